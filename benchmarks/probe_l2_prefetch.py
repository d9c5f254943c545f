"""Prefetch kernel alone: time to read wo + 24 MiB of w_gate_up (Qwen-like) per config."""
import statistics, time, sys
import jax, jax.numpy as jnp
from pallas_kernels import l2_prefetch as l2
wo = [jnp.ones((1536, 1536), jnp.bfloat16) for _ in range(28)]
gu = [jnp.ones((1536, 17920), jnp.bfloat16) for _ in range(28)]
x = jnp.ones((8, 1, 1536), jnp.bfloat16)
for prog, warps, block, unroll in [(64, 4, 4096, 4), (132, 8, 8192, 4), (264, 8, 8192, 4),
                                   (132, 4, 8192, 8), (264, 4, 4096, 4)]:
    def f(x, wo, gu):
        for i in range(28):
            x = l2.l2_prefetch(x, x, (wo[i], gu[i]), nbytes=(1 << 40, 24 << 20), programs=prog,
                               num_warps=warps, block=block, unroll=unroll) * 1.0001
        return x
    c = jax.jit(f).lower(x, wo, gu).compile()
    c(x, wo, gu).block_until_ready()
    ts = []
    for _ in range(20):
        t0 = time.perf_counter(); c(x, wo, gu).block_until_ready(); ts.append(time.perf_counter() - t0)
    us = statistics.median(ts) / 28 * 1e6
    mb = (1536 * 1536 * 2 + (24 << 20)) / 1e6
    print(f"programs {prog:4d} warps {warps} block {block} unroll {unroll}: {us:6.2f} us per layer "
          f"(with one tiny fusion) {mb / us:5.2f} TB/s", flush=True)
