"""The 16-bit row kernels of a decode step (``kernels_sm80.dense``: GEMV, SwiGLU;
``kernels_sm80.rope``): how they cut rows into 16-byte loads, and what that requires of
the tensors the API hands them (``bitdecode.dense``, ``bitdecode.rope``)."""

from __future__ import annotations

from . import resources

VEC_BYTES = 16  # one vector load
ELEM_BYTES = 2  # fp16 / bf16
VEC = VEC_BYTES // ELEM_BYTES  # 16-bit values per load: channel counts and row strides are multiples
GEMV_ROW_STEP = VEC * resources.WARP  # values of a weight row one warp-wide load covers: K is a multiple
GEMV_MAX_TOKENS = 3  # rows of x the GEMV takes (more go to cuBLAS; kernels_sm80.dense says why)

__all__ = ["VEC_BYTES", "ELEM_BYTES", "VEC", "GEMV_ROW_STEP", "GEMV_MAX_TOKENS"]
