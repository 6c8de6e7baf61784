"""Seeded fuzz of the public entry points (issue 14): random good and bad arguments.

Every call either runs and gives the right answer, or raises ``TypeError`` /
``ValueError`` whose message names the offending argument and has then changed nothing
(every cache tensor and ``cache.lengths`` compared with a snapshot taken before the call).
"The right answer" comes from a model of the cache kept beside it: the tokens written to
each sequence, which the cache must dequantize to exactly as ``kvdata.fake_quant_cache``
says, and attention over them by torch SDPA in fp32 (``kvdata``).

The CPU tests use the torch reference and run in CI; the ``gpu`` variants repeat the fuzz
on CUDA tensors with every shipped kernel backend (``backend`` fixture).  Each test walks
a fixed seed; all failures of a run are collected and listed together, each with its
seed, its case number, the entry point and the argument it corrupted.
"""

from __future__ import annotations

import random
import re
from typing import Callable, List, Sequence

import numpy as np
import pytest
import torch

import bitdecode as bd
from bitdecode import backend as backends, bitnet as bn, dispatch, reference

import kvdata

ACCEPT, REJECT, EITHER = "accept", "reject", "either"
CPU = torch.device("cpu")
DTYPES = (torch.float16, torch.bfloat16)
STORAGE = ("k_pack", "k_params", "v_pack", "v_params")
CACHE_TENSORS = STORAGE + ("k_res", "v_res", "seqlens", "block_table")
FUNCTIONAL = ("k_pack", "k_params", "v_pack", "v_params", "k_res", "v_res", "cache_seqlens", "block_table")
OTHER_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.float16, torch.bfloat16)
MAX_SPLITS = max(backends.get(b).limits.max_splits for b in backends.shipped())

# the kernel variants the GPU fuzz may pick (the first four configurations of
# test_kernels_gpu, so the fuzz compiles nothing new): bits, k_mode, group, dtype, D, gq
GPU_CONFIGS = [
    (4, "channel", 128, torch.float16, 128, 4),
    (2, "channel", 128, torch.float16, 128, 4),
    (4, "token", 32, torch.bfloat16, 128, 8),
    (2, "token", 64, torch.bfloat16, 64, 1),
]


# --------------------------------------------------------------------------------------
# Bookkeeping
# --------------------------------------------------------------------------------------


def names_in(message: str, names: Sequence[str]) -> bool:
    """Whether ``message`` names one of ``names`` as a whole word."""
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", message) for n in names)


def _short(x, limit=240) -> str:
    s = str(x).replace("\n", " ")
    return s if len(s) <= limit else s[:limit] + "..."


class Report:
    """The failures of one fuzz run, listed together at the end."""

    def __init__(self, seed):
        self.seed = seed
        self.problems: List[str] = []

    def add(self, case: str, text: str) -> None:
        self.problems.append(f"[seed {self.seed}] {case}: {text}")

    def check(self) -> None:
        if self.problems:
            shown = "\n".join(self.problems[:60])
            more = f"\n... and {len(self.problems) - 60} more" if len(self.problems) > 60 else ""
            pytest.fail(f"{len(self.problems)} fuzz failure(s):\n{shown}{more}", pytrace=False)


class Outcome:
    """What one call did: ``ran`` (returned), ``result`` or ``error``; ``trusted`` when
    the call ran as it should have (the model may be updated from it)."""

    def __init__(self, ran, result=None, error=None, trusted=False):
        self.ran, self.result, self.error, self.trusted = ran, result, error, trusted


def attempt(report: Report, case: str, call: Callable, expect: str, names: Sequence[str]) -> Outcome:
    """Run ``call`` and judge it against ``expect`` (ACCEPT / REJECT / EITHER)."""
    try:
        result = call()
    except (TypeError, ValueError) as exc:
        if expect == ACCEPT:
            report.add(case, f"valid call rejected: {type(exc).__name__}: {_short(exc)}")
        elif not names_in(str(exc), names):
            report.add(case, f"{type(exc).__name__} does not name {' or '.join(names)}: {_short(exc)}")
        return Outcome(False, error=exc)
    except Exception as exc:  # noqa: BLE001 - any other exception is a finding
        report.add(case, f"raised {type(exc).__name__} (not TypeError/ValueError): {_short(exc)}")
        return Outcome(False, error=exc)
    if expect == REJECT:
        report.add(case, "bad argument accepted")
        return Outcome(True, result=result)
    return Outcome(True, result=result, trusted=True)


def snapshot(cache):
    tensors = {n: getattr(cache, n).clone() for n in CACHE_TENSORS}
    overflow = getattr(cache, "overflow", None)  # issue 14's device-side flags, where present
    if isinstance(overflow, torch.Tensor):
        tensors["overflow"] = overflow.clone()
    return cache.lengths, tensors


def changed(cache, snap) -> List[str]:
    lengths, tensors = snap
    out = [n for n, t in tensors.items() if not torch.equal(getattr(cache, n), t)]
    if cache.lengths != lengths:
        out.append("lengths")
    return out


# --------------------------------------------------------------------------------------
# Argument variants
# --------------------------------------------------------------------------------------


def strided_last(t: torch.Tensor) -> torch.Tensor:
    """The values of ``t`` with a last-dimension stride of 2."""
    out = torch.zeros(*t.shape, 2, dtype=t.dtype, device=t.device)[..., 0]
    out.copy_(t)
    return out


