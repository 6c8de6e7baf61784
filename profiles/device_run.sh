#!/usr/bin/env bash
# One device call's work, step by step, on the GPU host (see ../shared/device/README.md):
#
#   source .device/gpu-env.sh >/dev/null && timeout 590 bash profiles/device_run.sh suite:400 quick
#
# Steps, run in the order given (each under its own timeout).  Logs and results go flat into a
# folder of their own, which after every step is tarred to $OUT/records_<tag>.tar (a device
# call brings back only a few files of $OUT, and a call cut short keeps the steps that ended;
# unpack with `tar -xf`):
#   suite[:S]   the GPU test suite (-m gpu, 14 xdist workers; S seconds, default 400), then
#               any worker it left behind is killed so that no later timing shares the GPU
#   peer        FlashInfer's kit on PYTHONPATH (../shared/peers/flashinfer) for what follows
#   quick       bitdecode bench decode --quick (every backend side by side; FlashInfer too
#               after `peer`)
#   full        bitdecode bench decode (the full sweep)
#   flush       profiles/bench_flush.py (clean / dirty / no flush, interleaved)
#   settle      profiles/bench_free_settle.py (how long freed memory slows a decode)
#   wide        the wide_boxes A/B of the sm90 decode, narrow against wide (the default)
#               boxes (profiles/bench_variants.py)
#   ringwide    the same with the decode's ring alone, narrow and wide boxes (the probe
#               patch profiles/probes/sm90_decode_ablation.patch applied for the step, then
#               taken back out)
#   placement   one cache allocated afresh six times in one process, each timed three times
#               (profiles/bench_placement.py: K4V2 fp16 B=16 N=64K; bimodal on an H100 until
#               the captures waited out the memory they free, sixty-ninth session)
#   b1short     sm90 against sm80 on B=1 (and B=2) sequences of 1K-16K tokens, 4-bit, 2-bit and
#               K4V2, GQA 4 and MHA, each backend's own split choice timed twice in turn
#               (profiles/bench_splits.py --backends sm90,sm80,sm90,sm80): whether `auto`
#               should leave the shortest small grids to sm80 (seventieth session)
#   b1more      b1short's A/B where it was not taken: bf16 (4c128, 2c128, K4V2), other K modes
#               and groups (4c64, 4t64), B=2 at 8K / 16K and B=4 (32 pairs) at 2K-8K, and many
#               pairs of few tiles (B=32-128 at 1K-2K): how far the per-call rule that gives short
#               small grids to sm80 (kernels_sm90.backend.SM80_SHORT) could reach (seventy-first
#               session)
#   manyedge    b1more's many-pairs A/B between its points (B=40-96 at 512-2K tokens): the lower
#               bound on pairs that a many-pairs tier of SM80_SHORT would need (seventy-second)
#   b16short    the sm90 short-sequence rule (SHORT_TILES: one split of the small grid's kernel
#               against two of the default) again, its one split timed first and last
#               (--splits 1,2,0,1): the records it was fitted on timed the one split first,
#               inside the capture's slow spell; on an H100 one split won at 4-bit B=16 12K-16K,
#               past the rule's 8K (profiles/h100/short_grids_h100.json, seventieth session)
# The GPU's name picks the tag (h200 / h100 / ...), so a record is never filed under the
# wrong GPU.
set -u
: "${OUT:?OUT must name the output folder (a device call sets it)}"
for arg in "$@"; do  # (every step known before any runs: a typo costs no device time)
  case "$arg" in
    suite|suite:[0-9]*|peer|quick|full|flush|settle|wide|ringwide|placement|b1short|b1more|manyedge|b16short) ;;
    *) echo "device_run.sh: unknown step '$arg'" >&2; exit 2 ;;
  esac
done
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$GPU" in
  *H200*) TAG=h200 ;;
  *H100*) TAG=h100 ;;
  *) TAG=$(echo "$GPU" | tr -c 'A-Za-z0-9\n' '_' | tr 'A-Z' 'a-z') ;;
esac
echo "GPU: $GPU (tag $TAG)"
WORK=$(mktemp -d)
bundle() { tar -C "$WORK" -cf "$OUT/records_$TAG.tar" . ; }

step() {  # step NAME SECONDS COMMAND...: run it under a timeout, log to $WORK/NAME_$TAG.log
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date +%T), at most ${limit} s)"
  timeout "$limit" "$@" > "$WORK/${name}_$TAG.log" 2>&1
  echo "$name rc=$?"
  grep -v -e Warning -e warn "$WORK/${name}_$TAG.log" | tail -25
}

