"""jaxkv.lru.ensure with partitioned pools (``parts > 1``: one pool per request) against the
plain-Python model run on each partition on its own (tests/lru_model.py), for every method;
the one-kernel Pallas form against the dense form from random consistent states; the
fetch rows of ``partition_rows``; the Triton lowering for an abstract H200."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import lru
from lru_model import LruModel

_FIELDS = ("page_table", "slot_owner", "last_used", "slots", "fetch_src", "fetch_dst",
           "fetch_payload", "hits", "misses", "evictions", "dropped")


@functools.cache
def _jit(method, parts):
    return jax.jit(functools.partial(lru.ensure, method=method, parts=parts))


def _stream_step(rng, L, n, Pp, Rp, Qp, prev, locality=0.7, p_dup=0.3, p_pad=0.2):
    """Per-partition requests [L, n * Rp] (global ids of the partition's own pages, with
    duplicates, padding and a few pages of another partition, which count as padding) and
    protect lists [L, n * Qp]."""
    base = (np.arange(n) * Pp)[None, :, None]
    local = np.where(rng.random((L, n, Rp)) < locality, prev, rng.integers(0, Pp, (L, n, Rp)))
    local = np.where(rng.random((L, n, Rp)) < p_dup, np.roll(local, 1, axis=2), local)
    req = base + local
    req = np.where(rng.random((L, n, Rp)) < p_pad, -1, req)
    other = (base + Pp) % (n * Pp) + rng.integers(0, Pp, (L, n, Rp))
    req = np.where(rng.random((L, n, Rp)) < 0.05, other, req)  # not this partition's page
    prot = np.where(rng.random((L, n, Qp)) < 0.5, base + rng.integers(0, Pp, (L, n, Qp)), -1)
    return req.reshape(L, -1), prot.reshape(L, -1), local


@pytest.mark.parametrize("method", ["dense", "sort", "pallas"])
@pytest.mark.parametrize("L,n,Pp,Sp,Rp,Qp", [
    (2, 3, 20, 7, 5, 2),     # nothing a power of two
    (1, 4, 16, 8, 6, 1),     # pool smaller than the requests: drops
    (2, 2, 32, 16, 8, 2),
])
def test_partitioned_matches_model_per_partition(method, L, n, Pp, Sp, Rp, Qp):
    seed = int(np.random.SeedSequence().entropy % 2**31)  # fresh each run; in the message
    rng = np.random.default_rng(seed)
    P, S = n * Pp, n * Sp
    pt = jnp.full((L, P), -1, jnp.int32)
    so = jnp.full((L, S), -1, jnp.int32)
    lu = jnp.full((L, S), -1, jnp.int32)
    models = [[LruModel(Pp, Sp) for _ in range(n)] for _ in range(L)]
    prev = rng.integers(0, Pp, (L, n, Rp))
    evictions = 0
    for t in range(12):
        req, prot, prev = _stream_step(rng, L, n, Pp, Rp, Qp, prev)
        out = _jit(method, n)(pt, so, lu, jnp.asarray(req, jnp.int32),
                              jnp.asarray(prot, jnp.int32), t)
        pt, so, lu = out.page_table, out.slot_owner, out.last_used
        slots, src, dst = (np.asarray(a) for a in (out.slots, out.fetch_src, out.fetch_dst))
        counts = np.zeros(4, np.int64)
        for l in range(L):
            for b in range(n):
                r = slice(b * Rp, (b + 1) * Rp)
                mine = (req[l, r] >= b * Pp) & (req[l, r] < (b + 1) * Pp)
                local_req = np.where(mine, req[l, r] - b * Pp, -1)
                pmine = (prot[l, b * Qp:(b + 1) * Qp] >= 0)
                local_prot = np.where(pmine, prot[l, b * Qp:(b + 1) * Qp] - b * Pp, -1)
                m_slots, fetched, h, mi, ev, dr = models[l][b].step(
                    local_req.tolist(), local_prot.tolist(), t)
                want = [s + b * Sp if s >= 0 else -1 for s in m_slots]
                msg = f"seed {seed} step {t} layer {l} part {b}"
                assert slots[l, r].tolist() == want, msg
                k = len(fetched)
                assert src[l, r][:k].tolist() == [p + b * Pp for p in sorted(fetched)], msg
                assert dst[l, r][:k].tolist() == [fetched[p] + b * Sp for p in sorted(fetched)], msg
                assert (src[l, r][k:] == -1).all() and (dst[l, r][k:] == -1).all(), msg
                owner = np.asarray(so[l, b * Sp:(b + 1) * Sp])
                assert owner.tolist() == [p + b * Pp if p >= 0 else -1
                                          for p in models[l][b].owner], msg
                counts += (h, mi, ev, dr)
            so_l, pt_l = np.asarray(so[l]), np.asarray(pt[l])
            for s in range(S):  # inverse maps, each page in its own partition's slots
                if so_l[s] >= 0:
                    assert pt_l[so_l[s]] == s and so_l[s] // Pp == s // Sp
            assert (pt_l >= 0).sum() == (so_l >= 0).sum()
        assert counts.tolist() == [int(out.hits), int(out.misses), int(out.evictions),
                                   int(out.dropped)]
        evictions += counts[2]
    assert evictions > 0


def _random_partitioned_state(rng, L, n, Pp, Sp):
    """Consistent random state: in each partition a random number of its pages in a random
    permutation of its slots; random last-used steps."""
    pt = np.full((L, n * Pp), -1, np.int32)
    so = np.full((L, n * Sp), -1, np.int32)
    lu = rng.integers(-1, 8, (L, n * Sp)).astype(np.int32)
    for l in range(L):
        for b in range(n):
            k = int(rng.integers(0, min(Sp, Pp) + 1))
            pages = b * Pp + rng.permutation(Pp)[:k]
            slots = b * Sp + rng.permutation(Sp)[:k]
            pt[l, pages], so[l, slots] = slots, pages
    return jnp.asarray(pt), jnp.asarray(so), jnp.asarray(lu)


@pytest.mark.parametrize("L,n,Pp,Sp,Rp,Qp", [(3, 2, 37, 7, 5, 3), (2, 8, 24, 13, 8, 2)])
def test_pallas_partitioned_equals_dense_and_sort(L, n, Pp, Sp, Rp, Qp):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    rng = np.random.default_rng(seed)
    state = _random_partitioned_state(rng, L, n, Pp, Sp)
    prev = rng.integers(0, Pp, (L, n, Rp))
    for t in range(10, 20):
        req, prot, prev = _stream_step(rng, L, n, Pp, Rp, Qp, prev, locality=0.4)
        pay = jnp.asarray(rng.integers(-1, 1000, req.shape), jnp.int32)
        args = (*state, jnp.asarray(req, jnp.int32), jnp.asarray(prot, jnp.int32), t, pay)
        outs = {m: _jit(m, n)(*args) for m in ("pallas", "dense", "sort")}
        for f in _FIELDS:
            for m in ("dense", "sort"):
                np.testing.assert_array_equal(getattr(outs["pallas"], f), getattr(outs[m], f),
                                              err_msg=f"{f} vs {m} step {t} seed {seed}")
        state = (outs["dense"].page_table, outs["dense"].slot_owner, outs["dense"].last_used)


def test_one_partition_is_the_shared_pool():
    rng = np.random.default_rng(0)
    state = _random_partitioned_state(rng, 2, 1, 30, 9)
    req, prot, _ = _stream_step(rng, 2, 1, 30, 6, 2, rng.integers(0, 30, (2, 1, 6)))
    args = (*state, jnp.asarray(req, jnp.int32), jnp.asarray(prot, jnp.int32), 4)
    for m in ("dense", "pallas"):
        a, b = _jit(m, 1)(*args), jax.jit(functools.partial(lru.ensure, method=m))(*args)
        for f in _FIELDS:
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)


def test_parts_must_divide_every_size():
    z = jnp.zeros((1, 12), jnp.int32)
    with pytest.raises(ValueError, match="parts=5 must divide"):
        lru.ensure(z, z[:, :10], z[:, :10], z[:, :10], z[:, :5], 0, parts=5)


def test_partition_rows_address_the_same_rows():
    """Row l * n + b of partition_rows with its strides names the same host row
    (l * P + page) and pool row (l * S + slot) as the layer-wide lists."""
    L, n, Pp, Sp, Rp = 3, 4, 10, 5, 3
    rng = np.random.default_rng(1)
    src = np.full((L, n * Rp), -1, np.int64)
    dst = np.full((L, n * Rp), -1, np.int64)
    for l in range(L):
        for b in range(n):
            k = int(rng.integers(0, Rp + 1))
            src[l, b * Rp:b * Rp + k] = b * Pp + np.sort(rng.permutation(Pp)[:k])
            dst[l, b * Rp:b * Rp + k] = b * Sp + rng.permutation(Sp)[:k]
    s, d, ps, ss = lru.partition_rows(jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32),
                                      n, n * Pp, n * Sp)
    assert (ps, ss) == (Pp, Sp) and s.shape == d.shape == (L * n, Rp)
    s, d = np.asarray(s), np.asarray(d)
    want = {(l * n * Pp + src[l, j], l * n * Sp + dst[l, j])
            for l in range(L) for j in range(n * Rp) if src[l, j] >= 0}
    got = {(r * Pp + s[r, j], r * Sp + d[r, j]) for r in range(L * n) for j in range(Rp)
           if s[r, j] >= 0}
    assert got == want
    for r in range(L * n):  # compacted: entries first, -1 after
        k = int((s[r] >= 0).sum())
        assert (s[r, :k] >= 0).all() and (s[r, k:] == -1).all()


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_partitioned_pallas_lowers_to_one_triton_kernel(no_interpret):
    """Qwen-like B=8 shapes (R = 512 requests, S = 1040 slots per layer, in 8 partitions of
    64 and 130) lower for an abstract H200 as one Triton kernel with no sort."""
    from lowering import lower_for_h200
    L, n = 28, 8
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    txt = lower_for_h200(functools.partial(lru.ensure, method="pallas", parts=n),
                         i32(L, n * 2048), i32(L, n * 130), i32(L, n * 130), i32(L, n * 64),
                         i32(L, n * 2), i32())
    assert txt.count("__gpu$xla.gpu.triton") == 1 and "stablehlo.sort" not in txt


@pytest.mark.gpu
@pytest.mark.parametrize("L,n,Pp,Sp,Rp,Qp", [(28, 8, 2048, 130, 64, 2), (3, 4, 37, 13, 8, 2)])
def test_gpu_partitioned_pallas_equals_dense(L, n, Pp, Sp, Rp, Qp):
    """On the device (Triton, not interpret): the partitioned kernel equals the dense form at
    the Qwen-like B=8 shapes of the engine's 2x pool, over a stream of steps."""
    rng = np.random.default_rng([L, n, Sp])
    state = _random_partitioned_state(rng, L, n, Pp, Sp)
    prev = rng.integers(0, Pp, (L, n, Rp))
    for t in range(10, 16):
        req, prot, prev = _stream_step(rng, L, n, Pp, Rp, Qp, prev, locality=0.8)
        args = (*state, jnp.asarray(req, jnp.int32), jnp.asarray(prot, jnp.int32), t)
        x = _jit("pallas", n)(*args)
        y = _jit("dense", n)(*args)
        for f in _FIELDS:
            np.testing.assert_array_equal(getattr(x, f), getattr(y, f), err_msg=f"{f} step {t}")
        state = (y.page_table, y.slot_owner, y.last_used)


def test_auto_method_for_partitions_is_sort(monkeypatch):
    """Measured at the engine's shape (lru.PARTS_AUTO_METHOD): "auto" with parts > 1 runs the
    sort form, also where the Pallas kernel would take one partition on the GPU."""
    monkeypatch.setattr(lru._common, "on_gpu", lambda: True)
    monkeypatch.delenv("JAXKV_IMPL", raising=False)
    assert lru.resolve_method("auto", R=64, S=130, Q=2, parts=8) == "sort"
    assert lru.resolve_method("auto", R=64, S=130, Q=2) == "pallas"
