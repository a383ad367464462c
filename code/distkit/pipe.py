"""Pipeline plumbing for chapter 02: a Llama cut into stages, its loss, and a stopwatch per stage.

A stage is a contiguous slice of a transformers LlamaForCausalLM's decoder layers; the first
stage also holds the token embedding, the last one the final norm and the LM head. Every stage
takes one tensor and returns one (token ids -> hidden states -> ... -> logits), which is what
torch.distributed.pipelining's PipelineStage expects of a stage module.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def split_layers(num_layers: int, sizes: list[int] | int) -> list[tuple[int, int]]:
    """[first, last) layer indices per stage: `sizes` layers each, or `sizes` equal parts."""
    if isinstance(sizes, int):
        if sizes < 1 or num_layers % sizes:
            raise ValueError(f"{num_layers} layers do not split evenly into {sizes} stages")
        sizes = [num_layers // sizes] * sizes
    if sum(sizes) != num_layers or min(sizes) < 1:
        raise ValueError(f"stage sizes {sizes} must be >= 1 and add up to {num_layers} layers")
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    return [(end - size, end) for size, end in zip(sizes, ends)]


class LlamaStage(nn.Module):
    """Layers [first, last) of a LlamaForCausalLM, as one pipeline stage.

    The modules are the model's own (not copies), so a stage starts from the model's weights.
    Position embeddings (rotary cos/sin) carry no weights: every stage computes them itself.
    attention_mask=None lets transformers' SDPA attention use its causal kernel, as the full
    model does for unpadded sequences.
    """

    def __init__(self, model, first: int, last: int):
        super().__init__()
        n = model.config.num_hidden_layers
        self.embed = model.model.embed_tokens if first == 0 else None
        self.layers = nn.ModuleList(model.model.layers[first:last])
        self.rotary = model.model.rotary_emb
        self.norm = model.model.norm if last == n else None
        self.head = model.lm_head if last == n else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        cos_sin = self.rotary(h, positions)
        for layer in self.layers:
            h = layer(h, position_embeddings=cos_sin)
        return self.head(self.norm(h)) if self.head is not None else h


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of every next token, as LlamaForCausalLM(labels=tokens).loss."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


class Timeline:
    """When this process computes: (kind, micro-batch, start s, end s) spans, for timelines.

    Every rank reads the same clock: time.time(), which all processes on one machine share
    (and NTP keeps within a millisecond or so across machines), counted from rank 0's `start()`.
    Each rank's own clock after a barrier would not do: ranks leave a barrier up to several
    milliseconds apart (measured here on CPU/gloo), which would shift whole timelines.
    On a GPU, kernels run after the Python call that queues them returns, so a span is timed
    with CUDA events recorded on the current stream at its start and end: they mark when the
    GPU reached that point, without making the CPU wait (torch.cuda.synchronize around every
    span would serialise the host with the device, and would also wait for the NCCL kernels of
    the sends and receives, on their own stream). A recv's wait() makes the compute stream wait
    for the NCCL stream, so a span's start event fires when its input has arrived. `gather()`
    synchronises once and turns the events into seconds on the shared clock, from an event
    recorded at `start()` while the GPU was idle.
    """

    def __init__(self, cuda: bool = False):
        self.cuda = cuda
        self.t0 = time.time()
        self.spans: list[tuple[str, int, float, float]] = []
        self.pending: list[tuple] = []  # CUDA: (kind, micro-batch, start event, end event)

    def start(self) -> None:
        box = [time.time()]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)  # also a barrier: nobody starts before rank 0
        self.t0 = box[0]
        self.spans, self.pending = [], []
        if self.cuda:  # the GPU's clock, pinned to the shared one while the GPU is idle
            torch.cuda.synchronize()
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record()
            self.ref_s = time.time() - self.t0

    @contextmanager
    def span(self, kind: str, microbatch: int = 0):
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            try:
                yield
            finally:
                end.record()
                self.pending.append((kind, microbatch, begin, end))
            return
        begin = time.time()
        try:
            yield
        finally:
            self.spans.append((kind, microbatch, begin - self.t0, time.time() - self.t0))

    def gather(self) -> list[list[tuple]] | None:
        """Every rank's spans, on rank 0 (None elsewhere). Collective: all ranks call it."""
        if self.cuda:
            torch.cuda.synchronize()  # every event has fired: their times can be read
            at = lambda event: self.ref_s + self.ref.elapsed_time(event) / 1e3  # ms -> s
            self.spans += [(kind, mb, at(b), at(e)) for kind, mb, b, e in self.pending]
            self.pending = []
        spans = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(self.spans, spans, dst=0)
        return spans


