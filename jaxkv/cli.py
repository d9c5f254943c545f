"""Command line: ``jaxkv "prompt"`` / ``python -m jaxkv --file prompt.txt``.

Loads SmolLM2-135M-Instruct from its GGUF package, or ``--model PATH``: a GGUF file (llama or
qwen2 architecture), a Hugging Face checkpoint directory (config.json, safetensors,
tokenizer.json), a cached hub repo id, or a model name (``smollm2-135m``, the default;
an installed asset's, ``qwen2.5-coder-0.5b``).
Generates with the host tier by default and prints the backend, the text, tokens/s and the
cache counters (``--json``: one JSON object only, with ``"error"`` when generation fails; a bad
option fails before the model loads, on stderr with exit status 2). JAX's persistent compilation cache is on
(``--compile-cache DIR``, ``--no-compile-cache`` or ``JAXKV_COMPILATION_CACHE=0``).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

DEFAULT_PROMPT = "The capital of France is Paris. The capital of Germany is"
DEFAULT_BUDGET = 1024  # tokens: CacheConfig's default, 64 pages of 16
SELECTORS = ("quest_rescore8", "quest", "indexer", "dense")  # --selector's choices


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {v}")
        return v
    parse.__name__ = f"int >= {minimum}"  # argparse names the type in its messages
    return parse


_positive_int = _int_at_least(1)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in --help, except where there is none to show (None, a flag's
    False) or the help text already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from jaxkv import __version__
    p = argparse.ArgumentParser(
        prog="jaxkv", description="Generate text with a host-tier sparse KV cache (JAX/Pallas).",
        formatter_class=_HelpFormatter)
    p.add_argument("--version", action="version", version=f"jaxkv {__version__}")
    p.add_argument("prompt", nargs="?", default=None, help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--file", type=Path, help="read the prompt from a file ('-': standard input)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="PATH",
                     help="GGUF file, Hugging Face checkpoint directory, cached hub repo id or "
                          "model name: smollm2-135m or an installed asset's, qwen2.5-coder-0.5b "
                          "(default: SmolLM2-135M-Instruct)")
    src.add_argument("--gguf", type=Path, help="a GGUF file (the same as --model for a GGUF file)")
    p.add_argument("--mode", choices=["host", "resident"], default="host",
                   help="host: KV cache in host RAM, device pool as LRU cache; resident: all on device")
    p.add_argument("--selector", choices=SELECTORS,
                   default="quest_rescore8",
                   help="which pages each step reads (quest_rescore8: Quest's candidates "
                        "re-ranked by attention mass from an int8 key copy, near-lossless on "
                        "RULER; quest: Quest alone, faster, lossy at small budgets; indexer: "
                        "models with indexer weights)")
    p.add_argument("--candidate-pages", type=_positive_int, default=None,
                   help="quest_rescore8: pages per KV head Quest hands to the re-ranking "
                        "(default: 8x the budget's pages, at least 8192 tokens' pages; 16x kept an "
                        "exact oracle's retrievals)")
    p.add_argument("--candidate-block", type=_positive_int, default=1,
                   help="quest_rescore8: Quest's first stage bounds and picks blocks of this "
                        "many pages (fewer bounds to read and rank, fewer retrievals kept); "
                        "default: 1, per page")
    p.add_argument("--candidate-pieces", type=_positive_int, default=None,
                   help="quest_rescore8: the first stage's top-k in this many strided pieces "
                        "of each row, the top candidates / pieces of each (one top-k program "
                        "per piece); default: pieces of 64 candidates (8 for 512); 1: the "
                        "row's top")
    p.add_argument("--max-new-tokens", type=_positive_int, default=48, help="tokens to generate")
    p.add_argument("--budget", type=_positive_int, default=DEFAULT_BUDGET,
                   help="selected tokens per step, layer and KV head (rounded to pages)")
    p.add_argument("--page-size", type=_positive_int, default=16, help="tokens per page (a power of two)")
    p.add_argument("--pool-pages", type=_positive_int, default=None,
                   help="device pool slots per layer (host mode; default: enough for a "
                        "step's worst-case working set, so no page is dropped)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=_int_at_least(0), default=0,
                   help="keep the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--seed", type=_int_at_least(0), default=0, help="sampling seed, any int >= 0")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="weights and activations (default: float32 for GGUF, the checkpoint's own "
                        "dtype for Hugging Face checkpoints)")
    p.add_argument("--kv-dtype", choices=["bfloat16", "float32", "int8", "float8_e4m3fn"],
                   default=None,
                   help="how the KV cache is stored (default: the model's dtype); int8 and "
                        "float8_e4m3fn halve bf16's host RAM and PCIe bytes, int8 the more "
                        "accurately (fp8 needs an H100/H200-class GPU)")
    p.add_argument("--schedule", choices=["step", "scratch", "layer"], default=None,
                   help="host-mode residency schedule (default: step, which never drops a page; "
                        "layer with --strict)")
    p.add_argument("--strict", action="store_true",
                   help="fail (exit 1, after printing the text) if any selected page was dropped "
                        "or a request was cut at the context capacity; selects the per-layer "
                        "schedule, which drops what the pool cannot hold, unless --schedule is given")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="a stop string (repeatable)")
    p.add_argument("--stream", action="store_true", help="print the text as it is decoded")
    p.add_argument("--json", action="store_true",
                   help="print only one JSON object (backend, text, finish reason, stats)")
    p.add_argument("--compile-cache", metavar="DIR", default=None,
                   help="JAX's persistent compilation cache directory (default: "
                        "$JAXKV_COMPILATION_CACHE or ~/.cache/jaxkv/xla)")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="compile without the persistent cache")
    return p


def _read_prompt(args) -> str:
    """The prompt text; raises ValueError naming the problem."""
    if args.file is None:
        return args.prompt if args.prompt is not None else DEFAULT_PROMPT
    if str(args.file) == "-":
        try:
            return sys.stdin.read()
        except UnicodeDecodeError as e:
            raise ValueError(f"cannot read standard input as UTF-8 text ({e})") from None
    if not args.file.is_file():
        why = "is a directory, not a file" if args.file.is_dir() else "does not exist"
        raise ValueError(f"prompt file {args.file} {why}")
    try:
        return args.file.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read prompt file {args.file} as UTF-8 text ({e})") from None


# CacheConfig's and Sampling's fields and generate's arguments as this command's options:
# their errors name the fields and arguments
_OPTION_OF_FIELD = {"mode": "--mode", "selector": "--selector", "page_size": "--page-size",
                    "selected_pages": "--budget", "pool_pages": "--pool-pages",
                    "candidate_pages": "--candidate-pages",
                    "candidate_block": "--candidate-block",
                    "candidate_pieces": "--candidate-pieces", "kv_dtype": "--kv-dtype",
                    "strict": "--strict", "schedule": "--schedule",
                    "max_new_tokens": "--max-new-tokens", "temperature": "--temperature",
                    "top_k": "--top-k", "top_p": "--top-p"}


def _with_option_names(e: Exception) -> str:
    """A CacheConfig, Sampling or generate error with the command-line options of the fields
    it names."""
    msg = str(e)
    named = [f"{field} is {opt}" for field, opt in _OPTION_OF_FIELD.items()
             if re.search(rf"\b{field}\b", msg)]
    return msg + (f" (here {', '.join(named)})" if named else "")


def _check_model_options(args):
    """Options the chosen model cannot serve fail here, before its weights load: the indexer
    selector needs indexer weights (GGUF files and the checkpoints read here have none), and
    --chat needs a chat template in the model's files."""
    if args.selector != "indexer" and not args.chat:
        return
    from jaxkv import models
    if args.gguf is not None:
        kind, path = "gguf", args.gguf
    else:
        kind, path = models.resolve_model(args.model)
    if args.selector == "indexer":
        heads = 0
        if kind == "hf":
            from jaxkv.models.hf_loader import load_config
            heads = load_config(path)[0].indexer_heads
        if not heads:
            raise ValueError(f"--selector indexer needs a model with lightning-indexer weights; "
                             f"{path} has none: use --selector quest or --selector dense")
    if args.chat:
        from jaxkv.models.tokenizer import Tokenizer
        tok = Tokenizer.from_gguf(path) if kind == "gguf" else Tokenizer.from_pretrained(path)
        why = tok.no_chat_template()
        if why:
            raise ValueError(f"--chat: {path}: {why}: drop --chat"
                             + (" and pass the prompt formatted with the template you want"
                                if tok.chat_template_names else ""))


