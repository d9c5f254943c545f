"""The two-stage selectors' second stage (jaxkv.kernels.candidate_mass) against numpy: fresh
seeds, NaN in every key and scale the op must not read, candidates in any order."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxkv.kernels import candidate_mass as cm
from page_kernel_util import fresh_rng


def _rng():
    return fresh_rng()  # fresh seed each run, printed (shown when a test fails)


def mass_numpy(q, keys, scales, layer, cand, positions):
    """Float64 masses: per KV head and query head, softmax over the candidates' valid tokens."""
    _, B, H, Np, ps, D = keys.shape
    G = q.shape[1] // H
    out = np.full(cand.shape, -np.inf)
    for b in range(B):
        for h in range(H):
            c = cand[b, h]
            toks = [(i, p, t) for i, p in enumerate(c) if p >= 0 for t in range(ps)
                    if p * ps + t <= positions[b]]
            mass = np.zeros(len(c))
            for g in range(G):
                if not toks:
                    break
                s = np.array([keys[layer, b, h, p, t].astype(np.float64) * scales[layer, b, h, p, t]
                              @ q[b, h * G + g].astype(np.float64) for _, p, t in toks]) / np.sqrt(D)
                w = np.exp(s - s.max())
                for (i, _, _), wi in zip(toks, w / w.sum()):
                    mass[i] += wi
            out[b, h] = np.where(c >= 0, mass, -np.inf)
    return out


def _mass_numpy_vectorized(q, keys, scales, layer, cand, positions):
    """``mass_numpy`` in float64 array form, for decode-sized cases."""
    _, B, H, Np, ps, D = keys.shape
    G = q.shape[1] // H
    idx = np.clip(cand, 0, Np - 1)
    bi, hi = np.arange(B)[:, None, None], np.arange(H)[None, :, None]
    k = keys[layer][bi, hi, idx].astype(np.float64) * scales[layer][bi, hi, idx][..., None]
    s = np.einsum("bhgd,bhctd->bhgct", q.reshape(B, H, G, D).astype(np.float64), k) / np.sqrt(D)
    tok = idx[..., None] * ps + np.arange(ps)
    valid = (cand[..., None] >= 0) & (tok <= positions[:, None, None, None])
    s = np.where(valid[:, :, None], s, -np.inf)
    with np.errstate(invalid="ignore"):  # rows without a candidate: masked below
        p = np.exp(s - s.max(axis=(-2, -1), keepdims=True))
        mass = (p.sum(-1) / p.sum(axis=(-2, -1))[..., None]).sum(axis=2)
    return np.where(cand >= 0, mass, -np.inf)


