"""Loads Hugging Face checkpoints (``config.json`` + safetensors) without torch.

A checkpoint is a directory with ``config.json`` and ``model.safetensors`` (or shards listed
in ``model.safetensors.index.json``), as ``save_pretrained`` writes it, or a huggingface_hub
cache entry (``.../hub/models--Org--Name``, or the repo id ``Org/Name`` looked up in the
local hub cache; nothing is downloaded). ``LlamaForCausalLM`` and ``Qwen2ForCausalLM`` map to
:class:`ModelConfig`, with RoPE scaling of types ``linear``, ``llama3`` and ``yarn``.

Safetensors files are read here (an 8-byte header length, a JSON header, raw little-endian
tensors) as read-only memory maps: each tensor goes from the mapped file straight to the
device in its stored dtype (bf16 stays bf16), and one compiled function per layer shape
transposes, fuses (``wqkv``, ``w_gate_up``) and casts it there. The host never holds a
converted copy of the model. Hugging Face stores ``nn.Linear`` weights ``[out, in]`` with Q/K
rows already in the half-split (NeoX) RoPE order that ``jaxkv.models.llama`` uses.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .configs import dtype_name
from .llama import fuse_layer

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_CONFIG = "config.json"
_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"
# safetensors dtype names -> numpy dtypes (BF16 through ml_dtypes, which jax depends on)
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded: missing or inconsistent files, or an
    unsupported architecture or setting."""


# --------------------------------------------------------------------------- locating

def _hub_cache_dir() -> Path:
    """The huggingface_hub cache folder (HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _snapshot(repo_dir: Path) -> Path:
    """The snapshot folder of a hub cache entry ``models--Org--Name``: the one ``refs/main``
    names, else the only one."""
    snaps = repo_dir / "snapshots"
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        p = snaps / ref.read_text().strip()
        if p.is_dir():
            return p
    found = sorted(p for p in snaps.iterdir() if p.is_dir()) if snaps.is_dir() else []
    if len(found) == 1:
        return found[0]
    if not found:
        raise FileNotFoundError(f"{repo_dir} is a hub cache entry without snapshots: download "
                                "the model again")
    raise CheckpointError(f"{repo_dir} holds {len(found)} snapshots and no refs/main: pass the "
                          f"snapshot folder itself, one of {[p.name for p in found]}")


def _with_config(d: Path) -> Path:
    """``d`` if it holds config.json; a folder of GGUF files only is named as such."""
    if not (d / _CONFIG).is_file():
        ggufs = sorted(d.glob("*.gguf"))
        if ggufs:
            raise FileNotFoundError(f"{d} holds GGUF file(s) and no {_CONFIG}: pass the file "
                                    f"itself, e.g. {ggufs[0]}")
    return d


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The directory holding ``config.json`` for ``path``: a checkpoint directory, a hub cache
    entry (``models--Org--Name``) or a repo id ``Org/Name`` present in the local hub cache.
    Raises FileNotFoundError naming what is missing."""
    p = Path(path).expanduser()
    if p.is_dir():
        if (p / _CONFIG).is_file():
            return p
        if (p / "snapshots").is_dir():
            return _with_config(_snapshot(p))
        _with_config(p)
        raise FileNotFoundError(f"{p} has no {_CONFIG}: a Hugging Face checkpoint directory holds "
                                f"{_CONFIG}, {_SINGLE} (or {_INDEX} and its shards) and tokenizer.json")
    text = str(path)
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", text) and not p.exists():
        entry = _hub_cache_dir() / ("models--" + text.replace("/", "--"))
        if entry.is_dir():
            return _with_config(_snapshot(entry))
        raise FileNotFoundError(
            f"{text!r} is neither a directory nor in the local Hugging Face cache ({entry}); "
            "jaxkv downloads nothing: fetch it first (e.g. `huggingface-cli download "
            f"{text}`) or pass the checkpoint directory")
    raise FileNotFoundError(f"checkpoint directory not found: {p}")


# --------------------------------------------------------------------------- safetensors

