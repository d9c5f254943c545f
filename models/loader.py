"""``load(path)``: a model and its tokenizer from a GGUF file, a Hugging Face checkpoint
directory (or hub cache entry / cached repo id), or the name of an installed asset."""
from __future__ import annotations

import os
from pathlib import Path


def _is_gguf(p: Path) -> bool:
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def resolve_model(path: str | os.PathLike | None) -> tuple[str, Path]:
    """``("gguf", file)`` or ``("hf", checkpoint dir)`` for what ``path`` names: None (the
    packaged SmolLM2-135M GGUF), a GGUF file, a checkpoint directory (or its config.json), a
    hub cache entry or cached repo id, or an asset name ("qwen2.5-coder-0.5b", see
    ``jaxkv.models.assets``). Raises FileNotFoundError / ValueError naming the fix."""
    from . import assets
    from .gguf_loader import default_model_path
    from .hf_loader import resolve_checkpoint

    if path is None:
        return "gguf", default_model_path()
    p = Path(path).expanduser()
    if not p.exists() and str(path) in assets.ASSETS:
        return "gguf", assets.asset_path(str(path))
    if p.is_file():
        if p.name == "config.json":
            return "hf", p.parent
        if _is_gguf(p):
            return "gguf", p
        raise ValueError(f"{p} is neither a GGUF file nor a checkpoint's config.json: pass a GGUF "
                         "file or a Hugging Face checkpoint directory (config.json, safetensors, "
                         "tokenizer.json)")
    try:
        return "hf", resolve_checkpoint(p if p.exists() else str(path))
    except FileNotFoundError as e:
        if p.exists():
            raise
        raise FileNotFoundError(f"model not found: {path} (expected a GGUF file, a Hugging Face "
                                f"checkpoint directory, a cached repo id or one of "
                                f"{sorted(assets.ASSETS)}); {e}") from None


def load(path: str | os.PathLike | None = None, *, dtype: str | None = None, device=None):
    """Loads a model and its tokenizer: ``(ModelConfig, params, Tokenizer)``.

    ``path``: see :func:`resolve_model`. ``dtype``: "float32", "bfloat16" or None (GGUF:
    float32; checkpoints: their stored dtype, bf16 staying bf16). ``device``: where a
    checkpoint's weights go (default device when None; GGUF weights always go to the default
    device). The tokenizer and chat template come from the model's own files.
    """
    from .gguf_loader import load_gguf
    from .hf_loader import load_hf
    from .tokenizer import Tokenizer

    kind, p = resolve_model(path)
    if kind == "gguf":
        cfg, params = load_gguf(p, dtype="float32" if dtype is None else dtype)
        tok = Tokenizer.from_gguf(p)
    else:
        cfg, params = load_hf(p, dtype=dtype, device=device)
        tok = Tokenizer.from_pretrained(p)
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"{p}: the tokenizer has {tok.vocab_size} tokens, the model's embedding "
                         f"only {cfg.vocab_size}: the files belong to different models")
    return cfg, params, tok
