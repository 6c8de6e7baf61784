"""The sm100 backend: the tcgen05 block-scaled decode kernel for FP4 caches (``decode.DecodeSm100``).

Everything else is the sm80 family compiled for sm_100a (the packed bytes are the same on
every arch): prefill / append, the split-KV combine, and the decode of integer caches and
of FP4 caches with head dim 64.  The FP4 kernel has only been compiled (PTX checked, no
spills) and its arithmetic emulated on the CPU (``bitdecode.emulate_sm100``, ``tests/test_sm100_emulation``):
no Blackwell GPU has run it.  Its block-scaled MMA kinds take Q and P in FP4 too; each is
split into four FP4 terms (``layouts.sm100.OPERAND_TERMS``), which brings the output to the
16-bit operands' accuracy (emulated: 0.0002-0.0021 relative L2 against the reference over
the same cache; one term cost 0.12-0.22) and within the tolerance rule every backend is
held to.  So ``auto`` takes it on compute capability 10.x for FP4 caches at head dims 128
and 256, once ``auto``'s first-use check of an unvalidated backend (``bitdecode.selfcheck``)
has passed on the device: the reference's tolerance rule, and its own spec (the emulation).
``bitdecode selfcheck --backend sm100 --fp4 nvfp4`` runs that check by hand.
"""

from __future__ import annotations

from typing import Tuple

from .. import jit
from ..formats import KVFormat
from ..kernels_sm80 import backend as sm80_backend

HEAD_DIMS = (128, 256)  # V^T's rows are the MMA's M = 128


class Sm100Backend(sm80_backend.Sm80Backend):
    """Blackwell (sm_100a code); the decode plan, writes and limits of sm80 otherwise."""

    name = "sm100"
    hardware_validated = False  # compiled and emulated only

    def supports(self, capability: Tuple[int, int]) -> bool:
        return capability[0] == 10

    def auto_picks(self, fmt: KVFormat, head_dim: int, dtype=None) -> bool:
        """FP4 caches at head dims 128 / 256 (the tcgen05 kernel); the rest of this backend
        is sm80's, which ``auto`` reaches through the sm80 backend (validated on hardware)."""
        return self.runs_tcgen05(fmt, head_dim)

    def fp4_operands(self, fmt: KVFormat, head_dim: int) -> bool:
        return self.runs_tcgen05(fmt, head_dim)

    def runs_tcgen05(self, fmt: KVFormat, head_dim: int, tq: int = 1) -> bool:
        """Whether a decode request gets the tcgen05 kernel (else the sm80 one)."""
        return bool(fmt.fp4) and head_dim in HEAD_DIMS and tq == 1

    def make_decode(self, arch, fmt, dtype, head_dim, nh, split, tq=1, variant="", append=False):
        if not self.runs_tcgen05(fmt, head_dim, tq) or variant or append:  # (sm80's appends; FP4 never does)
            return super().make_decode(arch, fmt, dtype, head_dim, nh, split, tq, variant, append)
        from .decode import DecodeSm100

        sm80_backend.check_decode_request(fmt, tq)
        if arch != "sm_100a":
            raise ValueError(f"the sm100 decode kernel (tcgen05) compiles for sm_100a only, got {arch!r}")
        return DecodeSm100(dtype, fmt.fp4, head_dim, nh, split, pdl=jit.has_pdl(arch), sinks=fmt.sink_tokens)


BACKEND = Sm100Backend()


def compile_decode(arch: str, fmt: KVFormat, dtype, head_dim: int, nh: int, split: bool, keep_ptx: bool = False):
    """The sm100 backend's decode kernel for ``fmt`` (``Sm100Backend.compile_decode``)."""
    return BACKEND.compile_decode(arch, fmt, dtype, head_dim, nh, split, keep_ptx=keep_ptx)