class SafetensorsFile:
    """One ``.safetensors`` file, memory-mapped read-only. ``names`` lists its tensors;
    ``get(name)`` returns a numpy view of the mapped bytes (no copy)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{self.path}: not a safetensors file (only {size} bytes)")
            n = int.from_bytes(head, "little")
            if n <= 1 or 8 + n > size:
                raise CheckpointError(f"{self.path}: not a safetensors file or truncated (header "
                                      f"length {n}, file size {size})")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        header.pop("__metadata__", None)
        self._start = 8 + n
        self._entries = header
        data_bytes = size - self._start
        for name, e in header.items():
            try:
                dt, shape, (b, end) = e["dtype"], [int(s) for s in e["shape"]], e["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: corrupt header entry for {name!r}: {e!r}") from None
            if dt not in _DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name!r} has dtype {dt}; supported: "
                                      f"{', '.join(_DTYPES)}")
            want = math.prod(shape) * np.dtype(self._np_dtype(dt)).itemsize
            if not 0 <= b <= end <= data_bytes or end - b != want:
                raise CheckpointError(f"{self.path}: tensor {name!r} needs bytes {b}..{end} "
                                      f"({want} for {dt} {shape}), the file has {data_bytes}: "
                                      "the file is truncated or corrupt")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size else None

    @staticmethod
    def _np_dtype(name: str):
        if name == "BF16":
            import ml_dtypes
            return ml_dtypes.bfloat16
        return np.dtype(_DTYPES[name])

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def dtype(self, name: str) -> str:
        return self._entries[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(s) for s in self._entries[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        e = self._entries[name]
        b, end = e["data_offsets"]
        raw = self._map[self._start + b:self._start + end]
        return raw.view(self._np_dtype(e["dtype"])).reshape(self.shape(name))


class Checkpoint:
    """The tensors of a checkpoint directory: one ``model.safetensors`` or the shards named by
    ``model.safetensors.index.json`` (each opened on first use)."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        index = self.dir / _INDEX
        if index.is_file():
            try:
                wmap = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: corrupt index ({type(e).__name__}: {e})") from None
            self._where = {str(k): str(v) for k, v in wmap.items()}
            missing = sorted({f for f in self._where.values() if not (self.dir / f).is_file()})
            if missing:
                raise FileNotFoundError(f"{self.dir}: shard(s) {missing} named by {_INDEX} are "
                                        "missing: the download is incomplete")
        elif (self.dir / _SINGLE).is_file():
            self._where = {n: _SINGLE for n in SafetensorsFile(self.dir / _SINGLE).names}
        else:
            other = sorted(p.name for p in self.dir.glob("*.bin")) + sorted(
                p.name for p in self.dir.glob("*.pth"))
            hint = (f" (found {other[:3]}: torch pickles are not read; convert them to "
                    "safetensors)" if other else "")
            raise FileNotFoundError(f"{self.dir}: neither {_SINGLE} nor {_INDEX}{hint}")
        self._files: dict[str, SafetensorsFile] = {}

    @property
    def names(self) -> set[str]:
        return set(self._where)

    def file(self, name: str) -> SafetensorsFile:
        fname = self._where[name]
        if fname not in self._files:
            self._files[fname] = SafetensorsFile(self.dir / fname)
        f = self._files[fname]
        if name not in f._entries:
            raise CheckpointError(f"{self.dir / fname}: tensor {name!r} is missing although "
                                  f"{_INDEX} names this shard")
        return f

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Tensor ``name`` (a view of the mapped file), checked against ``shape``."""
        if name not in self._where:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing")
        f = self.file(name)
        got = f.shape(name)
        if got != tuple(shape):
            raise CheckpointError(f"{self.dir}: tensor {name!r} has shape {list(got)}, config.json "
                                  f"implies {list(shape)}: the weights do not match the config")
        return f.get(name)


# --------------------------------------------------------------------------- config

def _read_json(path: Path) -> dict:
    try:
        out = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return out


def _first_id(v):
    if isinstance(v, (list, tuple)):
        return int(v[0]) if v else None
    return None if v is None else int(v)


def rope_from_hf(hf: dict):
    """``(rope_theta, RopeScaling | None)`` from a config dict: transformers >= 5 writes
    ``rope_parameters`` (type and theta inside), older checkpoints ``rope_theta`` and
    ``rope_scaling`` (``rope_type`` or ``type``)."""
    from .configs import RopeScaling

    params = dict(hf.get("rope_parameters") or {})
    if set(params) & {"full_attention", "sliding_attention"}:
        raise CheckpointError("per-layer-type rope_parameters are not supported")
    params = {**(hf.get("rope_scaling") or {}), **params}
    theta = params.get("rope_theta", hf.get("rope_theta"))
    theta = 10000.0 if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise CheckpointError(f"rope_theta must be a positive number, got {theta!r}")
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    prf = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        raise CheckpointError(f"partial_rotary_factor {prf} is not supported (RoPE on all dims only)")
    if kind not in ROPE_TYPES:
        raise CheckpointError(f"RoPE scaling type {kind!r} is not supported; supported: "
                              f"{', '.join(ROPE_TYPES)}")
    if kind == "default":
        return float(theta), None
    mpe = int(hf.get("max_position_embeddings") or 0)
    orig = int(params.get("original_max_position_embeddings") or mpe)
    factor = params.get("factor")
    try:
        if kind == "linear":
            return float(theta), RopeScaling("linear", factor=float(factor))
        if kind == "llama3":  # transformers requires all four fields: no defaults here
            missing = [k for k in ("factor", "original_max_position_embeddings",
                                   "low_freq_factor", "high_freq_factor") if params.get(k) is None]
            if missing:
                raise CheckpointError(f"llama3 RoPE scaling needs {', '.join(missing)}: the "
                                      "config is incomplete (the frequencies depend on them)")
            return float(theta), RopeScaling(
                "llama3", factor=float(factor), original_max_position=orig,
                low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                high_freq_factor=float(params.get("high_freq_factor", 4.0)))
        if factor is None:
            factor = mpe / orig
        factor = float(factor)
        att = params.get("attention_factor")
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if att is None and mscale and mscale_all:
            def m(scale, ms):
                return 1.0 if scale <= 1 else 0.1 * ms * math.log(scale) + 1.0
            att = m(factor, mscale) / m(factor, mscale_all)
        return float(theta), RopeScaling(
            "yarn", factor=factor, original_max_position=orig, attention_factor=att,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"rope scaling {params}: {e}") from None


def _refuse_sliding_window(hf: dict) -> None:
    """Refuse a Qwen2 config whose layers attend to a sliding window, read as Qwen2Config
    reads it: the window (``sliding_window``, default 4096) applies only with
    ``use_sliding_window``; ``layer_types`` names the sliding layers, else layers from
    ``max_window_layers`` (default 28) on slide. ``max_window_layers`` is read only when a
    window applies (configs with the window off may leave it null)."""
    if not hf.get("use_sliding_window"):
        return
    window = hf.get("sliding_window", 4096)
    if window is None:  # Qwen2Config: no window, every layer attends to the full context
        return
    layers = int(hf.get("num_hidden_layers") or 0)
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int):
            raise CheckpointError(f"max_window_layers must be an integer when use_sliding_window "
                                  f"is set, got {first!r}: set it in config.json (the first "
                                  "layer that slides), or set use_sliding_window to false")
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding:
        raise CheckpointError(
            f"use_sliding_window is set: {len(sliding)} of {layers} layers (the first: layer "
            f"{sliding[0]}) attend to a sliding window of {window} tokens; sliding-window "
            "attention is not supported (set use_sliding_window to false to attend to the full "
            "context)")


def model_config_from_hf(hf: dict, *, name: str = "hf-model", dtype: str = "bfloat16",
                         generation: dict | None = None):
    """A :class:`ModelConfig` from a ``config.json`` dict of a LlamaForCausalLM or
    Qwen2ForCausalLM (``generation``: ``generation_config.json``, for its eos ids)."""
    from .configs import ModelConfig

    archs = hf.get("architectures") or []
    mt = hf.get("model_type")
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None and not archs and mt in ("llama", "qwen2"):
        arch = mt
    if arch is None:
        raise CheckpointError(f"unsupported architecture {archs or mt!r}; supported: "
                              f"{', '.join(ARCHITECTURES)} (model_type llama, qwen2)")
    req = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
           "num_attention_heads")
    missing = [k for k in req if hf.get(k) is None]
    if missing:
        raise CheckpointError(f"config.json lacks {missing}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
    if arch == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise CheckpointError("attention_bias / mlp_bias are not supported for llama checkpoints "
                              "(they add biases to o_proj and the MLP)")
    if arch == "qwen2":
        _refuse_sliding_window(hf)
    heads = int(hf["num_attention_heads"])
    theta, scaling = rope_from_hf(hf)
    # without the key, transformers' config default: LlamaConfig 2048, Qwen2Config 32768
    max_pos = int(hf.get("max_position_embeddings") or (32768 if arch == "qwen2" else 2048))
    if scaling is not None and scaling.kind == "yarn":
        max_pos = max(max_pos, int(round(scaling.factor * scaling.original_max_position)))
    gen = generation or {}
    eos = _first_id(hf.get("eos_token_id"))
    if eos is None:
        eos = _first_id(gen.get("eos_token_id"))
    if eos is None:
        raise CheckpointError("neither config.json nor generation_config.json gives an eos_token_id")
    bos = _first_id(hf.get("bos_token_id"))
    if bos is None:
        bos = _first_id(gen.get("bos_token_id"))
    try:
        return ModelConfig(
            name=name, vocab_size=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]),
            num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            ffn_dim=int(hf["intermediate_size"]), rope_theta=theta,
            rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2", dtype=dtype, max_position=max_pos,
            bos_id=eos if bos is None else bos, eos_id=eos, rope_scaling=scaling)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"config.json: {e}") from None


def eos_ids(directory: str | os.PathLike) -> tuple[int, ...]:
    """All eos ids that config.json and generation_config.json name (Llama-3.1 instruct
    models list several)."""
    d = resolve_checkpoint(directory)
    out: list[int] = []
    for fname in ("generation_config.json", _CONFIG):
        p = d / fname
        if p.is_file():
            v = _read_json(p).get("eos_token_id")
            for i in (v if isinstance(v, (list, tuple)) else [v]):
                if i is not None and int(i) not in out:
                    out.append(int(i))
    return tuple(out)


def _default_dtype(hf: dict, directory: Path) -> str:
    """The checkpoint's dtype: config.json's ``dtype`` / ``torch_dtype``, else the stored
    embedding's; bf16 stays bf16, f32 and f16 load as float32."""
    dt = hf.get("dtype") or hf.get("torch_dtype")
    if dt is None:
        ck = Checkpoint(directory)
        name = "model.embed_tokens.weight"
        dt = "bfloat16" if name in ck.names and ck.file(name).dtype(name) == "BF16" else None
    return "bfloat16" if dt == "bfloat16" else "float32"


