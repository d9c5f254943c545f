"""The persistent XLA compilation cache of a test process.

About three quarters of the CPU suite's time is XLA compiling (tests/test_textapi.py: 96 s
cold, 24 s with every program cached). ``scripts/test.sh`` makes one cache directory for
the whole run (``$JAXKV_TEST_XLA_CACHE``) and removes it at the end, so the pytest workers
and the multi-device subprocesses (tests/parallel_cases.py) reuse each other's programs;
without it each process gets a cache of its own (a temporary directory). The cache is
size-bounded, which makes JAX lock it (``filelock``) so concurrent processes never read a
half-written entry.
"""
import atexit
import os
import shutil
import tempfile

import jax

ENV = "JAXKV_TEST_XLA_CACHE"


def enable(min_compile_time_s: float = 0.2) -> str:
    path = os.environ.get(ENV)
    if not path:
        path = tempfile.mkdtemp(prefix="jaxkv-tests-xla-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_time_s)
    try:
        import filelock  # noqa: F401 - JAX needs it for a bounded (locked) cache
    except ImportError:
        return path
    jax.config.update("jax_compilation_cache_max_size", 8 * 2**30)
    return path
