"""benchmarks/bench_decode.py off the GPU: the quick run, and what its JSON keeps when a
configuration fails part-way through a point (the figures already measured stay)."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_decode  # noqa: E402


def test_failed_configuration_keeps_the_finished_ones(tmp_path, monkeypatch):
    real = bench_decode.run_decode
    calls = []

    def flaky(name, *a, **kw):
        calls.append(name)
        if len(calls) == 2:
            raise RuntimeError("simulated out of memory")
        return real(name, *a, **kw)

    monkeypatch.setattr(bench_decode, "run_decode", flaky)
    st = bench_decode.Settings(configs=("b", "a"), probe_steps=0)
    res = bench_decode.run(str(tmp_path), quick=True, batches=[1], settings=st, prefill=(),
                           plot=False)
    disk = json.loads((tmp_path / "bench_decode.json").read_text())
    first = disk["cases"][0]
    assert [r["config"] for r in first["results"]] == ["b"]      # measured before the failure
    assert "simulated out of memory" in first["error"]
    assert "incomplete" not in first and disk["complete"] and res["complete"]
    assert first["results"][0]["tokens_per_s"] > 0
