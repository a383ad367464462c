"""float8 training, emulated: chapter 10's scales, scaled matmuls and a Float8Linear, on any device.

float8 matmuls run on H100-class tensor cores at twice bf16's peak. What they compute is simple,
and that is what this module writes out, in plain torch, so that it runs (slowly, but exactly)
on a CPU:

- a **scale** maps a tensor's largest magnitude (its *amax*) onto the format's largest finite
  value, `scale = fp8_max / amax`; the tensor is multiplied by it, clamped (saturated) and cast
  to 1 byte (`to_float8`);
- a **scaled matmul** multiplies two float8 operands and divides by their scales (torch's
  `torch._scaled_mm` takes the inverse scales, 1 / scale, and accumulates in fp32); `scaled_mm`
  here dequantises both operands to fp32 and multiplies, which is the same arithmetic;
- a **Float8Linear** casts its input and weight to e4m3 in forward and the output's gradient to
  e5m2 in backward, with a fresh ("dynamic") scale per tensor and step: the three matmuls of a
  linear layer (output, input gradient, weight gradient) each take float8 operands. That is
  torchao's default "tensorwise" recipe; its "rowwise" recipe takes one scale per row along the
  summed dimension, e4m3 everywhere, scales rounded down to powers of 2.

Sources (read at the tags named): torchao v0.18.0, torchao/float8/float8_utils.py
(`amax_to_scale`: fp8_max / clamp(amax, EPS=1e-12), computed in float64; `to_fp8_saturated`:
clamp, then cast), config.py (`Float8LinearConfig`: input and weight e4m3, grad_output e5m2;
`Float8LinearRecipeName.ROWWISE`), float8_linear.py (`matmul_with_hp_or_float8_args`: the three
matmuls), float8_ops.py (`torch._scaled_mm` called with `scale.reciprocal()`), fsdp_utils.py
(float8 all-gather of weights, `precompute_float8_dynamic_scale_for_fsdp`: one all-reduce of
every weight's amax per step). torch 2.13: `torch._scaled_mm`, `torch.nn.functional.scaled_mm`,
and the saturating cast (torch/headeronly/util/Float8_e4m3fn.h, fp8e4m3fn_from_fp32_value).
"""
from __future__ import annotations

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn  # 4 exponent bits, 3 mantissa bits, no inf: max 448
E5M2 = torch.float8_e5m2    # 5 exponent bits, 2 mantissa bits, has inf: max 57344
EPS = 1e-12                 # torchao's floor under amax: an all-zero tensor gets a finite scale
RECIPES = ("tensorwise", "rowwise")


def fp8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def scale_for(x: torch.Tensor, dtype: torch.dtype = E4M3, dim: int | None = None,
              power_of_2: bool = False) -> torch.Tensor:
    """fp8_max / amax(|x|): one scale for the tensor (dim None, a 0-dim tensor) or one per slice
    along `dim` (kept as a size-1 dimension, so it broadcasts against x). float64 inside, as
    torchao does, then float32. `power_of_2` rounds the scale down to a power of 2 (rowwise)."""
    amax = x.detach().abs().amax() if dim is None else x.detach().abs().amax(dim=dim, keepdim=True)
    scale = (fp8_max(dtype) / amax.double().clamp(min=EPS)).float()
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_2 else scale


def to_float8(x: torch.Tensor, dtype: torch.dtype = E4M3, scale: torch.Tensor | None = None,
              dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x x scale, saturated to +-fp8_max and cast to `dtype`; the scale). Clamping first makes
    the cast's own overflow rule irrelevant (e5m2 would give inf)."""
    scale = scale_for(x, dtype, dim) if scale is None else scale
    top = fp8_max(dtype)
    return (x.float() * scale).clamp(-top, top).to(dtype), scale


