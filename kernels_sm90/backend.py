"""The sm90 backend: the warp-specialized TMA + wgmma decode kernel (``decode.DecodeSm90``).

Everything but the decode kernel is shared with the sm80 backend, compiled for sm_90a: the
packed format is the same bytes on every arch, so prefill / append run the sm80 pack
kernels, and split-KV partials are merged by the sm80 combine kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional, Tuple

import torch

from .. import jit
from ..backend import Variant, num_sms, query_rows
from ..formats import KVFormat
from ..kernels_sm80 import backend as sm80_backend
from ..layouts import sm80, sm90


# grid_variant's kernels: their DecodeSm90 keywords (the "small" grid's by format,
# ``small_grid``: 4-bit leaves K's scale out of Q there, 2-bit keeps it).  The small grids
# (B <= 2 at Hkv = 8) issue their first loads early (``early_loads``: Q and the first
# block-table entry beside the length; ``early_residual``: the residual block's first
# sub-tile beside Q; ``early_tiles``: the first tiles before Q o s, 2-bit's fold only).
# H200, fp16 GQA 4, one run, us, without / with all three (+ the combine's hoisted loads;
# profiles/h200/variants_early_issue_2c128.json, _4c128.json): 2-bit B=1 N=4096 13.34 /
# 11.86, 4296 18.02 / 15.39, 131272 47.14 / 47.39; 4-bit 11.70 / 11.46, 12.61 / 12.10,
# 55.50 / 54.64.  The default grid's kernels (two CTAs an SM) lost with them at B=16 N=64K
# (2-bit 263.4 / 270.2, 4-bit 317.1 / 321.4), so they keep the late issue.
EARLY_ISSUE = {"early_loads": True, "early_residual": True}
SMALL_GRID = {"consumers": 2, "fold_k": False, **EARLY_ISSUE}
SMALL_GRID_2BIT = {"consumers": 2, "early_tiles": True, **EARLY_ISSUE}
VARIANTS = ("", "small")
# splits per (sequence, KV head) the default kernel would need for a grid to count as small
SMALL_GRID_SPLITS = 8
# The 4-head tile (GQA <= 4): where the (sequence, KV head) pairs fill more than half the
# SMs (the default two CTAs an SM need two splits, and the combine) and no sequence is
# longer than this many tiles, one split of the small grid's kernel (one CTA an SM, two
# consumers) instead (``Sm90Backend.unsplit``).  H200, Hkv=8, one run each, us, one
# split of it / two of the default (profiles/h200/splits_short_*.json, profiles/NOTES.md):
# - 2-bit (256-token tiles), B=16: N=4K 26.7 / 30.0, 8K 43.5 / 45.5, 12K 60.1 / 61.5, 16K
#   76.3 / 77.6, 32K 141.3 / 140.7; B=12 N=8K 42.8 / 44.7; B=9 N=4K 25.7 / 27.9, 16K 75.3 /
#   75.9;
# - 4-bit (128-token tiles), B=16: N=4K 30.4 / 34.6, 6K 41.9 / 44.9, 8K 50.8 / 53.7, 12K
#   73.0 / 73.1, 16K 93.2 / 90.8, 32K 176.9 / 164.3; B=12 N=4K 28.8 / 30.3, 8K 48.8 / 48.7;
#   B=9 N=4K 28.2 / 29.0; bf16 B=16 N=4K 31.1 / 35.1, 8K 52.8 / 56.2
#   (variants_small_grid_bf16.json).
SHORT_TILES = {2: 64, 4: 64}
# ... and small grids (``grid_variant``'s "small": pairs x SMALL_GRID_SPLITS fit the SMs) on
# sequences of at most this many tiles (512 tokens) run that kernel unsplit: one launch and
# no combine, where the splits' few tiles each do not pay for the combine's launch and pass.
# H200, B=1 Hkv=8 GQA 4 fp16, one run, us, unsplit / the best split count
# (profiles/h200/splits_direct_*.json): 4-bit N=512 8.85 / 9.47, 1K 11.71 / 9.98, 2K 16.5 /
# 10.8.  2-bit: N=512 10.40 / 11.23, 1K 12.54 / 12.03, where sm80's heuristic already
# leaves its two 256-token tiles unsplit (``MIN_TILES_PER_SPLIT``), so no entry.
DIRECT_TILES = {4: 4}
# Short sequences of small grids decode faster on sm80's kernels than on these (measured
# below), so ``auto`` in ``KVCache.decode`` hands such calls to sm80
# (``Sm90Backend.call_backend``; the packed cache is the same for both).  Key: (K bits, V
# bits, GQA: 2-4 query rows a KV head (measured at 4), else one); value: (most (sequence, KV
# head) pairs, longest sequence in tokens) tiers, the first tier that holds the call's pairs
# deciding (a tier of 0 tokens hands nothing off: a lower bound on the pairs of the tiers
# after it).  Measured on an H100 (CUDA-graph replay, L2 flushed, each backend timed twice in
# turn, the faster kept, us, sm90 / sm80, fp16 unless named, K per channel g128, head dim
# 128; profiles/h100/short_grids_h100.json and short_grids_more_h100.json, ``device_run.sh
# b1short`` and ``b1more``), Hkv = 8 GQA 4:
# - 2-bit B=1 N=1K 11.62 / 10.56, 4K 12.21 / 11.58, 8K 13.25 / 12.85, 16K 15.90 / 16.06; B=2
#   N=4K 14.83 / 12.88, 8K 17.17 / 15.10, 16K 21.71 / 23.44; B=4 N=2K 14.62 / 12.93, 4K
#   18.30 / 15.34, 8K 22.42 / 23.87; bf16 B=1 N=8K 14.85 / 12.98, 16K 17.10 / 15.84, B=2 N=8K
#   16.96 / 15.22 (the H200's full sweep, fp16: B=1 1K-8K sm80 ahead by 0.3-0.8 us, 16K
#   behind);
# - K4V2 B=1 N=1K 12.94 / 10.69, 4K 14.14 / 12.06, 16K 18.99 / 16.94 (32K: 25.95 / 28.83 in
#   the quick sweep); B=2 N=4K 15.79 / 13.33, 8K 18.67 / 16.58, 16K 23.79 / 27.33; B=4 N=2K
#   15.92 / 13.41, 4K 20.24 / 18.14, 8K 25.02 / 26.94; bf16 B=1 N=16K 18.74 / 17.18, B=2 N=8K
#   18.69 / 17.09;
# - 4-bit B=1 N=1K 10.11 / 9.89, 4K 11.98 / 11.49, 8K 13.39 / 14.11; B=2 N=8K 15.49 / 18.46;
#   B=4 N=2K 14.69 / 13.39, 4K 16.83 / 19.92; bf16 B=1 N=4K 12.22 / 11.71; but on the H200
#   sm90 led at B=1 1K-2K (9.33 / 9.73, 10.27 / 10.58; profiles/h200/decode.json), so no
#   entry (4c64 and 4t64, not on the H200: sm80 ahead by 3-9 % at B=1 2K-4K);
# and MHA (Hq = Hkv = 32, B=1): 2-bit N=2K 14.35 / 13.01, 4K 15.65 / 15.09, 8K 19.41 / 21.41;
# 4-bit N=2K 14.19 / 12.98, 4K 16.82 / 17.39 (the H200's full sweep agrees for both).
SM80_SHORT = {
    (2, 2, True): ((16, 8192), (32, 4096)),
    (4, 2, True): ((8, 16384), (16, 8192), (32, 4096)),
    (2, 2, False): ((32, 4096),),
    (4, 4, False): ((32, 2048),),
}
# A weighted tail (``Sm90Backend.tail_weight``): where the default kernel's whole waves
# leave SM slots free, one more split a (sequence, KV head), shorter, started after all the
# long ones (``split_coords``): the free slots run the short splits while the long ones
# run, and the slots that free early (CTA times spread ~+-20 % on the H200) take what is
# left.  The split heuristic adds it where the even choice is one split (the grid fills
# 136-256 of 264 slots at B=17-32, Hkv=8) or the tail is at most a tenth of a long split
# (``MIN_TAIL_WEIGHT``).  H200, Hkv=8 GQA 4 fp16, us, even / with the tail, the faster of
# two alternating runs (profiles/h200/splits_tails_4bit.json, splits_tails_2bit.json):
# - 4-bit N=32K: B=17 291.4 / 248.4, B=20 291.7 / 227.8, B=24 292.6 / 245.9, B=28 295.1 /
#   270.6, B=32 299.9 / 299.4, B=16 161.9 / 160.3 (weight 489); N=64K B=16 302.6 / 298.3
#   (337), B=8 161.6 / 159.6 (165);
# - 2-bit: N=32K B=20 258.9 / 198.7, N=64K B=24 506.4 / 409.3, B=16 263.7 / 259.5 (489);
# - not taken, heavier tails where the even choice already splits: 4-bit N=32K B=4 53.8 /
#   55.0 (104), B=9 109.9 / 112.0 (25), B=12 155.0 / 158.3 (22), but B=5 65.3 / 63.5 (29);
#   2-bit B=5 56.6 / 53.8 (31), B=9 97.0 / 93.2 (25).
# Taken where it was measured: ``measured_grids`` formats, sequences of at least this many
# tokens (shorter ones keep even splits: there a split more also costs a larger share in
# the combine, unmeasured) ...
TAIL_MIN_TOKENS = 32768
# ... and after one even split from this many tokens by V's width (``tail_min_tokens``).
# H200, fp16 Hkv=8 GQA 4, us, even / with the tail, the faster of two alternating runs
# (profiles/h200/splits_explore_*.json, splits_explore8k_*.json):
# - 4-bit N=16K: B=17 150.3 / 133.7, B=20 150.8 / 124.4, B=24 152.0 / 134.0, B=28 155.5 /
#   145.0; but N=8K B=17 80.0 / 85.9 (B=20 81.0 / 71.5, B=24 81.8 / 75.4), N=4K B=24 45.6 /
#   46.4 (B=20 45.2 / 43.1);
# - 2-bit (256-token tiles): N=16K B=17 134.7 / 117.2, B=24 135.6 / 111.8; N=8K B=17 72.8 /
#   67.1, B=24 73.9 / 65.6; N=4K B=20 42.4 / 37.7.
ONE_SPLIT_TAIL_MIN_TOKENS = {2: 4096, 4: 16384}
MIN_TAIL_WEIGHT = 10 * sm80.TAIL_UNIT
# Where the tails outnumber the free slots (k = ceil(P / e) of them a slot), the weight that
# ends them with the long splits: as a fluid (P (t + f) = e (b + f)) or in whole rounds (b + f
# = k (t + f), heavier where k is 2-4, the same where k is large).  With K and V at 2 bits
# whole rounds measured faster twice, at 4 bits not (an explanation, not measured: 2-bit
# CTAs are issue-bound and run no faster on an emptier SM, 4-bit ones gain bandwidth there,
# as a fluid would).  H200, fp16 Hkv=8 GQA 4, us, the rule's count with the fluid / whole
# rounds, at every shape of B = 1-33 x N = 4K-128K where the two picks differ, then again at
# 18 of them (profiles/NOTES.md, thirty-second session): 2-bit geomean 0.985 over 58 shapes,
# 0.965 over the 18: B=17 / 18 / 19 N=4K 40.0 / 40.7 / 41.4 -> 36.7 / 36.7 / 37.1, B=23 N=8K
# 73.1 -> 65.3, B=25 N=16K 127.8 -> 120.4, slower at B=17 N=16K 97.6 -> 100.1, B=27 / 28 N=8K
# 70.9 / 73.1 -> 72.7 / 74.9; 4-bit geomean 1.004 over 34 (B=26 N=32K 276.2 -> 257.1, B=27
# N=128K 982.4 -> 1044.9).
WHOLE_ROUNDS_BITS = 2
# A CTA's fixed time (entry, Q, the first tile's wait, epilogue) in tiles of the default
# kernel at two CTAs an SM: ~4.5 us against ~1.1 us a tile (B=16 N=64K, a per-CTA
# globaltimer trace, profiles/NOTES.md thirtieth session)
CTA_FIXED_TILES = 4
# More (sequence, KV head) pairs than CTA slots, but at most this many times as many: one
# split a pair runs a second, partial wave of whole-sequence CTAs, so splitting each pair
# in 2 or 4 (``wave_splits``) evens the waves out.  H200, fp16 Hkv=8 GQA 4 (264 slots),
# us, 1 / 2 / 4 splits (profiles/h200/splits_many_*.json, splits_many2_*.json):
# - 4-bit N=32K: B=36 491.9 / 391.2 / 351.6, B=40 485.5 / 395.5 / 386.3, B=48 487.2 / 452.3
#   / 461.0, B=56 589.6 / 534.0 / 539.3; N=16K B=40 254.7 / 212.6 / 211.1; N=8K B=48 139.5 /
#   135.3 / 142.8;
# - 2-bit N=32K B=40 424.4 / 344.8 / 341.7, B=48 423.1 / 396.2 / 405.4; N=16K B=56 265.9 /
#   249.1 / 256.9;
# - past 1.75 (one split kept): 4-bit N=32K B=64 596.4 / 590.4 / 596.9, N=16K B=66 308.2 /
#   325.9 / 332.7, N=8K B=64 164.2 / 174.4 / 183.9, N=16K B=80 392.6 / 388.1 / 398.1, N=8K
#   B=96 237.7 / 249.9 / 262.7, B=100 272.2 / 264.8 / 271.1, N=4K B=128 168.8 / 184.8 /
#   204.3; 2-bit N=16K B=64 267.2 / 277.5 / 291.7, B=80 342.0 / 343.0 / 360.5, N=8K B=96
#   207.7 / 224.0 / 246.0.
MANY_PAIRS_MAX = 1.75
# the heaviest weight (a tail of 1/256 of a long split; keeps n * weight in int32 for
# sequences of up to 2^19 tiles)
MAX_TAIL_WEIGHT = 256 * sm80.TAIL_UNIT


def tail_time(pairs: int, slots: int, tiles: int, splits: int, weight: int,
              fixed: float = CTA_FIXED_TILES) -> Optional[float]:
    """How long ``splits`` splits of each pair with ``split_tiles``' ``weight`` take, in
    tiles, when all the long splits fit the slots at once: the long ones start first, the
    tails run in rounds of the slots left free while they last and on any slot after; each
    CTA costs its tiles plus its ``fixed`` time (``waves_time`` for even splits; None when
    the long splits outnumber the slots).  The rounds are whole: a tail does not share a
    slot's time with the next one, which ``tail_balance``'s fluid assumes."""
    free = slots - (splits - 1) * pairs
    if splits < 2 or free <= 0:
        return None
    per_split = sm80.tiles_per_split(tiles, splits, weight)
    long, tail = per_split + fixed, max(tiles - (splits - 1) * per_split, 0) + fixed
    if -(-long // tail) * free >= pairs:  # every tail starts before the long splits end
        return max(long, -(-pairs // free) * tail)
    return long + tail


# Pairs that fill more than half the CTA slots but not all of them (one split by the fill
# rule, so each pair's one CTA leaves the rest idle): the even count of whole waves that
# ends soonest (``sm80_backend.fewest_waves`` at ``CTA_FIXED_TILES``) where that beats one
# split, or one split and a weighted tail, in the same model (``tail_time``).  Chosen on
# every count of 1, 3, 4, 5, 6, 8, 10 at B=17-32 x N=4K-64K (profiles/h200/splits_band_*.json:
# the model's pick averaged 1.003x the fastest count timed).  H200, fp16 Hkv=8 GQA 4 (264
# slots), us, the rule before / this one (its count) (splits_half_full_*.json, 48 shapes a
# format, B=17-30 x N=4K-128K; geomean 0.921 4-bit, 0.936 2-bit):
# - 4-bit: B=17 N=8K 80.7 / 66.3 (5), 32K 252.7 / 188.5 (9), 128K 939.4 / 636.8 (17); B=18
#   N=32K 290.1 / 193.9 (9); B=20 N=8K 81.8 / 70.2 (3), 64K 438.0 / 383.2 (8); B=24 N=32K
#   250.7 / 240.7 (4); B=26 N=128K 1043.2 / 960.2 (5); slower: B=26 N=8K 86.1 / 89.0 (5),
#   B=28 N=64K 532.5 / 561.4 (7), 128K 1091.9 / 1115.1 (7);
# - 2-bit: B=17 N=4K 43.6 / 39.7 (3), 32K 220.2 / 172.1 (5), 128K 816.2 / 569.2 (11); B=20
#   N=32K 199.5 / 185.8 (3); B=24 N=64K 411.5 / 394.4 (4); slower: B=18 N=4K 38.9 / 40.2 (3),
#   B=20 N=8K 60.0 / 61.3 (3), B=28 N=128K 866.3 / 878.6 (7); since then 2-bit tails are
#   weighed in whole rounds (``WHOLE_ROUNDS_BITS``), after which one split and its tail
#   win at B=20-28, and at B=17-19 below 32K tokens (B=17 N=4K 36.7 against 40.0 with 3
#   even splits);
# - GQA 8 (Hq=64), 4-bit: B=17 N=32K 282.5 / 206.0 (9), B=18 N=8K 88.7 / 70.1 (5).
# Where both rules take the same count (timed twice: as the rule's and as a count given) the
# two times differed by up to 6 % at N=128K (4-bit B=22 791.9 / 840.0), once by 19 % (4-bit
# B=30 N=128K 1103.3 / 1318.5).


# the heads tile of GQA groups of at most 4 heads (one query token): an 8-column wgmma whose
# quad lanes 2 and 3 take their partner's second rows instead of padding (``half_cols``;
# 2-4 % faster at B=8 / 16, level at B=1, profiles/h200/variants_half_cols.json)
HALF_TILE = sm90.HALF_HEADS_TILE


def tail_min_tokens(fmt: KVFormat, splits: int) -> int:
    """The shortest sequence that ``splits`` splits with a weighted tail were measured faster
    on: ``ONE_SPLIT_TAIL_MIN_TOKENS`` where the tail follows one long split, else
    ``TAIL_MIN_TOKENS``."""
    if splits == 2:
        return ONE_SPLIT_TAIL_MIN_TOKENS[2 if fmt.bits == fmt.v_bits == 2 else 4]
    return TAIL_MIN_TOKENS


def tail_balance(pairs: int, spare: int, tiles: int, splits: int, rounds: bool) -> Tuple[float, float]:
    """The long split's and the tail's tiles (b, t) with (splits - 1) b + t = ``tiles`` that
    end together when the ``pairs`` tails run on ``spare`` free slots, each CTA with the fixed
    time f (``CTA_FIXED_TILES``): ``rounds``, in k = ceil(P / e) whole rounds, b + f = k (t +
    f); else as a fluid, P (t + f) = e (b + f).  Whole rounds where they leave no tile for the
    tail fall back to the fluid."""
    f = CTA_FIXED_TILES
    if rounds:
        k = -(-pairs // spare)
        tail = (tiles - (splits - 1) * (k - 1) * f) / ((splits - 1) * k + 1)
        if tail >= 1:
            return k * tail + (k - 1) * f, tail
    share = spare / pairs
    long = (tiles + f * (1 - share)) / (splits - 1 + share)
    return long, tiles - (splits - 1) * long


def wave_splits(pairs: int, slots: int, tiles: int) -> int:
    """Splits a (sequence, KV head) pair where the pairs outnumber the CTA slots by at most
    ``MANY_PAIRS_MAX``: 2 or 4, whichever ends sooner in whole waves of CTAs that each take
    their share of the tiles plus the fixed time (``CTA_FIXED_TILES``; 2 on a tie), as long
    as each split keeps ``MIN_TILES_PER_SPLIT`` tiles; else 1."""
    if not slots < pairs <= MANY_PAIRS_MAX * slots:
        return 1
    fits = [s for s in (2, 4) if tiles >= s * sm80_backend.MIN_TILES_PER_SPLIT]
    return min(fits, key=lambda s: sm80_backend.waves_time(pairs, slots, tiles, s, CTA_FIXED_TILES), default=1)


def measured_grids(fmt: KVFormat, head_dim: int) -> bool:
    """Whether the grid rules below were measured for this format: K per channel in groups of
    >= 64 (where the default puts K's scale in Q), integer codes, head dim 128."""
    return not fmt.fp4 and fmt.k_mode == "channel" and fmt.group_size >= 64 and head_dim == 128


def small_grid(fmt: KVFormat, fp16: bool, head_dim: int, nh: int):
    """The ``"small"`` variant's keywords where small grids of this decode request take it,
    else None (``Sm90Backend.grid_variant``).  Measured (``measured_grids``): 4-bit with GQA
    tiles of 8 columns (4 or 8 heads; in bf16 the 4-head tile, the one measured), two
    consumers in one CTA without the fold; 2-bit fp16 with the 4-head tile, two consumers (its
    default there is one, two CTAs an SM)."""
    if not measured_grids(fmt, head_dim):
        return None
    if fmt.bits == fmt.v_bits == 4 and (nh == HALF_TILE or (nh == 8 and fp16)):
        return SMALL_GRID
    if fmt.bits == fmt.v_bits == 2 and nh == HALF_TILE and fp16:
        return SMALL_GRID_2BIT
    return None


def grid_keywords(fmt: KVFormat, fp16: bool, head_dim: int, nh: int, variant: str):
    """``DecodeSm90`` keywords of ``grid_variant``'s kernel ``variant`` (None: there is no
    such kernel).  The default kernel's are DecodeSm90's own, but for 2-bit with the 4-head
    tile (``one_consumer``): one consumer warpgroup, two CTAs an SM, where the grid fills
    the SMs (H200, one run, 2c128 fp16 GQA 4, us, two / one consumers,
    profiles/h200/variants_consumers_2bit.json: B=8 N=64K 143.7 / 141.5, B=16 272.4 / 267.9,
    but B=1 N=128K 45.8 / 47.1, so its "small" kernel keeps two)."""
    if variant == "small":
        keywords = small_grid(fmt, fp16, head_dim, nh)
        if keywords is None:
            return None
    else:
        keywords = {"consumers": 1} if one_consumer(fmt, head_dim, nh) else {}
    return {**keywords, "merge_splits": True} if merges_in_kernel(fmt) else keywords


def merges_in_kernel(fmt: KVFormat) -> bool:
    """Whether the split decode merges its splits in its last CTAs (``DecodeSm90``'s
    ``merge_splits``, ``HeadMerge``) instead of launching the combine kernel: integer 4-bit
    K and V.  Its GPU time is the combine's (H100, CUDA-graph replay, one run, us, combine
    / merged, profiles/h100/variants_headmerge_4bit_h100.json, variants_headmerge2_h100.json:
    fp16 B=1 N=4K 11.25 / 11.07, 16K 15.62 / 15.46, 64K 33.33 / 33.92, 128K 58.88 / 59.42,
    B=2 N=32K 36.10 / 34.21, B=4 59.81 / 59.34, B=8 N=64K 198.1 / 196.8; bf16 11.65 / 12.06,
    16.16 / 16.46, 33.74 / 34.02, 35.33 / 33.86, 59.31 / 60.46, 199.6 / 197.7) and an eager
    call makes one launch, not two: 12.2 / 8.2 and 11.8 / 8.3 us of host time a layer (bf16
    B=1 N=1K, 4 splits, the GPU held busy, two runs: profiles/host_merge.py,
    profiles/h100/host_merge_h100.json).  2-bit's small grid lost 1.3-2.6 us merged at B=1
    (fp16 N=4K 12.26 / 14.82, 32K 20.06 / 21.36, 128K 45.42 / 47.04; the loop's SASS is
    the same, and with the count-in alone it is level with the combine, so ``HeadMerge``
    itself costs it: profiles/h100/variants_merge_parts_2bit_*_h100.json), so it keeps the
    combine; K4V2 and FP4 were not measured."""
    return fmt.bits == fmt.v_bits == 4 and not fmt.fp4


def one_consumer(fmt: KVFormat, head_dim: int, nh: int) -> bool:
    """Whether the default kernel runs one consumer warpgroup, two CTAs an SM (2-bit with
    the 4-head tile, ``grid_keywords``).  bf16 too, where K's scale is in Q as well
    (``DecodeSm90.fold_k_bf16``), but everywhere: its small grid's two consumers measured
    slower (H200, 2c128 bf16 GQA 4, us, the fold with two consumers in one CTA / one in each
    of two / no fold, profiles/h200/variants_fold_bf16_2bit.json: B=1 N=128K 50.7 / 49.5 /
    49.2, B=8 N=64K 164.8 / 152.0 / 154.0, B=16 314.4 / 290.4 / 295.7)."""
    return fmt.bits == fmt.v_bits == 2 and nh == HALF_TILE and measured_grids(fmt, head_dim)


def small_pairs(pairs: int, sms: int) -> bool:
    """Whether ``pairs`` (sequence, KV head) pairs make a small grid: the default kernel
    would need ``SMALL_GRID_SPLITS`` splits a pair or more to fill the SMs."""
    return pairs * SMALL_GRID_SPLITS <= sms


def sm80_short(fmt: KVFormat, dtype, head_dim: int, pairs: int, rows: int, tq: int, max_len: int) -> bool:
    """Whether ``auto`` runs a decode of ``pairs`` (sequence, KV head) pairs, ``rows`` query
    rows a KV head of ``tq`` tokens, over sequences of at most ``max_len`` tokens on sm80
    (``SM80_SHORT``): one query token, the measured formats (K per channel g128, integer
    codes, head dim 128, fp16 / bf16).  By tiles, so that calls with the same tile count
    (``KVCache``'s fast-path key) decide alike."""
    if (tq != 1 or rows > HALF_TILE or not measured_grids(fmt, head_dim) or fmt.group_size != 128
            or dtype not in (torch.float16, torch.bfloat16)):
        return False
    tiers = SM80_SHORT.get((fmt.bits, fmt.v_bits, rows > 1), ())
    tokens = next((tokens for most, tokens in tiers if pairs <= most), 0)
    return tokens > 0 and fmt.tiles(max_len) <= fmt.tiles(tokens)


def short_tiles(fmt: KVFormat, fp16: bool, head_dim: int, nh: int) -> int:
    """The most tiles a sequence may have for one split of the small grid's kernel to
    replace the default's two where the pairs fill the SMs (``SHORT_TILES``; 0: never).
    The 4-head tile only: the 8-head tile's small grid was measured at B <= 2 alone."""
    if nh != HALF_TILE or small_grid(fmt, fp16, head_dim, nh) is None:
        return 0
    return SHORT_TILES[fmt.bits]


# Hopper's GEMM choice: the wgmma kernel (pipelined s8 x s8 wgmma, the token tile staged
# once per CTA, K split over a cluster where its tiles leave the GPU half idle) beats the
# mma.sync kernel above 48 tokens on every BitNet shape, above 32 on all but the smallest
# matrix, and from 17 on the widest (more weight rows than the mma.sync kernel's CTA
# columns re-reading the activations can stream); up to 16 tokens mma.sync always wins
# (H200, profiles/NOTES.md, nineteenth session: 2560 x 2560 at 48 tokens 5.6 vs 6.1 us, at
# 64 6.6 vs 6.2; 3200 x 10240 at 32 12.7 vs 13.9, at 48 16.6 vs 11.6; 13824 x 2560 at 24
# 17.0 vs 11.0).
WGMMA_SMALL_M = 16  # up to this many tokens: mma.sync
WGMMA_ALL_M = 48  # above: wgmma
WGMMA_MOST_M = 32  # above: wgmma unless the matrix is at most WGMMA_SMALL_MATRIX
WGMMA_SMALL_MATRIX = 2560 * 2560
WGMMA_MIN_N = 13824  # from WGMMA_SMALL_M + 1 tokens: wgmma from this many weight rows


class BitnetKernels(sm80_backend.BitnetKernels):
    """sm80's BitNet kernels, plus Hopper's: the stripe GEMV (a CTA's weights through one
    bulk copy, ``bitnet_gemv.BULK`` / ``BULK_X``), the register GEMV's PDL configurations
    the host picks from, and the wgmma GEMM (``bitnet_gemm``)."""

    gemm_kernels = ("mma", "wgmma")
    stripe_gemv = True

    def gemv_config(self, n: int, k: int, sms: int):
        from . import bitnet_gemv

        return bitnet_gemv.config_for(n, k, sms)

    def gemv_configs(self) -> list:
        from . import bitnet_gemv

        return super().gemv_configs() + list(bitnet_gemv.CANDIDATES) + [bitnet_gemv.BULK, bitnet_gemv.BULK_X]

    def gemv_key(self, cfg, k: int) -> tuple:
        """The stripe kernel is compiled per K (its stripe is sized to fit shared memory)."""
        if not cfg.bulk:
            return super().gemv_key(cfg, k)
        from . import bitnet_gemv

        if not bitnet_gemv.bulk_fits(k, cfg.stage_x):
            raise ValueError(f"the bulk-copy GEMV's stripe of K={k} does not fit in shared memory")
        return ("bulk", cfg, k)

    def compile_gemv(self, cfg, k: int, options: str):
        if not cfg.bulk:
            return super().compile_gemv(cfg, k, options)
        from . import bitnet_gemv

        self.gemv_key(cfg, k)
        return bitnet_gemv.compile_bulk(cfg, k, options)

    def gemv_launch_size(self, cfg, n: int, k: int, sms: int) -> int:
        if not cfg.bulk:
            return super().gemv_launch_size(cfg, n, k, sms)
        from . import bitnet_gemv

        return bitnet_gemv.bulk_warps(k)

    def default_gemm_kernel(self, m: int, n: Optional[int] = None, k: Optional[int] = None) -> str:
        """mma.sync (split-K, streaming the weights) up to ``WGMMA_SMALL_M`` tokens; wgmma
        above ``WGMMA_ALL_M``, above ``WGMMA_MOST_M`` but for the smallest matrices, and above
        ``WGMMA_SMALL_M`` for at least ``WGMMA_MIN_N`` weight rows (measured on the H200)."""
        if m <= WGMMA_SMALL_M:
            return "mma"
        if m > WGMMA_ALL_M:
            return "wgmma"
        if m > WGMMA_MOST_M:
            return "mma" if n is not None and k is not None and n * k <= WGMMA_SMALL_MATRIX else "wgmma"
        return "wgmma" if n is not None and n >= WGMMA_MIN_N else "mma"

    def gemm_plan(self, kernel: str, m: int, n: int, k: int, sms: int, raw: bool, pdl: bool):
        if kernel != "wgmma":
            return super().gemm_plan(kernel, m, n, k, sms, raw, pdl)
        from . import bitnet_gemm as mod

        cfg = dataclasses.replace(mod.config_for(m, n, sms), raw=raw)
        # the tiles of a partial last wave split along K (its workspace: the tail tiles'
        # int32 partial sums and arrival counts; none without a tail); or, where its tiles
        # leave half the CTA slots idle, K split over a cluster's CTAs; or, with more tiles
        # than CTA slots, a persistent grid (``persistent_plan``)
        persistent = mod.persistent_plan(cfg, m, n, k, sms)
        cluster_k = 1 if persistent else mod.cluster_plan(cfg, m, n, k, sms)
        if cluster_k > 1 or persistent:
            full, splits, tails = mod.tile_count(cfg, m, n), 1, 0
        else:
            full, splits, tails = mod.split_plan(cfg, m, n, k, sms)
        # (only what the plan needs; PDL where it pays: ``pdl_plan``)
        cfg = dataclasses.replace(cfg, split_k=tails > 0, cluster_k=cluster_k, persistent=persistent,
                                  pdl=mod.pdl_plan(m) and pdl)
        return cfg, (full, splits), (tails * splits * cfg.block_m * cfg.block_n, tails)

    def compile_gemm(self, kernel: str, cfg, options: str):
        if kernel != "wgmma":
            return super().compile_gemm(kernel, cfg, options)
        from . import bitnet_gemm

        return bitnet_gemm.compile_gemm(cfg, options)


class Sm90Backend(sm80_backend.Sm80Backend):
    """Hopper only (sm_90a code); the decode plan, writes and limits of sm80 otherwise."""

    name = "sm90"
    whole_waves = True  # two (or one) CTAs per SM: a partial second wave costs a full one
    tails = True  # weighted tails (``tail_weight``; False: even splits, for A/B timing)
    # The appending decode merges any split count in its last CTA (``HeadMerge``): the one
    # call beat append + decode at every count measured (H100, B=1, GQA 4, GPU us a step,
    # two calls / one, profiles/h100/append_step_gpu_nolimit*_h100.json): 4-bit bf16 at 16
    # splits 21.71 / 18.52 (32K), 60.60 / 58.10 (128K); 2 KV heads, 66 splits 19.95 / 11.93,
    # 23.63 / 20.25; 1 KV head, 128 / 132 splits 20.45 / 13.27, 20.19 / 16.68; 2-bit fp16 at
    # 16 splits 21.64 / 18.44, 47.42 / 44.24
    append_max_splits = sm80.MAX_SPLITS

    decode_tiles = (HALF_TILE,) + sm80.HEADS_TILES
    bitnet = BitnetKernels()

    def supports(self, capability: Tuple[int, int]) -> bool:
        return capability[0] == 9

    def heads_tile(self, rows: int, tq: int) -> int:
        """``HALF_TILE`` for at most 4 rows of one query token (GQA <= 4: half the softmax
        work of an 8-head tile, see ``DecodeSm90.half_cols``), else sm80's 8 or 16."""
        return HALF_TILE if rows <= HALF_TILE and tq == 1 else super().heads_tile(rows, tq)

    def auto_picks(self, fmt: KVFormat, head_dim: int, dtype=None) -> bool:
        """4-bit (integer or FP4) fp16 / bf16 caches with head dims up to 128, 2-bit fp16 / bf16
        caches with K per channel in groups of 128, and K 4-bit / V 2-bit ones.  On the H200 (sixth session, CUDA-graph
        replay, L2 flushed, us, sm90 vs sm80): integer 4-bit with V's scale folded into P, fp16
        B=1 N=128K 58.4 vs 62.6, B=16 N=32K 189.6 vs 226.9, B=16 N=64K 362.2 vs 379.7; bf16
        59.9 vs 61.2, 197.0 vs 222.9, 379.7 vs 377.8 (before the fold bf16 was 8 % slower here
        and stayed on sm80).  NVFP4 fp16 91.6 vs 95.3, 325.5 vs 448.9, 632.8 vs 881.5; MXFP4
        bf16 85.3 vs 92.4, 299.6 vs 306.4, 584.0 vs 592.5.  2-bit with 128-token steps
        (fifteenth session, ``profiles/h200/decode_backends.json`` and a side-by-side run in
        NOTES.md): K per channel g128 fp16 faster from N = 32K (B=1 N=128K 51.1 vs 54.1, B=16
        N=128K 577.6 vs 625.4), 1.4 us slower at B=1 N=4K; bf16, once K's scale went into Q
        (twenty-sixth session, ``profiles/h200/splits_backends_2bit_bf16.json``): B=1 N=32K
        23.2 vs 24.9, N=128K 50.2 vs 52.2, B=8 N=64K 152.6 vs 181.9, B=16 N=4K 30.7 vs 35.5,
        N=32K 152.6 vs 159.0, N=128K 568.4 vs 593.9, 1.0 us slower at B=1 N=4K.  K per token
        g64 (slower at B=16: 348.5 vs 324.9) stays on sm80, as do head dim 256, never timed
        here, and an unknown dtype (profiles/NOTES.md).  K 4-bit / V 2-bit
        (K per channel g128, fp16), two recordings of ``decode_backends.json`` (twenty-first
        and twenty-second sessions), sm90 vs sm80: B=1 N=32K 25.5 vs 30.8, N=128K 54.8 vs
        70.2, B=16 N=4K 33.5 vs 38.3, N=32K 165.1 vs 174.3, N=128K 612.1 vs 644.5; 1.7 us
        slower at B=1 N=4K (15.0 vs 13.3); in bf16 (twenty-seventh session,
        ``profiles/h200/splits_backends_k4v2_bf16.json``): B=1 N=32K 25.2 vs 30.7, N=128K 54.2 vs
        69.7, B=8 N=64K 165.4 vs 196.7, B=16 N=4K 32.8 vs 38.6, N=32K 165.4 vs 174.2, 1.4 us
        slower at B=1 N=4K (14.2 vs 12.8)."""
        if head_dim > 128 or dtype not in (torch.float16, torch.bfloat16):
            return False
        if fmt.bits == fmt.v_bits == 4:
            return True
        return (fmt.bits in (2, 4) and fmt.v_bits == 2 and fmt.k_mode == "channel" and fmt.group_size == 128
                and not fmt.fp4)

    def ctas_per_sm(self, fmt: KVFormat, head_dim: int, nh: int, dtype=torch.float16, variant: str = "",
                    arch: str = "sm_90a") -> int:
        """What the decode kernel for these arguments is built for (its constexpr config;
        ``arch``, which sm80's register model reads, does not change it)."""
        return _kernel_ctas_per_sm(self, fmt, head_dim, nh, dtype, variant)

    def call_backend(self, cache, q_shape, max_len: int) -> str:
        """sm80 for the short sequences of small grids that its kernels decode faster
        (``sm80_short``), else sm90."""
        bsz, tq, hq, d = q_shape
        hkv = cache.k_res.shape[2]
        if sm80_short(cache.fmt, cache.k_res.dtype, d, bsz * hkv, query_rows(1, hq, hkv), tq, max_len):
            return sm80_backend.BACKEND.name
        return self.name

    def unsplit(self, fmt, dtype, head_dim, nh, batch, kv_heads, tq, max_len, device) -> bool:
        """One split where the request's pairs fill more than half the SMs and its sequences
        are short (``short_tiles``), and for a small grid's very short sequences
        (``DIRECT_TILES``): ``grid_variant`` then takes the one-CTA kernel."""
        short = short_tiles(fmt, dtype == torch.float16, head_dim, nh) if tq == 1 else 0
        if not short:
            return False
        pairs, tiles, sms = batch * kv_heads, fmt.tiles(max_len), num_sms(device)
        if sms < 2 * pairs <= 2 * sms:
            return tiles <= short
        return small_pairs(pairs, sms) and tiles <= DIRECT_TILES.get(fmt.bits, 0)

    def choose_splits(self, cache, q_shape, max_len: int, device) -> int:
        """sm80's fill rule in whole waves; where the pairs outnumber the slots a little
        (``wave_splits``), 2 or 4 splits; and one more split with a weighted tail
        (``tail_weight``) where that measured faster: after one even split, or with a tail
        of at most a tenth of a long split (``MIN_TAIL_WEIGHT``); where one split leaves
        slots idle, the faster in the wave model of it and several even splits
        (``half_full_splits``)."""
        splits = super().choose_splits(cache, q_shape, max_len, device)
        if splits == 1:
            splits = self.many_pairs_splits(cache, q_shape, max_len, device)
        if splits >= sm80.MAX_SPLITS:
            return splits
        weight = self.tail_weight(cache, q_shape, splits + 1, max_len, device)
        takes = weight > sm80.TAIL_UNIT and (splits == 1 or weight >= MIN_TAIL_WEIGHT)
        if splits == 1:
            return self.half_full_splits(cache, q_shape, max_len, device, weight if takes else 0)
        return splits + 1 if takes else splits

    def half_full_splits(self, cache, q_shape, max_len: int, device, weight: int) -> int:
        """Where one split leaves CTA slots idle (pairs between half the slots and all of
        them) on one query token of a ``measured_grids`` format: ``fewest_waves``' even count
        where the model ends it sooner than one split, or than 2 with a tail of ``weight``
        (0: no tail); else that one split (1 or 2)."""
        one = 2 if weight else 1
        bsz, tq, hq, d = q_shape
        hkv = cache.k_res.shape[2]
        if tq != 1 or not measured_grids(cache.fmt, d):
            return one
        nh, slots = self.default_grid(cache, q_shape, device)
        if self.unsplit(cache.fmt, cache.k_res.dtype, d, nh, bsz, hkv, tq, max_len, device):
            return one
        pairs, tiles = bsz * hkv, cache.fmt.tiles(max_len)
        if not pairs <= slots < 2 * pairs:
            return one
        most = sm80_backend.most_splits(tiles)
        even = sm80_backend.fewest_waves(pairs, slots, tiles, most, CTA_FIXED_TILES)
        single = tail_time(pairs, slots, tiles, 2, weight) if weight else None
        if single is None:  # (no tail, or no slot free for one)
            single = sm80_backend.waves_time(pairs, slots, tiles, 1, CTA_FIXED_TILES)
        return even if sm80_backend.waves_time(pairs, slots, tiles, even, CTA_FIXED_TILES) < single else one

    def many_pairs_splits(self, cache, q_shape, max_len: int, device) -> int:
        """``wave_splits`` for the default kernel's slots on one query token of a
        ``measured_grids`` format, else 1."""
        bsz, tq, hq, d = q_shape
        hkv = cache.k_res.shape[2]
        # every kernel has at least one slot an SM: fewer pairs than SMs never outnumber them
        if tq != 1 or bsz * hkv <= num_sms(device) or not measured_grids(cache.fmt, d):
            return 1
        return wave_splits(bsz * hkv, self.default_grid(cache, q_shape, device)[1], cache.fmt.tiles(max_len))

    def default_grid(self, cache, q_shape, device) -> Tuple[int, int]:
        """(heads tile, CTA slots) of the default decode kernel for this request: the slots
        are the SMs times its CTAs an SM, which the split rules fill."""
        bsz, tq, hq, d = q_shape
        nh = self.heads_tile(query_rows(tq, hq, cache.k_res.shape[2]), tq)
        return nh, num_sms(device) * self.ctas_per_sm(cache.fmt, d, nh, cache.k_res.dtype)

    def tail_weight(self, cache, q_shape, splits: int, max_len: int, device) -> int:
        """The weight of ``split_tiles`` for ``splits`` splits of the default kernel: with P
        (sequence, KV head) pairs, the first ``splits - 1`` splits of each take P (splits -
        1) of the SM slots and the e slots left run the P tails; a tail of t tiles and a
        long split of b end together (``tail_balance``: K and V at 2 bits in whole rounds
        of tails, ``WHOLE_ROUNDS_BITS``; else as a fluid).  The weight is b / t in sixteenths
        (``sm80.TAIL_UNIT``); even wherever there is no such tail (no free slot, a tail
        under one tile or as long as the others) and outside what was measured
        (``measured_grids``, ``tail_min_tokens``).  ``tails`` False: even."""
        even = sm80.TAIL_UNIT
        bsz, tq, hq, d = q_shape
        # the checks that need no tensor attribute first (host time: choose_splits asks
        # whenever a cache's tile count changes, decode_attention on every call)
        if (not self.tails or splits < 2 or max_len < tail_min_tokens(cache.fmt, splits)
                or not measured_grids(cache.fmt, d)):
            return even
        hkv = cache.k_res.shape[2]
        nh, slots = self.default_grid(cache, q_shape, device)
        if self.grid_variant(cache.fmt, cache.k_res.dtype, d, nh, bsz, hkv, tq, device, splits):
            return even
        pairs = bsz * hkv
        spare = slots - pairs * (splits - 1)
        if spare <= 0:
            return even
        rounds = cache.fmt.bits == cache.fmt.v_bits == WHOLE_ROUNDS_BITS
        long, tail = tail_balance(pairs, spare, cache.fmt.tiles(max_len), splits, rounds)
        if tail < 1:
            return even
        return min(MAX_TAIL_WEIGHT, max(even, round(even * long / tail)))

    def grid_variant(self, fmt, dtype, head_dim, nh, batch, kv_heads, tq, device, splits=0) -> str:
        """``"small"`` where ``small_grid`` takes the request and (sequence, KV head)
        pairs are so few that the default kernel needs at least ``SMALL_GRID_SPLITS`` splits
        each to fill the SMs: there one CTA an SM with two consumer warpgroups and K's scale
        left out of Q (``SMALL_GRID``) is faster.  H200, one run (B=1, Hkv=8, 4-bit K per
        channel g128 fp16, profiles/h200/variants_consumers.json, "c2nf" against "base", us):
        N=4K 12.54 -> 11.90, 32K 25.28 -> 22.42, 128K 57.17 -> 53.97; at B=8 it was 3 %
        slower (173.9 -> 179.7).  bf16, GQA 4 (profiles/h200/variants_small_grid_bf16.json):
        B=1 N=4K 12.26 -> 12.02, 32K 25.38 -> 22.29, 128K 57.95 -> 55.94, B=2 N=64K 57.02 ->
        56.10, B=4 100.0 -> 101.7.  At N=64K (profiles/h200/variants_scalers.json, one run):
        B=2 55.26 -> 53.92, B=4 94.38 -> 95.52, so the threshold sits between 8 and 4 splits
        a pair (B=2 at Hkv=8 on 132 SMs) and bigger grids keep the default.  2-bit (4-head
        tile): two consumers in one CTA, K's scale kept in Q, against the default two CTAs of
        one (profiles/h200/variants_consumers_2bit.json, us): B=1 N=128K 45.8 vs 47.1, and
        the default ahead at B=8 / 16 N=64K (141.5 vs 143.7, 267.9 vs 272.4)."""
        fp16 = dtype == torch.float16
        if tq != 1 or small_grid(fmt, fp16, head_dim, nh) is None:
            return ""
        pairs, sms = batch * kv_heads, num_sms(device)
        if small_pairs(pairs, sms):
            return "small"
        # one split that one CTA a pair fits in the SMs (two CTAs an SM would leave half
        # their slots idle)
        return "small" if splits == 1 and pairs <= sms and short_tiles(fmt, fp16, head_dim, nh) else ""

    def variants(self, kinds, formats, head_dims, dtypes) -> List[Variant]:
        """sm80's list, and the ``"small"`` grid variant of each decode kernel that has one."""
        out = super().variants(kinds, formats, head_dims, dtypes)
        return out + [v._replace(extra=v.extra + ("small",)) for v in out if v.kind == "decode" and small_grid(
            sm80_backend.variant_format(v), v.dtype == "fp16", v.head_dim, sm80_backend.decode_variant_args(v)[0])
            is not None]

    def merges_splits(self, arch, fmt, dtype, head_dim, nh, split, tq=1, variant=""):
        """Whether the split kernel merges its splits in its last CTAs (``DecodeSm90``'s
        ``merge_splits``, which ``grid_keywords`` sets where ``merges_in_kernel``): asked of
        the kernel object ``make_decode`` builds (a plan build's ~10 us; no compile), so that
        whatever built it with other keywords (``profiles/bench_variants.py``'s variants) is
        launched as it was built."""
        return split and self.make_decode(arch, fmt, dtype, head_dim, nh, True, tq, variant).merges

    def make_decode(self, arch, fmt, dtype, head_dim, nh, split, tq=1, variant="", append=False):
        import cutlass

        from .decode import DecodeSm90

        sm80_backend.check_decode_request(fmt, tq)
        if arch != "sm_90a":
            raise ValueError(f"the sm90 decode kernel (wgmma, setmaxnreg) compiles for sm_90a only, got {arch!r}")
        if variant not in VARIANTS:
            raise ValueError(f"the sm90 decode kernel has no variant {variant!r} (known: {sorted(VARIANTS)})")
        half = nh == HALF_TILE
        if half and tq != 1:
            raise ValueError(f"the sm90 decode kernel's {HALF_TILE}-head tile takes one query token, got tq={tq}")
        keywords = grid_keywords(fmt, dtype is cutlass.Float16, head_dim, nh, variant)
        if keywords is None:
            raise ValueError(f"the sm90 decode kernel has no small-grid variant for {fmt} at head dim {head_dim}, "
                             f"{nh} heads, {dtype.__name__}")
        return DecodeSm90(dtype, fmt.bits, fmt.k_mode, fmt.group_size, head_dim, sm80.HEADS_TILES[0] if half else nh, split,
                          pdl=jit.has_pdl(arch), sinks=fmt.sink_tokens, v_bits=fmt.v_bits, tq=tq, fp4=fmt.fp4,
                          half_cols=half, append=append, **keywords)


@functools.lru_cache(maxsize=None)
def _kernel_ctas_per_sm(backend: Sm90Backend, fmt: KVFormat, head_dim: int, nh: int, dtype, variant: str) -> int:
    """``Sm90Backend.ctas_per_sm``, remembered: the split heuristic asks on every decode call
    that misses the cache's fast path, and building the kernel's config costs ~10 us."""
    kernel = backend.make_decode("sm_90a", fmt, sm80_backend._cute_dtype(dtype), head_dim, nh, True, variant=variant)
    return kernel.ctas_per_sm


BACKEND = Sm90Backend()


def compile_decode(arch: str, fmt: KVFormat, dtype, head_dim: int, nh: int, split: bool, keep_ptx: bool = False,
                   tq: int = 1):
    """The sm90 decode kernel (sm_90a only; ``Sm90Backend.compile_decode``)."""
    return BACKEND.compile_decode(arch, fmt, dtype, head_dim, nh, split, keep_ptx=keep_ptx, tq=tq)
