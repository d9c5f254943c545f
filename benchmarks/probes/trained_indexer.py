"""A trained page indexer (issue 27's candidate: DSA's warm-up recipe at page level), against
Quest and the exact oracle, by the attention mass each one's pages keep. CPU, float32.

The model is frozen. Per layer a small indexer reads the layer's normed hidden state ``h``
(the input of its q / k / v projections):

    query heads   q_j = h_t W_q[j]  (heads x dim),  weights w_j = h_t W_w[j]
    page key      kbar_p = (mean of h over the page's tokens) W_k      (dim)
    page score    s_p = sum_j w_j relu(q_j . kbar_p) / sqrt(dim)

with heads x dim one of ``--shapes`` (e.g. ``4x32``; one indexer is trained per shape),
one page set shared by the request's KV heads (as the ``indexer`` selector shares it). The key
is linear in ``h`` so a page's key is the projection of its mean hidden state (the selector's
``LayerNorm`` per token is left out here). Training (Adam, ``--steps``) minimizes the KL
divergence from the model's own attention distribution over the earlier pages (the page
mass, averaged over all query heads) to ``softmax(s)``, at ``--queries`` random positions
of ``--train-seqs`` windows of ``--tokens`` tokens of Paul Graham's essays, starting every
``--stride`` tokens (overlapping when the stride is shorter than a window); the held-out
essays are ``--eval-seqs`` windows after the training text.

Evaluation, per layer, at each query position and query head: the share of the head's
attention mass on the pages a method keeps at ``--budgets`` (tokens per KV head; the
query's own page and page 0 always kept, as the selectors keep the recent and the sink
page):

- ``oracle``: per KV head the pages of largest mass summed over the head's query group;
- ``oracle_shared``: one set for all KV heads (the bound of any shared selection);
- ``quest``: per KV head Quest's upper bound (page ``kmax`` / ``kmin``) summed over the group;
- ``indexer``: the trained indexer (shared).

Sets: ``essays`` (held-out windows, ``--queries`` random positions each) and ``ruler``
(``--ruler DIR``: the last ``--ruler-queries`` positions of ``--ruler-cases`` prompts of
each length from ``bench_quality.py --prepare``, where the question sits). On RULER prompts
the pages holding the answers (from each case's ``answer_tokens``) are the needle pages:
``needle_mass_<method>`` is the share of the mass on them that the kept pages hold,
``recall_<method>`` the share of them kept.

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/probes/trained_indexer.py \
        --ruler .devout/scases200 --out OUT.json
"""
import argparse
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxkv.kernels import prefill_attention, quest
from jaxkv.models import gguf_loader, llama
from jaxkv.models.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import decode_lib  # noqa: E402  (benchmarks/)
from _meta import commit  # noqa: E402


def layer_views(cfg, params, ids, qpos, ps):
    """Per layer of a float32 prefill of ``ids`` [T]: (page-mean h [Np, d], query h [Q, d],
    page mass [Q, Hq, Np] of the query heads at positions ``qpos``, Quest's group-summed
    upper bound [Q, H, Np]). Np = T // ps complete pages."""
    T = len(ids)
    x = llama.embed(params, cfg, jnp.asarray([ids], jnp.int32))
    qpos = jnp.asarray(qpos, jnp.int32)
    out = []
    for lp in params["layers"]:
        x, views = _layer(cfg, ps, lp, x, qpos)
        out.append(tuple(np.asarray(a) for a in views))
    return out


