"""BitNet b1.58 W2A8 linear layers: ternary 2-bit weights times int8 activations.

```python
import bitdecode as bd
w_t, w_s = bd.bitnet.quantize_weight(w, segments=(2560, 640, 640))   # fused q/k/v
w_p = bd.bitnet.pack_weight(w_t)                 # int8 [N, K/4], microsoft/BitNet's bytes
x_q, x_s = bd.bitnet.quantize_activation(x)      # int8 [M, K], fp32 [M]
y, x_q, x_s = bd.bitnet.rms_norm_quantize(x, norm_w, 1e-5)   # an RMSNorm, then the same
y = bd.bitnet.gemv(x_q, w_p, x_s, w_s, segments=(2560, 640, 640))   # M == 1, bf16 [1, N]
y = bd.bitnet.gemm(x_q, w_p, x_s, w_s, segments=(2560, 640, 640))   # any M, bf16 [M, N]
layer = bd.bitnet.BitLinear.from_float(torch_linear, segments=(2560, 640, 640)).cuda()
model = bd.bitnet.convert(bitnet_for_causal_lm)   # every BitNet linear of a transformers model
```

Maths (the kernels and the torch reference compute exactly this):

* weights, per segment ``S`` of rows: ``scale_S = max(mean|W_S|, 1e-5)``,
  ``w = clamp(round(W / scale_S), -1, 1)`` (round half to even);
* activations, per token: ``s = 127 / max(max|x|, 1e-5)``,
  ``q = clamp(round(x * s), -128, 127)`` in fp32 (round half to even);
* ``y[m, n] = bf16((float(sum_k q[m, k] * w[n, k]) / s[m]) * scale_{segment(n)})``, the
  integer sum exact in int32, the two fp32 operations rounded once each.

Segments are the row counts of the fused projections (q, k, v or w1, w3), so each
scale is applied at the true row boundaries (BitNet's own kernel splits N in equal
parts instead).  ``None`` means one segment.

On CUDA tensors gemv / gemm run the CuTe DSL kernels of the GPU's backend
(``kernels_for``: ``kernels_sm80`` on sm_80+, ``kernels_sm90`` on Hopper), elsewhere
the torch reference; ``backend="reference"``
forces the reference.  The kernel calls are torch.library ops, so torch.compile
traces around them, and they allocate nothing but their output, so CUDA graphs can
capture them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import _validate, bitnet_tune, dispatch, jit
from .backend import num_sms
from .formats import model_head_dim
from .reference import _to_int32
from .layouts import bitnet as layout

__all__ = [
    "quantize_weight",
    "pack_weight",
    "unpack_weight",
    "quantize_activation",
    "rms_norm_quantize",
    "rms_norm",
    "add_rms_norm",
    "gemv",
    "gemm",
    "reference_gemm",
    "kernels_for",
    "gemm_kernel_for",
    "gemv_config_for",
    "gemv_configs",
    "tune_gemv",
    "pdl_enabled",
    "accumulate",
    "OUT_DTYPES",
    "BitLinear",
    "FusedSlice",
    "RMSNormQuant",
    "FusedMLP",
    "RMS_NORM_CLASSES",
    "is_rms_norm",
    "convert",
    "load_int2_checkpoint",
    "MAX_SEGMENTS",
    "MODEL_SHAPES",
]

# The (N, K) of BitNet b1.58 2B's linear layers (fused q/k/v, o, fused w1/w3, w2, for the
# 2560- and 3200-wide variants): the shapes the tests and `bitdecode bench bitnet` use.
MODEL_SHAPES = (
    (2560, 2560),
    (3840, 2560),
    (13824, 2560),
    (2560, 6912),
    (3200, 3200),
    (4800, 3200),
    (3200, 10240),
    (20480, 3200),
)
MAX_SEGMENTS = layout.MAX_SEGMENTS
WEIGHT_EPS = 1e-5
ACT_EPS = 1e-5
BACKENDS = ("auto", "reference", "kernel")


# --------------------------------------------------------------------------------------
# Segments
# --------------------------------------------------------------------------------------


def _segments(segments: Optional[Sequence[int]], n: int, name: str = "segments") -> Tuple[int, ...]:
    """Validated segment row counts (a tuple summing to ``n``)."""
    if segments is None:
        return (n,)
    if isinstance(segments, torch.Tensor) or not isinstance(segments, (tuple, list)):
        raise TypeError(f"{name} must be a tuple of ints (rows per fused segment), got {type(segments).__name__}")
    segs = tuple(segments)
    if not segs:
        raise ValueError(f"{name} must not be empty")
    for s in segs:
        if isinstance(s, bool) or not isinstance(s, int) or s <= 0:
            raise ValueError(f"{name} must hold positive ints, got {segs}")
    if len(segs) > MAX_SEGMENTS:
        raise ValueError(f"{name} may hold at most {MAX_SEGMENTS} segments, got {len(segs)}")
    if sum(segs) != n:
        raise ValueError(f"{name} {segs} sum to {sum(segs)} rows, but the weight has N={n} rows")
    return segs


def _segment_ends(segs: Tuple[int, ...], n: int) -> Tuple[int, int, int]:
    """Cumulative row ends of segments 0..2 (``n`` where there is no such boundary)."""
    ends: List[int] = []
    total = 0
    for s in segs[:-1]:
        total += s
        ends.append(total)
    ends += [n] * (MAX_SEGMENTS - 1 - len(ends))
    return tuple(ends)  # type: ignore[return-value]


def _row_scales(w_scales: torch.Tensor, segs: Tuple[int, ...]) -> torch.Tensor:
    counts = torch.tensor(segs, device=w_scales.device)
    return torch.repeat_interleave(w_scales.float(), counts, output_size=sum(segs))


# --------------------------------------------------------------------------------------
# Quantization
# --------------------------------------------------------------------------------------


def _has_data(name: str, t: torch.Tensor) -> None:
    """Weights are read on the host here (their scales, their range): a meta tensor has none."""
    if t.is_meta:
        raise ValueError(f"{name} is on the meta device (no data to quantize or pack); materialize it first")


def quantize_weight(w: torch.Tensor, segments: Optional[Sequence[int]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Ternary weights: (int8 [N, K] in {-1, 0, 1}, fp32 [S] scales ``mean|W|`` per segment)."""
    _validate.tensor("w", w, dtypes=(torch.float32, torch.float16, torch.bfloat16), ndim=2)
    _has_data("w", w)
    if w.numel() == 0:  # (its scale, the mean of no values, would be NaN)
        raise ValueError(f"w must hold at least one weight, got shape {tuple(w.shape)}")
    n = w.shape[0]
    segs = _segments(segments, n)
    _validate.finite("w", w)
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scales = torch.empty(len(segs), dtype=torch.float32, device=w.device)
    start = 0
    for i, rows in enumerate(segs):
        part = w[start : start + rows].float()
        scale = part.abs().mean().clamp(min=WEIGHT_EPS)
        q[start : start + rows] = torch.round(part / scale).clamp_(-1, 1).to(torch.int8)
        scales[i] = scale
        start += rows
    return q, scales


