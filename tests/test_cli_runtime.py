"""The command line (--version, --json only JSON, --file -, --stream, defaults in --help,
options the model cannot serve failing before it loads) and the runtime: the persistent
compilation cache a second process hits, the warning when a GPU is visible but JAX runs on
the CPU."""
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import jaxkv
import jaxkv.models
from jaxkv import runtime
from jaxkv.cli import build_parser, main as cli_main

ROOT = Path(__file__).parent.parent
FIXTURE = str(ROOT / "tests" / "fixtures" / "hf_qwen2")
FAST = ["--model", FIXTURE, "--max-new-tokens", "3", "--page-size", "4", "--no-compile-cache"]


def test_version_and_help_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["--version"])
    assert e.value.code == 0 and jaxkv.__version__ in capsys.readouterr().out
    help_text = " ".join(build_parser().format_help().split())
    assert "(default: 48)" in help_text and "(default: host)" in help_text
    assert "(default: 0)" in help_text  # --top-k's 0, although 0 == False
    # nothing without a default to show, and no option with two defaults
    assert "(default: None)" not in help_text and "(default: False)" not in help_text
    assert help_text.count("(default: SmolLM2-135M-Instruct)") == 1


def test_json_prints_only_json(capsys):
    assert cli_main(["Hello", *FAST, "--json"]) == 0
    out = capsys.readouterr().out
    d = json.loads(out)
    assert d["prompt"] == "Hello" and len(d["tokens"]) <= 3
    assert d["finish_reason"] in ("length", "stop_token") and d["backend"].startswith("cpu")
    assert isinstance(d["text"], str) and d["stats"]["generated_tokens"] == len(d["tokens"])
    # strict JSON: no lookups on a resident dense cache, so no hit rate: null, not NaN
    assert cli_main(["Hello", *FAST, "--json", "--mode", "resident", "--selector", "dense"]) == 0
    d = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"JSON has {c}"))
    assert d["stats"]["hit_rate"] is None