def _model_name(directory: Path, requested) -> str:
    parts = directory.parts
    for i, part in enumerate(parts):
        if part.startswith("models--") and i + 2 < len(parts) and parts[i + 1] == "snapshots":
            return part[len("models--"):].replace("--", "/")
    return directory.name or str(requested)


def load_config(path: str | os.PathLike, *, dtype: str | None = None):
    """``(ModelConfig, checkpoint directory)`` for ``path`` without reading the weights."""
    dtype = dtype_name(dtype)
    d = resolve_checkpoint(path)
    hf = _read_json(d / _CONFIG)
    gen_path = d / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else None
    dtype = dtype or _default_dtype(hf, d)
    cfg = model_config_from_hf(hf, name=_model_name(d, path), dtype=dtype, generation=gen)
    return cfg, d


# --------------------------------------------------------------------------- weights

@functools.partial(jax.jit, static_argnames=("dtype",))
def _fuse_layer(raw: dict, dtype: str) -> dict:
    """One layer's Hugging Face tensors ([out, in]) -> the jaxkv layer dict ([in, out], fused)."""
    dt = jnp.dtype(dtype)
    lay = {"attn_norm": raw["input_layernorm"], "mlp_norm": raw["post_attention_layernorm"]}
    for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"),
                         ("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
        lay[ours] = raw[theirs].T
    for ours, theirs in (("bq", "q_bias"), ("bk", "k_bias"), ("bv", "v_bias")):
        if theirs in raw:
            lay[ours] = raw[theirs]
    return {k: v.astype(dt) for k, v in fuse_layer(lay).items()}


@functools.partial(jax.jit, static_argnames=("dtype", "transpose"))
def _cast(x, dtype: str, transpose: bool = False):
    x = x.T if transpose else x
    return x.astype(jnp.dtype(dtype))


def load_hf(path: str | os.PathLike, *, dtype: str | None = None, device=None):
    """Loads a LlamaForCausalLM / Qwen2ForCausalLM checkpoint.

    Args: ``path``: checkpoint directory, hub cache entry or cached repo id (see
    :func:`resolve_checkpoint`); ``dtype``: "float32", "bfloat16" (or a dtype object of one) or
    None (the checkpoint's: bf16 stays bf16, f32 and f16 load as float32); ``device``: a
    ``jax.Device`` (default: the default device).
    Returns ``(ModelConfig, params)`` in the ``jaxkv.models.llama`` layout. Each tensor goes
    from the memory-mapped file to the device in its stored dtype; transposes, fusion and the
    cast run there, one layer at a time.
    """
    cfg, d = load_config(path, dtype=dtype)
    ck = Checkpoint(d)
    dev = device if device is not None else jax.devices()[0]
    V, dm, F = cfg.vocab_size, cfg.d_model, cfg.ffn_dim
    qd, kvd = cfg.q_dim, cfg.kv_dim

    def put(name, shape):
        return jax.device_put(ck.get(name, shape), dev)

    shapes = {"input_layernorm": (dm,), "post_attention_layernorm": (dm,),
              "q_proj": (qd, dm), "k_proj": (kvd, dm), "v_proj": (kvd, dm), "o_proj": (dm, qd),
              "gate_proj": (F, dm), "up_proj": (F, dm), "down_proj": (dm, F)}
    where = {"input_layernorm": "", "post_attention_layernorm": "", "q_proj": "self_attn.",
             "k_proj": "self_attn.", "v_proj": "self_attn.", "o_proj": "self_attn.",
             "gate_proj": "mlp.", "up_proj": "mlp.", "down_proj": "mlp."}
    extra = sorted({int(m.group(1)) for n in ck.names
                    if (m := re.match(r"model\.layers\.(\d+)\.", n))} - set(range(cfg.num_layers)))
    if extra:
        raise CheckpointError(f"{d}: the weights hold layer(s) {extra[:3]} beyond config.json's "
                              f"num_hidden_layers ({cfg.num_layers}): the config does not match "
                              "the weights")
    layers = []
    for i in range(cfg.num_layers):
        b = f"model.layers.{i}."
        raw = {k: put(f"{b}{where[k]}{k}.weight", s) for k, s in shapes.items()}
        if cfg.qkv_bias:
            for p, n in (("q", qd), ("k", kvd), ("v", kvd)):
                raw[f"{p}_bias"] = put(f"{b}self_attn.{p}_proj.bias", (n,))
        layers.append(_fuse_layer(raw, cfg.dtype))
        del raw
    extra_bias = sorted(n for n in ck.names if re.search(r"\.(o_proj|mlp\.\w+)\.bias$", n))
    if extra_bias:
        raise CheckpointError(f"{d}: unsupported bias tensors {extra_bias[:3]}")
    params = {"embed": _cast(put("model.embed_tokens.weight", (V, dm)), cfg.dtype),
              "layers": tuple(layers),
              "final_norm": _cast(put("model.norm.weight", (dm,)), cfg.dtype)}
    if not cfg.tie_embeddings:
        if "lm_head.weight" not in ck.names:
            raise CheckpointError(f"{d}: tie_word_embeddings is false but lm_head.weight is missing")
        params["lm_head"] = _cast(put("lm_head.weight", (V, dm)), cfg.dtype, transpose=True)
    return cfg, params


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    """True when ``path`` resolves to a checkpoint directory (see :func:`resolve_checkpoint`)."""
    try:
        resolve_checkpoint(path)
    except (FileNotFoundError, CheckpointError):
        return False
    return True
