"""layer_lookup: the Pallas kernel (interpret mode on CPU) and the jnp reference against a numpy
oracle (random page tables, inactive requests, -1 pads, NaN-poisoned pool, reuse off); the
Triton lowering at the engine's shapes; on the GPU, the compiled kernel against the reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kernels import layer_lookup as ll

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

from lowering import lower_for_h200  # noqa: E402
from page_kernel_util import as_f32, rng  # noqa: F401,E402


def make_case(rng, *, B, H, K, D, ps, L, Np, S, dtype):
    """Random state: each layer's page table maps a random subset of the B * Np logical pages
    to distinct slots; selections mix resident, missed and -1 entries."""
    P = B * Np
    table = np.full((L, P), -1, np.int32)
    for layer in range(L):
        n = int(rng.integers(0, min(S, P) + 1))
        table[layer, rng.permutation(P)[:n]] = rng.permutation(S)[:n]
    pages = np.stack([np.stack([rng.permutation(Np)[:K] for _ in range(H)]) for _ in range(B)])
    pages = np.where(rng.random(pages.shape) < 0.2, -1, pages).astype(np.int32)
    active = rng.random(B) < 0.75
    tok_page = np.where(active, np.arange(B) * Np + rng.integers(0, Np, B), -1).astype(np.int32)
    tok_off = rng.integers(0, ps, B).astype(np.int32)
    tok_off[rng.random(B) < 0.2] = ps  # out of range: not written
    kv = np.asarray(jnp.asarray(rng.standard_normal((B, 2, H, D)), dtype).astype(jnp.float32))
    record = rng.integers(-1, P, (L, B * H * K)).astype(np.int32)
    return dict(pages=pages, active=active, tok_page=tok_page, tok_offset=tok_off, tok_kv=kv,
                page_table=table, record=record)


def oracle(c, layer, *, Np, S, ps, reuse, pool):
    """Plain numpy, one entry at a time."""
    pages, table = c["pages"], c["page_table"]
    B, H, K = pages.shape
    L, P = table.shape
    D = c["tok_kv"].shape[-1]
    rows = np.full((B, H, K), -1, np.int32)
    hrows = np.full((B, H, K), -1, np.int32)
    record = c["record"].copy()
    for b in range(B):
        for h in range(H):
            for i in range(K):
                p = pages[b, h, i]
                lg = b * Np + p if (p >= 0 and c["active"][b]) else -1
                record[layer, (b * H + h) * K + i] = lg
                if lg < 0:
                    continue
                s = table[layer, lg] if reuse else -1
                if s >= 0:
                    rows[b, h, i] = layer * S + s
                else:
                    hrows[b, h, i] = layer * P + lg
    pool = pool.copy().reshape(L * S, 2, H, ps, D)
    thr = np.full((B,), -1, np.int32)
    for b in range(B):
        t = c["tok_page"][b]
        if t < 0:
            continue
        thr[b] = layer * P + t
        s = table[layer, t] if reuse else -1
        o = c["tok_offset"][b]
        if s >= 0 and 0 <= o < ps:
            pool[layer * S + s, :, :, o, :] = c["tok_kv"][b]
    return pool.reshape(L * S, -1), record, rows, hrows, thr


@pytest.mark.parametrize("B,H,K,D,ps,Np,S,dtype,reuse", [
    (2, 3, 5, 16, 4, 12, 9, "float32", True),     # H*K = 15: padded to 16 in the kernel
    (3, 2, 4, 32, 2, 6, 7, "bfloat16", True),
    (1, 4, 8, 16, 8, 20, 12, "bfloat16", True),
    (2, 2, 3, 16, 4, 8, 5, "float32", False),     # no cache: everything from the host tier
    (2, 5, 15, 16, 4, 40, 30, "float32", True),   # H*K = 75: two entry programs per request
])
def test_layer_lookup_matches_oracle(rng, B, H, K, D, ps, Np, S, dtype, reuse):
    L = 3
    dt = jnp.dtype(dtype)
    c = make_case(rng, B=B, H=H, K=K, D=D, ps=ps, L=L, Np=Np, S=S, dtype=dt)
    pool0 = np.full((L * S, 2 * H * ps * D), np.nan, np.float32)
    layer = int(rng.integers(0, L))
    want = oracle(c, layer, Np=Np, S=S, ps=ps, reuse=reuse, pool=pool0)
    for impl in ("pallas", "xla"):
        got = ll.layer_lookup(
            jnp.asarray(c["pages"]), jnp.asarray(c["active"]), jnp.asarray(c["tok_page"]),
            jnp.asarray(c["tok_offset"]), jnp.asarray(c["tok_kv"], dt), jnp.asarray(c["page_table"]),
            jnp.int32(layer), jnp.asarray(pool0, dt), jnp.asarray(c["record"]), pages_per_seq=Np,
            page_size=ps, reuse=reuse, implementation=impl)
        np.testing.assert_array_equal(as_f32(got[0]), want[0], err_msg=f"{impl} pool")
        for name, g, w in zip(("record", "rows", "host_rows", "tok_host_rows"), got[1:], want[1:]):
            np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"{impl} {name}")


def test_layer_lookup_with_unused_pool_rows(rng):
    """``slots_per_layer`` with unused rows after ``L * S`` (``jaxkv.spec.alloc_rows``): the
    rows are those of the exact pool, and the unused rows (NaN) are never written."""
    B, H, K, D, ps, Np, S, L, extra = 2, 3, 4, 16, 4, 10, 7, 3, 5
    c = make_case(rng, B=B, H=H, K=K, D=D, ps=ps, L=L, Np=Np, S=S, dtype=jnp.float32)
    pool0 = rng.standard_normal((L * S, 2 * H * ps * D)).astype(np.float32)
    padded = np.concatenate([pool0, np.full((extra, pool0.shape[1]), np.nan, np.float32)])
    layer = int(rng.integers(0, L))
    want = oracle(c, layer, Np=Np, S=S, ps=ps, reuse=True, pool=pool0)
    for impl in ("pallas", "xla"):
        got = ll.layer_lookup(
            *(jnp.asarray(c[k]) for k in ("pages", "active", "tok_page", "tok_offset", "tok_kv",
                                          "page_table")),
            jnp.int32(layer), jnp.asarray(padded), jnp.asarray(c["record"]), pages_per_seq=Np,
            page_size=ps, slots_per_layer=S, implementation=impl)
        pool = np.asarray(got[0])
        np.testing.assert_array_equal(pool[:L * S], want[0], err_msg=f"{impl} pool")
        assert np.isnan(pool[L * S:]).all(), impl
        for name, g, w in zip(("record", "rows", "host_rows", "tok_host_rows"), got[1:], want[1:]):
            np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"{impl} {name}")
    with pytest.raises(ValueError, match="pool"):
        ll.layer_lookup(*(jnp.asarray(c[k]) for k in ("pages", "active", "tok_page", "tok_offset",
                                                      "tok_kv", "page_table")),
                        jnp.int32(0), jnp.asarray(pool0[:-1]), jnp.asarray(c["record"]),
                        pages_per_seq=Np, page_size=ps, slots_per_layer=S, implementation="xla")


def test_layer_lookup_in_a_jitted_loop(rng):
    """Traced layer index, pool and record donated through a fori_loop over the layers."""
    B, H, K, D, ps, Np, S, L = 2, 2, 4, 16, 4, 8, 6, 4
    c = make_case(rng, B=B, H=H, K=K, D=D, ps=ps, L=L, Np=Np, S=S, dtype=jnp.float32)
    pool0 = rng.standard_normal((L * S, 2 * H * ps * D)).astype(np.float32)
    want_pool, want_rec = pool0, c["record"]
    for layer in range(L):
        cl = dict(c, record=want_rec)
        want_pool, want_rec, *_ = oracle(cl, layer, Np=Np, S=S, ps=ps, reuse=True, pool=want_pool)
    args = [jnp.asarray(c[k]) for k in ("pages", "active", "tok_page", "tok_offset", "tok_kv",
                                         "page_table")]
    for impl in ("pallas", "xla"):
        @jax.jit
        def run(pool, record):
            def body(layer, carry):
                pool, record = carry
                pool, record, *_ = ll.layer_lookup(*args, layer, pool, record, pages_per_seq=Np,
                                                   page_size=ps, implementation=impl)
                return pool, record
            return jax.lax.fori_loop(0, L, body, (pool, record))
        pool, rec = run(jnp.asarray(pool0), jnp.asarray(c["record"]))
        np.testing.assert_array_equal(np.asarray(pool), want_pool, err_msg=impl)
        np.testing.assert_array_equal(np.asarray(rec), want_rec, err_msg=impl)


def test_layer_lookup_rejects_bad_shapes():
    z = lambda *s, dt=jnp.int32: jnp.zeros(s, dt)
    good = dict(pages=z(2, 2, 3), active=z(2), tok_page=z(2), tok_offset=z(2),
                tok_kv=z(2, 2, 2, 16, dt=jnp.float32), page_table=z(3, 8),
                layer=jnp.int32(0), pool=z(3 * 4, 2 * 2 * 4 * 16, dt=jnp.float32), record=z(3, 12))
    for key, bad in [("record", z(3, 11)), ("tok_kv", z(2, 2, 3, 16, dt=jnp.float32)),
                     ("pool", z(10, 512, dt=jnp.float32)), ("page_table", z(3, 8, dt=jnp.int16)),
                     ("active", z(3))]:
        with pytest.raises(ValueError):
            ll.layer_lookup(**dict(good, **{key: bad}), pages_per_seq=4, page_size=4,
                            implementation="xla")


@pytest.mark.parametrize("B,H,K,D,L,P,S", [(1, 8, 32, 128, 32, 2052, 516),   # 8B-like 128k B=1
                                           (8, 2, 32, 128, 28, 16416, 1056)])  # Qwen-like B=8
def test_layer_lookup_lowers_to_triton(no_interpret, B, H, K, D, L, P, S):
    sds = jax.ShapeDtypeStruct
    ps = 64
    txt = lower_for_h200(
        lambda *a: ll.layer_lookup(*a, pages_per_seq=P // B, page_size=ps, implementation="pallas"),
        sds((B, H, K), jnp.int32), sds((B,), jnp.bool_), sds((B,), jnp.int32), sds((B,), jnp.int32),
        sds((B, 2, H, D), jnp.bfloat16), sds((L, P), jnp.int32), sds((), jnp.int32),
        sds((L * S, 2 * H * ps * D), jnp.bfloat16), sds((L, B * H * K), jnp.int32))
    assert "__gpu$xla.gpu.triton" in txt


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,K", [(1, 8, 32), (8, 2, 32), (3, 3, 7)])
def test_gpu_layer_lookup_matches_reference(rng, B, H, K):
    D, ps, Np, S, L = 128, 64, 40, 50, 4
    c = make_case(rng, B=B, H=H, K=K, D=D, ps=ps, L=L, Np=Np, S=S, dtype=jnp.bfloat16)
    pool0 = np.full((L * S, 2 * H * ps * D), np.nan, np.float32)
    layer = int(rng.integers(0, L))
    want = oracle(c, layer, Np=Np, S=S, ps=ps, reuse=True, pool=pool0)
    got = ll.layer_lookup(
        jnp.asarray(c["pages"]), jnp.asarray(c["active"]), jnp.asarray(c["tok_page"]),
        jnp.asarray(c["tok_offset"]), jnp.asarray(c["tok_kv"], jnp.bfloat16),
        jnp.asarray(c["page_table"]), jnp.int32(layer), jnp.asarray(pool0, jnp.bfloat16),
        jnp.asarray(c["record"]), pages_per_seq=Np, page_size=ps, implementation="pallas")
    np.testing.assert_array_equal(as_f32(got[0]), want[0])
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(np.asarray(g), w)
