"""Early checks for the public entry points and the strict-mode guards (docs/failure_modes.md).

Every check raises ``ValueError`` / ``TypeError`` (``RuntimeError`` for strict mode) with a
message that names the fix. Checks on arrays look at static shapes and dtypes (free at trace
time) and, when the arrays are concrete (not traced), at their values.

Memory limits are testable off the GPU: ``JAXKV_HOST_MEMORY_LIMIT_GB`` sets a pinned-host cap
on any backend (on the GPU the smaller of it and XLA's cap applies) and
``JAXKV_DEVICE_MEMORY_LIMIT_GB`` caps the free device memory figure (which
``Device.memory_stats()`` does not give on CPU); the check functions also take the figure
as an argument.
"""
from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

HOST_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
HOST_LIMIT_OVERRIDE_ENV = "JAXKV_HOST_MEMORY_LIMIT_GB"
DEVICE_LIMIT_OVERRIDE_ENV = "JAXKV_DEVICE_MEMORY_LIMIT_GB"
DEFAULT_GPU_HOST_LIMIT_GB = 64.0
# Counters that strict mode requires to be zero after a generate() call.
STRICT_COUNTERS = ("dropped", "truncated_requests")

_UNSET = object()


# ------------------------------------------------------------------------------ limits
def _env_gb(name: str) -> float | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        gb = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number: set it to a size in GB (e.g. 100)") from None
    if not gb > 0:
        raise ValueError(f"{name}={raw!r} must be a positive size in GB")
    return gb


def host_limit_bytes(backend: str | None = None) -> int | None:
    """The pinned-host memory cap in bytes, or None when none is known.

    On the GPU: ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` (default 64 GiB), lowered by
    ``JAXKV_HOST_MEMORY_LIMIT_GB`` if that is set. Elsewhere: ``JAXKV_HOST_MEMORY_LIMIT_GB``
    if set, else None (no check).
    """
    backend = backend or jax.default_backend()
    override = _env_gb(HOST_LIMIT_OVERRIDE_ENV)
    caps = [] if override is None else [override]
    if backend == "gpu":
        xla = _env_gb(HOST_LIMIT_ENV)
        caps.append(DEFAULT_GPU_HOST_LIMIT_GB if xla is None else xla)
    return int(min(caps) * 2**30) if caps else None


def host_ram_bytes() -> int | None:
    """The machine's RAM in bytes, capped by this process's cgroup limit (``memory.max``)
    where one is set; None when unknown."""
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit():
            ram = min(ram, int(raw))
    return int(ram)


_REGION0 = 2 << 20  # the pinned-host BFC allocator's first region (2 MiB), doubled as it grows


def pinned_reservation_bytes(tier_bytes: int, limit_bytes: int) -> int:
    """Pinned host memory XLA's GPU host allocator reserves for one tier of ``tier_bytes``.

    It is a BFC allocator with growth: a request larger than its current region size doubles
    that size (from 2 MiB) until the request fits, and the new region takes that size, capped
    by what is left under the limit. So a 64.1 GiB tier reserves a 128 GiB region under a
    140 GiB limit, but 70 GiB under a 70 GiB one; two such 128 GiB regions, one per GPU,
    take all of a 256 GiB machine's RAM and the process is killed (docs/decisions.md).
    """
    region = _REGION0
    while region < tier_bytes:
        region *= 2
    return int(min(region, limit_bytes))


