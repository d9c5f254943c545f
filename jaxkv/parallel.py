"""Tensor parallelism over KV heads on several devices of one host (``generate(mesh=...)``).

Megatron-style, inside ``jax.shard_map`` over a one-axis mesh named ``"kv"`` of N devices:
device j holds KV heads ``[j*H/N, (j+1)*H/N)`` and their query heads (the matching columns
of wq/wk/wv and their biases, the matching rows of wo) and MLP hidden units
``[j*F/N, (j+1)*F/N)`` (columns of w_gate/w_up, rows of w_down). The o_proj and down_proj
outputs are summed over the mesh (``llama.layer_output(axis_name=...)``). The fused per-layer
weights (``wqkv`` = [wq | wk | wv], ``w_gate_up``) are split part by part, so device j's
``wqkv`` is [its wq block | its wk block | its wv block]. The embedding, the
norms, the LM head and the indexer weights are replicated (the simplest choice: every device
computes the same logits, samples with the same key, and ``engine.agree`` makes the tokens
certainly equal).

Every device runs the single-device engine on a *local* :class:`engine.Plan` whose model has
H/N KV heads, Hq/N query heads and F/N hidden units: its own host tier (``pinned_host``), device
pool, LRU state, selector summaries and counters; page selection is per KV head, so it stays
local. Global layout: every leaf of those per-device parts (``DecodeState.kv``, ``summaries``,
``lookahead``, ``dense``) has a leading ``[N]`` axis sharded over ``"kv"``, keeping its memory
kind; the per-request values (lengths, tokens, done flags, counts, key) are replicated.
Parameters (``params["layers"]``: one dict per layer): the split leaves are stacked
``[N, ...]`` (device j's block j) and sharded, the others replicated.

Prefill runs one ``jit(shard_map(...))`` per layer; a decode round is one
``jit(shard_map(while_loop))`` with the state donated: one program over the mesh.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv import cache as kvcache
from jaxkv import engine, prefill, validation
from jaxkv.models.configs import ModelConfig

AXIS = "kv"
# per-layer leaves split over the mesh: by rows (wo, w_down) or by output columns, part by part
# for the fused ones (the widths of their parts, from the ModelConfig)
_SPLIT_ROWS = ("wo", "w_down")
_SPLIT_COLS = {"wqkv": lambda m: (m.q_dim, m.kv_dim, m.kv_dim),
               "bqkv": lambda m: (m.q_dim, m.kv_dim, m.kv_dim),
               "w_gate_up": lambda m: (m.ffn_dim, m.ffn_dim)}
# DecodeState fields that hold one shard per device (leading [N] axis)
_PER_DEVICE = ("kv", "summaries", "lookahead", "dense")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_model(model: ModelConfig, n: int) -> None:
    """Raise ValueError unless ``n`` devices can split ``model``'s KV heads and MLP."""
    for name, v in (("num_kv_heads", model.num_kv_heads), ("ffn_dim", model.ffn_dim)):
        if v % n:
            ok = [d for d in _divisors(model.num_kv_heads) if model.ffn_dim % d == 0]
            raise ValueError(
                f"tensor parallelism over {n} devices needs {name} ({v}) of model "
                f"{model.name!r} divisible by {n}: pass a mesh (or device list) of "
                f"{' / '.join(map(str, ok))} devices")


