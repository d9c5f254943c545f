"""Command line: ``jaxkv "prompt"`` / ``python -m jaxkv --file prompt.txt``.

Loads SmolLM2-135M-Instruct from its GGUF package, or ``--model PATH``: a GGUF file (llama or
qwen2 architecture), a Hugging Face checkpoint directory (config.json, safetensors,
tokenizer.json), a cached hub repo id, or an installed asset name (``qwen2.5-coder-0.5b``).
Generates with the host tier by default and prints the text, tokens/s and the cache counters.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_PROMPT = "The capital of France is Paris. The capital of Germany is"


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxkv", description="Generate text with a host-tier sparse KV cache (JAX/Pallas).")
    p.add_argument("prompt", nargs="?", help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--file", type=Path, help="read the prompt from a file")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="PATH",
                     help="GGUF file, Hugging Face checkpoint directory, cached hub repo id or "
                          "asset name (default: SmolLM2-135M-Instruct)")
    src.add_argument("--gguf", type=Path, help="a GGUF file (the same as --model for a GGUF file)")
    p.add_argument("--mode", choices=["host", "resident"], default="host")
    p.add_argument("--selector", choices=["quest", "indexer", "dense"], default="quest")
    p.add_argument("--max-new-tokens", type=_positive_int, default=48)
    p.add_argument("--budget", type=_positive_int, default=None,
                   help="selected tokens per step, layer and KV head (rounded to pages)")
    p.add_argument("--page-size", type=_positive_int, default=16, help="tokens per page (a power of two)")
    p.add_argument("--pool-pages", type=_positive_int, default=None,
                   help="device pool slots per layer (host mode)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=_int_at_least(0), default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=_int_at_least(0), default=0, help="any int >= 0")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="weights and activations (default: float32 for GGUF, the checkpoint's own "
                        "dtype for Hugging Face checkpoints)")
    p.add_argument("--schedule", choices=["step", "scratch", "layer"], default=None,
                   help="host-mode residency schedule (default: step, which never drops a page; "
                        "layer with --strict)")
    p.add_argument("--strict", action="store_true",
                   help="fail (exit 1, after printing the text) if any selected page was dropped "
                        "or a request was cut at the context capacity; selects the per-layer "
                        "schedule, which drops what the pool cannot hold, unless --schedule is given")
    p.add_argument("--json", action="store_true", help="print the stats as JSON")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import jaxkv
    from jaxkv import models
    from jaxkv.validation import StrictModeError

    if args.file is not None:
        if not args.file.is_file():
            why = "is a directory, not a file" if args.file.is_dir() else "does not exist"
            print(f"error: prompt file {args.file} {why}", file=sys.stderr)
            return 2
        try:
            text = args.file.read_text()
        except (OSError, UnicodeDecodeError) as e:
            print(f"error: cannot read prompt file {args.file} as UTF-8 text ({e})", file=sys.stderr)
            return 2
    else:
        text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    if not text.strip():
        print("error: the prompt is empty", file=sys.stderr)
        return 2
    # settings first: a bad option fails before the model is loaded
    budget = args.budget if args.budget is not None else 4 * args.page_size * 4
    # --strict checks for dropped pages: only the per-layer schedule drops any
    schedule = args.schedule or ("layer" if args.strict else "step")
    try:
        cache = jaxkv.CacheConfig(
            mode=args.mode, selector=args.selector, page_size=args.page_size,
            selected_pages=max(2, -(-budget // args.page_size)), pool_pages=args.pool_pages,
            strict=args.strict, schedule=schedule,
            prefill_chunk=max(jaxkv.CacheConfig.prefill_chunk, args.page_size))
        sampling = jaxkv.Sampling.make(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if args.gguf is not None:
            from jaxkv.models import gguf_loader
            from jaxkv.models.tokenizer import Tokenizer
            cfg, params = gguf_loader.load_gguf(args.gguf, dtype=args.dtype or "float32")
            tok = Tokenizer.from_gguf(args.gguf)
        else:
            cfg, params, tok = models.load(args.model, dtype=args.dtype)
        if args.chat:
            ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                          add_generation_prompt=True, tokenize=True)
        else:
            ids = tok.encode(text)
    except (FileNotFoundError, ValueError, TypeError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        res = jaxkv.generate(cfg, params, [ids], max_new_tokens=args.max_new_tokens,
                             sampling=sampling, cache=cache, stop_tokens=tok.stop_ids,
                             seed=args.seed)
    except StrictModeError as e:  # the text is printed, then the failure
        _print_text(args, text, tok, e.result)
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    _print_text(args, text, tok, res)
    s = res.stats
    if args.json:
        print(json.dumps(s, indent=1, default=float))
    else:
        print(f"\n--- {cfg.name}, {s['mode']} mode, {s['selector']} selector, "
              f"{s['selected_pages']} pages x {s['page_size']} tokens selected per KV head")
        print(f"prompt {s['prompt_tokens']} tokens, prefill {s['prefill_time_s']:.2f} s; "
              f"{s['generated_tokens']} new tokens, decode {s['decode_tokens_per_s']:.1f} tokens/s "
              f"(compile {s['compile_time_s']:.1f} s, {s['num_compilations']} compilations)")
        print(f"cache: hit rate {s['hit_rate']:.3f} (hits {s['hits']}, misses {s['misses']}), "
              f"evictions {s['evictions']}, dropped {s['dropped']}, "
              f"host->device {s['bytes_host_to_device'] / 2**20:.2f} MiB, "
              f"device->host {s['bytes_device_to_host'] / 2**20:.2f} MiB")
        print(f"memory: device KV {s['device_kv_bytes'] / 2**20:.1f} MiB, "
              f"host KV {s['host_kv_bytes'] / 2**20:.1f} MiB")
    return 0


def _print_text(args, text: str, tok, res) -> None:
    out = tok.decode(res.tokens[0], skip_special_tokens=True)
    print(text + out if not args.chat else out)


if __name__ == "__main__":
    sys.exit(main())
