"""benchmarks/trace_summary.py on a hand-made perfetto trace: busy time, and each kernel's
exclusive time (what it adds past the kernels that started before it) summing to it."""
import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import trace_summary  # noqa: E402


def _write(tmp_path, kernels):
    ev = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
          {"ph": "X", "pid": 2, "name": "host_op", "ts": 0.0, "dur": 1000.0}]
    ev += [{"ph": "X", "pid": 1, "name": n, "ts": ts, "dur": d} for n, ts, d in kernels]
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": ev}, f)
    return str(tmp_path)


def test_exclusive_time_leaves_out_waiting_and_sums_to_busy(tmp_path):
    # gemm.1 runs 0-10; add.2 launches at 2 and waits for it, ends at 12 (duration 10,
    # exclusive 2); gemm.3 runs 20-30 alone; add.4 lies inside it (exclusive 0).
    s = trace_summary.summarise(_write(tmp_path, [
        ("gemm_fusion.1", 0.0, 10.0), ("wrapped_add.2", 2.0, 10.0),
        ("gemm_fusion.3", 20.0, 10.0), ("wrapped_add.4", 22.0, 3.0)]), steps=2)
    rows = {r["name"]: r for r in s["top"]}
    assert s["processes"] == ["/device:GPU:0"] and s["kernels"] == 4
    assert s["busy_us_per_step"] == pytest.approx(22.0 / 2)
    assert s["span_us_per_step"] == pytest.approx(30.0 / 2)
    assert rows["gemm_fusion"]["us_per_step"] == pytest.approx(10.0)
    assert rows["gemm_fusion"]["exclusive_us_per_step"] == pytest.approx(10.0)
    assert rows["wrapped_add"]["us_per_step"] == pytest.approx(6.5)
    assert rows["wrapped_add"]["exclusive_us_per_step"] == pytest.approx(1.0)
    assert sum(r["exclusive_us_per_step"] for r in s["top"]) == pytest.approx(
        s["busy_us_per_step"])
    trace_summary.print_summary(s)


def test_no_trace_file_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="perfetto_trace"):
        trace_summary.summarise(str(tmp_path))


def test_hlo_counts_on_a_hand_made_module():
    """benchmarks/probes/hlo_counts.py: weight products by shape, rematerialized instructions,
    parameter bytes by memory space (``S(5)``: pinned host)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "probes"))
    import hlo_counts
    text = "\n".join([
        "HloModule jit__decode_round, entry_computation_layout={(bf16[4,8]{1,0:S(5)}, "
        "s32[2,2]{1,0}, f32[16]{0})->s32[]}",
        "  %gemm_fusion_dot.1 = f32[8,8,1536]{2,1,0} fusion(%a, %b), kind=kCustom, "
        "calls=%gemm_fusion_dot.1_computation",
        "  %gemm_fusion_dot.1.remat3 = f32[8,8,1536]{2,1,0} fusion(%a, %b), kind=kCustom, "
        "calls=%gemm_fusion_dot.1_computation.3",
        "  %loop_add_fusion.2 = s32[8]{0} fusion(%c), kind=kLoop, calls=%fused_add",
        "  %use = f32[8,8,1536]{2,1,0} add(%gemm_fusion_dot.1.remat3, %gemm_fusion_dot.1)"])
    c = hlo_counts.count(text)
    assert c["params_bytes"] == {"device": 2 * 2 * 4 + 16 * 4, "pinned_host": 4 * 8 * 2}
    assert c["gemm_fusions_by_shape"] == {"f32[8,8,1536]": 2} and c["gemm_fusions"] == 2
    assert c["rematerialized"] == 1
    assert c["rematerialized_by_kind"] == {"gemm_fusion_dot f32[8,8,1536]": 1}
