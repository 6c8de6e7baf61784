"""The 16-bit dense layers of a decode step as bitdecode kernels: a projection's GEMV for a
few tokens and SwiGLU's ``silu(gate) * up``.

``linear(x, weight, bias)`` is ``torch.nn.functional.linear``: for at most ``GEMV_MAX_TOKENS``
rows of ``x`` it runs the backend's GEMV (``Backend.dense``; every backend's is sm80's
``kernels_sm80.dense.GemvSm80``: each warp streams a few weight rows
once, and on sm_90+ starts fetching them while the previous kernel finishes), otherwise
cuBLAS through torch.  Its sums run in another order than cuBLAS's, so outputs agree to the
16-bit rounding, not bit for bit.  ``backend="kernel"`` with ``GEMV_MAX_TOKENS`` to
``SMALL_M_MAX_TOKENS`` rows runs ``kernels_sm80.dense.GemmSmallMSm80`` (mma.sync, the weights
streamed straight into the MMA's registers); "auto" takes each kernel only where it measured
faster than cuBLAS (``small_m_wins``: 3-16 tokens on weights up to q/k/v's size;
``gemv_wins``).  ``silu_mul(gate_up)`` is ``F.silu(gate) * up`` over the
halves of the last dim, bit for bit, in one launch.  ``bitdecode.hf.fuse_projections(model)``
puts both in a transformers model's layers.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _validate, dispatch
from .layouts import dense as layout

BACKENDS = dispatch.KERNEL_CHOICES
GEMV_MAX_TOKENS = layout.GEMV_MAX_TOKENS
SMALL_M_MAX_TOKENS = layout.SMALL_M_MAX_TOKENS


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % layout.VEC_BYTES == 0


# --------------------------------------------------------------------------------------
# GEMV
# --------------------------------------------------------------------------------------


def _check_linear(x, weight, bias) -> None:
    _validate.tensor("x", x)
    _validate.tensor("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be (N, K), got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x's last dim must be weight's K = {weight.shape[1]}, got x of shape {tuple(x.shape)}")
    if bias is not None:
        _validate.tensor("bias", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must be ({weight.shape[0]},) for weight {tuple(weight.shape)}, "
                             f"got {tuple(bias.shape)}")


def _check_torch_operands(x, weight, bias) -> None:
    """One device and dtype for torch's ``linear`` (the kernels' own fit, ``dispatch.
    float16_kernel_fit``, already asks it of theirs): torch's product of a CPU x and a meta
    weight returns uninitialized memory, and other mixes fail inside torch."""
    _validate.same_device(x=x, weight=weight, bias=bias)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {t.dtype}")


def _gemv_rows(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]):
    """(why the GEMV kernel cannot run ``linear(x, weight, bias)``, "" when it can; x as the
    kernel's [tokens, K] rows when it can, else None)."""
    ts = (x, weight) if bias is None else (x, weight, bias)
    why = dispatch.float16_kernel_fit(ts)
    if why:
        return why, None
    tokens, k = _tokens(x), weight.shape[1]
    if not 1 <= tokens <= GEMV_MAX_TOKENS:
        return f"1 to {GEMV_MAX_TOKENS} rows of x (backend='kernel': up to {SMALL_M_MAX_TOKENS} on the small-M GEMM; " \
               f"more go to cuBLAS), got {tokens}", None
    if k % layout.GEMV_ROW_STEP:
        return f"K a multiple of {layout.GEMV_ROW_STEP}, got {k}", None
    if bias is not None and not bias.is_contiguous():
        return f"a contiguous bias, got stride {bias.stride()}", None
    return _weight_and_rows(x, weight)


def _weight_and_rows(x: torch.Tensor, weight: torch.Tensor):
    """(why the projection kernels cannot read ``weight`` and ``x``'s rows, "" when they can;
    x as [tokens, K] rows when they can, else None)."""
    if not weight.is_contiguous() or not _aligned(weight) or weight.shape[0] == 0:
        return f"a contiguous, 16-byte aligned, non-empty weight, got strides {weight.stride()}", None
    rows = x.reshape(-1, weight.shape[1])
    if rows.stride(1) != 1 or rows.stride(0) % layout.VEC or not _aligned(rows):
        return f"x with contiguous channels, a row stride that is a multiple of {layout.VEC} and 16-byte aligned " \
               f"storage, got strides {x.stride()}", None
    return "", rows


def _small_m_rows(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]):
    """(why the small-M GEMM cannot run ``linear(x, weight, bias)``, "" when it can; x as
    its [tokens, K] rows when it can, else None); ``linear`` sends it 1 to
    ``SMALL_M_MAX_TOKENS`` rows only."""
    why = dispatch.float16_kernel_fit((x, weight))
    if why:
        return why, None
    if bias is not None:
        return "no bias", None
    if weight.shape[1] % layout.SMALL_M_K_STEP:
        return f"K a multiple of {layout.SMALL_M_K_STEP}, got {weight.shape[1]}", None
    return _weight_and_rows(x, weight)


