"""``load(path)``: a model and its tokenizer from a GGUF file, a Hugging Face checkpoint
directory (or hub cache entry / cached repo id), or the name of an installed asset."""
from __future__ import annotations

import os
import warnings
from pathlib import Path


def _is_gguf(p: Path) -> bool:
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def resolve_model(path: str | os.PathLike | None) -> tuple[str, Path]:
    """``("gguf", file)`` or ``("hf", checkpoint dir)`` for what ``path`` names: None (the
    packaged SmolLM2-135M GGUF), a GGUF file, a checkpoint directory (or its config.json), a
    hub cache entry or cached repo id, or a model name: "smollm2-135m" (the packaged
    default, as None) or an asset's ("qwen2.5-coder-0.5b", see ``jaxkv.models.assets``).
    Raises FileNotFoundError / ValueError naming the fix."""
    from . import assets
    from .gguf_loader import DEFAULT_MODEL_NAME, default_model_path
    from .hf_loader import resolve_checkpoint

    if path is None:
        return "gguf", default_model_path()
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike (a GGUF file, a checkpoint directory, "
                        f"a cached repo id or an asset name) or None, got {type(path).__name__}")
    if not str(path).strip():
        raise ValueError("path is empty: pass a GGUF file, a checkpoint directory, a cached repo "
                         "id or an asset name, or None for the packaged SmolLM2-135M-Instruct")
    p = Path(path).expanduser()
    if not p.exists() and str(path) == DEFAULT_MODEL_NAME:
        return "gguf", default_model_path()
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
                                f"{[DEFAULT_MODEL_NAME, *sorted(assets.ASSETS)]}, the first "
                                f"the packaged default); {e}") from None


def resolve_device(device):
    """``device`` as a ``jax.Device`` (or None): a platform name gives its first device."""
    import jax
    if device is None or isinstance(device, jax.Device):
        return device
    if isinstance(device, str):
        if not device.strip():  # jax.devices("") is the default backend's: not what was meant
            raise ValueError("device is an empty string: pass a platform name ('cpu', 'gpu'), a "
                             "jax.Device, or None for the default device")
        try:
            return jax.devices(device)[0]
        except RuntimeError:
            raise ValueError(f"device {device!r}: JAX has no such platform here (its devices: "
                             f"{jax.devices()}); pass 'cpu', 'gpu', a jax.Device or None")
    raise TypeError(f"device must be a jax.Device, a platform name ('cpu', 'gpu') or None, got "
                    f"{type(device).__name__}")


def load(path: str | os.PathLike | None = None, *, dtype: str | None = None, device=None):
    """Loads a model and its tokenizer: ``(ModelConfig, params, Tokenizer)``; see
    :func:`load_with_path`."""
    return load_with_path(path, dtype=dtype, device=device)[:3]


def load_with_path(path: str | os.PathLike | None = None, *, dtype: str | None = None,
                   device=None):
    """Loads a model and its tokenizer: ``(ModelConfig, params, Tokenizer, file)``, ``file``
    the GGUF file or checkpoint directory read (``path`` resolved once: an asset's checksum
    is checked once).

    ``path``: see :func:`resolve_model`. ``dtype``: "float32", "bfloat16" (or a dtype object of
    one: ``np.float32``, ``jnp.bfloat16``) or None (GGUF: float32; checkpoints: their stored
    dtype, bf16 staying bf16). ``device``: where the weights
    go: a ``jax.Device``, a platform name ("cpu", "gpu") for its first device, or None for the
    default device. The tokenizer and chat template come from the model's own files.
    """
    from .configs import dtype_name
    from .gguf_loader import load_gguf
    from .hf_loader import load_hf
    from .tokenizer import Tokenizer

    dtype = dtype_name(dtype)
    device = resolve_device(device)
    kind, p = resolve_model(path)
    # the tokenizer first: one the loader cannot read fails before minutes of weights
    if kind == "gguf":
        tok = Tokenizer.from_gguf(p)
        with warnings.catch_warnings():  # the tokenizer has said it: one warning per load
            warnings.filterwarnings("ignore", message=r".*no tokenizer\.ggml\.eos_token_id: the config")
            cfg, params = load_gguf(p, dtype="float32" if dtype is None else dtype)
        if device is not None:
            import jax
            params = jax.device_put(params, device)
    else:
        tok = Tokenizer.from_pretrained(p)
        cfg, params = load_hf(p, dtype=dtype, device=device)
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"{p}: the tokenizer has {tok.vocab_size} tokens, the model's embedding "
                         f"only {cfg.vocab_size}: the files belong to different models")
    return cfg, params, tok, p
