"""The decode benchmark off the GPU (benchmarks/decode_lib.py and its command line
bench_decode.py): the quick run, and what its JSON keeps when a configuration fails part-way
through a point (the figures already measured stay)."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import decode_lib  # benchmarks/ (tests/conftest.py puts it on sys.path)

ROOT = Path(__file__).resolve().parents[1]


def test_command_line_quick(tmp_path):
    """bench_decode.py --quick: the arguments reach the library, the JSON lands in --out."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), "--quick",
                    "--batches", "1", "--configs", "b", "--prefill", "none", "--probe-steps", "0",
                    "--overlap", "0.7", "--no-plot", "--tag", "cli", "--out", str(tmp_path)],
                   check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    res = json.loads((tmp_path / "bench_decode_cli.json").read_text())
    assert res["complete"] and res["tag"] == "cli" and res["prefill"] == []
    assert res["selection"]["target_overlap"] == 0.7 and res["settings"]["configs"] == ["b"]
    assert [r["config"] for c in res["cases"] for r in c["results"]] == ["b"]


def test_two_stage_selector(tmp_path):
    """--selector quest_rescore8 (the library's default selector): the sparse configurations
    run it (here without the barrier on its query, ``--tuning materialize_qk=false``), and the
    memory plan counts its int8 key copy beside Quest's bounds."""
    st = decode_lib.Settings(selector="quest_rescore8", configs=("b",), probe_steps=0,
                             tuning=(("materialize_qk", False),))
    res = decode_lib.run(str(tmp_path), quick=True, batches=[1], settings=st, prefill=(),
                         plot=False, overlap_target=0.7)
    case = res["cases"][0]
    assert case["selector"] == "quest_rescore8" and case["results"][0]["tokens_per_s"] > 0
    cfg = decode_lib.model_config("8b")
    st = decode_lib.Settings()
    plans = {s: decode_lib.feasibility(cfg, 1, 131072, dataclasses.replace(st, selector=s),
                                       float("inf"), float("inf"), 0)
             for s in ("quest", "quest_rescore8")}
    Np = -(-(131072 + st.room) // st.page_size)
    copy = cfg.num_layers * cfg.num_kv_heads * Np * st.page_size * (cfg.head_dim + 4)
    assert (plans["quest_rescore8"]["summaries_bytes"]
            == plans["quest"]["summaries_bytes"] + copy)


def test_failed_configuration_keeps_the_finished_ones(tmp_path, monkeypatch):
    real = decode_lib.run_decode
    calls = []

    def flaky(name, *a, **kw):
        calls.append(name)
        if len(calls) == 2:
            raise RuntimeError("simulated out of memory")
        return real(name, *a, **kw)

    monkeypatch.setattr(decode_lib, "run_decode", flaky)
    st = decode_lib.Settings(configs=("b", "a"), probe_steps=0)
    res = decode_lib.run(str(tmp_path), quick=True, batches=[1], settings=st, prefill=(),
                         plot=False)
    disk = json.loads((tmp_path / "bench_decode.json").read_text())
    first = disk["cases"][0]
    assert [r["config"] for r in first["results"]] == ["b"]      # measured before the failure
    assert "simulated out of memory" in first["error"]
    assert "incomplete" not in first and disk["complete"] and res["complete"]
    assert first["results"][0]["tokens_per_s"] > 0


def test_paired_measurement_alternates_b_and_c2(tmp_path):
    """--pairs: b and c2 re-measured alternately (ABBA) in one process, without recompiling;
    the per-pair ratios and their median land in the case's JSON."""
    st = decode_lib.Settings(configs=("b", "c2"), pools=(2,), probe_steps=0, pairs=3)
    res = decode_lib.run(str(tmp_path), quick=True, batches=[1], settings=st, prefill=(),
                         plot=False)
    pr = res["cases"][0]["paired"]
    assert pr["pairs"] == 3 and len(pr["ratios"]) == 3 and pr["compilations"] == 0
    assert pr["min_ratio"] <= pr["median_ratio"] <= pr["max_ratio"]
    assert all(b > 0 for b in pr["b_step_ms"]) and all(c > 0 for c in pr["c2_step_ms"])
    assert [r["config"] for r in res["cases"][0]["results"]] == ["b", "c2"]


def test_ab_step_traces_each_variant_once(tmp_path):
    """ab_step --quick: each variant compiles its own round, both with the fused Quest update
    + scores kernel (the full-row top-k reads its scores, the chunk-maxima top-k, forced at
    the quick size, its maxima), and nothing recompiles after the warm-up."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab_step.py"), "--quick",
                    "--variants", "topk_full_row,exhaustive",
                    "--pairs", "1", "--out", str(tmp_path)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = json.loads((tmp_path / "ab_step.json").read_text())
    t = out["fused_kernel_traced"]
    assert t["topk_full_row"] > 0 and t["exhaustive"] > 0
    assert "xla_gpu_exhaustive_tiling_search" in out["variants"]["exhaustive"]["compiler_options"]
    assert out["variants"]["topk_full_row"]["tuning"] == {"topk_cmax_min_pages": "None"}
    assert all(len(out["results"][n]["step_ms"]) == 1 for n in t)
    assert out["compiles_after_warmup"] == {n: 0 for n in t}


def test_ab_step_share_kv(tmp_path):
    """--share-kv: three variants decode from one device KV array handed from round to round
    (a donated array read again would fail), each with its own selector data."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab_step.py"), "--quick",
                    "--variants", "default,rescore8,dense", "--share-kv", "--pairs", "1",
                    "--out", str(tmp_path)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    out = json.loads((tmp_path / "ab_step.json").read_text())
    assert out["share_kv"] is True
    assert {n: len(r["step_ms"]) for n, r in out["results"].items()} == {
        "default": 1, "rescore8": 1, "dense": 1}
    assert out["compiles_after_warmup"] == {"default": 0, "rescore8": 0, "dense": 0}


