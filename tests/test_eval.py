"""``bitdecode.eval`` and ``bitdecode eval`` on the CPU: a tiny random-weight Llama, bytes as
tokens, the torch reference backend (a few seconds)."""

from __future__ import annotations

import importlib.util
import math
import json

import pytest
import torch

pytest.importorskip("transformers")

import bitdecode as bd  # noqa: E402
import bitdecode.eval as bdeval  # noqa: E402
from bitdecode import cli_eval, cli_generate  # noqa: E402
from bitdecode.cli import main  # noqa: E402

CONTEXT = 272  # > the 2-bit residual block (256): the scored steps read packed 2-bit tokens
SCORED = 16


def _quanto() -> bool:
    return bdeval._quanto_missing() is None


@pytest.fixture(scope="module")
def model():
    return cli_generate.random_llama("tiny", "cpu", torch.bfloat16, "sdpa")


@pytest.fixture(scope="module")
def ids():
    return bdeval.tokenize(bdeval.ByteTokenizer(), bdeval.pydoc_text()[:100_000])


@pytest.fixture(scope="module")
def result(model, ids):
    specs = ["4c64", "2c32", "4c128"] + (["quanto4"] if _quanto() else [])
    return bdeval.evaluate(model, ids, specs, contexts=[CONTEXT], scored=SCORED, windows=2)


def test_parse_method():
    m = bdeval.parse_method("4c64", head_dim=64)
    assert m.kind == "bitdecode" and m.runnable and m.fmt == bd.KVFormat(bits=4, k_mode="channel", group_size=64)
    m = bdeval.parse_method("2t64")
    assert (m.fmt.bits, m.fmt.k_mode, m.fmt.group_size) == (2, "token", 64)
    assert "head_dim=64" in bdeval.parse_method("4c128", head_dim=64).error  # V groups cannot exceed D
    assert bdeval.parse_method("4c128", head_dim=128).runnable
    assert bdeval.parse_method("3c64").error.startswith("unsupported")
    assert bdeval.parse_method("bf16").kind == "16-bit"
    q = bdeval.parse_method("quanto2")
    assert q.kind == "quanto" and q.nbits == 2
    with pytest.raises(ValueError, match="cannot read the method spec"):
        bdeval.parse_method("4x64")
    methods = bdeval.parse_methods("4c64,2c32,4c64", head_dim=64)
    assert [m.spec for m in methods] == ["16", "4c64", "2c32"]


def test_suffixes_pass_fields_only_when_given(monkeypatch):
    m = bdeval.parse_method("4c64v2s16")
    if m.runnable:  # this KVFormat has v_bits / sink_tokens
        assert (m.fmt.bits, m.fmt.v_bits, m.fmt.sink_tokens) == (4, 2, 16)

    def old_format(bits=4, k_mode="channel", group_size=128):  # a KVFormat without the two fields
        return bd.KVFormat(bits=bits, k_mode=k_mode, group_size=group_size)

    monkeypatch.setattr(bdeval, "KVFormat", old_format)
    assert bdeval.parse_method("4c64").runnable
    m = bdeval.parse_method("4c64v2")
    assert not m.runnable and "v_bits" in m.error and "unsupported" in m.error
    assert "sink_tokens" in bdeval.parse_method("2c32s16").error


def test_teacher_forced_decode_scores_the_right_tokens(model, ids, result):
    """The 16-bit decode loop's perplexity equals one forward pass over the window's tokens."""
    row = next(r for r in result["results"] if r["method"] == "16")
    x = torch.stack([ids[e - CONTEXT - 1:e] for e in result["settings"]["window_ends"]])
    with torch.inference_mode():
        logits = model(x[:, :CONTEXT]).logits.float()
    logp = torch.log_softmax(logits[:, CONTEXT - SCORED:], dim=-1)
    nll = -logp.gather(-1, x[:, CONTEXT - SCORED + 1:, None]).mean().item()
    assert row["ppl"] == pytest.approx(torch.tensor(nll).exp().item(), rel=0.02)


