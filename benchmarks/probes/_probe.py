"""Shared by the per-layer probes (fp8_rotation.py, layer_budget.py): a real model's own
per-layer q / k / v on real text, and the per-layer report (printed rows, their means, JSON)."""
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kernels.prefill_attention import extend_attention
from jaxkv.models import gguf_loader, llama
from jaxkv.models.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import decode_lib  # noqa: E402  (benchmarks/)
from _meta import commit  # noqa: E402


def layer_qkv(path, tokens: int, layers: int | None = None):
    """Yields (layer, q [T, Hq, D], k [T, H, D], v [T, H, D]) of a float32 prefill of
    ``tokens`` tokens of Paul Graham's essays through the GGUF model at ``path`` (its first
    ``layers`` layers; default all)."""
    cfg, params = gguf_loader.load_gguf(path, dtype="float32")
    ids = decode_lib.haystack_tokens(load_tokenizer(path), tokens)
    yield from model_qkv(cfg, params, ids, layers)


def model_qkv(cfg, params, ids, layers: int | None = None, dense_max: int = 8192):
    """Yields (layer, q [T, Hq, D], k [T, H, D], v [T, H, D]) of a prefill of the token ids
    ``ids`` through a loaded model (its first ``layers`` layers; default all); the attention
    from [T, T] scores up to ``dense_max`` tokens, from key blocks above."""
    x = llama.embed(params, cfg, jnp.asarray([ids], jnp.int32))
    pos = jnp.arange(len(ids), dtype=jnp.int32)[None]
    valid = jnp.ones(pos.shape, bool)
    for i, lp in enumerate(params["layers"][:layers]):
        _, q, k, v = llama.attention_inputs(lp, cfg, x, pos)
        if len(ids) <= dense_max:
            attn, _ = llama.dense_attend(i, lp, None, q, k, v, None)
        else:  # no [T, T] scores: key blocks with an online softmax
            attn = extend_attention(q, k, v, pos, valid).astype(q.dtype)
        x = llama.layer_output(lp, cfg, x, attn)
        yield i, q[0], k[0], v[0]


def print_row(row: dict):
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in row.items()), flush=True)


def report(rows: list, out, **fields) -> dict:
    """Prints the mean of every per-layer figure and, with ``out``, writes the rows, the means,
    ``fields`` and the run's device, jax version, commit and date as JSON."""
    mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0] if k != "layer"}
    print("mean", json.dumps(mean))
    if out:
        meta = dict(device=str(jax.devices()[0]), jax=jax.__version__, commit=commit(),
                    date=time.strftime("%Y-%m-%d %H:%M:%S"))
        Path(out).write_text(json.dumps(dict(meta, **fields, layers=rows, mean=mean), indent=1))
    return mean
