"""Multi-token decode (issue 10): T query tokens per sequence, causal over the cache, at
GQA 4 (Hq/Hkv 32/8, D 128, 4-bit K per channel g128, fp16): the kernels' path (T x 4 <= 16
query rows per KV head) beside one-token decode and the dequantize + SDPA path that longer
chunks take.  CUDA-graph replay and eager, L2 flushed, median of 30 (the chunk path: of 5).

    python3 profiles/bench_multi_token.py --out profiles/h200
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bitdecode as bd  # noqa: E402
from bitdecode import attention  # noqa: E402
from bitdecode._files import write_record  # noqa: E402
from bitdecode._memory import release_memory  # noqa: E402
from bench_decode import Timer, _graph_time  # noqa: E402


def run(out_dir: Path) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    timer = Timer(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for b, n in ((1, 32768), (8, 32768)):
        cache = bd.KVCache.allocate(b, 8, 128, n, bd.KVFormat(bits=4), dtype=torch.float16, device=dev)
        k = torch.randn(b, n, 8, 128, device=dev, dtype=torch.float16, generator=gen)
        cache.prefill(k, k)
        del k
        for t in (1, 2, 4):
            q = torch.randn(b, t, 32, 128, device=dev, dtype=torch.float16, generator=gen)
            row = dict(B=b, N=n, T=t, backend=cache.backend,
                       graph_us=_graph_time(timer, lambda: bd.decode(q, cache)),
                       eager_us=timer(lambda: bd.decode(q, cache)),
                       dequant_sdpa_us=timer(lambda: attention.chunk_decode(q, cache.tensors(), 128 ** -0.5, False),
                                             iters=5, warmup=1))
            rows.append(row)
            print({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        cache = None  # (rebinding, not del: the lambdas above name it)
        release_memory()
    result = {"command": f"python3 profiles/bench_multi_token.py --out {out_dir}",
              "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
              "format": "4-bit, K per channel g128, fp16; Hq/Hkv 32/8, D 128", "rows": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_record(out_dir / "multi_token.json", result)
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("profiles/h200"))
    run(p.parse_args().out)