def quantize_activation(x: torch.Tensor, *, backend: str = "reference") -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token int8 activations: (int8 [..., K], fp32 [...] with ``s = 127 / max|x|``).

    ``x ~= q / s``.  Rounds half to even, like ``torch.round``.  ``backend="auto"`` runs
    one kernel (``kernels_sm80.act_quant``, bit-identical) for fp16 / bf16 CUDA tensors
    with K % 8 == 0, else these torch ops; ``"reference"`` (the default) always the torch
    ops; ``"kernel"`` requires the kernel.  ``x`` is not checked for NaN / Inf (on this
    per-layer path a check would wait for the GPU every call): a row holding Inf gets scale
    0 and a row holding NaN a NaN scale, which the matmuls then carry into their outputs.
    """
    _validate.tensor("x", x, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if _row_kernel_runs(x, None, backend, "activation quantizer"):
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = _aligned(x.reshape(-1, k))
        if x2.shape[0] == 0:
            return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(lead, dtype=torch.float32)
        q, scale = (_act_quant_op if torch.compiler.is_compiling() else _act_quant_launch)(x2.detach())
        return q.reshape(x.shape), scale.reshape(lead)
    xf = x.float()
    s = float(layout.ACT_Q_MAX) / xf.abs().amax(dim=-1).clamp(min=ACT_EPS)
    q = torch.round(xf * s.unsqueeze(-1)).clamp_(layout.ACT_Q_MIN, layout.ACT_Q_MAX).to(torch.int8)
    return q, s


def _act_quant_launch(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    bf16 = x.dtype == torch.bfloat16
    arch = _arch(x.device)
    # (the backend is looked up only when the kernel is first built: this runs every layer)
    fn = _compile(("bitnet_act_quant", arch, bf16),
                  lambda: _kernels(x.device).compile_act_quant(bf16, ACT_EPS, jit.compile_options(arch)))
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    s = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    fn(x, q, s)
    return q, s


@torch.library.custom_op("bitdecode::bitnet_act_quant", mutates_args=())
def _act_quant_op(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return _act_quant_launch(x)


@_act_quant_op.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0],), dtype=torch.float32)


def _check_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps, gated: bool) -> None:
    _validate.tensor("x", x, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    _validate.tensor("weight", weight, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    _validate.flag("gated", gated)
    if gated and x.shape[-1] % 2:
        raise ValueError(f"gated: x's last dimension must be even (gate then up), got {x.shape[-1]}")
    k = x.shape[-1] // 2 if gated else x.shape[-1]
    if weight.shape != (k,):
        what = "half x's last dimension" if gated else "x's last dimension"
        raise ValueError(f"weight must have shape ({k},) ({what}), got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight must be on x's device ({x.device}), got {weight.device}")
    _check_eps(eps)


def _check_eps(eps) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0 or eps == float("inf"):
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")


def _row_kernel_runs(x: torch.Tensor, weight: Optional[torch.Tensor], backend: str, what: str) -> bool:
    """Whether ``backend`` runs one of the per-row kernels (``kernels_sm80.act_quant``: the
    quantizer, or with the norm's ``weight`` the norm kernels) on these tensors: fp16 /
    bf16 x (and weight of its dtype), rows of K % 8 == 0, a CUDA device that has them.
    "kernel" requires it; "reference" never."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    k = x.shape[-1] if weight is None else weight.shape[0]
    fits = (x.dtype in (torch.float16, torch.bfloat16) and (weight is None or weight.dtype == x.dtype)
            and k % layout.ACT_QUANT_VEC == 0)
    if backend == "kernel" and not fits:
        operands = f"x {x.dtype}" if weight is None else f"x {x.dtype}, weight {weight.dtype} (one dtype)"
        raise ValueError(f"the {what} kernel takes fp16 / bf16 {'x' if weight is None else 'x and weight'} with "
                         f"K % {layout.ACT_QUANT_VEC} == 0, got {operands}, K = {k}")
    return backend != "reference" and fits and _use_kernel(backend, x.device, what)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``BitNetRMSNorm`` (and ``LlamaRMSNorm``) forward, op for op."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _relu2_times_up(x: torch.Tensor) -> torch.Tensor:
    """BitNet's MLP activation on the fused gate / up output: ``relu(gate)^2 * up`` with
    transformers' ops (``ReLUSquaredActivation``, then the product)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.square(torch.nn.functional.relu(gate)) * up


def rms_norm_quantize(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, gated: bool = False, backend: str = "reference"
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An RMSNorm and the per-token int8 quantization of its output: ``(y, q, s)``.

    ``y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` in fp32, as transformers'
    ``BitNetRMSNorm`` computes it; ``(q, s) = quantize_activation(y)``.  ``gated=True``:
    ``x`` is [..., 2K] (gate then up, the fused gate / up projection's output) and the
    norm's input is BitNet's MLP activation ``relu(gate)^2 * up`` (torch's ops, each
    rounded to x's dtype).  Every BitLinear
    input of BitNet b1.58 is such a norm's output, so ``RMSNormQuant`` (what ``convert``
    puts in the norms' place) hands ``q, s`` on with ``y`` and the layers skip their own
    quantization.  ``backend="auto"`` runs one kernel (``kernels_sm80.act_quant``) for fp16
    / bf16 CUDA tensors with ``weight`` in x's dtype and K % 8 == 0, else the torch ops;
    ``"kernel"`` requires it.  The kernel sums the squares in another order than torch,
    so its ``y`` may differ from torch's by up to two 16-bit ulps (on rows whose ``rsqrt``
    lands near a rounding edge); its ``q, s`` are exactly ``quantize_activation`` of its ``y``.
    """
    _check_norm_quant(x, weight, eps, gated)
    if _row_kernel_runs(x, weight, backend, "norm + quantizer"):
        return _norm_kernel(x, weight, eps, gated, True)
    y = _rms_norm(_relu2_times_up(x) if gated else x, weight, eps)
    q, s = quantize_activation(y)
    return y, q, s


def _norm_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float, gated: bool, quantize: bool):
    """(y, q, s) of the norm kernel over x's rows, shaped like x (the last dimension K);
    q and s are None without ``quantize``.  Under torch.compile: the custom op."""
    lead, k = x.shape[:-1], weight.shape[0]
    x2 = _aligned(x.reshape(-1, x.shape[-1]))
    if x2.shape[0] == 0:
        y, q, s = x.new_empty(0, k), x.new_empty(0, k, dtype=torch.int8), x.new_empty(0, dtype=torch.float32)
    else:
        # (detached: DLPack refuses tensors that require grad; the kernels are inference only)
        x2, w = x2.detach(), _aligned(weight).detach()
        if torch.compiler.is_compiling():  # (only rms_norm_quantize gets here compiling)
            y, q, s = _norm_quant_op(x2, w, float(eps), gated)
        else:
            y, q, s = _norm_quant_launch(x2, w, float(eps), gated, quantize)
    if not quantize:
        return y.reshape(*lead, k), None, None
    return y.reshape(*lead, k), q.reshape(*lead, k), s.reshape(lead)


# The norm kernels ask L2 for their weight before waiting for the previous kernel
# (``kernels_sm80.act_quant.RmsNormQuantSm80.prefetch_weight``): in a model step, whose
# weights stream through L2, a round trip to HBM less between the norm's two passes
# (measured with ``dense.RESIDUAL_AHEAD``, whose comment has the numbers).
# ``profiles/bench_e2e.py --no-norm-prefetch`` clears it for an A/B (read when a kernel is
# first built: set it before the first call).
NORM_PREFETCH = True


def _norm_fn(x: torch.Tensor, eps: float, gated: bool = False, quantize: bool = True, residual: bool = False):
    """The norm kernel for ``x``'s dtype and device with these constexprs (compiled once)."""
    bf16 = x.dtype == torch.bfloat16
    arch = _arch(x.device)
    prefetch = NORM_PREFETCH

    def build():  # (the backend looked up here, once: this function runs every layer)
        return _kernels(x.device).compile_norm_quant(
            bf16, ACT_EPS, eps, jit.compile_options(arch), gated=gated, quantize=quantize, pdl=jit.has_pdl(arch),
            residual=residual, prefetch_weight=prefetch)

    return _compile(("bitnet_norm_quant", arch, bf16, eps, gated, quantize, residual, prefetch), build)