def check_host_capacity(host_bytes: int, *, limit_bytes=_UNSET, devices: int = 1,
                        ram_bytes=_UNSET, backend: str | None = None,
                        fix: str = "lower batch / max_context") -> None:
    """Check a pinned-host tier of ``host_bytes`` per device on ``devices`` devices.

    Raises if one device's tier exceeds the cap (``host_limit_bytes()``: each GPU has its own
    pinned-host allocator under it) or all tiers together exceed the RAM
    (``host_ram_bytes()``). Warns (``RuntimeWarning``) on the GPU when the allocator's
    doubling would reserve more than the RAM (:func:`pinned_reservation_bytes`), naming a
    limit that avoids it.
    """
    limit = host_limit_bytes(backend) if limit_bytes is _UNSET else limit_bytes
    if limit is not None and host_bytes > limit:
        # XLA's variable caps the GPU's pinned-host allocator only; elsewhere jaxkv's own sets the cap
        env = (HOST_LIMIT_ENV if (backend or jax.default_backend()) == "gpu"
               else HOST_LIMIT_OVERRIDE_ENV)
        raise ValueError(
            f"the host tier needs {host_bytes / 2**30:.2f} GiB of pinned host memory, over the cap "
            f"of {limit / 2**30:.2f} GiB: set {env} (in GB, before JAX starts; the "
            f"machine's RAM bounds it) or {fix}")
    ram = host_ram_bytes() if ram_bytes is _UNSET else ram_bytes
    if ram is None:
        return
    if devices * host_bytes > ram:
        raise ValueError(
            f"the host tier{'s' if devices > 1 else ''} need{'' if devices > 1 else 's'} "
            f"{devices * host_bytes / 2**30:.2f} GiB of pinned host memory"
            f"{f' ({devices} devices)' if devices > 1 else ''}, more than the machine's "
            f"{ram / 2**30:.2f} GiB of RAM: {fix}")
    if limit is None or (backend or jax.default_backend()) != "gpu":
        return
    reserve = devices * pinned_reservation_bytes(host_bytes, limit)
    if reserve > ram:
        suggest = math.ceil(host_bytes * 1.02 / 2**30) + 1
        warnings.warn(
            f"XLA's pinned-host allocator grows by doubling: under {HOST_LIMIT_ENV}="
            f"{limit / 2**30:g} a {host_bytes / 2**30:.1f} GiB host tier reserves "
            f"{reserve / devices / 2**30:.0f} GiB per device ({reserve / 2**30:.0f} GiB in all), "
            f"more than the {ram / 2**30:.0f} GiB of RAM, and the process may be killed: set "
            f"{HOST_LIMIT_ENV}={suggest} (the tier and a margin) before JAX starts",
            RuntimeWarning, stacklevel=3)


