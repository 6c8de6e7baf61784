"""``bitdecode generate`` on the CPU: a tiny random-weight Llama, the torch reference backend."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")

from bitdecode.cache import MAX_SEQLEN  # noqa: E402
from bitdecode.cli import main  # noqa: E402


def _rows(out):
    """{first cell: [cells]} of the rich table rows in ``out``."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("│"):
            cells = [c.strip() for c in line.strip("│").split("│")]
            rows[cells[0]] = cells[1:]
    return rows


def _run(capsys, monkeypatch, *args):
    monkeypatch.setenv("COLUMNS", "220")
    code = main(["generate", "--random-llama", "tiny", "--device", "cpu", "--backend", "reference", *args])
    out = capsys.readouterr().out
    assert code == 0, out
    return out


def test_generate_tiny_random_llama(capsys, monkeypatch):
    out = _run(capsys, monkeypatch, "--max-new-tokens", "4")
    for field in ("bitdecode generate", "random-weight Llama (tiny", "prompt 512 tokens (random ids)",
                  "4 new tokens", "backend reference", "decode tokens/s", "prefill", "KV memory", "vs 16-bit",
                  "tokens as 16-bit"):
        assert field in out, field
    rows = _rows(out)
    base = next(v for k, v in rows.items() if k.startswith("16-bit (transformers DynamicCache"))
    four = next(v for k, v in rows.items() if k.startswith("bitdecode 4-bit (K per channel, G=64, reference)"))
    assert base[3] == "1.000x"
    assert 0 < float(four[3].rstrip("x")) < 1  # packed + residual block + capacity, below 16-bit
    assert float(four[0].replace(",", "")) > 0 and float(base[0].replace(",", "")) > 0
    # both runs printed their 4 generated token ids; the 4-bit cache agrees with 16-bit on a tiny model
    ids = {m.group(1): m.group(2).split()
           for m in re.finditer(r"^(16-bit|bitdecode 4-bit): token ids (.*)$", out, re.M)}
    assert len(ids["16-bit"]) == len(ids["bitdecode 4-bit"]) == 4
    assert re.match(r"\d+% \(first divergence: (none|\d)\)", four[4])


def test_generate_fused_model(capsys, monkeypatch):
    """--fuse puts the norms, rotary embedding and projections on bitdecode's ops for both
    rows (the reference ones here: bit-identical or equal up to summation order), and the
    modeling module's own rotary embedding is back after the run."""
    from transformers.models.llama import modeling_llama

    own = modeling_llama.apply_rotary_pos_emb
    out = _run(capsys, monkeypatch, "--max-new-tokens", "3", "--fuse")
    assert re.search(r"fused \(--fuse\): \d+ RMSNorms, the rotary embedding of 1 modeling module\(s\), \d+ "
                     r"projection groups merged", out), out
    assert int(re.search(r"(\d+) RMSNorms", out).group(1)) > 0
    assert int(re.search(r"(\d+) projection groups", out).group(1)) > 0
    rows = _rows(out)
    four = next(v for k, v in rows.items() if k.startswith("bitdecode 4-bit"))
    assert re.match(r"\d+% \(first divergence: (none|\d)\)", four[4])
    assert modeling_llama.apply_rotary_pos_emb is own


def test_generate_two_widths_without_baseline(capsys, monkeypatch):
    out = _run(capsys, monkeypatch, "--max-new-tokens", "2", "--no-baseline", "--bits", "4", "2",
               "--prompt-tokens", "300", "--batch", "2", "--k-mode", "token", "--group-size", "32", "--dtype", "fp16")
    rows = _rows(out)
    assert not any(k.startswith("16-bit") for k in rows)
    assert any(k.startswith("bitdecode 4-bit (K per token, G=32") for k in rows)
    assert any(k.startswith("bitdecode 2-bit (K per token, G=32") for k in rows)
    assert "batch 2" in out and "fp16" in out and "16-bit K/V of 302 tokens" in out


