"""The sm90 backend: the warp-specialized TMA + wgmma decode kernel (``decode.DecodeSm90``).

Everything but the decode kernel is shared with the sm80 backend, compiled for sm_90a: the
packed format is the same bytes on every arch, so prefill / append run the sm80 pack
kernels, and split-KV partials are merged by the sm80 combine kernel.
"""

from __future__ import annotations

from typing import Tuple

from .. import jit
from ..backend import num_sms
from ..formats import KVFormat
from ..layouts import sm80
from ..kernels_sm80 import backend as sm80_backend
from ..kernels_sm80.host import stream


def compile_decode(arch: str, fmt: KVFormat, dtype, head_dim: int, nh: int, split: bool, keep_ptx: bool = False):
    import cutlass
    import cutlass.cute as cute

    from .decode import DecodeSm90

    if arch != "sm_90a":
        raise ValueError(f"the sm90 decode kernel (wgmma, setmaxnreg) compiles for sm_90a only, got {arch!r}")
    kernel = DecodeSm90(dtype, fmt.bits, fmt.k_mode, fmt.group_size, head_dim, nh, split)
    args = sm80_backend.decode_args(fmt, dtype, head_dim, split)
    return cute.compile(kernel, *args, cutlass.Float32(1.0), stream(), options=jit.compile_options(arch, keep_ptx=keep_ptx))


def _decode_kernel(arch, fmt, dtype, d, nh, split):
    key = ("decode_sm90", arch, str(dtype), (fmt.bits, fmt.k_mode, fmt.group_size), d, nh, split)
    return jit.KERNELS.get(key, lambda: compile_decode(arch, fmt, dtype, d, nh, split))


class Sm90Backend(sm80_backend.Sm80Backend):
    """Hopper only (sm_90a code); the decode plan, writes and limits of sm80 otherwise."""

    name = "sm90"

    def supports(self, capability: Tuple[int, int]) -> bool:
        return capability[0] == 9

    def auto_picks(self, fmt: KVFormat, head_dim: int) -> bool:
        """4-bit up to head dim 128: faster than the sm80 kernels on the H200.  2-bit: not yet;
        head dim 256: its variants spill registers and are not measured (profiles/NOTES.md)."""
        return fmt.bits == 4 and head_dim <= 128

    def ctas_per_sm(self, fmt: KVFormat, head_dim: int, nh: int) -> int:
        from .decode import default_ctas_per_sm

        return default_ctas_per_sm(head_dim)

    def choose_splits(self, cache, q_shape, max_len: int, device) -> int:
        """Whole waves only: with two or one CTAs per SM a partial second wave costs as much
        as a full one (B=16, Hkv=8 on 132 SMs: 2 splits, not 3)."""
        bsz, _, hq, d = q_shape
        hkv = cache.k_res.shape[2]
        slots = num_sms(device) * self.ctas_per_sm(cache.fmt, d, sm80.heads_tile(hq // hkv))
        base = bsz * hkv
        if base >= slots:
            return 1
        tiles = max(1, -(-max_len // cache.fmt.residual_block))
        return max(1, min(slots // base, tiles // sm80_backend.MIN_TILES_PER_SPLIT, sm80.MAX_SPLITS))

    def decode_kernel(self, arch, fmt, dtype, head_dim, nh, split):
        return _decode_kernel(arch, fmt, dtype, head_dim, nh, split)

    def compile_decode(self, arch, fmt, dtype, head_dim, nh, split, keep_ptx=False):
        return compile_decode(arch, fmt, dtype, head_dim, nh, split, keep_ptx=keep_ptx)


BACKEND = Sm90Backend()