def from_float8(x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Back to float32: x8 / scale."""
    return x8.float() / scale


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact|| / ||exact|| (Frobenius), in float64."""
    return ((approx.double() - exact.double()).norm() / exact.double().norm()).item()


def scaled_mm(a8: torch.Tensor, b8: torch.Tensor, scale_a: torch.Tensor,
              scale_b: torch.Tensor) -> torch.Tensor:
    """(a8 / scale_a) @ (b8 / scale_b) in float32: what torch._scaled_mm(a8, b8, 1 / scale_a,
    1 / scale_b, out_dtype=float32) computes, written out (it also runs where _scaled_mm does
    not: any shape, any device). Row-wise scales: scale_a of shape (M, 1), scale_b (1, N)."""
    return from_float8(a8, scale_a) @ from_float8(b8, scale_b)


def torch_scaled_mm(a8: torch.Tensor, b8: torch.Tensor, scale_a: torch.Tensor,
                    scale_b: torch.Tensor) -> torch.Tensor:
    """The same product by torch's kernel, torch._scaled_mm, which takes the inverse scales and
    wants b column-major. On an H100 it runs on the fp8 tensor cores; there row-wise scales need
    a bf16 output (CUDA's row-wise kernel: torchao's float8_ops.py forces bf16, pytorch#156771),
    so that is asked for on CUDA. On a CPU, _scaled_mm is itself an emulation (dequantise, fp32
    matmul), float32 output for both scalings: it checks the API's conventions (inverse scales,
    column-major b, scale shapes), not a GPU kernel's numerics (fp8 accumulation, fast accum)."""
    bf16_out = scale_a.dim() == 2 and a8.is_cuda  # row-wise on CUDA
    out = torch._scaled_mm(a8.contiguous(), b8.t().contiguous().t(), scale_a.reciprocal(),
                           scale_b.reciprocal(),
                           out_dtype=torch.bfloat16 if bf16_out else torch.float32)
    return out.float()


def float8_mm(a: torch.Tensor, b: torch.Tensor, a_dtype: torch.dtype = E4M3,
              b_dtype: torch.dtype = E4M3, recipe: str = "tensorwise",
              kernel: str = "emulated") -> torch.Tensor:
    """a (M, K) @ b (K, N) with both operands cast to float8 with fresh scales. Tensorwise: one
    scale each. Rowwise: the scale may change only along the dimensions the product does not
    sum over, so that it factors out of each sum: one per row of a, one per column of b, rounded
    down to powers of 2 (torchao's rowwise recipe). kernel "emulated" (`scaled_mm`, any device)
    or "torch" (`torch_scaled_mm`)."""
    rowwise = recipe == "rowwise"
    scale_a = scale_for(a, a_dtype, -1 if rowwise else None, power_of_2=rowwise)
    scale_b = scale_for(b, b_dtype, 0 if rowwise else None, power_of_2=rowwise)
    (a8, _), (b8, _) = to_float8(a, a_dtype, scale_a), to_float8(b, b_dtype, scale_b)
    return (scaled_mm if kernel == "emulated" else torch_scaled_mm)(a8, b8, scale_a, scale_b)


class _Float8Matmul(torch.autograd.Function):
    """y = x @ w.T with float8 operands in all three matmuls of a linear layer. Forward: x and
    w in e4m3. Backward: the output's gradient g in e5m2 (tensorwise) or e4m3 (rowwise);
    grad_x = g @ w and grad_w = g.T @ x, each operand cast anew for the sum it enters."""

    @staticmethod
    def forward(ctx, x, w, recipe, kernel):
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, w)
        ctx.recipe, ctx.kernel, ctx.shape = recipe, kernel, x.shape
        with torch.autocast(x.device.type, enabled=False):  # the matmul is ours, not autocast's
            y = float8_mm(x2.float(), w.float().t(), recipe=recipe, kernel=kernel)
        return y.reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x2, w = ctx.saved_tensors
        mm = dict(recipe=ctx.recipe, kernel=ctx.kernel)
        g = grad_out.reshape(-1, w.shape[0]).float()
        g_dtype = E5M2 if ctx.recipe == "tensorwise" else E4M3  # torchao's choices
        with torch.autocast(g.device.type, enabled=False):
            grad_x = float8_mm(g, w.float(), g_dtype, E4M3, **mm)             # sums over outputs
            grad_w = float8_mm(g.t(), x2.float(), g_dtype, E4M3, **mm)        # sums over tokens
        return grad_x.reshape(ctx.shape).to(grad_out.dtype), grad_w.to(w.dtype), None, None


class Float8Linear(nn.Linear):
    """nn.Linear whose matmuls take float8 operands (emulated), like torchao's Float8Linear: the
    weight stays a float32 parameter (the optimizer's master copy); every forward casts it, with
    the input, to float8 with fresh scales. Bias (if any) is added in high precision."""

    recipe = "tensorwise"
    kernel = "emulated"  # or "torch": torch._scaled_mm (fp8 tensor cores on an H100)

    def forward(self, x):
        y = _Float8Matmul.apply(x, self.weight, self.recipe, self.kernel)
        return y if self.bias is None else y + self.bias


