"""What a page budget leaves out, layer by layer (issue 27): on a real model and real text, the
attention mass outside the pages an exact page oracle keeps, and the error that leaves in each
layer's attention output. CPU, float32.

Per layer: the model's own q / k / v (prefill of ``--tokens`` tokens of Paul Graham's essays),
the last ``--queries`` positions. For each query position and KV head the oracle keeps the
``budget / page_size`` pages with the largest attention mass summed over the head's query
group (the ``oracle`` selector's page score, ``oracle.attention_mass``), the query's own page
always among them (no sink page forced, unlike the selector's ``sink_pages``), and attention
is renormalized over them:

- ``lost_mass``: the mean share of a query head's attention mass outside the kept pages;
- ``out_rel``: the relative L2 error of the layer's attention output against full attention.

Layers that spread attention over the whole context lose the most; the ``dense_layers`` field
of ``CacheConfig`` keeps the first layers dense for that reason (Quest's recipe).

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/probes/layer_budget.py --gguf FILE \
        --tokens 8192 --budgets 512 1024 2048 --out OUT.json
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

from _probe import layer_qkv, print_row, report
from jaxkv.models import gguf_loader
from jaxkv.selectors import oracle


def kept_attention(q, k, v, t0, page_size, n_pages):
    """q [Q, Hq, D] at positions t0.., k / v [T, H, D] -> (full output, budget output [Q, Hq,
    D], lost mass [Q, Hq]) with ``n_pages`` pages per (query, KV head) kept by group mass."""
    Q, Hq, D = q.shape
    T, H, _ = k.shape
    G = Hq // H
    n_all = -(-T // page_size)
    qpos = t0 + jnp.arange(Q, dtype=jnp.int32)
    keys = jnp.pad(k, ((0, n_all * page_size - T), (0, 0), (0, 0))).reshape(n_all, page_size, H, D)
    gm = jax.vmap(lambda qi, pos: oracle.attention_mass(qi[None], keys[None], pos[None],
                                                         page_size)[0])(q, qpos)  # [Q, H, pages]
    gm = gm.at[jnp.arange(Q), :, qpos // page_size].set(jnp.inf)      # the query's own page
    kth = -jnp.sort(-gm, axis=-1)[..., min(n_pages, n_all) - 1:min(n_pages, n_all)]
    keep = jnp.repeat(gm >= kth, G, axis=1)                           # [Q, Hq, pages]
    keep_t = jnp.repeat(keep, page_size, axis=-1)[..., :T]
    s = jnp.einsum("qhd,thd->qht", q, jnp.repeat(k, G, axis=1)) / np.sqrt(D)
    s = jnp.where(jnp.arange(T)[None, None, :] <= qpos[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)                                   # [Q, Hq, T]
    vv = jnp.repeat(v, G, axis=1)
    full = jnp.einsum("qht,thd->qhd", p, vv)
    lost = 1.0 - jnp.sum(jnp.where(keep_t, p, 0.0), axis=-1)         # [Q, Hq]
    part = jnp.einsum("qht,thd->qhd", jax.nn.softmax(jnp.where(keep_t, s, -jnp.inf), axis=-1), vv)
    return full, part, lost


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--layers", type=int, default=None, help="the first N layers only")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    path = a.gguf or str(gguf_loader.default_model_path())
    fn = jax.jit(kept_attention, static_argnums=(3, 4, 5))
    rows = []
    for i, q, k, v in layer_qkv(path, a.tokens, a.layers):
        T = k.shape[0]
        t0 = T - a.queries
        row = dict(layer=i)
        for b in a.budgets:
            full, part, lost = fn(q[t0:], k, v, t0, a.page_size, b // a.page_size)
            row[f"lost_mass_{b}"] = float(jnp.mean(lost))
            row[f"out_rel_{b}"] = float(jnp.linalg.norm(part - full) / jnp.linalg.norm(full))
        rows.append(row)
        print_row(row)
    report(rows, a.out, model=path, tokens=T, queries=a.queries, page_size=a.page_size)


if __name__ == "__main__":
    main()