def _norm_quant_launch(x: torch.Tensor, weight: torch.Tensor, eps: float, gated: bool, quantize: bool = True):
    fn = _norm_fn(x, eps, gated, quantize)
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    if not quantize:  # the norm alone (its own entry point: y only)
        fn(x, weight, y)
        return y, None, None
    q = torch.empty(x.shape[0], weight.shape[0], dtype=torch.int8, device=x.device)
    s = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    fn(x, weight, y, q, s)
    return y, q, s


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: str = "auto") -> torch.Tensor:
    """transformers' RMSNorm (``LlamaRMSNorm``, ``BitNetRMSNorm``, Mistral's and Qwen's:
    ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` in fp32) as one kernel: the
    norm of ``rms_norm_quantize`` without the quantizer, for any model.  ``backend`` as
    there ("auto": the kernel for fp16 / bf16 CUDA tensors with ``weight`` in x's dtype and
    K % 8 == 0, else torch's ops; "reference": torch's ops; "kernel": required).  Within
    two 16-bit ulps of torch's ops (the squares are summed in another order)."""
    _check_norm_quant(x, weight, eps, False)
    if torch.compiler.is_compiling() or not _row_kernel_runs(x, weight, backend, "RMSNorm"):
        return _rms_norm(x, weight, eps)
    return _norm_kernel(x, weight, eps, False, False)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 backend: str = "auto") -> Tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's residual sum and the RMSNorm after it as one kernel: ``(h, y)``
    with ``h = residual + x`` (torch's add) and ``y = rms_norm(h, weight, eps)``, what
    transformers' Llama-family layers compute between attention and the MLP (the add's
    own launch saved).  ``residual`` has x's shape, dtype and device; ``backend`` as
    ``rms_norm`` ("auto": the kernel where ``rms_norm`` takes it); ``h`` is bit for bit
    torch's, ``y`` within two 16-bit ulps of the norm's torch ops."""
    _check_norm_quant(x, weight, eps, False)
    _validate.tensor("residual", residual, dtypes=[x.dtype], shape=tuple(x.shape), device=x.device)
    if torch.compiler.is_compiling() or not _row_kernel_runs(x, weight, backend, "RMSNorm"):
        h = residual + x
        return h, _rms_norm(h, weight, eps)
    lead, k = x.shape[:-1], weight.shape[0]
    x2, r2 = (_aligned(t.reshape(-1, k)).detach() for t in (x, residual))
    if x2.shape[0] == 0:
        return residual + x, x.new_empty(x.shape)
    h, y = torch.empty_like(x2), torch.empty_like(x2)
    _norm_fn(x2, float(eps), quantize=False, residual=True)(x2, r2, _aligned(weight).detach(), h, y)
    return h.reshape(*lead, k), y.reshape(*lead, k)


@torch.library.custom_op("bitdecode::bitnet_norm_quant", mutates_args=())
def _norm_quant_op(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   gated: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _norm_quant_launch(x, weight, eps, gated)


@_norm_quant_op.register_fake
def _(x, weight, eps, gated):
    shape = (x.shape[0], weight.shape[0])
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int8), x.new_empty((x.shape[0],), dtype=torch.float32)


# A norm output's quantization travels with it as this attribute: (q, s, the tensor's
# version when they were made), so an in-place change of the output invalidates them.
_ACT_ATTR = "_bitdecode_act"


def _carried_quantization(x: torch.Tensor):
    """(q, s) that ``RMSNormQuant`` attached to ``x``, if still valid for it, else None."""
    act = getattr(x, _ACT_ATTR, None)
    if act is None or act[2] != _validate.version_counter(x) or act[0].shape != x.shape:
        return None
    return act[0], act[1]


# --------------------------------------------------------------------------------------
# Packing (byte-for-byte microsoft/BitNet gpu/pack_weight.py)
# --------------------------------------------------------------------------------------


def _tables(device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    perm = torch.tensor(layout.tile_permutation_table(), dtype=torch.long, device=device)
    shifts = torch.tensor(layout.word_interleave_table(), dtype=torch.int64, device=device)
    return perm, shifts


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """Ternary int8 [N, K] -> packed int8 [N, K/4] in BitNet's layout (N % 16, K % 32)."""
    _validate.tensor("w", w, dtypes=(torch.int8,), ndim=2)
    _has_data("w", w)
    n, k = w.shape
    layout.check_shape(n, k, k_multiple=layout.TILE_K, name="w")
    if w.numel() and (int(w.min()) < -1 or int(w.max()) > 1):
        raise ValueError("w must be ternary (values -1, 0, 1); quantize it with quantize_weight first")
    perm, shifts = _tables(w.device)
    nt, kt = n // layout.TILE_N, k // layout.TILE_K
    codes = (w.to(torch.int64) + layout.CODE_OFFSET).reshape(nt, layout.TILE_N, kt, layout.TILE_K)
    tiles = codes.permute(0, 2, 1, 3).reshape(nt, kt, layout.TILE_N * layout.TILE_K)
    # permuted position p = 16 * word + element holds tile offset perm[p]
    words = tiles[..., perm].reshape(nt, kt, layout.TILE_WORDS, layout.CODES_PER_WORD)
    words = (words << shifts).sum(dim=-1)  # disjoint bit fields: sum == or
    return _to_int32(words).reshape(n, k // layout.CODES_PER_WORD).view(torch.int8).reshape(n, k // layout.CODES_PER_BYTE)


def unpack_weight(w_packed: torch.Tensor) -> torch.Tensor:
    """Packed int8 [N, K/4] -> ternary int8 [N, K]; the inverse of ``pack_weight``."""
    _validate.tensor("w_packed", w_packed, dtypes=(torch.int8,), ndim=2)
    n, kb = w_packed.shape
    k = kb * layout.CODES_PER_BYTE
    layout.check_shape(n, k, k_multiple=layout.TILE_K, name="w_packed (unpacked)")
    perm, shifts = _tables(w_packed.device)
    nt, kt = n // layout.TILE_N, k // layout.TILE_K
    src = w_packed.contiguous()
    if src.storage_offset() % 4:  # (a view past a byte boundary cannot be read as int32 words in place)
        src = src.clone()
    words = src.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    words = words.reshape(nt, kt, layout.TILE_WORDS, 1)
    codes = ((words >> shifts) & 3).reshape(nt, kt, layout.TILE_N * layout.TILE_K)
    tiles = torch.empty_like(codes)
    tiles[..., perm] = codes
    w = tiles.reshape(nt, kt, layout.TILE_N, layout.TILE_K).permute(0, 2, 1, 3).reshape(n, k)
    return (w - layout.CODE_OFFSET).to(torch.int8)


# --------------------------------------------------------------------------------------
# Validation of the matmul arguments
# --------------------------------------------------------------------------------------


def _check_matmul(x, w_packed, x_scale, w_scales, segments, *, gemv: bool):
    _validate.tensor("x", x, dtypes=(torch.int8,), ndim=2)
    m, k = x.shape
    if gemv and m != 1:
        raise ValueError(f"gemv takes one token, x must have shape (1, K), got {tuple(x.shape)}; use gemm for M > 1")
    if m < 1:
        raise ValueError(f"x must hold at least one token, got shape {tuple(x.shape)}")
    _validate.tensor("w_packed", w_packed, dtypes=(torch.int8,), ndim=2)
    n, kb = w_packed.shape
    if k % layout.K_MULTIPLE or k == 0:
        raise ValueError(f"x has K={k} columns; K must be a positive multiple of {layout.K_MULTIPLE}")
    if n % layout.N_MULTIPLE or n == 0:
        raise ValueError(f"w_packed has N={n} rows; N must be a positive multiple of {layout.N_MULTIPLE}")
    if kb * layout.CODES_PER_BYTE != k:
        raise ValueError(
            f"w_packed must have shape ({n}, K/4) = ({n}, {k // layout.CODES_PER_BYTE}) for x with K={k}, "
            f"got {tuple(w_packed.shape)}"
        )
    _validate.tensor("x_scale", x_scale, dtypes=(torch.float32,), shape=(m,))
    segs = _segments(segments, n)
    _validate.tensor("w_scales", w_scales, dtypes=(torch.float32,), shape=(len(segs),))
    _validate.same_device(x=x, w_packed=w_packed, x_scale=x_scale, w_scales=w_scales)
    return m, n, k, segs


OUT_DTYPES = (torch.bfloat16, torch.int32)


def _check_out_dtype(out_dtype) -> None:
    if out_dtype not in OUT_DTYPES:
        raise ValueError(
            f"out_dtype must be torch.bfloat16 (scaled output) or torch.int32 (the exact integer "
            f"sums, unscaled), got {out_dtype}"
        )


# --------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------


def accumulate(x: torch.Tensor, w_ternary: torch.Tensor) -> torch.Tensor:
    """Exact int32 ``x @ w.T`` of int8 activations and ternary weights (any device).

    float64 holds every partial sum exactly (|sum| <= 128 * K < 2**53).
    """
    return torch.matmul(x.double(), w_ternary.double().t()).to(torch.int32)


def _scale(acc: torch.Tensor, x_scale: torch.Tensor, row_scales: torch.Tensor) -> torch.Tensor:
    return ((acc.float() / x_scale.unsqueeze(1)) * row_scales.unsqueeze(0)).to(torch.bfloat16)


def reference_gemm(
    x, w_packed, x_scale, w_scales, segments: Optional[Sequence[int]] = None, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The torch reference of gemv / gemm: bf16 [M, N], or the int32 sums for ``out_dtype=torch.int32``."""
    _, _, _, segs = _check_matmul(x, w_packed, x_scale, w_scales, segments, gemv=False)
    _check_out_dtype(out_dtype)
    acc = accumulate(x, unpack_weight(w_packed))
    if out_dtype == torch.int32:
        return acc
    return _scale(acc, x_scale, _row_scales(w_scales, segs))


# --------------------------------------------------------------------------------------
# Kernels (torch.library ops; the kernel modules are imported on first use)
# --------------------------------------------------------------------------------------


def _arch(device: torch.device) -> str:
    from . import jit

    return jit.target_arch(device.index)  # cached there


def _check_kernel_device(device: torch.device, what: str) -> None:
    if device.type != "cuda":
        raise ValueError(f"the {what} kernel runs on CUDA tensors, got tensors on {device}")
    if not dispatch.capability_at_least(device, 8):
        major = dispatch.device_capability(device)[0]
        raise ValueError(
            f"the {what} kernel needs compute capability 8.0 or newer (dp4a / int8 mma.sync), "
            f"{torch.cuda.get_device_name(device)} is sm_{major}x"
        )


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """The kernels load 16 bytes at a time: contiguous, 16-byte aligned storage."""
    if not t.is_contiguous():
        t = t.contiguous()  # a fresh allocation: aligned
    elif t.data_ptr() % 16:
        t = t.clone()
    return t


def _compile(key, build):
    from . import jit

    with warnings.catch_warnings():
        # the warp count is a launch argument, so the DSL cannot emit .reqntid
        warnings.filterwarnings("ignore", message=".*block size.*")
        return jit.KERNELS.get(key, build)


def kernels_for(device: torch.device):
    """The BitNet kernels of ``device``'s backend (``backend.Backend.bitnet``: its GEMV
    configurations and GEMMs; the arch decides, as for ``bitdecode compile --arch``)."""
    return _kernels(_cuda_device(device))


def _kernels(device: torch.device):
    """``kernels_for`` without the device check (the library's own calls; tests stand a
    patched ``_arch`` in for a GPU)."""
    from . import backend

    return backend.of_arch(_arch(torch.device(device))).bitnet


def _cuda_device(device) -> torch.device:
    """``device`` of the public kernel-choice helpers: a CUDA one (a CPU device made the arch
    query assert inside torch.cuda, or answer for the current GPU)."""
    device = torch.device(device) if isinstance(device, (str, int, torch.device)) else device
    if not isinstance(device, torch.device) or device.type != "cuda":
        raise ValueError(f"device: the BitNet kernels run on CUDA devices, got {device}")
    return device


# Programmatic dependent launch on Hopper (the kernels read the weights before the
# previous kernel on the stream has finished); BITDECODE_PDL=0 turns it off, for callers
# that write the packed weights in the kernel right before a GEMV / GEMM.
ENV_PDL = "BITDECODE_PDL"


def pdl_enabled() -> bool:
    """Whether the Hopper GEMV and GEMMs launch with PDL (``$BITDECODE_PDL != 0``)."""
    return os.environ.get(ENV_PDL, "1").strip() != "0"


def _pdl(arch: str) -> bool:
    """Whether kernels for ``arch`` may launch with programmatic dependent launch: from sm_90
    on, unless ``BITDECODE_PDL=0``."""
    return jit.has_pdl(arch) and pdl_enabled()


def _with_pdl(cfg, arch: str):
    """``cfg`` with programmatic dependent launch where ``_pdl`` allows it: the GEMV and the
    mma.sync GEMM stream weights while the previous kernel drains (profiles/NOTES.md); the
    weights must not come from that kernel.  Without PDL the scales load where the plain
    kernel loads them (``early_scales`` places them after the PDL wait, so it goes too)."""
    pdl = _pdl(arch)
    return dataclasses.replace(cfg, pdl=pdl, early_scales=cfg.early_scales and pdl)


def gemv_config_for(device: torch.device, n: int, k: int):
    """The GEMV kernel configuration used on ``device`` (a CUDA device) for N x K weights:
    the one ``tune_gemv`` measured fastest for this GPU and shape (``bitnet_tune``'s
    table), else the rule's."""
    device = _cuda_device(device)  # (first: the tuning table's lookup asks the GPU's name)
    tuned = bitnet_tune.lookup(device, n, k)
    if tuned is None:
        return _with_pdl(_rule_gemv_config(device, n, k), _arch(device))
    try:  # (an entry of another arch's, or hand-edited: refused by name, not deep in the compile)
        _kernels(device).gemv_key(tuned, k)
    except ValueError as e:
        raise ValueError(f"the GEMV tuning entry for {n} x {k} weights on {torch.cuda.get_device_name(device)} "
                         f"(${bitnet_tune.ENV_GEMV_TUNING}'s file, or bitnet_tune.load / remember) cannot run here: {e}; "
                         "fix or drop it (bitnet_tune.forget)") from None
    return _with_pdl(tuned, _arch(device))


def _rule_gemv_config(device: torch.device, n: int, k: int):
    """The backend rule's GEMV configuration for N x K weights (before PDL is applied)."""
    return _kernels(device).gemv_config(n, k, num_sms(device))


def gemm_kernel_for(m: int, device: torch.device, n: Optional[int] = None, k: Optional[int] = None) -> str:
    """The GEMM kernel ``gemm(kernel="auto")`` runs for M tokens (and N weight rows, K
    inputs, if given; the choice may depend on them) on ``device``."""
    return kernels_for(device).default_gemm_kernel(m, n, k)


def _out(m: int, n: int, raw: bool, device) -> torch.Tensor:
    return torch.empty((m, n), dtype=torch.int32 if raw else torch.bfloat16, device=device)


# (kind, device index, ...) -> compiled kernel (+ what launching it needs): the per-call
# path is then a dict lookup, no config building or cache-key hashing.
_LAUNCHERS: dict = {}


def gemv_configs(device: torch.device) -> list:
    """Every GEMV configuration ``device`` can run (benchmarks and tests time / check them
    side by side): unroll 4 and 8 plain, and on Hopper the PDL candidates the host picks from
    and the stripe kernels (``kernels_sm90.bitnet_gemv.BULK``, ``BULK_X``, picked by ``stripe_config``)."""
    return kernels_for(device).gemv_configs()


def _gemv_kernel(device: torch.device, raw: bool, n: int, k: int, cfg=None):
    """(compiled kernel, launch size) for this shape: the host's configuration, or ``cfg``."""
    # (the host's pick depends on $BITDECODE_PDL and the tuning table; a given ``cfg`` on neither)
    key = ("gemv", device.index, raw, n, k, (pdl_enabled(), bitnet_tune.generation) if cfg is None else cfg)
    hit = _LAUNCHERS.get(key)
    if hit is None:
        arch, kernels = _arch(device), _kernels(device)
        cfg = dataclasses.replace(cfg or gemv_config_for(device, n, k), raw=raw)
        fn = _compile(("bitnet_gemv", arch, *kernels.gemv_key(cfg, k)),
                      lambda: kernels.compile_gemv(cfg, k, jit.compile_options(arch)))
        hit = _LAUNCHERS[key] = (fn, kernels.gemv_launch_size(cfg, n, k, num_sms(device)))
    return hit


def _gemv_launch(x, w, x_scale, w_scales, ends: List[int], raw: bool, cfg=None) -> torch.Tensor:
    """Launch the GEMV (``cfg``: a configuration from ``gemv_configs`` instead of the
    host's choice; benchmarks and tests)."""
    fn, size = _gemv_kernel(x.device, raw, w.shape[0], x.shape[1], cfg)
    x, w = _aligned(x), _aligned(w)
    x_scale, w_scales = x_scale.contiguous(), w_scales.contiguous()
    out = _out(1, w.shape[0], raw, x.device)
    fn(x, w, x_scale, w_scales, out, ends[0], ends[1], ends[2], size)
    return out


def _gemm_kernel(device: torch.device, m: int, n: int, k: int, kernel: str, raw: bool):
    """(compiled kernel, its trailing launch arguments) for this call's shape; the tile and
    split choice is made once per shape."""
    key = ("gemm", device.index, m, n, k, kernel, raw, pdl_enabled())
    hit = _LAUNCHERS.get(key)
    if hit is None:
        arch, kernels = _arch(device), _kernels(device)
        if kernel == "auto":
            kernel = kernels.default_gemm_kernel(m, n, k)
        cfg, extra, split_work = kernels.gemm_plan(kernel, m, n, k, num_sms(device), raw, _pdl(arch))
        fn = _compile(("bitnet_gemm", kernel, arch, cfg),
                      lambda: kernels.compile_gemm(kernel, cfg, jit.compile_options(arch)))
        hit = _LAUNCHERS[key] = (fn, extra, split_work)
    return hit


# The wgmma GEMM's split-K workspace (partial sums, counts) per (device, stream); the counts
# are zero between launches (each launch leaves them so).
_SPLIT_WORK = jit.PerStream()


def _split_workspace(device: torch.device, values: int, tiles: int):
    """The split-K workspace of the current stream, at least ``values`` partial sums and
    ``tiles`` counts; while a CUDA graph is captured, a fresh one from the graph's pool (so
    a replay never shares it with eager launches; only its counts are zeroed on replay)."""

    def make():
        return (torch.empty(values, dtype=torch.int32, device=device),
                torch.zeros(tiles, dtype=torch.int32, device=device))

    stream = jit.current_stream(device.index)
    if stream is None:
        return make()
    return _SPLIT_WORK.get((device.index, stream), make,
                           keep=lambda ws: ws[0].numel() >= values and ws[1].numel() >= tiles)


def _gemm_launch(x, w, x_scale, w_scales, ends: List[int], kernel: str, raw: bool) -> torch.Tensor:
    m, n, k = x.shape[0], w.shape[0], x.shape[1]
    fn, extra, split_work = _gemm_kernel(x.device, m, n, k, kernel, raw)
    x, w = _aligned(x), _aligned(w)
    x_scale, w_scales = x_scale.contiguous(), w_scales.contiguous()
    out = _out(m, n, raw, x.device)
    if split_work is not None:  # the wgmma kernel
        values, tiles = split_work
        # no split tile: the kernel never touches the workspace, the output stands in for it
        work = _split_workspace(x.device, values, tiles) if tiles else (out.view(torch.int32).view(-1),) * 2
        extra = (*work, *extra)
    fn(x, w, x_scale, w_scales, out, ends[0], ends[1], ends[2], *extra)
    return out


GEMM_KERNELS = ("auto", "mma", "wgmma")


@torch.library.custom_op("bitdecode::bitnet_gemv", mutates_args=())
def _gemv_op(
    x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scales: torch.Tensor, ends: List[int], raw: bool
) -> torch.Tensor:
    return _gemv_launch(x, w, x_scale, w_scales, ends, raw)


@_gemv_op.register_fake
def _(x, w, x_scale, w_scales, ends, raw):
    return x.new_empty((1, w.shape[0]), dtype=torch.int32 if raw else torch.bfloat16)


@torch.library.custom_op("bitdecode::bitnet_gemm", mutates_args=())
def _gemm_op(
    x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scales: torch.Tensor, ends: List[int], kernel: str, raw: bool
) -> torch.Tensor:
    return _gemm_launch(x, w, x_scale, w_scales, ends, kernel, raw)


@_gemm_op.register_fake
def _(x, w, x_scale, w_scales, ends, kernel, raw):
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.int32 if raw else torch.bfloat16)


