"""jaxkv.generate(): batched generation with a host-tier (or resident) sparse KV cache (public API)."""
from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import cache as kvcache
from jaxkv import compile_stats, engine, parallel, runtime, validation
from jaxkv import sampling as sampling_lib
from jaxkv import context as context_api
from jaxkv import text as text_api
from jaxkv.config import CacheConfig, Sampling, dense_layer_set
from jaxkv.models.configs import ModelConfig
from jaxkv.text import Model


@dataclasses.dataclass
class GenerateResult:
    """tokens: generated ids per request (a stop token, if hit, is the last one; a stop
    string's tokens end the list). text: the generated text per request (models from
    :func:`jaxkv.load`; without the stop token or stop string), else None.
    finish_reasons: per request "stop_token", "stop_string", "length" (max_new_tokens) or
    "capacity" (the context or the model's positions ran out). logprobs: per request the
    log-probability of each chosen token under the model (``logprobs=True``), else None.
    context: a :class:`jaxkv.context.Context` (``keep=True``), else None. rounds: per-round
    stats (``on_round``'s argument). stats: timings, cache counters and memory (see README,
    "Stats")."""

    tokens: list[list[int]]
    stats: dict
    text: list[str] | None = None
    finish_reasons: list[str] = dataclasses.field(default_factory=list)
    logprobs: list[list[float]] | None = None
    context: object = None
    rounds: list[dict] = dataclasses.field(default_factory=list)


class Chunk(list):
    """One streamed item: a list (one per request) of the new token ids, with ``.text`` (one
    str per request: the new text, None without a tokenizer) and ``.logprobs`` (per request
    the new tokens' log-probabilities, None unless ``logprobs=True``)."""

    def __init__(self, tokens, text=None, logprobs=None):
        super().__init__(tokens)
        self.text = text
        self.logprobs = logprobs


class _CallerTime:
    """Wall time and compilations spent outside the call while it waits on its caller (an
    ``on_round`` callback, a stream's consumer between items): ``with caller: ...``."""

    def __init__(self):
        self.time_s, self.compiles, self.compile_time_s = 0.0, 0, 0.0

    def __enter__(self):
        self._t, self._c = time.perf_counter(), compile_stats.snapshot()

    def __exit__(self, *exc):
        self.time_s += time.perf_counter() - self._t
        c = compile_stats.since(self._c)
        self.compiles += c["count"]
        self.compile_time_s += c["time_s"]
        return False


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _prompt_list(prompts) -> Sequence:
    """``prompts`` (normalized: ``text.normalize``) as a non-empty sequence of requests."""
    if isinstance(prompts, (np.ndarray, jax.Array)) and prompts.ndim == 2:
        prompts = list(np.asarray(prompts))  # a [B, T] array of equal-length prompts
    # a chat message where a request goes: the error shows a chat's shape (the token-id check
    # would report an array of shape ())
    where = ["prompts"] if isinstance(prompts, Mapping) else [
        f"prompt {i}" for i, p in enumerate(prompts if isinstance(prompts, Sequence) else ())
        if isinstance(p, Mapping)][:1]
    if where:
        raise ValueError(f"{where[0]} is one chat message (a dict): a chat is a list of messages, "
                         "[{'role': 'user', 'content': ...}], and a batch of chats a list of them")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be one request (token ids; with a Model from jaxkv.load "
                         "also text or a chat) or a non-empty list of requests")
    return prompts


def _validate_prompts(model: ModelConfig, prompts) -> list[list[int]]:
    prompts = _prompt_list(prompts)
    out = []
    for i, p in enumerate(prompts):
        arr = validation.check_token_ids(p, model.vocab_size, f"prompt {i}")
        if arr.size == 0:
            raise ValueError(f"prompt {i} is empty: every request needs at least one token "
                             "(e.g. the BOS id)")
        out.append(arr.tolist())
    return out


