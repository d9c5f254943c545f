"""Smoke tests of small benchmark scripts off the GPU (their --quick modes)."""
import json
import re
import os
import subprocess
import shutil
import sys
from pathlib import Path

import pytest

from jaxkv.config import CacheConfig

ROOT = Path(__file__).resolve().parents[1]


def test_bench_matmul_quick(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probes" / "bench_matmul.py"), "--quick",
                    "--shapes", "qwen1.5b", "--batches", "1", "--steps", "1", "--reps", "1",
                    "--out", str(tmp_path)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = json.loads((tmp_path / "bench_matmul.json").read_text())["rows"]
    assert [(r["variant"], r["batch"]) for r in rows] == [("xla", 1)]
    assert rows[0]["us_per_layer"] > 0 and rows[0]["rel_err_vs_xla"] == 0.0


def test_bench_fetch_locality_quick(tmp_path):
    """bench_fetch --only-locality: every source layout moves the right rows."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_fetch.py"), "--quick",
                    "--only-locality", "--out", str(tmp_path)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = json.loads((tmp_path / "bench_fetch_locality.json").read_text())["locality"]
    assert {r["mode"] for r in rows} == {"random", "random_32MiB", "sorted", "contiguous",
                                         "dma_in_program"}
    assert all(r["correct"] for r in rows)


def test_bench_fetch_steady_quick(tmp_path):
    """bench_fetch --only-steady: every fitted loop moved the right rows; the fit is exact
    on a line."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_fetch.py"), "--quick",
                    "--only-steady", "--out", str(tmp_path)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    st = json.loads((tmp_path / "bench_fetch_steady.json").read_text())["steady"]
    (p,) = st["points"]
    for key in ("default", "naive", "dma"):
        assert p[key]["correct"] and len(p[key]["calls"]) == len(st["steps"])
    assert p["dma_gather"]["correct"]
    assert "fetch_us_per_step" in p["interleaved"]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_fetch import fit_line
    a, b, r2 = fit_line([1, 2, 4], [5.0, 7.0, 11.0])
    assert abs(a - 3) < 1e-9 and abs(b - 2) < 1e-9 and abs(r2 - 1) < 1e-9
    # an unknown target or tuning name is an error naming it, not a section that measures nothing
    for opt in ("--steady-targets", "--steady-variants"):
        r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_fetch.py"), "--quick",
                            "--only-steady", opt, "nope", "--out", str(tmp_path)], cwd=ROOT,
                           capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert r.returncode == 2 and f"{opt}: unknown nope" in r.stderr


def test_source_rows_layouts():
    import numpy as np
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_fetch import source_rows
    rng = np.random.default_rng(0)
    for mode, span in (("random", None), ("random", 40), ("sorted", None), ("contiguous", None)):
        tab = source_rows(rng, 1000, 32, 5, mode, span)
        assert tab.shape == (5, 32)
        assert all(len(set(r)) == 32 for r in tab.tolist())
        assert tab.max() < (span or 1000) and tab.min() >= 0
        if mode == "sorted":
            assert (np.diff(tab, axis=1) > 0).all()
        if mode == "contiguous":
            assert (np.sort(tab, axis=1) == np.sort(tab, axis=1)[:, :1] + np.arange(32)).all()


def test_bench_launch_quick(tmp_path):
    """bench_launch --quick: every chain (XLA, Pallas, mixed; PDL on and off) computes right."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probes" / "bench_launch.py"), "--quick",
                    "--out", str(tmp_path)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = json.loads((tmp_path / "bench_launch.json").read_text())["rows"]
    assert len(rows) == 6 and all(r["correct"] and r["us_per_kernel"] > 0 for r in rows)


def test_bench_prefill_attention_quick(tmp_path):
    """bench_prefill_attention --quick: every variant runs, the kernel agrees with the XLA
    reference at the first length."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_prefill_attention.py"),
                    "--quick", "--shapes", "qwen", "--out", str(tmp_path)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = json.loads((tmp_path / "bench_prefill_attention.json").read_text())["rows"]
    assert rows and all(r["ms"] > 0 for r in rows)
    errs = [r["max_abs_err_vs_xla"] for r in rows if "max_abs_err_vs_xla" in r]
    assert errs and max(errs) < 0.1