def _use_kernel(backend: str, device: torch.device, what: str) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return False
    if backend == "kernel" or device.type == "cuda":
        _check_kernel_device(device, what)
        return True
    return False


def gemv(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    x_scale: torch.Tensor,
    w_scales: torch.Tensor,
    segments: Optional[Sequence[int]] = None,
    *,
    backend: str = "auto",
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """One token: ``x`` int8 [1, K], packed weights int8 [N, K/4] -> bf16 [1, N].

    ``x_scale`` fp32 [1] (``127 / max|x|``), ``w_scales`` fp32 [S] per segment.
    N % 16 == 0 and K % 128 == 0.  ``out_dtype=torch.int32`` returns the exact integer
    sums ``x @ w.T`` instead (no scaling).

    On Hopper the kernel uses programmatic dependent launch: it streams ``w_packed``
    before the previous kernel on the stream has finished (and reads ``x`` only after),
    so ``w_packed`` must not be written by the kernel launched right before this call
    (or set ``BITDECODE_PDL=0``).
    """
    _, n, _, segs = _check_matmul(x, w_packed, x_scale, w_scales, segments, gemv=True)
    _check_out_dtype(out_dtype)
    if not _use_kernel(backend, x.device, "gemv"):
        return reference_gemm(x, w_packed, x_scale, w_scales, segs, out_dtype)
    ends = list(_segment_ends(segs, n))
    raw = out_dtype == torch.int32
    if torch.compiler.is_compiling():
        return _gemv_op(x, w_packed, x_scale, w_scales, ends, raw)
    return _gemv_launch(x, w_packed, x_scale, w_scales, ends, raw)


def tune_gemv(shapes, device="cuda", *, replays: int = 20, margin: float = 0.02,
              progress: Optional[Callable[[str], None]] = None) -> List[dict]:
    """Time every GEMV configuration ``device`` runs at each weight shape (N, K) of ``shapes``
    and launch the fastest from now on (``bitnet_tune``'s table; ``bitnet_tune.save`` keeps
    it): the rule's pick stays unless another is faster by more than ``margin``.

    ``shapes``: (N, K) pairs or ``"NxK,NxK"``.  Each configuration's int32 sums are compared
    with the reference's before it is timed (``RuntimeError`` on any difference: a kernel
    bug).  Times are ``bitnet_tune``'s method: weights read from HBM, CUDA-graph replays,
    the median of ``replays``.  Returns a dict a shape: ``gpu``, ``sms``, ``n``, ``k``,
    ``config`` (the pick's fields) and ``us``, ``default`` (the rule's) and ``default_us``,
    and ``times`` (every configuration's fields and time).  ``progress(text)`` is called
    before each shape.  Tune before capturing CUDA graphs that run these GEMVs."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"device: tune_gemv times kernels on a CUDA GPU, got {device}"
                         + ("" if torch.cuda.is_available() else " (this machine has none)"))
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    _check_kernel_device(device, "GEMV")
    shapes = bitnet_tune.parse_shapes(shapes)
    if not isinstance(replays, int) or isinstance(replays, bool) or replays < 1:
        raise ValueError(f"replays must be a positive integer, got {replays!r}")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    rows = []
    for n, k in shapes:
        if progress is not None:
            progress(f"{n} x {k}")
        rows.append(_tune_shape(n, k, device, l2, replays, margin))
    return rows


def _gemv_candidates(device: torch.device, k: int) -> list:
    """Every GEMV configuration ``device`` runs at K columns as a call would launch it (PDL
    as ``$BITDECODE_PDL`` says), less those it cannot build at this K (a stripe too long
    for shared memory)."""
    kernels, arch = _kernels(device), _arch(device)
    out = []
    for cfg in kernels.gemv_configs():
        cfg = _with_pdl(cfg, arch)
        try:
            kernels.gemv_key(cfg, k)
        except ValueError:
            continue
        if cfg not in out:
            out.append(cfg)
    return out


def _tune_shape(n: int, k: int, device: torch.device, l2: int, replays: int, margin: float) -> dict:
    """``tune_gemv`` at one shape: check and time every candidate, remember the pick."""
    gpu = bitnet_tune.gpu_key(device)
    default = _with_pdl(_rule_gemv_config(device, n, k), _arch(device))  # (not an earlier tuning's pick)
    configs = _gemv_candidates(device, k)  # (the rule's pick is one: test_candidates_are_what_a_call_would_launch)
    gen = torch.Generator(device=device).manual_seed(n * 7 + k)
    packed = pack_weight(torch.randint(-1, 2, (n, k), generator=gen, dtype=torch.int8, device=device))
    x, xs = quantize_activation(torch.randn(1, k, generator=gen, device=device), backend="reference")
    ws = torch.ones(1, device=device)
    ends = [n, n, n]
    want = reference_gemm(x, packed, xs, ws, None, torch.int32)
    copies = bitnet_tune.copies_for(packed.numel(), l2)
    packs = [packed] + [packed.clone() for _ in range(copies - 1)]
    times = {}
    for cfg in configs:
        got = _gemv_launch(x, packed, xs, ws, ends, True, cfg)
        if not torch.equal(got, want):
            raise RuntimeError(f"the GEMV configuration {cfg} summed N={n} x K={k} wrongly "
                               f"({int((got != want).sum())} of {n} outputs): a kernel bug, please report it")
        calls = [(lambda p=packs[i % copies], c=cfg: _gemv_launch(x, p, xs, ws, ends, False, c))
                 for i in range(max(copies, bitnet_tune.MIN_CALLS))]
        times[cfg] = bitnet_tune.graph_time_us(calls, replays)
    del packs
    best = min(times, key=times.get)
    if times[best] >= times[default] * (1 - margin):
        best = default
    bitnet_tune.remember(gpu, n, k, best)
    fields = bitnet_tune.config_fields
    return {"gpu": gpu[0], "sms": gpu[1], "n": n, "k": k, "config": fields(best), "us": times[best],
            "default": fields(default), "default_us": times[default],
            "times": [{"config": fields(cfg), "us": us} for cfg, us in times.items()]}


def gemm(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    x_scale: torch.Tensor,
    w_scales: torch.Tensor,
    segments: Optional[Sequence[int]] = None,
    *,
    backend: str = "auto",
    kernel: str = "auto",
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """M tokens on integer tensor cores: ``x`` int8 [M, K] -> bf16 [M, N].

    ``kernel``: ``"mma"`` (mma.sync m16n8k32, any sm_80+), ``"wgmma"`` (Hopper only)
    or ``"auto"``.  ``out_dtype=torch.int32`` returns the exact integer sums.
    On Hopper the mma.sync kernel streams ``w_packed`` before the previous kernel has
    finished (programmatic dependent launch, as ``gemv``): don't write the weights in
    the kernel launched right before.
    """
    m, n, _, segs = _check_matmul(x, w_packed, x_scale, w_scales, segments, gemv=False)
    _check_out_dtype(out_dtype)
    if kernel not in GEMM_KERNELS:
        raise ValueError(f"kernel must be one of {GEMM_KERNELS}, got {kernel!r}")
    if not _use_kernel(backend, x.device, "gemm"):
        return reference_gemm(x, w_packed, x_scale, w_scales, segs, out_dtype)
    ends = list(_segment_ends(segs, n))
    raw = out_dtype == torch.int32
    if torch.compiler.is_compiling():
        return _gemm_op(x, w_packed, x_scale, w_scales, ends, kernel, raw)
    return _gemm_launch(x, w_packed, x_scale, w_scales, ends, kernel, raw)


# --------------------------------------------------------------------------------------
# Module
# --------------------------------------------------------------------------------------


class BitLinear(nn.Module):
    """A linear layer with ternary weights and per-token int8 activations (inference).

    ``forward(x)``: ``x`` [..., K] (fp32 / fp16 / bf16) -> [..., N] in ``x.dtype``.  One
    token (M = 1) runs the GEMV kernel, more tokens the GEMM; on the CPU (or with
    ``backend="reference"``) the torch reference.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        segments: Optional[Sequence[int]] = None,
        device=None,
        backend: str = "auto",
    ):
        super().__init__()
        in_features = _validate.positive_int("in_features", in_features)
        out_features = _validate.positive_int("out_features", out_features)
        _validate.flag("bias", bias)
        layout.check_shape(out_features, in_features, k_multiple=layout.K_MULTIPLE, name="BitLinear")
        self.in_features = in_features
        self.out_features = out_features
        self.segments = _segments(segments, out_features)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        self.register_buffer(
            "weight_packed",
            torch.zeros(out_features, in_features // layout.CODES_PER_BYTE, dtype=torch.int8, device=device),
        )
        self.register_buffer("weight_scale", torch.ones(len(self.segments), dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float32, device=device))
        else:
            self.bias = None

    @classmethod
    def from_float(cls, linear: nn.Linear, segments: Optional[Sequence[int]] = None, backend: str = "auto") -> "BitLinear":
        """Quantize a float ``nn.Linear`` (weights ternary per segment, bias kept in fp32)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        _, hf_auto = _hf_bitnet_classes()
        if hf_auto and isinstance(linear, hf_auto) and not linear.online_quant:
            raise TypeError("linear is transformers' offline AutoBitLinear (ternary weights beside a weight_scale): "
                            "from_float would quantize them again without the scale; bd.bitnet.convert(model) "
                            "converts it")
        w = linear.weight.detach()
        mod = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            segments=segments,
            device=w.device,
            backend=backend,
        )
        q, scales = quantize_weight(w, mod.segments)
        mod.weight_packed.copy_(pack_weight(q))
        mod.weight_scale.copy_(scales)
        if linear.bias is not None:
            mod.bias.copy_(linear.bias.detach().float())
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x must have {self.in_features} features in its last dimension, got shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        if x.numel() == 0:
            return x.new_empty(*lead, self.out_features)
        carried = _carried_quantization(x)  # an RMSNormQuant output: quantized already
        if carried is not None:
            q, s = carried[0].reshape(-1, self.in_features), carried[1].reshape(-1)
        else:
            q, s = quantize_activation(x.reshape(-1, self.in_features), backend=self.backend)
        if q.shape[0] == 1:
            y = gemv(q, self.weight_packed, s, self.weight_scale, self.segments, backend=self.backend)
        else:
            y = gemm(q, self.weight_packed, s, self.weight_scale, self.segments, backend=self.backend)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*lead, self.out_features)

    def _apply(self, fn, recurse=True):
        """A model's ``.half()`` / ``.to(dtype)`` casts every floating buffer; the scales and
        the bias stay the fp32 the kernels take (the values held before, not a round trip
        through the new dtype), and only follow the device."""
        fp32 = {n: t for n, t in (("weight_scale", self.weight_scale), ("bias", self.bias)) if t is not None}
        super()._apply(fn, recurse)
        for name, before in fp32.items():
            now = self._buffers[name]
            if now.dtype != before.dtype:
                self._buffers[name] = before.to(now.device)
        return self

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"segments={self.segments}, bias={self.bias is not None}"
        )


# --------------------------------------------------------------------------------------
# Whole-model conversion (transformers' BitNetForCausalLM and BitNet-quantized models)
# --------------------------------------------------------------------------------------

# Fused groups: projections that read the same input become one BitLinear whose segments
# are their row counts (each keeps its own scale), registered on the parent under this name.
FUSED_GROUPS = ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj"))

_HF_BITNET = "transformers.integrations.bitnet"


def _hf_bitnet_classes():
    """transformers' ``BitLinear`` / ``AutoBitLinear`` classes, if that module is loaded
    (a model holding them has imported it; nothing here imports transformers)."""
    import sys

    mod = sys.modules.get(_HF_BITNET)
    if mod is None:
        return (), ()
    return (mod.BitLinear,), (mod.AutoBitLinear,)


def _unpack_hf_rows(packed: torch.Tensor, n: int) -> torch.Tensor:
    """transformers' packed BitNet weights (uint8 [ceil(N/4), K], four row blocks per
    byte, code ``w + 1`` in bits ``2i``) -> ternary int8 [N, K]; ``unpack_weights`` of
    ``transformers.integrations.bitnet`` without its torch.compile."""
    p = packed.to(torch.uint8)
    rows = torch.cat([(p >> (2 * i)) & 3 for i in range(4)], dim=0)[:n]
    return rows.to(torch.int8) - 1


def _ternary_of(values: torch.Tensor, what: str) -> torch.Tensor:
    t = values.float().round()
    if values.numel() and (not torch.equal(t, values.float()) or float(t.abs().max()) > 1):
        raise ValueError(f"{what}: an offline BitNet weight must hold ternary values (-1, 0, 1)")
    return t.to(torch.int8)


def _finite_scale(scale: torch.Tensor, name: str) -> torch.Tensor:
    """An offline layer's weight scale in bitdecode's meaning, refused where it is not finite
    (transformers' packed layer stores 1 / mean|W|: a zero there is an infinite scale)."""
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"{name}: its weight_scale gives the non-finite scale {scale.tolist()} (a zero or "
                         "non-finite weight_scale)")
    return scale