def _device_state_bytes(plan: engine.Plan) -> tuple[int, int]:
    """(device bytes of the decode state generate() allocates: the pool or resident KV cache,
    the page table and LRU, the selector's summaries and, on the host tier, the dense layers'
    device copy; of those, the summaries' bytes), from ``engine.abstract_state`` (shapes only)."""
    state = engine.abstract_state(plan, [0] * plan.batch)
    return (validation.nbytes_by_space(state)["device"],
            validation.nbytes_of(state.summaries))


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
    dense_layer_set(cache.dense_layers, model.num_layers)  # a ValueError names a bad set
    if cache.mode == "resident":
        host_only = [f"{n}={v!r}" for n, v, default in (
            ("pool_pages", cache.pool_pages, None), ("schedule", cache.schedule, "step"),
            ("reuse", cache.reuse, True)) if v != default]
        if host_only:
            warnings.warn(f"CacheConfig({', '.join(host_only)}) applies to mode='host' only: "
                          "the resident cache ignores it", UserWarning, stacklevel=4)
    if cache.selector == "indexer" and not model.indexer_heads:
        raise ValueError(
            f"CacheConfig(selector='indexer') needs a model with lightning-indexer weights "
            f"(ModelConfig.indexer_heads); {model.name!r} has none: use the default selector "
            "('quest_rescore8') or 'quest'")
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
            clamp = (f", at most the context's {plan.pages_per_seq} pages"
                     if one < cache.selected_pages + plan.num_pinned else "")
            raise ValueError(
                f"pool_pages ({pool}) is smaller than one request's pages in a step ({one}: "
                f"selected_pages {cache.selected_pages} + pinned {plan.num_pinned}{clamp}): "
                f"raise pool_pages to at least {one} (None sizes it for a step's working set)")
        if pool is not None and pool < batch * plan.num_pinned:
            raise ValueError(
                f"pool_pages ({pool}) cannot hold the pinned pages of {batch} requests "
                f"({batch} x (sink {cache.sink_pages} + recent {cache.recent_pages})): raise "
                "pool_pages, lower sink_pages / recent_pages or split the batch")
    spec = plan.spec  # validates the remaining shapes
    plan.selector.check_plan(plan)
    validation.check_kv_dtype(plan.kv_dtype)
    if cache.mode == "host":
        validation.check_host_capacity(spec.host_bytes, fix="lower batch / max_context")
    _check_device_memory(plan)
    return plan


def _check_device_memory(plan: engine.Plan):
    host = plan.cache.mode == "host"
    need, summ = _device_state_bytes(plan)
    fix = ("lower pool_pages / selected_pages / batch" if host
           else "lower batch / max_context, or use mode='host'")
    if host and plan.num_dense:
        fix += (f"; the {plan.num_dense} dense layers' K/V (CacheConfig.dense_layers) stay on "
                "the device whole")
    if plan.selector.two_stage:
        fix += (f"; the {plan.cache.selector!r} selector's summaries (Quest's bounds and a copy "
                f"of the keys) take {summ / 2**30:.2f} GiB of it: selector='quest' keeps the "
                "bounds only")
    what = (("device pool and dense layers" if plan.num_dense else "device pool") if host
            else "resident KV cache")
    validation.check_device_memory(need, what=what, fix=fix)


def _memory_stats(plan: engine.Plan, state: engine.DecodeState, n: int = 1) -> dict:
    """Totals over the ``n`` devices (``plan`` is one device's; state arrays are global)."""
    spec = plan.spec
    summ = sum(int(a.nbytes) for a in jax.tree.leaves(state.summaries))
    if plan.cache.mode == "host":
        dense = sum(int(a.nbytes) for a in jax.tree.leaves(state.dense))  # dense layers' K/V
        dev = n * spec.pool_bytes + summ + int(state.kv.page_table.nbytes) * 3 + dense
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
    if stop_tokens is None:  # the config's eos (none when its files name no eos)
        return [] if model.eos_id is None else [model.eos_id]
    one = validation.scalar_value(stop_tokens)   # a 0-d array is one value, as an int is
    if isinstance(one, (int, np.integer)) or not isinstance(one, Iterable):
        raise TypeError(f"stop_tokens must be a list of token ids, got {type(stop_tokens).__name__} "
                        f"{stop_tokens!r}" + (f": pass [{int(one)}]"
                                              if isinstance(one, (int, np.integer)) else ""))
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


