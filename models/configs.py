"""Model configuration (`ModelConfig`) and named presets for the Llama-family models.

`ModelConfig` is a frozen, hashable dataclass (usable as a jit static argument); every
field is validated on construction (also by `dataclasses.replace`). Presets:
`tiny()` (CPU tests), `smollm2_135m()`, `qwen2_5_1_5b()`, `llama3_8b()`; look them up by
name with `get_config(name, **overrides)`. `with_indexer(cfg, heads, dim)` adds the
DSA-style lightning-indexer parameters (off by default).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

DTYPES = ("float32", "bfloat16")


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static shape and numerics of a Llama-family decoder (SwiGLU MLP, RMSNorm, NeoX RoPE).

    `dtype` is the dtype of parameters and activations ("float32" or "bfloat16"); norms,
    softmax and logits are always computed in float32. `indexer_heads` (H_I) and
    `indexer_dim` (dI) are both 0 (no indexer parameters) or both positive.
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
    eos_id: int = 2
    indexer_heads: int = 0
    indexer_dim: int = 0

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
        if self.bos_id >= self.vocab_size or self.eos_id >= self.vocab_size:
            bad(f"bos_id ({self.bos_id}) and eos_id ({self.eos_id}) must be < vocab_size "
                f"({self.vocab_size})")
        if (self.indexer_heads == 0) != (self.indexer_dim == 0):
            bad(f"indexer_heads ({self.indexer_heads}) and indexer_dim ({self.indexer_dim}) "
                "must both be 0 (no indexer) or both positive")

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


PRESETS: dict[str, Callable[..., ModelConfig]] = {
    "tiny": tiny,
    "smollm2-135m": smollm2_135m,
    "qwen2.5-1.5b": qwen2_5_1_5b,
    "llama3-8b": llama3_8b,
}


def _canon(name: str) -> str:
    return name.lower().replace("_", "-").replace("qwen2-5", "qwen2.5").replace("1-5b", "1.5b")


def get_config(name: str, **overrides) -> ModelConfig:
    """Preset `name` ("tiny", "smollm2-135m", "qwen2.5-1.5b", "llama3-8b"; `_` and `-` and
    case are interchangeable) with fields replaced by `overrides` (validated)."""
    key = _canon(name)
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[key](**overrides)


def with_indexer(cfg: ModelConfig, heads: int = 64, dim: int = 128) -> ModelConfig:
    """`cfg` with lightning-indexer parameters turned on (H_I = heads, dI = dim)."""
    if not (_is_int(heads) and heads > 0 and _is_int(dim) and dim > 0):
        raise ValueError(f"with_indexer: heads and dim must be positive ints, got {heads!r}, {dim!r}")
    return dataclasses.replace(cfg, indexer_heads=int(heads), indexer_dim=int(dim))
