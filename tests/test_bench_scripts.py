"""Smoke tests of small benchmark scripts off the GPU (their --quick modes)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_matmul_quick(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_matmul.py"), "--quick",
                    "--shapes", "qwen1.5b", "--batches", "1", "--steps", "1", "--reps", "1",
                    "--out", str(tmp_path)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = json.loads((tmp_path / "bench_matmul.json").read_text())["rows"]
    assert [(r["variant"], r["batch"]) for r in rows] == [("xla", 1)]
    assert rows[0]["us_per_layer"] > 0 and rows[0]["rel_err_vs_xla"] == 0.0