def device_free_bytes(device=None) -> int | None:
    """Free device memory in bytes (``memory_stats``), capped by ``JAXKV_DEVICE_MEMORY_LIMIT_GB``.
    A CPU device reports none: its memory is the RAM (``host_ram_bytes()``, a bound that
    catches impossible sizes before they are allocated); None when nothing is known."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        stats = None
    free = None
    if stats and "bytes_limit" in stats:
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    elif device.platform == "cpu":
        free = host_ram_bytes()
    override = _env_gb(DEVICE_LIMIT_OVERRIDE_ENV)
    if override is not None:
        cap = int(override * 2**30)
        free = cap if free is None else min(free, cap)
    return free


def check_device_memory(need_bytes: int, *, what: str, fix: str, free_bytes=_UNSET) -> None:
    """Raise if ``need_bytes`` exceed the free device memory (``device_free_bytes()``)."""
    free = device_free_bytes() if free_bytes is _UNSET else free_bytes
    if free is not None and need_bytes > free:
        raise ValueError(f"the {what} needs {need_bytes / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB "
                         f"of device memory is free: {fix}")


# ------------------------------------------------------------------------------ inputs
def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_kv_dtype(kv_dtype: str, device=None) -> None:
    """Raise unless the backend can store and read ``kv_dtype`` (CacheConfig.kv_dtype): fp8
    needs a GPU of compute capability >= 8.9 (its Triton kernels convert fp8 in registers)
    or the CPU (interpret mode and XLA)."""
    from jaxkv.kernels import kv_quant
    if not kv_quant.is_fp8(kv_dtype):
        return
    device = device or jax.devices()[0]
    if device.platform == "gpu":
        cc = getattr(device, "compute_capability", None)
        try:
            major, minor = (int(x) for x in str(cc).split(".")[:2])
        except ValueError:
            return  # unknown: let the compiler decide
        if (major, minor) < (8, 9):
            raise ValueError(f"CacheConfig.kv_dtype={kv_dtype!r} needs a GPU of compute "
                             f"capability >= 8.9 (H100, H200, L40S); {device.device_kind} has "
                             f"{cc}: use kv_dtype='bfloat16' (or None, the model's dtype)")
    elif device.platform != "cpu":
        raise ValueError(f"CacheConfig.kv_dtype={kv_dtype!r} runs on the GPU (compute "
                         f"capability >= 8.9) or the CPU, not on {device.platform}: use "
                         "kv_dtype='bfloat16' (or None, the model's dtype)")


def is_scalar(t) -> bool:
    """A single value: a number, a numpy scalar or a 0-d array; not a list, tuple, array of
    one or more dimensions (lists are tested first: ``np.ndim`` fails on a ragged one), text
    or a mapping."""
    return not isinstance(t, (list, tuple, str, bytes, Mapping)) and np.ndim(t) == 0


def _is_int_item(t) -> bool:
    """An int, a numpy integer or a 0-d integer array (numpy or jax); not a bool."""
    if _is_int(t):
        return True
    dt = getattr(t, "dtype", None)
    return (dt is not None and np.ndim(t) == 0 and np.issubdtype(np.dtype(dt), np.integer))


def _plain_int_ids(ids):
    """A list / tuple of plain Python ints (what tokenizers return; not bools) as an int64
    array in one conversion, or None for anything else (then checked item by item)."""
    if not all(type(t) is int for t in ids):
        return None
    try:
        return np.asarray(ids, np.int64) if ids else np.zeros((0,), np.int64)
    except OverflowError:
        return None


def check_token_ids(ids, vocab_size: int, what: str) -> np.ndarray:
    """``ids`` as a 1-D int array of token ids in ``[0, vocab_size)`` (may be empty). A list
    of plain ints (a tokenizer's) is converted at once; any other list item by item, so the
    message names a float, bool, nested list or an int numpy cannot hold (2**70) and its
    index, instead of numpy's conversion error."""
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"{what} is text: pass token ids (tokenizer.encode(text))")

    def outside(j, t):
        return ValueError(f"{what} has token id {int(t)} at index {j}, outside the vocabulary "
                          f"[0, {vocab_size}): encode with the model's own tokenizer")

    if isinstance(ids, (list, tuple)):
        arr = _plain_int_ids(ids)
        if arr is None:  # not all plain ints of int64's range: each item checked and named
            for j, t in enumerate(ids):
                if isinstance(t, (list, tuple)) or np.ndim(t) > 0:   # lists first: ragged ones
                    raise ValueError(f"{what} must be a 1-D list of token ids, but holds "
                                     f"{type(t).__name__} {t!r} at index {j}: pass a flat "
                                     "list of ids")
                if not _is_int_item(t):
                    raise TypeError(f"{what} holds a {type(t).__name__} ({t!r}) at index {j}: "
                                    "pass int token ids (tokenizer.encode(text) gives them)")
                if not 0 <= int(t) < vocab_size:   # before numpy, which cannot hold 2**70
                    raise outside(j, t)
            # int64 explicitly: numpy would promote int64 mixed with uint64 items to float64
            arr = np.asarray([int(t) for t in ids], np.int64)
    else:
        arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a 1-D list of token ids, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{what} must hold integer token ids, got dtype {arr.dtype}")
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        j = int(np.argmax(bad))
        raise outside(j, arr[j])
    return arr.astype(np.int64)