def request_keys(seed, n: int) -> jax.Array:
    """One sampling key per request [n]: request b draws with ``prng_key(seed + b)`` for an int
    ``seed``, or ``prng_key(seed[b])`` for a sequence of n ints. A request's sampled tokens
    depend on its prompt and its seed only: alone, with ``seed=s``, it gives what it gives as
    request b of a batch whose seed makes its own ``s``."""
    if isinstance(seed, (Sequence, np.ndarray, jax.Array)) and np.ndim(seed) > 0 \
            and not isinstance(seed, (str, bytes)):
        seeds = list(seed)
        if len(seeds) != n:
            raise ValueError(f"seed: a sequence needs one seed per request ({n}), got {len(seeds)}")
        seeds = [validation.check_int(f"seed[{i}]", v, minimum=0) for i, v in enumerate(seeds)]
    else:
        first = validation.check_int("seed", seed, minimum=0)
        seeds = [first + b for b in range(n)]
    data = np.stack([np.asarray(jax.random.key_data(prng_key(v))) for v in seeds])
    return jax.random.wrap_key_data(data)


class TokenStream:
    """Iterator over rounds (or steps, ``stream="step"``): each item is a :class:`Chunk`, a
    list (one per request) of the new token ids, with ``.text`` the new text per request.

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

    def text(self) -> Iterator[str]:
        """The first request's text as it is decoded (e.g. ``print(piece, end="")``)."""
        for chunk in self:
            if chunk.text is not None and chunk.text[0]:
                yield chunk.text[0]