def _case(rng, *, L=2, B=3, H=2, G=3, Np=10, ps=4, D=8, C=5, int8=True):
    q = rng.normal(size=(B, H * G, D)).astype(np.float32)
    if int8:
        keys = rng.integers(-127, 128, size=(L, B, H, Np, ps, D)).astype(np.int8)
        scales = (rng.random((L, B, H, Np, ps)) * 0.05).astype(np.float32)
    else:
        keys = rng.normal(size=(L, B, H, Np, ps, D)).astype(np.float32)
        scales = np.ones((L, B, H, Np, ps), np.float32)
    positions = np.array([Np * ps - 3, 13, -1][:B], np.int32)
    cand = np.full((B, H, C), -1, np.int32)
    for b in range(B):
        n = max(0, -(-(positions[b] + 1) // ps))
        for h in range(H):
            pick = rng.permutation(n)[:rng.integers(0, min(C, n) + 1)]  # any order, some -1
            cand[b, h, :len(pick)] = pick
            cand[b, h] = rng.permutation(cand[b, h])  # the -1s anywhere in the row
    return q, keys, scales, cand, positions


def _poison(keys, scales, cand, positions, layer, ps):
    """NaN keys / scales everywhere the op must not read: other layers, non-candidate pages,
    tokens past the position (float keys; int8 keys get NaN scales only)."""
    scales = scales.copy()
    keys = keys.copy()
    L, B, H, Np = keys.shape[:4]
    read = np.zeros((L, B, H, Np, ps), bool)
    for b in range(B):
        for h in range(H):
            for p in cand[b, h][cand[b, h] >= 0]:
                read[layer, b, h, p] = p * ps + np.arange(ps) <= positions[b]
    scales[~read] = np.nan
    if keys.dtype != np.int8:
        keys[~read] = np.nan
    return keys, scales


@pytest.mark.parametrize("int8", [True, False])
def test_candidate_mass_matches_numpy_with_poison(int8):
    rng = _rng()
    q, keys, scales, cand, positions = _case(rng, int8=int8)
    want = mass_numpy(q, keys, scales, 1, cand, positions)
    keys, scales = _poison(keys, scales, cand, positions, 1, 4)
    got = np.asarray(cm.candidate_mass(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(scales),
                                       jnp.int32(1), jnp.asarray(cand), jnp.asarray(positions)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    G = q.shape[1] // keys.shape[2]
    for b, h in np.ndindex(cand.shape[:2]):  # a row's candidates hold its G heads' mass
        ok = cand[b, h] >= 0
        assert np.all(got[b, h][~ok] == -np.inf)
        if ok.any() and positions[b] >= 0:
            np.testing.assert_allclose(got[b, h][ok].sum(), G, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
@pytest.mark.parametrize("ps, block_c", [(16, 2), (8, None), (8, 1), (4, 2)])
def test_candidate_mass_kernel_matches_numpy_with_poison(dtype, ps, block_c):
    """The Pallas kernel (interpret mode off the GPU): head dim 32, 6 query heads per KV head
    (padded to the dot's 16 rows), candidates in any order with -1s, a request before its
    first token; NaN wherever it must not read. Pages of 16 tokens, and pages under 16 whose
    programs take at least 16 tokens of candidates (a ``block_c`` below that is raised;
    candidates past ``C`` in the last program are masked)."""
    rng = _rng()
    q, keys, scales, cand, positions = _case(rng, L=2, B=3, H=2, G=6, Np=7, ps=ps, D=32, C=5)
    if dtype == "bfloat16":  # the KV-dtype copy: keys themselves, scales one
        keys = (keys.astype(np.float32) * scales[..., None]).astype(jnp.bfloat16)
        scales = np.ones_like(scales)
    want = mass_numpy(q, np.asarray(keys, np.float32), scales, 1, cand, positions)
    keys, scales = _poison(np.asarray(keys), scales, cand, positions, 1, ps)
    got = np.asarray(cm.candidate_mass_pallas(
        jnp.asarray(q), jnp.asarray(keys), jnp.asarray(scales), jnp.int32(1), jnp.asarray(cand),
        jnp.asarray(positions), block_c=block_c))
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize("qdtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("ps, G", [(16, 6), (8, 7), (4, 16)])
def test_kernel_query_split_matches_numpy(qdtype, ps, G):
    """Each program gathers its KV head's G query rows (a group not a power of two, padded in
    the kernel) and splits them into bfloat16 halves itself: the masses equal float64 numpy's
    for a float32 and a bfloat16 query (fresh seed, NaN poison where nothing may be read,
    permuted candidates)."""
    rng = _rng()
    q, keys, scales, cand, positions = _case(rng, L=2, B=3, H=2, G=G, Np=7, ps=ps, D=32, C=5)
    q = np.asarray(jnp.asarray(q, qdtype).astype(jnp.float32))
    want = mass_numpy(q, np.asarray(keys, np.float32), scales, 1, cand, positions)
    keys, scales = _poison(np.asarray(keys), scales, cand, positions, 1, ps)
    perm = rng.permutation(cand.shape[2])
    got = np.asarray(cm.candidate_mass_pallas(
        jnp.asarray(q, qdtype), jnp.asarray(keys), jnp.asarray(scales), jnp.int32(1),
        jnp.asarray(cand[:, :, perm]), jnp.asarray(positions)))
    np.testing.assert_allclose(got, want[:, :, perm], rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_candidate_mass_blocked_matches_numpy_with_poison(int8, chunk):
    """The blocked formulation (the CPU default): candidates in any order with -1s, a chunk
    that does not divide the candidates (the last chunk overlaps the one before); NaN
    wherever it must not read."""
    rng = _rng()
    q, keys, scales, cand, positions = _case(rng, int8=int8, C=7)
    want = mass_numpy(q, keys, scales, 1, cand, positions)
    keys, scales = _poison(keys, scales, cand, positions, 1, 4)
    got = np.asarray(cm.candidate_mass_blocked(
        jnp.asarray(q), jnp.asarray(keys), jnp.asarray(scales), jnp.int32(1), jnp.asarray(cand),
        jnp.asarray(positions), chunk=chunk))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("implementation", ["xla", "blocked"])
@pytest.mark.parametrize("chunk", [3, 64])
def test_candidate_mass_in_order_reads_only_the_pages_in_use(implementation, chunk):
    """Every page a candidate, in page order (what the two-stage selectors hand over when
    the candidates cover the row): the masses of the candidates in any order, with NaN in
    every key and scale past each request's position (float keys) and in the other layers."""
    rng = _rng()
    q, keys, scales, _, positions = _case(rng, int8=False)
    L, B, H, Np, ps, D = keys.shape
    nv = np.clip(-(-(positions + 1) // ps), 0, Np)
    p = np.arange(Np)
    every = np.broadcast_to(np.where(p[None, :] < nv[:, None], p[None, :], -1)[:, None],
                            (B, H, Np)).astype(np.int32)
    want = mass_numpy(q, keys, scales, 1, every, positions)
    keys, scales = _poison(keys, scales, every, positions, 1, ps)
    kw = dict(chunk=chunk) if implementation == "blocked" else {}
    fn = cm.candidate_mass_blocked if implementation == "blocked" else cm.candidate_mass_reference
    got = np.asarray(fn(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(scales), jnp.int32(1),
                        jnp.asarray(every), jnp.asarray(positions), in_order=True, **kw))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("implementation", ["xla", "blocked", "pallas"])
def test_candidate_mass_of_an_empty_page_is_zero(implementation):
    """A candidate page that holds no token yet (past the request's position; every candidate
    of the request before its first token) gets mass 0, not NaN, in every implementation;
    the pages' keys and scales there are NaN."""
    rng = _rng()
    ps, D, G = (16, 32, 6) if implementation == "pallas" else (4, 8, 3)
    q, keys, scales, cand, positions = _case(rng, L=2, B=3, H=2, G=G, Np=7, ps=ps, D=D, C=5,
                                             int8=implementation != "pallas")
    if implementation == "pallas":
        keys = (keys.astype(np.float32) * scales[..., None]).astype(jnp.bfloat16)
        scales = np.ones_like(scales)
    nv = np.clip(-(-(positions + 1) // ps), 0, 7)
    for b in range(3):  # the last candidate of each row: the first page past the position
        cand[b, :, -1] = nv[b] if nv[b] < 7 else -1
    want = mass_numpy(q, np.asarray(keys, np.float32), scales, 1, cand, positions)
    keys, scales = _poison(np.asarray(keys), scales, cand, positions, 1, ps)
    got = np.asarray(cm.candidate_mass(
        jnp.asarray(q), jnp.asarray(keys), jnp.asarray(scales), jnp.int32(1), jnp.asarray(cand),
        jnp.asarray(positions), implementation=implementation))
    empty = (cand >= 0) & (cand * ps > positions[:, None, None])
    assert empty.any() and np.all(got[empty] == 0.0)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6)


def test_candidate_mass_default_off_the_gpu_is_the_blocked_form():
    """Off the GPU the op's default is the blocked formulation; "xla" still names the
    reference."""
    from jaxkv.kernels import _common
    if _common.on_gpu():
        pytest.skip("the CPU default")
    assert _common.resolve(cm.OP) is cm.candidate_mass_blocked
    assert _common.resolve(cm.OP, "xla") is cm.candidate_mass_reference


def test_candidate_mass_kernel_takes_the_reference_for_other_shapes():
    """A head dim under 16 (the tensor cores' smallest block) or float32 keys: the
    reference's result."""
    rng = _rng()
    for int8 in (True, False):  # head dim 8; float32 keys
        q, keys, scales, cand, positions = _case(rng, ps=16, D=8 if int8 else 32, int8=int8)
        assert not cm.kernel_takes(jnp.asarray(keys))
        args = (jnp.asarray(q), jnp.asarray(keys), jnp.asarray(scales), jnp.int32(0),
                jnp.asarray(cand), jnp.asarray(positions))
        np.testing.assert_array_equal(np.asarray(cm.candidate_mass_pallas(*args)),
                                      np.asarray(cm.candidate_mass_reference(*args)))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["qwen_b8", "qwen_b8_p8", "qwen_b8_p16", "8b_b1"])
def test_gpu_candidate_mass_kernel_at_decode_shapes(shape):
    """The kernel on the GPU against the reference at the two 128k decode shapes' second stage
    (pages shortened to keep the test small): Qwen-like B=8 (64-token pages, 12 / 2 heads,
    8x 32 candidates; 8-token pages, 8x 128 candidates, 16 per program), 8B-like B=1 (16-token
    pages, 32 / 8 heads, 8x 128 candidates); and the statistics with the query split in the
    kernel against those with it split in XLA."""
    rng = _rng()
    if shape == "qwen_b8":
        L, B, H, G, Np, ps, D, C = 3, 8, 2, 6, 512, 64, 128, 256
    elif shape == "qwen_b8_p8":
        L, B, H, G, Np, ps, D, C = 3, 8, 2, 6, 2048, 8, 128, 1024
    elif shape == "qwen_b8_p16":  # CacheConfig()'s pages and candidates, Qwen's head dim 64
        L, B, H, G, Np, ps, D, C = 3, 8, 2, 7, 2048, 16, 64, 512
    else:
        L, B, H, G, Np, ps, D, C = 3, 1, 8, 4, 2048, 16, 128, 1024
    q = rng.normal(size=(B, H * G, D)).astype(np.float32)
    keys = rng.integers(-127, 128, size=(L, B, H, Np, ps, D)).astype(np.int8)
    scales = (rng.random((L, B, H, Np, ps)) * 0.02).astype(np.float32)
    positions = rng.integers(Np * ps // 2, Np * ps, size=B).astype(np.int32)
    cand = np.stack([np.stack([rng.permutation(positions[b] // ps + 1)[:C] for _ in range(H)])
                     for b in range(B)]).astype(np.int32)
    cand[:, :, -3:] = -1
    args = (jnp.asarray(q), jnp.asarray(keys), jnp.asarray(scales), jnp.int32(2),
            jnp.asarray(cand), jnp.asarray(positions))
    got = np.asarray(cm.candidate_mass_pallas(*args))
    want = _mass_numpy_vectorized(q, keys, scales, 2, cand, positions)
    assert np.all(got[cand < 0] == -np.inf)
    np.testing.assert_allclose(got[cand >= 0], want[cand >= 0], rtol=2e-3, atol=1e-6)


def test_vectorized_numpy_mass_equals_the_loop():
    rng = _rng()
    q, keys, scales, cand, positions = _case(rng)
    positions[-1] = 5  # every request has a token (the vectorized form's one assumption)
    np.testing.assert_allclose(_mass_numpy_vectorized(q, keys, scales, 1, cand, positions),
                               mass_numpy(q, keys, scales, 1, cand, positions), rtol=1e-12)


@pytest.mark.parametrize("ps", [16, 8, 64])
def test_candidate_mass_lowers_for_h200(no_interpret, ps):
    """The kernel's page statistics through the Triton lowering at Qwen-like B=8's second
    stage (128k, 512 / 1024 / 128 candidates of 16 / 8 / 64 tokens): one Triton call, the
    query split inside it."""
    import functools
    from tests.lowering import lower_for_h200
    B, H, G, D = 8, 2, 7, 64
    Np, C = (131072 + 256) // ps, {16: 512, 8: 1024, 64: 128}[ps]
    S = jax.ShapeDtypeStruct
    text = lower_for_h200(cm.page_stats_pallas, S((B, H * G, D), jnp.bfloat16),
                          S((28, B, H, Np, ps, D), jnp.int8),
                          S((28, B, H, Np, ps), jnp.float32), S((), jnp.int32),
                          S((B, H, C), jnp.int32), S((B,), jnp.int32))
    assert text.count("__gpu$xla.gpu.triton") == 1


def test_engine_pallas_second_stage_host_equals_resident():
    """The Pallas second stage in the engine (interpret mode; a first stage that chooses: 8
    candidates of the prompts' 19 / 11 pages of 16 tokens): host tier == resident."""
    import jaxkv
    from jaxkv import CacheConfig
    from jaxkv.models import configs, llama
    cfg = configs.tiny(head_dim=16)
    params = llama.init_params(cfg, seed=5)
    rng = np.random.default_rng(12)
    prompts = [rng.integers(3, cfg.vocab_size, size=n).tolist() for n in (300, 170)]
    out = {}
    for mode in ("resident", "host"):
        cache = CacheConfig(mode=mode, selector="quest_rescore8", page_size=16, selected_pages=3,
                            candidate_pages=8, implementation="pallas")
        out[mode] = jaxkv.generate(cfg, params, prompts, max_new_tokens=4, stop_tokens=[],
                                   cache=cache).tokens
    assert out["host"] == out["resident"]
