"""What the two-stage selector's first stage keeps when it bounds blocks of pages
(``CacheConfig.candidate_block``, issue 27's cost): on a real model and real text, per layer,
the attention mass the two-stage selection keeps against an exact page oracle's, for Quest's
bound per page (r = 1, the selector's default) and per block of r pages. CPU, float32.

Per layer: the model's own q / k (prefill of ``--tokens`` tokens of Paul Graham's essays),
the last ``--queries`` positions. For each query position and KV head, with the selector's
rules (the sink page and the query's own page forced, Quest's bound summed over the head's
query group):

- the oracle keeps the ``budget / page_size`` pages of most attention mass (the ``oracle``
  selector's page score, summed over the group) of all pages;
- the first stage keeps ``candidates / r`` blocks of r pages by Quest's bound over each
  block's keys (up to the query), and the second stage the ``budget / page_size`` candidate
  pages of most mass (an exact second stage: the selector's int8 key copy is close to it);
- ``kept``: the two-stage selection's mass over the oracle's (1 = the oracle's pages' mass);
  ``hit``: the share of the oracle's pages among the candidates; ``share`` / ``oracle_share``:
  the two-stage selection's / the oracle's mass over all of the attention (comparable across
  page sizes, where ``kept`` is not);
- ``--groups max``: the first stage scores a block by the largest bound of the KV head's
  query heads instead of their sum (keys ``kept_r{r}_gmax``...), ``union``: half the
  candidates by the sum, half by the max among the rest; ``--recent N``: the blocks of
  the last N pages forced into the candidates (keys ``..._w{N}``); ``--lag first``: the first
  stage a step early (the previous position's query and keys, the query's own page forced;
  a candidate set the selector could compute off the step's critical path), the second
  stage on the query; ``--lag all``: both stages a step early, as ``selection_lag=1``
  (keys ``..._lagfirst`` / ``..._lagall``); ``--pieces S``: the first stage's top-k in S
  pieces of each row, each piece keeping ``candidates / S`` blocks (no merge: a cheaper
  top-k, S programs per row), the pieces strided (block b in piece b mod S) or contiguous
  (``--piece-order``; keys ``..._s{S}`` / ``..._sc{S}``).

The masses rank first stages and page sizes within one model; they are not a forecast of
RULER's retrievals: RULER lost 0.8 points to 64-token pages on SmolLM2 and 6.4 on Qwen2.5,
where ``share`` fell by 3.5 and 2.5 points (docs/decisions.md has that and two more cases).

    PYTHONPATH=.:benchmarks/probes JAX_PLATFORMS=cpu python benchmarks/probes/first_stage_recall.py \\
        --gguf FILE --tokens 8192 --budget 512 --candidates 8 --blocks 1 2 4 --out OUT.json
"""
import argparse
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from _probe import layer_qkv, print_row, report
from jaxkv.models import gguf_loader
from jaxkv.selectors import oracle


def _outward(mx, mn, fmt):
    """The block summaries as a first stage would store them in ``fmt``, rounded outward so the
    bound stays a bound: ``mx`` up, ``mn`` down. "f32": as they are; "bf16" / "fp8" (e4m3fn):
    the nearest value of the format at or above / below (from the sorted table of its finite
    values); "int8": one scale per block and KV head (its largest |value| over 127), the
    values ceil / floor of x / scale; "int8p2": that scale rounded up to a power of two
    (``_quest_scores`` takes "int8p2s" as "int8p2" of the keys less their mean)."""
    if fmt == "f32":
        return mx, mn
    if fmt in ("int8", "int8p2"):
        s = jnp.maximum(jnp.max(jnp.maximum(jnp.abs(mx), jnp.abs(mn)), axis=-1, keepdims=True),
                        1e-30) / 127.0
        if fmt == "int8p2":  # the smallest power of two at or above
            s = jnp.exp2(jnp.ceil(jnp.log2(s)))
        return jnp.ceil(mx / s) * s, jnp.floor(mn / s) * s
    dt = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}[fmt]
    bits = np.arange(2 ** (16 if fmt == "bf16" else 8), dtype=np.uint16 if fmt == "bf16" else np.uint8)
    vals = bits.view(np.dtype(dt)).astype(np.float32)
    table = jnp.asarray(np.unique(vals[np.isfinite(vals)]))
    up = table[jnp.clip(jnp.searchsorted(table, mx, side="left"), 0, table.size - 1)]
    down = table[jnp.clip(jnp.searchsorted(table, mn, side="right") - 1, 0, table.size - 1)]
    return up, down


