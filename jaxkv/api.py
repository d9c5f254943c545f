"""jaxkv.generate(): batched generation with a host-tier (or resident) sparse KV cache (public API)."""
from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import cache as kvcache
from jaxkv import compile_stats, engine, parallel, validation
from jaxkv.config import CacheConfig, Sampling
from jaxkv.models.configs import ModelConfig


@dataclasses.dataclass
class GenerateResult:
    """tokens: generated ids per request (a stop token, if hit, is the last one).
    stats: timings, cache counters and memory (see README, "Stats")."""

    tokens: list[list[int]]
    stats: dict


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _validate_prompts(model: ModelConfig, prompts) -> list[list[int]]:
    if isinstance(prompts, (np.ndarray, jax.Array)) and prompts.ndim == 2:
        prompts = list(np.asarray(prompts))  # a [B, T] array of equal-length prompts
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists "
                         "(encode text with the model's tokenizer first)")
    out = []
    for i, p in enumerate(prompts):
        if not isinstance(p, (str, bytes)) and np.asarray(p).size == 0:
            raise ValueError(f"prompt {i} is empty: every request needs at least one token "
                             "(e.g. the BOS id)")
        arr = validation.check_token_ids(p, model.vocab_size, f"prompt {i}")
        out.append([int(t) for t in arr])
    return out


def _need_device_bytes(plan: engine.Plan) -> int:
    """Device bytes generate() allocates for the KV cache (pool or resident) and summaries."""
    spec = plan.spec
    kv = spec.pool_bytes if plan.cache.mode == "host" else spec.host_bytes
    return kv + validation.nbytes_of(jax.eval_shape(lambda: engine.init_summaries(plan)))


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
        # at least one page per pinned (sink + recent) page, each held apart in the cache
        max_context = max(_next_pow2(need), 256, ps * _next_pow2(cache.sink_pages + cache.recent_pages))
    pinned = cache.sink_pages + cache.recent_pages
    if pinned > max_context // ps:
        raise ValueError(
            f"CacheConfig.max_context ({cache.max_context}) holds {max_context // ps} page(s) of "
            f"{ps} tokens, fewer than the {pinned} pinned pages (sink_pages {cache.sink_pages} + "
            f"recent_pages {cache.recent_pages}): raise max_context to at least {pinned * ps} "
            "(or None), or lower sink_pages / recent_pages")
    if cache.dense_layers > model.num_layers:
        raise ValueError(f"CacheConfig.dense_layers ({cache.dense_layers}) exceeds the model's "
                         f"{model.num_layers} layers: lower dense_layers")
    if need > model.max_position:
        raise ValueError(
            f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) = {need} exceeds the model's "
            f"max_position ({model.max_position}): shorten the prompt or lower max_new_tokens")
    prompt_len = min(max(_next_pow2(longest), ps), max_context)
    # strict only changes the Python-side check after the call: keep it out of the jit key.
    # A pool larger than the host tier holds nothing more: clamp it to the logical pages; a
    # round of more steps than the context has tokens runs no more steps (its token buffer is
    # [batch, round_steps]): clamp it to the context.
    batch = len(prompt_lens)
    logical = batch * (max_context // ps)
    pool = None if cache.pool_pages is None else min(cache.pool_pages, logical)
    cache_key = dataclasses.replace(cache, strict=False, pool_pages=pool,
                                    round_steps=min(cache.round_steps, max_context))
    plan = engine.Plan(model=model, cache=cache_key,
                       batch=batch, prompt_len=prompt_len, max_context=max_context, num_stop=num_stop)
    if cache.mode == "host":
        # one request's distinct pages of a step: its selection and pinned pages, at most all
        # of its pages (a short context caps it, as it caps the clamped pool)
        one = min(plan.k + plan.num_pinned, plan.pages_per_seq)
        if pool is not None and pool < one:
            raise ValueError(
                f"pool_pages ({pool}) is smaller than one request's selection "
                f"(selected_pages {plan.k} + pinned {plan.num_pinned}): raise pool_pages to "
                f"at least {one} (None sizes it for a step's working set)")
        if pool is not None and pool < batch * plan.num_pinned:
            raise ValueError(
                f"pool_pages ({pool}) cannot hold the pinned pages of {batch} requests "
                f"({batch} x (sink {cache.sink_pages} + recent {cache.recent_pages})): raise "
                "pool_pages, lower sink_pages / recent_pages or split the batch")
    spec = plan.spec  # validates the remaining shapes
    validation.check_kv_dtype(plan.kv_dtype)
    if cache.mode == "host":
        validation.check_host_capacity(spec.host_bytes, fix="lower batch / max_context")
    _check_device_memory(plan)
    return plan


def _check_device_memory(plan: engine.Plan):
    host = plan.cache.mode == "host"
    validation.check_device_memory(
        _need_device_bytes(plan), what="device pool" if host else "resident KV cache",
        fix=("lower pool_pages / selected_pages / batch" if host
             else "lower batch / max_context, or use mode='host'"))


def _memory_stats(plan: engine.Plan, state: engine.DecodeState, n: int = 1) -> dict:
    """Totals over the ``n`` devices (``plan`` is one device's; state arrays are global)."""
    spec = plan.spec
    summ = sum(int(a.nbytes) for a in jax.tree.leaves(state.summaries))
    if plan.cache.mode == "host":
        dev = n * spec.pool_bytes + summ + int(state.kv.page_table.nbytes) * 3
        host = n * spec.host_bytes
    else:
        dev, host = n * spec.host_bytes + summ, 0
    out = {"device_kv_bytes": dev, "host_kv_bytes": host,
           "logical_kv_bytes": n * spec.host_bytes,
           "pool_fraction_of_logical": (spec.pool_bytes / spec.host_bytes
                                        if plan.cache.mode == "host" else 1.0)}
    if n > 1:
        out["device_kv_bytes_per_device"] = dev // n
    return out


def _validate_stop_tokens(model: ModelConfig, stop_tokens) -> list[int]:
    if stop_tokens is None:
        return [model.eos_id]
    if isinstance(stop_tokens, (int, np.integer)) or not isinstance(stop_tokens, Iterable):
        raise TypeError(f"stop_tokens must be a list of token ids, got {type(stop_tokens).__name__} "
                        f"{stop_tokens!r}" + (f": pass [{int(stop_tokens)}]"
                                              if isinstance(stop_tokens, (int, np.integer)) else ""))
    # text is refused by check_token_ids; a set or generator is read once into a list
    ids = validation.check_token_ids(stop_tokens if isinstance(stop_tokens, (str, bytes))
                                     else list(stop_tokens), model.vocab_size, "stop_tokens")
    return [int(t) for t in ids]


def _validate_sampling(sampling) -> Sampling:
    """One value per field for the whole batch (the compiled step broadcasts scalars)."""
    sampling = Sampling.make() if sampling is None else sampling
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be a jaxkv.Sampling (Sampling.make(...)), got "
                        f"{type(sampling).__name__}")
    for f in dataclasses.fields(sampling):
        v = getattr(sampling, f.name)
        if np.ndim(v) != 0:
            raise ValueError(
                f"sampling.{f.name} has shape {tuple(np.shape(v))}: one value applies to every "
                "request (per-request sampling is not supported): split the batch into calls "
                "with one Sampling each")
        if not np.issubdtype(np.asarray(v).dtype, np.number):
            raise TypeError(f"sampling.{f.name} must be a number, got {v!r}: build it with "
                            "Sampling.make(...)")
    return sampling


