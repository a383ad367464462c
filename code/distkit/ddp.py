"""Watching DDP communicate: a comm hook that all-reduces exactly like DDP's default one and
records, for every gradient bucket, its size and when its all-reduce started and finished."""
from __future__ import annotations

import time

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


class CommLog:
    """Attach with `CommLog.attach(ddp_model)`; read `summary(ddp_model)` after training.

    DDP calls the hook once all of a bucket's gradients are computed (and every bucket before
    it has been launched: buckets go out in a fixed order, the same on every rank), while
    backward is still running for earlier layers: that is the overlap of communication and
    computation.

    The times are host clocks (time.perf_counter), right for CPU/gloo, where a collective runs on
    gloo's threads and finishes when its future does. On CUDA/NCCL they are not: the hook only
    *launches* the all-reduce on NCCL's stream, and torch's Future.then docstring warns that the
    callback "might be invoked while the async kernels ... haven't yet finished", while the
    end-of-backward callback marks when backward's kernels were queued. The figures would show
    near-zero communication, ~100 % hidden. On a GPU read the overlap off a torch.profiler
    trace (activities CPU + CUDA: the nccl AllReduce kernels on their own stream next to
    backward's kernels), or time with CUDA events.
    """

    def __init__(self):
        self.t0 = time.perf_counter()
        self.backwards = []  # [start, end] of every backward pass, seconds since t0
        self.calls = []      # one dict per all-reduce

    @classmethod
    def attach(cls, ddp_model) -> "CommLog":
        log = cls()
        ddp_model.register_comm_hook(log, cls._hook)
        ddp_model.module.register_forward_hook(log._watch_output)
        return log

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    def _watch_output(self, module, args, output):
        # The first gradient computed in backward is the output's: hook it to see backward start.
        values = output.values() if isinstance(output, dict) else (
            output if isinstance(output, (tuple, list)) else [output])
        first = next((t for t in values if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if first is not None:
            first.register_hook(self._backward_started)

    def _backward_started(self, grad):
        self.backwards.append([self._now(), None])
        end = self.backwards[-1]
        # Autograd runs queued callbacks in order once backward's computation is done. Ours is
        # queued now, before the one DDP's reducer queues when its last bucket is ready
        # (finalize_backward, which waits for every bucket's all-reduce: reducer.cpp,
        # Reducer::mark_variable_ready). So `end` marks the end of backward's *computation*;
        # communication still running then is time loss.backward() spends waiting.
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: end.__setitem__(1, self._now()))

    @staticmethod
    def _hook(log: "CommLog", bucket):
        call = {"backward": len(log.backwards) - 1, "bucket": bucket.index(),
                "bytes": bucket.buffer().numel() * bucket.buffer().element_size(),
                "params": len(bucket.parameters()), "start": log._now()}
        log.calls.append(call)

        def finished(fut):
            call["end"] = log._now()
            return fut.value()

        return default_hooks.allreduce_hook(None, bucket).then(finished)

    def summary(self, ddp_model) -> dict:
        """Gradient bytes, every backward's [start, end] and every all-reduce, as JSON-able data."""
        grads = [p for p in ddp_model.parameters() if p.requires_grad]
        return {"grad_bytes": sum(p.numel() * p.element_size() for p in grads),
                "num_params": sum(p.numel() for p in grads),
                "backwards": self.backwards, "calls": self.calls}


def overlap(summary: dict, backward: int) -> dict:
    """How much of one backward's communication hid under its computation (seconds).

    comm: time during which at least one all-reduce was in flight (the union of the calls'
    intervals); hidden: the part of it before backward's computation ended; exposed: from
    then until the last all-reduce finished, which loss.backward() spends waiting.
    Host-clock figures: meaningful on CPU/gloo only (see CommLog).
    """
    start, end = summary["backwards"][backward]
    spans = sorted((c["start"], c["end"]) for c in summary["calls"] if c["backward"] == backward)
    comm = hidden = 0.0
    cur_a, cur_b = spans[0]
    for a, b in spans[1:] + [(float("inf"), float("inf"))]:
        if a > cur_b:  # a gap: close the current busy interval
            comm += cur_b - cur_a
            hidden += max(0.0, min(cur_b, end) - cur_a)
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    exposed = max(0.0, max(b for _, b in spans) - end)
    return {"backward": end - start, "comm": comm, "hidden": hidden, "exposed": exposed,
            "calls": len(spans)}