def generate(model, params=None, prompts=None, *, max_new_tokens: int = 32,
             sampling: Sampling | None = None, cache: CacheConfig | None = None,
             stop_tokens: Sequence[int] | None = None, stop_strings: Sequence[str] | None = None,
             seed: int = 0, stream: bool | str = False, progress: bool | None = None, mesh=None,
             logprobs: bool = False, keep: bool = False, context=None, on_round=None):
    """Generate up to ``max_new_tokens`` tokens for each prompt.

    ``generate(model, prompts)`` with a model from :func:`jaxkv.load`, or
    ``generate(config, params, prompts)`` with a ModelConfig and its params.

    Args:
      model: a :class:`jaxkv.Model` (from ``jaxkv.load``: config, params, tokenizer) or the
        ModelConfig of ``params``.
      params: the model's params pytree (jaxkv.models.llama layout); with a Model, omitted.
      prompts: one request or a list of them. A request is text (a str), a chat (a list of
        ``{"role": ..., "content": ...}`` dicts, rendered with the model's chat template) or
        a list of token ids. Text and chats need a Model (its tokenizer); special-token
        strings in them (``<|im_end|>``) encode as those tokens, as in transformers.
      max_new_tokens: per request (traced: changing it does not recompile).
      sampling: :class:`Sampling` (default greedy); traced.
      cache: :class:`CacheConfig` (mode "host" or "resident", selector, page size, pool...).
      stop_tokens: ids that end a request (default: the tokenizer's stop ids, else the
        model's eos id).
      stop_strings: strings that end a request (checked after each round; the text stops
        before the string, the tokens with the token that completes it).
      seed: PRNG seed for sampling: an int >= 0 (request b draws with seed + b) or one int
        per request; a request's tokens depend on its prompt and its seed, not on the rest
        of the batch (:func:`request_keys`).
      stream: True or "round": return a :class:`TokenStream` yielding each round's new tokens
        and text; "step": one item per decode step (the round still runs as one program:
        ``CacheConfig(round_steps=...)`` sets how often new tokens arrive); breaking out and
        iterating again resumes the stream. The items' ids and logprobs are the result's; a
        last item may carry text only (text held back while a stop string could still start
        in it, or half a UTF-8 character).
      progress: show a prefill progress bar (default: prompts of >= 8k tokens).
      mesh: tensor parallelism over KV heads (jaxkv.parallel): a one-axis
        ``jax.sharding.Mesh`` or a list of N devices; N must divide num_kv_heads and ffn_dim.
        Each device keeps its heads' host tier, pool and LRU state. None or the one default
        device: the single-device path. Counters in ``stats`` are totals over the devices.
        ``keep``, ``context`` and ``logprobs`` run on one device only.
      logprobs: also return each chosen token's log-probability under the model
        (temperature 1), computed in the compiled step.
      keep: return the requests' KV, summaries and conversation as ``result.context``.
      context: continue a kept context (``jaxkv.context``): the prompts' tokens are appended
        to its requests (one prompt per request), or a context of one request is forked,
        once per prompt, without prefilling it again.
      on_round: ``callback(dict)`` after every decode round with that round's stats (steps,
        time, tokens/s, context length, hits, misses, hit rate, bytes moved).
    Returns:
      :class:`GenerateResult` (or a :class:`TokenStream` when ``stream``).
    Raises:
      ValueError / TypeError before any work for a bad argument (the message names it and the
      fix), including params holding NaN or Inf (one jitted reduction over the leaves, a read
      of the weights once per call: ~4 ms for 16 GB on an H200); ``validation.StrictModeError``
      (a RuntimeError whose ``.result`` holds the generated tokens) after the run in strict
      mode. See docs/failure_modes.md.
    """
    tokenizer = None
    if isinstance(model, Model):
        if prompts is None:
            prompts, params = params, model.params
        elif params is None:  # generate(model, prompts=...)
            params = model.params
        tokenizer, model = model.tokenizer, model.config
    elif prompts is None:
        raise TypeError("generate(config, params, prompts) needs prompts (or pass the Model from "
                        "jaxkv.load(...) as generate(model, prompts))")
    # by type first: 1, 1.0 or None would pass `in (False, True, ...)`, an array would fail in it
    if not (isinstance(stream, (bool, np.bool_))
            or isinstance(stream, str) and stream in ("round", "step")):
        raise ValueError(f"stream must be False, True, 'round' or 'step', got {stream!r}")
    gen = _generate(model, params, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                    cache=cache, stop_tokens=stop_tokens, seed=seed, progress=progress, mesh=mesh,
                    tokenizer=tokenizer, stop_strings=stop_strings, logprobs=logprobs, keep=keep,
                    context=context, on_round=on_round, per_step=stream == "step")
    if stream:
        return TokenStream(gen)
    try:
        while True:
            next(gen)
    except StopIteration as e:
        return e.value


def _check_params_device(params) -> None:
    """One-device generate() builds its cache on the default device: weights committed to
    another device would fail inside the first compiled call."""
    default = jax.devices()[0]
    devices = {d for leaf in jax.tree.leaves(params) if isinstance(leaf, jax.Array)
               for d in leaf.devices()}
    if devices and devices != {default}:
        where = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(f"params are on {where}, but generate() builds its cache on the default "
                         f"device {default}: load the model onto it (jaxkv.load(..., "
                         f"device=None)), or move the params there (jax.device_put(params, "
                         f"jax.devices()[0]))")


def _encode_prompts(model, tokenizer, prompts, ctx, src):
    """(token ids per request: the whole prompt, or with a context the tokens to append;
    chat messages per request, None where the request is not a chat)."""
    items = text_api.normalize(prompts)
    if isinstance(items, np.ndarray) or not isinstance(items, Sequence) or (
            ctx is None and not any(text_api.is_text(p) for p in items)):
        ids = _validate_prompts(model, items)
        return ids, [None] * len(ids)
    ids, messages = [], []
    for i, p in enumerate(items):
        history = None if ctx is None else ctx.messages[src[i]]
        if text_api.is_chat(p):
            if ctx is None:
                ids.append(text_api.encode(tokenizer, p, i))
                messages.append(list(p))
            elif history is not None:
                reply = ctx.tokens[src[i]][ctx.reply_start[src[i]]:]
                ids.append(text_api.encode_turns(tokenizer, list(history), reply, p, i))
                messages.append(list(history) + list(p))
            else:
                raise ValueError(f"prompt {i} is a chat, but the context's request {src[i]} has "
                                 "no chat history (it began as text or token ids, or a text or "
                                 "token-id turn continued it, which ends a chat's history): "
                                 "continue it with text or token ids, or start a new chat")
        elif isinstance(p, str):
            ids.append(text_api.encode(tokenizer, p, i, continued=ctx is not None))
            messages.append(None)
        else:
            ids.append(p)
            messages.append(None)
    if ctx is None:
        return _validate_prompts(model, ids), messages
    return [validation.check_token_ids(p, model.vocab_size, f"prompt {i}").tolist()
            for i, p in enumerate(ids)], messages


