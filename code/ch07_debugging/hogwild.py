"""Hogwild! (lock-free asynchronous SGD in shared memory) vs synchronous SGD; what staleness costs.

    PYTHONPATH=code python code/ch07_debugging/hogwild.py --json build/ch07/hogwild.json
    PYTHONPATH=code python code/ch07_debugging/hogwild.py --workers 4 --taus 0,1,4,16 --lrs 0.05,0.5

One machine, no torchrun, no process group: Hogwild's workers share memory, not messages.
Part 1 runs it for real (Recht et al. 2011; PyTorch's examples/mnist_hogwild does the same): the
parent puts ONE model in shared memory (model.share_memory()) and starts --workers processes
with torch.multiprocessing. Each reads the weights, computes a gradient on its own data and
writes its SGD update into the shared weights with no lock. Updates race, and gradients are
stale: by the time one is written, the other workers have changed the weights it was computed
on. Beside it, synchronous data parallelism: each step averages the workers' gradients, and
every worker applies that one update to the same weights. It is simulated in this process,
exactly: the mean of W gradients, each over B samples, is the gradient over the W*B samples
together (checked every step), which is what DDP's all-reduce gives (chapter 01). Per sample,
Hogwild makes W times as many updates (of B samples each) as synchronous SGD (of W*B samples),
at the same learning rate. A third run, "serial", takes the workers' batches in turns in one
process: Hogwild if its workers never overlapped. The OS interleaves the workers, so Hogwild's
curve changes from run to run: only robust facts are printed; the curves go to --json.
Start method "spawn": a fresh interpreter per worker (about 1 s of torch import each), the
default on macOS and Windows and safe everywhere, unlike "fork" of a parent that may hold
threads; it imports this file again, so everything runs under `if __name__ == "__main__"`.
Everything runs on the CPU, GPU or not: Hogwild is a CPU technique.

Part 2 makes staleness deterministic: one process runs SGD whose update at step t uses the
gradient computed at the weights of step t - tau (asynchronous SGD with a fixed delay; tau = 0
is plain SGD, checked bit for bit against the ordinary loop). The larger tau, the smaller the
stable learning rate: for a quadratic f(w) = h w^2 / 2 the delayed iteration
w_{t+1} = w_t - lr h w_{t-tau} converges iff lr h < 2 sin(pi / (2 (2 tau + 1))) (Levin & May
1976), about pi / (2 tau + 1) for large tau: it shrinks like 1 / tau (2, 1, 0.35, 0.095 for
tau = 0, 1, 4, 16).

Hogwild's convergence guarantee assumes sparse updates (each step touches few coordinates, so
workers rarely collide): CPUs, sparse models. Dense models on GPUs train with synchronous data
parallelism (DDP, FSDP: chapters 01 and 04), where no gradient is stale. Staleness comes back
with asynchronous pipeline schedules: PipeDream's weight stashing (chapter 02) keeps each
micro-batch's forward and backward on one version of the weights.
"""
import argparse
import copy
import math
import threading
import time
from collections import deque

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from distkit import int_list, seed_everything, write_json

FEATURES, CLASSES, HIDDEN = 16, 10, 32
HELD_OUT = 1024       # held-out samples, the same for every run
LEARNED = 0.5         # "learned": held-out loss below this (from ln(10) = 2.30 at the start)
DIVERGED = 10 * math.log(CLASSES)  # a loss above this (or not finite): the run blew up


# --- the problem: a mixture of Gaussians, one per class, and a small MLP ---------------------

def class_means() -> torch.Tensor:
    return torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(0))


def sample(means: torch.Tensor, g: torch.Generator, n: int):
    """n fresh samples: a class, then a point around its mean (the Bayes loss is about 0.15)."""
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return means[y] + torch.randn(n, FEATURES, generator=g), y


def held_out(means: torch.Tensor):
    return sample(means, torch.Generator().manual_seed(999), HELD_OUT)


