"""Host-side helpers every kernel backend uses: fake tensors for compilation, dtypes, the
TVM-FFI stream argument."""

from __future__ import annotations

import torch

from ..layouts import sm80

_TORCH_TO_CUTE = {}


def cute_dtype(dtype: torch.dtype):
    import cutlass

    if not _TORCH_TO_CUTE:
        _TORCH_TO_CUTE.update({
            torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16,
            torch.float32: cutlass.Float32, torch.int32: cutlass.Int32,
        })
    return _TORCH_TO_CUTE[dtype]


# --------------------------------------------------------------------------------------
# Fake tensors for compilation
# --------------------------------------------------------------------------------------


def fake_tensor(dtype, shape):
    """Row-major fake tensor: ``None`` dims are symbolic; strides are static while every
    dim to their right is static, symbolic (``sm80.CHUNK_BYTES``-divisible) beyond that."""
    import cutlass.cute as cute

    div = max(8 * sm80.CHUNK_BYTES // dtype.width, 1)
    sizes = tuple(cute.sym_int() if s is None else s for s in shape)
    strides = []
    acc, dynamic = 1, False
    for i in reversed(range(len(shape))):
        if i == len(shape) - 1:
            strides.append(1)
            continue
        if not dynamic and shape[i + 1] is not None:
            acc *= shape[i + 1]
            strides.append(acc)
        else:
            dynamic = True
            strides.append(cute.sym_int64(divisibility=div))
    return cute.runtime.make_fake_tensor(dtype, sizes, stride=tuple(reversed(strides)), assumed_align=16)


def fake_vector(dtype, ndim: int):
    """Fake tensor with all sizes symbolic and only the last dim contiguous (4-byte aligned)."""
    import cutlass.cute as cute

    sizes = tuple(cute.sym_int() for _ in range(ndim))
    strides = tuple(cute.sym_int64() for _ in range(ndim - 1)) + (1,)
    return cute.runtime.make_fake_tensor(dtype, sizes, stride=strides, assumed_align=4)


def stream():
    import cutlass.cute as cute

    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