def test_evaluate_fields_and_metrics(result):
    assert result["settings"]["contexts"] == [CONTEXT] and result["settings"]["prefill"] == [CONTEXT - SCORED]
    rows = {r["method"]: r for r in result["results"]}
    assert list(rows)[0] == "16"
    base = rows["16"]
    assert base["kl"] == 0 and base["top1_agreement"] == 1 and base["ppl_increase_pct"] == 0
    assert base["kv_ratio"] == 1 and base["tokens"] == 2 * SCORED and len(base["per_window"]) == 2
    four, two = rows["4c64"], rows["2c32"]
    for r in (four, two):
        for key in ("ppl", "ppl_increase_pct", "ppl_increase_se_pct", "kl", "top1_agreement", "top1_accuracy",
                    "kv_bytes", "kv_ratio", "seconds"):
            assert key in r, key
    assert two["kl"] > four["kl"] > 0
    assert 0 <= two["top1_agreement"] <= 1
    assert "error" in rows["4c128"] and "ppl" not in rows["4c128"]
    assert ("quanto4" in rows) == _quanto()  # (optimum-quanto is optional: its rows only where it imports)
    if "quanto4" in rows:
        assert rows["quanto4"]["kl"] > 0 and rows["quanto4"]["kv_ratio"] < 1
    t = bdeval.targets(result)
    assert t["2bit"]["best"] == "2c32" and t["k4v2"]["status"] == "not run"
    assert t["4bit_channel_sinks"]["best"] == "4c64"
    json.dumps(result)


def test_16bit_against_itself(model, ids):
    """A second 16-bit run scores identically: the same perplexity, the same log-probs, and
    scored against the first (``evaluate`` scores its baseline against itself, so its own
    row's KL and agreement hold by construction) KL 0 and agreement 1; a perturbed run does
    not."""
    a = bdeval.evaluate(model, ids, [], contexts=[CONTEXT], scored=8, windows=1)["results"][0]
    b = bdeval.evaluate(model, ids, [], contexts=[CONTEXT], scored=8, windows=1)["results"][0]
    assert a["ppl"] == b["ppl"]
    method, x = bdeval.parse_method("16"), ids[:CONTEXT + 1][None]
    first, second = (bdeval.teacher_forced(model, method, x, 8)[0] for _ in range(2))
    targets = x[:, CONTEXT - 8 + 1:]
    assert torch.equal(first, second)
    same = bdeval.score(second, first, targets)
    assert float(same["kl"].max()) == 0 and bool(same["agree"].all())
    other = torch.log_softmax(first + torch.randn(first.shape, generator=torch.Generator().manual_seed(0)), -1)
    moved = bdeval.score(other, first, targets)
    assert float(moved["kl"].min()) > 0 and not bool(moved["agree"].all())


def test_needle_prompts_and_run(model):
    tok = bdeval.ByteTokenizer()
    filler = bdeval.tokenize(tok, bdeval.pydoc_text()[:20_000])
    prompts = bdeval.needle_prompts(tok, filler, 300, depths=(0.1, 0.9), trials=2, seed=3)
    assert len(prompts) == 4 and all(len(p["ids"]) == 300 for p in prompts)
    for p in prompts:
        text = tok.decode(p["ids"])
        assert f"The pass key is {p['key']}." in text and text.endswith("The pass key is")
        a, b = p["needle_span"]
        assert p["key"] in tok.decode(p["ids"][a:b])
    assert prompts[0]["needle_span"][0] < prompts[-1]["needle_span"][0]
    with pytest.raises(ValueError, match=rf"needle context 30000 needs .* filler tokens; the text has {len(filler):,}"):
        bdeval.needle_prompts(tok, filler, 30_000)
    out = bdeval.needle(model, tok, ["4c64"], filler, context=300, depths=(0.5,), trials=2, new_tokens=4)
    rows = {r["method"]: r for r in out["results"]}
    assert set(rows) == {"16", "4c64"}
    for r in rows.values():
        assert 0 <= r["rate"] <= 1 and len(r["answers"]) == 2 and set(r["per_depth"]) == {"0.5"}
    assert rows["4c64"]["needle_in_packed"] is True  # 4-bit: 256 of the 299 prefilled tokens are packed