def idle_fractions(spans_per_rank: list[list[tuple]]) -> list[float]:
    """Per rank: the fraction of the run (first start to last end, over all ranks) it was not
    inside a span. Spans of one rank never overlap (a process computes one thing at a time)."""
    begin = min(s[2] for spans in spans_per_rank for s in spans)
    end = max(s[3] for spans in spans_per_rank for s in spans)
    return [1 - sum(s[3] - s[2] for s in spans) / (end - begin) for spans in spans_per_rank]


def timed_stage(stage_cls, timeline: Timeline):
    """A subclass of a pipelining stage class whose forward and backward chunks are timed.

    The schedules call forward_one_chunk / backward_one_chunk for the computation only (their
    sends and receives happen around them), so the spans are pure compute and the gaps between
    them are the waiting: the bubble, plus communication.
    """

    class Timed(stage_cls):
        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            with timeline.span("F", fwd_chunk_id):
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
            with timeline.span("B", bwd_chunk_id):
                return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    Timed.__name__ = f"Timed{stage_cls.__name__}"
    return Timed


class SavedActivations:
    """Bytes autograd keeps for the backward pass (the activations): now, and at the peak.

    Inside `with SavedActivations(module):`, torch.autograd.graph.saved_tensors_hooks sees every
    tensor the forward saves for the backward. Each is counted by its storage (the memory it
    really holds; views of one storage count once) until autograd frees it, which is when the
    backward has used it. Parameters are not activations: tensors in their storages are skipped.
    (torch's MemTracker would sort memory into such categories too, but it refuses a module
    that runs more than once per step, as a pipeline stage does once per micro-batch.)
    """

    def __init__(self, module: nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.refs: dict[int, int] = {}  # storage pointer -> saved tensors holding it
        self.now = self.peak = 0

    class _Saved:  # what autograd keeps instead of the tensor; its death frees the count
        def __init__(self, owner, tensor, ptr, nbytes):
            self.owner, self.tensor, self.ptr, self.nbytes = owner, tensor, ptr, nbytes

        def __del__(self):
            self.owner._release(self.ptr, self.nbytes)

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.params or storage.nbytes() == 0:
            return tensor
        if self.refs.get(ptr, 0) == 0:
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        return self._Saved(self, tensor, ptr, storage.nbytes())

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, SavedActivations._Saved) else saved

    def _release(self, ptr, nbytes):
        self.refs[ptr] -= 1
        if self.refs[ptr] == 0:
            del self.refs[ptr]
            self.now -= nbytes

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def idle_breakdown(spans_per_rank: list[list[tuple]]) -> list[dict]:
    """Per rank, its idle time split by what it waited for, as fractions of the run:

    - "wait_compute": waiting for work that another stage had not finished yet (forward i needs
      stage r-1's forward i; backward i needs stage r+1's backward i), and, after its last
      span, for the other stages to finish. The bubble of the formula (p-1)/(m+p-1) is waiting
      of this kind, but this also holds delays passed on from upstream (a stage that waited for
      a transfer finishes later, and its successor waits for it as for compute), so it is not
      the formula's bubble alone.
    - "wait_transfer": the rest: waiting after the needed work was done, while the result
      travelled (send, receive, waking up), and gaps with no producer (the schedule's own
      bookkeeping, waiting for a send to complete).
    """
    begin = min(s[2] for spans in spans_per_rank for s in spans)
    end = max(s[3] for spans in spans_per_rank for s in spans)
    done = {(r, kind, mb): stop for r, spans in enumerate(spans_per_rank)
            for kind, mb, _, stop in spans}
    last = len(spans_per_rank) - 1
    out = []
    for r, spans in enumerate(spans_per_rank):
        bubble = transfer = 0.0
        prev = begin
        for kind, mb, start, stop in spans:
            producer = {"F": (r - 1, "F", mb), "B": (r + 1, "B", mb)}.get(kind)
            ready = done.get(producer) if producer and 0 <= producer[0] <= last else None
            wait = max(0.0, start - prev)
            moving = wait if ready is None else min(wait, max(0.0, start - max(prev, ready)))
            transfer += moving
            bubble += wait - moving
            prev = max(prev, stop)
        bubble += end - prev  # drained: nothing left to do on this stage
        out.append({"wait_compute": bubble / (end - begin),
                    "wait_transfer": transfer / (end - begin)})
    return out