def scalar_value(v):
    """A numpy scalar or a concrete 0-d array (numpy or jax) as its Python value; anything
    else (a traced value too) as it is."""
    if isinstance(v, np.generic) or isinstance(v, (np.ndarray, jax.Array)) and \
            not isinstance(v, jax.core.Tracer) and v.ndim == 0:
        return v.item()
    return v


def check_sampling_args(temperature, top_k, top_p) -> None:
    """The arguments of ``Sampling.make``: each a plain number (one value for the batch) in
    its range; the message names the argument."""
    for name, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
            hint = (f": pass {name}={v.strip()}" if isinstance(v, str) else
                    ": one value applies to every request (per-request sampling is not "
                    "supported): split the batch" if np.ndim(v) else "")
            raise TypeError(f"{name} must be a number, got {type(v).__name__} {v!r}{hint}")
    # an int is finite (math.isfinite(2**1100) would overflow); Sampling names one that
    # float32 cannot hold
    if not (_is_int(temperature) or math.isfinite(temperature)) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if not _is_int(top_k) or not 0 <= top_k < 2**31:
        raise ValueError(f"top_k must be an int >= 0 and < 2**31 (0 = off; a value over the "
                         f"vocabulary size keeps every token), got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def check_int(name: str, value, *, minimum: int) -> int:
    """``value`` (an int, or a 0-d integer array) as a Python int >= ``minimum``."""
    value = scalar_value(value)
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_params(cfg, params) -> None:
    """Raise unless ``params`` has the tree structure, shapes and dtypes ``cfg`` implies."""
    want = _param_shapes(cfg)
    if not isinstance(params, dict):
        raise TypeError(f"params must be the jaxkv.models.llama params dict, got {type(params).__name__}: "
                        "load it with jaxkv.models.gguf_loader.load_gguf or llama.init_params")
    flat_want = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(want)}
    try:
        flat_got = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(params)}
    except Exception as e:
        raise TypeError(f"params is not a pytree of arrays ({e})") from e
    missing = sorted(set(flat_want) - set(flat_got))
    extra = sorted(set(flat_got) - set(flat_want))
    if missing or extra:
        raise ValueError(
            f"params do not match ModelConfig {cfg.name!r}: missing {missing or 'none'}, unexpected "
            f"{extra or 'none'}: use the ModelConfig returned with these params (load_gguf) or "
            "llama.init_params(cfg)")
    for k, w in flat_want.items():
        g = flat_got[k]
        shape, dtype = tuple(getattr(g, "shape", ())), getattr(g, "dtype", None)
        if shape != tuple(w.shape):
            raise ValueError(f"params{k} has shape {shape}, ModelConfig {cfg.name!r} needs "
                             f"{tuple(w.shape)}: the params belong to another model configuration")
        if dtype is None or np.dtype(dtype) != np.dtype(w.dtype):
            raise ValueError(f"params{k} has dtype {dtype}, ModelConfig {cfg.name!r} says {cfg.dtype}: "
                             f"cast the params (jax.tree.map(lambda a: a.astype('{cfg.dtype}'), params)) "
                             "or use dataclasses.replace(cfg, dtype=...)")


@jax.jit
def _leaves_finite(leaves: list) -> jax.Array:
    """[n] bool: leaf i holds no NaN / Inf. One program per params structure, one read of
    the weights (the reductions fuse)."""
    return jnp.stack([jnp.isfinite(x).all() for x in leaves])


def check_params_finite(params) -> None:
    """Raise ValueError naming the first params leaf that holds NaN or Inf (such weights
    decode to garbage, e.g. token 0 repeated). Cost: one jitted reduction over the leaves,
    compiled once per params structure; it reads every weight once (~4 ms for 16 GB on an
    H200, well under a second for a few GB on a CPU)."""
    flat = jax.tree_util.tree_leaves_with_path(params)
    ok = np.asarray(_leaves_finite([x for _, x in flat]))
    if not ok.all():
        path = jax.tree_util.keystr(flat[int(np.argmin(ok))][0])
        raise ValueError(f"params{path} holds NaN or Inf values: the weights are corrupt or were "
                         "built wrongly (re-load them; after training, check for divergence); "
                         "generation would give garbage")