def worker_stream(rank: int) -> torch.Generator:
    """Worker `rank`'s own data: every run below draws worker r's batches in the same order."""
    return torch.Generator().manual_seed(1000 + rank)


def make_model() -> nn.Module:
    seed_everything(0)  # every run starts from the same weights
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


@torch.no_grad()
def sgd_step(model: nn.Module, lr: float) -> None:
    """SGD without momentum, written out: what torch.optim.SGD does on the CPU (param.add_(grad,
    alpha=-lr)), without its first-use import of torch._dynamo (~1 s of CPU per process)."""
    for p in model.parameters():
        p.add_(p.grad, alpha=-lr)


@torch.no_grad()
def loss_on(model: nn.Module, data) -> float:
    x, y = data
    return F.cross_entropy(model(x), y).item()


# --- part 1: Hogwild for real, next to synchronous and serial SGD ----------------------------

def hogwild_worker(rank, model, steps, batch, lr, eval_every, barrier, updates, log, curve,
                   seconds):
    """One Hogwild worker, in its own process: plain SGD on its own data, written into the
    shared model with no lock. `updates` (a counter with its lock), `log`, `curve` and `seconds`
    (shared tensors) are for the measurements only: the model's weights are never locked."""
    torch.set_num_threads(1)  # one core per worker: W workers on W cores, none oversubscribed
    means = class_means()
    data, test = worker_stream(rank), held_out(means)
    barrier.wait(timeout=60)  # all together, once the parent has done its own runs
    start = time.perf_counter()
    for step in range(steps):
        if rank == 0 and step % eval_every == 0:  # on the weights as they are right now
            curve[step // eval_every] = torch.tensor([updates.value * batch,
                                                      loss_on(model, test)])
        seen = updates.value  # updates in the weights we are about to read (about)
        x, y = sample(means, data, batch)
        model.zero_grad()  # .grad is this process's own: only the weights are shared
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        sgd_step(model, lr)  # p -= lr * grad, in place in shared memory, racing the others
        with updates.get_lock():
            updates.value += 1
            done = updates.value
        # staleness: other workers' updates written between our read and our write
        log[rank, step] = torch.tensor([done, done - 1 - seen, loss.item()])
    seconds[rank] = time.perf_counter() - start