def worth_float8(out_features: int, in_features: int, recipe: str = "rowwise") -> bool:
    """Whether torchao's automatic filter converts a linear layer of this weight shape (out,
    in): float8 is per layer, and a small matmul gets SLOWER (the casts' memory traffic is not
    repaid by the faster multiply). torchao v0.18 `_auto_filter_for_recipe` (float8/
    float8_linear_utils.py; torchtitan's filter_fqns=["auto_filter_small_kn"]), thresholds from
    H100 micro-benchmarks, on the full (unsharded) weight: both sizes multiples of 16; row-wise
    skips in <= 2048, out <= 1024, or (in <= 4096 and out <= 2048); tensorwise skips out <= 4096
    with in <= 1024. Llama 3.1 8B's k and v projections (out 1024) stay bf16 row-wise."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    if out_features % 16 or in_features % 16:
        return False
    if recipe == "tensorwise":
        return not (out_features <= 4096 and in_features <= 1024)
    return not (in_features <= 2048 or out_features <= 1024
                or (in_features <= 4096 and out_features <= 2048))


def convert_to_float8(model: nn.Module, recipe: str = "tensorwise", skip: tuple = ("lm_head",),
                      kernel: str = "emulated") -> list[str]:
    """Swap every nn.Linear of `model` whose name does not end with one of `skip` for a
    Float8Linear holding the same parameters, in place (torchao's convert_to_float8_training with
    a module filter; torchtitan's Float8LinearConverter skips the output layer, `filter_fqns`).
    Returns the names of the converted layers."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    if kernel not in ("emulated", "torch"):
        raise ValueError(f"kernel must be 'emulated' or 'torch', got {kernel!r}")
    done = []
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and not name.endswith(skip):
            module.__class__ = Float8Linear  # same parameters, new forward
            module.recipe, module.kernel = recipe, kernel
            done.append(name)
    return done


# --- bytes: FSDP's all-gathers in float8 ---------------------------------------------------------

def fsdp_float8_bytes(config, ranks: int, *, float8_gather: bool = True) -> dict:
    """Bytes each rank sends per training step for FSDP2's collectives on a Llama `config`
    (a dict such as distkit.memory.LLAMA_CONFIGS["70b"]), bf16 compute, fp32 gradient reduction,
    decoder layers resharded after forward (gathered twice), the root (embedding, final norm,
    LM head) gathered once; ring collectives over `ranks`.

    With `float8_gather` (torchao's enable_fsdp_float8_all_gather), each decoder layer's seven
    linear weights are cast to e4m3 *before* the all-gather: 1 byte instead of 2; norms and the
    root stay bf16 (torchtitan skips the LM head). Scales come from one all-reduce of every
    float8 weight's amax per step (precompute_float8_dynamic_scale_for_fsdp; an fp32 value per
    weight). The gradients' reduce-scatter is unchanged.
    """
    from distkit.memory import communication_bytes, llama_parts
    parts = llama_parts(config)
    L, h = config["num_hidden_layers"], config["hidden_size"]
    linear = parts["layer"] - 2 * h  # a layer's seven matrices, without its two RMSNorm weights
    ring = (ranks - 1) / ranks
    fp8 = L * linear if float8_gather else 0
    bf16_layers = L * parts["layer"] - fp8
    out = {"all-gather float8": 2 * ring * fp8 * 1,
           "all-gather bf16": 2 * ring * bf16_layers * 2 + ring * parts["root"] * 2,
           "reduce-scatter fp32": ring * (L * parts["layer"] + parts["root"]) * 4,
           "amax all-reduce": 2 * ring * 7 * L * 4 if float8_gather else 0.0}
    out["total"] = sum(out.values())
    # the bf16 case is chapter 03's formula (distkit.memory.communication_bytes): a check
    if not float8_gather:
        params = L * parts["layer"] + parts["root"]
        assert abs(out["total"] - communication_bytes(params, ranks, 3, param_bytes=2,
                                                      reduce_bytes=4,
                                                      gathered_once=parts["root"])) < 1
    return out