def prng_key(seed: int) -> jax.Array:
    """The sampling key of any int ``seed >= 0``: ``jax.random.key`` of its low 32 bits, then
    each further 32 bits folded in (``fold_in``), so seeds that differ above bit 31 give
    different keys (``jax.random.key`` alone keeps 32 bits: 2**32 would alias 0, and 2**63
    overflows) and seeds below 2**32 keep their ``jax.random.key(seed)``."""
    key = jax.random.key(np.uint32(seed & 0xFFFFFFFF))
    rest = seed >> 32
    while rest:
        key = jax.random.fold_in(key, np.uint32(rest & 0xFFFFFFFF))
        rest >>= 32
    return key


class TokenStream:
    """Iterator over rounds: each item is a list (one per request) of the new token ids.

    One pass over one generation, like a file: breaking out of a ``for`` loop pauses the
    generation, and iterating again resumes where it stopped (no token is lost or repeated);
    once the generation has ended, iterating again yields nothing. ``.result`` holds the
    :class:`GenerateResult` once the iteration has ended; reading it earlier raises
    ``RuntimeError`` saying so (a strict-mode failure's result is the exception's ``.result``
    and also ``.result`` here).
    """

    def __init__(self, gen: Iterator):
        self._gen = gen
        self._result: GenerateResult | None = None
        self._error: BaseException | None = None
        self._ended = False

    def __iter__(self):
        return self

    def __next__(self) -> list[list[int]]:
        if self._ended:
            raise StopIteration
        try:
            return next(self._gen)
        except StopIteration as e:
            self._ended, self._result = True, e.value
            raise StopIteration from None
        except BaseException as e:
            self._ended, self._error = True, e
            self._result = getattr(e, "result", None)
            raise

    @property
    def result(self) -> GenerateResult:
        if self._result is not None:
            return self._result
        if self._error is not None:
            raise RuntimeError(f"the stream's generation failed ({type(self._error).__name__}: "
                               f"{self._error}), so it has no result") from self._error
        raise RuntimeError("the stream has not ended: .result is set once the iteration has "
                           "ended; keep iterating (a new for loop resumes where the last stopped)")