ab() {  # ab NAME SECONDS FORMAT SHAPES [ARGS...]: sm90 against sm80, each its own split choice, twice in turn
  local name=$1 limit=$2 fmt=$3 shapes=$4
  shift 4
  step "$name" "$limit" python3 profiles/bench_splits.py --format "$fmt" --shapes "$shapes" --splits 0 \
    --backends sm90,sm80,sm90,sm80 "$@" --out "$WORK" --tag "${name}_$TAG"
}

for arg in "$@"; do
  case "$arg" in
    suite|suite:*)
      limit=${arg#suite}; limit=${limit#:}
      step suite "${limit:-400}" python3 -m pytest -m gpu -q -n 14 -p no:cacheprovider tests -rfEs --tb=short
      # (a stopped run leaves its xdist workers, execnet children named by their -c line)
      pkill -9 -f "pytest -m gpu"; pkill -9 -f "sys.stdin.readline"; sleep 2 ;;
    peer)
      eval "$(bash .device/fi-setup.sh)" ;;
    quick)
      step quick 300 bitdecode bench decode --quick --out "$WORK" ;;
    full)
      step full 420 bitdecode bench decode --out "$WORK" ;;
    flush)
      step flush 200 python3 profiles/bench_flush.py --out "$WORK" --tag "$TAG" ;;
    settle)
      step settle 120 python3 profiles/bench_free_settle.py --out "$WORK" --tag "$TAG" ;;
    wide)
      step wide 200 python3 profiles/bench_variants.py --variant narrow=wide_boxes=False --variant wide=wide_boxes=True \
        --formats 4c128,2c128 --shapes 1x4096,1x131072,16x65536 --out "$WORK" --tag "wide_boxes_$TAG" ;;
    placement)
      step placement 240 python3 profiles/bench_placement.py --out "$WORK" --tag "k4v2_$TAG" ;;
    b1short)
      for f in 4c128 2c128 k4v2c128; do ab "b1short_$f" 150 "$f" 1x1024,1x2048,1x4096,1x8192,1x16384,2x4096; done
      for f in 4c128 2c128; do ab "b1short_mha_$f" 120 "$f" 1x1024,1x2048,1x4096,1x8192 --heads 32/32; done ;;
    b1more)
      for f in 4c128 2c128 k4v2c128; do
        ab "b1more_bf16_$f" 150 "$f" 1x2048,1x4096,1x8192,1x16384,2x4096,2x8192 --dtype bf16
        ab "b1more_$f" 150 "$f" 2x8192,2x16384,4x2048,4x4096,4x8192
      done
      for f in 4c64 4t64; do ab "b1more_$f" 120 "$f" 1x2048,1x4096,1x8192,2x4096; done
      # many pairs, few tiles: sm80 led at B=64 N=1K in all four full sweeps
      for f in 4c128 2c128; do ab "b1more_many_$f" 150 "$f" 32x1024,64x1024,64x2048,128x1024; done ;;
    manyedge)
      # where the many-pairs edge lies: sm90 led 4-bit B=32 N=1K by 29 %, sm80 led B=64-128
      for f in 4c128 2c128; do ab "manyedge_$f" 200 "$f" 40x1024,48x1024,64x512,96x1024,64x1536,96x2048; done ;;
    b16short)
      step b16short_4c128 200 python3 profiles/bench_splits.py --format 4c128 --shapes 16x4096,16x8192,16x12288,16x16384,16x24576,16x32768,12x8192,12x12288,12x16384,9x12288,9x16384 \
        --splits 1,2,0,1 --out "$WORK" --tag "b16short_4c128_$TAG"
      step b16short_2c128 200 python3 profiles/bench_splits.py --format 2c128 --shapes 16x8192,16x16384,16x24576,16x32768 \
        --splits 1,2,0,1 --out "$WORK" --tag "b16short_2c128_$TAG" ;;
    ringwide)
      patch=profiles/probes/sm90_decode_ablation.patch
      if git apply "$patch"; then
        step ringwide 240 python3 profiles/bench_variants.py --variant narrow=wide_boxes=False \
          --variant wide=wide_boxes=True --variant ring=probe_ring_only=True,wide_boxes=False \
          --variant ringwide=probe_ring_only=True,wide_boxes=True \
          --formats 4c128,2c128 --shapes 1x131072,16x65536 --out "$WORK" --tag "ring_wide_boxes_$TAG"
        git apply -R "$patch"
      else
        echo "ringwide: $patch does not apply"
      fi ;;
  esac
  bundle
done
echo "done $(date +%T)"
