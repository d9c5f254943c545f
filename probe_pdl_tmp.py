"""Per-kernel cost in a chain of tiny kernels: XLA fusions vs Pallas kernels, PDL on/off, and a
Pallas kernel that begins with griddepcontrol.wait (inline asm)."""
import time, statistics, functools
import numpy as np
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

N = 200
SHAPE = (8, 1024)

def kern(x_ref, o_ref, *, gdc):
    x = x_ref[...]
    if gdc:
        x = plgpu.elementwise_inline_asm("griddepcontrol.wait;\n mov.b32 $0, $1;", args=[x],
            constraints="=r,r", pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])[0]
    o_ref[...] = x * 1.0001 + 0.5

def pallas_step(x, gdc):
    return pl.pallas_call(functools.partial(kern, gdc=gdc), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(8,), in_specs=[pl.BlockSpec((1, 1024), lambda i: (i, 0))],
                          out_specs=pl.BlockSpec((1, 1024), lambda i: (i, 0)), name="tiny")(x)

def xla_step(x):
    return jax.lax.optimization_barrier(x * 1.0001 + 0.5)

def chain(kind):
    def f(x):
        for i in range(N):
            if kind == "xla": x = xla_step(x)
            elif kind == "pallas": x = pallas_step(x, False)
            elif kind == "pallas_gdc": x = pallas_step(x, True)
            elif kind == "mixed": x = pallas_step(x, False) if i % 2 else xla_step(x)
            elif kind == "mixed_gdc": x = pallas_step(x, True) if i % 2 else xla_step(x)
        return x
    return f

x = jnp.ones(SHAPE, jnp.float32)
rows = []
for kind in ["xla", "pallas", "pallas_gdc", "mixed", "mixed_gdc"]:
    for pdl in [True, False]:
        try:
            c = jax.jit(chain(kind)).lower(x).compile({"xla_gpu_enable_pdl": pdl})
            y = c(x); y.block_until_ready()
            ts = []
            for _ in range(30):
                t = time.perf_counter(); c(x).block_until_ready(); ts.append(time.perf_counter() - t)
            us = statistics.median(ts) / N * 1e6
            ok = bool(np.allclose(np.asarray(y), np.asarray(jax.jit(chain("xla"))(x))))
            rows.append((kind, pdl, us, ok))
        except Exception as e:
            rows.append((kind, pdl, float("nan"), str(e)[:300]))
print("kind        pdl   us/kernel  ok")
for r in rows: print(f"{r[0]:11s} {str(r[1]):5s} {r[2]:8.3f}  {r[3]}")