def test_generate_k4v2_sinks_hadamard(capsys, monkeypatch):
    """The format options a user protects accuracy with reach the cache (and the table)."""
    out = _run(capsys, monkeypatch, "--max-new-tokens", "2", "--no-baseline", "--bits", "4", "--v-bits", "2",
               "--sinks", "4", "--hadamard", "--prompt-tokens", "40")
    assert any(k.startswith("bitdecode 4-bit (K per channel, G=64, V 2-bit, 4 sinks, Hadamard")
               for k in _rows(out)), out


def test_generate_fp4(capsys, monkeypatch):
    """--fp4 runs an FP4 cache (on the CPU the reference writes and decodes it)."""
    out = _run(capsys, monkeypatch, "--max-new-tokens", "2", "--no-baseline", "--fp4", "nvfp4", "--sinks", "4",
               "--prompt-tokens", "40")
    assert any(k.startswith("bitdecode NVFP4 (K per token, G=16, 4 sinks") for k in _rows(out)), out


def test_generate_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    for opt in ("--gguf-file", "--random-llama", "--bits", "--k-mode", "--group-size", "--max-new-tokens",
                "--prompt", "--device", "--dtype", "--backend", "--no-baseline", "never downloaded"):
        assert opt in out, opt


def test_help_lists_generate(capsys):
    main([])
    assert re.search(r"^\s+generate\s+\S", capsys.readouterr().out, re.M)


