"""The compiled parts of generation, in one namespace. Each concern has its module:

* :mod:`jaxkv.plan`: :class:`Plan`, the static shapes and code paths (the jit key);
* :mod:`jaxkv.state`: :class:`DecodeState`, what the decode loop carries, and its
  construction;
* :mod:`jaxkv.prefill`: the prompt, layer by layer, into the cache and the summaries;
* :mod:`jaxkv.selectors`: the page selectors (one module each);
* :mod:`jaxkv.residency`: where a selected page is read from (one object per schedule);
* :mod:`jaxkv.decode`: the decode step (select -> residency -> attend -> write-through)
  and the compiled round (one ``lax.while_loop``).
"""
from __future__ import annotations

from jaxkv.decode import (_decode_round, _round_fn, decode_round, decode_step,  # noqa: F401
                          lower_decode_round)
from jaxkv.plan import Plan, _accepted_options, round_compiler_options  # noqa: F401
from jaxkv.prefill import (_in_token_chunks, embed_prompt, extend_layer,  # noqa: F401
                           first_token, prefill_layer)
from jaxkv.residency import pool_only_reads  # noqa: F401
from jaxkv.sampling import agree  # noqa: F401
from jaxkv.state import (DecodeState, abstract_state, init_dense, init_kv,  # noqa: F401
                         init_lookahead, init_summaries, start_state, state_shardings)