def test_ab_step_lower_only(tmp_path):
    """--lower-only: each variant's round lowered for an abstract H200 on the CPU; a line each,
    nothing written."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab_step.py"), "--quick",
                        "--variants", "default,rescore8_block2", "--lower-only",
                        "--out", str(tmp_path)], check=True, cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [ln.split() for ln in r.stdout.splitlines() if "lowered:" in ln]
    assert [ln[0] for ln in lines] == ["default", "rescore8_block2"]
    assert all(int(ln[2]) > 0 for ln in lines) and not list(tmp_path.iterdir())


def test_lagged_selection_run(tmp_path):
    """--selection-lag 1: the sparse configs run with CacheConfig(selection_lag=1), the dense
    baseline (a) without it; the JSON's settings say so."""
    st = decode_lib.Settings(configs=("a", "b", "c2"), pools=(2,), probe_steps=0,
                             selection_lag=1)
    res = decode_lib.run(str(tmp_path), quick=True, batches=[1], settings=st, prefill=(),
                         plot=False)
    assert res["settings"]["selection_lag"] == 1
    assert [r["config"] for r in res["cases"][0]["results"]] == ["b", "a", "c2"]
    assert all(r["tokens_per_s"] > 0 for r in res["cases"][0]["results"])


def test_fp8_kv_dtype_runs_every_part(tmp_path):
    """--kv-dtype float8_e4m3fn: the synthetic fill, decode and the split timings run on fp8
    rows; the case records its KV dtype and a host tier of about half the bf16 bytes."""
    st = decode_lib.Settings(configs=("b", "c2"), pools=(2,), probe_steps=0,
                             kv_dtype="float8_e4m3fn")
    res = decode_lib.run(str(tmp_path), quick=True, batches=[1], settings=st, prefill=(),
                         plot=False)
    case = res["cases"][0]
    assert case["kv_dtype"] == "float8_e4m3fn" and "error" not in case
    recs = {r["config"]: r for r in case["results"]}
    assert recs["b"]["tokens_per_s"] > 0 and recs["c2"]["tokens_per_s"] > 0
    H, ps, D = 2, 4, 16  # the tiny shape, the quick page size
    assert case["memory_plan"]["logical_kv_bytes"] % (2 * H * ps * (D + 1)) == 0