def test_bench_matmul_l2_quick(tmp_path):
    """bench_matmul --l2: one row per projection with both timings."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probes" / "bench_matmul.py"), "--quick", "--l2",
                    "--shapes", "qwen1.5b", "--batches", "8", "--steps", "1", "--reps", "1",
                    "--out", str(tmp_path)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = json.loads((tmp_path / "bench_matmul_l2.json").read_text())["rows"]
    assert [r["matrix"] for r in rows] == ["wqkv", "wo", "w_gate", "w_down"]
    assert all(r["us_distinct"] > 0 and r["us_shared"] > 0 for r in rows)


def test_bench_ensure_quick(tmp_path):
    """bench_ensure: one row per method, every method sees the same hits and misses."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_ensure.py"), "--quick",
                    "--batch", "2", "--reps", "1", "--variants", "auto,dense,sort",
                    "--out", str(tmp_path)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = json.loads((tmp_path / "bench_ensure.json").read_text())
    rows = out["rows"]
    assert [r["variant"] for r in rows] == ["auto", "dense", "sort"]
    assert all(r["us_per_step"] > 0 for r in rows)
    assert len({(r["hits_per_step"], r["misses_per_step"]) for r in rows}) == 1
    assert out["auto_method"] in ("dense", "sort", "pallas")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_ensure.py"), "--quick",
                        "--variants", "auto,pallas_w4,pallas_x"], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and "unknown variants ['pallas_x']" in r.stderr


def _decode_json(path, commit, cases, lag=0):
    """A minimal bench_decode JSON: cases = [(shape, batch, context, {config: tok/s})]."""
    res = {"commit": commit, "date": "2026-11-30", "device": "cpu", "jax_version": "0",
           "settings": {"selection_lag": lag}, "bulk_h2d_gbps": {"mean": 50.0}, "cases": []}
    for shape, batch, context, toks in cases:
        res["cases"].append({
            "shape": shape, "batch": batch, "context": context,
            "bucket_check": {"compilations": 0},
            "results": [{"config": c, "tokens_per_s": t, "step_ms": 1e3 * batch / t,
                         "hit_rate": 0.99, "pool_fraction_of_logical": 0.05}
                        for c, t in toks.items()]})
    path.write_text(json.dumps(res))
    return str(path)


