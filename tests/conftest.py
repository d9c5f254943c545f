"""Test configuration: GPU tests (marker ``gpu``) are skipped unless JAX sees a GPU; the
benchmark modules (benchmarks/: ``synthetic``, ``decode_lib``, ...) import by name. The
persistent compilation cache directory that jaxkv.load and the command line use by default is
not used in tests (tests/test_cli_runtime.py gives it a directory of its own).

The suite's own process keeps a persistent compilation cache in a temporary directory (removed
at exit): after a module's programs are dropped, a later module that builds the same program
loads it from disk instead of compiling it again (generate, lagged selection, isolation,
text API, KV dtype and oracle modules: 520 s -> 360 s on a 2-core CPU). Subprocesses that tests
start do not inherit it.

JAX's compiled programs are dropped after every test module (``jax.clear_caches``). XLA:CPU
maps each executable's machine code into its own memory regions, and JAX's caches keep every
executable alive, so one process running the whole suite would otherwise approach Linux's
limit of 65,530 memory maps per process (``vm.max_map_count``); at the limit XLA:CPU's code
allocator fails and the process dies with a segmentation fault inside the compiler."""
import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import pytest

os.environ.setdefault("JAXKV_COMPILATION_CACHE", "0")
_XLA_CACHE = tempfile.mkdtemp(prefix="jaxkv-tests-xla-")
atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU (run on the H200 through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """After each test module: drop JAX's compiled programs (see the module docstring)."""
    yield
    from jaxkv import runtime
    runtime.drop_compiled_programs()


@pytest.fixture
def no_interpret(monkeypatch):
    """Lower the real Triton kernels (not interpret mode) although JAX runs on the CPU."""
    from jaxkv.kernels import _common
    monkeypatch.setattr(_common, "interpret_mode", lambda: False)
