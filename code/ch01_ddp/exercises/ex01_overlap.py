# Yours to fill in (generated from ../solutions/ex01_overlap.py).
"""Exercise 01.2: overlap the gradient all-reduce with backward, by hand, as DDP does.

    code/run_w_torchrun.sh 2 ch01_ddp/exercises/ex01_overlap.py --times
    code/run_w_torchrun.sh 2 ch01_ddp/exercises/ex01_overlap.py --modes per-param   # one mode

Exercise 1 all-reduced the gradients after backward: `Flat` below, given. DDP does not wait: it
all-reduces gradients while backward is still computing those of earlier layers. Write the two
ways to do that:
(a) per-param: a hook on every parameter launches an async all_reduce of its gradient as soon
    as backward has produced it; after backward, wait for all of them and divide by N;
(b) bucketed: put the parameters, last layer's first, in buckets of about --bucket-mb MiB; when
    a bucket's last gradient is ready, flatten the bucket and launch one async all_reduce; after
    backward, wait, divide by N and copy the slices back into the gradients.
Fill in the TODO(you) parts, replacing each todo(...) call with your code. Run the script at any
time: it stops at the first todo() left and says what is missing; once none is left, it checks
every mode against one process on the global batch, counts your all_reduces and times them.
`make exercise EX=01.2` checks it at 2 and 3 ranks. Solution, with the answers to the
questions below: ../solutions/ex01_overlap.py.
After Stanford CS336 (2025), assignment 2: ddp_overlap_individual_parameters, ddp_overlap_bucketed.

Predict, then measure (--times; CPU/gloo wall-clock times vary: run it twice):
1. How many all_reduce calls per step in per-param mode for this model (21 parameter tensors)?
   In bucketed mode, with 394,496 gradient bytes and the default --bucket-mb 0.1?
2. How much communication will be left exposed after backward's computation in each mode, on 2
   CPU processes? Why might per-param be slower than flat here, although it overlaps? (Chapter
   00: every message costs a latency; and who runs gloo's threads on 2 cores?)
3. Which --bucket-mb makes bucketed behave like flat, and which like per-param?
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from distkit import print0, seed_everything, setup, teardown, todo, write_json
from distkit.toy import counting_data, tiny_llama

MODES = ("flat", "per-param", "bucketed")
# Against one process: float32 rounding differs (sums in another order), bugs differ by far more.
TOL = {"losses": 1e-5, "grads": 1e-5, "weights": 1e-4}
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--modes", default=",".join(MODES),
                    help="comma-separated, from: " + ", ".join(MODES))
parser.add_argument("--steps", type=int, default=8, help="training steps per mode (>= 2)")
parser.add_argument("--batch-size", type=int, default=8, help="sequences per step, per process")
parser.add_argument("--bucket-mb", type=float, default=0.1, help="bucket size in MiB (bucketed)")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--times", action="store_true",
                    help="also print the measured times (wall-clock: they vary run to run)")
parser.add_argument("--json", help="write losses, call counts and every timing here (rank 0)")
args = parser.parse_args()
modes = args.modes.split(",")
if not set(modes) <= set(MODES):
    parser.error(f"--modes: unknown {', '.join(sorted(set(modes) - set(MODES)))}; "
                 f"choose from {', '.join(MODES)}")
if args.steps < 2 or args.batch_size < 1 or not args.bucket_mb > 0:
    parser.error("need --steps >= 2, --batch-size >= 1 and --bucket-mb > 0")

env = setup()
N, b = env.world_size, args.batch_size
# Step s trains on the global batch of N*b sequences number s*N*b ... (s+1)*N*b - 1;
# rank r reads its b rows of it.
(tokens,) = counting_data(args.steps * N * b)[:]
batches = tokens.view(args.steps, N * b, -1).to(env.device)


def new_model():
    seed_everything(args.seed)  # the same weights on every rank and in every mode (no broadcast)
    model = tiny_llama().to(env.device)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def grad_vector(params) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in params])


# The reference: one process on the global batch. Every rank computes it (a tiny model).
model, optimizer = new_model()
single = {"losses": [], "grads": []}
for step in range(args.steps):
    loss = model(input_ids=batches[step], labels=batches[step]).loss
    loss.backward()
    single["grads"].append(grad_vector(model.parameters()))
    optimizer.step()
    optimizer.zero_grad()
    single["losses"].append(loss.item())
single["weights"] = parameters_to_vector(model.parameters()).detach().clone()


class Timeline:
    """Measurement: one step's all_reduces, in seconds since that step's backward started.

    Host clock. On CPU/gloo a Work's future completes when gloo's thread has finished the
    all_reduce. On CUDA/NCCL it completes once the all_reduce is queued on NCCL's stream (the GPU
    runs it later), so "done" would mean "queued": use torch.profiler there.
    """

    def __init__(self):
        self.start()

    def start(self):  # right before loss.backward()
        self.t0, self.calls, self.pending, self.works = time.perf_counter(), [], [], []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, work, tensor):
        """Record an all_reduce just launched: now, and when its Work completes."""
        call = {"launched": self.now(), "bytes": tensor.numel() * tensor.element_size()}
        self.calls.append(call)
        self.works.append(work)
        # runs on the backend's thread as soon as the all_reduce is done
        self.pending.append(work.get_future().then(lambda _: call.update(done=self.now())))

    def collect(self) -> list[dict]:
        torch.futures.wait_all(self.pending)  # every "done" time is written
        return self.calls


# The three ways to average gradients. Each has finish(), called right after loss.backward().
# dist.all_reduce(t, async_op=True) returns at once with a Work handle while the backend sums
# in the background; work.wait() blocks until t holds the sum. Wait before the optimizer reads
# the gradients.

class Flat:
    """Exercise 1's --flat: after backward, one all_reduce of every gradient, flattened."""

    def __init__(self, model, timeline):
        self.params, self.timeline = list(model.parameters()), timeline

    def finish(self):
        grads = [p.grad for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(flat, async_op=True)  # async only to time it like the others
        self.timeline.log(work, flat)
        work.wait()
        flat /= N  # sum -> mean
        for g, synced in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(synced.view_as(g))


class PerParam:
    """(a) One async all_reduce per parameter, launched the moment its gradient is ready."""

    def __init__(self, model, timeline):
        self.timeline, self.works = timeline, []
        # TODO(you): autograd must call self._ready(p) for every parameter p, once p.grad holds this
        # backward's whole gradient for it. Look up: Tensor.register_post_accumulate_grad_hook.
        todo("per-param: register self._ready as every parameter's grad hook")

    def _ready(self, p):
        # TODO(you): start summing p.grad over the ranks without waiting (backward goes on
        # meanwhile), hand the returned Work to self.timeline.log (the measurement) and keep it,
        # with p, for finish(). Look up: dist.all_reduce's async_op.
        todo("per-param: launch an async all_reduce of p.grad and keep its Work")

    def finish(self):
        # TODO(you): before the optimizer reads a gradient, its sum must have arrived (Work.wait)
        # and become the mean; leave self.works empty for the next step.
        todo("per-param: wait for every all_reduce, then divide the gradients by N")


class Bucketed:
    """(b) Parameters in buckets of about bucket_mb MiB; one async all_reduce per bucket,
    launched when the last gradient of the bucket is ready."""

    def __init__(self, model, timeline, bucket_mb):
        self.timeline, self.inflight = timeline, []
        # TODO(you): self.buckets: a list of buckets, each a list of parameters, every parameter in
        # exactly one. Fill them in roughly the order backward produces the gradients (the last
        # layer's first: the reverse of model.parameters()), so that the first bucket is complete
        # early; close a bucket once it holds at least bucket_mb MiB of gradient bytes
        # (Tensor.numel, Tensor.element_size).
        todo("bucketed: fill self.buckets, about --bucket-mb MiB each")
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.missing = [len(bucket) for bucket in self.buckets]  # gradients still to come
        # TODO(you): the same hooks as (a)'s, now that the buckets exist.
        todo("bucketed: hook every parameter, as in (a)")

    def _ready(self, p):
        # TODO(you): count p's gradient as arrived in its bucket (self.bucket_of, self.missing);
        # when it was the bucket's last, launch ONE async all_reduce of the bucket's gradients
        # flattened together, log its Work in self.timeline and keep (work, flat tensor, bucket
        # index) in self.inflight.
        todo("bucketed: once a bucket's last gradient is in, one async all_reduce")
        # Every rank runs the same graph, so buckets complete, and their all_reduces are
        # launched, in the same order on every rank: collectives are matched by order.

    def finish(self):
        # A parameter without a gradient (unused in forward) would leave its bucket waiting
        # forever: what DDP's find_unused_parameters=True is for.
        assert len(self.inflight) == len(self.buckets), "a bucket's all_reduce was never launched"
        # TODO(you): each bucket's averaged values must end up in its parameters' .grad (Flat above
        # does the same for one big tensor); then self.inflight and self.missing must be ready for
        # the next step.
        todo("bucketed: wait for every bucket, then copy the averaged slices back")


num_tensors = len(list(model.parameters()))
grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
print0(f"{num_tensors} parameter tensors, {grad_bytes:,} gradient bytes; {args.steps} steps per "
       f"mode on {N} processes x {b} sequences")
print0(f"same as one process x {N * b} sequences: max |diff| < {TOL['losses']:g} for losses and "
       f"gradients, < {TOL['weights']:g} for weights")
print0(f"{'mode':10} {'all_reduces/step':>16} {'bytes = gradients':>17} {'losses':>7} "
       f"{'grads':>6} {'weights':>8}")
results = {}
for mode in modes:
    model, optimizer = new_model()
    params = list(model.parameters())
    timeline = Timeline()
    if mode == "flat":
        sync = Flat(model, timeline)
    elif mode == "per-param":
        sync = PerParam(model, timeline)
    else:
        sync = Bucketed(model, timeline, args.bucket_mb)
    losses, grad_gaps, steps, scale = [], [], [], None
    for step in range(args.steps):
        mine = batches[step, env.rank * b:(env.rank + 1) * b]
        dist.barrier()  # measurement: every rank starts the step together
        loss = model(input_ids=mine, labels=mine).loss
        if step == 0 and env.rank == N - 1 and N > 1:
            # the check of finish(): the last rank starts step 1's backward late, so no other
            # rank's all_reduce can have completed when its finish() returns without waiting
            time.sleep(0.5)
        timeline.start()
        loss.backward()  # per-param, bucketed: the hooks launch all_reduces in here
        backward_end = timeline.now()  # computation done; all_reduces may still be running
        sync.finish()  # wait for the all_reduces; gradients are now averaged
        finished = timeline.now()
        waited = all(work.is_completed() for work in timeline.works)  # when finish() returned
        calls = timeline.collect()
        g, ref = grad_vector(params), single["grads"][step]
        grad_gaps.append((g - ref).abs().max().item())
        if scale is None:  # step 1's gradients over one process's (1: the mean; N: the sum)
            scale = (g @ ref / (ref @ ref)).item()
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)  # for the log: the mean over all ranks' sequences
        losses.append(loss.item() / N)
        steps.append({"backward_end": backward_end, "finished": finished, "calls": calls,
                      "waited": waited,
                      "exposed": max(0.0, max(c["done"] for c in calls) - backward_end)})
    r = results[mode] = {
        "losses": losses, "steps": steps,
        "calls_per_step": [len(s["calls"]) for s in steps],
        "bytes_per_step": [sum(c["bytes"] for c in s["calls"]) for s in steps],
        "max_loss_diff": max(abs(x - y) for x, y in zip(losses, single["losses"])),
        "max_grad_diff": max(grad_gaps), "grad_scale": scale,
        "max_weight_diff": (parameters_to_vector(params) - single["weights"]).abs().max().item(),
        # medians over steps 2.. (step 1 includes one-time warm-up costs)
        "backward_ms": 1e3 * statistics.median(s["backward_end"] for s in steps[1:]),
        "exposed_ms": 1e3 * statistics.median(s["exposed"] for s in steps[1:]),
    }
    counts = ",".join(map(str, sorted(set(r["calls_per_step"]))))
    exact = set(r["bytes_per_step"]) == {grad_bytes}
    print0(f"{mode:10} {counts:>16} {exact!s:>17} {r['max_loss_diff'] < TOL['losses']!s:>7} "
           f"{r['max_grad_diff'] < TOL['grads']!s:>6} {r['max_weight_diff'] < TOL['weights']!s:>8}")
    if mode == "bucketed":
        r["buckets"] = [sum(p.numel() * p.element_size() for p in bk) for bk in sync.buckets]
        r["bucket_tensors"] = [len(bk) for bk in sync.buckets]
        print0(f"{'':10} {len(r['buckets'])} bucket(s), last layer first: "
               f"{' + '.join(f'{x:,}' for x in r['buckets'])} bytes "
               f"({' + '.join(map(str, r['bucket_tensors']))} tensors)")

if args.times:
    print0(f"\nrank 0, ms since backward started, median of steps 2-{args.steps} "
           f"({env.device.type.upper()}/{env.backend} wall-clock: varies run to run)")
    print0(f"{'mode':10} {'backward ends':>13} {'launched during it':>18} {'last done':>9} "
           f"{'exposed':>8}")
    for mode, r in results.items():
        later = r["steps"][1:]
        during = statistics.median(sum(c["launched"] < s["backward_end"] for c in s["calls"])
                                   for s in later)
        last = 1e3 * statistics.median(max(c["done"] for c in s["calls"]) for s in later)
        launched = f"{during:g} of {len(later[0]['calls'])}"
        print0(f"{mode:10} {r['backward_ms']:13.1f} {launched:>18} {last:9.1f} "
               f"{r['exposed_ms']:8.1f}")
write_json(args.json, {"world_size": N, "backend": env.backend, "batch_size": b,
                       "steps": args.steps, "bucket_mb": args.bucket_mb,
                       "num_param_tensors": num_tensors, "grad_bytes": grad_bytes,
                       "single_losses": single["losses"], "modes": results})
teardown()