def test_summarize_grid_merges_runs(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import summarize_grid
    old = _decode_json(tmp_path / "old.json", "aaa", [
        ("qwen1.5b", 1, 32768, {"a": 100.0, "b": 200.0, "c2": 150.0}),
        ("qwen1.5b", 1, 1 << 20, {"b": 180.0, "d": 90.0})])
    new = _decode_json(tmp_path / "new.json", "bbb", [
        ("qwen1.5b", 1, 32768, {"a": 100.0, "b": 250.0, "c2": 240.0})])
    lag = _decode_json(tmp_path / "lag.json", "bbb", [
        ("qwen1.5b", 1, 32768, {"b": 260.0})], lag=1)
    rows = summarize_grid.main([old, new, lag, "--out", str(tmp_path / "grid")])
    got = {(r["context"], r["config"], r["selection_lag"]): r for r in rows}
    assert sorted(got) == [(32768, "a", 0), (32768, "b", 0), (32768, "b", 1),
                           (32768, "c2", 0), (1 << 20, "b", 0), (1 << 20, "d", 0)]
    assert got[(32768, "c2", 0)]["commit"] == "bbb"  # the file named last wins
    assert got[(32768, "c2", 0)]["vs_b"] == 240.0 / 250.0
    assert got[(32768, "c2", 0)]["vs_a"] == 2.4
    assert got[(1 << 20, "d", 0)]["vs_a"] is None  # no dense run at that point
    table = (tmp_path / "grid.md").read_text()
    assert "| qwen1.5b | 1 | 1M | d |" in table and "| b (lag 1) |" in table
    assert json.loads((tmp_path / "grid.json").read_text())["meta"]["commits"] == ["aaa", "bbb"]
    assert (tmp_path / "grid.png").stat().st_size > 0


def test_summarize_grid_reads_printed_tables():
    """A run whose JSON was lost: the summary table bench_decode prints gives the rows."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import summarize_grid
    log = """===== grid-h
bench_decode on gpu:NVIDIA H200 (jax 0.11.2, commit abc1234); bulk H2D 52.8 GB/s; target overlap 0.885
shape     B      ctx cfg     tok/s     step    sel    ens  fetch   attn   rest   hit  GB/s  pool% comp_s
qwen1.5b  8   131072 b      3648.4    2.193   0.75   0.00   0.00   0.50   0.95     -     - 100.00    5.2
qwen1.5b  8   131072 a       949.6    8.425   0.00   0.00   0.00   7.32   1.11     -     - 100.00    3.7
qwen1.5b  8   131072 c1     1773.1    4.512   0.75   0.08   1.77   0.46   1.45 0.917  43.5   3.22    4.8
no recompilation within a bucket: True
"""
    rows = {r["config"]: r for r in summarize_grid.rows_of_log(log, "x.log")}
    assert sorted(rows) == ["a", "b", "c1"]
    c1 = rows["c1"]
    assert (c1["commit"], c1["bulk_gbps"], c1["hit_rate"], c1["fetch_gbps"]) == ("abc1234", 52.8, 0.917, 43.5)
    assert c1["pool_fraction"] == 0.0322 and c1["bucket_compilations"] == 0
    assert c1["vs_b"] == 1773.1 / 3648.4 and rows["b"]["hit_rate"] is None
    # the table as bench_decode prints it now: three roofline columns more
    log18 = "\n".join(
        line + ("  floor roof%  peak%" if line.startswith("shape") else
                "  1.000  45.6  40.1" if line.startswith("qwen1.5b") else "")
        for line in log.splitlines())
    rows = {r["config"]: r for r in summarize_grid.rows_of_log(log18, "x.log")}
    assert sorted(rows) == ["a", "b", "c1"] and rows["c1"]["hit_rate"] == 0.917
    assert rows["c1"]["floor_ms"] == 1.0 and rows["c1"]["fraction_of_roofline"] == 0.456


def test_bench_real_model_quick(tmp_path):
    """bench_real_model --quick on the tiny qwen2 checkpoint: every configuration runs (the
    sparse ones with the library's default selector), the host tier's tokens equal the
    resident cache's."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_real_model.py"), "--quick",
                    "--model", str(ROOT / "tests" / "fixtures" / "hf_qwen2"), "--contexts", "256",
                    "--out", str(tmp_path)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    doc = json.loads((tmp_path / "bench_real_model.json").read_text(),
                     parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert [r["config"] for r in doc["rows"]] == ["dense", "resident", "host"]
    assert [r["selector"] for r in doc["rows"]] == ["dense"] + [CacheConfig().selector] * 2
    assert doc["rows"][0]["hit_rate"] is None  # dense: no lookups
    assert [c["host_equals_resident"] for c in doc["checks"]] == [True]
    host = doc["rows"][2]
    assert 0 < host["hit_rate"] < 1 and host["bytes_host_to_device_per_step"] > 0


def test_bench_cpu_quick(tmp_path):
    """bench_cpu --quick (random tiny model, no transformers): a row per mode with positive
    speeds, the issue's comparison figures recorded, and the markdown table."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cpu.py"), "--quick",
                    "--modes", "resident", "host", "default", "default-xla", "--out", str(tmp_path)],
                   check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
    res = json.loads((tmp_path / "bench_cpu.json").read_text())
    assert [(r["mode"], r["prompt_tokens"]) for r in res["jaxkv"]] == [
        ("resident", 128), ("host", 128), ("default", 128), ("default-xla", 128)]
    assert all(r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
               for r in res["jaxkv"])
    assert [(r["selector"], r["budget_tokens"]) for r in res["jaxkv"]] == [
        ("dense", None), ("quest", 256), ("quest_rescore8", 1024), ("quest_rescore8", 1024)]
    assert res["transformers"]["source"].startswith("issue 34")
    md = (tmp_path / "bench_cpu.md").read_text()
    assert "| resident (dense) | 128 |" in md and "| default (quest_rescore8 1024) | 128 |" in md


def test_fp8_rotation_probe_small(tmp_path):
    """probes/fp8_rotation.py on a short prompt: one row per layer; fp8 errs more than bf16."""
    out = tmp_path / "rot.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probes" / "fp8_rotation.py"),
                    "--tokens", "96", "--queries", "8", "--layers", "4", "--out", str(out)],
                   check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
    d = json.loads(out.read_text())
    assert d["tokens"] == 96 and len(d["layers"]) == 4
    assert d["mean"]["out_rel"] > d["mean"]["out_rel_bf16"] > 0


def test_layer_budget_probe_small(tmp_path):
    """probes/layer_budget.py on a short prompt: a budget of the whole prompt loses nothing; a
    smaller one loses some mass in every layer and more than a larger one on average."""
    out = tmp_path / "lb.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probes" / "layer_budget.py"),
                    "--tokens", "96", "--queries", "8", "--budgets", "32", "64", "128",
                    "--layers", "6", "--out", str(out)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
    d = json.loads(out.read_text())
    assert d["tokens"] == 96 and len(d["layers"]) == 6
    assert all(r["lost_mass_128"] < 1e-6 and r["out_rel_128"] < 1e-5 for r in d["layers"])
    assert all(r["lost_mass_32"] > 0 for r in d["layers"])
    assert d["mean"]["lost_mass_32"] > d["mean"]["lost_mass_64"] > 0


def test_trained_indexer_probe_small(tmp_path):
    """probes/trained_indexer.py on short windows: the loss falls; a budget of the whole window
    keeps every method's mass; at a smaller one the per-KV-head oracle keeps the most."""
    out = tmp_path / "ti.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probes" / "trained_indexer.py"),
                    "--tokens", "256", "--train-seqs", "2", "--eval-seqs", "1", "--queries", "16",
                    "--steps", "30", "--shapes", "2x16", "--budgets", "64", "256",
                    "--out", str(out)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
    d = json.loads(out.read_text())
    curve = d["curves"]["2x16"]
    assert curve[-1][1] < curve[0][1]
    res = d["results"]["2x16"]["essays_heldout"]
    methods = ("oracle", "oracle_shared", "quest", "indexer")
    assert all(abs(res["256"][m] - 1.0) < 1e-5 for m in methods)
    assert all(res["64"]["oracle"] >= res["64"][m] - 1e-6 for m in methods)
    assert all(0.0 < res["64"][m] < 1.0 for m in methods)


def test_bench_context_quick(tmp_path):
    """bench_context --quick (the tiny checkpoint): a row per cache and turn, the continued
    turn giving the fresh prompt's tokens, and the markdown table."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_context.py"), "--quick",
                    "--out", str(tmp_path)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
    res = json.loads((tmp_path / "bench_context.json").read_text())
    assert [(r["mode"], r["turn_tokens"]) for r in res["rows"]] == [
        ("default", 8), ("default", 40), ("dense", 8), ("dense", 40)]
    assert all(r["same_tokens"] and r["continued"]["wall_s"] > 0 for r in res["rows"])
    assert "| default (quest_rescore8) | 96 | 8 |" in (tmp_path / "bench_context.md").read_text()


def test_first_stage_recall_probe_small(tmp_path):
    """probes/first_stage_recall.py on a short prompt: candidates covering every page keep the
    oracle's mass at every block size, and with the first stage a step early; fewer keep at
    most that; both stages a step early keep at most the oracle's mass too."""
    rows = {}
    for cand in (4, 2):
        out = tmp_path / f"fsr{cand}.json"
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probes" / "first_stage_recall.py"),
                        "--tokens", "256", "--queries", "8", "--budget", "64", "--candidates",
                        str(cand), "--blocks", "1", "2", "4", "--layers", "3", "--lag", "none",
                        "first", "all", "--out", str(out)],
                       check=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
        rows[cand] = json.loads(out.read_text())
    assert rows[4]["tokens"] == 256 and len(rows[4]["layers"]) == 3
    for r in (1, 2, 4):
        for lag in ("", "_lagfirst"):
            mean = rows[4]["mean"]
            assert abs(mean[f"kept_r{r}{lag}"] - 1) < 1e-6 and mean[f"hit_r{r}{lag}"] == 1
        for lag in ("", "_lagfirst", "_lagall"):
            mean = rows[2]["mean"]
            assert 0 < mean[f"kept_r{r}{lag}"] <= 1 + 1e-6 and mean[f"hit_r{r}{lag}"] <= 1
        assert 0 < rows[4]["mean"][f"kept_r{r}_lagall"] <= 1 + 1e-6
    # the shares of all the attention: the oracle's at most 1, a covering first stage's equal
    for cand in (4, 2):
        mean = rows[cand]["mean"]
        assert 0 < mean["share_r1"] <= mean["oracle_share"] + 1e-6 <= 1 + 2e-6
    assert abs(rows[4]["mean"]["share_r1"] - rows[4]["mean"]["oracle_share"]) < 1e-6


def test_needle_recall_probe_small(tmp_path):
    """probes/needle_recall.py on a quick RULER case: a budget that covers the prompt keeps all
    of the needle's attention and all of the attention; a smaller one keeps at most that."""
    out = {}
    for budget in (512, 64):
        path = tmp_path / f"nr{budget}.json"
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probes" / "needle_recall.py"),
                        "--data", str(ROOT / "benchmarks" / "quality_data"), "--set", "quick",
                        "--length", "512", "--case", "niah_single_1/0", "--page-sizes", "16", "32",
                        "--budget", str(budget), "--out", str(path)],
                       check=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu",
                                                  "PYTHONPATH": f"{ROOT}:{ROOT / 'benchmarks' / 'probes'}"})
        out[budget] = json.loads(path.read_text())
    row = out[512]["layers"][0]
    assert row["layer"] == "niah_single_1/0" and row["needle_tokens"] > 0
    assert row["needle_attention"] > 0
    for ps in (16, 32):
        assert abs(row[f"needle_kept_p{ps}"] - 1) < 1e-5 and abs(row[f"share_p{ps}"] - 1) < 1e-5
        small = out[64]["layers"][0]
        assert 0 < small[f"share_p{ps}"] < 1
        assert 0 <= small[f"needle_kept_p{ps}"] <= 1 + 1e-6


