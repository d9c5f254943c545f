"""jaxkv.generate(): batched generation with a host-tier (or resident) sparse KV cache (public API)."""
from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import compile_stats, engine
from jaxkv.config import CacheConfig, Sampling
from models.configs import ModelConfig

_HOST_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
_DEFAULT_GPU_HOST_LIMIT_GB = 64


@dataclasses.dataclass
class GenerateResult:
    """tokens: generated ids per request (a stop token, if hit, is the last one).
    stats: timings, cache counters and memory (see README, "Stats")."""

    tokens: list[list[int]]
    stats: dict


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _validate_prompts(model: ModelConfig, prompts) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists "
                         "(encode text with the model's tokenizer first)")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)):
            raise TypeError(f"prompt {i} is text: pass token ids (tokenizer.encode(text))")
        arr = np.asarray(p)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"prompt {i} must be a non-empty 1-D list of token ids, got shape {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"prompt {i} must hold integer token ids, got dtype {arr.dtype}")
        bad = (arr < 0) | (arr >= model.vocab_size)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(f"prompt {i} has token id {int(arr[j])} at index {j}, outside the "
                             f"vocabulary [0, {model.vocab_size})")
        out.append([int(t) for t in arr])
    return out


def _host_limit_bytes() -> int | None:
    """The pinned-host cap on GPU (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, default 64 GiB)."""
    if jax.default_backend() != "gpu":
        return None
    gb = float(os.environ.get(_HOST_LIMIT_ENV, _DEFAULT_GPU_HOST_LIMIT_GB))
    return int(gb * 2**30)


def make_plan(model: ModelConfig, cache: CacheConfig, prompt_lens: Sequence[int],
              max_new_tokens: int, num_stop: int) -> engine.Plan:
    """Bucket shapes (prompt length, context) so similar calls share one compilation."""
    ps = cache.page_size
    longest = max(prompt_lens)
    need = longest + max_new_tokens
    if cache.max_context is not None:
        max_context = -(-cache.max_context // ps) * ps
        if need > max_context:
            raise ValueError(
                f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds "
                f"CacheConfig.max_context ({cache.max_context}): raise max_context or shorten the request")
    else:
        max_context = max(_next_pow2(need), 256, ps)
    if need > model.max_position:
        raise ValueError(
            f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) = {need} exceeds the model's "
            f"max_position ({model.max_position}): shorten the prompt or lower max_new_tokens")
    prompt_len = min(max(_next_pow2(longest), ps), max_context)
    # strict only changes the Python-side check after the call: keep it out of the jit key
    plan = engine.Plan(model=model, cache=dataclasses.replace(cache, strict=False), batch=len(prompt_lens), prompt_len=prompt_len,
                       max_context=max_context, num_stop=num_stop)
    spec = plan.spec  # validates shapes (pinned pages vs pool, ...)
    if cache.mode == "host":
        if cache.pool_pages is not None and cache.pool_pages < plan.k + plan.num_pinned:
            raise ValueError(
                f"pool_pages ({cache.pool_pages}) is smaller than one request's selection "
                f"(selected_pages {plan.k} + pinned {plan.num_pinned}): raise pool_pages")
        limit = _host_limit_bytes()
        if limit is not None and spec.host_bytes > limit:
            raise ValueError(
                f"the host tier needs {spec.host_bytes / 2**30:.1f} GiB of pinned host memory, over the "
                f"cap of {limit / 2**30:.0f} GiB: set {_HOST_LIMIT_ENV} (in GB) before JAX starts, "
                "or lower batch / max_context")
    _check_device_memory(plan)
    return plan


def _check_device_memory(plan: engine.Plan):
    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return
    spec = plan.spec
    need = spec.pool_bytes if plan.cache.mode == "host" else spec.host_bytes
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    if need > free:
        what = "device pool" if plan.cache.mode == "host" else "resident KV cache"
        raise ValueError(f"the {what} needs {need / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB of "
                         "device memory is free: lower pool_pages / batch / max_context, or use mode='host'")


def _memory_stats(plan: engine.Plan, state: engine.DecodeState) -> dict:
    spec = plan.spec
    summ = sum(int(a.nbytes) for a in jax.tree.leaves(state.summaries))
    if plan.cache.mode == "host":
        dev = spec.pool_bytes + summ + int(state.kv.page_table.nbytes) * 3
        host = spec.host_bytes
    else:
        dev, host = spec.host_bytes + summ, 0
    return {"device_kv_bytes": dev, "host_kv_bytes": host,
            "logical_kv_bytes": spec.host_bytes,
            "pool_fraction_of_logical": (spec.pool_bytes / spec.host_bytes
                                         if plan.cache.mode == "host" else 1.0)}


class TokenStream:
    """Iterator over rounds: each item is a list (one per request) of the new token ids.

    After the iteration ends, ``.result`` holds the :class:`GenerateResult`.
    """

    def __init__(self, gen: Iterator):
        self._gen = gen
        self.result: GenerateResult | None = None

    def __iter__(self):
        self.result = yield from self._gen


