"""``bitdecode generate``: a Hugging Face causal LM generating with the bitdecode KV cache.

Loads a transformers causal LM (a local folder, or a Hugging Face id already in the local
cache: nothing is downloaded; --gguf-file for a GGUF checkpoint, which needs the gguf
package; --random-llama SIZE for random weights of a named Llama shape, no files at all),
generates greedily from --prompt with a BitDecodingCache (attn_implementation
"bitdecode") and prints the generated text (token ids without a tokenizer), the decode
speed and the KV-cache memory.  Unless --no-baseline, the same generation first runs with
transformers' default 16-bit cache (DynamicCache, SDPA) on the same weights, for the
speed, the memory and how many generated tokens agree.

Speed: decode tokens/s counts the generated tokens after the first (batch included)
over the time between the first and the last generation step, each step synchronized
(the prefill is timed apart).  KV memory: bitdecode counts all its storage (packed K/V,
(scale, zero) params, the 16-bit residual block, lengths, block table) preallocated
for --max-seqlen tokens; the 16-bit cache counts its K/V tensors at the end.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import List, Optional

import torch

from . import dispatch
from .cli import DTYPE_NAMES, nonnegative_int, out_of_memory, positive_int, print_error, torch_dtype
from .formats import FP4_FORMATS, GROUP_SIZES, K_MODES, model_head_dim


# Llama shapes for --random-llama (and profiles/bench_e2e.py): LlamaConfig keyword arguments
RANDOM_LLAMA = {
    # a few MB: CPU tests and smoke runs
    "tiny": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False),
    # Llama-3.2-1B
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    # Llama-3.1-8B
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
# BitNet b1.58 shapes for --random-bitnet: BitNetConfig keyword arguments (the linears are
# converted to bitdecode's W2A8 BitLinear, bd.bitnet.convert)
RANDOM_BITNET = {
    "tiny": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    # BitNet b1.58 2B (microsoft/bitnet-b1.58-2B-4T's shape)
    "2b": dict(vocab_size=128256, hidden_size=2560, intermediate_size=6912, num_hidden_layers=30,
               num_attention_heads=20, num_key_value_heads=5, head_dim=128),
}
_LLAMA_COMMON = dict(max_position_embeddings=262144, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                     rms_norm_eps=1e-5,
                     bos_token_id=None, eos_token_id=None, pad_token_id=None)


def add_model_arguments(p: argparse.ArgumentParser, random_note: str):
    """The model-source options of the model-running subcommands (``generate``, ``eval``):
    MODEL, --gguf-file, --random-llama; returns their group for more."""
    src = p.add_argument_group("model (one of)")
    src.add_argument("model", nargs="?", default=None,
                     help="a local model folder or a Hugging Face id in the local cache (never downloaded)")
    src.add_argument("--gguf-file", default=None, metavar="FILE",
                     help="load this GGUF checkpoint (a file name inside MODEL, or a path; needs the gguf package)")
    src.add_argument("--random-llama", choices=tuple(RANDOM_LLAMA), default=None, metavar="SIZE",
                     help=f"random weights of a Llama shape ({', '.join(RANDOM_LLAMA)}: tiny = 2 layers, "
                          f"1b = Llama-3.2-1B, 8b = Llama-3.1-8B); {random_note}")
    return src


def add_parser(subparsers, name: str, help_text: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(name, help=help_text, description=__doc__.split("\n\n", 1)[1].replace("``", ""),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    src = add_model_arguments(p, "no tokenizer, the prompt is random token ids")
    src.add_argument("--random-bitnet", choices=tuple(RANDOM_BITNET), default=None, metavar="SIZE",
                     help=f"random ternary weights of a BitNet b1.58 shape ({', '.join(RANDOM_BITNET)}), its "
                          "linear layers on bitdecode's W2A8 kernels (a BitNet checkpoint given as MODEL is "
                          "converted the same way)")
    src.add_argument("--bitnet-int2", default=None, metavar="FILE",
                     help="microsoft/BitNet's converted checkpoint (gpu/convert_checkpoint.py's "
                          "model_state_int2.pt) loaded onto bitdecode's W2A8 linears, in the --random-bitnet "
                          "shape (default 2b, the checkpoint's); no tokenizer")
    gen = p.add_argument_group("generation")
    gen.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog. " * 4 +
                     "Once upon a time, in a small village by the sea,",
                     help="the prompt (with a tokenizer)")
    gen.add_argument("--prompt-tokens", type=positive_int, default=512,
                     help="prompt length in random token ids when there is no tokenizer (default: 512)")
    gen.add_argument("--batch", type=positive_int, default=1, help="copies of the prompt generated together (default: 1)")
    gen.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens to generate (default: 32)")
    gen.add_argument("--max-seqlen", type=positive_int, default=None,
                     help="bitdecode cache capacity per sequence (default: prompt + max new tokens)")
    gen.add_argument("--no-baseline", action="store_true",
                     help="skip the run with transformers' default 16-bit cache")
    gen.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the random weights / prompt (default: 0)")
    gen.add_argument("--fuse", action="store_true",
                     help="run the model's RMSNorms (with the residual adds of Llama-family layers), rotary "
                          "embedding and projections on bitdecode's kernels (bitdecode.hf.fuse_norms / fuse_rope / "
                          "fuse_projections), for every row: fewer kernels per decode step, outputs equal up to "
                          "rounding order")
    fmt = p.add_argument_group("KV format and where it runs")
    fmt.add_argument("--bits", type=int, nargs="+", choices=(4, 2), default=[4],
                     help="bit widths to run, one generation each (default: 4)")
    fmt.add_argument("--k-mode", choices=K_MODES, default="channel",
                     help="K groups: per channel over tokens (KIVI) or per token over channels (default: channel)")
    fmt.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=None,
                     help="values per (scale, zero) pair (default: 128, or the head dim when smaller)")
    fmt.add_argument("--v-bits", type=int, choices=(4, 2), default=None,
                     help="V's own width (default: as K); --bits 4 --v-bits 2 is K4V2")
    fmt.add_argument("--sinks", type=nonnegative_int, default=0,
                     help="first tokens of each sequence kept 16-bit (attention sinks; default: 0)")
    fmt.add_argument("--hadamard", action="store_true",
                     help="store K and rotate Q by the head dim's Hadamard matrix (what 2-bit K needs)")
    fmt.add_argument("--fp4", choices=FP4_FORMATS, default=None,
                     help="an FP4 cache instead of integer codes (e2m1 + block scales; --bits, --k-mode, "
                          "--group-size and --v-bits do not apply; --sinks and --hadamard do)")
    fmt.add_argument("--device", choices=("cpu", "cuda"), default=None,
                     help="where to run (default: cuda when available, else cpu)")
    fmt.add_argument("--dtype", choices=DTYPE_NAMES, default="bf16", help="model and cache dtype (default: bf16)")
    fmt.add_argument("--backend", choices=dispatch.BACKENDS, default="auto",
                     help="auto (default): the compiled kernels on a GPU, the torch reference on the CPU")
    return p


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------


def llama_config(size: str, **overrides):
    """The ``LlamaConfig`` of a ``RANDOM_LLAMA`` shape."""
    import transformers

    return transformers.LlamaConfig(**{**_LLAMA_COMMON, **RANDOM_LLAMA[size], **overrides})


def random_llama(size: str, device, dtype: torch.dtype, attn_implementation: str = "sdpa", seed: int = 0,
                 **overrides):
    """A ``LlamaForCausalLM`` of shape ``size`` (``LlamaConfig`` fields in ``overrides``
    change it) with random weights, built directly on ``device`` in ``dtype`` (no fp32
    copy, no CPU copy of a GPU model), in eval mode."""
    import transformers

    torch.manual_seed(seed)
    config = llama_config(size, **overrides)
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation,
                                                            dtype=dtype)
    return model.eval()


def looks_like_path(name: str) -> bool:
    """Whether MODEL can only be a folder, never a Hugging Face id (``owner/name``, at most
    one ``/``, no leading ``.``): it starts with ``/``, ``.`` or ``~``, or has a backslash
    or more than one ``/``."""
    return name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1 or Path(name).is_absolute()


def load_model(args, device: torch.device, dtype: torch.dtype):
    """(model on ``device`` with the bitdecode attention, tokenizer or None, description)."""
    import transformers

    from . import bitnet, hf

    int2 = getattr(args, "bitnet_int2", None)
    if args.random_bitnet or int2:
        flag = "--bitnet-int2" if int2 else "--random-bitnet"
        if args.model or args.gguf_file or args.random_llama:
            raise ValueError(f"{flag} builds its own model: give no MODEL, --gguf-file or --random-llama")
        if int2 and not Path(int2).is_file():
            raise ValueError(f"--bitnet-int2 {int2}: no such file")
        shape = args.random_bitnet or "2b"
        torch.manual_seed(args.seed)
        config = transformers.BitNetConfig(**RANDOM_BITNET[shape])
        with torch.device(device):
            model = transformers.BitNetForCausalLM._from_config(config, attn_implementation=hf.ATTN_IMPLEMENTATION,
                                                                dtype=dtype)
        if int2:
            try:
                bitnet.load_int2_checkpoint(model.eval(), int2, backend=args.backend)
            except (ValueError, TypeError, RuntimeError) as exc:
                raise ValueError(f"--bitnet-int2 {int2}: {exc}") from exc
            what = f"BitNet b1.58 ({shape}) from microsoft/BitNet's {Path(int2).name}"
        else:
            bitnet.convert(model.eval(), backend=args.backend)
            what = f"random-weight BitNet b1.58 ({shape})"
        n = sum(p.numel() for p in model.parameters())
        return model, None, f"{what}, linears on bitdecode W2A8, {n / 1e6:,.1f} M float parameters left (embeddings, norms)"
    if args.random_llama:
        if args.model or args.gguf_file:
            raise ValueError("--random-llama builds its own model: give no MODEL and no --gguf-file")
        model = random_llama(args.random_llama, device, dtype, hf.ATTN_IMPLEMENTATION, args.seed)
        n = sum(p.numel() for p in model.parameters())
        return model, None, f"random-weight Llama ({args.random_llama}, {n / 1e6:,.1f} M parameters)"
    name, gguf = args.model or None, args.gguf_file
    if name is None and gguf is None:
        raise ValueError("give a MODEL (folder or cached Hugging Face id), --gguf-file FILE, --random-llama SIZE, "
                         "--random-bitnet SIZE or --bitnet-int2 FILE")
    folder = None
    if name is not None and looks_like_path(name):
        folder = Path(name).expanduser()
        if not folder.is_dir():
            raise ValueError(f"cannot load {name!r}: no such folder" if not folder.exists() else
                             f"cannot load {name!r}: not a folder (a GGUF file goes to --gguf-file)")
        name = str(folder)
    # the GGUF file: a path (absolute, or without MODEL from here), else a name inside the
    # MODEL folder (never a same-named file here), else a file of the hub model MODEL
    if gguf is not None and (name is None or folder is not None or Path(gguf).is_absolute()):
        path = Path(gguf).expanduser()
        if folder is not None and not path.is_absolute():
            path = folder / path
        if not path.is_file():
            raise ValueError(f"--gguf-file {gguf}: no such file" + (f" in {name}" if folder is not None else ""))
        name, gguf = str(path.resolve().parent), path.name
    kw = dict(local_files_only=True)
    if gguf is not None:
        # a local file by its absolute path: transformers tries a relative name here first
        kw["gguf_file"] = str(Path(name, gguf)) if Path(name).is_dir() else gguf
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            name, dtype=dtype, attn_implementation=hf.ATTN_IMPLEMENTATION, **kw)
    except Exception as exc:  # noqa: BLE001 - missing files, no gguf package, an unsupported checkpoint
        why = " ".join(str(exc).split())  # (one line: transformers' messages span several)
        raise ValueError(f"cannot load {name!r}{f' ({gguf})' if gguf else ''} offline: {why}") from exc
    model = model.to(device).eval()
    if getattr(model.config, "model_type", None) == "bitnet":  # ternary linears onto the W2A8 kernels
        bitnet.convert(model, backend=args.backend)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(name, **kw)
    except Exception:  # noqa: BLE001 - a model without a usable tokenizer still generates ids
        tokenizer = None
    what = f"{name}" + (f" ({gguf})" if gguf else "")
    n = sum(p.numel() for p in model.parameters())
    return model, tokenizer, f"{what}, {model.config.model_type}, {n / 1e6:,.1f} M parameters"


# --------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------


class StepClock:
    """A logits processor that notes the (synchronized) time of every generation step:
    the first is the prefill, each later one a decode step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: List[float] = []

    def __call__(self, input_ids, scores):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        return scores