def _docs_text(history=True):
    """The docs' text; ``history=False`` leaves out docs/benchmark-log.md, whose old entries
    name files deleted since."""
    docs = [ROOT / "BENCHMARKS.md", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "\n".join(p.read_text() for p in docs if history or p.name != "benchmark-log.md")


def test_every_result_file_is_cited_by_a_doc():
    """benchmarks/results/ holds only files a doc names: whole, or as ``stem.{json,md}`` /
    ``stem.md`` / ``.json``."""
    text = _docs_text()
    orphans = []
    for path in sorted((ROOT / "benchmarks" / "results").iterdir()):
        stem = path.name.split(".")[0]
        cited = path.name in text or re.search(re.escape(stem) + r"\.(\{|json|md|png|csv)",
                                                text)
        if not cited:
            orphans.append(path.name)
    assert not orphans, f"result files no doc cites (cite them or delete them): {orphans}"


def test_result_paths_in_the_docs_exist():
    """Every ``benchmarks/results/NAME`` a current doc writes out (braces expanded) is in the
    repo."""
    text = _docs_text(history=False)
    missing = []
    for m in re.finditer(r"benchmarks/results/([\w.\-]+(?:\{[\w,]+\})?)", text):
        name = m.group(1).rstrip(".")
        brace = re.search(r"\{([\w,]+)\}", name)
        names = ([name[:brace.start()] + alt + name[brace.end():] for alt in brace.group(1).split(",")]
                 if brace else [name])
        missing += [n for n in names if "." in n and not (ROOT / "benchmarks" / "results" / n).exists()]
    assert not missing, f"docs cite result files that are not in the repo: {sorted(set(missing))}"


def test_carry_pieces_split_keep_join(tmp_path):
    """carry_pieces.sh: a file split into pieces, each kept as a device call would, joins to
    the same bytes with its sha256 checked; a missing piece or a wrong sha256 fails naming
    it."""
    script = ROOT / "benchmarks" / "carry_pieces.sh"
    env = {**os.environ, "JAXKV_PIECES_DIR": str(tmp_path / "pieces"),
           "JAXKV_PIECES_KEEP": str(tmp_path / "keep")}
    data = os.urandom(2 * 1048576 + 12345)
    (tmp_path / "w.bin").write_bytes(data)

    def sh(*args, ok=True):
        r = subprocess.run(["bash", str(script), *map(str, args)], env=env, capture_output=True,
                           text=True)
        assert (r.returncode == 0) == ok, r.stdout + r.stderr
        return r.stdout + r.stderr

    assert "3 pieces of at most 1 MiB" in sh("split", tmp_path / "w.bin", 1)
    sha = (tmp_path / "pieces" / "w.bin" / "sha256").read_text().strip()
    parts = sorted((tmp_path / "pieces" / "w.bin").glob("p*.d"))
    assert [p.name for p in parts] == ["p00.d", "p01.d", "p02.d"]
    for p in (parts[0], parts[2]):
        sh("keep", p)
    assert "piece" in sh("join", "w.bin", tmp_path / "out", sha, ok=False)   # p01 missing
    sh("keep", parts[1])
    assert "sha256 ok" in sh("join", "w.bin", tmp_path / "out", sha)
    assert (tmp_path / "out").read_bytes() == data
    assert "want 00" in sh("join", "w.bin", tmp_path / "out", "00", ok=False)


def test_carry_pieces_aside_and_back(tmp_path):
    """carry_pieces.sh aside moves the tracked result files but the kept ones out of the tree
    (in a scratch repository) and back brings them back; a second aside before back is refused,
    and back never overwrites."""
    repo = tmp_path / "repo"
    (repo / "benchmarks" / "results").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "carry_pieces.sh", repo / "benchmarks")
    res, aside = repo / "benchmarks" / "results", repo / ".devout" / "results_aside"
    for name in ("a.json", "b.md", "keep.json"):
        (res / name).write_text(name * 1000)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)

    def sh(*args, ok=True):
        r = subprocess.run(["bash", str(repo / "benchmarks" / "carry_pieces.sh"), *map(str, args)],
                           capture_output=True, text=True)
        assert (r.returncode == 0) == ok, r.stdout + r.stderr
        return r.stdout + r.stderr

    out = sh("aside", "benchmarks/results/keep.json")
    assert "moved 2 result files" in out and "pieces are 59 MiB" in out, out
    assert sorted(p.name for p in res.iterdir()) == ["keep.json"]
    assert sorted(p.name for p in aside.iterdir()) == ["a.json", "b.md"]
    assert "already holds files" in sh("aside", ok=False)
    (res / "a.json").write_text("new")             # a file of the same name made meanwhile
    assert "left" in sh("back", ok=False)
    assert (res / "a.json").read_text() == "new" and (aside / "a.json").exists()
    (res / "a.json").unlink()
    assert "moved 1 result files back" in sh("back")
    assert sorted(p.name for p in res.iterdir()) == ["a.json", "b.md", "keep.json"]
    assert not aside.exists() and "nothing aside" in sh("back")