def _print_json(backend, model, text, res, error=None) -> None:
    """--json: one JSON object on stdout (strict JSON: NaN as null); ``error`` with a failure
    (``res`` None, or --strict's result, which is still reported)."""
    from jaxkv import runtime
    obj = {"backend": backend, "model": model.config.name, "prompt": text}
    if res is not None:
        obj.update(text=res.text[0], finish_reason=res.finish_reasons[0], tokens=res.tokens[0],
                   stats=res.stats)
    if error is not None:
        obj["error"] = error
    print(json.dumps(runtime.json_safe(obj), indent=1, allow_nan=False))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import jaxkv
    from jaxkv.validation import StrictModeError

    def fail(msg, code=2):
        print(f"error: {msg}", file=sys.stderr)
        return code

    try:
        text = _read_prompt(args)
    except ValueError as e:
        return fail(e)
    if not text.strip():
        return fail("the prompt is empty")
    if args.json and args.stream:
        return fail("--json and --stream exclude each other: --json prints one JSON object")
    # settings first: a bad option fails before the model is loaded
    budget = args.budget
    # --strict checks for dropped pages: only the per-layer schedule drops any (host mode)
    schedule = args.schedule or ("layer" if args.strict and args.mode == "host" else "step")
    try:
        cache = jaxkv.CacheConfig(
            mode=args.mode, selector=args.selector, page_size=args.page_size,
            selected_pages=max(2, -(-budget // args.page_size)), pool_pages=args.pool_pages,
            candidate_pages=args.candidate_pages, candidate_block=args.candidate_block,
            candidate_pieces=args.candidate_pieces, kv_dtype=args.kv_dtype,
            strict=args.strict, schedule=schedule,
            prefill_chunk=max(jaxkv.CacheConfig.prefill_chunk, args.page_size))
    except (ValueError, TypeError) as e:
        return fail(_with_option_names(e))
    try:
        sampling = jaxkv.Sampling.make(args.temperature, args.top_k, args.top_p)
        if args.stop is not None and not all(args.stop):
            raise ValueError("--stop: a stop string must not be empty")
    except (ValueError, TypeError) as e:
        return fail(_with_option_names(e))
    from jaxkv import runtime
    runtime.enable_compilation_cache(False if args.no_compile_cache else args.compile_cache)
    runtime.warn_if_gpu_unused()
    backend = runtime.describe_backend()
    try:
        _check_model_options(args)
        if args.gguf is not None:
            from jaxkv.models import gguf_loader
            from jaxkv.models.tokenizer import Tokenizer
            cfg, params = gguf_loader.load_gguf(args.gguf, dtype=args.dtype or "float32")
            model = jaxkv.Model(cfg, params, Tokenizer.from_gguf(args.gguf), str(args.gguf))
        else:
            model = jaxkv.load(args.model, dtype=args.dtype, compile_cache=False)
        prompt = [{"role": "user", "content": text}] if args.chat else text
    except (FileNotFoundError, ValueError, TypeError, ImportError) as e:
        return fail(e)
    if not args.json:
        print(f"[jaxkv] backend {backend}; model {model.config.name}", file=sys.stderr)
    try:
        kw = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, cache=cache,
                  seed=args.seed, stop_strings=args.stop)
        if args.stream:
            if not args.chat:
                print(text, end="", flush=True)
            st = jaxkv.generate(model, [prompt], stream=True, **kw)
            for piece in st.text():
                print(piece, end="", flush=True)
            print()
            res = st.result
        else:
            res = jaxkv.generate(model, [prompt], **kw)
    except StrictModeError as e:  # the text is printed, then the failure
        if args.json:  # the one JSON object, with the error
            _print_json(backend, model, text, e.result, error=str(e))
        elif not args.stream:
            print(text + e.result.text[0] if not args.chat else e.result.text[0])
        return fail(e, 1)
    except (ValueError, TypeError, RuntimeError) as e:
        msg = _with_option_names(e)
        if args.json:
            _print_json(backend, model, text, None, error=msg)
        return fail(msg, 1)
    out = res.text[0]
    s = res.stats
    if args.json:
        _print_json(backend, model, text, res)
        return 0
    if not args.stream:
        print(text + out if not args.chat else out)
    cfg = model.config
    clamp = (f" (all of the context's pages; --budget {args.budget} asks for more)"
             if s["selected_pages"] * s["page_size"] < args.budget else "")
    print(f"\n--- {cfg.name} on {backend}, {s['mode']} mode, {s['selector']} selector, "
          f"{s['selected_pages']} pages x {s['page_size']} tokens selected per KV head{clamp}; "
          f"finished: {res.finish_reasons[0]}")
    print(f"prompt {s['prompt_tokens']} tokens, prefill {s['prefill_time_s']:.2f} s; "
          f"{s['generated_tokens']} new tokens, decode {s['decode_tokens_per_s']:.1f} tokens/s "
          f"(compile {s['compile_time_s']:.1f} s, {s['num_compilations']} compilations)")
    if s["mode"] == "resident":  # no host tier: no lookups (a hit rate of nan) and no copies
        print("cache: resident, every page on the device (no lookups, nothing moved to or "
              "from the host)")
    else:
        print(f"cache: hit rate {s['hit_rate']:.3f} (hits {s['hits']}, misses {s['misses']}), "
              f"evictions {s['evictions']}, dropped {s['dropped']}, "
              f"host->device {s['bytes_host_to_device'] / 2**20:.2f} MiB, "
              f"device->host {s['bytes_device_to_host'] / 2**20:.2f} MiB")
    print(f"memory: device KV {s['device_kv_bytes'] / 2**20:.1f} MiB, "
          f"host KV {s['host_kv_bytes'] / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
