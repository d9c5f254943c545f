"""The CPU prefill's work outside attention, per token, by prompt length (issue 34): the same
prefill with the real causal attention and with attention replaced by zeros (the module-level
``prefill_attention`` of ``jaxkv.prefill`` swapped in this process only), so that the
difference is attention in place and the zero run is everything else.

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/probes/cpu_prefill_rest.py zero 512 2048 8160
    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/probes/cpu_prefill_rest.py real 512 2048 8160

SmolLM2-135M-Instruct (the bundled GGUF), float32, one request, resident dense; per length one
compiling call, then the best prefill time of two calls.
"""
import argparse

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("attention", choices=("zero", "real"),
                help="zero: attention replaced by zeros; real: the causal attention")
ap.add_argument("lengths", type=int, nargs="+", help="prompt lengths in tokens")
args = ap.parse_args()

import jax.numpy as jnp  # noqa: E402  (after parsing: --help loads nothing)
import numpy as np  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv import prefill as pf  # noqa: E402
from jaxkv.models import gguf_loader  # noqa: E402

if args.attention == "zero":
    pf.prefill_attention = lambda q, k, v, lengths, **kw: jnp.zeros_like(q)
cfg, params = gguf_loader.load_gguf(str(gguf_loader.default_model_path()), dtype="float32")
rng = np.random.default_rng(0)
for T in args.lengths:
    ids = [int(t) for t in rng.integers(3, cfg.vocab_size, T)]
    cache = jaxkv.CacheConfig(mode="resident", selector="dense")
    jaxkv.generate(cfg, params, [ids], max_new_tokens=2, cache=cache)
    ts = [jaxkv.generate(cfg, params, [ids], max_new_tokens=2, cache=cache).stats["prefill_time_s"]
          for _ in range(2)]
    print(f"{args.attention} T={T}: prefill {min(ts):.2f} s, {1e3 * min(ts) / T:.3f} ms/token",
          flush=True)
