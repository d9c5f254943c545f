"""The process around the compiled programs: JAX's persistent compilation cache (on by
default for :func:`jaxkv.load` and the command line), the backend in words, a warning
when JAX runs on the CPU although an NVIDIA GPU is visible (the CUDA plugin is missing), and
the guard that keeps a long-lived process under Linux's limit on memory maps.
"""
from __future__ import annotations

import gc
import glob
import math
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import jax
import numpy as np

ENV_CACHE = "JAXKV_COMPILATION_CACHE"
_OFF = ("0", "off", "false", "no", "")


def default_cache_dir() -> str | None:
    """``$JAXKV_COMPILATION_CACHE`` (a directory; "0" / "off": no cache), else
    ``$XDG_CACHE_HOME/jaxkv/xla`` (``~/.cache/jaxkv/xla``)."""
    env = os.environ.get(ENV_CACHE)
    if env is not None:
        return None if env.strip().lower() in _OFF else env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return os.path.join(base, "jaxkv", "xla")


def enable_compilation_cache(setting: bool | str | os.PathLike | None = None, *,
                             min_compile_time_s: float = 0.2) -> str | None:
    """Turns on JAX's persistent compilation cache, so a second process loads the compiled
    prefill and decode programs from disk instead of compiling them (the command line with
    SmolLM2 on a 2-core CPU: compile 15.9 s -> 0.8 s, the whole run 34 s -> 16 s). ``setting``: None or True = :func:`default_cache_dir`; False = leave
    it off; a path = that directory. A directory the user already gave JAX
    (``jax_compilation_cache_dir``) is kept, and so is the first one of the process: JAX reads
    it once, so a later, different path warns that it is not used. Programs that compile faster than
    ``min_compile_time_s`` are not stored. Returns the directory in use, or None."""
    current = jax.config.jax_compilation_cache_dir
    if setting is False:
        return current
    if current:
        if not isinstance(setting, (bool, type(None))) and (
                os.path.abspath(os.fspath(setting)) != os.path.abspath(current)):
            # JAX reads its cache directory once per process: a second one would be ignored
            warnings.warn(f"jaxkv: the compilation cache stays in {current} (set earlier in "
                          f"this process); {os.fspath(setting)} is not used. Give the directory "
                          f"in the process's first load, or set JAX_COMPILATION_CACHE_DIR",
                          RuntimeWarning, stacklevel=2)
        return current
    path = default_cache_dir() if setting is None or setting is True else os.fspath(setting)
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        warnings.warn(f"jaxkv: cannot create the compilation cache directory {path} ({e}); "
                      f"compiling without it (set {ENV_CACHE}=0 to silence)", RuntimeWarning,
                      stacklevel=2)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    return path


def gpu_visible() -> bool:
    """An NVIDIA GPU is visible to this process (device files, or ``nvidia-smi -L`` lists
    one)."""
    if glob.glob("/dev/nvidia[0-9]*"):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def warn_if_gpu_unused() -> bool:
    """Warns (and returns True) when JAX's backend is the CPU while a GPU is visible."""
    if jax.default_backend() != "cpu" or not gpu_visible():
        return False
    warnings.warn(
        "jaxkv: JAX runs on the CPU, but an NVIDIA GPU is visible: JAX's CUDA plugin is not "
        "installed (or does not match jax). Install it with: pip install 'jaxkv[cuda]' "
        "(README, \"Install on a CUDA GPU\"); check with python -c 'import jax; "
        "print(jax.devices())'", RuntimeWarning, stacklevel=2)
    return True


def describe_backend() -> str:
    """E.g. "gpu: NVIDIA H200 (1 device)" or "cpu: cpu (1 device)"."""
    devs = jax.devices()
    kind = getattr(devs[0], "device_kind", str(devs[0]))
    return f"{jax.default_backend()}: {kind} ({len(devs)} device{'s' if len(devs) > 1 else ''})"


MAP_FRACTION = 0.75


def memory_maps() -> tuple[int, int] | None:
    """(memory maps this process holds, the kernel's per-process limit ``vm.max_map_count``),
    or None where /proc does not tell (not Linux)."""
    try:
        with open("/proc/sys/vm/max_map_count", "rb") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            n = f.read().count(b"\n")
    except (OSError, ValueError):
        return None
    return n, limit


def release_compiled_programs(fraction: float = MAP_FRACTION) -> bool:
    """Drops JAX's compiled programs (``jax.clear_caches()``, with a warning) when this process
    holds more than ``fraction`` of Linux's memory maps per process; returns whether it did.

    XLA:CPU maps each compiled program's machine code into memory regions of its own, and
    JAX keeps every compiled program: each new cache configuration that ``generate``
    compiles adds about 1,100-1,400 maps on the CPU (SmolLM2-135M), so one process that
    sweeps some 50 configurations reaches the default limit of 65,530, and then XLA:CPU's
    compiler dies with a segmentation fault. ``generate`` calls this before it compiles:
    programs dropped here recompile on their next use."""
    got = memory_maps()
    if got is None or got[0] < fraction * got[1]:
        return False
    n, limit = got
    warnings.warn(
        f"jaxkv: this process holds {n} memory maps, near Linux's limit of {limit} per process "
        f"(vm.max_map_count), most of them compiled programs' machine code: JAX's compiled "
        f"programs are dropped now (jax.clear_caches()) and compile again when next used. A "
        f"larger limit avoids this: sysctl -w vm.max_map_count={4 * limit}", RuntimeWarning,
        stacklevel=3)
    drop_compiled_programs()
    return True


def drop_compiled_programs() -> None:
    """Frees every compiled program JAX holds (``jax.clear_caches()``, then a garbage
    collection so the executables' code maps go now); they compile again when next used."""
    jax.clear_caches()
    gc.collect()


def json_safe(x):
    """``x`` for strict JSON: NaN and infinities (e.g. a hit rate with no lookups) as null,
    numpy scalars as Python numbers."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x