def padded(t: torch.Tensor, pad: int) -> torch.Tensor:
    """The values of ``t`` in rows padded by ``pad`` elements (last dim contiguous)."""
    out = torch.zeros(*t.shape[:-1], t.shape[-1] + pad, dtype=t.dtype, device=t.device)[..., : t.shape[-1]]
    out.copy_(t)
    return out


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """The values of ``t``, contiguous, one element past an allocation's start."""
    out = torch.zeros(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
    out.copy_(t)
    return out


def other_device(device: torch.device) -> torch.device:
    return torch.device("meta") if device.type == "cpu" else CPU


def resized(t: torch.Tensor, dim: int, delta: int, gen) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = max(shape[dim] + delta, 0)
    if t.is_floating_point():
        return torch.randn(*shape, generator=gen).to(t.dtype).to(t.device)
    return torch.zeros(*shape, dtype=t.dtype, device=t.device)


def tensor_variants(name, t, gen, *, kind, fixed_dims, kernels, names=None, optional=False):
    """Replacements of tensor argument ``name``: ``(label, make, expect, names)``.

    ``kind``: ``"last"`` (only the last dim must be contiguous: k, v, q) or
    ``"contiguous"`` (cache storage).  ``kernels``: a kernel backend runs the call (a
    misaligned or padded tensor may then be copied or refused with a clear message).
    ``optional``: None is a valid value (not offered here).
    """
    names = names or (name,)
    out = [
        ("a list", lambda: t.tolist(), REJECT, names),
        ("a str", lambda: "tensor", REJECT, names),
        ("on " + str(other_device(t.device)), lambda: t.to(other_device(t.device)), REJECT, names),
        ("rank + 1", lambda: t[None], REJECT, names),
    ]
    if not optional:
        out.append(("None", lambda: None, REJECT, names))
    if t.dim() > 1:
        out.append(("rank - 1", lambda: t[0], REJECT, names))
    for dt in OTHER_DTYPES:
        if dt != t.dtype:
            out.append((f"dtype {dt}", lambda dt=dt: t.to(dt), REJECT, names))
    for dim in fixed_dims:
        for delta in (1, -1):
            if t.shape[dim] + delta >= 0:
                out.append((f"dim {dim} {delta:+d}", lambda dim=dim, delta=delta: resized(t, dim, delta, gen), REJECT,
                            names))
    if t.shape[-1] > 1:
        if kind == "last":
            out.append(("last dim strided", lambda: strided_last(t), REJECT, names))
        else:
            strided = strided_last(t)
            out.append(("last dim strided", lambda: strided, ACCEPT if strided.is_contiguous() else REJECT, names))
    # valid for the API when only the last dim must be contiguous; a kernel may copy it or
    # refuse it by name
    for pad in (8, 3):
        pad_t = padded(t, pad)
        if kind == "last":
            expect = EITHER if kernels else ACCEPT
        else:
            expect = ACCEPT if pad_t.is_contiguous() else REJECT
        out.append((f"rows padded by {pad}", lambda pad_t=pad_t: pad_t, expect, names))
    out.append(("storage offset 1", lambda: misaligned(t), EITHER if kernels else ACCEPT, names))
    return out


def pick(rng: random.Random, variants, p_clean: float):
    """``None`` (keep the valid value) with probability ``p_clean``, else one variant."""
    if not variants or rng.random() < p_clean:
        return None
    return rng.choice(variants)


def apply_write_variant(rng: random.Random, variants, args: dict, label: str, names):
    """A prefill / append call's arguments: the valid ones (probability 0.35) or one
    variant ``(label, arg, make, expect, names)`` written into ``args`` (``arg == "kv"``
    replaces both k and v).  Returns (label, expected outcome, names the error must cite)."""
    choice = pick(rng, variants, 0.35)
    if choice is None:
        return label, ACCEPT, names
    label, arg, make, expect, names = choice
    if arg == "kv":
        args["k"], args["v"] = make()
    else:
        args[arg] = make()
    return label, expect, names


# --------------------------------------------------------------------------------------
# Expected decode results (the model)
# --------------------------------------------------------------------------------------


def lowprec_attention(q, ks, vs, scale):
    """fp32 attention with P rounded to the model dtype (what the tensor cores consume)."""
    outs = []
    for b in range(q.shape[0]):
        hq, d = q.shape[2], q.shape[3]
        k, v = ks[b], vs[b]
        if k.shape[0] == 0:
            outs.append(torch.zeros(hq, d, device=q.device))
            continue
        hkv = k.shape[1]
        qg = q[b, 0].float().view(hkv, hq // hkv, d)
        p = torch.softmax(torch.einsum("hgd,lhd->hgl", qg, k.float()) * scale, dim=-1)
        outs.append(torch.einsum("hgl,lhd->hgd", p.to(q.dtype).float(), v.float()).reshape(hq, d))
    return torch.stack(outs)[:, None]


def check_decode_result(report, case, result, q, ks, vs, scale, kernel: bool, return_lse: bool):
    """``result`` of a decode against attention over what the cache should hold."""
    out, lse = result if return_lse else (result, None)
    if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype:
        report.add(case, f"output {type(out).__name__} {getattr(out, 'shape', '')} {getattr(out, 'dtype', '')}, "
                         f"want {tuple(q.shape)} {q.dtype}")
        return
    if q.shape[2] == 0:
        return
    ref, ref_lse = kvdata.batch_attention(q, ks, vs, scale)
    ref_lse = ref_lse.to(q.device)
    empty = torch.tensor([k.shape[0] == 0 for k in ks], device=q.device)
    if empty.any() and not (bool((out[empty] == 0).all()) and (lse is None or bool(torch.isneginf(lse[empty]).all()))):
        report.add(case, "an empty sequence did not give zeros (and LSE -inf)")
    full = ~empty
    if not full.any():
        return
    got, want = out[full].float(), ref[full]
    if kernel:
        lp = lowprec_attention(q, ks, vs, scale)[full]
        tol = reference.decode_tolerance(lp, want)
        err = (got - want).abs().max().item()
        if not err <= tol:
            report.add(case, f"output error {err:.3g} > tolerance {tol:.3g}")
        lse_tol = dict(atol=2e-3, rtol=1e-3)
    else:  # the fp32 result rounded once to 16 bits
        # (atol: both fp32 computations lose ~1e-6 to cancellation near zero when the
        # outlier channels of K make scores of order 100)
        rtol = 2.0 ** -kvdata.MANTISSA_BITS[q.dtype]
        if not torch.allclose(got, want, rtol=rtol, atol=1e-5):
            report.add(case, f"output off by {(got - want).abs().max().item():.3g}")
        lse_tol = dict(atol=1e-5, rtol=1e-6)
    if lse is not None:
        if lse.shape != (q.shape[0], 1, q.shape[2]) or lse.dtype != torch.float32:
            report.add(case, f"lse {tuple(lse.shape)} {lse.dtype}")
        elif not torch.allclose(lse[full], ref_lse[full], **lse_tol):
            report.add(case, f"lse off by {(lse[full] - ref_lse[full]).abs().max().item():.3g}")


# --------------------------------------------------------------------------------------
# A cache and its model
# --------------------------------------------------------------------------------------


class CacheFuzz:
    """One cache, the tokens each sequence should hold, and random calls on both."""

    def __init__(self, report, rng, gen, device, backend, cfg, label):
        self.report, self.rng, self.gen, self.device, self.backend = report, rng, gen, device, backend
        bits, k_mode, group, self.dtype, self.d, self.gq = cfg
        self.fmt = bd.KVFormat(bits=bits, k_mode=k_mode, group_size=group)
        self.nr = self.fmt.residual_block
        self.batch = rng.randint(1, 3)
        self.hkv = rng.choice((1, 2))
        max_seqlen = rng.randint(1, 3 * self.nr - 20)
        page_size = rng.choice((None, self.nr, 2 * self.nr))
        self.cache = bd.KVCache.allocate(self.batch, self.hkv, self.d, max_seqlen, self.fmt, dtype=self.dtype,
                                         device=device, page_size=page_size, backend=backend)
        if page_size is not None and rng.random() < 0.7:
            perm = torch.randperm(self.cache.block_table.numel(), generator=gen).to(torch.int32)
            self.cache.block_table.copy_(perm.view_as(self.cache.block_table))
        self.kernels = self.cache.backend != "reference"
        self.label = (f"{label} {bits}-bit {k_mode} g{group} {str(self.dtype)[6:]} D{self.d} B{self.batch} "
                      f"Hkv{self.hkv} gq{self.gq} max_seqlen {max_seqlen} page {page_size} {self.cache.backend}")
        self.forget()

    # ---- the model ---------------------------------------------------------------------
    def forget(self):
        """The cache emptied (after a call that did something unexpected, to go on)."""
        self.cache.reset()
        empty = torch.zeros(0, self.hkv, self.d, dtype=self.dtype, device=self.device)
        self.hist_k = [empty] * self.batch
        self.hist_v = [empty] * self.batch

    @property
    def lengths(self):
        return [k.shape[0] for k in self.hist_k]

    def expected_kv(self):
        pairs = [kvdata.fake_quant_cache(k, v, self.fmt, k.shape[0]) for k, v in zip(self.hist_k, self.hist_v)]
        return [k for k, _ in pairs], [v for _, v in pairs]

    def verify_state(self, case):
        c = self.cache
        if c.lengths != self.lengths or c.seqlens.tolist() != self.lengths:
            self.report.add(case, f"lengths {c.lengths} / seqlens {c.seqlens.tolist()}, want {self.lengths}")
            self.forget()
            return
        ks, vs = self.expected_kv()
        for b in range(self.batch):
            kd, vd = c.dequantized(b)
            if not (torch.equal(kd, ks[b]) and torch.equal(vd, vs[b])):
                self.report.add(case, f"sequence {b} does not hold the tokens written to it")
                self.forget()
                return

    def judge_write(self, case, outcome, snap, expect, update):
        if outcome.trusted:
            update()
            self.verify_state(case)
        elif outcome.ran:  # a bad argument went through: start over from an empty cache
            self.forget()
        else:
            moved = changed(self.cache, snap)
            if moved:
                self.report.add(case, f"rejected call changed {moved}")
                self.forget()

    def tokens(self, n):
        return kvdata.kv(self.gen, self.batch, n, self.hkv, self.d, dtype=self.dtype, device=self.device)

    def kv_variants(self, k, v):
        pair = ("k", "v")
        out = [("k " + lab, "k", make, exp, names) for lab, make, exp, names in
               tensor_variants("k", k, self.gen, kind="last", fixed_dims=(0, 1, 2, 3), kernels=self.kernels,
                               names=pair)]
        out += [("v " + lab, "v", make, exp, names) for lab, make, exp, names in
                tensor_variants("v", v, self.gen, kind="last", fixed_dims=(0, 1, 2, 3), kernels=self.kernels,
                                names=pair)]
        return out

    # ---- prefill -----------------------------------------------------------------------
    def prefill(self, case):
        rng, c = self.rng, self.cache
        n = rng.randint(0, c.max_seqlen)
        k, v = self.tokens(n)
        lens = None if rng.random() < 0.4 else [rng.randint(0, n) for _ in range(self.batch)]
        args = dict(k=k, v=v, seqlens=lens)
        variants = self.kv_variants(k, v)
        base = lens if lens is not None else [n] * self.batch
        over = c.max_seqlen + rng.randint(1, 9)
        long_k, long_v = self.tokens(over)
        variants.append(("k, v longer than max_seqlen", "kv", lambda: (long_k, long_v), REJECT, ("k", "max_seqlen")))
        bad_lens = [
            ("seqlens one entry short", base[:-1], REJECT),
            ("seqlens one entry long", base + [0], REJECT),
            ("seqlens negative", [-1 - rng.randint(0, 5)] + base[1:], REJECT),
            ("seqlens beyond the tokens given", [n + 1 + rng.randint(0, 5)] + base[1:], REJECT),
            ("seqlens non-integral floats", [x + 0.5 for x in base], REJECT),
            ("seqlens integral floats", [float(x) for x in base], EITHER),
            ("seqlens strings", [str(x) for x in base], REJECT),
            ("seqlens bools", [True] * self.batch, REJECT),
            ("seqlens None entries", [None] * self.batch, REJECT),
            ("seqlens nested lists", [[x] for x in base], REJECT),
            ("seqlens a scalar int", base[0], REJECT),
            ("seqlens a dict", {i: x for i, x in enumerate(base)}, REJECT),
            ("seqlens a float tensor", torch.tensor(base, dtype=torch.float32) + 0.5, REJECT),
            ("seqlens an int tensor", torch.tensor(base, dtype=torch.int64), ACCEPT),
            ("seqlens a tuple", tuple(base), ACCEPT),
            ("seqlens numpy ints", [np.int64(x) for x in base], EITHER),
        ]
        variants += [(lab, "seqlens", (lambda val=val: val), exp, ("seqlens",)) for lab, val, exp in bad_lens]
        lab, expect, names = apply_write_variant(rng, variants, args, "valid", ("k", "v", "seqlens"))
        case = f"{case} prefill [{lab}]"
        snap = snapshot(c)
        outcome = attempt(self.report, case, lambda: c.prefill(**args), expect, names)

        def update():
            kk, vv, sl = args["k"], args["v"], args["seqlens"]
            if sl is None:
                used = [kk.shape[1]] * self.batch
            else:
                used = [int(x) for x in (sl.tolist() if isinstance(sl, torch.Tensor) else sl)]
            self.hist_k = [kk[b, : used[b]].clone() for b in range(self.batch)]
            self.hist_v = [vv[b, : used[b]].clone() for b in range(self.batch)]

        self.judge_write(case, outcome, snap, expect, update)

    # ---- append ------------------------------------------------------------------------
    def append(self, case):
        rng, c = self.rng, self.cache
        room = c.max_seqlen - max(self.lengths)
        t = rng.choice([0, 1, 1, 1, 2, 3, self.nr - 1, self.nr, self.nr + 5, rng.randint(0, max(room, 0))])
        t = min(t, room) if room >= 0 else 0
        k, v = self.tokens(t)
        args = dict(k=k, v=v)
        variants = self.kv_variants(k, v)
        extra = room + 1 + rng.randint(0, 4)
        big_k, big_v = self.tokens(extra)
        variants.append(("more tokens than fit", "kv", lambda: (big_k, big_v), REJECT, ("k", "max_seqlen")))
        lab, expect, names = apply_write_variant(rng, variants, args, f"valid, {t} tokens", ("k", "v"))
        case = f"{case} append [{lab}]"
        snap = snapshot(c)
        outcome = attempt(self.report, case, lambda: c.append(**args), expect, names)

        def update():
            self.hist_k = [torch.cat([h, args["k"][b]]) for b, h in enumerate(self.hist_k)]
            self.hist_v = [torch.cat([h, args["v"][b]]) for b, h in enumerate(self.hist_v)]

        self.judge_write(case, outcome, snap, expect, update)

    # ---- decode and decode_attention -----------------------------------------------------
    def option_variants(self):
        """Bad and good values of the decode options: (label, key, value, expect)."""
        top = MAX_SPLITS
        bad_scale = ["0.1", True, [0.1], float("nan"), float("inf"), -float("inf"), 1j]
        good_scale = [None, 0.3, 1, 0.0, self.rng.uniform(0.01, 0.5)]
        bad_splits = [-1, top + 1, 1.5, True, "2", None, 2.0]
        good_splits = [0, 1, 2, 3, 8, top, self.rng.randint(0, top)]
        bad_backend = ["triton", None, 3, "SM80", "sm100", "cuda"]
        good_backend = ["auto", "reference", self.cache.backend]
        if self.device.type == "cpu":
            bad_backend += ["sm80", "sm90"]
        else:
            good_backend += [b for b in dispatch.available(self.device) if b != "reference"]
        out = [(f"softmax_scale={s!r}", "softmax_scale", s, REJECT) for s in bad_scale]
        out += [(f"softmax_scale={s!r}", "softmax_scale", s, ACCEPT) for s in good_scale]
        out += [(f"num_splits={s!r}", "num_splits", s, REJECT) for s in bad_splits]
        out += [(f"num_splits={s!r}", "num_splits", s, ACCEPT) for s in good_splits]
        out += [(f"backend={s!r}", "backend", s, REJECT) for s in bad_backend]
        out += [(f"backend={s!r}", "backend", s, ACCEPT) for s in good_backend]
        return out

    def query(self, heads=None):
        heads = self.hkv * self.gq if heads is None else heads
        return kvdata.randn(self.gen, self.batch, 1, heads, self.d, dtype=self.dtype, device=self.device)

    def runs(self, backend_arg, functional: bool) -> str:
        """The implementation a decode with ``backend=backend_arg`` runs (valid names only)."""
        if backend_arg != "auto":
            return backend_arg
        if functional:  # no cache object: auto's choice for the device and format
            return dispatch.resolve("auto", self.device, fmt=self.fmt, head_dim=self.d)
        return self.cache.backend

    def query_variants(self, q, runs: str):
        kernels = runs != "reference"
        out = [("q " + lab, "q", make, exp, names) for lab, make, exp, names in
               tensor_variants("q", q, self.gen, kind="last", fixed_dims=(0, 3), kernels=kernels)]
        # dim 1 is the query tokens: any count from 1 is valid (test_kernels_gpu checks T > 1)
        out.append(("q with no tokens", "q", lambda: q[:, :0], REJECT, ("q",)))
        if self.hkv > 1:
            out.append(("q heads not a multiple of Hkv", "q", lambda: self.query(self.hkv * self.gq + 1), REJECT,
                        ("q",)))
        out.append(("q with no heads", "q", lambda: self.query(0), EITHER, ("q",)))
        limit = max(backends.get(b).limits.max_gqa for b in backends.shipped())
        out.append((f"q with {limit + 1} heads per KV head", "q", lambda: self.query(self.hkv * (limit + 1)),
                    REJECT if kernels else ACCEPT, ("q",)))
        return out

    def used_pages(self):
        """Block-table columns each sequence's packed blocks use."""
        page = self.cache.page_size
        return [-(-(n // self.nr * self.nr) // page) for n in self.lengths]

    def table_variants(self, table):
        used = self.used_pages()
        in_use = [(b, j) for b in range(self.batch) for j in range(used[b])]
        free = [(b, j) for b in range(self.batch) for j in range(used[b], table.shape[1])]
        pages = self.cache.k_pack.shape[0]
        out = []

        def edited(pos, value):
            def make():
                t = table.clone()
                t[pos] = value
                return t
            return make

        if in_use:
            pos = self.rng.choice(in_use)
            out.append(("block_table page past the pool", edited(pos, pages + self.rng.randint(0, 3)), REJECT))
            out.append(("block_table negative page", edited(pos, -1 - self.rng.randint(0, 3)), REJECT))
            if len(in_use) > 1:
                other = self.rng.choice([p for p in in_use if p != pos])
                out.append(("block_table page shared", edited(pos, int(table[other])), REJECT))
        if free:
            pos = self.rng.choice(free)
            out.append(("block_table junk in an unused entry", edited(pos, self.rng.choice([-5, pages + 7, 0])),
                        ACCEPT))
        if max(used, default=0) > 0:
            out.append(("block_table without the used columns", lambda: table[:, : max(used) - 1].contiguous(),
                        REJECT))
        out.append(("block_table one row short", lambda: table[: self.batch - 1].contiguous(), REJECT))
        if pages != self.batch:
            out.append(("block_table None for a paged cache", lambda: None, REJECT))
        return [(lab, "block_table", make, exp, ("block_table", "cache_seqlens")) for lab, make, exp in out]

    def functional_variants(self, args, runs):
        """Bad and good tensors of ``decode_attention``'s cache arguments."""
        every = ("q", "head_dim") + FUNCTIONAL
        out = []
        for name in FUNCTIONAL:
            if args[name] is None:
                continue
            fixed = (0,) if name == "block_table" else tuple(range(args[name].dim()))
            out += [(f"{name} {lab}", name, make, exp, every) for lab, make, exp, _ in
                    tensor_variants(name, args[name], self.gen, kind="contiguous", fixed_dims=fixed,
                                    kernels=runs != "reference", optional=name == "block_table")]
        lens = args["cache_seqlens"]
        cap = self.cache.tensors().max_packed_tokens + self.nr - 1

        def lens_with(first):
            def make():
                x = lens.clone()
                x[0] = first
                return x
            return make

        out.append(("cache_seqlens negative", "cache_seqlens", lens_with(-1 - self.rng.randint(0, 9)), REJECT,
                    ("cache_seqlens",)))
        out.append(("cache_seqlens past the storage", "cache_seqlens",
                    lens_with(cap + 1 + self.rng.randint(0, 99)), REJECT, ("cache_seqlens",)))
        out += self.table_variants(self.cache.tensors().block_table)
        others = [bd.KVFormat(bits=b, k_mode=m, group_size=g) for b in (4, 2) for m in ("channel", "token")
                  for g in (32, 64, 128)]
        other = self.rng.choice([f for f in others if f != self.fmt])
        out.append((f"fmt {other}", "fmt", lambda: other, REJECT, ("fmt", "head_dim", "group_size") + every))
        for bad in ("4bit", None, 4, {"bits": 4}):
            out.append((f"fmt={bad!r}", "fmt", (lambda bad=bad: bad), REJECT, ("fmt",)))
        return out

    def decode(self, case, functional: bool = False):
        """``bd.decode`` / ``cache.decode`` (or ``bd.decode_attention`` over the cache's
        tensors) with random options and at most one bad argument."""
        rng, c = self.rng, self.cache
        q = self.query()
        opts = dict(softmax_scale=None, num_splits=0, backend="auto", return_lse=rng.random() < 0.5)
        for _, key, value, expect in rng.sample(self.option_variants(), 2):  # random valid options
            if expect == ACCEPT:
                opts[key] = value
        runs = self.runs(opts["backend"], functional)
        if functional:
            t = c.tensors()
            identity = torch.arange(self.batch, dtype=torch.int32).view(self.batch, 1)
            dense = t.k_pack.shape[0] == self.batch and torch.equal(t.block_table.cpu(), identity)
            args = dict(q=q, k_pack=t.k_pack, k_params=t.k_params, v_pack=t.v_pack, v_params=t.v_params,
                        k_res=t.k_res, v_res=t.v_res, cache_seqlens=t.cache_seqlens,
                        block_table=None if dense and rng.random() < 0.5 else t.block_table)
            opts["fmt"] = self.fmt
            variants = self.query_variants(q, runs) + self.functional_variants(args, runs)
        else:
            args = dict(q=q, cache=c)
            variants = self.query_variants(q, runs)
            variants.append(("cache not a KVCache", "cache", lambda: c.tensors(), REJECT, ("cache",)))
        variants += [(lab, key, (lambda val=val: val), exp, (key,)) for lab, key, val, exp in self.option_variants()]
        choice = pick(rng, variants, 0.3)
        expect, names, lab = ACCEPT, ("q",), "valid"
        if choice is not None:
            lab, arg, make, expect, names = choice
            (args if arg in args else opts)[arg] = make()
        if expect != REJECT:
            runs = self.runs(opts["backend"], functional)
        shown = {k: v for k, v in opts.items() if k != "fmt"}
        if functional:
            what = "bd.decode_attention"
            call = lambda: bd.decode_attention(**args, **opts)  # noqa: E731
        elif rng.random() < 0.3 and isinstance(args["cache"], bd.KVCache):
            what = "cache.decode"
            call = lambda: args["cache"].decode(args["q"], **opts)  # noqa: E731
        else:
            what = "bd.decode"
            call = lambda: bd.decode(args["q"], args["cache"], **opts)  # noqa: E731
        case = f"{case} {what} [{lab}] {shown}"
        snap = snapshot(c)
        outcome = attempt(self.report, case, call, expect, names)
        moved = changed(c, snap)
        if moved:
            self.report.add(case, f"a decode changed {moved}")
            self.forget()
            return
        if outcome.trusted:
            qq = args["q"]
            scale = qq.shape[-1] ** -0.5 if opts["softmax_scale"] is None else float(opts["softmax_scale"])
            ks, vs = self.expected_kv()
            check_decode_result(self.report, case, outcome.result, qq, ks, vs, scale, runs != "reference",
                                bool(opts["return_lse"]))

    def decode_attention(self, case):
        self.decode(case, functional=True)

    # ---- a session -----------------------------------------------------------------------
    def run(self, ops: int):
        steps = [self.prefill, self.append, self.append, self.decode, self.decode, self.decode_attention]
        self.prefill(f"{self.label} #0")
        for i in range(1, ops):
            if self.rng.random() < 0.04:  # reset (forget() resets the cache and the model)
                self.forget()
                self.verify_state(f"{self.label} #{i} reset")
                continue
            self.rng.choice(steps)(f"{self.label} #{i}")


def random_config(rng, device):
    if device.type == "cuda":
        return rng.choice(GPU_CONFIGS)
    fmt = bd.KVFormat(bits=rng.choice((4, 2)), k_mode=rng.choice(("channel", "token")),
                      group_size=rng.choice((32, 64, 128)))
    d = rng.choice([h for h in (64, 128) if h >= fmt.group_size])
    return (fmt.bits, fmt.k_mode, fmt.group_size, rng.choice(DTYPES), d, rng.choice((1, 2, 3, 4, 8)))


def fuzz_caches(seed, device, backend, sessions, ops):
    report = Report(seed)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for s in range(sessions):
        CacheFuzz(report, rng, gen, device, backend, random_config(rng, device), f"session {s}").run(ops)
    report.check()


@pytest.mark.parametrize("seed", range(4))
def test_fuzz_cache_calls(seed):
    """prefill / append / decode / decode_attention with random good and bad arguments on
    the torch reference: right answers or named errors that change nothing."""
    fuzz_caches(seed, CPU, "reference", sessions=6, ops=16)


@pytest.mark.parametrize("seed", range(2))
def test_fuzz_cache_calls_gpu(seed, backend):
    """The same fuzz on CUDA tensors with each kernel backend (cpu tensors as the wrong
    device; misaligned or padded tensors must be copied or refused by name)."""
    fuzz_caches(100 + seed, torch.device("cuda"), backend, sessions=6, ops=12)


# --------------------------------------------------------------------------------------
# KVCache.allocate
# --------------------------------------------------------------------------------------


def allocate_variants(rng, args, device):
    nr = args["fmt"].residual_block
    bad_ints = [0, -1, -7, 2.0, 1.5, True, False, "2", None]
    out = []
    for name in ("batch", "num_kv_heads", "max_seqlen"):
        out += [(name, v, REJECT) for v in bad_ints]
    out += [("head_dim", v, REJECT) for v in (80, 0, -64, 32, 512, 64.0, 128.0, "64", None, True)]
    out += [("fmt", v, REJECT) for v in ("4bit", None, 4, {"bits": 4})]
    out += [("dtype", v, REJECT) for v in (torch.float32, torch.int8, torch.float64, "float16", None)]
    bad_devices = ["nonsense", None, "cpu:x", 3.5]
    if device.type == "cuda":
        bad_devices += [f"cuda:{torch.cuda.device_count()}"]
    else:
        bad_devices += ["cuda", "cuda:0", 5]
    out += [("device", v, REJECT) for v in bad_devices]
    out += [("page_size", v, REJECT) for v in (0, -nr, nr // 2, nr + 16, float(nr), True, str(nr))]
    out += [("page_size", v, ACCEPT) for v in (None, nr, 3 * nr)]
    bad_backends = ["cuda", None, 3, "SM80", "triton"]
    if device.type == "cpu":
        bad_backends += ["sm80", "sm90"]
    else:
        out += [("backend", b, ACCEPT) for b in dispatch.available(device)]
    out += [("backend", v, REJECT) for v in bad_backends]
    out += [("fmt", bd.KVFormat(bits=4, group_size=128), ACCEPT if args["head_dim"] >= 128 else REJECT)]
    return out


def check_allocation(report, case, cache, args):
    fmt, nr = args["fmt"], args["fmt"].residual_block
    page = args["page_size"] or -(-args["max_seqlen"] // nr) * nr
    per_seq = -(-(-(-args["max_seqlen"] // nr) * nr) // page)
    pages = args["batch"] * per_seq
    shape = (pages, args["num_kv_heads"], page, args["head_dim"])
    want = dict(k_pack=fmt.k_pack_shape(*shape), k_params=fmt.k_params_shape(*shape),
                v_pack=fmt.v_pack_shape(*shape), v_params=fmt.v_params_shape(*shape),
                k_res=(args["batch"], nr, args["num_kv_heads"], args["head_dim"]))
    for name, s in want.items():
        t = getattr(cache, name)
        if tuple(t.shape) != tuple(s) or bool(t.any()):
            report.add(case, f"{name} has shape {tuple(t.shape)} (want {tuple(s)}) or is not zero")
    facts = dict(batch=cache.batch, num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim,
                 max_seqlen=cache.max_seqlen, dtype=cache.dtype, page_size=cache.page_size)
    expect = dict(batch=args["batch"], num_kv_heads=args["num_kv_heads"], head_dim=args["head_dim"],
                  max_seqlen=args["max_seqlen"], dtype=args["dtype"], page_size=page)
    if facts != expect:
        report.add(case, f"cache facts {facts}, want {expect}")
    if cache.lengths != [0] * args["batch"] or cache.seqlens.tolist() != [0] * args["batch"]:
        report.add(case, "a new cache is not empty")
    if not torch.equal(cache.block_table.cpu(), torch.arange(pages, dtype=torch.int32).view(args["batch"], per_seq)):
        report.add(case, "block table is not the identity")
    if cache.device.type != torch.device(args["device"]).type:
        report.add(case, f"cache on {cache.device}")


def fuzz_allocate(seed, device, backend, cases):
    report = Report(seed)
    rng = random.Random(seed)
    for i in range(cases):
        fmt = bd.KVFormat(bits=rng.choice((4, 2)), k_mode=rng.choice(("channel", "token")),
                          group_size=rng.choice((32, 64, 128)))
        args = dict(batch=rng.randint(1, 4), num_kv_heads=rng.randint(1, 3),
                    head_dim=rng.choice([h for h in (64, 128, 256) if h >= fmt.group_size]),
                    max_seqlen=rng.randint(1, 1000), fmt=fmt, dtype=rng.choice(DTYPES),
                    device=rng.choice([device, str(device)]), page_size=None, backend=backend)
        choice = pick(rng, allocate_variants(rng, args, device), 0.25)
        expect, names = ACCEPT, tuple(args)
        if choice is not None:
            name, value, expect = choice
            args[name] = value
            names = (name,) if name != "fmt" or expect == ACCEPT else ("fmt",)
            if name == "fmt" and not isinstance(value, (str, int, dict, type(None))):
                names = ("fmt", "head_dim", "group_size")
            if name == "head_dim":
                names = ("head_dim", "group_size")
        case = f"#{i} allocate({', '.join(f'{k}={v!r}' for k, v in args.items() if k != 'fmt')}, fmt={args['fmt']!r})"
        outcome = attempt(report, case, lambda: bd.KVCache.allocate(**args), expect, names)
        if outcome.trusted:
            check_allocation(report, case, outcome.result, args)
    report.check()


@pytest.mark.parametrize("seed", range(2))
def test_fuzz_allocate(seed):
    """KVCache.allocate with one random bad argument (or none): a named error, or a cache
    of the asked shape, empty, with the identity block table."""
    fuzz_allocate(seed, CPU, "reference", cases=120)


def test_fuzz_allocate_gpu(backend):
    """The allocate fuzz on CUDA (a device index past the GPUs present must be refused by name)."""
    fuzz_allocate(200, torch.device("cuda"), backend, cases=80)


# --------------------------------------------------------------------------------------
# Formats and quantization (KVFormat, reference.quantize / dequantize / pack_k / pack_v)
# --------------------------------------------------------------------------------------


def fuzz_kvformat(report, rng, i):
    vals = dict(bits=rng.choice((4, 2)), k_mode=rng.choice(("channel", "token")), group_size=rng.choice((32, 64, 128)))
    bad = dict(bits=[3, 8, 0, -4, "4", 4.0, True, None, 16], k_mode=["Channel", "tokens", "", 1, "head"],
               group_size=[16, 256, 0, -32, 32.0, True, "32", 96])  # None: the default of both
    expect, names = ACCEPT, tuple(vals)
    if rng.random() < 0.6:
        key = rng.choice(list(bad))
        vals[key] = rng.choice(bad[key])
        expect, names = REJECT, (key,)
    case = f"#{i} KVFormat({vals})"
    outcome = attempt(report, case, lambda: bd.KVFormat(**vals), expect, names)
    if not outcome.trusted:
        return
    f = outcome.result
    bits, g = vals["bits"], vals["group_size"]
    nr = {4: 128, 2: 256}[bits]
    p, h, page, d = 3, 2, 2 * nr, 128
    want = dict(residual_block=nr, qmax=2 ** bits - 1, codes_per_word=32 // bits,
                k_pack=(p, h, page, d * bits // 32), v_pack=(p, h, page // nr, d, nr * bits // 32),
                k_params=(p, h, page // g, d) if vals["k_mode"] == "channel" else (p, h, page, d // g),
                v_params=(p, h, page // 16, d // g, 16))
    got = dict(residual_block=f.residual_block, qmax=f.qmax, codes_per_word=f.codes_per_word,
               k_pack=f.k_pack_shape(p, h, page, d), v_pack=f.v_pack_shape(p, h, page, d),
               k_params=f.k_params_shape(p, h, page, d), v_params=f.v_params_shape(p, h, page, d))
    if got != want:
        report.add(case, f"{got} != {want}")


def dequant_bound(x, deq, scale, bits, group_size, dim):
    """|deq - x| allowed: half a step, the largest code's shortfall from a scale rounded
    toward zero, the final 16-bit rounding (and a hair for the fp32 reciprocal)."""
    s = scale.double().repeat_interleave(group_size, dim=dim)
    step_ulp = kvdata.ulp(s, scale.dtype)
    return 0.5001 * s + (2 ** bits - 1) * step_ulp + kvdata.ulp(x.double().abs().maximum(deq.double().abs()), x.dtype)


def fuzz_quantize(report, rng, gen, device, i):
    rank = rng.randint(1, 3)
    dim = rng.randrange(-rank, rank)
    g = rng.choice((1, 2, 4, 8, 16, 32, 64))
    shape = [rng.randint(1, 5) for _ in range(rank)]
    shape[dim] = g * rng.randint(1, 3)
    dtype = rng.choice(DTYPES)
    x = (torch.randn(*shape, generator=gen) * rng.choice((1.0, 8.0, 0.05))).to(dtype).to(device)
    if rng.random() < 0.2:  # constant groups (scale 0)
        x = torch.full_like(x, rng.choice((0.0, -1.5, 3.0)))
    args = dict(x=x, bits=rng.choice((4, 2)), group_size=g, dim=dim)
    variants = [(lab, "x", make, exp, ("x",)) for lab, make, exp, _ in
                tensor_variants("x", x, gen, kind="last", fixed_dims=(), kernels=False)
                if not lab.startswith(("rank", "last dim", "on "))]  # any rank, strides and device are fine
    variants = [v for v in variants if v[0] not in ("dtype torch.float16", "dtype torch.bfloat16")]  # both valid
    variants.append(("x 0-dim", "x", lambda: x.reshape(-1)[0], REJECT, ("x",)))
    variants.append(("x transposed view", "x", lambda: x.t() if x.dim() == 2 else x, EITHER, ("x", "group_size")))
    if g > 1:
        variants.append(("x not a whole number of groups", "x", lambda: resized(x, dim % rank, 1, gen), REJECT,
                         ("x", "group_size")))
    variants += [(f"bits={b!r}", "bits", (lambda b=b: b), REJECT, ("bits",)) for b in (3, 8, 0, "4", 4.0, None, True)]
    variants += [(f"group_size={v!r}", "group_size", (lambda v=v: v), REJECT, ("group_size",))
                 for v in (0, -g, float(g), True, None, str(g))]
    variants += [(f"dim={v!r}", "dim", (lambda v=v: v), REJECT, ("dim",))
                 for v in (rank, rank + 3, -rank - 1, 1.0, "0", None)]
    choice = pick(rng, variants, 0.35)
    expect, names, lab = ACCEPT, ("x",), "valid"
    if choice is not None:
        lab, arg, make, expect, names = choice
        args[arg] = make()
    case = f"#{i} reference.quantize [{lab}] shape {shape} dim {dim} group {g} bits {args['bits']!r}"
    outcome = attempt(report, case, lambda: reference.quantize(**args), expect, names)
    if not outcome.trusted:
        return
    xx, bits, d = args["x"], args["bits"], args["dim"]
    codes, scale, zero = outcome.result
    want = list(xx.shape)
    want[d] //= g
    if codes.shape != xx.shape or codes.dtype != torch.uint8 or list(scale.shape) != want or scale.dtype != xx.dtype \
            or list(zero.shape) != want:
        report.add(case, f"codes {tuple(codes.shape)} {codes.dtype}, scale {tuple(scale.shape)} {scale.dtype}")
        return
    if int(codes.max()) > 2 ** bits - 1:
        report.add(case, f"code {int(codes.max())} above 2^bits - 1")
    deq = reference.dequantize(codes, scale, zero, g, dim=d)
    err = (deq.double() - xx.double()).abs()
    bound = dequant_bound(xx, deq, scale, bits, g, d % xx.dim())
    if not bool((err <= bound).all()):
        report.add(case, f"dequantized error {float((err - bound).max()):.3g} past the bound")


def fuzz_pack(report, rng, gen, device, i):
    fmt = bd.KVFormat(bits=rng.choice((4, 2)), k_mode=rng.choice(("channel", "token")),
                      group_size=rng.choice((32, 64, 128)))
    d = rng.choice([h for h in (64, 128) if h >= fmt.group_size])
    nr = fmt.residual_block
    which = rng.choice(("k", "v"))
    n = nr * rng.randint(1, 2)
    x = kvdata.randn(gen, rng.randint(1, 2), n, d, dtype=rng.choice(DTYPES), device=device)
    args = dict(x=x, fmt=fmt)
    variants = [(f"fmt={b!r}", "fmt", (lambda b=b: b), REJECT, ("fmt",)) for b in ("4bit", None, 4)]
    variants.append(("x float32", "x", lambda: x.float(), REJECT, ("x", which)))
    variants.append((f"{which} not a whole block", "x", lambda: x[:, : n - 16], REJECT if which == "v" else EITHER,
                     ("x", which, which.upper(), "group_size")))
    choice = pick(rng, variants, 0.4)
    expect, names, lab = ACCEPT, ("x",), "valid"
    if choice is not None:
        lab, arg, make, expect, names = choice
        args[arg] = make()
    fn = reference.pack_k if which == "k" else reference.pack_v
    case = f"#{i} reference.pack_{which} [{lab}] {fmt} D{d}"
    outcome = attempt(report, case, lambda: fn(args["x"], args["fmt"]), expect, names)
    if not outcome.trusted:
        return
    xx = args["x"]
    if which == "k":
        got = reference.unpack_k(*outcome.result, fmt, xx.dtype)
        kdim = -2 if fmt.k_mode == "channel" else -1
        want = reference.dequantize(*reference.quantize(xx, fmt.bits, fmt.group_size, dim=kdim), fmt.group_size,
                                    dim=kdim)
    else:
        got = reference.unpack_v(*outcome.result, fmt, xx.dtype)
        want = reference.dequantize(*reference.quantize(xx, fmt.bits, fmt.group_size, dim=-1), fmt.group_size, dim=-1)
    if not torch.equal(got, want):
        report.add(case, "unpack(pack(x)) is not dequantize(quantize(x))")


def fuzz_formats(seed, device, cases):
    report = Report(seed)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for i in range(cases):
        kind = rng.choice(("format", "quantize", "quantize", "pack"))
        if kind == "format":
            fuzz_kvformat(report, rng, i)
        elif kind == "quantize":
            fuzz_quantize(report, rng, gen, device, i)
        else:
            fuzz_pack(report, rng, gen, device, i)
    report.check()


@pytest.mark.parametrize("seed", range(2))
def test_fuzz_formats_and_quantize(seed):
    """KVFormat, reference.quantize and the K / V packers with random good and bad
    arguments: named errors, or results within the format's rounding bound."""
    fuzz_formats(seed, CPU, cases=150)


@pytest.mark.gpu
def test_fuzz_formats_and_quantize_gpu():
    """The same on CUDA tensors."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    fuzz_formats(300, torch.device("cuda"), cases=150)


# --------------------------------------------------------------------------------------
# BitNet
# --------------------------------------------------------------------------------------


def random_segments(rng, n):
    if rng.random() < 0.3:
        return None
    parts = rng.randint(1, bn.MAX_SEGMENTS)
    cuts = sorted(rng.sample(range(1, n), parts - 1)) if parts > 1 else []
    bounds = [0] + cuts + [n]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


BAD_SEGMENTS = [5, "ab", torch.tensor([16]), (), (0,), (-16, 32), (True,), (8, 8, 8, 8), (1.5,)]


class BitnetFuzz:
    def __init__(self, report, rng, gen, device):
        self.report, self.rng, self.gen, self.device = report, rng, gen, device
        self.kernels = device.type == "cuda"
        self.shapes = [(48, 384), (64, 256)] if self.kernels else [(16, 128), (32, 256), (48, 128), (64, 384)]

    def rand(self, *shape, dtype=torch.float32):
        return torch.randn(*shape, generator=self.gen).to(dtype).to(self.device)

    def ternary(self, n, k):
        return (torch.randint(0, 3, (n, k), generator=self.gen) - 1).to(torch.int8).to(self.device)

    def run_one(self, i, name, call, args, variants, verify, p_clean=0.35):
        choice = pick(self.rng, variants, p_clean)
        expect, names, lab = ACCEPT, tuple(args), "valid"
        if choice is not None:
            lab, arg, make, expect, names = choice
            args[arg] = make()
        case = f"#{i} bitnet.{name} [{lab}]"
        outcome = attempt(self.report, case, lambda: call(**args), expect, names)
        if outcome.trusted:
            verify(case, args, outcome.result)

    def seg_variants(self, n):
        out = [(f"segments={s!r}", "segments", (lambda s=s: s), REJECT, ("segments",)) for s in BAD_SEGMENTS]
        out.append(("segments summing past N", "segments", lambda: (n, 16), REJECT, ("segments",)))
        return out

    def quantize_weight(self, i):
        n, k = self.rng.choice(self.shapes)
        w = self.rand(n, k, dtype=self.rng.choice((torch.float32, torch.float16, torch.bfloat16)))
        args = dict(w=w, segments=random_segments(self.rng, n))
        variants = [(lab, "w", make, exp, ("w",)) for lab, make, exp, _ in
                    tensor_variants("w", w, self.gen, kind="last", fixed_dims=(), kernels=False)
                    if lab.startswith(("a ", "None", "rank", "dtype torch.int", "dtype torch.uint"))]
        variants += [v for v in self.seg_variants(n) if v[0] != "segments summing past N"]
        variants.append(("segments summing past N", "segments", lambda: (n, 16), REJECT, ("segments",)))

        def verify(case, a, res):
            q, scales = res
            segs = a["segments"] or (n,)
            ww, start = a["w"].float(), 0
            for j, rows in enumerate(segs):
                part = ww[start:start + rows]
                want_s = part.abs().mean().clamp(min=bn.WEIGHT_EPS)
                want_q = torch.round(part / want_s).clamp(-1, 1).to(torch.int8)
                if not torch.allclose(scales[j], want_s, rtol=1e-6) or not torch.equal(q[start:start + rows], want_q):
                    self.report.add(case, f"segment {j}: scale {float(scales[j])} vs {float(want_s)}, or codes differ")
                start += rows

        self.run_one(i, "quantize_weight", bn.quantize_weight, args, variants, verify)

    def quantize_activation(self, i):
        shape = [self.rng.randint(1, 3) for _ in range(self.rng.randint(0, 2))] + [self.rng.choice((4, 128, 256))]
        x = self.rand(*shape, dtype=self.rng.choice((torch.float32, torch.float16, torch.bfloat16))) * 3
        args = dict(x=x)
        variants = [(lab, "x", make, exp, ("x",)) for lab, make, exp, _ in
                    tensor_variants("x", x, self.gen, kind="last", fixed_dims=(), kernels=False)
                    if lab.startswith(("a ", "None", "dtype torch.int", "dtype torch.uint"))]
        variants.append(("x 0-dim", "x", lambda: x.reshape(-1)[0], REJECT, ("x",)))
        variants.append(("x with an empty last dim", "x", lambda: x[..., :0], REJECT, ("x",)))

        def verify(case, a, res):
            q, s = res
            xf = a["x"].float()
            want_s = 127.0 / xf.abs().amax(dim=-1).clamp(min=bn.ACT_EPS)
            want_q = torch.round(xf * want_s.unsqueeze(-1)).clamp(-128, 127).to(torch.int8)
            if not (torch.equal(s, want_s) and torch.equal(q, want_q)):
                self.report.add(case, "codes or scales differ from round(x * 127 / max|x|)")

        self.run_one(i, "quantize_activation", bn.quantize_activation, args, variants, verify)

    def pack_weight(self, i):
        n, k = self.rng.choice(self.shapes)
        w = self.ternary(n, k)
        args = dict(w=w)
        variants = [(lab, "w", make, exp, ("w",)) for lab, make, exp, _ in
                    tensor_variants("w", w, self.gen, kind="last", fixed_dims=(), kernels=False)
                    if lab.startswith(("a ", "None", "rank", "dtype"))]
        variants += [
            ("w rows not a multiple of 16", "w", lambda: w[: n - 8].contiguous(), REJECT, ("w",)),
            ("w columns not a multiple of 32", "w", lambda: w[:, : k - 16].contiguous(), REJECT, ("w",)),
            ("w not ternary", "w", lambda: w.clone().index_fill_(1, torch.tensor([3], device=w.device), 2), REJECT,
             ("w",)),
            ("w transposed view", "w", lambda: w.t().contiguous().t(), ACCEPT, ("w",)),
        ]

        def verify(case, a, packed):
            if packed.shape != (n, k // 4) or packed.dtype != torch.int8 or not torch.equal(bn.unpack_weight(packed),
                                                                                              a["w"]):
                self.report.add(case, "unpack_weight(pack_weight(w)) != w")

        self.run_one(i, "pack_weight", bn.pack_weight, args, variants, verify)

    def matmul(self, i, gemv: bool):
        n, k = self.rng.choice(self.shapes)
        m = 1 if gemv else self.rng.choice((1, 2, 7, 16))
        w = self.ternary(n, k)
        wp = bn.pack_weight(w)
        segs = random_segments(self.rng, n)
        x, xs = bn.quantize_activation(self.rand(m, k) * 3)
        ws = torch.rand(len(segs or (n,)), generator=self.gen).to(self.device) + 0.5
        backend_choices = ["auto", "reference"] + (["kernel"] if self.kernels else [])
        args = dict(x=x, w_packed=wp, x_scale=xs, w_scales=ws, segments=segs, backend=self.rng.choice(backend_choices),
                    out_dtype=self.rng.choice(bn.OUT_DTYPES))
        hopper = self.kernels and torch.cuda.get_device_capability(self.device)[0] == 9
        if not gemv:
            args["kernel"] = self.rng.choice(["auto", "mma"] + (["wgmma"] if hopper or not self.kernels else []))
        every = ("x", "w_packed", "x_scale", "w_scales")
        variants = []
        for name in every:
            for lab, make, exp, _ in tensor_variants(name, args[name], self.gen, kind="last",
                                                     fixed_dims=tuple(range(args[name].dim())), kernels=False):
                if lab.startswith("last dim strided") or lab.startswith("rows padded") or lab.startswith("storage"):
                    exp = ACCEPT  # any strides and offsets: the kernels copy to aligned storage
                variants.append((f"{name} {lab}", name, make, exp, every + ("segments",)))
        if gemv:
            variants.append(("x with two tokens", "x", lambda: torch.cat([x, x]), REJECT, ("x", "x_scale")))
        else:
            variants.append(("x with no tokens", "x", lambda: x[:0], REJECT, ("x", "x_scale")))
        variants += self.seg_variants(n)
        variants += [(f"backend={b!r}", "backend", (lambda b=b: b), REJECT, ("backend",)) for b in ("fast", None, 3)]
        if not self.kernels:
            variants.append(("backend='kernel' on the CPU", "backend", lambda: "kernel", REJECT, ("backend", "CUDA")))
        variants += [(f"out_dtype={d!r}", "out_dtype", (lambda d=d: d), REJECT, ("out_dtype",))
                     for d in (torch.float16, torch.float32, "bf16", None)]
        if not gemv:
            variants += [(f"kernel={kn!r}", "kernel", (lambda kn=kn: kn), REJECT, ("kernel",))
                         for kn in ("tcgen05", None, 3)]
            if self.kernels and not hopper:
                variants.append(("kernel='wgmma' off Hopper", "kernel", lambda: "wgmma", EITHER, ("kernel",)))

        def verify(case, a, y):
            acc = bn.accumulate(a["x"], w)
            if a["out_dtype"] == torch.int32:
                if not torch.equal(y, acc):
                    self.report.add(case, "integer sums differ from x @ w.T")
                return
            rows = torch.repeat_interleave(a["w_scales"].float(), torch.tensor(a["segments"] or (n,),
                                                                               device=self.device))
            want = ((acc.float() / a["x_scale"].float().unsqueeze(1)) * rows.unsqueeze(0)).to(torch.bfloat16)
            if y.shape != want.shape or y.dtype != torch.bfloat16:
                self.report.add(case, f"output {tuple(y.shape)} {y.dtype}")
                return
            diff = (y.float() - want.float()).abs()
            ulp = want.float().abs().clamp(min=1e-30) * 2.0 ** -7  # one bf16 ulp (same fp32 maths, one rounding)
            if not bool((diff <= ulp).all()):
                self.report.add(case, f"output off by {float(diff.max()):.3g}")

        self.run_one(i, "gemv" if gemv else "gemm", bn.gemv if gemv else bn.gemm, args, variants, verify)

    def bitlinear(self, i):
        n, k = self.rng.choice(self.shapes)
        args = dict(in_features=k, out_features=n, bias=self.rng.random() < 0.5,
                    segments=random_segments(self.rng, n), device=self.device,
                    backend=self.rng.choice(("auto", "reference")))
        variants = [(f"in_features={v!r}", "in_features", (lambda v=v: v), REJECT, ("in_features", "K"))
                    for v in (k + 64, 0, -k, float(k), "128")]
        variants += [(f"out_features={v!r}", "out_features", (lambda v=v: v), REJECT, ("out_features", "N"))
                     for v in (n + 8, 0, float(n), None)]
        variants += [v for v in self.seg_variants(n)]
        variants += [(f"backend={b!r}", "backend", (lambda b=b: b), REJECT, ("backend",)) for b in ("fast", None)]

        def verify(case, a, layer):
            lin = torch.nn.Linear(k, n, bias=a["bias"]).to(self.device)
            try:
                layer = bn.BitLinear.from_float(lin, segments=a["segments"], backend=a["backend"])
            except Exception as exc:  # noqa: BLE001
                self.report.add(case, f"from_float of a valid layer raised {type(exc).__name__}: {_short(exc)}")
                return
            m = self.rng.choice((1, 3))
            x = self.rand(m, k, dtype=torch.bfloat16)
            bad = [("x with the wrong features", lambda: self.rand(m, k + 128, dtype=torch.bfloat16), ("x",)),
                   ("x integer", lambda: x.to(torch.int32), ("x",))]
            lab, make, names = self.rng.choice(bad)
            attempt(self.report, f"{case} forward [{lab}]", lambda: layer(make()), REJECT, names)
            out = attempt(self.report, f"{case} forward [valid]", lambda: layer(x), ACCEPT, ("x",))
            if out.trusted and (out.result.shape != (m, n) or out.result.dtype != torch.bfloat16):
                self.report.add(case, f"forward gave {tuple(out.result.shape)} {out.result.dtype}")
            attempt(self.report, f"{case} from_float [not a Linear]", lambda: bn.BitLinear.from_float("linear"),
                    REJECT, ("linear",))

        self.run_one(i, "BitLinear", lambda **a: bn.BitLinear(**a), args, variants, verify)

    def run(self, cases):
        ops = [self.quantize_weight, self.quantize_activation, self.pack_weight, self.bitlinear,
               lambda i: self.matmul(i, True), lambda i: self.matmul(i, False), lambda i: self.matmul(i, False)]
        for i in range(cases):
            self.rng.choice(ops)(i)


def fuzz_bitnet(seed, device, cases):
    report = Report(seed)
    BitnetFuzz(report, random.Random(seed), torch.Generator().manual_seed(seed), device).run(cases)
    report.check()


@pytest.mark.parametrize("seed", range(2))
def test_fuzz_bitnet(seed):
    """bitnet.quantize_weight / quantize_activation / pack_weight / gemv / gemm / BitLinear
    with random good and bad arguments (torch reference on the CPU)."""
    fuzz_bitnet(seed, CPU, cases=120)


@pytest.mark.gpu
def test_fuzz_bitnet_gpu():
    """The same on CUDA tensors: the GEMV / GEMM kernels, exact integer sums and bf16
    within one ulp of the reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    fuzz_bitnet(400, torch.device("cuda"), cases=120)


# --------------------------------------------------------------------------------------
# A block table the caller edited
# --------------------------------------------------------------------------------------


def test_fuzz_caller_edited_block_table():
    """``cache.block_table`` is the caller's to edit (pages handed between sequences).  An
    edit that sends a page in use past the pool, below zero or onto a page another entry
    in use holds must make the next prefill, append or decode that would use it raise a
    ``ValueError`` naming ``block_table`` before anything is read or written, leaving the
    cache as it was (the torch reference: an index past the pool raises IndexError, a
    negative one silently reads or writes the pool's last pages, a shared one packs over
    another sequence's tokens)."""
    report = Report(500)
    rng = random.Random(500)
    gen = torch.Generator().manual_seed(500)
    for i in range(30):
        fmt = bd.KVFormat(bits=rng.choice((4, 2)), group_size=rng.choice((32, 64)))
        nr = fmt.residual_block
        batch, page = rng.randint(2, 3), nr * rng.choice((1, 2))
        max_seqlen = rng.randint(3 * nr, 4 * nr)
        cache = bd.KVCache.allocate(batch, 1, 64, max_seqlen, fmt, device="cpu", page_size=page, backend="reference")
        perm = torch.randperm(cache.block_table.numel(), generator=gen).to(torch.int32)
        cache.block_table.copy_(perm.view_as(cache.block_table))
        lens = [rng.randint(nr, max_seqlen - nr) for _ in range(batch)]
        k, v = kvdata.kv(gen, batch, max(lens), 1, 64)
        cache.prefill(k, v, lens)
        op = rng.choice(("prefill", "append", "decode"))
        if op == "append":  # enough tokens that every sequence packs at least one more block
            t = nr
            after = [n + t for n in lens]
            if max(after) > max_seqlen:
                continue
            k_new, v_new = kvdata.kv(gen, batch, t, 1, 64)
            call = lambda: cache.append(k_new, v_new)  # noqa: E731
        elif op == "prefill":
            after = lens
            call = lambda: cache.prefill(k, v, lens)  # noqa: E731
        else:
            after = lens
            q = kvdata.randn(gen, batch, 1, 2, 64)
            call = lambda: bd.decode(q, cache)  # noqa: E731
        used = [-(-(n // nr * nr) // page) for n in after]
        in_use = [(b, j) for b in range(batch) for j in range(used[b])]
        if op == "append":  # an entry the append packs into
            in_use = [(b, j) for b, j in in_use if j * page + page > lens[b] // nr * nr]
        b, j = rng.choice(in_use)
        how = rng.choice(("past the pool", "negative", "shared"))
        if how == "past the pool":
            cache.block_table[b, j] = cache.k_pack.shape[0] + rng.randint(0, 5)
        elif how == "negative":
            cache.block_table[b, j] = -1 - rng.randint(0, 2)
        else:
            others = [(b2, j2) for b2 in range(batch) for j2 in range(used[b2]) if (b2, j2) != (b, j)]
            cache.block_table[b, j] = cache.block_table[rng.choice(others)]
        snap = snapshot(cache)
        case = f"#{i} {op} with the page of sequence {b}, column {j} {how} ({fmt}, page {page}, lengths {lens})"
        outcome = attempt(report, case, call, REJECT, ("block_table",))
        moved = changed(cache, snap)
        if moved and not outcome.ran:
            report.add(case, f"the failed call changed {moved}")
    report.check()


# --------------------------------------------------------------------------------------
# Capacity (issue 14's API: capacity, check(), overflow)
# --------------------------------------------------------------------------------------


def fuzz_capacity(seed, device, backend, cases):
    """Random appends into random caches until they are full and past it."""
    report = Report(seed)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for i in range(cases):
        cfg = random_config(rng, device)
        bits, k_mode, group, dtype, d, _ = cfg
        fmt = bd.KVFormat(bits=bits, k_mode=k_mode, group_size=group)
        nr = fmt.residual_block
        batch, max_seqlen = rng.randint(1, 3), rng.randint(1, 3 * nr)
        cache = bd.KVCache.allocate(batch, 1, d, max_seqlen, fmt, dtype=dtype, device=device,
                                    page_size=rng.choice((None, nr)), backend=backend)
        case = f"#{i} {fmt} batch {batch} max_seqlen {max_seqlen}"
        if cache.capacity != max_seqlen:
            report.add(case, f"capacity {cache.capacity}")
        lens = [rng.randint(0, max_seqlen) for _ in range(batch)]
        k, v = kvdata.kv(gen, batch, max(lens), 1, d, dtype=dtype, device=device)
        cache.prefill(k, v, lens)
        for step in range(10):
            room = max_seqlen - max(lens)
            t = rng.choice((0, 1, room, room + 1, rng.randint(0, room + 5), nr + 1))
            k, v = kvdata.kv(gen, batch, t, 1, d, dtype=dtype, device=device)
            fits = max(lens) + t <= max_seqlen
            snap = snapshot(cache)
            label = f"{case} step {step}: append {t} to {lens}"
            outcome = attempt(report, label, lambda: cache.append(k, v), ACCEPT if fits else REJECT, ("max_seqlen",))
            if outcome.trusted:
                lens = [n + t for n in lens]
            elif not outcome.ran and changed(cache, snap):
                report.add(label, f"refused append changed {changed(cache, snap)}")
            checked = attempt(report, f"{label}, then check()", cache.check, ACCEPT, ())
            if checked.trusted and checked.result is not None:
                report.add(label, f"check() returned {checked.result!r}")
            if cache.lengths != lens or cache.seqlens.tolist() != lens or bool(cache.overflow.any()):
                report.add(label, f"lengths {cache.lengths}, seqlens {cache.seqlens.tolist()}, overflow "
                                  f"{cache.overflow.tolist()}; want {lens} and no overflow")
                break
        cache.reset()
        if cache.check() is not None or cache.lengths != [0] * batch or bool(cache.overflow.any()):
            report.add(case, "reset() did not leave an empty cache that check() passes")
    report.check()


def test_fuzz_capacity_is_checked_on_the_host():
    """``capacity`` is ``max_seqlen``; an append past it raises a ``ValueError`` naming
    ``max_seqlen`` and writes nothing; ``check()`` returns None (the host refused
    everything, so nothing overflowed on the device) and keeps ``lengths`` in step with
    ``seqlens``; ``overflow`` stays zero (torch reference)."""
    assert issubclass(bd.CacheOverflowError, RuntimeError)
    fuzz_capacity(600, CPU, "reference", cases=25)


def test_fuzz_capacity_is_checked_on_the_host_gpu(backend):
    """The same with eager kernel appends."""
    fuzz_capacity(601, torch.device("cuda"), backend, cases=20)


# --------------------------------------------------------------------------------------
# The decode fast path (kernel backends)
# --------------------------------------------------------------------------------------


def test_decode_fast_path_still_validates_options_gpu(backend):
    """``cache.decode`` reuses the plan of the last validated call when the call looks the
    same.  Options that compare equal to valid ones (``True == 1``, ``1.0 == 1``) and a q
    that is not a tensor must still be refused by name, not slip through the reuse."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(700)
    fmt = bd.KVFormat(bits=4)
    cache = bd.KVCache.allocate(2, 2, 128, 400, fmt, device=dev, backend=backend)
    cache.prefill(*kvdata.kv(gen, 2, 300, 2, 128, device=dev))
    q = kvdata.randn(gen, 2, 1, 8, 128, device=dev)
    good = bd.decode(q, cache, softmax_scale=1, num_splits=1)  # the plan a later call may reuse
    cases = [
        (dict(softmax_scale=1, num_splits=True), "num_splits"),
        (dict(softmax_scale=1, num_splits=1.0), "num_splits"),
        (dict(softmax_scale=True, num_splits=1), "softmax_scale"),
    ]
    for kwargs, name in cases:
        with pytest.raises((TypeError, ValueError), match=rf"\b{name}\b"):
            bd.decode(q, cache, **kwargs)
    with pytest.raises(TypeError, match=r"\bq\b"):
        bd.decode(q.tolist(), cache, softmax_scale=1, num_splits=1)
    assert torch.equal(bd.decode(q, cache, softmax_scale=1, num_splits=1), good)