def _source(linear: nn.Module, name: str):
    """(ternary int8 [N, K], fp32 scale [1], fp32 bias [N] or None, in-linear RMSNorm or None)
    of one of the model's linear layers, with bitdecode's meaning of the scale
    (``W ~= ternary * scale``)."""
    hf_packed, hf_auto = _hf_bitnet_classes()
    norm = getattr(linear, "rms_norm", None)
    bias = getattr(linear, "bias", None)
    bias = None if bias is None else bias.detach().float()
    if hf_packed and isinstance(linear, hf_packed):
        # y = (q @ t.T) / (x_scale * weight_scale): weight_scale is 1 / mean|W|
        t = _unpack_hf_rows(linear.weight, linear.out_features)
        if t.numel() and int(t.max()) > 1:
            raise ValueError(f"{name}: transformers' packed BitNet weight holds the 2-bit code 3, no ternary value")
        scale = _finite_scale(1.0 / linear.weight_scale.detach().float().reshape(1), name)
        return t, scale, bias, norm
    if hf_auto and isinstance(linear, hf_auto) and not linear.online_quant:
        # y = (ActQuant(x) @ t.T + bias) * weight_scale, t stored unpacked
        t = _ternary_of(linear.weight.detach(), name)
        scale = _finite_scale(linear.weight_scale.detach().float().reshape(1), name)
        return t, scale, None if bias is None else bias * scale, norm
    # nn.Linear / AutoBitLinear online: float weights, bitdecode's rule (= WeightQuant per tensor)
    try:
        t, scale = quantize_weight(linear.weight.detach())
    except (TypeError, ValueError) as exc:  # (they name "w": say which layer's)
        raise type(exc)(f"cannot convert {name}: {exc}") from None
    return t, scale, bias, norm


