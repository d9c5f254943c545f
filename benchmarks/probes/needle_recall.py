"""How much of the attention on a RULER case's needle the pages of a budget still hold, by page
size: a CPU proxy for what RULER loses to a page size, on the cases themselves.

For each case (``--data``, as ``bench_quality.py --prepare`` writes them): the prompt, then the
first expected answer teacher-forced (`` " " + outputs[0]``), through the model in float32.
At the positions that predict the answer's tokens, per layer and KV head, with the attention
summed over the head's query group:

- ``needle``: the attention on the needle's tokens (each expected string's tokens where the
  prompt holds it, ``answer_tokens`` of the case);
- per page size: the page oracle's selection (the ``budget / page_size`` pages of most mass,
  the first page and the query's own page forced, as the selectors force them), and
  ``needle_kept_p{ps}``: the needle's attention on those pages over all of the needle's
  attention, summed over layers, heads and positions (so the heads that read the needle
  weigh most); ``share_p{ps}``: the selection's mass over all of the attention (the
  ``first_stage_recall.py`` figure); ``needle_kept_min_p{ps}``: the least kept over the
  (layer, head, position) triples whose needle attention is at least ``--min-needle``.

The oracle stands for the selectors (the two-stage first stage keeps about 99% of its mass:
``first_stage_recall.py``), so the figures are the page size's own.

    PYTHONPATH=.:benchmarks/probes JAX_PLATFORMS=cpu python benchmarks/probes/needle_recall.py \\
        --gguf FILE --data DIR --length 8192 --case niah_multikey_2/3 --case vt/0 --out OUT.json
"""
import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from _probe import model_qkv, print_row, report
from jaxkv.models import gguf_loader
from jaxkv.selectors.oracle import attention_mass
from jaxkv.models.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_quality import load_cases  # noqa: E402  (benchmarks/)


def token_mass(q, k, qpos):
    """Attention of the queries at ``qpos`` [Q] on every key: q [T, Hq, D], k [T, H, D] ->
    [Q, H, T] float32, summed over each KV head's query group (causal): the oracle
    selector's page mass with one-token pages."""
    keys = k[None, :, None]                                               # [1, T, 1, H, D]
    return jax.vmap(lambda qi, p: attention_mass(qi[None], keys, p[None], 1)[0])(q[qpos], qpos)


def kept_by_pages(mass, needle, qpos, page_size: int, n_pages: int):
    """The page oracle's selection of ``n_pages`` pages per query and head (the first page and
    the query's own forced): (needle attention kept [Q, H], all attention kept [Q, H])."""
    Q, H, T = mass.shape
    Tp = -(-T // page_size) * page_size
    pm = jnp.pad(mass, ((0, 0), (0, 0), (0, Tp - T))).reshape(Q, H, -1, page_size)
    page_mass = jnp.sum(pm, -1)                                            # [Q, H, Np]
    page = jnp.arange(Tp // page_size)
    own = (qpos // page_size)[:, None, None]
    valid = page[None, None] <= own
    forced = (page[None, None] == 0) | (page[None, None] == own)
    score = jnp.where(forced, jnp.inf, jnp.where(valid, page_mass, -jnp.inf))
    top = jax.lax.top_k(score, min(n_pages, page.size))[1]
    sel = jnp.zeros(page_mass.shape, bool).at[
        jnp.arange(Q)[:, None, None], jnp.arange(H)[None, :, None], top].set(True) & valid
    keep = jnp.repeat(sel, page_size, axis=-1)[..., :T]
    return jnp.sum(jnp.where(keep & needle, mass, 0.0), -1), jnp.sum(jnp.where(keep, mass, 0.0), -1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--data", required=True, help="prepared RULER cases (bench_quality --prepare)")
    ap.add_argument("--set", default="full", help="the cases' set (bench_quality's 'quick' or 'full')")
    ap.add_argument("--length", type=int, required=True)
    ap.add_argument("--case", action="append", required=True, help="TASK/INDEX (repeatable)")
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--budget", type=int, default=1024, help="selected tokens per KV head")
    ap.add_argument("--min-needle", type=float, default=0.1,
                    help="needle attention (of a group's summed mass) that makes a triple count "
                         "for needle_kept_min")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    path = a.gguf or str(gguf_loader.default_model_path())
    tok = load_tokenizer(path)
    cfg, params = gguf_loader.load_gguf(path, dtype="float32")
    cases, _ = load_cases(a.data, a.set)
    by_key = {(c["task"], int(c["index"])): c for c in cases if int(c["length"]) == a.length}
    rows = []
    for spec in a.case:
        task, index = spec.rsplit("/", 1)
        c = by_key.get((task, int(index)))
        if c is None:
            raise SystemExit(f"--case {spec}: no such case at {a.length} tokens in {a.data}")
        outputs, starts = list(c["outputs"]), list(c["answer_tokens"])
        prompt = list(c["ids"])
        answer = tok.encode(" " + outputs[0])
        ids = prompt + answer
        T = len(ids)
        needle = np.zeros(T, bool)
        for o, p in zip(outputs, starts):
            if p >= 0:
                needle[p:p + len(tok.encode(" " + o))] = True
        qpos = jnp.arange(len(prompt) - 1, T - 1, dtype=jnp.int32)
        needle_j = jnp.asarray(needle)
        tot = dict(needle=0.0)
        kept = {ps: 0.0 for ps in a.page_sizes}
        share = {ps: [] for ps in a.page_sizes}
        worst = {ps: 1.0 for ps in a.page_sizes}
        for layer, q, k, _ in model_qkv(cfg, params, ids, dense_max=0):  # key blocks: less memory
            mass = token_mass(q, k, qpos)                                       # [Q, H, T]
            nd = jnp.sum(jnp.where(needle_j, mass, 0.0), -1)                    # [Q, H]
            tot["needle"] += float(jnp.sum(nd))
            G = q.shape[1] // k.shape[1]
            for ps in a.page_sizes:
                nk, allk = kept_by_pages(mass, needle_j, qpos, ps, a.budget // ps)
                kept[ps] += float(jnp.sum(nk))
                share[ps].append(float(jnp.mean(allk)) / G)
                big = nd >= a.min_needle * G
                if bool(jnp.any(big)):
                    worst[ps] = min(worst[ps], float(jnp.min(jnp.where(big, nk / nd, 1.0))))
        row = dict(case=spec, tokens=T, answer=outputs[0], needle_tokens=int(needle.sum()),
                   needle_attention=tot["needle"])
        for ps in a.page_sizes:
            row[f"needle_kept_p{ps}"] = kept[ps] / max(tot["needle"], 1e-30)
            row[f"needle_kept_min_p{ps}"] = worst[ps]
            row[f"share_p{ps}"] = float(np.mean(share[ps]))
        rows.append(row)
        print_row(row)
    # report() averages every figure but "layer": here the case names it
    report([dict(layer=r["case"], **{k: v for k, v in r.items() if not isinstance(v, str)})
            for r in rows], a.out, model=path, length=a.length, budget=a.budget,
           page_sizes=a.page_sizes, min_needle=a.min_needle, answers={r["case"]: r["answer"] for r in rows})


if __name__ == "__main__":
    main()