@functools.partial(jax.jit, static_argnums=(0, 1))
def _layer(cfg, ps, lp, x, qpos):
    """One layer (the blocked XLA:CPU prefill attention) and its views."""
    T = x.shape[1]
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    h, q, k, v = llama.attention_inputs(lp, cfg, x, pos)
    attn = prefill_attention.prefill_attention(q, k, v, jnp.asarray([T], jnp.int32),
                                               implementation="blocked")
    return llama.layer_output(lp, cfg, x, attn), _views(h[0], q[0], k[0], qpos, ps, T // ps)


def _views(h, q, k, qpos, ps, Np):
    T, Hq, D = q.shape
    H = k.shape[1]
    G = Hq // H
    hp = jnp.mean(h[:Np * ps].reshape(Np, ps, -1).astype(jnp.float32), axis=1)
    qq = q[qpos].astype(jnp.float32)                                       # [Q, Hq, D]
    s = jnp.einsum("qhd,thd->qht", qq, jnp.repeat(k, G, axis=1).astype(jnp.float32)) / np.sqrt(D)
    s = jnp.where(jnp.arange(T)[None, None, :] <= qpos[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)[..., :Np * ps]
    mass = jnp.sum(p.reshape(p.shape[0], Hq, Np, ps), axis=-1)              # [Q, Hq, Np]
    # Quest's own summaries and scores, each query position a row of the batch
    kmax, kmin = quest.quest_summarize(k[None, :Np * ps].astype(jnp.float32), ps,
                                       jnp.asarray([Np * ps], jnp.int32))   # [1, Np, H, D]
    Q = qq.shape[0]
    summ = [jnp.broadcast_to(x, (1, Q) + x.shape[1:]) for x in (kmax, kmin)]
    bound = quest.quest_scores_reference(qq, *summ, 0, jnp.full((Q,), Np * ps, jnp.int32),
                                         page_size=ps)                       # [Q, H, Np]
    return hp, h[qpos].astype(jnp.float32), mass, bound


def init_params(key, d, heads, dim, L):
    k1, k2, k3 = jax.random.split(key, 3)
    return dict(wq=jax.random.normal(k1, (L, d, heads * dim)) * d ** -0.5,
                wk=jax.random.normal(k2, (L, d, dim)) * d ** -0.5,
                ww=jax.random.normal(k3, (L, d, heads)) * d ** -0.5)


def scores(p, hq, hp, heads, dim):
    """One layer: hq [..., Q, d], hp [..., Np, d] -> page scores [..., Q, Np]."""
    qi = (hq @ p["wq"]).reshape(hq.shape[:-1] + (heads, dim))
    w = hq @ p["ww"]                                                        # [..., Q, HI]
    kb = hp @ p["wk"]                                                       # [..., Np, dim]
    dots = jnp.einsum("...qjd,...pd->...qjp", qi, kb) / np.sqrt(dim)
    return jnp.einsum("...qj,...qjp->...qp", w, jax.nn.relu(dots))


def earlier(qpos, Np, ps):
    """[Q, Np] pages before each query's own page (the distribution the indexer learns)."""
    return jnp.arange(Np)[None, :] < (jnp.asarray(qpos)[:, None] // ps)


def loss_fn(p, hq, hp, tgt, valid, heads, dim):
    """Mean KL(target || softmax(scores)) over queries; all arrays carry [L, S] in front."""
    s = jax.vmap(lambda pl, a, b: scores(pl, a, b, heads, dim))(p, hq, hp)  # [L, S, Q, Np]
    logp = jax.nn.log_softmax(jnp.where(valid, s, -1e30), axis=-1)
    t = jnp.where(valid, tgt, 0.0)
    t = t / jnp.maximum(jnp.sum(t, -1, keepdims=True), 1e-9)
    kl = jnp.sum(jnp.where(t > 0, t * (jnp.log(jnp.maximum(t, 1e-30)) - logp), 0.0), -1)
    return jnp.mean(kl)


def keep_mask(score, qpos, Np, ps, n):
    """[..., Q, Np] scores -> kept pages: own page and page 0 forced, then the top n - 2 of the
    earlier pages."""
    own = (jnp.asarray(qpos) // ps)
    pages = jnp.arange(Np)
    forced = (pages[None, :] == own[:, None]) | (pages[None, :] == 0)
    ok = pages[None, :] < own[:, None]
    own_b = forced.reshape((1,) * (score.ndim - 2) + forced.shape)
    ok_b = ok.reshape((1,) * (score.ndim - 2) + ok.shape)
    s = jnp.where(ok_b & ~own_b, score, -jnp.inf)
    m = max(n - 2, 0)
    if m == 0:
        return jnp.broadcast_to(own_b, score.shape)
    kth = -jnp.sort(-s, axis=-1)[..., m - 1:m]
    return own_b | ((s >= kth) & jnp.isfinite(s))


def captured(view, qpos, ps, n, idx_scores, needles=None):
    """Mean share of each query head's mass on the kept pages, per method; with ``needles``
    (the pages holding the answer in a RULER prompt) also ``recall_<method>``: the mean share
    of them kept (per KV head, or shared)."""
    _, _, mass, quest = view
    mass = jnp.asarray(mass)                                                 # [Q, Hq, Np]
    Q, Hq, Np = mass.shape
    H = quest.shape[1]
    G = Hq // H
    grp = jnp.sum(mass.reshape(Q, H, G, Np), axis=2)                         # [Q, H, Np]
    tot = jnp.sum(mass, axis=-1)                                             # [Q, Hq]

    def per_kv(keep):                                                        # [Q, H, Np]
        kq = jnp.repeat(keep, G, axis=1)
        return float(jnp.mean(jnp.sum(jnp.where(kq, mass, 0.0), -1) / tot))

    def shared(keep):                                                        # [Q, Np]
        return float(jnp.mean(jnp.sum(jnp.where(keep[:, None], mass, 0.0), -1) / tot))

    qp = np.asarray(qpos)
    keeps = dict(
        oracle=keep_mask(jnp.moveaxis(grp, 1, 0), qp, Np, ps, n).transpose(1, 0, 2),
        oracle_shared=keep_mask(jnp.sum(mass, 1), qp, Np, ps, n)[:, None],
        quest=keep_mask(jnp.moveaxis(jnp.asarray(quest), 1, 0), qp, Np, ps, n).transpose(1, 0, 2),
        indexer=keep_mask(idx_scores, qp, Np, ps, n)[:, None])
    out = {m: (per_kv(k) if k.shape[1] == H else shared(k[:, 0])) for m, k in keeps.items()}
    if needles is not None and len(needles):
        nd = jnp.asarray(needles)
        out.update({f"recall_{m}": float(jnp.mean(k[..., nd])) for m, k in keeps.items()})
        nm = mass[..., nd]                                                   # [Q, Hq, n]

        def needle_mass(k):
            kq = jnp.repeat(k, G, axis=1) if k.shape[1] == H else k
            return float(jnp.sum(jnp.where(kq[..., nd], nm, 0.0)) / jnp.sum(nm))
        out.update({f"needle_mass_{m}": needle_mass(k) for m, k in keeps.items()})
    return out


def train_indexer(a, rng, L, d, heads, dim, hq, hp, tgt, valid):
    """Adam on the KL loss, all layers at once; returns (params, loss curve, seconds)."""
    p = init_params(jax.random.key(a.seed), d, heads, dim, L)
    opt = optax.adamw(a.lr, weight_decay=a.weight_decay)
    st = opt.init(p)
    S = hq.shape[1]

    @jax.jit
    def step(p, st, sel):
        lv, g = jax.value_and_grad(loss_fn)(p, hq[:, sel], hp[:, sel], tgt[:, sel],
                                            valid[:, sel], heads, dim)
        upd, st = opt.update(g, st, p)
        return optax.apply_updates(p, upd), st, lv

    t0 = time.time()
    curve = []
    for i in range(a.steps):
        sel = jnp.asarray(rng.choice(S, min(a.batch, S), replace=False))
        p, st, lv = step(p, st, sel)
        if i % 100 == 0 or i == a.steps - 1:
            curve.append((i, float(lv)))
            print(f"{heads}x{dim} step {i} loss {float(lv):.4f} ({time.time() - t0:.0f} s)",
                  flush=True)
    return p, curve, time.time() - t0


def evaluate(a, p, L, ps, heads, dim, items, label):
    """Per budget the mean of ``captured`` over layers, queries and prompts (and per layer)."""
    layer_p = lambda i: jax.tree.map(lambda x: x[i], p)  # noqa: E731
    rows = {b: [] for b in a.budgets}
    kl_rows = []
    for qpos, views, needles in items:
        Npv = views[0][0].shape[0]
        for i, v in enumerate(views):
            sc = scores(layer_p(i), jnp.asarray(v[1]), jnp.asarray(v[0]), heads, dim)
            ok = earlier(qpos, Npv, ps)
            kl_rows.append(float(loss_fn(jax.tree.map(lambda x: x[None], layer_p(i)),
                                         jnp.asarray(v[1])[None, None],
                                         jnp.asarray(v[0])[None, None],
                                         jnp.mean(jnp.asarray(v[2]), 1)[None, None],
                                         ok[None, None], heads, dim)))
            for b in a.budgets:
                rows[b].append(dict(layer=i, **captured(v, qpos, ps, b // ps, sc, needles)))
    out = {"kl": float(np.mean(kl_rows)), "items": len(items)}
    for b in a.budgets:
        keys = [k for k in rows[b][0] if k != "layer"]
        out[str(b)] = {k: float(np.mean([r[k] for r in rows[b] if k in r])) for k in keys}
        out[str(b)]["per_layer"] = {
            k: [float(np.mean([r[k] for r in rows[b] if r["layer"] == i and k in r]))
                for i in range(L)] for k in keys}
    print(label, json.dumps({k: (v if not isinstance(v, dict) else
                                 {m: round(x, 4) for m, x in v.items() if m != "per_layer"})
                             for k, v in out.items()}), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--train-seqs", type=int, default=24)
    ap.add_argument("--eval-seqs", type=int, default=4)
    ap.add_argument("--queries", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--shapes", nargs="+", default=["4x32", "8x64"],
                    help="indexer heads x dim, one trained indexer each")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--stride", type=int, default=None,
                    help="tokens between window starts (default: --tokens, no overlap)")
    ap.add_argument("--batch", type=int, default=8, help="windows per Adam step")
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--ruler", default=None)
    ap.add_argument("--ruler-cases", type=int, default=6, help="per task and length")
    ap.add_argument("--ruler-lengths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--ruler-queries", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    t_start = time.time()
    path = a.gguf or str(gguf_loader.default_model_path())
    cfg, params = gguf_loader.load_gguf(path, dtype="float32")
    L, d, ps, T = cfg.num_layers, cfg.d_model, a.page_size, a.tokens
    Np = T // ps
    rng = np.random.default_rng(a.seed)
    n_win = a.train_seqs + a.eval_seqs
    stride = a.stride or T
    tok = load_tokenizer(path)
    # training windows start at w * stride; the held-out windows follow the training text
    n_train_tokens = (a.train_seqs - 1) * stride + T
    ids = decode_lib.haystack_tokens(tok, n_train_tokens + a.eval_seqs * T)

    def window_views(start):
        qpos = np.sort(rng.choice(np.arange(ps * 4, T), a.queries, replace=False))
        return qpos, layer_views(cfg, params, ids[start:start + T], qpos, ps)

    data = ([window_views(w * stride) for w in range(a.train_seqs)]
            + [window_views(n_train_tokens + w * T) for w in range(a.eval_seqs)])
    print(f"collected {n_win} windows in {time.time() - t_start:.0f} s", flush=True)
    train, held = data[:a.train_seqs], data[a.train_seqs:]
    stack = lambda j: jnp.asarray(np.stack([np.stack([v[j] for v in vs]) for _, vs in train],  # noqa: E731
                                           axis=1))                          # [L, S, ...]
    hp, hq, mass = stack(0), stack(1), stack(2)
    tgt = jnp.mean(mass, axis=3)                                             # [L, S, Q, Np]
    valid = jnp.asarray(np.stack([np.asarray(earlier(q, Np, ps)) for q, _ in train]))[None]

    sets = [("essays_heldout", [(q, v, None) for q, v in held]),
            ("essays_train", [(q, v, None) for q, v in train[:a.eval_seqs]])]
    if a.ruler:
        import bench_quality
        cases, _ = bench_quality.load_cases(a.ruler)
        for length in a.ruler_lengths:
            pick = {}
            for c in cases:
                if c["length"] == length and len(pick.get(c["task"], [])) < a.ruler_cases:
                    pick.setdefault(c["task"], []).append(c)
            items = []
            for cs in pick.values():
                for c in cs:
                    n = len(c["ids"])
                    qpos = np.arange(n - a.ruler_queries, n)
                    needles = sorted({t // ps for at, o in zip(c["answer_tokens"], c["outputs"])
                                      for t in range(at, at + len(tok.encode(" " + o)))
                                      if t // ps < n // ps})
                    items.append((qpos, layer_views(cfg, params, c["ids"], qpos, ps), needles))
            sets.append((f"ruler_{length}", items))
        print(f"collected the RULER prompts at {time.time() - t_start:.0f} s", flush=True)
    results, curves, train_s = {}, {}, {}
    for shape in a.shapes:
        heads, dim = (int(x) for x in shape.split("x"))
        p, curves[shape], train_s[shape] = train_indexer(a, rng, L, d, heads, dim, hq, hp, tgt,
                                                          valid)
        results[shape] = {name: evaluate(a, p, L, ps, heads, dim, items, f"{shape} {name}")
                          for name, items in sets}
    methods = ("oracle", "oracle_shared", "quest", "indexer")
    print("attention mass kept / needle pages' mass kept, mean over layers, queries, query heads")
    print(f"{'indexer':8} {'set':16} {'budget':>6} " + " ".join(f"{m:>13}" for m in methods))
    for shape, res in results.items():
        for name, r in res.items():
            for b in a.budgets:
                rb = r[str(b)]
                print(f"{shape:8} {name:16} {b:>6} " + " ".join(
                    f"{rb[m]:6.3f}/{rb.get('needle_mass_' + m, float('nan')):6.3f}"
                    for m in methods))
    if a.out:
        meta = dict(device=str(jax.devices()[0]), jax=jax.__version__, commit=commit(),
                    date=time.strftime("%Y-%m-%d %H:%M:%S"), model=path, args=vars(a),
                    train_s=train_s, total_s=time.time() - t_start, curves=curves)
        Path(a.out).write_text(json.dumps(dict(meta, results=results)))


if __name__ == "__main__":
    main()