def local_model(model: ModelConfig, n: int) -> ModelConfig:
    """One device's share of ``model``: H/N KV heads, Hq/N query heads, F/N hidden units."""
    check_model(model, n)
    return dataclasses.replace(model, num_heads=model.num_heads // n,
                               num_kv_heads=model.num_kv_heads // n, ffn_dim=model.ffn_dim // n)


def _as_devices(mesh) -> list:
    if isinstance(mesh, Mesh):
        big = [(name, s) for name, s in mesh.shape.items() if s > 1]
        if len(big) > 1:
            raise ValueError(f"mesh {dict(mesh.shape)} has several axes of size > 1: tensor "
                             "parallelism uses one axis, pass jax.sharding.Mesh(devices, ('kv',))")
        return list(np.asarray(mesh.devices).reshape(-1))
    if isinstance(mesh, (str, bytes)) or not isinstance(mesh, (Sequence, np.ndarray)):
        raise TypeError(f"mesh must be None, a jax.sharding.Mesh or a list of devices, got "
                        f"{type(mesh).__name__}")
    devs = list(np.asarray(mesh, dtype=object).reshape(-1))
    if not devs or not all(isinstance(d, jax.Device) for d in devs):
        raise TypeError("mesh must be a non-empty list of jax devices (e.g. jax.devices()[:2])")
    return devs


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Drop-in for the ``engine`` functions that generate() calls, over ``mesh`` (axis "kv").

    ``init_*``, ``embed_prompt``, ``prefill_layer``, ``first_token`` and ``decode_round`` take
    the same arguments as their ``engine`` namesakes, with a *local* plan (:meth:`plan`),
    params from :meth:`shard_params` and the global state layout of the module docstring.
    ``model`` is the whole (global) model.
    """

    mesh: Mesh
    model: ModelConfig

    @classmethod
    def create(cls, mesh, model: ModelConfig) -> "TensorParallel | None":
        """From generate()'s ``mesh`` argument: None (or one device that is the default
        device) -> None, the single-device path; else a TensorParallel over those devices."""
        if mesh is None:
            return None
        devs = _as_devices(mesh)
        if len(set(devs)) != len(devs):
            raise ValueError(f"mesh lists a device twice: {devs}")
        if len(devs) == 1 and devs[0] == jax.devices()[0]:
            return None
        check_model(model, len(devs))
        return cls(Mesh(np.asarray(devs, dtype=object), (AXIS,)), model)

    @property
    def size(self) -> int:
        return self.mesh.size

    def local_model(self, model: ModelConfig | None = None) -> ModelConfig:
        return local_model(self.model if model is None else model, self.size)

    def plan(self, plan: engine.Plan) -> engine.Plan:
        """A plan made for :meth:`local_model` -> the plan that runs inside shard_map. Checks
        the pinned host memory: each device's tier against the cap (every GPU has its own
        pinned-host allocator), all of them together against the host's RAM."""
        if plan.cache.mode == "host":
            validation.check_host_capacity(plan.spec.host_bytes, devices=self.size,
                                           fix="lower batch / max_context")
        return dataclasses.replace(plan, axis_name=AXIS)

    # ------------------------------------------------------------------ placement
    def _sharding(self, spec: P, memory_kind: str = "device") -> NamedSharding:
        return NamedSharding(self.mesh, spec, memory_kind=memory_kind)

    def shard_params(self, params):
        """Global params (``self.model``'s): split leaves as ``[N, ...]`` stacks sharded over
        "kv" (device j's block j), the others replicated on every device."""
        n = self.size

        def one(path, a):
            name = _leaf_name(path)
            if name is None:
                return jax.device_put(a, self._sharding(P()))
            if name in _SPLIT_ROWS:          # [rows, d] -> [n, rows/n, d]
                a = jnp.reshape(a, (n, a.shape[0] // n) + a.shape[1:])
            else:                            # [..., w1 + w2 (+ w3)] -> [n, ..., (w1 + w2 + w3)/n]
                parts, start = [], 0
                for w in _SPLIT_COLS[name](self.model):
                    part = a[..., start:start + w]
                    parts.append(jnp.reshape(part, part.shape[:-1] + (n, w // n)))
                    start += w
                a = jnp.moveaxis(jnp.concatenate(parts, axis=-1), -2, 0)
            return jax.device_put(a, self._sharding(P(AXIS)))

        return jax.tree_util.tree_map_with_path(one, params)

    def _state_shardings(self, state: engine.DecodeState):
        """Per-device parts sharded over "kv" (keeping each leaf's memory kind: the host tier
        stays pinned_host); the rest replicated."""
        rep = self._sharding(P())

        def per_device(a):
            return self._sharding(P(AXIS), getattr(a.sharding, "memory_kind", None) or "device")

        return engine.DecodeState(**{
            f.name: jax.tree.map(per_device if f.name in _PER_DEVICE else (lambda _: rep),
                                 getattr(state, f.name))
            for f in dataclasses.fields(engine.DecodeState)})

    # ------------------------------------------------------------------ state
    def _alloc(self, plan, what: str, poison: bool = False):
        fn = _alloc_fn(self, plan, what, poison)
        out = () if fn is None else fn()
        if what == "kv" and plan.cache.mode == "host":
            # the host tier is built on the host, never in a program (kvcache.host_zeros)
            spec = plan.spec
            out = dataclasses.replace(out, host_kv=kvcache.host_zeros(
                (self.size,) + spec.host_shape, spec.dtype, self._sharding(P(AXIS), "pinned_host")))
        return out

    def init_kv(self, plan, *, poison: bool = False):
        return self._alloc(plan, "kv", poison)

    def init_dense(self, plan, *, poison: bool = False):
        return self._alloc(plan, "dense", poison)

    def init_summaries(self, plan):
        return self._alloc(plan, "summaries")

    def init_lookahead(self, plan):
        return self._alloc(plan, "lookahead")

    # ------------------------------------------------------------------ compiled parts
    def embed_prompt(self, plan, params, tokens):
        """tokens [B, T] -> x [B, T, d] replicated."""
        fn = _smap_fn(self, plan, "embed", jax.tree.structure(params))
        return fn(params, tokens)

    def prefill_layer(self, plan, layer_params, layer, x, lengths, kv, summaries, dense=()):
        """engine.prefill_layer on every device's shard (kv, summaries, dense donated);
        ``layer_params``: ``shard_params(...)["layers"][layer]``."""
        sh = jax.tree.map(lambda a: a.sharding, (kv, summaries, dense))
        fn = _prefill_fn(self, plan, jax.tree.structure(layer_params), _key(sh))
        return fn(layer_params, layer, x, lengths, kv, summaries, dense)

    def first_token(self, plan, params, x, lengths, sampling, key):
        fn = _smap_fn(self, plan, "first", jax.tree.structure(params))
        return fn(params, x, lengths, sampling, key)

    def _round(self, plan, params, state):
        sh = self._state_shardings(state)
        state = jax.device_put(state, sh)
        return _round_fn(self, plan, jax.tree.structure(params), _key(sh)), state

    def decode_round(self, plan, params, state, sampling, stop_ids, max_new):
        """engine.decode_round over the mesh: one jit(shard_map(while_loop)), state donated.
        Returns (state, tokens [B, round_steps], steps) (tokens and steps replicated)."""
        fn, state = self._round(plan, params, state)
        return fn(params, state, sampling, stop_ids, max_new)

    def map_state(self, fn, state: engine.DecodeState) -> engine.DecodeState:
        """``fn(one device's DecodeState) -> DecodeState`` (traceable; e.g.
        ``benchmarks/synthetic.py``'s ``reuse_state``) on every device's shard in one jit(shard_map); ``state``
        is donated. The per-request fields ``fn`` returns must not depend on the device.
        Compiles on every call (``fn`` is the cache key): for set-up, not for loops."""
        sh = self._state_shardings(state)
        state = jax.device_put(state, sh)
        smap = jax.shard_map(
            lambda st: _expand_state(fn(_squeeze_state(st))), mesh=self.mesh,
            in_specs=(_STATE_SPECS,), out_specs=_STATE_SPECS, check_vma=False)
        out = jax.eval_shape(smap, state)
        host = jax.memory.Space.Host
        out_sh = engine.DecodeState(**{
            f.name: jax.tree.map(
                lambda a, name=f.name: self._sharding(
                    P(AXIS) if name in _PER_DEVICE else P(),
                    "pinned_host" if jax.typeof(a).memory_space == host else "device"),
                getattr(out, f.name))
            for f in dataclasses.fields(engine.DecodeState)})
        return jax.jit(smap, donate_argnums=(0,), out_shardings=out_sh)(state)

    def lower_decode_round(self, plan, params, state, sampling, stop_ids, max_new):
        """The lowered decode round (tests inspect its HLO)."""
        fn, state = self._round(plan, params, state)
        return fn.lower(params, state, sampling, stop_ids, max_new)


def _leaf_name(path) -> str | None:
    """The name of a split leaf (a per-layer weight), else None (replicated). Works on the
    whole params tree and on one layer's dict."""
    name = getattr(path[-1], "key", None) if path else None
    return name if name in _SPLIT_ROWS or name in _SPLIT_COLS else None


def _param_specs(treedef):
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(
        jax.tree.unflatten(treedef, [0] * treedef.num_leaves))[0]]
    return jax.tree.unflatten(treedef, [P(AXIS) if _leaf_name(p) else P() for p in paths])


def _local_params(params):
    """Inside shard_map: drop the [1] device axis of the split leaves."""
    return jax.tree_util.tree_map_with_path(lambda p, a: a[0] if _leaf_name(p) else a, params)


def _squeeze(tree):
    return jax.tree.map(lambda a: a[0], tree)


def _expand(tree):
    return jax.tree.map(lambda a: a[None], tree)


_STATE_SPECS = engine.DecodeState(**{
    f.name: P(AXIS) if f.name in _PER_DEVICE else P() for f in dataclasses.fields(engine.DecodeState)})


def _squeeze_state(st):
    return dataclasses.replace(st, **{f: _squeeze(getattr(st, f)) for f in _PER_DEVICE})


def _expand_state(st):
    return dataclasses.replace(st, **{f: _expand(getattr(st, f)) for f in _PER_DEVICE})


def _key(shardings):
    return jax.tree.structure(shardings), tuple(jax.tree.leaves(shardings))


def _unkey(key):
    return jax.tree.unflatten(key[0], key[1])


def _raw(fn):
    """The Python function under a jax.jit (its jit is inlined in ours anyway)."""
    return getattr(fn, "__wrapped__", fn)


@functools.lru_cache(maxsize=64)
def _alloc_fn(tp: TensorParallel, plan, what: str, poison: bool):
    def local():
        if what == "kv":
            out = engine.init_kv(plan, poison=poison, traced=True)
        elif what == "dense":
            out = engine.init_dense(plan, poison=poison, traced=True)
        elif what == "summaries":
            out = engine.init_summaries(plan)
        else:
            out = engine.init_lookahead(plan)
        return _expand(out)

    shapes = jax.eval_shape(local)
    if not jax.tree.leaves(shapes):
        return None
    host = jax.memory.Space.Host
    out_sh = jax.tree.map(lambda a: tp._sharding(
        P(AXIS), "pinned_host" if jax.typeof(a).memory_space == host else "device"), shapes)
    return jax.jit(jax.shard_map(local, mesh=tp.mesh, in_specs=(), out_specs=P(AXIS),
                                 check_vma=False), out_shardings=out_sh)


@functools.lru_cache(maxsize=64)
def _smap_fn(tp: TensorParallel, plan, what: str, treedef):
    ps = _param_specs(treedef)
    if what == "embed":
        def local(params, tokens):
            return _raw(prefill._embed)(plan.model, _local_params(params), tokens)
        in_specs = (ps, P())
    else:
        def local(params, x, lengths, sampling, key):
            return _raw(engine.first_token)(plan, _local_params(params), x, lengths, sampling, key)
        in_specs = (ps, P(), P(), P(), P())
    # check_vma=False: the Pallas kernels do not declare how their outputs vary over the mesh
    return jax.jit(jax.shard_map(local, mesh=tp.mesh, in_specs=in_specs, out_specs=P(),
                                 check_vma=False), out_shardings=tp._sharding(P()))


@functools.lru_cache(maxsize=64)
def _prefill_fn(tp: TensorParallel, plan, treedef, shardings_key):
    def local(params, layer, x, lengths, kv, summaries, dense):  # params: one layer's
        x, kv, summaries, dense = _raw(engine.prefill_layer)(
            plan, _local_params(params), layer, x, lengths, _squeeze(kv), _squeeze(summaries),
            _squeeze(dense))
        return x, _expand(kv), _expand(summaries), _expand(dense)

    smap = jax.shard_map(local, mesh=tp.mesh,
                         in_specs=(_param_specs(treedef), P(), P(), P(), P(AXIS), P(AXIS), P(AXIS)),
                         out_specs=(P(), P(AXIS), P(AXIS), P(AXIS)), check_vma=False)
    kv_sh, summ_sh, dense_sh = _unkey(shardings_key)
    return jax.jit(smap, donate_argnums=(4, 5, 6),
                   out_shardings=(tp._sharding(P()), kv_sh, summ_sh, dense_sh))


@functools.lru_cache(maxsize=64)
def _round_fn(tp: TensorParallel, plan, treedef, shardings_key):
    state_sh = _unkey(shardings_key)

    def local(params, state, sampling, stop_ids, max_new):
        st, buf, steps = engine._decode_round(plan, _local_params(params), _squeeze_state(state),
                                              sampling, stop_ids, max_new)
        return _expand_state(st), buf, steps

    smap = jax.shard_map(local, mesh=tp.mesh,
                         in_specs=(_param_specs(treedef), _STATE_SPECS, P(), P(), P()),
                         out_specs=(_STATE_SPECS, P(), P()), check_vma=False)
    rep = tp._sharding(P())
    return jax.jit(smap, donate_argnums=(1,), out_shardings=(state_sh, rep, rep),
                   compiler_options=engine.round_compiler_options(plan) or None)