def _tokens(x: torch.Tensor) -> int:
    """Rows of ``x`` [..., K]: the tokens a projection takes."""
    return x.numel() // max(x.shape[-1], 1)


# Which kernel "auto" runs, from one H200 sweep (bf16, graph of back-to-back calls from HBM,
# profiles/h200/dense_small_m_sweep.json, us, GEMV / small-M GEMM / cuBLAS at the Llama-3-8B
# decode shapes):
#   o_proj 4096 x 4096   2 tokens 11.7 / 11.9 / 13.1, 3: 16.3 / 11.9 / 13.1, 4-16: - / 11.9-12.0 / 13.0-13.4
#   q/k/v 6144 x 4096    2 tokens 15.1 / 15.2 / 16.0, 3: 18.3 / 15.2 / 15.9, 4: - / 15.2 / 15.9,
#                        8: - / 15.5 / 15.7, 16: - / 15.7 / 15.7
#   gate/up 28672 x 4096 2 tokens 57.5 / 63.0 / 55.4, 3: 69.0 / 63.3 / 55.4, 4-16: cuBLAS 55-56 ahead of 63-67
#   down 4096 x 14336    2 tokens 28.3 / 37.6 / 31.4, 3: 28.8 / 37.6 / 31.7, 4-16: cuBLAS 32 ahead of 35-38
# (one token: the GEMV, level with cuBLAS on gate/up and ahead elsewhere, profiles/h200/dense.json).
# So the small-M GEMM from 3 tokens on weights of at most q/k/v's size, the GEMV for fewer
# tokens except on large weights with more rows than columns (gate/up), cuBLAS otherwise.
SMALL_M_AUTO_WEIGHTS = 6144 * 4096
# The fused residual read with a row's first weights, not after its reduction
# (``kernels_sm80.dense.GemvSm80.residual_ahead`` and the small-M GEMM's): a global round
# trip off the o_proj and down_proj of every layer.  With ``NORM_PREFETCH`` (H200, Llama-3.1-8B
# shape, bd4-all graph step / roofline, without / with both,
# profiles/h200/e2e_ahead_ab.json): B=1 N=128K 1.294 / 1.281, B=8 N=64K 1.294 / 1.279.
# ``profiles/bench_e2e.py --no-dense-residual-ahead`` clears it for an A/B (read when a
# kernel is first built: set it before the first call).
RESIDUAL_AHEAD = True
SMALL_M_AUTO_MIN_TOKENS = 3


def small_m_wins(tokens: int, n: int, k: int) -> bool:
    """Whether "auto" runs an (N, K) projection of ``tokens`` rows on the small-M GEMM."""
    return SMALL_M_AUTO_MIN_TOKENS <= tokens <= SMALL_M_MAX_TOKENS and n * k <= SMALL_M_AUTO_WEIGHTS


def gemv_wins(tokens: int, n: int, k: int) -> bool:
    """Whether "auto" runs an (N, K) projection of ``tokens`` (at most ``GEMV_MAX_TOKENS``)
    rows on the GEMV: always for one token; for more, not on large weights with more rows
    than columns, where cuBLAS measured faster."""
    return tokens == 1 or n * k <= SMALL_M_AUTO_WEIGHTS or n <= k