def generate(model: ModelConfig, params, prompts, *, max_new_tokens: int = 32,
             sampling: Sampling | None = None, cache: CacheConfig | None = None,
             stop_tokens: Sequence[int] | None = None, seed: int = 0, stream: bool = False,
             progress: bool | None = None, mesh=None):
    """Generate up to ``max_new_tokens`` tokens for each prompt.

    Args:
      model: the ModelConfig of ``params``.
      params: the model's params pytree (jaxkv.models.llama layout).
      prompts: list of token-id lists (different lengths allowed).
      max_new_tokens: per request (traced: changing it does not recompile).
      sampling: :class:`Sampling` (default greedy); traced.
      cache: :class:`CacheConfig` (mode "host" or "resident", selector, page size, pool...).
      stop_tokens: a list of ids that end a request (default: the model's eos id).
      seed: PRNG seed for sampling, any int >= 0 (:func:`prng_key`).
      stream: return a :class:`TokenStream` yielding tokens round by round (breaking out and
        iterating again resumes it).
      progress: show a prefill progress bar (default: prompts of >= 8k tokens).
      mesh: tensor parallelism over KV heads (jaxkv.parallel): a one-axis
        ``jax.sharding.Mesh`` or a list of N devices; N must divide num_kv_heads and ffn_dim.
        Each device keeps its heads' host tier, pool and LRU state. None or the one default
        device: the single-device path. Counters in ``stats`` are totals over the devices.
    Returns:
      :class:`GenerateResult` (or a :class:`TokenStream` when ``stream``).
    Raises:
      ValueError / TypeError before any work for a bad argument (the message names it and the
      fix), including params holding NaN or Inf (one jitted reduction over the leaves, a read
      of the weights once per call: ~4 ms for 16 GB on an H200); ``validation.StrictModeError``
      (a RuntimeError whose ``.result`` holds the generated tokens) after the run in strict
      mode. See docs/failure_modes.md.
    """
    gen = _generate(model, params, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                    cache=cache, stop_tokens=stop_tokens, seed=seed, progress=progress, mesh=mesh)
    if stream:
        return TokenStream(gen)
    try:
        while True:
            next(gen)
    except StopIteration as e:
        return e.value