class _Parsed(Exception):
    """Raised in place of returning from ``parse_args``: the command line parsed."""


def _parse_only(script: str, argv: list) -> str:
    """Run ``script``'s ``main()`` with ``argv`` up to its ``parse_args`` and stop there: ""
    when the command line parses, else argparse's error."""
    import argparse
    import contextlib
    import importlib.util
    import io

    path = ROOT / script
    if not path.is_file():
        return f"no such script {script}"
    sys.path.insert(0, str(path.parent))  # as `python3 path` does: the script's folder first
    spec = importlib.util.spec_from_file_location(f"_cmdline_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    real = argparse.ArgumentParser.parse_args

    def parse(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    err, argv0 = io.StringIO(), sys.argv
    sys.argv, argparse.ArgumentParser.parse_args = [str(path), *argv], parse
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            mod.main()
    except _Parsed:
        return ""
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1]
    finally:
        sys.argv, argparse.ArgumentParser.parse_args = argv0, real
    return "main() returned without parsing its arguments"


def _suite_argvs(tmp_path, stages, env=()):
    """(exit status, stderr, the command lines gpu_suite.sh runs with $PY) for ``stages``: a
    stand-in $PY records its arguments instead of running them (``$PY -c`` prints 2, the
    device count the tp stages read)."""
    log = tmp_path / "argv.log"
    py = tmp_path / "py.sh"
    py.write_text('#!/usr/bin/env bash\nif [ "$1" = -c ]; then case $2 in *device_count*) '
                  'echo 2 ;; *pytest_timeout*) exit 1 ;; esac; exit 0; fi\n'
                  f'printf "%s\\0" "$@" >> {log}; echo >> {log}\n')
    py.chmod(0o755)
    smi = tmp_path / "bin" / "nvidia-smi"   # the env / topo stages fail without it
    smi.parent.mkdir(exist_ok=True)
    smi.write_text("#!/usr/bin/env bash\necho stand-in\n")
    smi.chmod(0o755)
    log.write_text("")
    r = subprocess.run(["bash", "benchmarks/gpu_suite.sh", str(tmp_path / "suite"), *stages],
                       cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PATH": f"{smi.parent}:{os.environ['PATH']}",
                            "PY": str(py), "TEST_FILES": "tests/test_bench_scripts.py",
                            "QUALITY_GGUF": "model.gguf", **dict(env)})
    argvs = [line.strip("\0").split("\0") for line in log.read_text().splitlines() if line]
    return r.returncode, r.stderr, argvs