def generate(model, ids: torch.Tensor, cache, max_new_tokens: int, pad_token_id: Optional[int]):
    """Greedy generation; (new tokens [B, T], prefill seconds, decode tokens/s, the cache)."""
    import transformers

    from .hf import cache_kwargs

    clock = StepClock(ids.device)
    kw = {} if cache is None else cache_kwargs(model, cache)
    if ids.device.type == "cuda":
        torch.cuda.synchronize(ids.device)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         logits_processor=transformers.LogitsProcessorList([clock]), pad_token_id=pad_token_id,
                         return_dict_in_generate=True, use_cache=True, **kw)
    t = clock.times
    new = out.sequences[:, ids.shape[1]:]
    rate = ids.shape[0] * (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 else float("nan")
    return new, t[0] - t0, rate, getattr(out, "past_key_values", None) or getattr(out, "cache", None) or cache


def mib(n: float) -> str:
    """Bytes as MiB for the tables of ``generate`` and ``eval``."""
    return f"{n / 2**20:,.2f} MiB"


def _agreement(a: torch.Tensor, b: torch.Tensor) -> str:
    n = min(a.shape[1], b.shape[1])
    if n == 0:
        return "-"
    same = (a[:, :n] == b[:, :n])
    frac = same.float().mean().item()
    diverge = [int((~row).nonzero()[0]) if not row.all() else None for row in same]
    first = "none" if all(d is None for d in diverge) else str(min(d for d in diverge if d is not None))
    return f"{frac:.0%} (first divergence: {first})"


def prepare_run(args, command: str):
    """(device, backend) of a model-running subcommand (``generate``, ``eval``), with
    transformers imported and quiet; None after printing the error."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print_error("--device cuda, but no CUDA GPU is available (use --device cpu)")
        return None
    try:
        backend = dispatch.resolve(args.backend, device, what="KV cache")
    except ValueError as exc:
        print_error(str(exc))
        return None
    try:
        import transformers
    except ImportError:
        print_error(f"bitdecode {command} needs transformers: pip install -e \".[hf]\"")
        return None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return device, backend


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    ready = prepare_run(args, "generate")
    if ready is None:
        return 2
    device, backend = ready

    from . import hf

    dtype = torch_dtype(args.dtype)
    t_load = time.perf_counter()
    try:
        model, tokenizer, what = load_model(args, device, dtype)
    except ValueError as exc:
        print_error(str(exc))
        return 2
    t_load = time.perf_counter() - t_load
    if not args.fuse:
        return _run_loaded(console, args, device, backend, model, tokenizer, what, t_load, None)
    # the cache-independent fusions, for every row (the 16-bit baseline too); fuse_rope patches
    # the modeling modules, so they are undone after.  A BitNet model's norms and linears are
    # bitdecode's already (bd.bitnet.convert): only its rotary embedding is left to fuse.
    kernels = "reference" if backend == "reference" else "auto"
    with hf.fused(model, projections=kernels, backend=kernels) as done:
        line = (f"{done['norms']} RMSNorms, the rotary embedding of {len(done['rope'])} modeling module(s), "
                f"{done['projection_groups']} projection groups merged")
        return _run_loaded(console, args, device, backend, model, tokenizer, what, t_load, line)


def _run_loaded(console, args, device, backend, model, tokenizer, what, t_load, fused) -> int:
    import bitdecode as bd
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    from . import hf
    from .cache import MAX_SEQLEN
    from .eval import cache_bytes

    dtype = torch_dtype(args.dtype)
    cfg = model.config
    head_dim = model_head_dim(cfg)
    group = args.group_size or min(128, head_dim)
    try:
        if args.fp4:
            fmts = [bd.KVFormat(fp4=args.fp4, sink_tokens=args.sinks, hadamard=args.hadamard)]
        else:
            fmts = [bd.KVFormat(bits=b, k_mode=args.k_mode, group_size=group, v_bits=args.v_bits,
                                sink_tokens=args.sinks, hadamard=args.hadamard) for b in args.bits]
        for f in fmts:
            f.check_head_dim(head_dim)
    except ValueError as exc:
        print_error(str(exc))
        return 2

    if tokenizer is not None:
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    else:  # (the random prompt is drawn after the length checks: a refused length allocates nothing)
        ids, pad = None, 0
    prompt_len = args.prompt_tokens if ids is None else ids.shape[1]
    max_seqlen = args.max_seqlen or prompt_len + args.max_new_tokens
    if max_seqlen < prompt_len + args.max_new_tokens:
        print_error(f"--max-seqlen {max_seqlen} is less than the prompt ({prompt_len}) plus "
                    f"--max-new-tokens ({args.max_new_tokens})")
        return 2
    if max_seqlen > MAX_SEQLEN:  # (refused here, not by the first layer's allocation after the baseline ran)
        print_error(f"the bitdecode cache would hold {max_seqlen:,} tokens a sequence (--max-seqlen, or "
                    f"the prompt plus --max-new-tokens); at most {MAX_SEQLEN:,}")
        return 2
    if args.sinks >= max_seqlen:  # every token would stay 16-bit: a packed cache only in name
        print_error(f"--sinks {args.sinks} keeps every token of the {max_seqlen:,}-token cache 16-bit "
                    f"(--max-seqlen, or the prompt plus --max-new-tokens); give fewer sinks")
        return 2
    try:
        if ids is None:
            ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(args.seed))
        ids = ids.expand(args.batch, -1).contiguous().to(device)
    except RuntimeError as exc:  # (torch.OutOfMemoryError is one; a CPU allocation fails as a RuntimeError)
        if not out_of_memory(exc):
            raise
        print_error(f"--batch {args.batch} prompts of {prompt_len:,} tokens do not fit in memory "
                    f"({' '.join(str(exc).split())[:160]})")
        return 2

    def show(tokens: torch.Tensor) -> str:
        if tokenizer is not None:
            return tokenizer.decode(tokens[0], skip_special_tokens=True)
        return "token ids " + " ".join(str(int(t)) for t in tokens[0])

    rows, texts = [], []
    base = None
    with torch.no_grad():
        if not args.no_baseline:
            hf.use_attention(model, "sdpa")
            new16, pre16, rate16, cache16 = generate(model, ids, None, args.max_new_tokens, pad)
            base = (new16, cache_bytes(cache16))
            del cache16
            rows.append(("16-bit (transformers DynamicCache, SDPA)", rate16, pre16, base[1], None))
            texts.append(("16-bit", show(new16)))
            hf.use_attention(model, hf.ATTN_IMPLEMENTATION)
        for fmt in fmts:
            cache = hf.BitDecodingCache(model, fmt, max_seqlen=max_seqlen, backend=backend)
            try:
                new, pre, rate, _ = generate(model, ids, cache, args.max_new_tokens, pad)
            except torch.OutOfMemoryError as exc:  # (a layer's cache, allocated at its first update)
                print_error(" ".join(str(exc).split()))
                return 1
            kv = cache.layers[0].kv
            used = kv.backend if kv is not None else backend
            extras = "".join([f", V {fmt.v_bits}-bit" if fmt.v_bits != fmt.bits else "",
                              f", {fmt.sink_tokens} sinks" if fmt.sink_tokens else "",
                              ", Hadamard" if fmt.hadamard else ""])
            rows.append((f"bitdecode {fmt.code_name} (K per {fmt.k_mode}, G={fmt.group_size}{extras}, {used})",
                         rate, pre, cache.memory_bytes(), new))
            texts.append((f"bitdecode {fmt.code_name}", show(new)))
            del cache

    # the 16-bit size of the same tokens, when no baseline ran
    tokens = prompt_len + args.max_new_tokens
    dense = base[1] if base is not None else (2 * cfg.num_hidden_layers * args.batch * cfg.num_key_value_heads *
                                              tokens * head_dim * torch.tensor([], dtype=dtype).element_size())
    setup = (f"{escape(what)}\n"
             f"device {device}, {args.dtype}, backend {backend}; batch {args.batch}, prompt {prompt_len:,} tokens"
             f"{'' if tokenizer is not None else ' (random ids)'}, {args.max_new_tokens} new tokens (greedy), "
             f"bitdecode capacity {max_seqlen:,} tokens; model loaded in {t_load:.1f} s"
             + (f"\nfused (--fuse): {fused}" if fused is not None else ""))
    console.print(Panel(setup, title="bitdecode generate", expand=False))
    if tokenizer is not None:
        console.print(f"[bold]prompt:[/] {escape(args.prompt)}")
    for label, text in texts:
        console.print(f"[bold]{label}:[/] {escape(text)}")

    table = Table(title="generation: bitdecode KV cache vs transformers' 16-bit cache", header_style="bold")
    for col, just in (("KV cache", "left"), ("decode tokens/s", "right"), ("prefill", "right"),
                      ("KV memory", "right"), ("vs 16-bit", "right"), ("tokens as 16-bit", "right")):
        table.add_column(col, justify=just, no_wrap=(col == "KV cache"))
    for label, rate, pre, nbytes, new in rows:
        agree = "-" if new is None or base is None else _agreement(new, base[0])
        table.add_row(label, f"{rate:,.1f}", f"{pre * 1e3:,.1f} ms", mib(nbytes), f"{nbytes / dense:.3f}x", agree)
    console.print(table)
    notes = ["decode tokens/s: generated tokens after the first (x batch) / time from the first to the last "
             "step, each step synchronized; prefill: time to the first step",
             f"KV memory: bitdecode preallocates {max_seqlen:,} tokens (packed K/V + params + the 16-bit "
             f"residual block of {', '.join(str(f.residual_block) for f in fmts)} tokens); "
             + ("16-bit: the DynamicCache's K/V at the end" if base is not None
                else f"vs 16-bit: against {mib(dense)}, 16-bit K/V of {tokens:,} tokens")]
    if base is not None:
        notes.append("tokens as 16-bit: share of generated tokens equal to the 16-bit run's")
    console.print("\n".join(f"[dim]{escape(n)}[/]" for n in notes))
    return 0