def test_cli_eval_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "220")
    formats = "4c64,2c32,4c128"
    code = main(["eval", "--random-llama", "tiny", "--device", "cpu", "--formats", formats,
                 "--window", f"160,{CONTEXT}", "--scored", "8", "--windows", "2", "--needle", "--needle-context", "300",
                 "--needle-trials", "1", "--needle-depths", "0.5", "--needle-tokens", "3", "--out", str(tmp_path)]
                + (["--quanto"] if _quanto() else []))
    out = capsys.readouterr().out
    assert code == 0, out
    for text in ("bitdecode eval", "random-weight Llama (tiny", "context 272 tokens", "4c64", "2c32",
                 "not run: 4c128", "needle", "issue 11 targets"):
        assert text in out, text
    result = json.loads((tmp_path / "accuracy.json").read_text())
    assert result["settings"]["contexts"] == [160, CONTEXT] and result["settings"]["windows"] == 2
    assert result["text"]["tokens"] > 100_000 and result["model"]["head_dim"] == 64
    methods = {r["method"] for r in result["results"] if "ppl" in r}
    assert {"16", "4c64", "2c32"} <= methods and ("quanto2" in methods) == _quanto()
    assert len(result["needle"]["results"]) == len(result["methods"])
    assert "targets" in result and "versions" in result and result["runtime_s"] > 0
    if importlib.util.find_spec("matplotlib") is None:  # (the plot is optional: no matplotlib, no PNG)
        assert not (tmp_path / "accuracy.png").exists()
    else:
        assert (tmp_path / "accuracy.png").stat().st_size > 1000


def test_cli_eval_rejects_a_bad_spec(capsys):
    assert main(["eval", "--random-llama", "tiny", "--device", "cpu", "--formats", "4q64"]) == 2
    assert "cannot read the method spec" in capsys.readouterr().err


def test_cli_eval_refuses_an_out_it_cannot_write_before_it_runs(tmp_path, capsys):
    """--out is checked when parsed (the results of a long run would be lost at its end)."""
    a_file = tmp_path / "afile"
    a_file.write_text("")
    for out, msg in ((a_file, "exists and is not a folder"), (a_file / "x.json", "cannot make the folder")):
        with pytest.raises(SystemExit) as exit_:
            main(["eval", "--random-llama", "tiny", "--device", "cpu", "--out", str(out)])
        assert exit_.value.code == 2 and msg in capsys.readouterr().err
    with pytest.raises(SystemExit):  # (an empty path was the working folder)
        main(["eval", "--random-llama", "tiny", "--device", "cpu", "--out", ""])
    assert "argument --out: an empty path is not a file or folder" in capsys.readouterr().err
    assert cli_eval.results_path(str(tmp_path / "new" / "r.json")) == tmp_path / "new" / "r.json"
    assert (tmp_path / "new").is_dir() and not (tmp_path / "new" / "r.json").exists()


def test_help_lists_eval(capsys):
    main([])
    assert "eval" in capsys.readouterr().out


