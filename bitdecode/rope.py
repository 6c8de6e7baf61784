"""Rotary position embedding of queries and keys (transformers' ``apply_rotary_pos_emb``) as one kernel.

``apply_rotary(q, k, cos, sin)`` returns ``(q * cos + rotate_half(q) * sin, k * cos +
rotate_half(k) * sin)`` with ``cos`` / ``sin`` broadcast over the heads (transformers'
``unsqueeze_dim=1`` layout: q / k ``(B, H, T, D)``, cos / sin ``(B, T, D)``), bit for bit
what transformers' ten torch kernels return, in one launch of the backend's kernel
(``Backend.dense.compile_rope``: sm80's ``kernels_sm80.rope`` on every arch).
``bitdecode.hf.fuse_rope(model)`` installs it in a model's attention layers.
"""

from __future__ import annotations

from typing import Tuple

import torch

from . import _validate, dispatch
from .layouts.dense import VEC, VEC_BYTES

BACKENDS = dispatch.KERNEL_CHOICES


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``rotate_half``: ``cat(-x2, x1)`` over the last dim's halves."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``, op for op."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    for name, t, dim in (("q", q, 4), ("k", k, 4), ("cos", cos, 3), ("sin", sin, 3)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dim:
            want = "(B, H, T, D)" if dim == 4 else "(B, T, D)"
            raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    b, _, t, d = q.shape
    if k.shape[0] != b or k.shape[2] != t or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} must share q's batch, length and head dim {(b, t, d)}")
    for name, x in (("cos", cos), ("sin", sin)):
        if x.shape[0] not in (1, b) or tuple(x.shape[1:]) != (t, d):
            raise ValueError(f"{name} must be ({b} or 1, {t}, {d}) for q {tuple(q.shape)}, got {tuple(x.shape)}")
    if d % 2:
        raise ValueError(f"the head dim must be even to rotate its halves, got {d}")
    _validate.same_device(q=q, k=k, cos=cos, sin=sin)


def _kernel_fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str:
    """Why the kernel cannot take these tensors ("" when it can): one fp16 / bf16 dtype on one
    sm_80+ GPU without autograd, head dim a multiple of 16, channels contiguous, the other
    strides multiples of 8 values and 16-byte aligned storage (its 16-byte loads)."""
    ts = (q, k, cos, sin)
    why = dispatch.float16_kernel_fit(ts)
    if why:
        return why
    if q.shape[-1] % (2 * VEC):
        return f"a head dim that is a multiple of {2 * VEC}, got {q.shape[-1]}"
    for name, t in zip(("q", "k", "cos", "sin"), ts):
        if t.stride(-1) != 1 or any(s % VEC for s in t.stride()[:-1]) or t.data_ptr() % VEC_BYTES:
            return f"{name} with contiguous channels, strides that are multiples of {VEC} and 16-byte " \
                   f"aligned storage, got strides {t.stride()}"
    return ""


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                 backend: str = "auto") -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of ``q`` (B, Hq, T, D) and ``k`` (B, Hk, T, D) with ``cos`` / ``sin``
    (B or 1, T, D): transformers' ``apply_rotary_pos_emb``, bit-identical, outputs contiguous.
    ``backend``: "auto" the kernel for tensors it takes (see ``_kernel_fits``), else torch's
    ops; "reference" torch's ops; "kernel" the kernel or a ValueError saying why not.  Under
    ``torch.compile`` (and with autograd) torch's ops."""
    dispatch.check_kernel_choice(backend)
    _check(q, k, cos, sin)
    if not dispatch.kernel_runs(backend, _kernel_fits(q, k, cos, sin), "rotary-embedding"):
        return apply_rotary_reference(q, k, cos, sin)
    return _launch(q, k, cos.expand(q.shape[0], -1, -1), sin.expand(q.shape[0], -1, -1))


def _launch(q, k, cos, sin):
    from . import jit

    arch = jit.target_arch(q.device.index)
    bf16 = q.dtype == torch.bfloat16
    d = q.shape[-1]

    def build():
        from .dense import kernels_for  # (the arch's backend: ``Backend.dense``)

        return kernels_for(arch).compile_rope(bf16, d, jit.compile_options(arch))

    fn = jit.KERNELS.get(("rope", arch, bf16, d), build)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.shape[0] and q.shape[2]:  # (grid: a CTA per token and sequence)
        # (detached: DLPack refuses tensors that require grad; the kernel is inference only)
        fn(q.detach(), k.detach(), cos.detach(), sin.detach(), q_out, k_out)
    return q_out, k_out


__all__ = ["apply_rotary", "apply_rotary_reference", "rotate_half"]
