# Yours to fill in (generated from ../solutions/ex08_fewest_gpus.py).
"""Exercise 08.1: the fewest GPUs that train a Llama at a sequence length, and with which settings.

    PYTHONPATH=code python code/ch08_plan/exercises/ex08_fewest_gpus.py --model 70b --seq 8192

Solution: ../solutions/ex08_fewest_gpus.py

Notebook 08's question 1 as a function you can point at your own model and GPU: search whole
nodes of GPUs, tensor-parallel degrees inside a node and checkpointing modes for the smallest
GPU count on which the step fits. A step fits when what the GPU must hold, not only what torch
allocates, fits its memory: distkit.speed.peak_bytes gives the allocated peak (llama_training_bytes
or CUDA AdamW's step), distkit.plan.fits adds the caching allocator's reserve and the CUDA context
(the course's measured rule) and compares with the GPU's memory as nvidia-smi reports it. Among
settings with the same count, prefer less tensor parallelism (its all-reduces sit in every
layer's critical path), then less recomputation (none, selective, full: each costs compute).

Predict, then measure:
1. 70B at 8,192 tokens on 80 GB H100s (nvidia-smi: 81,559 MiB = 79.6 GiB, the default): how many
   GPUs, which settings?
2. The same on 141 GB H200s (--gpu-gib 140.4: nvidia-smi's 143,771 MiB): fewer GPUs, and is full
   checkpointing still needed?
3. 8B at 32,768 tokens: which term of the peak decides, model states or activations?
"""
import argparse
import json

from distkit import todo
from distkit.memory import LLAMA_CONFIGS
from distkit.plan import fits, reserved_bytes
from distkit.speed import peak_bytes

GiB = 2**30
TP_DEGREES = (1, 2, 4, 8)                 # inside one node of 8
CHECKPOINTING = ("none", "selective", "full")  # in order of recomputation


def fewest_gpus(config, seq: int, gpu_gib: float, per_node: int = 8, max_gpus: int = 4096):
    """(gpus, tp, ac) for the smallest multiple of `per_node` GPUs, up to max_gpus, on which
    some tp in TP_DEGREES and ac in CHECKPOINTING fit a GPU of `gpu_gib` GiB (the allocated peak,
    peak_bytes, through distkit.plan.fits; ties: the smaller tp, then the earlier ac); None when
    nothing fits."""
    # TODO(you): The answer is the first setting that fits when you try GPU counts from small to
    # large and, for each, the preferred settings first; tp must divide the GPU count.
    todo("search GPU counts, tensor-parallel degrees and checkpointing modes")


parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--model", choices=sorted(LLAMA_CONFIGS), default="70b")
parser.add_argument("--seq", type=int, default=8192, help="tokens per sequence (one per GPU)")
parser.add_argument("--gpu-gib", type=float, default=79.6,
                    help="the GPU's memory as nvidia-smi reports it, in GiB (default: an 80 GB "
                    "H100's 81,559 MiB)")
parser.add_argument("--sweep", action="store_true",
                    help="answer every model at 2,048, 8,192 and 32,768 tokens on 80 GB H100s "
                    "and 141 GB H200s instead (the table the checker compares)")
parser.add_argument("--max-gpus", type=int, default=4096,
                    help="search up to this many GPUs (default 4096; a multiple of 8)")
parser.add_argument("--json", help="write the answer(s) here")
args = parser.parse_args()
if args.seq < 2 or args.gpu_gib <= 0 or args.max_gpus < 8 or args.max_gpus % 8:
    parser.error("need --seq >= 2, --gpu-gib > 0 and --max-gpus a positive multiple of 8")
# GPU memory as nvidia-smi reports it: an 80 GB H100 (81,559 MiB), a 141 GB H200 (143,771 MiB)
cases = [(model, seq, gib) for model in sorted(LLAMA_CONFIGS) for seq in (2048, 8192, 32768)
         for gib in (81559 / 1024, 143771 / 1024)] if args.sweep else \
    [(args.model, args.seq, args.gpu_gib)]
answers = []
for model, seq, gib in cases:
    config = LLAMA_CONFIGS[model]
    answer = fewest_gpus(config, seq, gib, max_gpus=args.max_gpus)
    answers.append([model, seq, gib, answer])
    if answer is None:
        print(f"{model} at {seq} tokens fits no setting up to {args.max_gpus} GPUs of "
              f"{gib:.1f} GiB")
        continue
    gpus, tp, ac = answer
    peak = peak_bytes(config, gpus=gpus, seq=seq, tp=tp, ac=ac)
    print(f"{model} at {seq} tokens: {gpus} GPUs, tensor parallel {tp}, "
          f"checkpointing {ac}: {peak / GiB:.1f} GiB allocated, "
          f"{reserved_bytes(peak) / GiB:.1f} reserved-equivalent of {gib:.1f} per GPU")
if args.json:
    with open(args.json, "w") as f:
        json.dump({"model": args.model, "seq": args.seq, "gpu_gib": args.gpu_gib,
                   "answer": answers[0][3], "answers": answers}, f)
