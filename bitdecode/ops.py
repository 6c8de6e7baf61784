"""torch.library custom ops, so ``torch.compile`` traces around bitdecode calls.

``torch.ops.bitdecode.decode`` is ``decode_attention`` as an opaque op with a fake
(meta) implementation: a compiled graph keeps it as one node instead of breaking at the
Python dispatch, the kernel plans and the TVM-FFI launch.  The cache writes (append /
prefill) are not ops yet: their capacity check reads host-side lengths, which a compiled
graph cannot (issue 14's device-side guard comes first).
"""

from __future__ import annotations

from typing import Tuple

import torch

from . import attention
from .formats import KVFormat


@torch.library.custom_op("bitdecode::decode", mutates_args=())
def decode(q: torch.Tensor, k_pack: torch.Tensor, k_params: torch.Tensor, v_pack: torch.Tensor,
           v_params: torch.Tensor, k_res: torch.Tensor, v_res: torch.Tensor, cache_seqlens: torch.Tensor,
           block_table: torch.Tensor, bits: int, k_mode: str, group_size: int, softmax_scale: float,
           num_splits: int, backend: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """``decode_attention`` over the cache tensors: (out ``[B, 1, Hq, D]``, lse ``[B, 1, Hq]``).
    The values of the lengths and block table are not re-checked (no device sync)."""
    fmt = KVFormat(bits=bits, k_mode=k_mode, group_size=group_size)
    out, lse = attention.decode_attention(q, k_pack, k_params, v_pack, v_params, k_res, v_res, cache_seqlens,
                                          block_table, fmt=fmt, softmax_scale=softmax_scale,
                                          num_splits=num_splits, backend=backend, return_lse=True,
                                          check_values=False)
    return out, lse


@decode.register_fake
def _decode_fake(q, k_pack, k_params, v_pack, v_params, k_res, v_res, cache_seqlens, block_table, bits, k_mode,
                 group_size, softmax_scale, num_splits, backend):
    return torch.empty_like(q), q.new_empty((q.shape[0], 1, q.shape[2]), dtype=torch.float32)


def decode_cache(q: torch.Tensor, cache, softmax_scale: float, backend: str = "auto") -> torch.Tensor:
    """``bd.decode(q, cache)`` through the op (for compiled code): ``cache`` is a ``KVCache``."""
    t = cache.tensors()
    out, _ = torch.ops.bitdecode.decode(q, t.k_pack, t.k_params, t.v_pack, t.v_params, t.k_res, t.v_res,
                                        t.cache_seqlens, t.block_table, t.fmt.bits, t.fmt.k_mode,
                                        t.fmt.group_size, float(softmax_scale),
                                        0, cache.backend if backend == "auto" else backend)
    return out