def _generate(model, params, prompts, *, max_new_tokens, sampling, cache, stop_tokens, seed, progress,
              mesh=None, tokenizer=None, stop_strings=None, logprobs=False, keep=False,
              context=None, on_round=None, per_step=False):
    if not isinstance(model, ModelConfig):
        raise TypeError(f"model must be a jaxkv.models.configs.ModelConfig, got {type(model).__name__}")
    cache = CacheConfig() if cache is None else cache
    if not isinstance(cache, CacheConfig):
        raise TypeError(f"cache must be a jaxkv.CacheConfig, got {type(cache).__name__}")
    sampling = _validate_sampling(sampling)
    validation.check_int("max_new_tokens", max_new_tokens, minimum=1)
    for name, v, none in (("logprobs", logprobs, ""), ("keep", keep, ""),
                          ("progress", progress, "None (a bar for prompts of 8192 tokens on) or ")):
        if not (isinstance(v, (bool, np.bool_)) or none and v is None):
            raise ValueError(f"{name} must be {none}a bool, got {v!r}")
    if on_round is not None and not callable(on_round):
        raise TypeError(f"on_round must be a callable taking one dict, got {type(on_round).__name__}")
    stop_strs = text_api.check_stop_strings(stop_strings, tokenizer)
    validation.check_params(model, params)
    tp = parallel.TensorParallel.create(mesh, model)   # None: one device
    if tp is None:
        _check_params_device(params)
    if tp is not None and (keep or context is not None or logprobs):
        raise ValueError("keep / context / logprobs run on one device: drop mesh, or drop them")
    n_dev = 1 if tp is None else tp.size
    eng = engine if tp is None else tp
    ctx, src = (None, None)
    if context is not None:
        n = len(_prompt_list(text_api.normalize(prompts)))
        ctx, src = context_api.sources(context, n)
    new_ids, messages = _encode_prompts(model, tokenizer, prompts, ctx, src)
    key = request_keys(seed, len(new_ids))
    if stop_tokens is None:
        # the tokenizer's stop ids (none for a vocabulary without eos), else the config's eos
        stops = list(tokenizer.stop_ids) if tokenizer is not None else \
            _validate_stop_tokens(model, None)
    else:
        stops = _validate_stop_tokens(model, stop_tokens)
    if stop_strs:
        stop_strs = text_api.drop_special_stop_strings(stop_strs, tokenizer, stops)
    num_stop = max(4, _next_pow2(len(stops)))
    stop_ids = jnp.asarray(stops + [-1] * (num_stop - len(stops)), jnp.int32)
    if ctx is None:
        prompts = new_ids
    else:  # each request's whole conversation: the context's, then the new tokens
        prompts = [list(ctx.tokens[s]) + p for s, p in zip(src, new_ids)]
    lens = [len(p) for p in prompts]
    plan = make_plan(model if tp is None else tp.local_model(model), cache, lens,
                     int(max_new_tokens), num_stop)
    validation.check_params_finite(params)  # after the cheap checks: it reads every weight
    runtime.release_compiled_programs()  # before this call compiles: no segfault at the map limit
    if tp is not None:
        plan, params = tp.plan(plan), tp.shard_params(params)
    B, T = plan.batch, plan.prompt_len
    compiles0 = compile_stats.snapshot()
    out = [[] for _ in range(B)]
    lps = [[] for _ in range(B)] if logprobs else None
    stop_np = set(stops)
    t0 = time.perf_counter()

    if ctx is None:
        # ---- prefill -----------------------------------------------------------------
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
        for layer in _layer_bar(model, lens, progress, "prefill"):
            x, kv, summaries, dense = eng.prefill_layer(plan, params["layers"][layer], jnp.int32(layer), x,
                                                        lengths, kv, summaries, dense)
        last, reused, t_copy = lengths, 0, None
    else:
        # ---- continue a kept context: copy its pages, prefill the tokens not yet cached ---
        context_api.check_compatible(ctx, plan)
        kv, summaries, dense = context_api.relayout(ctx, plan, src, eng)
        t_copy = time.perf_counter() - t0
        cached = [ctx.cached[s] for s in src]
        pending = [p[c:] for p, c in zip(prompts, cached)]
        for i, p in enumerate(pending):
            if not p:
                raise ValueError(f"prompt {i} is empty and context request {src[i]} has no "
                                 "token left to feed: pass the tokens to append")
        # a power of two, at least 64: turns of up to 64 tokens share one program per layer
        F = max(64, _next_pow2(max(len(p) for p in pending)))
        tokens = np.zeros((B, F), np.int32)
        for b, p in enumerate(pending):
            tokens[b, :len(p)] = p
        start = jnp.asarray(cached, jnp.int32)
        count = jnp.asarray([len(p) for p in pending], jnp.int32)
        x = eng.embed_prompt(plan, params, jnp.asarray(tokens))
        for layer in _layer_bar(model, [len(p) for p in pending], progress, "append"):
            x, kv, summaries, dense = engine.extend_layer(plan, params["layers"][layer],
                                                          jnp.int32(layer), x, start, count, kv,
                                                          summaries, dense)
        lengths, last, reused = start + count, count, sum(cached)

    # the first new token from each request's last prompt position (``last`` [B]: its index
    # in x), then the decode state
    key, sub = sampling_lib.split(key)
    if logprobs:
        first, first_lp = engine.first_token(plan, params, x, last, sampling, sub,
                                             with_logprob=True)
        first_lp = [[float(v)] for v in np.asarray(first_lp)]
    else:
        first = eng.first_token(plan, params, x, last, sampling, sub)
        first_lp = None
    first_np = np.asarray(first)
    t_prefill = time.perf_counter() - t0
    del x
    done0 = np.array([(t in stop_np) or max_new_tokens <= 1 for t in first_np])
    state = engine.start_state(plan, kv, summaries, lengths, first, key, done=done0,
                               lookahead=eng.init_lookahead(plan), dense=dense,
                               logprobs=logprobs)
    first_new = [[int(t)] for t in first_np]

    detok = [text_api.Detokenizer(tokenizer) for _ in range(B)] if tokenizer is not None else None
    shown = [""] * B                  # text already streamed per request
    finish: list = [None] * B         # "stop_string" once one is seen
    hold = max((len(s) for s in stop_strs), default=1) - 1

    def text_ids(ids):
        """The ids whose text a request shows: all but a stop token (only ever the last)."""
        return ids[:-1] if ids and ids[-1] in stop_np else ids

    def decoded(b: int) -> str:
        """Request b's whole text: cut before its first stop string (searched with the stop
        token's text, which may complete one), else without a stop token."""
        txt = tokenizer.decode(out[b], skip_special_tokens=True)
        i = text_api.find_stop(txt, stop_strs) if stop_strs else -1
        if i >= 0:
            return txt[:i]
        ids = text_ids(out[b])
        return txt if len(ids) == len(out[b]) else tokenizer.decode(ids, skip_special_tokens=True)

    def absorb(new, new_lp) -> Chunk:
        """Adds one round's (or step's) tokens; a stop string ends its request. The new text
        comes from the streaming decoder, or with stop strings from the whole text, without
        the tail a stop string could still start in (and a partial UTF-8 character)."""
        texts = [] if detok is not None else None
        n0 = [len(o) for o in out]      # the chunk carries what it adds to the result
        for b in range(B):
            toks = [] if finish[b] is not None else new[b]
            out[b].extend(toks)
            if lps is not None and toks:
                lps[b].extend(new_lp[b])
            if detok is None:
                continue
            if not stop_strs:
                piece = detok[b].add(text_ids(toks))
                shown[b] += piece
                texts.append(piece)
                continue
            txt = tokenizer.decode(out[b], skip_special_tokens=True) if toks else shown[b]
            i = text_api.find_stop(txt, stop_strs) if toks else -1
            if i < 0 and toks and len(text_ids(out[b])) < len(out[b]):  # no stop token's text
                txt = tokenizer.decode(text_ids(out[b]), skip_special_tokens=True)
            if i >= 0:
                m = text_api.tokens_until(tokenizer, out[b], stop_strs)
                del out[b][m:]
                if lps is not None:
                    del lps[b][m:]
                finish[b] = "stop_string"
                vis = txt[:i]
            else:
                vis = txt[:max(0, len(txt) - hold)].rstrip("\ufffd")
            piece = vis[len(shown[b]):] if vis.startswith(shown[b]) else ""
            shown[b] += piece
            texts.append(piece)
        kept = [o[n:] for o, n in zip(out, n0)]
        kept_lp = [lp[n:] for lp, n in zip(lps, n0)] if lps is not None else None
        return Chunk(kept, texts, kept_lp)

    yield absorb(first_new, first_lp)

    # ---- decode rounds -----------------------------------------------------------------
    max_new = jnp.int32(max_new_tokens)
    # the decode round never reads the prompt bucket: one program serves every prompt length
    round_plan = dataclasses.replace(plan, prompt_len=plan.page_size)
    t1 = time.perf_counter()
    compiles_decode0 = compile_stats.snapshot()
    rounds = []
    caller = _CallerTime()
    host_mode = plan.cache.mode == "host"
    totals = {f.name: 0 for f in dataclasses.fields(kvcache.CacheCounters)}
    per_device = {name: np.zeros(n_dev, np.int64) for name in totals}
    while True:
        ended = [b for b in range(B) if finish[b] is not None]
        if ended:  # a stop string ends its request in the compiled loop as well
            state = state.replace(done=state.done.at[jnp.asarray(ended)].set(True))
        if bool(np.all(np.asarray(state.done))):
            break
        active = int(np.sum(~np.asarray(state.done)))
        tr = time.perf_counter()
        before = dict(totals)
        state, buf, steps = eng.decode_round(round_plan, params, state, sampling, stop_ids, max_new)
        state = _drain_counters(state, totals, per_device)
        steps = int(steps)
        buf = np.asarray(buf)[:, :steps]
        lbuf = np.asarray(state.logprobs[0])[:, :steps] if logprobs else None
        dt = time.perf_counter() - tr
        delta = kvcache.CacheCounters(**{k: totals[k] - before[k] for k in totals})
        delta = delta.as_dict(plan.spec, host=host_mode)
        n_tok = int(np.sum(buf >= 0))
        info = {"round": len(rounds), "steps": steps, "active_requests": active,
                "new_tokens": n_tok, "time_s": dt, "tokens_per_s": n_tok / dt if dt > 0 else float("nan"),
                "context_tokens": int(np.max(np.asarray(state.lengths))),
                **delta}
        rounds.append(info)
        if on_round is not None:
            with caller:
                on_round(info)
        cols = range(steps) if per_step else [slice(0, steps)]
        for c in cols:
            part = buf[:, c] if per_step else buf
            part = part.reshape(B, -1)
            new = [[int(t) for t in row if t >= 0] for row in part]
            new_lp = None
            if lbuf is not None:
                lp_part = lbuf[:, c].reshape(B, -1)
                new_lp = [[float(v) for v, t in zip(lr, row) if t >= 0] for lr, row in zip(lp_part, part)]
            chunk = absorb(new, new_lp)
            if per_step and not any(chunk):
                continue
            with caller:
                yield chunk
    # decode time without the first round's compilation (reported as compile_time_s) and
    # without the caller's: on_round callbacks and a stream's consumer between items
    t_decode = max(0.0, time.perf_counter() - t1 - caller.time_s
                   - (compile_stats.since(compiles_decode0)["time_s"] - caller.compile_time_s))
    compiles = compile_stats.since(compiles0)   # this call's, not the caller's
    compiles = {"count": compiles["count"] - caller.compiles,
                "time_s": compiles["time_s"] - caller.compile_time_s}

    reasons = []
    for b in range(B):
        if finish[b] is not None:
            reasons.append(finish[b])
        elif out[b] and out[b][-1] in stop_np:
            reasons.append("stop_token")
        elif len(out[b]) >= max_new_tokens:
            reasons.append("length")
        else:
            reasons.append("capacity")
    final_text = None
    if detok is not None:
        final_text = [decoded(b) for b in range(B)]
        tail = [t[len(s):] if t.startswith(s) else "" for t, s in zip(final_text, shown)]
        if any(tail):  # text held back (a possible stop string, a partial character)
            yield Chunk([[] for _ in range(B)], tail, [[] for _ in range(B)] if logprobs else None)

    counters = kvcache.CacheCounters(**totals).as_dict(plan.spec, host=host_mode)
    n_new = sum(len(o) for o in out)
    n_decoded = n_new - B
    stats = {
        "mode": cache.mode, "selector": cache.selector, "batch": B,
        "prompt_tokens": sum(lens), "generated_tokens": n_new,
        "prefill_time_s": t_prefill, "decode_time_s": t_decode,
        "prefill_tokens_per_s": (sum(lens) - reused) / t_prefill if t_prefill else float("nan"),
        "decode_tokens_per_s": n_decoded / t_decode if t_decode > 0 else float("nan"),
        "decode_rounds": len(rounds),
        **counters,
        "truncated_requests": reasons.count("capacity"),
        **_memory_stats(plan, state, n_dev),
        "page_size": plan.page_size, "selected_pages": plan.k,
        "selection_lag": cache.selection_lag,
        "pool_pages": plan.pool_pages if cache.mode == "host" else plan.spec.num_logical_pages,
        "max_context": plan.max_context, "prompt_bucket": plan.prompt_len,
        "compile_time_s": compiles["time_s"], "num_compilations": compiles["count"],
        "num_devices": n_dev,
    }
    if ctx is not None:  # the context's tokens were copied, not prefilled again
        rate = ctx.prefill_tokens_per_s
        stats.update({"reused_context_tokens": reused, "appended_tokens": sum(lens) - reused,
                      "context_copy_time_s": t_copy,
                      # what prefilling the reused tokens again would take, less the copy
                      # (this call's compilation is compile_time_s)
                      "prefill_time_saved_s": (reused / rate - t_copy) if rate and rate > 0
                      else float("nan")})
    if n_dev > 1:  # counters are totals over the devices; here each device's own
        stats["per_device"] = {k: [int(x) for x in v] for k, v in per_device.items()}
    kept = None
    if keep:
        rate = stats["prefill_tokens_per_s"] if ctx is None else ctx.prefill_tokens_per_s
        msgs = [None if m is None else m + [{"role": "assistant", "content":
                                             tokenizer.decode(o, skip_special_tokens=True)}]
                for m, o in zip(messages, out)]
        kept = context_api.keep(plan, state, [list(p) + o for p, o in zip(prompts, out)], msgs,
                                rate, reply_start=[len(p) for p in prompts])
    result = GenerateResult(tokens=out, stats=stats, text=final_text, finish_reasons=reasons,
                            logprobs=lps, context=kept, rounds=rounds)
    if cache.strict:
        validation.check_strict(stats, result=result)
    else:
        for why in validation.strict_violations(stats):
            warnings.warn(why + " (CacheConfig(strict=True) raises instead)", RuntimeWarning, stacklevel=3)
    return result


def _layer_bar(model, lens, progress, what):
    """The layer indices, as a progress bar when ``progress`` (None: from 8192 tokens on)."""
    layers = range(model.num_layers)
    if progress if progress is not None else max(lens) >= 8192:
        from tqdm.auto import tqdm
        layers = tqdm(layers, desc=f"{what} {sum(lens)} tokens", unit="layer")
    return layers


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
