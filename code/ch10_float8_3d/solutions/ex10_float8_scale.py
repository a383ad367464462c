"""Exercise 10.1: cast a tensor to float8 with its own scale, and measure what the cast loses.

    PYTHONPATH=code python code/ch10_float8_3d/exercises/ex10_float8_scale.py

Solution: ../solutions/ex10_float8_scale.py

Notebook 10's section 2 as code you write. `to_float8` maps a tensor into a float8 format: one
scale for the whole tensor (dim None), or one per slice along `dim`, chosen so that the largest
magnitude lands on the format's largest finite value; then it saturates and casts. The script
below feeds it the cases a real recipe meets (a gaussian tensor, a large negative outlier,
all zeros, a scale from an earlier step meeting larger gradients) and prints what comes back.
`make exercise EX=10.1` checks your numbers against torchao's rule (torchao/float8/
float8_utils.py: amax_to_scale, to_fp8_saturated), which distkit.fp8 follows.

Predict, then measure:
1. The relative error of a gaussian (64, 256) tensor's round trip through e4m3 (3 mantissa bits:
   a spacing of 2^-3 between 1 and 2) and through e5m2 (2 bits)?
2. Put -1e5 at row 0: the error of the other 63 rows with one scale for the tensor, and with one
   scale per row? What fraction of them becomes exactly 0?
3. An all-zero tensor: which scale, and what comes back?
"""
import argparse
import json

import torch

from distkit import todo

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12  # the smallest amax a scale is computed from (torchao's), so zeros give no inf


def to_float8(x: torch.Tensor, dtype: torch.dtype, dim: int | None = None,
              scale: torch.Tensor | None = None):
    """(x8, scale): scale = fp8_max / amax(|x|), over the whole tensor (dim None: a 0-dim tensor)
    or over `dim` (kept as a size-1 dimension, one scale per slice), in float32, unless a scale
    is given (one computed earlier: torchao's precomputed scales for FSDP; delayed scaling's
    amax history, deleted from torchao in 2025, pytorch/ao#1753); x8 = x x scale, saturated to
    [-fp8_max, fp8_max], cast to `dtype`. x8.float() / scale gives x back."""
    ### BEGIN SOLUTION: the scale from amax(|x|), then the saturated cast
    ### HINT torch.finfo(dtype).max is the largest finite value. An amax of 0 must not divide by
    ### HINT zero (EPS), and e5m2 turns values beyond its max into inf unless you clamp first.
    top = torch.finfo(dtype).max
    if scale is None:
        amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
        scale = (top / amax.double().clamp(min=EPS)).float()
    x8 = (x * scale).clamp(-top, top).to(dtype)
    return x8, scale
    ### END SOLUTION


def error(x8, scale, x, rows=slice(None)) -> float:
    """||x8 / scale - x|| / ||x|| over `rows`."""
    back = x8.float() / scale
    return ((back[rows] - x[rows]).norm() / x[rows].norm()).item()


parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--json", help="write the scales and errors here")
args = parser.parse_args()

g = torch.Generator().manual_seed(0)
x = torch.randn(64, 256, generator=g)
out = {}
for name, dtype in (("e4m3", E4M3), ("e5m2", E5M2)):
    x8, scale = to_float8(x, dtype)
    out[f"gaussian {name}"] = {"scale": scale.item(), "error": error(x8, scale, x)}
outlier = x.clone()
outlier[0, 7] = -1e5  # one large negative value, in row 0
rest = slice(1, None)  # the rows without it
x8, scale = to_float8(outlier, E4M3)
out["outlier per tensor"] = {"scale": scale.item(), "scale shape": list(scale.shape),
                             "error rest": error(x8, scale, outlier, rest),
                             "zeros rest": (x8[rest].float() == 0).float().mean().item()}
x8, scale = to_float8(outlier, E4M3, dim=1)
out["outlier per row"] = {"scale shape": list(scale.shape), "scale row 0": scale[0].item(),
                          "error rest": error(x8, scale, outlier, rest),
                          "zeros rest": (x8[rest].float() == 0).float().mean().item()}
# one scale per column (dim 0), e5m2: another dim, another format than the cases above
x8, scale = to_float8(outlier, E5M2, dim=0)
out["outlier per column e5m2"] = {
    "scale shape": list(scale.shape), "scale column 0": scale.reshape(-1)[0].item(),
    "error rest": error(x8, scale, outlier, rest)}
# a row of zeros among the others, one scale per row: that row's scale finite, its zeros back
zero_row = x.clone()
zero_row[3] = 0
x8, scale = to_float8(zero_row, E4M3, dim=1)
back = x8.float() / scale
out["zero row per row"] = {"scales finite": bool(torch.isfinite(scale).all()),
                           "back finite": bool(torch.isfinite(back).all()),
                           "row back all zero": bool((back[3] == 0).all()),
                           "error": error(x8, scale, zero_row)}
x8, scale = to_float8(torch.zeros(4, 16), E4M3)
back = x8.float() / scale
out["zeros"] = {"scale finite": bool(torch.isfinite(scale).all()),
                "back all zero": bool((back == 0).all())}
# a scale from an earlier step (1.0) meets gradients that have grown beyond e5m2's 57344
x8, _ = to_float8(x * 1e6, E5M2, scale=torch.tensor(1.0))
out["stale scale e5m2"] = {"finite": bool(torch.isfinite(x8.float()).all()),
                           "largest": x8.float().abs().max().item()}
for case, values in out.items():
    print(f"{case:23s} " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in values.items()))
if args.json:
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
### BEGIN SOLUTION
# Answers (python code/ch10_float8_3d/solutions/ex10_float8_scale.py prints them): 1. about 2.6 %
# through e4m3 and 5.3 % through e5m2 (one mantissa bit fewer: twice the spacing). 2. per tensor
# ~12 %, with ~17 % of the other rows' values flushed to 0 (1e5 takes the top of the range; the
# rest falls to or below half e4m3's smallest subnormal, 2^-10); per row ~2.6 %, none flushed.
# 3. the scale 448 / 1e-12 (huge, but finite), and zeros come back.
### END SOLUTION