def _check_argv(argv, where):
    """Problems of one Python command line: its script's parser refuses it, or pytest's paths
    are missing."""
    if argv[:2] == ["-m", "pytest"]:
        return [f"{where}: no {p}" for p in argv[2:] if p.startswith("tests")
                and not (ROOT / p).exists()]
    err = _parse_only(argv[0], argv[1:])
    return [f"{where}: {' '.join(argv)}: {err}"] if err else []


def test_documented_commands_parse(tmp_path):
    """Every command of BENCHMARKS.md's Commands section and every gpu_suite.sh stage passes
    options its script's parser takes (ab_step's --variants of VARIANTS, bench_decode's
    --configs, ...), names stages gpu_suite.sh has and files that exist. Nothing runs: each
    script stops at parse_args, gpu_suite.sh runs a stand-in $PY."""
    import shlex
    environ, path = dict(os.environ), list(sys.path)
    problems = []
    try:
        suite = (ROOT / "benchmarks" / "gpu_suite.sh").read_text()
        stages = [s for m in re.finditer(r"^    ([a-z0-9|-]+)\)", suite, re.M)
                  for s in m.group(1).split("|")]
        rc, err, argvs = _suite_argvs(tmp_path, stages)
        assert rc == 0 and len(argvs) > len(stages), err
        for argv in argvs:
            problems += _check_argv(argv, "gpu_suite.sh")
        md = (ROOT / "BENCHMARKS.md").read_text().split("\n## Commands", 1)[1]
        block = md.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
        for line in block.splitlines():
            words = shlex.split(re.sub(r"\$\([^)]*\)", "X", line), comments=True)
            env = []
            while words and re.match(r"\w+=", words[0]):
                env.append(words.pop(0).split("=", 1))
            if not words:
                continue
            if words[0] == "bash":
                # bash SCRIPT OUT stages...; gpu_pair.sh: one quoted list of stages per GPU
                lists = ([words[3:]] if words[1].endswith("gpu_suite.sh") else
                         [w.split() for w in words[3:]])
                for stages in lists:
                    rc, err, argvs = _suite_argvs(tmp_path, stages, env)
                    problems += [f"BENCHMARKS.md: {line.strip()}: {err.strip()}"] if rc else []
                    for argv in argvs:
                        problems += _check_argv(argv, f"BENCHMARKS.md via {' '.join(words[1:])}")
            else:
                assert words[0].startswith("python"), line
                problems += _check_argv(words[1:], "BENCHMARKS.md")
    finally:
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = path
    assert not problems, "\n".join(problems)


def test_suite_env_fails_without_nvidia_smi(tmp_path):
    """The env stage is the first check of a GPU call: without nvidia-smi it reports failure
    instead of printing JAX's devices and exiting 0."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for tool in ("bash", "timeout", "tail", "date", "mkdir", "sed", "tr", "git", "printf"):
        real = shutil.which(tool)
        if real:
            (bin_ / tool).symlink_to(real)
    r = subprocess.run(["bash", "benchmarks/gpu_suite.sh", str(tmp_path / "suite"), "env"],
                       cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PATH": str(bin_), "PY": "true"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "env        rc=127" in r.stdout, r.stdout