def generate(model: ModelConfig, params, prompts, *, max_new_tokens: int = 32,
             sampling: Sampling | None = None, cache: CacheConfig | None = None,
             stop_tokens: Sequence[int] | None = None, seed: int = 0, stream: bool = False,
             progress: bool | None = None):
    """Generate up to ``max_new_tokens`` tokens for each prompt.

    Args:
      model: the ModelConfig of ``params``.
      params: the model's params pytree (models.llama layout).
      prompts: list of token-id lists (different lengths allowed).
      max_new_tokens: per request (traced: changing it does not recompile).
      sampling: :class:`Sampling` (default greedy); traced.
      cache: :class:`CacheConfig` (mode "host" or "resident", selector, page size, pool...).
      stop_tokens: ids that end a request (default: the model's eos id).
      seed: PRNG seed for sampling.
      stream: return a :class:`TokenStream` yielding tokens round by round.
      progress: show a prefill progress bar (default: prompts of >= 8k tokens).
    Returns:
      :class:`GenerateResult` (or a :class:`TokenStream` when ``stream``).
    """
    gen = _generate(model, params, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                    cache=cache, stop_tokens=stop_tokens, seed=seed, progress=progress)
    if stream:
        return TokenStream(gen)
    try:
        while True:
            next(gen)
    except StopIteration as e:
        return e.value


def _generate(model, params, prompts, *, max_new_tokens, sampling, cache, stop_tokens, seed, progress):
    if not isinstance(model, ModelConfig):
        raise TypeError(f"model must be a models.configs.ModelConfig, got {type(model).__name__}")
    cache = cache or CacheConfig()
    sampling = sampling or Sampling.make()
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    prompts = _validate_prompts(model, prompts)
    stops = [model.eos_id] if stop_tokens is None else [int(t) for t in stop_tokens]
    num_stop = max(4, _next_pow2(len(stops)))
    stop_ids = jnp.asarray(stops + [-1] * (num_stop - len(stops)), jnp.int32)
    lens = [len(p) for p in prompts]
    plan = make_plan(model, cache, lens, int(max_new_tokens), num_stop)
    B, T = plan.batch, plan.prompt_len
    compiles0 = compile_stats.snapshot()

    # ---- prefill ---------------------------------------------------------------------
    t0 = time.perf_counter()
    tokens = np.zeros((B, T), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    lengths = jnp.asarray(lens, jnp.int32)
    kv = engine.init_kv(plan)
    summaries = engine.init_summaries(plan)
    x = engine.embed_prompt(plan, params, jnp.asarray(tokens))
    show = progress if progress is not None else max(lens) >= 8192
    layers = range(model.num_layers)
    if show:
        from tqdm.auto import tqdm
        layers = tqdm(layers, desc=f"prefill {sum(lens)} tokens", unit="layer")
    for layer in layers:
        x, kv, summaries = engine.prefill_layer(plan, params, jnp.int32(layer), x, lengths, kv, summaries)
    key = jax.random.key(seed)
    key, sub = jax.random.split(key)
    first = engine.first_token(plan, params, x, lengths, sampling, sub)
    first_np = np.asarray(first)
    t_prefill = time.perf_counter() - t0
    del x

    stop_np = set(stops)
    done0 = np.array([(t in stop_np) or max_new_tokens <= 1 for t in first_np])
    state = engine.DecodeState(
        kv=kv, summaries=summaries, lengths=lengths, last_token=first,
        done=jnp.asarray(done0), n_generated=jnp.ones((B,), jnp.int32), key=key)
    out = [[int(t)] for t in first_np]
    yield [[int(t)] for t in first_np]

    # ---- decode rounds -----------------------------------------------------------------
    max_new = jnp.int32(max_new_tokens)
    t1 = time.perf_counter()
    rounds = 0
    while not bool(np.all(np.asarray(state.done))):
        state, buf, steps = engine.decode_round(plan, params, state, sampling, stop_ids, max_new)
        buf = np.asarray(buf)[:, : int(steps)]
        rounds += 1
        new = [[int(t) for t in row if t >= 0] for row in buf]
        for o, n in zip(out, new):
            o.extend(n)
        yield new
    t_decode = time.perf_counter() - t1
    compiles = compile_stats.since(compiles0)

    counters = state.kv.counters.as_dict(plan.spec)
    n_new = sum(len(o) for o in out)
    stats = {
        "mode": cache.mode, "selector": cache.selector, "batch": B,
        "prompt_tokens": sum(lens), "generated_tokens": n_new,
        "prefill_time_s": t_prefill, "decode_time_s": t_decode,
        "prefill_tokens_per_s": sum(lens) / t_prefill if t_prefill else float("nan"),
        "decode_tokens_per_s": (n_new - B) / t_decode if t_decode > 0 else float("nan"),
        "decode_rounds": rounds,
        **counters,
        **_memory_stats(plan, state),
        "page_size": plan.page_size, "selected_pages": plan.k,
        "pool_pages": plan.pool_pages if cache.mode == "host" else plan.spec.num_logical_pages,
        "max_context": plan.max_context, "prompt_bucket": plan.prompt_len,
        "compile_time_s": compiles["time_s"], "num_compilations": compiles["count"],
    }
    if cache.strict and counters["dropped"] > 0:
        raise RuntimeError(
            f"strict mode: {counters['dropped']} selected pages were dropped because the device pool "
            f"({stats['pool_pages']} pages per layer) could not hold a step's working set: raise "
            "CacheConfig.pool_pages or lower selected_pages / batch")
    return GenerateResult(tokens=out, stats=stats)