@pytest.mark.parametrize("args, message", [
    ([], "give a MODEL"),
    (["--random-llama", "tiny", "--gguf-file", "x.gguf"], "--random-llama builds its own model"),
    (["/nonexistent/model-dir"], "cannot load"),
    (["--gguf-file", "/nonexistent/model.gguf"], "no such file"),
    (["--random-llama", "tiny", "--backend", "sm80"], "runs CUDA kernels"),
    (["--random-llama", "tiny", "--group-size", "128"], "group_size"),
    (["--random-llama", "tiny", "--max-seqlen", "3000000000", "--no-baseline"],
     "the bitdecode cache would hold 3,000,000,000 tokens a sequence"),
    (["--random-llama", "tiny", "--prompt-tokens", "16", "--max-new-tokens", "8", "--sinks", "24", "--no-baseline"],
     "--sinks 24 keeps every token of the 24-token cache 16-bit"),
])
def test_generate_errors(args, message, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    assert main(["generate", "--device", "cpu", *args]) == 2
    assert message in capsys.readouterr().err


def test_bench_e2e_tiny_cpu(tmp_path):
    """profiles/bench_e2e.py's CPU smoke mode: every row recorded, the fit check skips the
    16-bit caches at the last point (as an H200 does at B=16 N=64K), JSON + targets written."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "profiles" / "bench_e2e.py"
    proc = subprocess.run([sys.executable, str(script), "--tiny", "--device", "cpu", "--configs", "dynamic,static,bd4,bd4-norms,bd4-fused,bd4-all",
                           "--steps", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads((tmp_path / "e2e.json").read_text())
    for key in ("command", "device_name", "torch", "transformers", "bandwidth", "model", "rows", "targets", "method"):
        assert key in res, key
    assert res["bandwidth"]["bytes_per_s"] > 0 and res["model"]["size"] == "tiny"
    rows = {(r["role"], r["config"], r["mode"]): r for r in res["rows"]}
    assert all(r["status"] == "ok" for (role, _, _), r in rows.items() if role != "b16_64k")
    assert rows[("b16_64k", "bd4", "eager")]["status"] == "ok"
    assert rows[("b16_64k", "dynamic", "eager")]["status"].startswith("skipped: needs")
    ok = [r for r in res["rows"] if r["status"] == "ok"]
    assert all(r["tokens_per_s"] > 0 and r["roofline_ms"] > 0 and r["kv_bytes"] > 0 for r in ok)
    assert all(r["step_ms_min"] <= r["step_ms_mean"] <= r["step_ms_max"] for r in ok)
    bd4 = rows[("b1_128k", "bd4", "eager")]
    assert bd4["kv_bytes"] < rows[("b1_128k", "static", "eager")]["kv_bytes"]
    targets = res["targets"]
    assert targets["meaningful"] is False and targets["b16_64k_served"]["pass"] is True
    assert "bd4_speedup" in targets["b1_128k_speedup>=1.5"]
    # the roofline divides by a read rate whose source is named; the speedups stand beside
    # what a 16-bit step at its own roofline would give
    bw = res["bandwidth"]
    assert bw["bytes_per_s"] == max(bw["sum_bytes_per_s"], bw["sdpa_bytes_per_s"]) and bw["bytes_per_s_source"]
    assert "copy_bytes_per_s" in bw and targets["b1_128k_speedup>=1.5"]["bd4_vs_16bit_roofline"] > 0
    assert rows[("b1_32k", "bd4-norms", "eager")]["status"] == "ok" and "b1_32k" in targets["bd4_graph_within_1.3x_roofline"]["ratios_bd4_norms"]
    assert rows[("b1_32k", "bd4-fused", "eager")]["status"] == "ok" and "b1_32k" in targets["bd4_graph_within_1.3x_roofline"]["ratios_bd4_fused"]
    assert rows[("b1_32k", "bd4-all", "eager")]["status"] == "ok" and "b1_32k" in targets["bd4_graph_within_1.3x_roofline"]["ratios_bd4_all"]


def _write_tiny_gguf(path):
    """A 2-layer random Llama GGUF (f32) with a byte-level BPE tokenizer, written with the
    gguf package (what transformers reads GGUF with)."""
    import numpy as np

    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    hidden, inter, layers, heads, kv, hd = 256, 512, 2, 4, 2, 64
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    symbols = [chr(b) if b in printable else chr(next(extra)) for b in range(256)]  # GPT-2's byte alphabet
    tokens = symbols + ["Ġt", "he", "Ġthe", "<|endoftext|>"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(2048)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_embedding_length(hidden)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(len(tokens) - 1)
    w.add_eos_token_id(len(tokens) - 1)

    def tensor(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    tensor("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        for name, shape in (("attn_norm", (hidden,)), ("attn_q", (heads * hd, hidden)), ("attn_k", (kv * hd, hidden)),
                            ("attn_v", (kv * hd, hidden)), ("attn_output", (hidden, heads * hd)),
                            ("ffn_norm", (hidden,)), ("ffn_gate", (inter, hidden)), ("ffn_up", (inter, hidden)),
                            ("ffn_down", (hidden, inter))):
            tensor(f"blk.{i}.{name}.weight", *shape)
    tensor("output_norm.weight", hidden)
    tensor("output.weight", len(tokens), hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_generate_gguf_file(tmp_path, capsys, monkeypatch):
    """--gguf-file: the model and its tokenizer come from one local GGUF file (as the
    offline SmolLM2-135M checkpoint does); the text is printed."""
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path)
    monkeypatch.setenv("COLUMNS", "220")
    code = main(["generate", "--gguf-file", str(path), "--device", "cpu", "--max-new-tokens", "3",
                 "--prompt", "the theme"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"{tmp_path} (tiny.gguf), llama" in out and "prompt: the theme" in out
    assert re.search(r"^bitdecode 4-bit: ", out, re.M) and "token ids" not in out
    assert any(k.startswith("bitdecode 4-bit (K per channel, G=64, reference)") for k in _rows(out))
    # MODEL and a file name: the file inside MODEL, not one of the same name here
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "tiny.gguf").write_text("not a GGUF file")
    monkeypatch.chdir(elsewhere)
    code = main(["generate", str(tmp_path), "--gguf-file", "tiny.gguf", "--device", "cpu", "--max-new-tokens", "2",
                 "--prompt", "the theme", "--no-baseline"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"{tmp_path} (tiny.gguf), llama" in out
    assert main(["generate", str(elsewhere / "none"), "--gguf-file", "tiny.gguf"]) == 2
    assert main(["generate", str(tmp_path), "--gguf-file", "other.gguf"]) == 2
    assert f"error: --gguf-file other.gguf: no such file in {tmp_path}\n" in capsys.readouterr().err


def test_generate_random_bitnet_runs_on_bitdecode_linears(capsys, monkeypatch):
    """--random-bitnet: a BitNet b1.58 model whose linears are bitdecode's W2A8 BitLinear
    (bd.bitnet.convert), generating with the packed KV cache beside the 16-bit one."""
    monkeypatch.setenv("COLUMNS", "220")
    code = main(["generate", "--random-bitnet", "tiny", "--device", "cpu", "--backend", "reference",
                 "--max-new-tokens", "3", "--prompt-tokens", "40"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "random-weight BitNet b1.58 (tiny), linears on bitdecode W2A8" in out
    assert re.search(r"^bitdecode 4-bit: token ids( \d+){3}$", out, re.M)


def test_generate_random_bitnet_refuses_a_second_model(capsys):
    assert main(["generate", "--random-bitnet", "tiny", "--random-llama", "tiny", "--device", "cpu"]) != 0
    assert "--random-bitnet builds its own model" in capsys.readouterr().err


def _random_int2_checkpoint(path, shape):
    """A model_state_int2.pt of microsoft/BitNet's layout for a --random-bitnet shape:
    random ternary weights packed in its int2 format, bf16 scales of four, norms and
    embeddings (the layout itself is checked in test_bitnet_model.py)."""
    import torch

    from bitdecode import bitnet
    from bitdecode.cli_generate import RANDOM_BITNET

    c = RANDOM_BITNET[shape]
    gen = torch.Generator().manual_seed(1)
    hd, h, kv, d, f = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"], \
        c["intermediate_size"]
    out = {}
    for i in range(c["num_hidden_layers"]):
        for name, (n, k, parts) in {"attention.wqkv": ((h + 2 * kv) * hd, d, 3), "attention.wo": (d, h * hd, 1),
                                    "feed_forward.w13": (2 * f, d, 2), "feed_forward.w2": (d, f, 1)}.items():
            t = torch.randint(-1, 2, (n, k), generator=gen, dtype=torch.int8)
            out[f"layers.{i}.{name}.weight"] = bitnet.pack_weight(t)
            out[f"layers.{i}.{name}.weight_scale"] = torch.tensor([0.02] * parts + [0.0] * (4 - parts),
                                                                  dtype=torch.bfloat16)
        for name, n in (("attention_norm", d), ("ffn_norm", d), ("attention.attn_sub_norm", d),
                        ("feed_forward.ffn_sub_norm", f)):
            out[f"layers.{i}.{name}.weight"] = torch.ones(n, dtype=torch.bfloat16)
    emb = torch.randn(c["vocab_size"], d, generator=gen).to(torch.bfloat16)
    out.update({"tok_embeddings.weight": emb, "output.weight": emb, "norm.weight": torch.ones(d, dtype=torch.bfloat16)})
    torch.save(out, path)


def test_generate_from_a_microsoft_int2_checkpoint(capsys, monkeypatch, tmp_path):
    """--bitnet-int2 FILE: microsoft/BitNet's converted checkpoint onto bitdecode's W2A8
    linears (bd.bitnet.load_int2_checkpoint) in the --random-bitnet shape; a file of
    another shape is refused naming the option."""
    monkeypatch.setenv("COLUMNS", "220")
    _random_int2_checkpoint(tmp_path / "model_state_int2.pt", "tiny")
    code = main(["generate", "--random-bitnet", "tiny", "--bitnet-int2", str(tmp_path / "model_state_int2.pt"),
                 "--device", "cpu", "--backend", "reference", "--max-new-tokens", "3", "--prompt-tokens", "40",
                 "--no-baseline"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "BitNet b1.58 (tiny) from microsoft/BitNet's model_state_int2.pt, linears on bitdecode W2A8" in out
    assert re.search(r"^bitdecode 4-bit: token ids( \d+){3}$", out, re.M)
    assert main(["generate", "--bitnet-int2", str(tmp_path / "missing.pt"), "--device", "cpu"]) != 0
    assert "--bitnet-int2" in (msg := capsys.readouterr().err) and "no such file" in msg
    for name, data in (("empty.pt", b""), ("text.pt", b"not a checkpoint\n")):  # refused by name, no traceback
        (tmp_path / name).write_bytes(data)
        assert main(["generate", "--random-bitnet", "tiny", "--bitnet-int2", str(tmp_path / name), "--device",
                     "cpu", "--no-baseline"]) == 2
        assert f"--bitnet-int2 {tmp_path / name}: state: cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--seed", str(2**64)], "argument --seed: must be an integer >= 0 and at most 9223372036854775807"),
    (["--seed", "-1"], "argument --seed: must be an integer >= 0 and at most 9223372036854775807"),
    (["--batch", str(10**20)], "argument --batch: must be a positive integer of at most 9223372036854775807"),
])
def test_generate_refuses_integers_torch_cannot_take(args, message, capsys):
    """Integers past int64 are refused naming the option (they overflowed inside torch)."""
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--random-llama", "tiny", "--device", "cpu", *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_generate_max_seqlen_bounds(capsys, monkeypatch):
    """--max-seqlen must hold the prompt plus --max-new-tokens (one token less is refused,
    exactly that many runs) and at most ``cache.MAX_SEQLEN`` tokens (one more is refused by
    name before any generation, not by the cache's allocation)."""
    base = ["--no-baseline", "--prompt-tokens", "16", "--max-new-tokens", "2"]
    monkeypatch.setenv("COLUMNS", "300")
    assert main(["generate", "--random-llama", "tiny", "--device", "cpu", *base, "--max-seqlen", "17"]) == 2
    assert "--max-seqlen 17 is less than the prompt (16) plus --max-new-tokens (2)" in capsys.readouterr().err
    assert "bitdecode capacity 18 tokens" in _run(capsys, monkeypatch, *base, "--max-seqlen", "18")
    assert main(["generate", "--random-llama", "tiny", "--device", "cpu", *base,
                 "--max-seqlen", str(MAX_SEQLEN + 1)]) == 2
    assert f"the bitdecode cache would hold {MAX_SEQLEN + 1:,} tokens a sequence" in capsys.readouterr().err


def test_generate_refuses_a_prompt_too_long_before_drawing_it(capsys, monkeypatch):
    """A random prompt longer than the cache can hold is refused by name before its ids are
    drawn (3e9 tokens: 24 GB of int64 never allocated); a prompt that does not fit in memory
    is one line and exit 2, not the allocator's traceback."""
    argv = ["generate", "--random-llama", "tiny", "--device", "cpu", "--no-baseline", "--max-new-tokens", "2"]
    real_randint = torch.randint
    monkeypatch.setattr(torch, "randint", lambda *a, **k: pytest.fail("drew the prompt"))
    assert main([*argv, "--prompt-tokens", "3000000000"]) == 2
    assert "the bitdecode cache would hold 3,000,000,002 tokens a sequence" in capsys.readouterr().err

    def no_memory(low, high, size, **kw):
        if size[1] > 64:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")
        return real_randint(low, high, size, **kw)

    monkeypatch.setattr(torch, "randint", no_memory)
    assert main([*argv, "--prompt-tokens", "100", "--batch", "2"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--batch 2 prompts of 100 tokens do not fit in memory (" in err and "Traceback" not in err


def test_generate_hands_seed_and_batch_on(capsys, monkeypatch):
    """--seed seeds both the random weights and the random prompt ids (the same seed, the
    same prompt), and --batch generates that many copies of the prompt together."""
    from bitdecode import cli_generate

    seeds, prompts = [], []
    real_llama, real_generate = cli_generate.random_llama, cli_generate.generate

    def random_llama(size, device, dtype, attn_implementation="sdpa", seed=0, **kw):
        seeds.append(seed)
        return real_llama(size, device, dtype, attn_implementation, seed, **kw)

    def generate(model, ids, cache, max_new_tokens, pad_token_id):
        prompts.append(ids.clone())
        return real_generate(model, ids, cache, max_new_tokens, pad_token_id)

    monkeypatch.setattr(cli_generate, "random_llama", random_llama)
    monkeypatch.setattr(cli_generate, "generate", generate)
    for seed, batch in (("5", "3"), ("6", "1"), ("5", "1")):
        _run(capsys, monkeypatch, "--no-baseline", "--max-new-tokens", "1", "--prompt-tokens", "24", "--seed", seed,
             "--batch", batch)
    assert seeds == [5, 6, 5]
    assert prompts[0].shape == (3, 24) and bool((prompts[0] == prompts[0][:1]).all())
    assert torch.equal(prompts[0][:1], prompts[2]) and not torch.equal(prompts[1], prompts[2])
