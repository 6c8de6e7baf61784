"""``bitdecode selfcheck``: one kernel backend on this GPU against the torch reference.

What ``auto`` runs in a child process (``bitdecode.selfcheck``) before it takes a backend
whose kernels have not run on their GPU in this project, and what a user can run by hand:
for one cache configuration, the backend's prefill and one-token appends must pack exactly
the reference's bytes (the dequantized caches are equal), and its decode must match the
reference within the GPU suite's tolerance rule (``reference.decode_tolerance``) with the
split heuristic's choice, one split and three, over ragged lengths (packed tiles, a
residual, sink tokens if the format has them) and GQA.  The sm100 FP4 kernel, which takes
Q and P as FP4 terms, is held to its own spec as well: ``emulate_sm100.emulate_decode``.
"""

from __future__ import annotations

import argparse
import json

import torch

from . import reference
from .backend import REGISTRY
from .cli import DTYPE_NAMES, nonnegative_int, print_error, torch_dtype
from .formats import BITS, FP4_FORMATS, HEAD_DIMS, KVFormat
from .selfcheck import DTYPES, OUT_OF_MEMORY

GQA = 4  # query heads per KV head (the Llama family's usual ratio)
SPLITS = (0, 1, 3)  # the split heuristic's own choice, one split (no combine), a forced few
APPENDED = 5  # one-token appends after the prefill
# The sm100 FP4 kernel against its emulation (relative L2, the worst sequence): fp32 sums in
# another order and exp2.approx may move a P value across an FP4 rounding boundary; the
# layout mistakes tests/test_sm100_emulation.py makes err by more than 0.5
SPEC_REL_L2 = 0.03


