"""Model configuration (`ModelConfig`) and named presets for the Llama-family models.

`ModelConfig` is a frozen, hashable dataclass (usable as a jit static argument); every
field is validated on construction (also by `dataclasses.replace`). Presets:
`tiny()` (CPU tests), `smollm2_135m()`, `qwen2_5_1_5b()`, `llama3_8b()`, `llama3_1_8b()`; look
them up by name with `get_config(name, **overrides)`. `with_indexer(cfg, heads, dim)` adds the
DSA-style lightning-indexer parameters (off by default). `RopeScaling` describes the RoPE
frequency scaling of long-context checkpoints (linear, llama3, yarn, per-frequency factors).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

DTYPES = ("float32", "bfloat16")
ROPE_SCALING_KINDS = ("linear", "llama3", "yarn", "factors")


def dtype_name(dtype) -> str | None:
    """A loader's ``dtype`` argument as the name it takes: None (the file's own) stays None;
    "float32" / "bfloat16", or a dtype object of one (``np.float32``, ``np.dtype("bfloat16")``,
    ``jnp.bfloat16``), gives that name. Anything else is an error naming ``dtype``."""
    if dtype is None:
        return None
    name = dtype
    if not isinstance(dtype, str):
        try:  # a dtype object: its name (np.dtype compares equal to its name, so convert first)
            name = np.dtype(dtype).name
        except TypeError:
            raise TypeError(f"dtype must be one of {DTYPES}, a dtype object of one "
                            f"(np.float32, jnp.bfloat16) or None, got {dtype!r}") from None
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES} (or a dtype object of one) or None, "
                         f"got {dtype!r}: load in float32 or bfloat16")
    return str(name)   # a plain str (np.str_ too): it goes into ModelConfig.dtype


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling of a long-context checkpoint (frozen, hashable: part of the
    `ModelConfig` and so of the jit keys). With `inv[j] = theta**(-2j/rot_dim)`:

    - ``"linear"`` (position interpolation): `inv / factor`.
    - ``"llama3"`` (Llama-3.1/3.2): wavelengths `2pi/inv` shorter than
      `original_max_position / high_freq_factor` keep `inv`, longer than
      `original_max_position / low_freq_factor` get `inv / factor`, and the band between
      blends the two with `s = (original_max_position / wavelength - low) / (high - low)`.
    - ``"yarn"``: `inv` blended between `inv` (dims that rotate more than `beta_fast` times over
      `original_max_position`) and `inv / factor` (fewer than `beta_slow` times), a linear ramp
      between (its ends floored / ceiled when `truncate`); cos and sin are multiplied by
      `attention_factor` (default `0.1 ln(factor) + 1`).
    - ``"factors"``: `inv / factors[j]`, one divisor per frequency (a GGUF ``rope_freqs`` tensor).

    `attention_factor` multiplies cos and sin (1.0 except for yarn).
    """

    kind: str
    factor: float = 1.0
    original_max_position: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    factors: tuple = ()

    def __post_init__(self):
        def bad(msg: str):
            raise ValueError(f"RopeScaling({self.kind!r}): {msg}")

        if self.kind not in ROPE_SCALING_KINDS:
            raise ValueError(f"RopeScaling: kind must be one of {ROPE_SCALING_KINDS}, got "
                             f"{self.kind!r}")
        for f in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            v = getattr(self, f)
            if not _is_number(v) or not float(v) > 0:
                bad(f"{f} must be a positive number, got {v!r}")
            object.__setattr__(self, f, float(v))
        if not _is_int(self.original_max_position) or self.original_max_position < 0:
            bad(f"original_max_position must be a non-negative int, got {self.original_max_position!r}")
        object.__setattr__(self, "original_max_position", int(self.original_max_position))
        if not isinstance(self.truncate, (bool, np.bool_)):
            bad(f"truncate must be a bool, got {self.truncate!r}")
        object.__setattr__(self, "truncate", bool(self.truncate))
        if self.kind in ("llama3", "yarn") and self.original_max_position <= 0:
            bad("original_max_position (the pretraining context) must be a positive int")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            bad(f"high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                f"({self.low_freq_factor})")
        af = self.attention_factor
        if af is None:
            af = 0.1 * math.log(self.factor) + 1.0 if self.kind == "yarn" and self.factor > 1 else 1.0
        if not _is_number(af) or not float(af) > 0:
            bad(f"attention_factor must be a positive number or None, got {af!r}")
        object.__setattr__(self, "attention_factor", float(af))
        try:
            factors = tuple(float(x) for x in self.factors)
        except (TypeError, ValueError):
            raise ValueError(f"RopeScaling({self.kind!r}): factors must be a sequence of numbers, "
                             f"got {self.factors!r}") from None
        if self.kind == "factors":
            if not factors or not all(math.isfinite(x) and x > 0 for x in factors):
                bad("factors must be a non-empty sequence of positive finite numbers "
                    "(one per rotated frequency)")
        elif factors:
            bad(f"factors only apply to kind 'factors', not {self.kind!r}")
        object.__setattr__(self, "factors", factors)

    def inv_freq(self, theta: float, rot_dim: int) -> np.ndarray:
        """The scaled inverse frequencies [rot_dim // 2] (float64, on the host)."""
        j = np.arange(0, rot_dim, 2, dtype=np.float64)
        inv = 1.0 / (float(theta) ** (j / rot_dim))
        if self.kind == "linear":
            return inv / self.factor
        if self.kind == "factors":
            if len(self.factors) != rot_dim // 2:
                raise ValueError(f"RopeScaling('factors'): {len(self.factors)} factors for "
                                 f"{rot_dim // 2} rotated frequencies (head_dim / 2)")
            return inv / np.asarray(self.factors, np.float64)
        if self.kind == "llama3":
            wavelen = 2 * math.pi / inv
            old = float(self.original_max_position)
            lo, hi = self.low_freq_factor, self.high_freq_factor
            s = (old / wavelen - lo) / (hi - lo)
            blended = (1.0 - s) * inv / self.factor + s * inv
            return np.where(wavelen > old / lo, inv / self.factor,
                            np.where(wavelen < old / hi, inv, blended))
        # yarn: number of full rotations over the pretraining context decides each dim
        def dim_of(rotations):
            return (rot_dim * math.log(self.original_max_position / (rotations * 2 * math.pi))
                    / (2 * math.log(theta)))

        lo, hi = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, rot_dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(rot_dim // 2, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
        keep = 1.0 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
        return inv / self.factor * (1.0 - keep) + inv * keep


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static shape and numerics of a Llama-family decoder (SwiGLU MLP, RMSNorm, NeoX RoPE).

    Covers the llama and qwen2 architectures: `qkv_bias` (qwen2: biases on the q/k/v
    projections), `tie_embeddings` (False: a separate `lm_head`), `rope_theta` and
    `rope_scaling` (a `RopeScaling` or None for plain RoPE).
    `dtype` is the dtype of parameters and activations ("float32" or "bfloat16"); norms,
    softmax and logits are always computed in float32. `indexer_heads` (H_I) and
    `indexer_dim` (dI) are both 0 (no indexer parameters) or both positive. `eos_id` None:
    the model's files name no eos token (generate then stops only on the stop tokens given).
    """

    name: str
    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False
    dtype: str = "float32"
    max_position: int = 2048
    bos_id: int = 1
    eos_id: int | None = 2
    indexer_heads: int = 0
    indexer_dim: int = 0
    rope_scaling: RopeScaling | None = None

    def __post_init__(self):
        def bad(msg: str):
            raise ValueError(f"ModelConfig {self.name!r}: {msg}")

        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ModelConfig: name must be a non-empty str, got {self.name!r}")
        positive = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "ffn_dim", "max_position")
        for f in positive:
            v = getattr(self, f)
            if not _is_int(v) or v <= 0:
                bad(f"{f} must be a positive int, got {v!r}")
            object.__setattr__(self, f, int(v))
        for f in ("bos_id", "eos_id", "indexer_heads", "indexer_dim"):
            v = getattr(self, f)
            if f == "eos_id" and v is None:
                continue
            if not _is_int(v) or v < 0:
                bad(f"{f} must be a non-negative int, got {v!r}")
            object.__setattr__(self, f, int(v))
        for f in ("rope_theta", "rms_eps"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) \
                    or not float(v) > 0:
                bad(f"{f} must be a positive number, got {v!r}")
            object.__setattr__(self, f, float(v))
        for f in ("tie_embeddings", "qkv_bias"):
            v = getattr(self, f)
            if not isinstance(v, (bool, np.bool_)):
                bad(f"{f} must be a bool, got {v!r}")
            object.__setattr__(self, f, bool(v))
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            bad(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.num_heads % self.num_kv_heads:
            bad(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})")
        if self.head_dim % 2:
            bad(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.bos_id >= self.vocab_size or (self.eos_id or 0) >= self.vocab_size:
            bad(f"bos_id ({self.bos_id}) and eos_id ({self.eos_id}) must be < vocab_size "
                f"({self.vocab_size})")
        if (self.indexer_heads == 0) != (self.indexer_dim == 0):
            bad(f"indexer_heads ({self.indexer_heads}) and indexer_dim ({self.indexer_dim}) "
                "must both be 0 (no indexer) or both positive")
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, RopeScaling):
                bad(f"rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")
            if self.rope_scaling.kind == "factors" and len(self.rope_scaling.factors) != self.head_dim // 2:
                bad(f"rope_scaling has {len(self.rope_scaling.factors)} frequency factors, "
                    f"head_dim {self.head_dim} needs {self.head_dim // 2}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (G = Hq // H); query head i reads KV head i // G."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_dim(self) -> int:
        """Hq * D."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """H * D."""
        return self.num_kv_heads * self.head_dim

    @property
    def has_indexer(self) -> bool:
        return self.indexer_heads > 0


def _make(base: dict, overrides: dict) -> ModelConfig:
    unknown = set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:
        raise ValueError(f"unknown ModelConfig field(s) {sorted(unknown)}")
    return ModelConfig(**{**base, **overrides})


def tiny(**overrides) -> ModelConfig:
    """A 2-layer, d_model 64 model for CPU tests (4 query / 2 KV heads of 16, vocab 256)."""
    return _make(dict(name="tiny", vocab_size=256, d_model=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, ffn_dim=128, rope_theta=10000.0,
                      rms_eps=1e-5, tie_embeddings=True, qkv_bias=False, dtype="float32",
                      max_position=1024, bos_id=1, eos_id=2), overrides)


def smollm2_135m(**overrides) -> ModelConfig:
    """SmolLM2-135M (HuggingFaceTB): 30 layers, d 576, 9 q / 3 KV heads of 64, tied."""
    return _make(dict(name="smollm2-135m", vocab_size=49152, d_model=576, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, ffn_dim=1536,
                      rope_theta=100000.0, rms_eps=1e-5, tie_embeddings=True, qkv_bias=False,
                      dtype="bfloat16", max_position=8192, bos_id=1, eos_id=2), overrides)


def qwen2_5_1_5b(**overrides) -> ModelConfig:
    """Qwen2.5-1.5B: 28 layers, d 1536, 12 q / 2 KV heads of 128, q/k/v biases, tied.

    bos/eos are <|endoftext|> (151643); the instruct model ends turns with 151645.
    """
    return _make(dict(name="qwen2.5-1.5b", vocab_size=151936, d_model=1536, num_layers=28,
                      num_heads=12, num_kv_heads=2, head_dim=128, ffn_dim=8960,
                      rope_theta=1e6, rms_eps=1e-6, tie_embeddings=True, qkv_bias=True,
                      dtype="bfloat16", max_position=32768, bos_id=151643, eos_id=151643),
                 overrides)


def llama3_8b(**overrides) -> ModelConfig:
    """Llama-3-8B: 32 layers, d 4096, 32 q / 8 KV heads of 128, untied lm_head.

    Plain RoPE (no Llama-3.1 frequency scaling).
    """
    return _make(dict(name="llama3-8b", vocab_size=128256, d_model=4096, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128, ffn_dim=14336,
                      rope_theta=500000.0, rms_eps=1e-5, tie_embeddings=False, qkv_bias=False,
                      dtype="bfloat16", max_position=8192, bos_id=128000, eos_id=128001),
                 overrides)


def llama3_1_8b(**overrides) -> ModelConfig:
    """Llama-3.1-8B: Llama-3-8B's shapes with llama3 RoPE scaling (factor 8 over an 8k
    pretraining context) for 128k positions; ends turns with <|eot_id|> (128009)."""
    scaling = RopeScaling("llama3", factor=8.0, original_max_position=8192,
                          low_freq_factor=1.0, high_freq_factor=4.0)
    return llama3_8b(**{**dict(name="llama3.1-8b", max_position=131072, rope_scaling=scaling),
                        **overrides})


PRESETS: dict[str, Callable[..., ModelConfig]] = {
    "tiny": tiny,
    "smollm2-135m": smollm2_135m,
    "qwen2.5-1.5b": qwen2_5_1_5b,
    "llama3-8b": llama3_8b,
    "llama3.1-8b": llama3_1_8b,
}


def _canon(name: str) -> str:
    return (name.lower().replace("_", "-").replace("qwen2-5", "qwen2.5").replace("1-5b", "1.5b")
            .replace("llama3-1", "llama3.1"))


def get_config(name: str, **overrides) -> ModelConfig:
    """Preset `name` ("tiny", "smollm2-135m", "qwen2.5-1.5b", "llama3-8b", "llama3.1-8b"; `_` and
    `-` and case are interchangeable) with fields replaced by `overrides` (validated)."""
    key = _canon(name)
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[key](**overrides)


def with_indexer(cfg: ModelConfig, heads: int = 64, dim: int = 128) -> ModelConfig:
    """`cfg` with lightning-indexer parameters turned on (H_I = heads, dI = dim)."""
    if not (_is_int(heads) and heads > 0 and _is_int(dim) and dim > 0):
        raise ValueError(f"with_indexer: heads and dim must be positive ints, got {heads!r}, {dim!r}")
    return dataclasses.replace(cfg, indexer_heads=int(heads), indexer_dim=int(dim))