_SHAPES_CACHE: dict = {}


def _param_shapes(cfg):
    if cfg not in _SHAPES_CACHE:
        from jaxkv.models import llama
        _SHAPES_CACHE[cfg] = llama.param_shapes(cfg)
    return _SHAPES_CACHE[cfg]


# ------------------------------------------------------------------------------ cache level
def _concrete(x) -> np.ndarray | None:
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def _int_array(name: str, x, ndim: int | None = None):
    dt = getattr(x, "dtype", None)
    if dt is None or not np.issubdtype(np.dtype(dt), np.integer):
        raise TypeError(f"{name} must be an integer array (int32), got dtype {dt}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")


def check_cache_state(spec, cache) -> None:
    """Raise unless ``cache`` (a ``HostTierCache``) has the shapes and dtypes of ``spec``."""
    from jaxkv.cache import HostTierCache
    from jaxkv.spec import CacheSpec

    if not isinstance(spec, CacheSpec):
        raise TypeError(f"spec must be a jaxkv.CacheSpec, got {type(spec).__name__}")
    if not isinstance(cache, HostTierCache):
        raise TypeError(f"cache must be a HostTierCache (jaxkv.cache.init_cache(spec)), got "
                        f"{type(cache).__name__}")
    L, P, S = spec.num_layers, spec.num_logical_pages, spec.num_slots
    want = {"host_kv": (spec.host_shape, spec.jnp_dtype), "pool": (spec.pool_shape, spec.jnp_dtype),
            "page_table": ((L, P), np.int32), "slot_owner": ((L, S), np.int32),
            "last_used": ((L, S), np.int32)}
    for name, (shape, dtype) in want.items():
        a = getattr(cache, name)
        if tuple(a.shape) != tuple(shape) or np.dtype(a.dtype) != np.dtype(dtype):
            raise ValueError(f"cache.{name} is {a.dtype}{list(a.shape)}, the spec needs "
                             f"{np.dtype(dtype)}{list(shape)}: build the cache with "
                             "jaxkv.cache.init_cache(spec) for this spec")


def check_page_requests(spec, requests, protect, layers=None) -> None:
    """Check ``ensure_resident`` arguments: requests [Lr, R], protect [Lr, Q], layers [Lr].

    Values are checked when concrete: pages in ``[-1, P)``, layers in ``[0, L)`` and distinct.
    """
    _int_array("requests", requests, 2)
    _int_array("protect", protect, 2)
    Lr = requests.shape[0]
    if protect.shape[0] != Lr:
        raise ValueError(f"protect has {protect.shape[0]} rows, requests {Lr}: one row per layer")
    if layers is None:
        if Lr != spec.num_layers:
            raise ValueError(f"requests has {Lr} rows but the cache has {spec.num_layers} layers: "
                             "pass layers=[...] for a subset")
    else:
        _int_array("layers", layers, 1)
        if layers.shape[0] != Lr:
            raise ValueError(f"layers has {layers.shape[0]} entries, requests {Lr} rows")
        lv = _concrete(layers)
        if lv is not None:
            if lv.size and (lv.min() < 0 or lv.max() >= spec.num_layers):
                raise ValueError(f"layers {lv.tolist()} outside [0, {spec.num_layers})")
            if len(set(lv.tolist())) != lv.size:
                raise ValueError(f"layers {lv.tolist()} repeat a layer: ensure each layer once per call")
    for name, x in (("requests", requests), ("protect", protect)):
        v = _concrete(x)
        if v is not None and v.size and (v.min() < -1 or v.max() >= spec.num_logical_pages):
            raise ValueError(f"{name} holds page {int(v.min() if v.min() < -1 else v.max())} outside "
                             f"[0, {spec.num_logical_pages}) (-1 = none): pages are logical ids "
                             "b * pages_per_seq + j")