def add_parser(subparsers, name: str, help_text: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(name, help=help_text, description=__doc__.split("\n\n")[1],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", required=True, choices=tuple(REGISTRY),
                   help=f"a kernel backend: {', '.join(REGISTRY)}")
    p.add_argument("--device", type=nonnegative_int, default=0, help="CUDA device index (default 0)")
    p.add_argument("--bits", type=int, default=None, choices=BITS,
                   help=f"KVFormat.bits, one of {', '.join(map(str, BITS))} (default 4)")
    p.add_argument("--fp4", choices=FP4_FORMATS, help="an FP4 format instead of integer codes")
    p.add_argument("--format-json", type=_format_json, metavar="JSON",
                   help="every KVFormat field as a JSON object, e.g. '{\"bits\": 4, \"v_bits\": 2}' "
                        "(what auto's check passes; instead of --bits / --fp4, which it refuses)")
    p.add_argument("--head-dim", type=int, default=128, choices=HEAD_DIMS,
                   help=f"head dim, one of {', '.join(map(str, HEAD_DIMS))} (default 128)")
    p.add_argument("--dtype", choices=DTYPE_NAMES + tuple(n for n in DTYPES if n not in DTYPE_NAMES), default="fp16",
                   metavar="{" + ",".join(DTYPE_NAMES) + "}",
                   help=f"model dtype (default fp16; {' / '.join(DTYPES)} are taken too)")
    p.add_argument("--json", action="store_true", help="print the verdict as one JSON line (what auto reads)")
    return p


def _format_json(text: str) -> KVFormat:
    """argparse type of ``--format-json``: the ``KVFormat`` its JSON object gives."""
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(fields, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of KVFormat fields, got {text!r}")
    try:
        return KVFormat(**fields)
    except TypeError as exc:  # a field KVFormat does not have
        raise argparse.ArgumentTypeError(f"not a KVFormat: {exc}") from None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def check_args(args):
    """What is wrong with the combination of options (``cli.main`` refuses it), or None."""
    if args.format_json is not None:
        given = [opt for opt, value in (("--bits", args.bits), ("--fp4", args.fp4)) if value is not None]
        if given:
            return f"--format-json gives every KVFormat field: give no {' / '.join(given)} with it"
    elif args.fp4 is not None and args.bits not in (None, 4):
        return f"--fp4 {args.fp4} stores 4-bit codes: --bits must be 4 or left out, got {args.bits}"
    return None


def _dtype(name: str) -> torch.dtype:
    """A ``--dtype`` value (``DTYPE_NAMES`` or ``selfcheck.DTYPES``' names) as the torch dtype."""
    return DTYPES[name] if name in DTYPES else torch_dtype(name)


def decode_mismatch(q: torch.Tensor, cache, backend: str, num_splits: int = 0) -> str:
    """Why ``backend``'s decode of ``q`` ``[B, T, Hq, D]`` over ``cache`` is not the
    reference's ("" when it is, within the tolerance rule; the GPU suite's check too):
    non-finite values, the output's error, the LSE's, and for a query that sees no token
    (a multi-token query past a short sequence) an output other than 0 or an LSE other
    than -inf."""
    import bitdecode as bd

    out, lse = bd.decode(q, cache, num_splits=num_splits, backend=backend, return_lse=True)
    ref, ref_lse = bd.decode(q, cache, backend="reference", return_lse=True)
    ref = ref.float()  # the reference keeps fp32 maths, rounded once at the end
    tol = reference.kernel_tolerance(q, cache, ref)
    if not torch.isfinite(out).all():
        return f"num_splits={num_splits}: non-finite outputs"
    err = (out.float() - ref).abs().max().item()
    if err > tol:
        return f"num_splits={num_splits}: max error {err:.3g} > tolerance {tol:.3g}"
    tq = q.shape[1]
    empty = torch.tensor([[n - tq + 1 + j <= 0 for j in range(tq)] for n in cache.lengths], device=lse.device)
    full = ~empty
    if full.any() and not torch.allclose(lse[full], ref_lse[full], atol=2e-3, rtol=1e-3):
        worst = (lse - ref_lse)[full].abs().max().item()
        return f"num_splits={num_splits}: LSE differs from the reference by {worst:.3g}"
    if empty.any() and not (torch.isneginf(lse[empty]).all() and (out[empty] == 0).all()):
        return f"num_splits={num_splits}: a query that sees no token gave an output other than 0 or an LSE other than -inf"
    return ""


def follows_emulation(backend: str, cache) -> bool:
    """Whether ``backend`` decodes ``cache`` with FP4 Q and P (``Backend.fp4_operands``)."""
    from . import backend as backends

    return backend != "reference" and backends.get(backend).fp4_operands(cache.fmt, cache.head_dim)


def spec_mismatch(q: torch.Tensor, cache, backend: str, num_splits: int = 0) -> str:
    """Why the sm100 FP4 kernel's decode is not its spec's (``emulate_sm100``), "" when it is
    within ``SPEC_REL_L2``."""
    import bitdecode as bd
    from .emulate_sm100 import emulate_cache

    out = bd.decode(q, cache, num_splits=num_splits, backend=backend)
    want, _ = emulate_cache(q, cache, num_splits)
    if not torch.isfinite(out).all():
        return f"num_splits={num_splits}: non-finite outputs"
    rel = max(float((o.float() - w.float()).norm() / w.float().norm()) for o, w in zip(out, want))
    if rel > SPEC_REL_L2:
        return f"num_splits={num_splits}: relative L2 {rel:.3g} against the sm100 emulation > {SPEC_REL_L2}"
    return ""


def run_check(backend: str, device: torch.device, fmt: KVFormat, head_dim: int, dtype: torch.dtype) -> str:
    """Runs ``backend`` on ``device`` for one cache configuration against the reference, in
    this process; "" when it agrees, else what differed."""
    import bitdecode as bd

    nr = fmt.residual_block
    lens = [9 * nr + 37 + fmt.sink_tokens, nr + 3]  # packed tiles and residuals; one row short
    gen = torch.Generator().manual_seed(0)
    hkv, n = 2, max(lens) + APPENDED
    k = torch.randn(len(lens), n, hkv, head_dim, generator=gen)
    k[..., :3] = k[..., :3] * 8 + 10  # a few large channels, as real models' K has
    v = torch.randn(len(lens), n, hkv, head_dim, generator=gen)
    k, v = k.to(dtype).to(device), v.to(dtype).to(device)
    caches = {}
    for name in (backend, "reference"):
        cache = bd.KVCache.allocate(len(lens), hkv, head_dim, n, fmt, dtype=dtype, device=device, backend=name)
        cache.prefill(k[:, : max(lens)], v[:, : max(lens)], lens)
        for t in range(n - APPENDED, n):  # a decode loop's appends
            cache.append(k[:, t: t + 1], v[:, t: t + 1])
        caches[name] = cache
    for b in range(len(lens)):
        for what, mine, ref in zip("KV", caches[backend].dequantized(b), caches["reference"].dequantized(b)):
            if not torch.equal(mine, ref):
                return (f"prefill + append: {what} of sequence {b} differs from the reference pack in "
                        f"{(mine != ref).sum().item()} values")
    q = torch.randn(len(lens), 1, hkv * GQA, head_dim, generator=gen).to(dtype).to(device)
    checks = [decode_mismatch] + ([spec_mismatch] if follows_emulation(backend, caches[backend]) else [])
    for splits in SPLITS:
        for mismatch in checks:
            why = mismatch(q, caches[backend], backend, splits)
            if why:
                return why
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a fault of the last launch is the check's too
    return ""


def run(args) -> int:
    # (the options' combination: ``check_args``, which ``cli.main`` ran)
    if args.format_json is not None:
        fmt = args.format_json
    else:
        fmt = KVFormat(bits=4 if args.bits is None else args.bits, fp4=args.fp4)
    if not torch.cuda.is_available():
        # 2, as every GPU command without a GPU: 1 is the check's own verdict ("FAILED")
        print_error("selfcheck: needs a CUDA GPU (the check runs the backend's kernels)")
        return 2
    if args.device >= torch.cuda.device_count():  # (2: exit 1 is a FAILED check)
        print_error(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                    f"0..{torch.cuda.device_count() - 1}")
        return 2
    device = torch.device("cuda", args.device)
    try:
        detail = run_check(args.backend, device, fmt, args.head_dim, _dtype(args.dtype))
    except torch.cuda.OutOfMemoryError as exc:  # (auto keeps this verdict for its process only)
        detail = f"{OUT_OF_MEMORY}: {' '.join(str(exc).split())[:200]}"
    except Exception as exc:  # noqa: BLE001 - a kernel's failure (or a refusal) is the verdict
        detail = f"{type(exc).__name__}: {exc}"
    ok = not detail
    if args.json:
        print(json.dumps({"ok": ok, "detail": detail or "matches the reference"}))
    else:
        print(f"{args.backend} on {torch.cuda.get_device_name(device)}, {fmt.describe()}, head_dim={args.head_dim}, "
              f"{args.dtype}: {'matches the reference' if ok else 'FAILED: ' + detail}")
    return 0 if ok else 1