def test_two_stage_selector_from_the_command_line(capsys):
    """--selector quest_rescore8 with --candidate-pages runs; --candidate-pages with a
    one-stage selector fails before the model loads, naming the options and the fix."""
    assert cli_main(["Hello", *FAST, "--json", "--selector", "quest_rescore8", "--budget", "8",
                     "--candidate-pages", "6"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["generated_tokens"] >= 1
    for sel in ("quest", "dense"):
        assert cli_main(["Hello", "--model", "/no/such/model", "--selector", sel,
                         "--candidate-pages", "6"]) == 2
        err = capsys.readouterr().err
        assert f"selector={sel!r} has none: leave candidate_pages=None" in err
        assert "(here selector is --selector, candidate_pages is --candidate-pages)" in err


def test_candidate_block_from_the_command_line(capsys):
    """--candidate-block groups quest_rescore8's first stage; one too large for the candidates
    (16 set: the default's floor would give more) names the largest that works, and one with
    a one-stage selector fails before the model loads, each naming the options."""
    assert cli_main(["Hello", *FAST, "--json", "--selector", "quest_rescore8", "--budget", "8",
                     "--candidate-block", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["generated_tokens"] >= 1
    assert cli_main(["Hello", *FAST, "--selector", "quest_rescore8", "--budget", "8",
                     "--candidate-pages", "16", "--candidate-block", "16"]) == 1
    # (found when the plan is made)
    err = capsys.readouterr().err
    assert "the largest candidate_block that divides the candidates and works here is 8" in err
    assert "candidate_block is --candidate-block" in err
    assert cli_main(["Hello", "--model", "/no/such/model", "--selector", "quest",
                     "--candidate-block", "2"]) == 2
    err = capsys.readouterr().err
    assert "leave candidate_block=1 (here selector is --selector, candidate_block is " \
           "--candidate-block)" in err


def test_candidate_pieces_from_the_command_line(capsys):
    """--candidate-pieces splits quest_rescore8's first stage; a count that does not divide
    the candidates (16, set) fails when the plan is made, naming the option and a count that
    works."""
    assert cli_main(["Hello", *FAST, "--json", "--selector", "quest_rescore8", "--budget", "8",
                     "--candidate-pieces", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["generated_tokens"] >= 1
    assert cli_main(["Hello", *FAST, "--selector", "quest_rescore8", "--budget", "8",
                     "--candidate-pages", "16", "--candidate-pieces", "3"]) == 1
    err = capsys.readouterr().err
    assert "candidate_pieces (3) does not split the first stage's 16 candidate(s)" in err
    assert "candidate_pieces=2 works here (here candidate_pieces is --candidate-pieces)" in err


def test_int8_kv_from_the_command_line(capsys):
    """--kv-dtype int8 runs; a dtype the cache cannot store fails naming the option."""
    assert cli_main(["Hello", *FAST, "--json", "--kv-dtype", "int8"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["stats"]["generated_tokens"] >= 1
    with pytest.raises(SystemExit) as e:
        cli_main(["Hello", *FAST, "--kv-dtype", "int4"])
    assert e.value.code == 2 and "--kv-dtype" in capsys.readouterr().err


def test_file_from_stdin_and_stream(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("From standard input"))
    assert cli_main(["--file", "-", *FAST, "--stream"]) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("From standard input") and "finished:" in cap.out
    assert "backend cpu" in cap.err


def test_options_the_model_cannot_serve_fail_before_loading(capsys, monkeypatch, tmp_path):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(jaxkv.models, "load", no_load)
    monkeypatch.setattr("jaxkv.models.loader.load_with_path", no_load)
    monkeypatch.setattr("jaxkv.models.hf_loader.load_hf", no_load)
    assert cli_main(["hi", "--model", FIXTURE, "--selector", "indexer"]) == 2
    assert "needs a model with lightning-indexer weights" in capsys.readouterr().err
    bare = tmp_path / "no_template"
    shutil.copytree(FIXTURE, bare)
    (bare / "chat_template.jinja").unlink()
    assert cli_main(["hi", "--model", str(bare), "--chat"]) == 2
    assert "the model files have no chat template: drop --chat" in capsys.readouterr().err
    # named templates without a "default": the error names them (not "no chat template")
    tc = json.loads((bare / "tokenizer_config.json").read_text())
    tc["chat_template"] = [{"name": "tool_use", "template": "{{ messages }}"}]
    (bare / "tokenizer_config.json").write_text(json.dumps(tc))
    assert cli_main(["hi", "--model", str(bare), "--chat"]) == 2
    assert "named chat templates ['tool_use'] and none is 'default'" in capsys.readouterr().err
    assert cli_main(["hi", "--model", FIXTURE, "--stop="]) == 2
    assert "--stop: a stop string must not be empty" in capsys.readouterr().err


def test_json_strict_failure_is_still_one_json_object(capsys):
    """--json --strict with dropped pages: stdout is one JSON object (the result and the
    error), the exit status 1."""
    words = " ".join(f"word{i}" for i in range(40))
    args = [words, "--model", FIXTURE, "--page-size", "4", "--no-compile-cache", "--json",
            "--strict", "--selector", "quest", "--budget", "20", "--pool-pages", "7",
            "--max-new-tokens", "40"]
    assert cli_main(args) == 1
    cap = capsys.readouterr()
    d = json.loads(cap.out)
    assert "strict mode" in d["error"] and d["stats"]["dropped"] > 0 and d["tokens"]
    assert "strict mode" in cap.err
    # any failure of the generation itself: the object carries the error
    assert cli_main(["Hello", *FAST[:2], "--no-compile-cache", "--json",
                     "--max-new-tokens", "100000"]) == 1
    cap = capsys.readouterr()
    assert json.loads(cap.out)["error"] in cap.err


def test_generation_errors_name_the_options_and_resident_shows_no_hit_rate(capsys):
    """An error that generate raises (a pool smaller than a step's pages) names the options
    of the fields it names; a resident run's cache line says it moved nothing, not 'nan'."""
    assert cli_main(["Hello", *FAST, "--pool-pages", "2"]) == 1
    assert "(here selected_pages is --budget, pool_pages is --pool-pages)" in \
        capsys.readouterr().err
    assert cli_main(["Hello", *FAST, "--mode", "resident"]) == 0
    out = capsys.readouterr().out
    assert "cache: resident, every page on the device" in out and "nan" not in out
    assert cli_main(["Hello", *FAST, "--temperature", "-1"]) == 2  # Sampling's errors too
    assert "(here temperature is --temperature)" in capsys.readouterr().err


def test_gpu_warning(monkeypatch):
    monkeypatch.setattr(runtime, "gpu_visible", lambda: True)
    with pytest.warns(RuntimeWarning, match=r"jaxkv\[cuda\]"):
        assert runtime.warn_if_gpu_unused()
    monkeypatch.setattr(runtime, "gpu_visible", lambda: False)
    assert not runtime.warn_if_gpu_unused()


def test_cache_dir_switches(monkeypatch, tmp_path):
    monkeypatch.setenv(runtime.ENV_CACHE, "0")
    assert runtime.default_cache_dir() is None
    monkeypatch.setenv(runtime.ENV_CACHE, str(tmp_path))
    assert runtime.default_cache_dir() == str(tmp_path)
    monkeypatch.delenv(runtime.ENV_CACHE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert runtime.default_cache_dir() == str(tmp_path / "jaxkv" / "xla")


def test_a_second_cache_directory_is_named_as_unused(tmp_path):
    """JAX keeps the process's first cache directory: a later, different one warns naming
    both; the same one, None, True and False do not."""
    import warnings
    import jax
    current = jax.config.jax_compilation_cache_dir  # the suite's (tests/conftest.py)
    assert current
    with pytest.warns(RuntimeWarning, match="stays in .* is not used"):
        assert runtime.enable_compilation_cache(tmp_path) == current
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for setting in (current, None, True, False):
            assert runtime.enable_compilation_cache(setting) == current


_CHILD = """
import sys, jax
hits = []
jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name))
import jaxkv
import jaxkv.models
m = jaxkv.load(sys.argv[1], compile_cache=sys.argv[2])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jaxkv.generate(m, ["cache me"], max_new_tokens=2, stop_tokens=[],
               cache=jaxkv.CacheConfig(page_size=4, round_steps=2))
print("HITS", sum(1 for h in hits if h == "/jax/compilation_cache/cache_hits"))
"""


def test_second_process_hits_the_compilation_cache(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop(runtime.ENV_CACHE, None)
    runs = [subprocess.run([sys.executable, "-c", _CHILD, FIXTURE, str(tmp_path / "xla")],
                           capture_output=True, text=True, env=env, timeout=600)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    first, second = (int(r.stdout.split("HITS")[-1]) for r in runs)
    assert any((tmp_path / "xla").iterdir())
    assert first == 0 and second > 0


def test_plot_rounds(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    from jaxkv.plot import plot_rounds
    rounds = [dict(steps=8, hit_rate=h, context_tokens=100 + 8 * i, tokens_per_s=50.0 - i)
              for i, h in enumerate([0.5, 0.8, 0.9])]
    fig = plot_rounds({"quest": rounds, "dense": rounds[:2]}, title="demo")
    ax_hit, ax_tps = fig.axes
    assert "hit rate" in ax_hit.get_ylabel() and "tokens / s" in ax_tps.get_ylabel()
    assert list(ax_hit.lines[0].get_xdata()) == [8, 16, 24]
    fig.savefig(tmp_path / "rounds.png")
    with pytest.raises(TypeError, match="GenerateResult"):
        plot_rounds(3)
    for empty in ({}, [], {"a": []}):
        with pytest.raises(ValueError, match="no decode rounds to plot"):
            plot_rounds(empty)


def test_memory_maps_guard(monkeypatch):
    """Near Linux's per-process map limit, generate drops JAX's compiled programs with a
    warning (XLA:CPU would otherwise segfault compiling the next one); below it, nothing."""
    got = runtime.memory_maps()
    if sys.platform.startswith("linux"):
        assert got is not None and 0 < got[0] < got[1]
    cleared = []
    monkeypatch.setattr(runtime.jax, "clear_caches", lambda: cleared.append(1))
    monkeypatch.setattr(runtime, "memory_maps", lambda: (10, 100))
    assert not runtime.release_compiled_programs() and not cleared
    monkeypatch.setattr(runtime, "memory_maps", lambda: None)
    assert not runtime.release_compiled_programs() and not cleared
    monkeypatch.setattr(runtime, "memory_maps", lambda: (80, 100))
    with pytest.warns(RuntimeWarning, match=r"vm.max_map_count.*jax.clear_caches"):
        assert runtime.release_compiled_programs()
    assert cleared == [1]

    from jaxkv.models import configs, llama
    cfg = configs.tiny()
    params = llama.init_params(cfg, seed=0)
    with pytest.warns(RuntimeWarning, match="memory maps"):
        res = jaxkv.generate(cfg, params, [[1, 2, 3]], max_new_tokens=2,
                             cache=jaxkv.CacheConfig(page_size=4))
    assert len(res.tokens[0]) == 2 and cleared == [1, 1]