def _quest_scores(q, k, pos, bs, group="sum", dims=0, fmt="f32"):
    """Quest's bound per block of ``bs`` tokens for one query: q [Hq, D] at position ``pos``,
    k [T, H, D] (T a multiple of bs). ``group``: the bounds of a KV head's query heads summed
    (the selector's score) or their largest ("max"). ``dims`` > 0: the bound over the
    ``dims`` channels of each KV head where its query group's |q| sums largest only (the
    summaries a first stage would read). Returns [H, T / bs], -inf on blocks past ``pos``."""
    T, H, D = k.shape
    G = q.shape[0] // H
    if fmt.endswith("s"):  # bounds of the keys less their mean (every page's score moves alike)
        k, fmt = k - k.mean(axis=0, keepdims=True), fmt[:-1]
    valid = (jnp.arange(T) <= pos)[:, None, None]
    kb = k.reshape(T // bs, bs, H, D)
    vb = valid.reshape(T // bs, bs, 1, 1)
    mx = jnp.max(jnp.where(vb, kb, -jnp.inf), axis=1)                  # [Nb, H, D]
    mn = jnp.min(jnp.where(vb, kb, jnp.inf), axis=1)
    ok = jnp.isfinite(mx[:, 0, 0])
    mx, mn = jnp.where(ok[:, None, None], mx, 0.0), jnp.where(ok[:, None, None], mn, 0.0)
    mx, mn = _outward(mx, mn, fmt)
    qg = q.reshape(H, G, D)
    per = jnp.maximum(qg[None] * mx[:, :, None], qg[None] * mn[:, :, None])  # [Nb, H, G, D]
    if dims:
        keep = jax.lax.top_k(jnp.abs(qg).sum(axis=1), dims)[1]                # [H, dims]
        mask = jnp.zeros((H, D), per.dtype).at[jnp.arange(H)[:, None], keep].set(1.0)
        per = per * mask[None, :, None, :]
    s = per.sum(axis=3)
    s = s.sum(axis=2) if group == "sum" else s.max(axis=2)             # [Nb, H]
    return jnp.where(ok[:, None], s, -jnp.inf).T                      # [H, Nb]


def _pieces_top(s, n, pieces, order):
    """The indices of the top ``n`` of [H, N] scores taken as the top ``n / pieces`` of each of
    ``pieces`` pieces of a row (block b in piece b mod pieces for "strided", piece b // ceil(N /
    pieces) for "contiguous"): [H, n] (padding never picked while a piece has enough blocks)."""
    H, N = s.shape
    P = pieces
    Ns = -(-N // P)
    x = jnp.pad(s, ((0, 0), (0, Ns * P - N)), constant_values=-jnp.inf)
    if order == "strided":
        x = x.reshape(H, Ns, P).transpose(0, 2, 1)                       # [H, P, Ns]
    else:
        x = x.reshape(H, P, Ns)
    i = jax.lax.top_k(x, n // P)[1]                                      # [H, P, n / P]
    p = jnp.arange(P)[None, :, None]
    idx = i * P + p if order == "strided" else p * Ns + i
    return jnp.minimum(idx, N - 1).reshape(H, -1)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13))
def recall(q, k, t0, page_size, n_pages, n_cand, r, group="sum", recent=0, lag="none", dims=0,
           pieces=1, order="strided", fmt="f32"):
    """q [Q + 1, Hq, D] at positions t0 - 1.., k [T, H, D] -> (kept, hit, share, oracle_share),
    each [Q, H], for
    the queries at t0.. with blocks of ``r`` pages, ``n_cand`` candidate pages and ``n_pages``
    selected; the blocks of the last ``recent`` pages before the query's own forced into the
    candidates. ``lag``: "first": the first stage runs a step early (the previous query, the
    keys up to it, the query's own page forced), the second stage on the query itself;
    "all": both stages a step early (``selection_lag=1``); "none": both on the query.
    ``dims``: the first stage's bound over that many channels (:func:`_quest_scores`).
    ``pieces``: the first stage's top-k per piece of the row (:func:`_pieces_top`).
    ``fmt``: the first stage's summaries stored in that format (:func:`_outward`)."""
    qp, q = q[:-1], q[1:]
    Q, Hq, D = q.shape
    T, H, _ = k.shape
    bs = page_size * r
    Tp = -(-T // bs) * bs
    kp = jnp.pad(k, ((0, Tp - T), (0, 0), (0, 0)))
    Np = Tp // page_size
    keys = kp.reshape(Np, page_size, H, D)
    qpos = t0 + jnp.arange(Q, dtype=jnp.int32)

    def one(args):
        qi, qprev, pos = args
        mass = oracle.attention_mass(qi[None], keys[None], pos[None], page_size)[0]  # [H, Np]
        q1, pos1 = (qprev, pos - 1) if lag != "none" else (qi, pos)     # the first stage's
        page = jnp.arange(Np)
        valid = page <= pos // page_size
        forced = (page == 0) | (page == pos // page_size)
        m = jnp.where(forced, jnp.inf, jnp.where(valid, mass, -jnp.inf))
        top = jax.lax.top_k(m, n_pages)[1]                              # [H, n_pages]
        best = jnp.zeros((H, Np), bool).at[jnp.arange(H)[:, None], top].set(True) & valid
        blk = jnp.arange(Np // r)
        near = (blk * r + r > pos // page_size - recent) & (blk <= pos // bs)
        forced_b = (blk == 0) | (blk == pos // bs) | near
        n_b = max(n_cand // r, 1)

        def top(s, n, taken):
            s = jnp.where(taken, -jnp.inf, jnp.where(forced_b, jnp.inf, s))
            if pieces > 1:
                cb = _pieces_top(s, n, pieces, order)
            else:
                cb = jax.lax.top_k(s, n)[1]
            return jnp.zeros((H, Np // r), bool).at[jnp.arange(H)[:, None], cb].set(True)

        if group == "union":  # half by the summed bound, half by the largest head's
            first = top(_quest_scores(q1, kp, pos1, bs, "sum", dims, fmt), n_b // 2, False)
            cand_b = first | top(_quest_scores(q1, kp, pos1, bs, "max", dims, fmt), n_b - n_b // 2,
                                 first)
        else:
            cand_b = top(_quest_scores(q1, kp, pos1, bs, group, dims, fmt), n_b, False)
        cand = jnp.repeat(cand_b, r, axis=1) & valid
        if lag == "all":  # the second stage's masses from the previous query too
            mp = oracle.attention_mass(qprev[None], keys[None], pos1[None], page_size)[0]
            m2 = jnp.where(cand, jnp.where(forced, jnp.inf, mp), -jnp.inf)
        else:
            m2 = jnp.where(cand, m, -jnp.inf)
        top2 = jax.lax.top_k(m2, n_pages)[1]
        sel = jnp.zeros((H, Np), bool).at[jnp.arange(H)[:, None], top2].set(True) & cand
        got, ceiling = (jnp.sum(jnp.where(s, mass, 0.0), -1) for s in (sel, best))
        total = jnp.sum(jnp.where(valid, mass, 0.0), -1)              # all the attention
        hit = jnp.sum(best & cand, -1) / jnp.sum(best, -1)
        return got / ceiling, hit, got / total, ceiling / total

    return jax.lax.map(one, (q, qp, qpos))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--budget", type=int, default=512, help="selected tokens per KV head")
    ap.add_argument("--candidates", type=int, default=8, help="first-stage pages / budget pages")
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--groups", nargs="+", default=["sum"], choices=("sum", "max", "union"),
                    help="a KV head's query heads' bounds summed (the selector's) or their max")
    ap.add_argument("--recent", type=int, nargs="+", default=[0],
                    help="the last N pages forced into the candidates (keys ..._w{N})")
    ap.add_argument("--lag", nargs="+", default=["none"], choices=("none", "first", "all"),
                    help="first: the first stage a step early (the previous query), the "
                         "second on the query; all: both a step early (keys ..._lag{first,all})")
    ap.add_argument("--dims", type=int, nargs="+", default=[0],
                    help="the first stage's bound over the N channels of largest |q| per KV "
                         "head (0: all; keys ..._d{N})")
    ap.add_argument("--pieces", type=int, nargs="+", default=[1],
                    help="the first stage's top-k per piece: S pieces of a row, candidates / S "
                         "each (keys ..._s{S} strided, ..._sc{S} contiguous)")
    ap.add_argument("--summary", nargs="+", default=["f32"], choices=("f32", "bf16", "fp8", "int8", "int8p2", "int8p2s"),
                    help="the first stage's summaries stored in this format, rounded outward "
                         "(keys ..._{bf16,fp8,int8,int8p2}; int8p2s: of the keys less their mean)")
    ap.add_argument("--piece-order", default="strided", choices=("strided", "contiguous"))
    ap.add_argument("--layers", type=int, default=None, help="the first N layers only")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    path = a.gguf or str(gguf_loader.default_model_path())
    n_pages = a.budget // a.page_size
    n_cand = n_pages * a.candidates
    rows = []
    for i, q, k, _ in layer_qkv(path, a.tokens, a.layers):
        T = k.shape[0]
        t0 = T - a.queries
        row = dict(layer=i)
        for g, r, w, lag, nd, ps, fm in itertools.product(a.groups, a.blocks, a.recent, a.lag,
                                                          a.dims, a.pieces, a.summary):
            kept, hit, share, oracle_share = recall(q[t0 - 1:], k, t0, a.page_size, n_pages,
                                                    n_cand, r, g, w, lag, nd, ps, a.piece_order,
                                                    fm)
            tag = (f"r{r}" + ("" if g == "sum" else f"_g{g}") + (f"_w{w}" if w else "")
                   + ("" if lag == "none" else f"_lag{lag}") + (f"_d{nd}" if nd else "")
                   + ("" if ps == 1 else
                      f"_s{ps}" if a.piece_order == "strided" else f"_sc{ps}")
                   + ("" if fm == "f32" else f"_{fm}"))
            row[f"kept_{tag}"] = float(jnp.mean(kept))
            row[f"kept_min_{tag}"] = float(jnp.min(kept))
            row[f"hit_{tag}"] = float(jnp.mean(hit))
            row[f"share_{tag}"] = float(jnp.mean(share))
        row["oracle_share"] = float(jnp.mean(oracle_share))  # the same for every variant
        rows.append(row)
        print_row(row)
    report(rows, a.out, model=path, tokens=T, queries=a.queries, page_size=a.page_size,
           budget=a.budget, candidates=n_cand, blocks=a.blocks, groups=a.groups,
           recent=a.recent, lag=a.lag, dims=a.dims, pieces=a.pieces,
           piece_order=a.piece_order, summary=a.summary)


if __name__ == "__main__":
    main()