def start_hogwild(args) -> dict:
    """Put one model in shared memory and start the workers; they wait at `barrier`."""
    model = make_model()
    model.share_memory()  # the weights move to shared memory; each worker maps the same pages
    ctx = mp.get_context("spawn")  # the default on macOS and Windows; safe with threads on Linux
    n_eval = -(-args.steps // args.eval_every)
    shared = {"model": model, "barrier": ctx.Barrier(args.workers + 1),  # + 1: this process
              "updates": ctx.Value("i", 0),
              "log": torch.zeros(args.workers, args.steps, 3, dtype=torch.float64).share_memory_(),
              "curve": torch.full((n_eval, 2), torch.nan, dtype=torch.float64).share_memory_(),
              "seconds": torch.zeros(args.workers, dtype=torch.float64).share_memory_()}
    shared["workers"] = [ctx.Process(target=hogwild_worker, daemon=True, args=(
        r, model, args.steps, args.batch, args.lr, args.eval_every, shared["barrier"],
        shared["updates"], shared["log"], shared["curve"], shared["seconds"]))
        for r in range(args.workers)]
    for p in shared["workers"]:
        p.start()  # each imports torch and this file (~1 s), then waits at the barrier
    return shared


def finish_hogwild(shared: dict, args, means) -> dict:
    """Release the workers, wait for them, and read what they measured."""
    try:
        shared["barrier"].wait(timeout=60)  # now the workers have the cores to themselves
    except threading.BrokenBarrierError:
        pass  # a worker failed before it got there: reported below
    workers = shared["workers"]
    for p in workers:
        p.join(timeout=60)
    failed = [r for r, p in enumerate(workers) if p.exitcode != 0]
    if failed:  # (daemon processes: any still alive end with this one)
        raise SystemExit(f"hogwild.py: Hogwild worker(s) {failed} failed (see above)")
    updates, log, curve = shared["updates"].value, shared["log"], shared["curve"]
    samples = [c[0] for c in curve.tolist()] + [updates * args.batch]
    losses = [c[1] for c in curve.tolist()] + [loss_on(shared["model"], held_out(means))]
    staleness = log[:, :, 1].long().flatten()
    return {"samples": samples, "heldout_loss": losses, "updates": updates,
            "staleness_mean": staleness.double().mean().item(),
            "staleness_max": staleness.max().item(),
            "staleness_counts": torch.bincount(staleness).tolist(),
            "worker_samples": (log[:, :, 0] * args.batch).tolist(),
            "worker_batch_loss": log[:, :, 2].tolist(),
            "train_s": shared["seconds"].tolist()}


def run_synchronous(args, means) -> dict:
    """Data-parallel SGD, simulated exactly: each step averages the workers' gradients (what an
    all-reduce divided by W gives), then applies one update that every worker would apply."""
    model, test = make_model(), held_out(means)
    streams = [worker_stream(r) for r in range(args.workers)]
    samples, losses, max_diff = [], [], 0.0
    for step in range(args.steps):
        if step % args.eval_every == 0:
            samples.append(step * args.workers * args.batch)
            losses.append(loss_on(model, test))
        batches = [sample(means, g, args.batch) for g in streams]
        grads = []
        for x, y in batches:  # worker r's backward, on worker r's batch
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        mean = [torch.stack(g).mean(0) for g in zip(*grads)]
        model.zero_grad()  # the check: one backward over the concatenated batch
        x, y = (torch.cat(t) for t in zip(*batches))
        F.cross_entropy(model(x), y).backward()
        max_diff = max(max_diff, *((p.grad - m).abs().max().item()
                                   for p, m in zip(model.parameters(), mean)))
        for p, m in zip(model.parameters(), mean):
            p.grad = m
        sgd_step(model, args.lr)
    samples.append(args.steps * args.workers * args.batch)
    losses.append(loss_on(model, test))
    return {"samples": samples, "heldout_loss": losses, "updates": args.steps,
            "max_grad_diff": max_diff}


def run_serial(args, means) -> dict:
    """One process takes the workers' batches in turns (r = 0, 1, ..., 0, 1, ...): Hogwild's
    updates in one of the orders it may write them, with no overlap and so no staleness."""
    model, test = make_model(), held_out(means)
    streams = [worker_stream(r) for r in range(args.workers)]
    samples, losses = [], []
    for step in range(args.steps):
        if step % args.eval_every == 0:
            samples.append(step * args.workers * args.batch)
            losses.append(loss_on(model, test))
        for g in streams:
            x, y = sample(means, g, args.batch)
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            sgd_step(model, args.lr)
    samples.append(args.steps * args.workers * args.batch)
    losses.append(loss_on(model, test))
    return {"samples": samples, "heldout_loss": losses, "updates": args.steps * args.workers}


# --- part 2: a fixed staleness tau, deterministic --------------------------------------------

def stale_sgd(tau: int, lr: float, steps: int, batch: int, means, test) -> list[float]:
    """SGD whose update at step t is lr times the gradient at the weights of step t - tau (of
    step 0 while t < tau). Returns the held-out loss at every step's weights, up to the step
    where it blows up."""
    model = make_model()
    reader = copy.deepcopy(model)  # where the stale gradient is computed
    history = deque([[p.detach().clone() for p in model.parameters()]], maxlen=tau + 1)
    data, losses = worker_stream(0), []
    for _ in range(steps):
        losses.append(loss_on(model, test))
        if not losses[-1] < DIVERGED:  # also catches nan
            break
        x, y = sample(means, data, batch)
        with torch.no_grad():  # history[0]: the weights of step t - tau
            for q, w in zip(reader.parameters(), history[0]):
                q.copy_(w)
        reader.zero_grad()
        F.cross_entropy(reader(x), y).backward()
        for p, q in zip(model.parameters(), reader.parameters()):
            p.grad = q.grad
        sgd_step(model, lr)  # applied to the current weights, step t's
        history.append([p.detach().clone() for p in model.parameters()])
    return losses


def plain_sgd(lr: float, steps: int, batch: int, means, test) -> list[float]:
    """The reference for tau = 0: the ordinary training loop."""
    model = make_model()
    data, losses = worker_stream(0), []
    for _ in range(steps):
        losses.append(loss_on(model, test))
        if not losses[-1] < DIVERGED:
            break
        x, y = sample(means, data, batch)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        sgd_step(model, lr)
    return losses


def quadratic_bound(tau: int) -> float:
    """The largest stable lr*h of w_{t+1} = w_t - lr h w_{t-tau} (Levin & May 1976)."""
    return 2 * math.sin(math.pi / (2 * (2 * tau + 1)))


def quadratic_final(tau: int, a: float) -> float:
    """|w| after 300 (tau + 1) steps of w_{t+1} = w_t - a w_{t-tau}, from w = 1 (its history
    too): the larger tau, the slower it converges or diverges near the bound."""
    w = deque([1.0] * (tau + 1), maxlen=tau + 1)
    for _ in range(300 * (tau + 1)):
        w.append(w[-1] - a * w[0])
        if abs(w[-1]) > 1e6:
            break
    return abs(w[-1])


def run_staleness(args, means) -> dict:
    """Part 2: every (lr, tau) run, the check of tau = 0, and the quadratic's stability bounds."""
    test, runs = held_out(means), []
    for lr in args.lrs:
        for tau in args.taus:
            losses = stale_sgd(tau, lr, args.stale_steps, args.batch, means, test)
            runs.append({"tau": tau, "lr": lr, "loss": losses,
                         "diverged": not losses[-1] < DIVERGED, "learned": losses[-1] < LEARNED})
    tau0_is_sgd = all(r["loss"] == plain_sgd(r["lr"], args.stale_steps, args.batch, means, test)
                      for r in runs if r["tau"] == 0)
    quadratic = [{"tau": tau, "bound": quadratic_bound(tau),
                  "converges_at_0.9": quadratic_final(tau, 0.9 * quadratic_bound(tau)) < 1e-3,
                  "diverges_at_1.1": quadratic_final(tau, 1.1 * quadratic_bound(tau)) > 1e3}
                 for tau in args.taus]
    return {"steps": args.stale_steps, "batch": args.batch, "runs": runs,
            "tau0_is_sgd": tau0_is_sgd, "quadratic": quadratic}


def report_part1(args, runs: dict) -> None:
    """Only what holds in every interleaving of the workers (the curves are in the JSON)."""
    samples = args.workers * args.steps * args.batch
    print(f"part 1: Hogwild, {args.workers} worker process(es) sharing one model with no lock "
          f"(spawn), vs synchronous SGD (simulated here), lr {args.lr}")
    print(f"  samples per run: {args.workers} x {args.steps} steps x {args.batch} = {samples}")
    print(f"  updates: Hogwild {runs['hogwild']['updates']} (of batch {args.batch}), "
          f"synchronous {runs['synchronous']['updates']} (of batch {args.workers * args.batch}), "
          f"serial {runs['serial']['updates']}")
    print(f"  synchronous: mean of the workers' gradients == gradient of the concatenated batch, "
          f"max diff < 1e-6: {runs['synchronous']['max_grad_diff'] < 1e-6}")
    start = runs["serial"]["heldout_loss"][0]
    print(f"  held-out loss at the start within 0.3 of ln({CLASSES}) = {math.log(CLASSES):.2f}: "
          f"{abs(start - math.log(CLASSES)) < 0.3}")
    print(f"  held-out loss at the end < {LEARNED}: " + ", ".join(
        f"{name} {r['heldout_loss'][-1] < LEARNED}" for name, r in runs.items()))


def report_part2(args, part2: dict) -> None:
    print(f"part 2: SGD with gradients tau steps stale, one process, seeded, "
          f"{args.stale_steps} steps of {args.batch} samples")
    print(f"  tau=0 is plain SGD, every held-out loss bit for bit: {part2['tau0_is_sgd']}")
    print(f"  {'lr':>5} {'tau':>4}  diverged (loss > {DIVERGED:.0f})  held-out loss < {LEARNED}")
    for r in part2["runs"]:
        print(f"  {r['lr']:>5g} {r['tau']:>4}  {str(r['diverged']):<21}  {r['learned']}")
    print("  quadratic h w^2/2, w_{t+1} = w_t - lr h w_{t-tau}: stable iff "
          "lr h < 2 sin(pi / (2 (2 tau + 1))) ~ pi / (2 tau + 1)")
    print(f"  {'tau':>4}  {'bound':>6}  {'pi/(2tau+1)':>11}  converges at 0.9x  diverges at 1.1x")
    for q in part2["quadratic"]:
        print(f"  {q['tau']:>4}  {q['bound']:>6.3f}  {math.pi / (2 * q['tau'] + 1):>11.3f}  "
              f"{str(q['converges_at_0.9']):<17}  {q['diverges_at_1.1']}")


def float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="Hogwild processes (part 1)")
    parser.add_argument("--steps", type=int, default=200, help="SGD steps per worker (part 1)")
    parser.add_argument("--batch", type=int, default=32, help="samples per gradient")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate of part 1")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between held-out losses")
    parser.add_argument("--taus", type=int_list, default=[0, 1, 4, 16],
                        help="staleness values of part 2, comma-separated, with 0 (the reference)")
    parser.add_argument("--lrs", type=float_list, default=[0.05, 0.5],
                        help="learning rates of part 2, comma-separated")
    parser.add_argument("--stale-steps", type=int, default=200, help="SGD steps of part 2")
    parser.add_argument("--json", help="write the curves and checks here")
    args = parser.parse_args()
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    if min(args.steps, args.batch, args.eval_every, args.stale_steps) < 1:
        parser.error("--steps, --batch, --eval-every and --stale-steps must be at least 1")
    if not args.taus or min(args.taus) < 0 or 0 not in args.taus:
        parser.error(f"--taus needs non-negative delays including 0 (the reference), "
                     f"got {args.taus}")
    if not all(lr > 0 for lr in [args.lr, *args.lrs]) or not args.lrs:
        parser.error(f"learning rates must be positive, got --lr {args.lr} --lrs {args.lrs}")
    torch.set_num_threads(1)  # this process too: same numbers whatever the machine's cores
    means = class_means()

    # Part 1's workers import torch (a second or so) while this process does its own runs;
    # then they train, on cores of their own.
    hogwild = start_hogwild(args)
    runs = {"synchronous": run_synchronous(args, means), "serial": run_serial(args, means)}
    part2 = run_staleness(args, means)
    runs = {"hogwild": finish_hogwild(hogwild, args, means), **runs}
    report_part1(args, runs)
    report_part2(args, part2)
    write_json(args.json, {"workers": args.workers, "steps": args.steps, "batch": args.batch,
                           "lr": args.lr, "eval_every": args.eval_every,
                           "ln_classes": math.log(CLASSES), "learned_below": LEARNED,
                           "diverged_above": DIVERGED, "part1": runs, "part2": part2})


if __name__ == "__main__":  # spawn re-imports this file in every worker: nothing may run there
    main()