def _convertible(module: nn.Module) -> bool:
    hf_packed, _ = _hf_bitnet_classes()
    return isinstance(module, nn.Linear) or bool(hf_packed and isinstance(module, hf_packed))


def _build(sources, names, in_features: int, device, backend: str) -> BitLinear:
    segs = tuple(t.shape[0] for t, *_ in sources)
    n = sum(segs)
    try:
        layer = BitLinear(in_features, n, bias=any(b is not None for _, _, b, _ in sources),
                          segments=segs if len(segs) > 1 else None, device=device, backend=backend)
    except ValueError as exc:
        raise ValueError(f"cannot convert {'/'.join(names)} ({n} x {in_features}): {exc}") from None
    layer.weight_packed.copy_(pack_weight(torch.cat([t for t, *_ in sources]).to(device)))
    layer.weight_scale.copy_(torch.cat([s for _, s, _, _ in sources]).to(device))
    if layer.bias is not None:
        layer.bias.copy_(torch.cat([b.to(device) if b is not None else torch.zeros(t.shape[0], device=device)
                                    for t, _, b, _ in sources]))
    return layer


class FusedSlice(nn.Module):
    """One projection of a fused ``BitLinear`` (``q_proj`` of ``qkv_proj``): the model's
    forward still calls ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)``; the first call on an
    input runs the fused layer (activations quantized once, one GEMV / GEMM for all
    segments) and keeps its output until every other slice has read its rows of it for the
    same input tensor (the same object, unchanged in place since: a different input, or the
    same one written to, runs the fused layer again).  Under ``torch.inference_mode`` a
    tensor has no version counter, so an in-place write between the slices' calls (which
    no model's attention or MLP forward makes) cannot be seen there."""

    def __init__(self, fused: BitLinear, index: int, memo: dict):
        super().__init__()
        if not isinstance(fused, BitLinear):
            raise TypeError(f"fused must be a BitLinear, got {type(fused).__name__}")
        index = _validate.integer("index", index)
        if not 0 <= index < len(fused.segments):
            raise ValueError(f"index must name one of fused's {len(fused.segments)} segments, got {index}")
        self.__dict__["fused"] = fused  # registered once, on the parent, not per slice
        self.__dict__["_memo"] = memo  # shared by the group's slices
        self.index = index
        self.start = sum(fused.segments[:index])
        self.stop = self.start + fused.segments[index]
        self.in_features, self.out_features = fused.in_features, fused.segments[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memo = self._memo
        # (compiling, the version is not read: the memo works as before it was checked)
        version = None if torch.compiler.is_compiling() else _validate.version_counter(x)
        if memo.get("x") is x and self.index in memo["pending"] and memo["version"] == version:
            out = memo["out"]
            memo["pending"].discard(self.index)
            if not memo["pending"]:
                memo.clear()
        else:
            out = self.fused(x)
            pending = set(range(len(self.fused.segments))) - {self.index}
            memo.clear()
            memo.update(x=x, version=version, out=out, pending=pending)
        return out[..., self.start : self.stop]

    def extra_repr(self) -> str:
        return f"rows {self.start}:{self.stop} of the fused {self.fused.extra_repr()}"


class RMSNormQuant(nn.Module):
    """An RMSNorm whose output carries its int8 quantization (``rms_norm_quantize``): the
    ``BitLinear`` layers that read the output use it instead of quantizing again, so
    BitNet's norm + quantizer become one kernel.  The output itself is the norm's (the
    model may read it anywhere); the attached quantization is dropped by any new tensor
    made from it (a view, a copy) and ignored once the output is changed in place.  Under
    ``torch.inference_mode`` (outputs without a version counter) and torch.compile the
    layers quantize their inputs themselves.  Holds the replaced norm's ``weight`` Parameter
    (same state-dict key) and ``variance_epsilon``."""

    def __init__(self, weight: nn.Parameter, eps: float, backend: str = "auto", gated: bool = False):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        _validate.tensor("weight", weight, ndim=1)
        _check_eps(eps)  # (here, not at the first forward, deep in a model)
        self.weight = weight
        self.variance_epsilon = float(eps)
        self.backend = backend
        self.gated = _validate.flag("gated", gated)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return _rms_norm(_relu2_times_up(x) if self.gated else x, self.weight, self.variance_epsilon)
        y, q, s = rms_norm_quantize(x, self.weight, self.variance_epsilon, gated=self.gated, backend=self.backend)
        version = _validate.version_counter(y)
        if version is not None:  # (an inference-mode output cannot show in-place changes: not carried)
            setattr(y, _ACT_ATTR, (q, s, version))
        return y

    def extra_repr(self) -> str:
        gate = ", of relu(gate)^2 * up" if self.gated else ""
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}{gate}, quantized output"


