"""The sm80 backend: compile (once) and launch the Ampere-path kernels from torch.

Every kernel is compiled against fake tensors whose sizes are symbolic (batch, heads,
pages, page size, lengths, splits) and whose head dim and packing dims are static, so one
compilation per configuration serves every shape.  Calls go through TVM-FFI with the
torch tensors themselves (no DLPack wrapping in Python), on the current torch stream, so
they can be captured in CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Callable, List, Optional, Tuple

import torch

from .. import jit
from ..backend import CacheTensors, Limits, Variant, num_sms, query_rows
from ..formats import KVFormat
from ..layouts import resources, sm80
from .host import cute_dtype as _cute_dtype, fake_tensor, fake_vector, stream as _stream

MIN_TILES_PER_SPLIT = 2

# --------------------------------------------------------------------------------------
# Kernel configurations
# --------------------------------------------------------------------------------------


def storage_dims(fmt: KVFormat, head_dim: int):
    """The fake shapes of k_pack, k_params, v_pack, v_params (int32): ``KVFormat``'s storage
    shapes with the pages, heads and per-page extent symbolic and the rest static."""
    shapes = (fmt.k_pack_shape, fmt.k_params_shape, fmt.v_pack_shape, fmt.v_params_shape)
    return [(None, None, None) + shape(1, 1, fmt.residual_block, head_dim)[3:] for shape in shapes]


def as_halves(dims):
    """Fake shape of the 16-bit view of int32 words (the decode kernels' view of packed rows)."""
    return dims[:-1] + (2 * dims[-1],)


def decode_args(fmt: KVFormat, dtype, head_dim: int, split: bool):
    """Fake arguments of DecodeSm80 (same order as the call)."""
    import cutlass

    f16, i32, f32 = cutlass.Float16, cutlass.Int32, cutlass.Float32
    nr, d = fmt.residual_block, head_dim
    kp, ks, vp, vs = storage_dims(fmt, d)
    args = [
        fake_tensor(dtype, (None, 1, None, d)),                    # q (B, 1, Hq, D)
        fake_tensor(f16, as_halves(kp)),                           # k_pack (16-bit view)
        fake_tensor(i32, ks),                                      # k_params
        fake_tensor(f16, as_halves(vp)),                           # v_pack (16-bit view)
        fake_tensor(i32, vs),                                      # v_params
        fake_tensor(dtype, (None, nr, None, d)),                   # k_res
        fake_tensor(dtype, (None, nr, None, d)),                   # v_res
        fake_tensor(dtype, (None, None, None, d)),                 # k_sink (B, S, Hkv, D)
        fake_tensor(dtype, (None, None, None, d)),                 # v_sink
        fake_vector(i32, 1),                                       # cache_seqlens
        fake_vector(i32, 2),                                       # block_table
    ]
    if split:
        args += [fake_tensor(f32, (None, None, None, d)), fake_vector(f32, 3)]
    else:
        args += [fake_tensor(dtype, (None, 1, None, d)), fake_vector(f32, 2)]
    return args


def merged_output_args(dtype, head_dim: int):
    """Fake arguments of a kernel's in-kernel split merge: the merged output ``[B, 1, Hq,
    D]``, its LSE ``[B, Hq]`` and the splits' arrival counters ``[B * Hkv]``."""
    import cutlass

    return [fake_tensor(dtype, (None, 1, None, head_dim)), fake_vector(cutlass.Float32, 2),
            fake_vector(cutlass.Int32, 1)]


def merged_decode_args(fmt: KVFormat, dtype, head_dim: int, split: bool):
    """Fake arguments of a split decode that merges its splits (``call_merged``):
    ``decode_args``' then ``merged_output_args``."""
    assert split, "only a split decode has splits to merge"
    return decode_args(fmt, dtype, head_dim, True) + merged_output_args(dtype, head_dim)


def append_decode_args(fmt: KVFormat, dtype, head_dim: int, split: bool):
    """Fake arguments of an appending decode (``call_append`` of DecodeSm80 / DecodeSm90):
    q, the new K and V ``[B, 1, Hkv, D]``, the cache's commit counters, then
    ``decode_args``' others, then the merged output ``[B, 1, Hq, D]``, its LSE ``[B, Hq]``
    and the splits' arrival counters (the split kernel merges in its last CTA)."""
    import cutlass

    args = decode_args(fmt, dtype, head_dim, split)
    new = [fake_tensor(dtype, (None, 1, None, head_dim)) for _ in range(2)]
    return args[:1] + new + [fake_vector(cutlass.Int32, 1)] + args[1:] + merged_output_args(dtype, head_dim)


def compile_decode(arch: str, fmt: KVFormat, dtype, head_dim: int, nh: int, split: bool,
                   keep_ptx: bool = False, tq: int = 1):
    """The sm80 decode kernel for ``arch`` (``Sm80Backend.compile_decode``)."""
    return BACKEND.compile_decode(arch, fmt, dtype, head_dim, nh, split, keep_ptx=keep_ptx, tq=tq)


def compile_combine(arch: str, dtype, head_dim: int, keep_ptx: bool = False):
    import cutlass
    import cutlass.cute as cute

    from .combine import CombineSm80

    f32 = cutlass.Float32
    kernel = CombineSm80(dtype, head_dim, pdl=jit.has_pdl(arch))
    args = [fake_tensor(f32, (None, None, None, head_dim)), fake_vector(f32, 3),
            fake_tensor(dtype, (None, 1, None, head_dim)), fake_vector(f32, 2)]
    return cute.compile(kernel, *args, _stream(), options=jit.compile_options(arch, keep_ptx=keep_ptx))


def pack_args(fmt: KVFormat, dtype, head_dim: int):
    import cutlass

    i32 = cutlass.Int32
    nr, d = fmt.residual_block, head_dim
    kp, ks, vp, vs = storage_dims(fmt, d)
    return [
        fake_tensor(dtype, (None, None, None, d)),      # source K (B, N, Hkv, D)
        fake_tensor(dtype, (None, None, None, d)),      # source V
        fake_tensor(dtype, (None, nr, None, d)),        # k_res
        fake_tensor(dtype, (None, nr, None, d)),        # v_res
        fake_tensor(dtype, (None, None, None, d)),      # k_sink (B, S, Hkv, D)
        fake_tensor(dtype, (None, None, None, d)),      # v_sink
        fake_vector(i32, 1),                            # lengths
        fake_vector(i32, 2),                            # block_table
        fake_tensor(i32, kp),                           # k_pack
        fake_tensor(i32, ks),                           # k_params
        fake_tensor(i32, vp),                           # v_pack
        fake_tensor(i32, vs),                           # v_params
        fake_vector(i32, 1),                            # overflow (lengths refused appends asked for)
        fake_vector(i32, 1),                            # commit counters
        cutlass.Int32(0),                               # capacity (tokens per sequence)
    ]


def compile_pack(arch: str, fmt: KVFormat, dtype, head_dim: int, mode: str, keep_ptx: bool = False):
    import cutlass.cute as cute

    from .pack import PackSm80
    from .pack_fp4 import PackFp4Sm80

    if fmt.fp4:
        kernel = PackFp4Sm80(dtype, fmt.fp4, head_dim, mode, pdl=jit.has_pdl(arch), sinks=fmt.sink_tokens)
    else:
        kernel = PackSm80(dtype, fmt.bits, fmt.k_mode, fmt.group_size, head_dim, mode, pdl=jit.has_pdl(arch),
                          sinks=fmt.sink_tokens, v_bits=fmt.v_bits)
    return cute.compile(kernel, *pack_args(fmt, dtype, head_dim), _stream(),
                        options=jit.compile_options(arch, keep_ptx=keep_ptx))


def _fmt_key(fmt: KVFormat) -> Tuple:
    return (fmt.bits, fmt.v_bits, fmt.k_mode, fmt.group_size, fmt.sink_tokens) + ((fmt.fp4,) if fmt.fp4 else ())


def sink_tensors(cache: CacheTensors) -> Tuple[torch.Tensor, torch.Tensor]:
    """The sink buffers the kernels take: the cache's; without sink tokens the residual
    buffers fill the two arguments (the kernels compiled for ``sinks = 0`` never read them)."""
    return cache.sinks if cache.fmt.sink_tokens else (cache.k_res, cache.v_res)


def _combine_kernel(arch, dtype, d):
    key = ("combine_sm80", arch, str(dtype), d)
    return jit.KERNELS.get(key, lambda: compile_combine(arch, dtype, d))


def _pack_kernel(arch, fmt, dtype, d, mode):
    key = ("pack_sm80", arch, str(dtype), _fmt_key(fmt), d, mode)
    return jit.KERNELS.get(key, lambda: compile_pack(arch, fmt, dtype, d, mode))


# --------------------------------------------------------------------------------------
# Split-KV heuristic
# --------------------------------------------------------------------------------------


def check_decode_request(fmt: KVFormat, tq: int) -> None:
    """What every decode kernel refuses: an FP4 cache with more than one query token per
    sequence (its natural order permutes the tokens of a tile, so no causal mask yet)."""
    if fmt.fp4 and tq > 1:
        raise ValueError(f"fmt.fp4={fmt.fp4!r}: the decode kernel takes one query token per sequence so far "
                         f"(got {tq}); pass backend='reference'")


# Where ptxas gives the decode kernel more registers than ``decode_registers``' classes: 2-bit
# K per token with fp16 at head dim 128 (8 head columns), by (target, V's bits): K's group
# sizes.  ptxas of CUDA 13 (CuTe DSL 4.8.1), registers, V 2-bit / V 4-bit: sm_80 g32 210 /
# 194 (g64 159-162 / 158, g128 154); sm_90a g32 206 / 204, g64 202-205 / 194, g128 186 / 187;
# sm_100a g32 206 / 162 (g64 158 / 168, g128 167 / 168).  Two CTAs an SM, not three; capped
# at three (``min_blocks_per_mp``) the sm_90a kernels spill 72-156 bytes.
WIDE_2BIT_TOKEN = {("sm_80", 2): (32,), ("sm_80", 4): (32,), ("sm_90a", 2): (32, 64, 128),
                   ("sm_90a", 4): (32, 64, 128), ("sm_100a", 2): (32,)}


def decode_registers(fmt: KVFormat, head_dim: int, nh: int, arch: str = "sm_80", fp16: bool = True) -> int:
    """Registers per thread of the decode kernel as ptxas reports them (4-bit D<=128 with 8
    head columns: capped at 128; 2-bit: 168, or 216, two CTAs an SM, where ``WIDE_2BIT_TOKEN``
    says; D=256 or 16 head columns: 211-255)."""
    if head_dim > 128 or nh > 8:
        return 255
    if fmt.fp4:
        return 192  # its dequant temporaries and block-scale pairs: 185 at D=128 (ptxas)
    if fmt.bits == fmt.v_bits == 4:
        return 128
    wide = fmt.bits == 2 and fmt.k_mode == "token" and fp16 and head_dim == 128
    return 216 if wide and fmt.group_size in WIDE_2BIT_TOKEN.get((arch, fmt.v_bits), ()) else 168


def ctas_per_sm(fmt: KVFormat, head_dim: int, nh: int, arch: str = "sm_80", fp16: bool = True) -> int:
    """Decode CTAs resident per SM (4 / 3 / 2 for the register counts above)."""
    return resources.ctas_per_sm(decode_registers(fmt, head_dim, nh, arch, fp16), sm80.WARPS_N)


def most_splits(tiles: int) -> int:
    """The most splits a sequence of ``tiles`` tiles takes: ``MIN_TILES_PER_SPLIT`` tiles each,
    at most the combine's ``MAX_SPLITS``, at least one."""
    return max(1, min(tiles // MIN_TILES_PER_SPLIT, sm80.MAX_SPLITS))


def choose_splits(batch: int, kv_heads: int, max_len: int, fmt: KVFormat, sms: int, per_sm: int,
                  whole_waves: bool = False) -> int:
    """The split count whose CTAs (``per_sm`` an SM) end soonest in whole waves
    (``fewest_waves``), at least two tiles per split; ``whole_waves`` (sm90's base rule):
    enough CTAs to fill the GPU once, rounded down (sm90, B=16 Hkv=8 on 132 SMs: 2 splits,
    not 3)."""
    tiles = max(1, fmt.tiles(max_len))
    base = batch * kv_heads
    target = sms * per_sm
    most = most_splits(tiles)
    if not whole_waves:
        return fewest_waves(base, target, tiles, most)
    if base >= target:
        return 1
    return min(target // base, most)


# A partial last wave costs about a whole one, so the sm80 heuristic counts waves
# (``fewest_waves``) instead of filling the slots once; a CTA's fixed time (entry, first
# loads, epilogue) in tiles, as ``fewest_waves`` charges it.  First measured where two CTAs
# share an SM, then at three and four (below).  H200, the sm80 kernel of 2-bit K per token
# g64 fp16 (two CTAs an SM on sm_90a), Hkv=8 GQA 4, us, the fill rule's count (at the three
# CTAs an SM it assumed) / ``fewest_waves``' / the fastest measured
# (profiles/h200/splits_sm80_occupancy_2t64.json, splits_sm80_many_2bit.json):
# B=1 N=32K 29.2 (50) / 22.2 (33) / 22.2 (33), N=128K 67.0 / 52.0 / 52.0; B=4 N=32K 60.7 (13)
# / - (8) / 56.2 (4); B=8 N=64K 187.3 (7) / 169.1 (4) / 169.1; B=16 N=32K 171.2 (4) / 168.1
# (2) / 168.1; B=24 N=32K 313.2 (3) / 244.8 (4) / 244.8; past the slots (N=16K, one split /
# fewest_waves' / fastest): B=54 299.5 / 271.7 (3) / 271.7, B=60 304.4 (1) / 304.4 / 304.4,
# B=72 440.9 / 368.0 (3) / 368.0, B=84 445.2 / 417.8 (3) / 417.8, B=100 578.7 / 534.4 (2) /
# 503.3 (3).  Head dim 256 (two CTAs an SM everywhere), 4-bit K per channel g128, the fill
# rule / fewest_waves' (profiles/h200/splits_sm80_waves_d256.json): B=1 N=32K 38.6 (33) /
# 39.1 (33), B=4 130.7 (9) / 98.9 (8), B=8 N=64K 527.6 (5) / 346.9 (4), B=16 N=32K 447.2 (3)
# / 347.0 (2), B=24 653.4 (2) / 517.1 (4), each the fastest count timed or within 0.2 %;
# 16 head columns (GQA 16, Hq/Hkv = 64/4, splits_sm80_waves_h16.json): B=2 N=32K 28.8 (33) /
# 29.4 (33), B=8 95.4 (9) / 70.2 (8), B=16 N=64K 373.6 (5) / 236.8 (4), B=32 N=32K 315.9 (3) /
# 237.8 (2), B=48 463.4 (2) / 360.5 (4).  At four CTAs an SM (4-bit K per token g64 fp16, 528
# slots) and three (2-bit bf16, 396), the fill rule that those kept before / fewest_waves',
# at every shape of B = 1-72 x N = 8K, 32K, 128K where the two counts differ (the two rules
# timed one after the other, splits_sm80_waves_4t64_*.json, splits_sm80_waves_2t64_bf16_*.json;
# geomean 0.922 over 36 shapes and 0.927 over 43): 4-bit B=8 N=32K 128.5 / 104.8, B=12 N=8K
# 63.2 / 49.9, B=16 N=8K 73.9 / 59.2, B=17 N=128K 879.1 / 727.7, B=24 N=32K 308.2 / 277.3,
# B=72 N=128K 3460.4 / 3176.4, slower at B=4 N=8K 26.3 / 27.6 and N=32K 60.2 / 62.3, B=20
# N=32K 238.5 / 249.4, B=40 N=32K 454.8 / 464.5; 2-bit bf16 B=4 N=32K 66.1 / 50.9, B=8 N=32K
# 114.4 / 87.6, B=17 N=128K 801.7 / 635.7, B=28 N=128K 1200.7 / 994.2, B=72 N=32K 731.4 /
# 659.9, slower at B=17 N=8K 60.9 / 66.4, B=40 N=8K 105.2 / 119.4, B=64 N=8K 160.4 / 163.9.
WAVE_FIXED_TILES = 4


def waves_time(pairs: int, slots: int, tiles: int, splits: int, fixed: float = WAVE_FIXED_TILES) -> float:
    """How long ``splits`` splits of each pair take, in tiles, when their CTAs run in whole
    waves over ``slots``: waves x (tiles / splits + the CTA's ``fixed`` time)."""
    return -(-pairs * splits // slots) * (tiles / splits + fixed)


@functools.lru_cache(maxsize=1024)
def fewest_waves(pairs: int, slots: int, tiles: int, most: int, fixed: float = WAVE_FIXED_TILES) -> int:
    """The split count (1 to ``most``) whose CTAs end soonest (``waves_time``), the fewest
    splits on a tie.  Cached: the search costs ~0.4 us a count (up to 256) in Python, and a
    decode call asks again with the same arguments until its sequences grow by a tile."""
    return min(range(1, most + 1), key=lambda splits: waves_time(pairs, slots, tiles, splits, fixed))


def device_arch(device: torch.device) -> str:
    """The target the kernels for ``device`` are compiled for (``jit.target_arch``); a CPU
    device (the CPU tests' stand-in for a GPU) counts as sm_80."""
    return jit.target_arch(device.index) if device.type == "cuda" else "sm_80"


def variant_format(v: Variant):
    """The KVFormat a ``bitdecode compile`` variant was listed for (None: the combine)."""
    return KVFormat(fp4=v.fp4) if v.fp4 else KVFormat(v.bits, v.k_mode, v.group_size) if v.bits else None


def decode_variant_args(v: Variant) -> Tuple[int, bool, str]:
    """A decode variant's (heads tile, split, ``grid_variant``) from its ``extra`` words
    (``h8``, ``split`` / ``direct``, then the grid variant where there is one)."""
    return int(v.extra[0][1:]), v.extra[1] == "split", v.extra[2] if len(v.extra) > 2 else ""


# --------------------------------------------------------------------------------------
# The backend object
# --------------------------------------------------------------------------------------


class DecodePlan:
    """What a decode call needs that does not change between calls: the compiled kernels,
    the split count and the cache tensors in the form the kernels take.  Building it once
    per (cache, query shape, splits) keeps the per-call host work to the allocations below
    and one or two TVM-FFI launches.  Every backend whose decode kernel takes the sm80
    argument list (and writes fp32 partials merged by the combine kernel when split) uses it.

    The split-KV workspace (fp32 partial outputs and LSEs) is kept per CUDA stream: calls
    on one stream are ordered, so they can reuse it, and calls on different streams (one
    cache decoded by parallel samplers) never share it.  A call made while a CUDA graph is
    being captured takes a fresh workspace from the graph's memory pool instead, so a
    replay, whatever stream it runs on, never shares one with eager calls.  Only the LSE that
    nobody asked for (``return_lse=False``) goes to one buffer per plan: it is written and
    never read, so calls that share it cannot disturb each other.  The kernels take ``q``
    and the output as the caller's ``[B, 1, Hq, D]`` tensors.  The outputs come from
    chunks of ``OUT_CHUNK`` allocated at once, per stream (each call's output is a view
    of its own, never handed out twice; a chunk is freed once all its views are), since a
    torch allocation costs about as much host time as a launch (H200 hosts: 2-9 us, a
    launch 3-7 us; profiles/NOTES.md).  All of this keeps the host work per call to the
    launches.  (An output's storage is its chunk's: ``torch.save`` of one writes the
    chunk, ``clone()`` gives a tensor of its own.)"""

    MAX_STREAMS = 8  # workspaces kept per plan (least recently added dropped first)
    OUT_CHUNK = 32  # outputs allocated at once

    def __init__(self, cache: CacheTensors, q_shape, q_dtype, device, splits: int, decode_fn, combine_fn,
                 append: bool = False, tail_weight: int = sm80.TAIL_UNIT, merged: bool = False):
        bsz, _, hq, d = q_shape
        self.q_shape = tuple(q_shape)  # the queries' and the outputs'
        self.part_shape = (splits, bsz, hq, d)
        self.lse_shape = (bsz, hq)
        self.dtype = q_dtype
        self.splits = splits
        self.tail_weight = tail_weight  # how the splits share a sequence (``tail_weight``)
        self.device = device
        self.device_index = device.index
        self.static = jit.bound_arguments((
            cache.k_pack.view(torch.float16), cache.k_params, cache.v_pack.view(torch.float16), cache.v_params,
            cache.k_res, cache.v_res, *sink_tensors(cache), cache.cache_seqlens, cache.block_table), decode_fn)
        self.decode_fn = decode_fn
        self.combine_fn = combine_fn
        self.fns = tuple(f for f in (decode_fn, combine_fn) if f)  # what bound arguments go to
        # an appending kernel (``call_append``) and a merging one (``merged``: ``call_merged``)
        # merge their splits in the last CTA of each (sequence, KV head), counted on
        # ``arrivals`` in the workspace: no combine launch
        self.append = append
        self.merged = merged  # (only a split kernel merges: ``merges_splits``)
        self.arrivals = bsz * cache.k_res.shape[2] if append or merged else 0
        self.unused_lse, = jit.bound_arguments(
            (torch.empty(self.lse_shape, dtype=torch.float32, device=device),), *self.fns)
        if append:  # the cache's commit counters, and what an unsplit call's unread merge arguments get
            self.commits, self.unused_out = jit.bound_arguments(
                (cache.commits, torch.empty(self.q_shape, dtype=q_dtype, device=device)), *self.fns)
        self.workspaces = jit.PerStream(self.MAX_STREAMS)  # (o_part, l_part), converted as ``static``
        self.outputs = jit.PerStream(self.MAX_STREAMS)  # outputs not handed out yet (views of a chunk)
        # the last stream's (outputs, workspace), so that a call on the stream of the call
        # before it (an eager decode loop) skips both per-stream lookups
        self._last = (None, None, None)

    def _take(self, stream):
        """An output (``q_shape``) and the split-KV partials' buffers (None unsplit) for a
        call on ``stream``.  While a graph is captured (``stream`` None) both are fresh, from
        the graph's pool as every capture-time tensor must be, and kept by nobody; else
        the stream's own (outputs from its chunks, so that the caching allocator ties each
        to the stream its kernels write it on), the last stream's without a lookup."""
        if stream is None:
            out = torch.empty(self.q_shape, dtype=self.dtype, device=self.device)
            return out, self._new_workspace() if self.splits > 1 else None
        last_stream, outs, work = self._last
        if stream != last_stream or not outs:
            outs = self.outputs.get(stream, self._new_outputs, keep=bool)
            work = self.workspaces.get(stream, self._new_bound_workspace) if self.splits > 1 else None
            self._last = (stream, outs, work)
        return outs.pop(), work

    def _new_workspace(self):
        parts = (torch.empty(self.part_shape, dtype=torch.float32, device=self.device),
                 torch.empty(self.part_shape[:3], dtype=torch.float32, device=self.device))
        if self.arrivals:  # (zero, and left so by the kernel)
            return parts + (torch.zeros(self.arrivals, dtype=torch.int32, device=self.device),)
        return parts

    def _new_bound_workspace(self):
        return jit.bound_arguments(self._new_workspace(), *self.fns)

    def _new_outputs(self):
        chunk = torch.empty((self.OUT_CHUNK, *self.q_shape), dtype=self.dtype, device=self.device)
        return list(reversed(chunk.unbind(0)))

    def __call__(self, q: torch.Tensor, scale_log2: float, return_lse: bool):
        # q is on the cache's device (attention.check_query), the device the plan was built for
        out, work = self._take(jit.current_stream(self.device_index))
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device) if return_lse else self.unused_lse
        if work is None:
            self.decode_fn(q, *self.static, out, lse, scale_log2, sm80.TAIL_UNIT)
        elif self.merged:
            o_part, l_part, arrivals = work
            self.decode_fn(q, *self.static, o_part, l_part, out, lse, arrivals, scale_log2, self.tail_weight)
        else:
            o_part, l_part = work
            self.decode_fn(q, *self.static, o_part, l_part, scale_log2, self.tail_weight)
            self.combine_fn(o_part, l_part, out, lse)
        return (out, lse.view(q.shape[0], 1, q.shape[2])) if return_lse else out

    def append_step(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, scale_log2: float,
                    return_lse: bool, stream):
        """An appending plan's call (one launch): the new K / V token stored, then q's
        attention; ``stream``: the current one (``jit.current_stream``, never None: a capture
        takes append + decode).  Unsplit, the merge's arguments are not read."""
        out, work = self._take(stream)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device) if return_lse else self.unused_lse
        if work is None:
            self.decode_fn(q, k_new, v_new, self.commits, *self.static, out, lse, self.unused_out,
                           self.unused_lse, self.commits, scale_log2, sm80.TAIL_UNIT)
        else:
            o_part, l_part, arrivals = work
            self.decode_fn(q, k_new, v_new, self.commits, *self.static, o_part, l_part, out, lse, arrivals,
                           scale_log2, self.tail_weight)
        return (out, lse.view(q.shape[0], 1, q.shape[2])) if return_lse else out


class MultiTokenPlan:
    """Decode of ``T`` > 1 query tokens per sequence (the newest ``T``, already appended;
    causal) through the kernels compiled with ``tq = T``: the query rows of a KV head are
    its (token, head) pairs, token-major, so T tokens at GQA g fill the tile as T * g heads
    would.  The host reorders q into that order and the output back (one copy each)."""

    def __init__(self, plan: DecodePlan, kv_heads: int):
        self.plan, self.hkv = plan, kv_heads

    def __call__(self, q: torch.Tensor, scale_log2: float, return_lse: bool):
        b, t, hq, d = q.shape
        g = hq // self.hkv
        rows = q.view(b, t, self.hkv, g, d).transpose(1, 2).reshape(b, 1, self.hkv * t * g, d)
        res = self.plan(rows, scale_log2, return_lse)
        out = (res[0] if return_lse else res).view(b, self.hkv, t, g, d).transpose(1, 2).reshape(b, t, hq, d)
        if not return_lse:
            return out
        return out, res[1].view(b, self.hkv, t, g).transpose(1, 2).reshape(b, t, hq)


def token_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[B, T, Hkv, D]`` as the pack kernel takes it (``pack_args``: heads D apart,
    each row contiguous, any 16-byte multiple between tokens and between sequences): itself
    where it is laid out so, e.g. a slice of a merged q / k / v projection's output, which
    ``contiguous()`` would copy at B > 1; else a contiguous copy."""
    return t if BACKEND.takes_rows(t) else t.contiguous()


def rows_laid_out(stride: Tuple[int, ...], head_dim: int, element_size: int) -> bool:
    """Whether a ``[B, T, Hkv, D]`` tensor of these strides is laid out as ``token_rows``
    wants it."""
    div = sm80.CHUNK_BYTES // element_size
    return stride[3] == 1 and stride[2] == head_dim and stride[1] % div == 0 and stride[0] % div == 0


def _pack_call(cache: CacheTensors, mode: str, src_k, src_v, lengths):
    arch = jit.target_arch(cache.device.index)
    kern = _pack_kernel(arch, cache.fmt, _cute_dtype(cache.dtype), cache.head_dim, mode)
    kern(src_k, src_v, cache.k_res, cache.v_res, *sink_tensors(cache), lengths, cache.block_table,
         cache.k_pack, cache.k_params, cache.v_pack, cache.v_params,
         cache.overflow, cache.commits, cache.capacity)


class DenseKernels:
    """The 16-bit kernels of a model's decode step, which ``bitdecode.dense`` and
    ``bitdecode.rope`` ask the device's backend for: the GEMV and the small-M GEMM
    (``dense``), SwiGLU, the rotary embedding (``rope``); all run on every GPU from sm_80 up."""

    def compile_gemv(self, bf16: bool, k: int, tokens: int, has_bias: bool, options: str, *, pdl: bool,
                     has_residual: bool, residual_ahead: bool):
        from . import dense

        return dense.compile_gemv(bf16, k, tokens, has_bias, options, pdl=pdl, has_residual=has_residual,
                                  residual_ahead=residual_ahead)

    def gemv_rows_per_warp(self, n: int, k: int, sms: int) -> int:
        from . import dense

        return dense.rows_per_warp(n, k, sms)

    def compile_gemm_small_m(self, bf16: bool, k: int, tokens: int, options: str, *, pdl: bool,
                             has_residual: bool, residual_ahead: bool, **config):
        from . import dense

        return dense.compile_gemm_small_m(bf16, k, tokens, options, pdl=pdl, has_residual=has_residual,
                                          residual_ahead=residual_ahead, **config)

    def compile_silu_mul(self, bf16: bool, options: str, *, pdl: bool):
        from . import dense

        return dense.compile_silu_mul(bf16, options, pdl=pdl)

    def compile_rope(self, bf16: bool, head_dim: int, options: str):
        from . import rope

        return rope.compile_rope(bf16, head_dim, options)


class BitnetKernels:
    """The host glue of the BitNet W2A8 kernels, which ``bitdecode.bitnet`` asks the device's
    backend for: the register-streaming GEMV (``bitnet_gemv``) and the mma.sync GEMM
    (``bitnet_gemm``); both run on every GPU from sm_80 up."""

    gemm_kernels = ("mma",)  # what ``gemm(kernel=...)`` may name besides "auto"
    stripe_gemv = False  # the bulk-copy stripe GEMV (``GemvConfig.bulk``): sm_90a only

    def compile_act_quant(self, bf16: bool, eps: float, options: str):
        """The per-row activation quantizer (``act_quant.ActQuantSm80``; every arch)."""
        from . import act_quant

        return act_quant.compile_act_quant(bf16, eps, options)

    def compile_norm_quant(self, bf16: bool, eps: float, norm_eps: float, options: str, **flags):
        """The RMSNorm (+ quantizer) kernel (``act_quant.RmsNormQuantSm80``; every arch)."""
        from . import act_quant

        return act_quant.compile_norm_quant(bf16, eps, norm_eps, options, **flags)

    def gemv_config(self, n: int, k: int, sms: int):
        """The GEMV configuration for N x K weights (the caller decides on PDL)."""
        from . import bitnet_gemv

        return bitnet_gemv.config_for(n, k, sms)

    def gemv_configs(self) -> list:
        """Every GEMV configuration it runs (benchmarks and tests check them side by side)."""
        from . import bitnet_gemv

        return [bitnet_gemv.GemvConfig(unroll=u) for u in (4, 8)]

    def gemv_key(self, cfg, k: int) -> tuple:
        """What one GEMV compilation serves: the register kernels every K."""
        if cfg.bulk:
            raise ValueError("the bulk-copy GEMV (GemvConfig.bulk) runs on sm_90a only (the sm90 backend)")
        return (cfg,)

    def compile_gemv(self, cfg, k: int, options: str):
        from . import bitnet_gemv

        self.gemv_key(cfg, k)  # (refuses what it cannot build)
        return bitnet_gemv.compile_gemv(cfg, options)

    def gemv_launch_size(self, cfg, n: int, k: int, sms: int) -> int:
        from . import bitnet_gemv

        return bitnet_gemv.launch_size(cfg, n, k, sms)

    def default_gemm_kernel(self, m: int, n: Optional[int] = None, k: Optional[int] = None) -> str:
        """The GEMM ``kernel="auto"`` runs for M tokens (N weight rows, K inputs if known)."""
        return "mma"

    def gemm_plan(self, kernel: str, m: int, n: int, k: int, sms: int, raw: bool, pdl: bool):
        """(configuration, launch arguments after the segment ends, split-K workspace
        ``(values, tiles)`` or None) of GEMM ``kernel`` for this shape; ``pdl``: whether
        programmatic dependent launch is allowed."""
        from . import bitnet_gemm

        self._check_gemm_kernel(kernel)
        cfg = dataclasses.replace(bitnet_gemm.config_for(m, n, sms), raw=raw, pdl=pdl)
        # the mma.sync kernel takes its split-K warp count at launch (one compilation per tile)
        return cfg, (bitnet_gemm.split_for(cfg, m, n, k, sms),), None

    def compile_gemm(self, kernel: str, cfg, options: str):
        from . import bitnet_gemm

        self._check_gemm_kernel(kernel)
        return bitnet_gemm.compile_gemm(cfg, options)

    def _check_gemm_kernel(self, kernel: str) -> None:
        if kernel not in self.gemm_kernels:
            raise ValueError(f"kernel={kernel!r} is not one of this backend's GEMMs {self.gemm_kernels} "
                             "('wgmma' needs a Hopper GPU, sm_90a)")


class Sm80Backend:
    """cp.async + ldmatrix + mma.sync kernels; they run on every GPU from sm_80 up."""

    name = "sm80"
    limits = Limits(max_gqa=sm80.HEADS_TILES[-1], max_splits=sm80.MAX_SPLITS)
    whole_waves = False  # split rounding (choose_splits)
    # whether ``auto`` may choose this backend: only kernels that have run on their GPU
    hardware_validated = True
    bitnet = BitnetKernels()  # the BitNet GEMV / GEMM (``bitdecode.bitnet``)
    dense = DenseKernels()  # a model step's 16-bit GEMV, SwiGLU, RoPE (``bitdecode.dense`` / ``rope``)

    def fp4_operands(self, fmt: KVFormat, head_dim: int) -> bool:
        return False  # Q and P stay 16-bit (the FP4 caches are dequantized in registers)

    def supports(self, capability: Tuple[int, int]) -> bool:
        return tuple(capability) >= (8, 0)

    def auto_picks(self, fmt: KVFormat, head_dim: int, dtype=None) -> bool:
        return True

    # ---- decode -------------------------------------------------------------------------
    def call_backend(self, cache: CacheTensors, q_shape: Tuple[int, ...], max_len: int) -> str:
        """The backend ``auto`` runs a decode of this shape on over sequences of at most
        ``max_len`` tokens: this one (the packed cache is every backend's)."""
        return self.name

    def ctas_per_sm(self, fmt: KVFormat, head_dim: int, nh: int, dtype=torch.float16, variant: str = "",
                    arch: str = "sm_80") -> int:
        """CTAs of the decode kernel one SM holds (the split heuristic fills them); ``dtype``:
        the model's, which some backends' kernels depend on; ``variant``: ``grid_variant``'s;
        ``arch``: the target it is compiled for (ptxas's register counts differ by target)."""
        return ctas_per_sm(fmt, head_dim, nh, arch, dtype == torch.float16)

    decode_tiles = sm80.HEADS_TILES  # every ``heads_tile`` (``bitdecode compile`` lists them)

    def heads_tile(self, rows: int, tq: int) -> int:
        """The decode kernel's query-head tile for ``rows`` query rows per KV head (``tq``
        tokens of each head): the MMA's N side, 8 or 16."""
        return sm80.heads_tile(rows)

    def grid_variant(self, fmt: KVFormat, dtype, head_dim: int, nh: int, batch: int, kv_heads: int, tq: int,
                     device, splits: int = 0) -> str:
        """A decode kernel variant for this launch's size ("" : the one kernel of the format),
        which ``choose_splits`` (``splits`` 0: not chosen yet) and ``plan`` (the splits it
        runs) both follow.  sm80 has none."""
        return ""

    # whether the decode kernel can append the step's new token itself (``plan(append=True)``):
    # DecodeSm80.call_append
    appends = True
    # Split, the appending kernel's last CTA of a (sequence, KV head) merges every split of
    # its query rows alone (``HeadMerge``): one launch less on the host, GPU time that grows
    # with splits x rows.  With the merge one row at a time (``SplitMerge``) more than 16
    # splits cost more than the two calls (H200, twenty-eighth session).  With ``HeadMerge``
    # (H100, B=1, GQA 4, GPU us a step, append + decode / one call, profiles/h100/
    # append_step_gpu_nolimit*_h100.json): 4-bit bf16, sm80 at 66 splits 26.32 / 23.21 (32K),
    # 64.87 / 62.60 (128K); 2 KV heads, 128 / 256 splits 20.67 / 19.46, 36.75 / 35.97; 1 KV
    # head 23.59 / 17.59, 29.41 / 28.92.  But sm80's 2-bit fp16 appending kernel at 49 splits
    # took 65.30 against 54.66 at 128K (26.51 / 26.28 at 32K: the same merge, so the
    # appending kernel's loop, not the merge; not pursued), so sm80 keeps 16.
    append_max_splits = 16

    def takes_rows(self, t: torch.Tensor) -> bool:
        """Whether ``t`` ``[B, T, Hkv, D]`` is laid out as the kernels take new tokens
        (``token_rows``; its storage's alignment aside)."""
        return rows_laid_out(t.stride(), t.shape[3], t.element_size())

    def make_decode(self, arch: str, fmt: KVFormat, dtype, head_dim: int, nh: int, split: bool, tq: int = 1,
                    variant: str = "", append: bool = False):
        """The decode kernel object (its constexpr configuration) for ``arch``; ``tq`` query
        tokens per sequence (``MultiTokenPlan``); ``variant``: one of ``grid_variant``'s;
        ``append``: the kernel appends one new token first (where ``appends``)."""
        import cutlass

        from .decode import DecodeSm80

        check_decode_request(fmt, tq)
        if variant:
            raise ValueError(f"the {self.name} decode kernel has no variant {variant!r}")
        # 4-bit D<=128: capping registers at 128 (no spills) lets 4 CTAs share an SM
        per_sm = ctas_per_sm(fmt, head_dim, nh, arch, dtype == cutlass.Float16)
        return DecodeSm80(dtype, fmt.bits, fmt.k_mode, fmt.group_size, head_dim, nh, split,
                          min_blocks_per_sm=per_sm if per_sm == 4 else 0, pdl=jit.has_pdl(arch),
                          sinks=fmt.sink_tokens, v_bits=fmt.v_bits, tq=tq, fp4=fmt.fp4, append=append)

    def compile_decode(self, arch: str, fmt: KVFormat, dtype, head_dim: int, nh: int, split: bool,
                       keep_ptx: bool = False, tq: int = 1, variant: str = "", append: bool = False):
        import cutlass
        import cutlass.cute as cute

        kernel = self.make_decode(arch, fmt, dtype, head_dim, nh, split, tq, variant, append)
        if append:
            entry, args = kernel.call_append, append_decode_args
        elif kernel.merges:  # (the backend's kernel merges its splits: ``merges_splits``)
            entry, args = kernel.call_merged, merged_decode_args
        else:
            entry, args = kernel, decode_args
        scalars = (cutlass.Float32(1.0), cutlass.Int32(sm80.TAIL_UNIT))  # softmax scale, tail weight
        return cute.compile(entry, *args(fmt, dtype, head_dim, split), *scalars, _stream(),
                            options=jit.compile_options(arch, keep_ptx=keep_ptx))

    def decode_kernel(self, arch: str, fmt: KVFormat, dtype, head_dim: int, nh: int, split: bool, tq: int = 1,
                      variant: str = "", append: bool = False, merged: Optional[bool] = None):
        """``compile_decode`` through the JIT cache (memory, then disk); ``merged``: whether
        the kernel merges its splits (``merges_splits``, asked here when not given)."""
        if merged is None:
            merged = not append and self.merges_splits(arch, fmt, dtype, head_dim, nh, split, tq, variant)
        key = (f"decode_{self.name}", arch, str(dtype), _fmt_key(fmt), head_dim, nh, split) + ((tq,) if tq > 1 else ()) \
            + ((variant,) if variant else ()) + (("append",) if append else ()) + (("merged",) if merged else ())
        return jit.KERNELS.get(key, lambda: self.compile_decode(arch, fmt, dtype, head_dim, nh, split, tq=tq,
                                                                variant=variant, append=append))

    def merges_splits(self, arch: str, fmt: KVFormat, dtype, head_dim: int, nh: int, split: bool, tq: int = 1,
                      variant: str = "") -> bool:
        """Whether this backend's split decode kernel for these arguments merges its splits
        itself (``call_merged``), so that no combine launch follows.  sm80: never."""
        return False

    def unsplit(self, fmt: KVFormat, dtype, head_dim: int, nh: int, batch: int, kv_heads: int, tq: int,
                max_len: int, device) -> bool:
        """Whether this request runs one split whatever ``choose_splits``' fill rule says (a
        kernel ``grid_variant`` gives one split that is faster unsplit).  sm80: never."""
        return False

    def choose_splits(self, cache: CacheTensors, q_shape, max_len: int, device) -> int:
        bsz, tq, hq, d = q_shape
        hkv = cache.k_res.shape[2]
        nh = self.heads_tile(query_rows(tq, hq, hkv), tq)
        dtype = cache.k_res.dtype
        if self.unsplit(cache.fmt, dtype, d, nh, bsz, hkv, tq, max_len, device):
            return 1
        variant = self.grid_variant(cache.fmt, dtype, d, nh, bsz, hkv, tq, device)
        per_sm = self.ctas_per_sm(cache.fmt, d, nh, dtype, variant, arch=device_arch(device))
        return choose_splits(bsz, hkv, max_len, cache.fmt, num_sms(device), per_sm, self.whole_waves)

    def tail_weight(self, cache: CacheTensors, q_shape, splits: int, max_len: int, device) -> int:
        """How ``splits`` splits share a sequence of up to ``max_len`` tokens: ``split_tiles``'
        weight of every split but the last against the last, in sixteenths
        (``sm80.TAIL_UNIT``, which is even).  sm80: even."""
        return sm80.TAIL_UNIT

    def plan(self, cache: CacheTensors, q_shape, q_dtype, device, splits: int, append: bool = False,
             max_len: int = 0):
        """A ``DecodePlan`` (one query token), or a ``MultiTokenPlan`` around one; ``append``:
        its kernel appends the step's new token first (``appends``; called with ``new``);
        ``max_len``: the longest sequence it is made for (0: not known), which the splits'
        partition (``tail_weight``) may follow; any partition gives the same attention."""
        arch = jit.target_arch(device.index)
        dtype = _cute_dtype(q_dtype)
        bsz, tq, hq, d = q_shape
        hkv = cache.k_res.shape[2]
        rows = query_rows(tq, hq, hkv)
        nh = self.heads_tile(rows, tq)
        variant = self.grid_variant(cache.fmt, q_dtype, d, nh, bsz, hkv, tq, device, splits)
        merged = not append and self.merges_splits(arch, cache.fmt, dtype, d, nh, splits > 1, tq, variant)
        decode_fn = self.decode_kernel(arch, cache.fmt, dtype, d, nh, splits > 1, tq, variant, append, merged)
        combine_fn = _combine_kernel(arch, dtype, d) if splits > 1 and not (append or merged) else None
        weight = self.tail_weight(cache, q_shape, splits, max_len, device) if splits > 1 else sm80.TAIL_UNIT
        plan = DecodePlan(cache, (bsz, 1, hkv * rows, d), q_dtype, device, splits, decode_fn, combine_fn, append,
                          weight, merged=merged)
        return plan if tq == 1 else MultiTokenPlan(plan, hkv)

    # ---- writes (the packed format is the same bytes on every arch) ---------------------
    def prefill(self, cache: CacheTensors, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor) -> None:
        """One launch packs every full block of the prompt and copies each sequence's
        tail to the residual buffer; ``lens`` (int32, on the cache's device) become the
        lengths."""
        if k.shape[1]:
            _pack_call(cache, "prefill", token_rows(k), token_rows(v), lens)
        cache.cache_seqlens.copy_(lens)

    def append(self, cache: CacheTensors, k: torch.Tensor, v: torch.Tensor) -> None:
        """One pack launch: fill the residual blocks, pack the ones that complete, and
        store the new lengths; a sequence that would pass ``cache.capacity`` (a replayed
        graph: the host checked only the capture) is left as it was and flagged in
        ``cache.overflow``."""
        self.appender(cache)(k, v)

    def appender(self, cache: CacheTensors) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """``append`` for this cache with the kernel and its fixed arguments bound once."""
        arch = jit.target_arch(cache.device.index)
        kern = _pack_kernel(arch, cache.fmt, _cute_dtype(cache.dtype), cache.head_dim, "append")
        before = jit.bound_arguments((cache.k_res, cache.v_res, *sink_tensors(cache), cache.cache_seqlens,
                                      cache.block_table), kern)
        after = jit.bound_arguments((cache.k_pack, cache.k_params, cache.v_pack, cache.v_params, cache.overflow,
                                     cache.commits, cache.capacity), kern)

        # whether k / v of the last strides seen are laid out as the kernel takes them: a
        # decode loop's appends repeat their strides, and asking again costs ~10 torch
        # accessor calls (~3 us of host time a call, more than the rest of the append)
        last = [None, (False, False)]
        d, size = cache.head_dim, cache.k_res.element_size()

        def append(k: torch.Tensor, v: torch.Tensor) -> None:
            strides = (k.stride(), v.stride())
            if strides != last[0]:
                last[:] = strides, (rows_laid_out(strides[0], d, size), rows_laid_out(strides[1], d, size))
            k_ok, v_ok = last[1]
            kern(k if k_ok else k.contiguous(), v if v_ok else v.contiguous(), *before, *after)

        return append

    # ---- ahead-of-time compilation (``bitdecode compile``) ------------------------------
    def variants(self, kinds, formats, head_dims, dtypes) -> List[Variant]:
        out: List[Variant] = []
        for dtype, d in itertools.product(dtypes, head_dims):
            if "combine" in kinds:
                out.append(Variant("combine", dtype, d))
            for fmt in formats:
                try:
                    fmt.check_head_dim(d)
                except ValueError:
                    continue
                fkey = () if fmt.fp4 else (fmt.bits, fmt.k_mode, fmt.group_size)
                if "decode" in kinds:
                    for nh, split in itertools.product(self.decode_tiles, (False, True)):
                        extra = (f"h{nh}", "split" if split else "direct")
                        out.append(Variant("decode", dtype, d, *fkey, extra=extra, fp4=fmt.fp4 or ""))
                if "pack" in kinds:
                    for mode in ("prefill", "append"):
                        out.append(Variant("pack", dtype, d, *fkey, extra=(mode,), fp4=fmt.fp4 or ""))
        return out

    def compile_variant(self, arch: str, v: Variant, keep_ptx: bool = False, cached: bool = False):
        """Compile ``v`` for ``arch`` (with its PTX), or fetch it through the JIT cache."""
        import cutlass

        dtype = {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16}[v.dtype]
        fmt = variant_format(v)
        if v.kind == "decode":
            nh, split, variant = decode_variant_args(v)
            if cached:
                return self.decode_kernel(arch, fmt, dtype, v.head_dim, nh, split, variant=variant)
            return self.compile_decode(arch, fmt, dtype, v.head_dim, nh, split, keep_ptx=keep_ptx, variant=variant)
        if v.kind == "pack":
            if cached:
                return _pack_kernel(arch, fmt, dtype, v.head_dim, v.extra[0])
            return compile_pack(arch, fmt, dtype, v.head_dim, v.extra[0], keep_ptx=keep_ptx)
        if cached:
            return _combine_kernel(arch, dtype, v.head_dim)
        return compile_combine(arch, dtype, v.head_dim, keep_ptx=keep_ptx)


BACKEND = Sm80Backend()