def test_roofline_bytes_by_part():
    """step_read_bytes by hand for a tiny plan: weights (the embedding's looked-up rows only
    when the LM head is separate), KV of min(k, valid) pages per layer / request / KV head,
    Quest's summaries of every valid page (float or int8 bounds; per block of pages with
    ``candidate_block``), the two-stage selector's candidate keys; the roofline's fraction is
    floor / step."""
    import dataclasses

    import jax
    from jaxkv import CacheConfig, engine
    from jaxkv.models import configs, llama

    cfg = configs.tiny()
    params = llama.init_params(cfg, 0)
    ps, k = 4, 3
    lengths = [37, 9]                                              # 10 and 3 pages
    L, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    kvb = jax.numpy.dtype(cfg.dtype).itemsize

    def plan(**kw):
        cache = CacheConfig(mode="resident", page_size=ps, selected_pages=k, **kw)
        return engine.Plan(model=cfg, cache=cache, batch=2, prompt_len=64, max_context=64,
                           num_stop=1)

    p = plan(selector="quest")
    got = decode_lib.step_read_bytes(p, params, lengths)
    head_page = 2 * ps * D * kvb                                   # K and V of one head's page
    assert got["kv"] == L * (3 + 3) * H * head_page
    assert got["selector"] == L * (10 + 3) * H * D * 2 * kvb
    total_w = sum(x.nbytes for x in jax.tree.leaves(params))
    emb = params["embed"]
    want_w = total_w - emb.nbytes + (2 * emb.nbytes // emb.shape[0] if "lm_head" in params else emb.nbytes)
    assert got["weights"] == want_w
    assert got["total"] == sum(v for n, v in got.items() if n != "total")
    dense = decode_lib.step_read_bytes(plan(selector="dense"), params, lengths)
    assert dense["kv"] == L * (10 + 3) * H * head_page and dense["selector"] == 0
    two = decode_lib.step_read_bytes(plan(selector="quest_rescore", bounds_dtype="float"),
                                     params, lengths)
    cand = min(10, 4 * k) + 3                                       # 4x candidates, capped
    keys = L * cand * H * ps * (D + 4)
    assert two["selector"] == got["selector"] + keys
    # int8 bounds (the two-stage selectors' default): a byte a bound, a float32 scale a page
    two8 = decode_lib.step_read_bytes(plan(selector="quest_rescore"), params, lengths)
    assert two8["selector"] == L * (10 + 3) * H * (D * 2 + 4) + keys
    quest8 = decode_lib.step_read_bytes(plan(selector="quest", bounds_dtype="int8"), params, lengths)
    assert quest8["selector"] == L * (10 + 3) * H * (D * 2 + 4)
    # by blocks of two pages: a bound per block (5 and 2 blocks), the candidates' keys as before
    two8b = decode_lib.step_read_bytes(plan(selector="quest_rescore", candidate_block=2,
                                            candidate_pages=12), params, lengths)
    assert two8b["selector"] == L * (5 + 2) * H * (D * 2 + 4) + keys
    roof = decode_lib.roofline(dict(step_ms=2.0, h2d_bytes_per_step=0), got, 1.0, 50.0)
    assert roof["floor_ms"] == got["total"] / 1e9 * 1e3
    assert roof["fraction_of_roofline"] == roof["floor_ms"] / 2.0
    assert decode_lib.roofline(dict(step_ms=2.0), got, None, None) == {}
    peak = decode_lib.roofline(dict(step_ms=2.0, h2d_bytes_per_step=0), got, 1.0, 50.0, peak=4.0)
    assert peak["peak_floor_ms"] == got["total"] / 4e9 * 1e3
    assert peak["fraction_of_peak_roofline"] == peak["peak_floor_ms"] / 2.0


def test_command_line_errors_and_the_pairs_notice(tmp_path, monkeypatch, capsys):
    """An empty --pools, --devices below 1, a negative --pairs and a --tuning item that is not a
    valid Tuning field and value are argparse errors naming the option (an empty --pools
    leaves the memory plan no pool to size); --tuning's pairs reach the settings; --pairs
    where the paired b / c2 run cannot happen prints why, and the run goes on."""
    import bench_decode
    runs = []
    monkeypatch.setattr(bench_decode.lib, "run", lambda *a, **k: runs.append(k["settings"]))
    out = ["--quick", "--out", str(tmp_path)]
    for bad, match in ((["--pools", ""], "--pools: '' names no pool size"),
                       (["--pools", " , "], "--pools: ' , ' names no pool size"),
                       (["--devices", ""], "argument --devices: invalid int value: ''"),
                       (["--devices", "0"], "--devices must be >= 1, got 0"),
                       (["--pairs", "-1"], "--pairs must be >= 0"),
                       (["--tuning", "nope=1"], "--tuning: 'nope=1' is not NAME=VALUE"),
                       (["--tuning", "materialize_qk"], "is not NAME=VALUE"),
                       (["--tuning", "materialize_qk=maybe"],
                        "Tuning.materialize_qk must be None (the selector's choice) or a bool")):
        with pytest.raises(SystemExit) as e:
            bench_decode.main(out + bad)
        assert e.value.code == 2 and match in capsys.readouterr().err
    for args, why in ((["--configs", "a,c"], "--configs leaves out b"),
                      (["--configs", "b,c", "--pools", "1,4"], "--pools leaves out 2 (c2)"),
                      (["--no-decode"], "--no-decode skips decoding")):
        bench_decode.main(out + ["--pairs", "2"] + args)
        err = capsys.readouterr().err
        assert "--pairs 2 has no effect: it pairs b with c2" in err and why in err
    bench_decode.main(out + ["--pairs", "2", "--configs", "b,c2", "--pools", "2"])
    assert "--pairs" not in capsys.readouterr().err and runs[-1].pairs == 2
    bench_decode.main(out + ["--tuning", "materialize_qk=true", "--tuning",
                             "topk_cmax_min_pages=none", "--tuning", "rescore_select_warps=4"])
    assert runs[-1].tuning == (("materialize_qk", True), ("rescore_select_warps", 4),
                               ("topk_cmax_min_pages", None))
    assert len(runs) == 5