class FusedMLP(nn.Module):
    """BitNet's MLP on the fused gate / up layer: ``down_proj(ffn_sub_norm(relu(gate)^2 *
    up))`` with the activation, the product, the norm and the quantizer in one kernel
    (``RMSNormQuant(gated=True)``).  Keeps the replaced MLP's ``gate_up_proj``,
    ``down_proj`` and ``ffn_sub_norm`` (same state-dict keys) and its ``gate_proj`` /
    ``up_proj`` slices."""

    def __init__(self, mlp: nn.Module, backend: str = "auto"):
        super().__init__()
        if not _fusable_mlp(mlp):
            raise TypeError(f"mlp must be a BitNet MLP whose gate / up are one BitLinear (gate_up_proj, after "
                            f"convert(fuse=True)), got {type(mlp).__name__}")
        norm = mlp.ffn_sub_norm
        self.gate_up_proj = mlp.gate_up_proj
        self.down_proj = mlp.down_proj
        self.ffn_sub_norm = RMSNormQuant(norm.weight, norm.variance_epsilon, backend, gated=True)
        for name in FUSED_GROUPS[1][0]:
            self.add_module(name, getattr(mlp, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ffn_sub_norm(self.gate_up_proj(x)))


# BitNet b1.58's norms whose outputs only BitLinear layers read (per decoder layer)
NORMS_BEFORE_LINEARS = ("input_layernorm", "post_attention_layernorm", "self_attn.attn_sub_norm", "mlp.ffn_sub_norm")


# transformers' RMSNorms that compute ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)``
# in fp32 with a ``variance_epsilon`` (their forwards are LlamaRMSNorm's, line for line;
# tests/test_hf.py checks that against the installed transformers), the maths of the norm
# kernels.  Gemma's (1 + weight) is not one of them.
RMS_NORM_CLASSES = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "SmolLM3RMSNorm",
                    "Phi3RMSNorm", "BitNetRMSNorm")


def is_rms_norm(module) -> bool:
    """Whether ``module`` is one of transformers' ``RMS_NORM_CLASSES`` (1-D weight, float
    ``variance_epsilon``): a norm ``rms_norm`` computes."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ in RMS_NORM_CLASSES and isinstance(weight, nn.Parameter) and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), float))


def _fusable_mlp(mlp) -> bool:
    """BitNet's MLP (``act_fn(gate) * up`` through ``ffn_sub_norm`` into ``down_proj``,
    transformers' ``BitNetMLP``) with relu^2 and gate / up fused into one BitLinear."""
    gate_up = getattr(mlp, "gate_up_proj", None)
    return (type(mlp).__name__ == "BitNetMLP" and type(getattr(mlp, "act_fn", None)).__name__ == "ReLUSquaredActivation"
            and isinstance(gate_up, BitLinear) and len(gate_up.segments) == 2
            and gate_up.segments[0] == gate_up.segments[1] and isinstance(getattr(mlp, "down_proj", None), BitLinear)
            and is_rms_norm(getattr(mlp, "ffn_sub_norm", None)))


def _fuse_norms(model: nn.Module, backend: str) -> None:
    """Put ``RMSNormQuant`` in place of each decoder layer's ``NORMS_BEFORE_LINEARS`` that
    is one of transformers' RMSNorms (``is_rms_norm``), and ``FusedMLP`` in place
    of a BitNet MLP whose gate / up are one BitLinear."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    for layer in layers if isinstance(layers, nn.ModuleList) else ():
        if _fusable_mlp(getattr(layer, "mlp", None)):
            layer.mlp = FusedMLP(layer.mlp, backend)
        for path in NORMS_BEFORE_LINEARS:
            parent_path, _, name = path.rpartition(".")
            try:
                parent = layer.get_submodule(parent_path) if parent_path else layer
            except AttributeError:
                continue
            norm = getattr(parent, name, None)
            if is_rms_norm(norm):
                setattr(parent, name, RMSNormQuant(norm.weight, norm.variance_epsilon, backend))


def _install_fused(parent: nn.Module, members, fused_name: str, fused: BitLinear) -> None:
    """The fused ``BitLinear`` ``fused`` registered on ``parent`` as ``fused_name``, with
    ``FusedSlice`` views of it under the member names."""
    parent.add_module(fused_name, fused)
    memo: dict = {}
    for i, m in enumerate(members):
        setattr(parent, m, FusedSlice(fused, i, memo))


def _is_bitnet(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) == "bitnet":
        return True
    qc = getattr(config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    if str(getattr(method, "value", method)) == "bitnet":
        return True
    hf_packed, hf_auto = _hf_bitnet_classes()
    return any(isinstance(m, hf_packed + hf_auto) for m in model.modules())


def _check_model_arguments(model: nn.Module, fuse, fuse_norms) -> None:
    """What ``convert`` and ``load_int2_checkpoint`` both refuse: non-bool ``fuse`` /
    ``fuse_norms``, a model with no data (meta weights) and one these already ran on
    (its ``FusedMLP`` would keep the old ``gate_up_proj``, a second backend would mix
    with the first: a fresh model is the one safe start)."""
    _validate.flag("fuse", fuse)
    _validate.flag("fuse_norms", fuse_norms)
    done = next((name for name, m in model.named_modules()
                 if isinstance(m, (BitLinear, FusedSlice, FusedMLP, RMSNormQuant))), None)
    if done is not None:
        raise ValueError(f"model already holds bitdecode layers ({done or 'the model itself'}): convert or "
                         "load_int2_checkpoint ran on it; start from a fresh transformers model")
    meta = next((name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta), None)
    if meta is not None:
        raise ValueError(f"model's weights are on the meta device ({meta}: no data); materialize them first "
                         "(model.to_empty(device=...), then load them)")


@torch.no_grad()
def convert(
    model: nn.Module, *, backend: str = "auto", fuse: bool = True, fuse_norms: bool = True, skip: Sequence[str] = ()
) -> nn.Module:
    """Swap a transformers BitNet model's linear layers for bitdecode ``BitLinear`` (in
    place; returns ``model``).

    Every linear layer except the output embeddings (``lm_head``) and the qualified
    module names in ``skip`` is converted: attention q/k/v/o and MLP gate/up/down of
    ``BitNetForCausalLM``, or the ``BitLinear`` / ``AutoBitLinear`` layers of a model
    loaded with a BitNet ``quantization_config``.  Weights are packed once into
    microsoft/BitNet's int2 layout:

    * float weights (``nn.Linear``; ``AutoBitLinear`` online) are quantized with
      ``quantize_weight``, one ``mean|W|`` scale per projection, as transformers'
      ``WeightQuant`` does per tensor;
    * transformers' packed ``BitLinear`` (what ``microsoft/bitnet-b1.58-2B-4T`` loads
      into) keeps its ternary values, scale ``1 / weight_scale``; offline
      ``AutoBitLinear`` keeps its ternary values, scale ``weight_scale``.

    ``fuse=True``: q/k/v become one ``qkv_proj`` and gate/up one ``gate_up_proj``
    (segments with their own scales, registered on the attention / MLP module), and
    ``q_proj`` ... ``up_proj`` become ``FusedSlice`` views of it, so the model's forward is
    unchanged and runs one activation quantization and one GEMV / GEMM per group.  A group
    whose layers carry their own RMSNorm (``use_rms_norm``) is not fused.
    ``fuse_norms=True``: the four norms of each decoder layer that feed linear layers
    (``NORMS_BEFORE_LINEARS``) become ``RMSNormQuant`` (same weight; their output carries
    its int8 quantization, one kernel for norm and quantizer), and with ``fuse`` the MLP
    becomes ``FusedMLP`` (relu^2, the product with up, the norm and the quantizer in that
    one kernel).  Embeddings, ``lm_head``
    and the final norm stay as they are.  ``backend`` goes to every ``BitLinear`` and
    ``RMSNormQuant`` ("auto": kernels on CUDA, the torch
    reference on the CPU).  The result is for inference; its state dict holds bitdecode's
    buffers (``weight_packed``, ``weight_scale``), not a transformers checkpoint.  A later
    ``.to(device)`` or ``.to(dtype)`` is fine (``BitLinear`` keeps its scales and bias fp32).
    A model that ``convert`` or ``load_int2_checkpoint`` already ran on is refused (a second
    run would mix two backends or keep the first fused MLP), as is one with meta weights.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _check_model_arguments(model, fuse, fuse_norms)
    if not _is_bitnet(model):
        raise ValueError(
            "model is not a BitNet model (config.model_type 'bitnet', a BitNet quantization_config, or "
            "transformers' BitLinear layers): ternary weights would destroy a full-precision model"
        )
    skipped = _names("skip", skip)
    names = {id(m): name for name, m in model.named_modules()}
    unknown = sorted(skipped - set(names.values()))
    if unknown:
        raise ValueError(f"skip names modules the model does not have: {unknown}")
    get_out = getattr(model, "get_output_embeddings", None)
    lm_head = get_out() if callable(get_out) else None

    def wanted(module) -> bool:
        return _convertible(module) and module is not lm_head and names.get(id(module)) not in skipped

    # every layer is built (and a shape the kernels cannot take refused) before any is
    # swapped in: a refused conversion leaves the model as it was
    swaps, fused_members = [], set()
    for parent in list(model.modules()):
        if fuse:
            for members, fused_name in FUSED_GROUPS:
                mods = [getattr(parent, m, None) for m in members]
                if not all(isinstance(m, nn.Module) and wanted(m) for m in mods):
                    continue
                if len({m.in_features for m in mods}) != 1 or hasattr(parent, fused_name):
                    continue
                sources = [_source(m, names[id(m)]) for m in mods]
                if any(norm is not None for *_, norm in sources):
                    continue  # per-projection RMSNorms: the inputs differ, convert one by one
                fused = _build(sources, [names[id(m)] for m in mods], mods[0].in_features, mods[0].weight.device,
                               backend)
                swaps.append(functools.partial(_install_fused, parent, members, fused_name, fused))
                fused_members.update(id(m) for m in mods)
        for child_name, child in list(parent.named_children()):
            if not wanted(child) or id(child) in fused_members:
                continue
            name = names[id(child)]
            src = _source(child, name)
            layer = _build([src], [name], child.in_features, child.weight.device, backend)
            norm = src[3]
            swaps.append(functools.partial(setattr, parent, child_name,
                                           layer if norm is None else nn.Sequential(norm, layer)))
    for swap in swaps:
        swap()
    if fuse_norms:
        _fuse_norms(model, backend)
    return model