def _generate(model, params, prompts, *, max_new_tokens, sampling, cache, stop_tokens, seed, progress,
              mesh=None):
    if not isinstance(model, ModelConfig):
        raise TypeError(f"model must be a jaxkv.models.configs.ModelConfig, got {type(model).__name__}")
    cache = CacheConfig() if cache is None else cache
    if not isinstance(cache, CacheConfig):
        raise TypeError(f"cache must be a jaxkv.CacheConfig, got {type(cache).__name__}")
    sampling = _validate_sampling(sampling)
    validation.check_int("max_new_tokens", max_new_tokens, minimum=1)
    validation.check_int("seed", seed, minimum=0)
    validation.check_params(model, params)
    tp = parallel.TensorParallel.create(mesh, model)   # None: one device
    n_dev = 1 if tp is None else tp.size
    eng = engine if tp is None else tp
    prompts = _validate_prompts(model, prompts)
    stops = _validate_stop_tokens(model, stop_tokens)
    num_stop = max(4, _next_pow2(len(stops)))
    stop_ids = jnp.asarray(stops + [-1] * (num_stop - len(stops)), jnp.int32)
    lens = [len(p) for p in prompts]
    plan = make_plan(model if tp is None else tp.local_model(model), cache, lens,
                     int(max_new_tokens), num_stop)
    validation.check_params_finite(params)  # after the cheap checks: it reads every weight
    if tp is not None:
        plan, params = tp.plan(plan), tp.shard_params(params)
    B, T = plan.batch, plan.prompt_len
    compiles0 = compile_stats.snapshot()

    # ---- prefill ---------------------------------------------------------------------
    t0 = time.perf_counter()
    tokens = np.zeros((B, T), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    lengths = jnp.asarray(lens, jnp.int32)
    kv = eng.init_kv(plan)
    summaries = eng.init_summaries(plan)
    # commit fresh arrays to their shardings: prefill then compiles once, not twice
    dense = eng.init_dense(plan)
    kv, summaries, dense = jax.device_put((kv, summaries, dense),
                                          jax.tree.map(lambda a: a.sharding, (kv, summaries, dense)))
    x = eng.embed_prompt(plan, params, jnp.asarray(tokens))
    show = progress if progress is not None else max(lens) >= 8192
    layers = range(model.num_layers)
    if show:
        from tqdm.auto import tqdm
        layers = tqdm(layers, desc=f"prefill {sum(lens)} tokens", unit="layer")
    for layer in layers:
        x, kv, summaries, dense = eng.prefill_layer(plan, params["layers"][layer], jnp.int32(layer), x,
                                                    lengths, kv, summaries, dense)
    key = prng_key(int(seed))
    key, sub = jax.random.split(key)
    first = eng.first_token(plan, params, x, lengths, sampling, sub)
    first_np = np.asarray(first)
    t_prefill = time.perf_counter() - t0
    del x

    stop_np = set(stops)
    done0 = np.array([(t in stop_np) or max_new_tokens <= 1 for t in first_np])
    state = engine.start_state(plan, kv, summaries, lengths, first, key, done=done0,
                               lookahead=eng.init_lookahead(plan), dense=dense)
    out = [[int(t)] for t in first_np]
    yield [[int(t)] for t in first_np]

    # ---- decode rounds -----------------------------------------------------------------
    max_new = jnp.int32(max_new_tokens)
    t1 = time.perf_counter()
    compiles_decode0 = compile_stats.snapshot()
    rounds = 0
    totals = {f.name: 0 for f in dataclasses.fields(kvcache.CacheCounters)}
    per_device = {name: np.zeros(n_dev, np.int64) for name in totals}
    while not bool(np.all(np.asarray(state.done))):
        state, buf, steps = eng.decode_round(plan, params, state, sampling, stop_ids, max_new)
        state = _drain_counters(state, totals, per_device)
        buf = np.asarray(buf)[:, : int(steps)]
        rounds += 1
        new = [[int(t) for t in row if t >= 0] for row in buf]
        for o, n in zip(out, new):
            o.extend(n)
        yield new
    # decode time without the first round's compilation (reported as compile_time_s)
    t_decode = max(0.0, time.perf_counter() - t1 - compile_stats.since(compiles_decode0)["time_s"])
    compiles = compile_stats.since(compiles0)

    counters = kvcache.CacheCounters(**totals).as_dict(plan.spec)
    n_new = sum(len(o) for o in out)
    # a request that ended without a stop token before max_new_tokens hit the context capacity
    truncated = sum(1 for o in out if len(o) < max_new_tokens and o[-1] not in stop_np)
    stats = {
        "mode": cache.mode, "selector": cache.selector, "batch": B,
        "prompt_tokens": sum(lens), "generated_tokens": n_new,
        "prefill_time_s": t_prefill, "decode_time_s": t_decode,
        "prefill_tokens_per_s": sum(lens) / t_prefill if t_prefill else float("nan"),
        "decode_tokens_per_s": (n_new - B) / t_decode if t_decode > 0 else float("nan"),
        "decode_rounds": rounds,
        **counters,
        "truncated_requests": truncated,
        **_memory_stats(plan, state, n_dev),
        "page_size": plan.page_size, "selected_pages": plan.k,
        "selection_lag": cache.selection_lag,
        "pool_pages": plan.pool_pages if cache.mode == "host" else plan.spec.num_logical_pages,
        "max_context": plan.max_context, "prompt_bucket": plan.prompt_len,
        "compile_time_s": compiles["time_s"], "num_compilations": compiles["count"],
        "num_devices": n_dev,
    }
    if n_dev > 1:  # counters are totals over the devices; here each device's own
        stats["per_device"] = {k: [int(x) for x in v] for k, v in per_device.items()}
    result = GenerateResult(tokens=out, stats=stats)
    if cache.strict:
        validation.check_strict(stats, result=result)
    else:
        for why in validation.strict_violations(stats):
            warnings.warn(why + " (CacheConfig(strict=True) raises instead)", RuntimeWarning, stacklevel=3)
    return result


def _drain_counters(state: engine.DecodeState, totals: dict, per_device: dict | None = None
                    ) -> engine.DecodeState:
    """Add the round's int32 device counters to Python ints and zero them (no int32 overflow
    over long generations; a negative value means one round overflowed). Several devices
    (counters [N]): ``totals`` get the sum, ``per_device`` each device's values."""
    c = jax.device_get(state.kv.counters)
    got = {name: np.asarray(getattr(c, name)).astype(np.int64).reshape(-1) for name in totals}
    for name, v in got.items():
        if (v < 0).any():
            raise RuntimeError(f"cache counter {name!r} overflowed int32 within one decode round: "
                               "lower CacheConfig.round_steps")
    for name, v in got.items():
        totals[name] += int(v.sum())
        if per_device is not None:
            per_device[name] += v
    zeros = (kvcache.CacheCounters.zeros() if np.ndim(c.hits) == 0
             else jax.tree.map(jnp.zeros_like, state.kv.counters))
    return dataclasses.replace(state, kv=dataclasses.replace(state.kv, counters=zeros))
