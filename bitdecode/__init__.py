"""bitdecode: low-bit KV-cache decode attention (BitDecoding) and BitNet W2A8 kernels.

Kernels are written in the CUTLASS Python DSL (CuTe DSL), compiled just in time and called
from PyTorch.  Quick start::

    import bitdecode as bd
    fmt = bd.KVFormat(bits=4, k_mode="channel", group_size=128)
    cache = bd.KVCache.allocate(batch, num_kv_heads, head_dim, max_seqlen, fmt)
    cache.prefill(k, v)                     # [B, N, Hkv, D]
    cache.append(k_new, v_new)              # [B, T, Hkv, D]
    out = bd.decode(q, cache)               # q: [B, 1, Hq, D]
"""

from . import layouts, reference
from . import bitnet  # BitNet W2A8: bd.bitnet.quantize_weight / pack_weight / gemv / gemm / BitLinear
from . import bitnet_tune  # measured GEMV configurations (bd.bitnet.tune_gemv): bd.bitnet_tune.load / save
from . import dense, rope  # a decode step's other kernels: bd.dense.linear / silu_mul, bd.rope.apply_rotary
from .attention import decode_attention
from .cache import CacheOverflowError, KVCache, decode
from .formats import KVFormat

__version__ = "0.1.0"

__all__ = ["KVFormat", "KVCache", "CacheOverflowError", "decode", "decode_attention", "reference", "layouts", "__version__"]