def _names(name: str, value) -> set:
    """A collection of qualified module names (a lone str is refused: it is not a set of
    its characters), as a set."""
    try:
        items = None if isinstance(value, str) else list(value)
    except TypeError:
        items = None
    if items is None or not all(isinstance(x, str) for x in items):
        raise TypeError(f"{name} must be a collection of qualified module names (str), got {value!r}")
    return set(items)


# --------------------------------------------------------------------------------------
# microsoft/BitNet's converted checkpoint (gpu/convert_checkpoint.py: model_state_int2.pt)
# --------------------------------------------------------------------------------------

# per layer: microsoft's name -> (transformers module path, the projections it holds)
_MS_LINEARS = (("attention.wqkv", "self_attn", FUSED_GROUPS[0][0]), ("attention.wo", "self_attn", ("o_proj",)),
               ("feed_forward.w13", "mlp", FUSED_GROUPS[1][0]), ("feed_forward.w2", "mlp", ("down_proj",)))
_MS_NORMS = (("attention_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
             ("attention.attn_sub_norm", "self_attn.attn_sub_norm"),
             ("feed_forward.ffn_sub_norm", "mlp.ffn_sub_norm"))
_MS_GLOBALS = (("tok_embeddings.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight"),
               ("output.weight", "lm_head.weight"))


def _ms_rope_rows_to_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q / k projection from microsoft's order back to transformers': its
    converter interleaves each head's two RoPE halves, ``(h l d) -> (h d l)`` with l = 2
    (``convert_safetensors.invert_convert_q``), for xformers' interleaved rotary; here
    ``(h d l) -> (h l d)``."""
    n, k = t.shape
    return t.reshape(heads, n // heads // 2, 2, k).transpose(1, 2).reshape(n, k)


@torch.no_grad()
def load_int2_checkpoint(model: nn.Module, state, *, backend: str = "auto", fuse: bool = True,
                         fuse_norms: bool = True) -> nn.Module:
    """Load microsoft/BitNet's converted checkpoint into a transformers BitNet model (in
    place; returns ``model``) with bitdecode's ``BitLinear`` layers, as ``convert`` would
    make them.

    ``state``: the dict ``gpu/convert_checkpoint.py`` saves as ``model_state_int2.pt``
    (or its path): per layer ``attention.wqkv`` / ``attention.wo`` / ``feed_forward.w13``
    / ``feed_forward.w2`` as packed int8 ``[N, K/4]`` (its ``pack_weight.py`` layout,
    which is bitdecode's) with a bf16 ``weight_scale`` of four (one ``mean|W|`` per
    projection, zeros after), q and k rows in its interleaved-RoPE order; the norms, the
    embeddings and ``output``.  ``model``: a ``BitNetForCausalLM`` of the checkpoint's
    shape (e.g. built from ``BitNetConfig`` with the 2B shape: hidden 2560, 30 layers,
    heads 20 / 5, MLP 6912, vocabulary 128256, ``rope_theta`` 500000); its own weights are
    replaced.  ``fuse`` and ``fuse_norms`` as in ``convert``.  The result computes what ``convert`` makes of
    the float model that checkpoint was quantized from, with the scales in bf16 as
    microsoft's kernel reads them."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "bitnet":
        raise ValueError("model must be a transformers BitNetForCausalLM (config.model_type 'bitnet')")
    if not isinstance(getattr(getattr(model, "model", None), "layers", None), nn.ModuleList):
        raise ValueError(f"model must be a transformers BitNetForCausalLM (its decoder layers at model.model.layers), "
                         f"got {type(model).__name__}")
    _check_model_arguments(model, fuse, fuse_norms)
    if isinstance(state, (str, bytes)) or hasattr(state, "__fspath__"):
        path = state
        try:
            state = torch.load(os.fsdecode(path), map_location="cpu", weights_only=True)
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001 - what a truncated, foreign or unsafe pickle raises varies
            why = ": ".join([type(exc).__name__, *([" ".join(str(exc).split())[:200]] if str(exc) else [])])
            raise ValueError(f"state: cannot read {os.fsdecode(path)!r} as a torch checkpoint of tensors ({why})") \
                from exc
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict of tensors or a path, got {type(state).__name__}")

    def get(key: str) -> torch.Tensor:
        if key not in state:
            raise ValueError(f"state has no {key!r}: not a microsoft/BitNet model_state_int2.pt of this model's "
                             f"depth ({config.num_hidden_layers} layers)")
        return state[key]

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = model_head_dim(config)
    rows = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim, "v_proj": kv_heads * head_dim,
            "o_proj": config.hidden_size, "gate_proj": config.intermediate_size,
            "up_proj": config.intermediate_size, "down_proj": config.hidden_size}
    rope_heads = {"q_proj": heads, "k_proj": kv_heads}
    # every tensor is checked and every layer built before the model is touched: a
    # checkpoint refused part-way leaves the model as it was
    copies, swaps = [], []

    def copy_into(param: torch.Tensor, key: str) -> None:
        src = get(key)
        if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(param.shape):
            raise ValueError(f"state[{key!r}] must have shape {tuple(param.shape)} (this model's), got "
                             f"{tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__}")
        copies.append((param, src))

    depth = len(model.model.layers)  # (before any layer is unpacked and built)
    deeper = sorted({int(k.split(".")[1]) for k in state if isinstance(k, str) and k.startswith("layers.")
                     and k.split(".")[1].isdigit() and int(k.split(".")[1]) >= depth})
    if deeper:
        raise ValueError(f"state holds layers {deeper[0]}..{deeper[-1]} beyond this model's {depth}: a checkpoint "
                         "of a deeper model")
    params = dict(model.named_parameters())
    for ms_key, hf_key in _MS_GLOBALS:
        if hf_key in params:
            copy_into(params[hf_key], ms_key)
    for i, layer in enumerate(model.model.layers):
        for ms_name, hf_name in _MS_NORMS:
            copy_into(layer.get_submodule(hf_name).weight, f"layers.{i}.{ms_name}.weight")
        for ms_name, parent_name, members in _MS_LINEARS:
            fused_name = dict(FUSED_GROUPS).get(members)
            parent = layer.get_submodule(parent_name)
            key = f"layers.{i}.{ms_name}"
            packed, scales = get(f"{key}.weight"), get(f"{key}.weight_scale")
            k = getattr(getattr(parent, members[0], None), "in_features", config.hidden_size)
            _validate.tensor(f"state[{key + '.weight'!r}]", packed, ndim=2)
            _validate.tensor(f"state[{key + '.weight_scale'!r}]", scales, ndim=1)
            want = sum(rows[m] for m in members)
            kb = k // layout.CODES_PER_BYTE
            if tuple(packed.shape) != (want, kb):
                raise ValueError(f"state[{key + '.weight'!r}] must have shape ({want}, {kb}) (this model's "
                                 f"{'/'.join(members)}: {want} rows, K = {k} packed {layout.CODES_PER_BYTE} a "
                                 f"byte), got {tuple(packed.shape)}")
            if scales.shape[0] < len(members):
                raise ValueError(f"state[{key + '.weight_scale'!r}] must hold one scale per projection "
                                 f"({len(members)}: {'/'.join(members)}), got {scales.shape[0]}")
            device = next(parent.parameters()).device
            t = unpack_weight(packed.to(torch.int8).to(device))
            if t.numel() and (int(t.min()) < -1 or int(t.max()) > 1):  # code 0 of the 2-bit field
                raise ValueError(f"state[{key + '.weight'!r}] holds a 2-bit code that is no ternary value: not "
                                 "microsoft/BitNet's pack_weight.py layout")
            scales = scales.float()
            used = scales[:len(members)]
            if not bool(torch.isfinite(used).all()) or bool((used == 0).any()):
                raise ValueError(f"state[{key + '.weight_scale'!r}] holds a zero or non-finite scale for "
                                 f"{'/'.join(members)}: {used.tolist()}")
            sources, start = [], 0
            for j, m in enumerate(members):
                part = t[start:start + rows[m]]
                start += rows[m]
                if m in rope_heads:
                    part = _ms_rope_rows_to_hf(part, rope_heads[m])
                sources.append((part, scales[j:j + 1].to(device), None, None))
            names = [f"model.layers.{i}.{parent_name}.{m}" for m in members]
            if fuse and fused_name is not None:
                fused = _build(sources, names, t.shape[1], device, backend)
                swaps.append(functools.partial(_install_fused, parent, members, fused_name, fused))
            else:
                for src, m, name in zip(sources, members, names):
                    swaps.append(functools.partial(setattr, parent, m, _build([src], [name], t.shape[1], device,
                                                                            backend)))
    for param, src in copies:
        param.copy_(src.to(param.dtype))
    for swap in swaps:
        swap()
    if fuse_norms:
        _fuse_norms(model, backend)
    return model