def gemv_fits(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> str:
    """Why the GEMV kernel cannot run ``linear(x, weight, bias)`` ("" when it can)."""
    return _gemv_rows(x, weight, bias)[0]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
           backend: str = "auto", residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)`` (x [..., K], weight [N, K], bias [N]);
    with ``residual`` ([..., N], x's dtype and device) ``residual + linear(x, weight, bias)``
    as torch computes it (the product rounded, then the add), in the GEMV's own epilogue
    where the kernel runs and there is no bias.

    ``backend``: "kernel" runs bitdecode's kernel for the shape, or raises a ValueError
    saying why it cannot: the small-M GEMM on the tensor cores (no bias) for
    ``GEMV_MAX_TOKENS`` + 1 to ``SMALL_M_MAX_TOKENS`` rows and where ``small_m_wins`` (from
    3 tokens on weights of at most 6144 x 4096 values), else the GEMV (at most
    ``GEMV_MAX_TOKENS`` rows); both need K % 256 == 0 and one fp16 / bf16 dtype on an
    sm_80+ GPU, no autograd (``gemv_fits``).  "auto" runs that kernel where it takes the
    tensors and measured faster than cuBLAS (``small_m_wins``, ``gemv_wins``), else torch's
    ``linear``; "reference" always torch's.  Under ``torch.compile``: torch's.

    On the H200 (bf16, one token, graph-captured, weights from HBM; profiles/h200/dense.json)
    against cuBLAS at the Llama-3-8B decode shapes: o_proj 4096 x 4096 10.5 us vs 13.3, q/k/v
    6144 x 4096 14.3 vs 16.2, gate/up 28672 x 4096 57.1 vs 57.0, down 4096 x 14336 27.7 vs
    32.5; at 3 tokens it loses on three of the four (0.82-0.87x)."""
    dispatch.check_kernel_choice(backend)
    _check_linear(x, weight, bias)
    if residual is not None:
        _validate.tensor("residual", residual, dtypes=[x.dtype], shape=(*x.shape[:-1], weight.shape[0]),
                         device=x.device)
    tokens, (n, k) = _tokens(x), weight.shape
    if tokens <= SMALL_M_MAX_TOKENS and (tokens > GEMV_MAX_TOKENS or (bias is None and small_m_wins(tokens, n, k))):
        (why, rows), run, what, wins = _small_m_rows(x, weight, bias), _gemm_small_m, "small-M GEMM", small_m_wins
    else:
        (why, rows), run, what, wins = _gemv_rows(x, weight, bias), _gemv, "GEMV", gemv_wins
    if backend == "auto" and not why and not wins(tokens, n, k):
        why = "a shape where it measured faster than cuBLAS"
    if not dispatch.kernel_runs(backend, why, what):
        _check_torch_operands(x, weight, bias)
        y = torch.nn.functional.linear(x, weight, bias)
        return y if residual is None else residual + y
    in_kernel = residual is not None and bias is None  # (the epilogues add a residual or a bias)
    y = run(rows, weight, bias, residual.reshape(rows.shape[0], -1).contiguous() if in_kernel else None)
    y = y.view(*x.shape[:-1], y.shape[1])
    return y if residual is None or in_kernel else residual + y


# (device index, dtype, N, K, tokens, bias, residual, RESIDUAL_AHEAD) -> (compiled GEMV, rows per warp): a
# decode step calls the same few projections every layer, so the per-call host work is this lookup
_GEMV_PLANS: dict = {}


def kernels_for(arch: str):
    """The dense kernels of ``arch``'s backend (``backend.Backend.dense``: the arch decides,
    as for ``bitdecode compile --arch``)."""
    from . import backend

    return backend.of_arch(arch).dense


def _gemv_plan(device: torch.device, dtype: torch.dtype, n: int, k: int, tokens: int, has_bias: bool,
               has_residual: bool = False):
    from . import jit
    from .backend import num_sms

    arch = jit.target_arch(device.index)
    kernels = kernels_for(arch)
    bf16 = dtype == torch.bfloat16

    ahead = has_residual and RESIDUAL_AHEAD

    def build():
        return kernels.compile_gemv(bf16, k, tokens, has_bias, jit.compile_options(arch), pdl=jit.has_pdl(arch),
                                    has_residual=has_residual, residual_ahead=ahead)

    key = ("gemv", arch, bf16, k, tokens, has_bias, has_residual, ahead)
    return jit.KERNELS.get(key, build), kernels.gemv_rows_per_warp(n, k, num_sms(device))


def _gemv(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
          residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The kernel on ``x2`` [tokens, K] (``_gemv_rows``'): y [tokens, N] (plus ``residual``
    [tokens, N], contiguous, with no bias)."""
    n, k = weight.shape
    tokens = x2.shape[0]
    key = (x2.device.index, x2.dtype, n, k, tokens, bias is not None, residual is not None, RESIDUAL_AHEAD)
    plan = _GEMV_PLANS.get(key)
    if plan is None:
        plan = _GEMV_PLANS[key] = _gemv_plan(x2.device, x2.dtype, n, k, tokens, bias is not None,
                                             residual is not None)
    fn, rows_per_warp = plan
    y = torch.empty(tokens, n, dtype=x2.dtype, device=x2.device)
    if residual is not None:
        fn(x2, weight, residual, y, rows_per_warp)
    elif bias is None:
        fn(x2, weight, y, rows_per_warp)
    else:
        fn(x2, weight, bias, y, rows_per_warp)
    return y