def test_bad_arguments_are_refused_before_the_model_runs(model, ids):
    """What ran the model (or its 16-bit prefills) before failing in torch.stack / cat, an
    embedding's IndexError, or reported needles at wrong positions, is refused by name."""
    tok = bdeval.ByteTokenizer()
    for kw, message in ((dict(scored=0), "scored must be positive, got 0"),
                        (dict(batch=-1), "batch must be positive, got -1")):
        with pytest.raises(ValueError, match=message):
            bdeval.evaluate(model, ids, [], **({"contexts": [40], "scored": 8} | kw))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 512\) \(the model's vocabulary\), got \[10, 999\]"):
        bdeval.evaluate(model, torch.cat([ids[:500], torch.tensor([999])]), [], contexts=[40], scored=8)
    with pytest.raises(TypeError, match="ids must hold integer token ids, got torch.float32"):
        bdeval.evaluate(model, ids[:500].float(), [], contexts=[40], scored=8)
    for kw, message in ((dict(trials=0), "trials must be positive, got 0"),
                        (dict(new_tokens=0), "new_tokens must be positive, got 0"),
                        (dict(depths=()), r"depths must be fractions in \[0, 1\]"),
                        (dict(depths=(-0.5, 0.5)), r"depths must be fractions in \[0, 1\].*-0.5")):
        with pytest.raises(ValueError, match=message):
            bdeval.needle(model, tok, [], ids[:20_000], context=300, **kw)
    with pytest.raises(ValueError, match=r"depths must be fractions in \[0, 1\].*1.5"):
        bdeval.needle_prompts(tok, ids[:20_000], 300, depths=(0.5, 1.5), trials=1)
    with pytest.raises(TypeError, match="cache must be a transformers Cache"):
        bdeval.cache_bytes(None)


def test_score_is_kl_of_the_baseline_against_the_method():
    """``score``'s definitions, computed by hand: KL(base || logp) (not the reverse: the two
    differ here), top-1 agreement with base, top-1 accuracy on the targets (which differ
    from base's argmax)."""
    base = torch.log_softmax(torch.tensor([[[3.0, 0.0, 0.0], [0.0, 0.0, 3.0]]]), -1)
    logp = torch.log_softmax(torch.tensor([[[0.0, 0.0, 0.0], [0.0, 3.0, 0.0]]]), -1)
    targets = torch.tensor([[1, 1]])
    m = bdeval.score(logp, base, targets)
    kl = (base.exp() * (base - logp)).sum(-1)
    assert torch.allclose(m["kl"], kl) and not torch.allclose(kl, (logp.exp() * (logp - base)).sum(-1))
    assert m["agree"].tolist() == [[1.0, 0.0]] and m["correct"].tolist() == [[0.0, 1.0]]
    torch.testing.assert_close(m["nll"], -logp[0, :, 1][None])


def test_evaluate_scores_the_next_tokens_window_by_window(model, ids, monkeypatch):
    """``evaluate``'s bookkeeping with a stand-in for the model's log-probs: the 16-bit run
    predicts each target exactly (so its perplexity is 1 only if the targets are the next
    tokens), ``2c32`` misses every token of the second window by a varying margin,
    ``2t64`` equals the baseline.  Every summary number is checked against its formula."""
    vocab, got = model.config.vocab_size, {}

    def fake(model_, method, x, scored, backend="auto"):
        nxt = x[:, -scored:]  # the tokens after each fed one
        logits = torch.full((*nxt.shape, vocab), -30.0).scatter(-1, nxt[..., None], 0.0)
        if method.spec == "2c32":
            logits[1] = torch.full((scored, vocab), -1.0).scatter(-1, nxt[1, :, None], -1.0 - torch.arange(
                scored, dtype=torch.float32)[:, None] / 4)
        got[method.spec] = torch.log_softmax(logits, -1)
        return got[method.spec], 1, 0.0

    monkeypatch.setattr(bdeval, "teacher_forced", fake)
    scored = 8
    r = bdeval.evaluate(model, ids, ["2c32", "2t64"], contexts=[64], scored=scored, windows=2)
    rows = {x["method"]: x for x in r["results"]}
    assert rows["16"]["ppl"] == pytest.approx(1.0, abs=1e-9) and rows["16"]["top1_accuracy"] == 1
    x = torch.stack([ids[e - 65:e] for e in r["settings"]["window_ends"]])
    nll = {k: -v.gather(-1, x[:, -scored:, None])[..., 0].double() for k, v in got.items()}
    d = nll["2c32"] - nll["16"]
    q = rows["2c32"]
    assert q["ppl"] == pytest.approx(math.exp(nll["2c32"].mean()), rel=1e-9)
    assert q["ppl_increase_pct"] == pytest.approx(100 * math.expm1(d.mean()), rel=1e-9)
    se = 100 * math.exp(d.mean()) * d.flatten().std().item() / math.sqrt(d.numel())
    assert q["ppl_increase_se_pct"] == pytest.approx(se, rel=1e-9)
    assert q["top1_agreement"] == 0.5 and q["top1_accuracy"] == 0.5  # (the second window's argmax: token 0)
    for w in range(2):
        assert q["per_window"][w]["ppl"] == pytest.approx(math.exp(nll["2c32"][w].mean()), rel=1e-9)
    assert q["per_window"][0]["ppl_increase_pct"] == pytest.approx(0, abs=1e-9)
    assert rows["2t64"]["ppl_increase_pct"] == pytest.approx(0, abs=1e-9)
    assert bdeval.targets(r)["2bit"]["best"] == "2t64"  # the smaller increase of the two 2-bit formats


def test_needle_spans_rates_and_what_the_model_is_fed(model, monkeypatch):
    """The needle span is exactly the needle's tokens; ``greedy`` prefills all but the last
    prompt token and feeds it as the first decode step; the rate per depth counts its own
    prompts; ``needle_in_packed`` counts the prefill (context - 1 tokens) in whole blocks."""
    tok = bdeval.ByteTokenizer()
    filler = bdeval.tokenize(tok, bdeval.pydoc_text()[:20_000])
    prompts = bdeval.needle_prompts(tok, filler, 300, depths=(0.1, 0.9), trials=2, seed=3)
    for p in prompts:
        a, b = p["needle_span"]
        assert tok.decode(p["ids"][a:b]) == bdeval.NEEDLE.format(key=p["key"])
    fed = []

    def forward(model_, x, cache, kw):
        fed.append(x.clone())
        return torch.zeros(x.shape[0], model_.config.vocab_size)

    monkeypatch.setattr(bdeval, "_forward", forward)
    x = torch.tensor([prompts[0]["ids"]])
    bdeval.greedy(model, bdeval.parse_method("16"), x, 3)
    assert torch.equal(fed[0], x[:, :-1]) and torch.equal(fed[1], x[:, -1:]) and len(fed) == 4

    first_key = prompts[0]["key"]

    def answers(model_, method, x, new_tokens, backend="auto"):  # only the first prompt's key is found
        out = torch.zeros(x.shape[0], new_tokens, dtype=torch.long)
        for i, row in enumerate(x.tolist()):
            if row == prompts[0]["ids"]:
                out[i, :5] = torch.tensor(tok.encode(first_key))
        return out, 0

    monkeypatch.setattr(bdeval, "greedy", answers)
    out = bdeval.needle(model, tok, ["4c64"], filler, context=300, depths=(0.1, 0.9), trials=2, seed=3,
                        new_tokens=6)
    for r in out["results"]:
        assert r["found"] == [True, False, False, False] and r["rate"] == 0.25
        assert r["per_depth"] == {"0.1": 0.5, "0.9": 0.0}
    short = bdeval.needle(model, tok, ["4c64"], filler[:2000], context=256, depths=(0.9,), trials=1, new_tokens=1)
    assert short["results"][1]["needle_in_packed"] is False  # 255 prefilled tokens: 128 of them packed


def test_cli_eval_hands_its_options_on(tmp_path, capsys, monkeypatch):
    """What ``eval`` hands on: --seed and --backend to the model loader (the random weights'
    seed), --window / --scored / --windows / --batch to the evaluation, and --needle-formats
    (not --formats) with the needle options to the pass-key test."""
    seen = {}
    real_load = cli_generate.load_model

    def load_model(args, device, dtype):
        seen["load"] = (args.random_llama, args.seed, args.backend)
        return real_load(args, device, dtype)

    def evaluate(model, ids, methods, **kw):
        seen["methods"] = [m.spec for m in methods]
        seen["evaluate"] = {k: kw[k] for k in ("contexts", "scored", "windows", "batch", "backend")}
        return {}

    def needle(model, tokenizer, methods, ids, **kw):
        seen["needle_methods"] = [m.spec for m in methods]
        seen["needle"] = {k: kw[k] for k in ("context", "depths", "trials", "new_tokens", "seed")}
        raise ValueError("stopped by the test")

    monkeypatch.setattr(cli_generate, "load_model", load_model)
    monkeypatch.setattr(bdeval, "evaluate", evaluate)
    monkeypatch.setattr(bdeval, "needle", needle)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 100)
    monkeypatch.setenv("COLUMNS", "300")
    code = main(["eval", "--random-llama", "tiny", "--device", "cpu", "--backend", "reference", "--seed", "7",
                 "--text", str(text), "--formats", "4c64", "--window", "64,128", "--scored", "5", "--windows", "3",
                 "--batch", "1", "--needle", "--needle-formats", "2c32", "--needle-context", "300",
                 "--needle-depths", "0.5", "--needle-trials", "1", "--needle-tokens", "2"])
    assert code == 2 and "stopped by the test" in capsys.readouterr().err
    assert seen == {"load": ("tiny", 7, "reference"), "methods": ["16", "4c64"],
                    "evaluate": {"contexts": [64, 128], "scored": 5, "windows": 3, "batch": 1, "backend": "reference"},
                    "needle_methods": ["16", "2c32"],
                    "needle": {"context": 300, "depths": [0.5], "trials": 1, "new_tokens": 2, "seed": 7}}