def check_token_writes(spec, layer, logical_pages, offsets, kv) -> None:
    """Check ``write_through`` arguments: layer scalar or [M], logical_pages/offsets [M],
    kv [M, 2, H, D]. Values are checked when concrete (``write_through`` writes nothing for
    a page ``>= P``: a silent no-op the check makes an error)."""
    _int_array("logical_pages", logical_pages, 1)
    _int_array("offsets", offsets, 1)
    M = logical_pages.shape[0]
    want = (M, 2, spec.num_kv_heads, spec.head_dim)
    if tuple(offsets.shape) != (M,):
        raise ValueError(f"offsets shape {tuple(offsets.shape)} != logical_pages shape ({M},)")
    if tuple(kv.shape) != want:
        raise ValueError(f"kv shape {tuple(kv.shape)} != [M, 2, H, D] = {list(want)}")
    if not np.issubdtype(np.dtype(kv.dtype), np.floating):
        raise TypeError(f"kv must be a float array, got {kv.dtype}")
    checks = ((layer, spec.num_layers, "layer"), (logical_pages, spec.num_logical_pages, "logical_pages"),
              (offsets, spec.page_size, "offsets"))
    for x, hi, name in checks:
        v = _concrete(x)
        if v is not None and v.size and (v.min() < -1 or v.max() >= hi):
            raise ValueError(f"{name} holds {int(v.min() if v.min() < -1 else v.max())} outside "
                             f"[0, {hi}) (-1 = inactive for logical_pages)")


# ------------------------------------------------------------------------------ strict mode
def strict_violations(stats: dict) -> list[str]:
    """Human-readable reasons why ``stats`` fail strict mode (empty: none)."""
    out = []
    if stats.get("dropped", 0) > 0:
        out.append(f"{stats['dropped']} selected pages were dropped because the device pool "
                   f"({stats.get('pool_pages')} pages per layer) could not hold a step's working set: "
                   "raise CacheConfig.pool_pages (None = no drops) or lower selected_pages / batch")
    if stats.get("truncated_requests", 0) > 0:
        out.append(f"{stats['truncated_requests']} requests stopped at the context capacity "
                   f"({stats.get('max_context')} tokens) before max_new_tokens: raise "
                   "CacheConfig.max_context or lower max_new_tokens")
    return out


class StrictModeError(RuntimeError):
    """Strict mode failed after the run; ``.result`` holds its ``GenerateResult`` (the tokens
    generated, the stats), or None when the check ran on stats alone."""

    def __init__(self, message: str, result=None):
        super().__init__(message)
        self.result = result


def check_strict(stats: dict, result=None) -> None:
    """Strict mode: raise :class:`StrictModeError` (a RuntimeError carrying ``result``) if any
    counter in STRICT_COUNTERS is non-zero."""
    why = strict_violations(stats)
    if why:
        raise StrictModeError("strict mode: " + "; ".join(why) + (
            " (the generated tokens are in this exception's .result)" if result is not None else ""),
            result)


def nbytes_of(tree) -> int:
    """Bytes of every array (or ShapeDtypeStruct) leaf of ``tree``."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def nbytes_by_space(tree) -> dict:
    """Bytes of ``tree``'s arrays (or ``jax.ShapeDtypeStruct`` leaves, e.g.
    ``engine.abstract_state``) by memory space: ``{"device": ..., "host": ...}`` (pinned host
    memory). PRNG keys count nothing."""
    out = {"device": 0, "host": 0}
    for x in jax.tree.leaves(tree):
        if not hasattr(x, "shape") or jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
            continue
        space = (x._memory_space if isinstance(x, jax.ShapeDtypeStruct)
                 else jax.typeof(x).memory_space)
        out["host" if space == jax.memory.Space.Host else "device"] += (
            math.prod(x.shape) * np.dtype(x.dtype).itemsize)
    return out