def _gemm_small_m(x2: torch.Tensor, weight: torch.Tensor, bias: None = None,
                  residual: Optional[torch.Tensor] = None, config: Optional[tuple] = None) -> torch.Tensor:
    """``GemmSmallMSm80`` on ``x2`` [tokens, K] (``_small_m_rows``': no bias, the argument
    only mirrors ``_gemv``'s): y [tokens, N] (plus ``residual`` [tokens, N], contiguous).
    ``config``: (warps, batch, row blocks a CTA) other than the kernel's defaults
    (``profiles/bench_dense.py --small-m`` times them)."""
    from . import jit

    assert bias is None, "the small-M GEMM takes no bias"
    arch = jit.target_arch(x2.device.index)
    bf16, k, tokens = x2.dtype == torch.bfloat16, weight.shape[1], x2.shape[0]
    has_residual = residual is not None
    extra = {} if config is None else dict(zip(("warps", "batch", "row_blocks"), config))
    ahead = has_residual and RESIDUAL_AHEAD

    def build():
        return kernels_for(arch).compile_gemm_small_m(bf16, k, tokens, jit.compile_options(arch),
                                                      pdl=jit.has_pdl(arch), has_residual=has_residual,
                                                      residual_ahead=ahead, **extra)

    fn = jit.KERNELS.get(("gemm_small_m", arch, bf16, k, tokens, has_residual, config, ahead), build)
    y = torch.empty(tokens, weight.shape[0], dtype=x2.dtype, device=x2.device)
    if has_residual:
        fn(x2, weight, residual, y)
    else:
        fn(x2, weight, y)
    return y


# --------------------------------------------------------------------------------------
# SwiGLU
# --------------------------------------------------------------------------------------


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` with ``gate, up = gate_up.chunk(2, dim=-1)``: torch's ops."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _silu_mul_rows(gate_up: torch.Tensor):
    """(why the SwiGLU kernel cannot take ``gate_up``, "" when it can; its [M, 2I] rows when
    it can, else None)."""
    why = dispatch.float16_kernel_fit((gate_up,))
    if why:
        return why, None
    if gate_up.shape[-1] % (2 * layout.VEC):
        return f"a last dim that is a multiple of {2 * layout.VEC}, got {gate_up.shape[-1]}", None
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    if rows.stride(-1) != 1 or rows.stride(0) % layout.VEC or not _aligned(rows):
        return f"contiguous channels, a row stride that is a multiple of {layout.VEC} and 16-byte aligned storage, " \
               f"got strides {gate_up.stride()}", None
    return "", rows


def silu_mul_fits(gate_up: torch.Tensor) -> str:
    """Why the SwiGLU kernel cannot take ``gate_up`` ("" when it can)."""
    return _silu_mul_rows(gate_up)[0]


def silu_mul(gate_up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """SwiGLU's activation over a merged gate / up projection's output ``[..., 2I]`` (gate
    first): ``F.silu(gate) * up`` [..., I], bit-identical to torch's two ops, in one kernel.
    ``backend`` as ``linear``'s (the kernel: one fp16 / bf16 dtype on an sm_80+ GPU, I % 8 == 0)."""
    dispatch.check_kernel_choice(backend)
    _validate.tensor("gate_up", gate_up)
    if not gate_up.dtype.is_floating_point:
        raise TypeError(f"gate_up must be a floating-point tensor, got {gate_up.dtype}")
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be (..., 2I): gate then up, got shape {tuple(gate_up.shape)}")
    if gate_up.numel() == 0:
        return silu_mul_reference(gate_up)
    why, rows = _silu_mul_rows(gate_up)
    if not dispatch.kernel_runs(backend, why, "SwiGLU"):
        return silu_mul_reference(gate_up)
    from . import jit

    arch = jit.target_arch(gate_up.device.index)
    bf16 = gate_up.dtype == torch.bfloat16

    def build():
        return kernels_for(arch).compile_silu_mul(bf16, jit.compile_options(arch), pdl=jit.has_pdl(arch))

    fn = jit.KERNELS.get(("silu_mul", arch, bf16), build)
    y = torch.empty(rows.shape[0], rows.shape[1] // 2, dtype=gate_up.dtype, device=gate_up.device)
    fn(rows, y)
    return y.reshape(*gate_up.shape[:-1], y.shape[1])


__all__ = ["linear", "silu_mul", "silu_mul_reference", "gemv_fits", "silu_mul_fits", "GEMV_MAX_TOKENS",
           "SMALL_M_MAX_TOKENS", "small_m_wins", "gemv_wins", "BACKENDS"]
