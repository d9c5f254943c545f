"""Test configuration: GPU tests (marker ``gpu``) are skipped unless JAX sees a GPU; the
benchmark modules (benchmarks/: ``synthetic``, ``decode_lib``, ...) import by name. The
persistent compilation cache directory that jaxkv.load and the command line use by default is
not used in tests (tests/test_cli_runtime.py gives it a directory of its own).

The suite keeps a persistent compilation cache in a temporary directory: after a module's
programs are dropped, a later module that builds the same program loads it from disk instead
of compiling it again (generate, lagged selection, isolation, text API, KV dtype and oracle
modules: 520 s -> 360 s on a 2-core CPU). The pytest-xdist workers of one run share the
directory (the main process makes it, names it in ``JAXKV_TEST_XLA_CACHE`` for the workers it
starts, and removes it at exit), so a program one worker compiled, another loads; its entries
are written under JAX's file lock. Subprocesses that tests start do not use it.

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
_XLA_CACHE = os.environ.get("JAXKV_TEST_XLA_CACHE") if os.environ.get("PYTEST_XDIST_WORKER") else None
if not _XLA_CACHE:  # the main process (or a run without workers): make it, remove it at exit
    _XLA_CACHE = tempfile.mkdtemp(prefix="jaxkv-tests-xla-")
    os.environ["JAXKV_TEST_XLA_CACHE"] = _XLA_CACHE
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
# a size limit turns on the cache's file lock: workers never read a half-written entry
jax.config.update("jax_compilation_cache_max_size", 32 << 30)
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
