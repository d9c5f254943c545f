"""Lowering the engine's programs for a GPU on a machine without one.

A decode round, a prompt's prefill layer or a continued turn's layer lowered as an H200 would
compile them, on any machine (the CPU CI, a laptop): the kernels go through Pallas' Triton
lowering, which checks what interpret mode on the CPU does not (power-of-two blocks, the
primitives Triton supports, memory spaces). With :func:`jaxkv.state.abstract_state` the state
is shapes only, so a round lowers at full benchmark size (an 8B-like model's 16 GiB tier at
128k) in seconds::

    from jaxkv import lowering
    with lowering.gpu_target():
        plan = engine.Plan(model=cfg, cache=cache, batch=1, prompt_len=n, max_context=n,
                           num_stop=4)
        text = lowering.lower_round(plan, jax.eval_shape(lambda: llama.init_params(cfg, 0)),
                                    engine.abstract_state(plan, [n]))

Build plans inside :func:`gpu_target` (a plan reads its per-backend defaults when built).
Nothing is compiled: the Triton -> PTX step, XLA:GPU's passes and everything at run time are
left to the GPU tests (``pytest -m gpu`` on the GPU machine)."""
from __future__ import annotations

import contextlib
import functools
import re
import warnings

import jax
import jax.numpy as jnp

from jaxkv.kernels import _common

TRITON_CALL = "__gpu$xla.gpu.triton"  # the custom call a Pallas kernel lowers to on the GPU


@contextlib.contextmanager
def gpu_target():
    """Inside: jaxkv builds its programs for the GPU (``_common.target_platform("gpu")``)."""
    with _common.target_platform("gpu"):
        yield


def _mesh(device_kind: str, num_cores: int):
    from jax.sharding import AbstractDevice, AbstractMesh
    return AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind=device_kind, num_cores=num_cores, platform="gpu"))


_SYMBOL = r'"[^"]+"|[\w.$-]+'  # an MLIR symbol name, quoted where it has other characters


def count_calls(text: str, marker: str = TRITON_CALL) -> int:
    """How many ``marker`` calls (Pallas kernels by default) one run of the lowered module's
    entry makes along its static call graph: a function's own occurrences plus those of the
    functions it calls, once per call. A jitted function called with the same shapes (a
    layer's top-k) lowers once as a private function with a call per use, so counting the
    text would count it once. Loop bodies count once, as in the text."""
    bodies = {}
    for chunk in re.split(r"(?=\bfunc\.func )", text)[1:]:
        m = re.match(r"func\.func (?:public |private )?@(" + _SYMBOL + ")", chunk)
        if m:
            bodies[m.group(1)] = chunk
    memo: dict[str, int] = {}

    def total(name: str) -> int:
        if name not in memo:
            memo[name] = 0  # a recursive call counts nothing more
            body = bodies[name]
            memo[name] = body.count(marker) + sum(
                total(c) for c in re.findall(r"call @(" + _SYMBOL + ")", body) if c in bodies)
        return memo[name]

    if not bodies:
        return text.count(marker)
    entry = "main" if "main" in bodies else next(iter(bodies))
    return total(entry)


def lower(fn, *args, device_kind: str = "NVIDIA H200", num_cores: int = 132) -> str:
    """StableHLO text of ``jax.jit(fn)`` lowered for CUDA on an abstract GPU (``args``:
    arrays or ``jax.ShapeDtypeStruct``, shardings with memory kinds allowed). The prefill's
    attention lowers with its Pallas kernel, not cuDNN's (no cuDNN without the GPU; its
    warning is silenced here)."""
    from jax.sharding import use_abstract_mesh
    with use_abstract_mesh(_mesh(device_kind, num_cores)), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "prefill_attention: cuDNN")
        return jax.jit(fn).trace(*abstract(args)).lower(lowering_platforms=("cuda",)).as_text()


def abstract(tree):
    """``tree``'s arrays as ``jax.ShapeDtypeStruct`` with their shardings and memory spaces
    (a pinned host array stays a host operand)."""
    def one(x):
        if not isinstance(x, jax.Array):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding,
                                    _memory_space=jax.typeof(x).memory_space)
    return jax.tree.map(one, tree)


def lower_round(plan, params, state, sampling=None, max_new: int = 8, **kw) -> str:
    """``plan``'s decode round (``decode.decode_round``) for CUDA; ``params`` / ``state``
    concrete or abstract. ``kw``: :func:`lower`'s device."""
    from jaxkv import decode
    from jaxkv.sampling import Sampling
    sampling = Sampling.make() if sampling is None else sampling
    return lower(functools.partial(decode._decode_round, plan), params, state, sampling,
                 jnp.full((plan.num_stop,), -1, jnp.int32), jnp.int32(max_new), **kw)


def lower_prefill(plan, layer_params, kv, summaries, dense=(), *, extend: bool = False,
                  tokens: int | None = None, **kw) -> str:
    """One prompt prefill layer (``prefill.prefill_layer``) of ``plan`` for CUDA, or with
    ``extend`` a continued turn's layer (``prefill.extend_layer``), over ``tokens`` new tokens
    (default: the plan's prompt length)."""
    from jaxkv import prefill
    B, T = plan.batch, tokens or plan.prompt_len
    x = jax.ShapeDtypeStruct((B, T, plan.model.d_model), plan.model.dtype)
    i32 = jax.ShapeDtypeStruct((B,), jnp.int32)
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    if extend:
        fn, lengths = prefill.extend_layer, (i32, i32)
    else:
        fn, lengths = prefill.prefill_layer, (i32,)
    return lower(functools.partial(fn.__wrapped__, plan), layer_params, layer, x, *lengths, kv,
                 summaries, dense, **kw)
