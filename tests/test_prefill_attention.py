"""Tests of jaxkv.kernels.prefill_attention: the flash-attention kernel (interpret mode on CPU,
Triton on GPU) and the blocked jnp formulation (the CPU default) vs the chunked reference vs a
direct ``jaxkv.models.llama.gqa_attention`` call with the full [B, T, T] mask; NaN-poisoned
padding; the reference's chunking; input validation; a CPU-only check that the kernel lowers to
Triton for an H200; and one GPU comparison at a long prompt."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxkv.models.llama import gqa_attention
from jaxkv.kernels import _common
from jaxkv.kernels import prefill_attention as pa
from jaxkv.kernels.prefill_attention import prefill_attention

# f32: both dots at HIGHEST precision, only the summation order differs. bf16: the kernel casts
# the probabilities to bf16 for p @ v (relative error <= 2**-9 per weight) and both round the
# output to bf16 (2**-8 relative).
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def fresh_seed() -> int:
    return int(np.random.SeedSequence().entropy % 2**32)


def make_case(seed, *, B, T, Hq, H, D, dtype, lengths=None, poison=True):
    """Random q/k/v (normal) and lengths (given, else random in [0, T]); with ``poison``, k and
    v at positions >= length are NaN."""
    rng = np.random.default_rng(seed)
    if lengths is None:
        lengths = rng.integers(0, T + 1, size=B)
    lengths = np.asarray(lengths, np.int32)
    q = rng.standard_normal((B, T, Hq, D)).astype(np.float32)
    k = rng.standard_normal((B, T, H, D)).astype(np.float32)
    v = rng.standard_normal((B, T, H, D)).astype(np.float32)
    if poison:
        pad = np.arange(T)[None, :] >= lengths[:, None]  # [B, T]
        k[pad], v[pad] = np.nan, np.nan
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(lengths))


def full_mask(T, lengths):
    """[B, T, T] bool: key s allowed for query t iff s <= t and s < lengths[b]."""
    i = np.arange(T)
    m = (i[None, :] <= i[:, None])[None] & (i[None, None, :] < np.asarray(lengths)[:, None, None])
    return jnp.asarray(m)


def f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


def check(a, b, dtype, seed, what, rows=None):
    a, b = f32(a), f32(b)
    if rows is not None:
        a, b = a[rows], b[rows]
    np.testing.assert_allclose(a, b, err_msg=f"{what} (seed {seed})", **TOL[dtype])


CASES = [  # (T, Hq, H, D, dtype, lengths, tuning); B = len(lengths)
    (64, 4, 4, 32, jnp.float32, [37, 64], dict(block_q=32, block_k=16)),    # G=1
    (96, 4, 2, 64, jnp.bfloat16, [96, 1], {}),                               # G=2, T < block_q
    (80, 6, 2, 32, jnp.float32, [0, 53], dict(block_q=32, block_k=16)),     # G=3, T % block_q
    (128, 12, 2, 64, jnp.bfloat16, [128, 70], dict(block_q=64, block_k=32)),  # G=6 (Qwen2.5)
    (256, 9, 3, 64, jnp.bfloat16, [200, 256], {}),                           # G=3 (SmolLM2)
    (48, 8, 2, 128, jnp.float32, None, dict(block_q=16, block_k=32, num_warps=4, num_stages=3)),
]


@pytest.mark.parametrize("T,Hq,H,D,dtype,lengths,tuning", CASES)
def test_kernel_matches_references(T, Hq, H, D, dtype, lengths, tuning):
    """pallas == chunked xla == direct gqa_attention, with NaN in k/v past each prompt."""
    seed = fresh_seed()
    q, k, v, lens = make_case(seed, B=2 if lengths is None else len(lengths), T=T, Hq=Hq, H=H,
                              D=D, dtype=dtype, lengths=lengths)
    direct = gqa_attention(q, k, v, full_mask(T, lens))
    ref = prefill_attention(q, k, v, lens, implementation="xla", chunk=48)  # 48 divides no T but 96
    out = prefill_attention(q, k, v, lens, implementation="pallas", **tuning)
    assert out.shape == q.shape and out.dtype == dtype and ref.dtype == dtype
    assert np.isfinite(f32(out)).all(), f"non-finite kernel output (seed {seed})"
    check(ref, direct, dtype, seed, "xla vs gqa_attention")
    check(out, direct, dtype, seed, "pallas vs gqa_attention")
    for b, n in enumerate(np.asarray(lens)):
        if n == 0:
            assert (f32(out[b]) == 0).all() and (f32(ref[b]) == 0).all(), f"length 0 (seed {seed})"


def check_blocked(q, k, v, lens, seed, what, **tuning):
    """The blocked formulation vs direct attention: equal on every query row below the longest
    prompt (rows of a shorter prompt's padding included), zeros in the query blocks past it."""
    T = q.shape[1]
    out = prefill_attention(q, k, v, lens, implementation="blocked", **tuning)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert np.isfinite(f32(out)).all(), f"non-finite blocked output (seed {seed})"
    tile = min(tuning.get("block_q") or pa.blocked_tile(T), _common.next_pow2(T))
    computed = -(-int(np.max(np.asarray(lens))) // tile) * tile
    rows = (slice(None), slice(0, min(computed, T)))
    check(out, gqa_attention(q, k, v, full_mask(T, lens)), q.dtype.type, seed, what, rows=rows)
    assert (f32(out)[:, computed:] == 0).all(), f"{what}: blocks past the prompts (seed {seed})"
    return out


@pytest.mark.parametrize("T,Hq,H,D,dtype,lengths,tuning", CASES)
def test_blocked_matches_direct_attention(T, Hq, H, D, dtype, lengths, tuning):
    """The blocked formulation (default and small tiles) with NaN in k/v past each prompt."""
    seed = fresh_seed()
    q, k, v, lens = make_case(seed, B=2 if lengths is None else len(lengths), T=T, Hq=Hq, H=H,
                              D=D, dtype=dtype, lengths=lengths)
    for tile in (None, 16):
        out = check_blocked(q, k, v, lens, seed, f"blocked tile {tile}", block_q=tile)
        for b, n in enumerate(np.asarray(lens)):
            if n == 0:
                assert (f32(out[b]) == 0).all(), f"length 0 (seed {seed})"


@pytest.mark.parametrize("implementation", ["pallas", "xla", "blocked"])
def test_poisoned_padding(implementation):
    """NaN in q, k and v at every position >= length: valid query rows stay finite and equal the
    reference on clean inputs; a length-0 prompt gives zeros."""
    seed = fresh_seed()
    T, lengths = 72, [45, 0, 72]
    kw = dict(B=3, T=T, Hq=4, H=2, D=32, dtype=jnp.float32, lengths=lengths)
    q, k, v, lens = make_case(seed, poison=False, **kw)
    pad = (np.arange(T)[None, :] >= np.asarray(lengths)[:, None])[:, :, None, None]
    qp, kp, vp = (jnp.where(pad, jnp.nan, x) for x in (q, k, v))
    clean = gqa_attention(q, k, v, full_mask(T, lens))
    tuning = {"pallas": dict(block_q=32, block_k=16), "blocked": dict(block_q=16)}
    out = prefill_attention(qp, kp, vp, lens, implementation=implementation,
                            **tuning.get(implementation, {}))
    for b, n in enumerate(lengths):
        rows = (b, slice(0, n))
        assert np.isfinite(f32(out)[rows]).all(), f"b={b}: NaN leaked into valid rows (seed {seed})"
        check(out, clean, jnp.float32, seed, f"b={b} valid rows", rows=rows)
    assert (f32(out[1]) == 0).all(), f"length-0 prompt not zero (seed {seed})"


@pytest.mark.parametrize("T,chunk", [(80, 32), (80, 7), (64, 16), (50, 64)])
def test_xla_chunking(T, chunk):
    """The reference with any chunk (dividing T or not, larger than T) equals one chunk, to
    float32 rounding: the online softmax sums in another order (seed 3425349489 at
    T=64, chunk=16 differs by 1.1e-6 in an output of magnitude up to 2.7)."""
    seed = fresh_seed()
    q, k, v, lens = make_case(seed, B=2, T=T, Hq=6, H=2, D=32, dtype=jnp.float32,
                              lengths=[T - 3, 11])
    whole = prefill_attention(q, k, v, lens, implementation="xla", chunk=T)
    chunked = prefill_attention(q, k, v, lens, implementation="xla", chunk=chunk)
    assert chunked.shape == q.shape
    np.testing.assert_allclose(f32(chunked), f32(whole), rtol=1e-5, atol=1e-5,
                               err_msg=f"seed {seed}")


def test_sm_scale_and_default_implementation():
    seed = fresh_seed()
    q, k, v, lens = make_case(seed, B=2, T=40, Hq=4, H=1, D=16, dtype=jnp.float32, lengths=[40, 9])
    direct = gqa_attention(q, k, v, full_mask(40, lens), sm_scale=0.3)
    check(prefill_attention(q, k, v, lens, sm_scale=0.3, implementation="pallas", block_q=16),
          direct, jnp.float32, seed, "pallas sm_scale")
    check(prefill_attention(q, k, v, lens, sm_scale=0.3, implementation="xla"), direct,
          jnp.float32, seed, "xla sm_scale")
    check(prefill_attention(q, k, v, lens, sm_scale=0.3, implementation="blocked", block_q=16),
          direct, jnp.float32, seed, "blocked sm_scale")
    assert set(_common.implementations(pa.OP)) == {"pallas", "xla", "blocked", "cudnn", "auto"}
    if jax.default_backend() != "gpu":
        assert _common.resolve(pa.OP) is pa.prefill_attention_blocked
        assert _common.resolve(pa.OP, "xla") is pa.prefill_attention_xla


def test_cpu_default_and_environment(monkeypatch):
    """Off the GPU the default is the blocked formulation; JAXKV_IMPL=xla (or the per-op
    variable) gives the reference, an explicit argument wins over both."""
    monkeypatch.setattr(_common, "on_gpu", lambda: False)
    for var in ("JAXKV_IMPL", "JAXKV_IMPL_PREFILL_ATTENTION"):
        monkeypatch.delenv(var, raising=False)
    assert _common.resolve(pa.OP) is pa.prefill_attention_blocked
    monkeypatch.setenv("JAXKV_IMPL", "xla")
    assert _common.resolve(pa.OP) is pa.prefill_attention_xla
    assert _common.resolve(pa.OP, "blocked") is pa.prefill_attention_blocked
    monkeypatch.delenv("JAXKV_IMPL")
    monkeypatch.setenv("JAXKV_IMPL_PREFILL_ATTENTION", "xla")
    assert _common.resolve(pa.OP) is pa.prefill_attention_xla
    monkeypatch.setattr(_common, "on_gpu", lambda: True)
    monkeypatch.delenv("JAXKV_IMPL_PREFILL_ATTENTION")
    assert _common.resolve(pa.OP) is pa.prefill_attention_auto


def _bad(B=2, T=32, Hq=4, H=2, D=32, kdtype=jnp.float32, lshape=None, qrank=4, kT=None):
    q = jnp.zeros((B, T, Hq, D)[:qrank], jnp.float32)
    k = jnp.zeros((B, kT or T, H, D), kdtype)
    return q, k, k, jnp.zeros(lshape or (B,), jnp.int32)


@pytest.mark.parametrize("implementation", ["pallas", "xla", "blocked"])
@pytest.mark.parametrize("args,match", [
    (_bad(qrank=3), "q must be rank 4"),
    (_bad(kT=16), r"k/v shape .* must be \[B=2, T=32"),
    (_bad(Hq=6, H=4), "query heads 6 must be a multiple of kv heads 4"),
    (_bad(kdtype=jnp.bfloat16), "must equal q dtype float32"),
    (_bad(lshape=(3,)), r"lengths shape \(3,\) != \(2,\)"),
])
def test_bad_inputs(implementation, args, match):
    with pytest.raises(ValueError, match=match):
        prefill_attention(*args, implementation=implementation)


def test_bad_kernel_arguments():
    q, k, v, lens = _bad(D=48)
    with pytest.raises(ValueError, match="head_dim=48 must be a power of two"):
        prefill_attention(q, k, v, lens, implementation="pallas")
    q, k, v, lens = _bad()
    with pytest.raises(ValueError, match="block_q=48 must be a power of two"):
        prefill_attention(q, k, v, lens, implementation="pallas", block_q=48)
    with pytest.raises(ValueError, match="block_k=8 must be a power of two >= 16"):
        prefill_attention(q, k, v, lens, implementation="pallas", block_k=8)
    with pytest.raises(ValueError, match="chunk=0 must be >= 1"):
        prefill_attention(q, k, v, lens, implementation="xla", chunk=0)
    with pytest.raises(ValueError, match="square tiles: block_k=16 must be None or block_q"):
        prefill_attention(q, k, v, lens, implementation="blocked", block_q=32, block_k=16)
    with pytest.raises(ValueError, match="block_q=0 must be >= 1"):
        prefill_attention(q, k, v, lens, implementation="blocked", block_q=0)
    with pytest.raises(TypeError, match="unknown tuning keywords"):
        prefill_attention(q, k, v, lens, block_m=64)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        prefill_attention(q.astype(jnp.float16), k.astype(jnp.float16), v.astype(jnp.float16),
                          lens, implementation="xla")


# --------------------------------------------------------------------------------------------
# Triton lowering without a GPU: lower for an abstract H200 and check the custom call appears.
# --------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the GPU test compiles the real thing")
@pytest.mark.parametrize("B,T,Hq,H,D,dtype,tuning", [
    (1, 4096, 32, 8, 128, jnp.bfloat16, {}),                        # Llama-3-8B-like, defaults
    (8, 1024, 12, 2, 128, jnp.bfloat16, dict(block_q=64, block_k=128, num_warps=4, num_stages=3)),
    (2, 100, 9, 3, 64, jnp.float32, {}),                            # T % blocks, f32
])
def test_lowers_to_triton(B, T, Hq, H, D, dtype, tuning):
    from lowering import lower_for_h200
    S = jax.ShapeDtypeStruct
    f = lambda q, k, v, l: pa._pallas_impl(q, k, v, l, interpret=False, **tuning)  # noqa: E731
    txt = lower_for_h200(f, S((B, T, Hq, D), dtype), S((B, T, H, D), dtype), S((B, T, H, D), dtype),
                         S((B,), jnp.int32))
    assert "__gpu$xla.gpu.triton" in txt


# --------------------------------------------------------------------------------------------
# GPU: the compiled Triton kernel at a long prompt.
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["pallas", "cudnn", "auto"])
def test_gpu_kernel_matches_reference(implementation):
    seed = fresh_seed()
    T = 4096
    q, k, v, lens = make_case(seed, B=3, T=T, Hq=32, H=8, D=128, dtype=jnp.bfloat16,
                              lengths=[4000, 1537, 0])
    ref = prefill_attention(q, k, v, lens, implementation="xla")
    out = prefill_attention(q, k, v, lens, implementation=implementation)
    assert np.isfinite(f32(out)).all(), f"non-finite {implementation} output (seed {seed})"
    valid = np.arange(T)[None, :] < np.asarray(lens)[:, None]  # padded query rows: unspecified
    check(out, ref, jnp.bfloat16, seed, f"{implementation} vs xla on the GPU", rows=valid)
    assert not np.asarray(f32(out[2])).any(), "a length-0 prompt gets zeros"


def test_cudnn_takes_bfloat16_only():
    q, k, v, lens = make_case(fresh_seed(), B=1, T=32, Hq=2, H=1, D=16, dtype=jnp.float32)
    with pytest.raises(ValueError, match="the cudnn implementation takes bfloat16"):
        prefill_attention(q, k, v, lens, implementation="cudnn")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cuDNN is there on the GPU")
def test_auto_falls_back_to_the_kernel_without_cudnn():
    seed = fresh_seed()
    q, k, v, lens = make_case(seed, B=2, T=48, Hq=4, H=2, D=16, dtype=jnp.bfloat16, lengths=[48, 5])
    with pytest.warns(RuntimeWarning, match="cuDNN flash attention unavailable"):
        out = prefill_attention(q, k, v, lens, implementation="auto")
    check(out, prefill_attention(q, k, v, lens, implementation="pallas"), jnp.bfloat16, seed,
          "auto (Pallas fallback) vs pallas")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), T=st.integers(1, 80), H=st.sampled_from([1, 2]),
       G=st.sampled_from([1, 2, 3]), blocks=st.sampled_from([(16, 16), (32, 16), (16, 32)]),
       data=st.data())
def test_property_kernel_equals_direct_attention(B, T, H, G, blocks, data):
    """Any prompt length, lengths in [0, T], GQA ratio and block shape: the kernel (interpret
    mode) equals the direct masked attention on every row, with NaN in the padding."""
    lengths = data.draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    seed = data.draw(st.integers(0, 2 ** 31 - 1))
    q, k, v, lens = make_case(seed, B=B, T=T, Hq=G * H, H=H, D=16, dtype=jnp.float32,
                              lengths=lengths)
    want = gqa_attention(q, k, v, full_mask(T, lens))
    got = prefill_attention(q, k, v, lens, implementation="pallas", block_q=blocks[0],
                            block_k=blocks[1])
    check(got, want, jnp.float32, seed, f"pallas B={B} T={T} lengths={lengths} blocks={blocks}")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 3), T=st.integers(1, 80), H=st.sampled_from([1, 2]),
       G=st.sampled_from([1, 2, 3]), tile=st.sampled_from([1, 8, 16, 32, 128]), data=st.data())
def test_property_blocked_equals_direct_attention(B, T, H, G, tile, data):
    """Any prompt length, lengths in [0, T], GQA ratio and tile (a multiple of T or not, larger
    than T): the blocked formulation equals the direct masked attention below the longest
    prompt, with NaN in the padding."""
    lengths = data.draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    seed = data.draw(st.integers(0, 2 ** 31 - 1))
    q, k, v, lens = make_case(seed, B=B, T=T, Hq=G * H, H=H, D=16, dtype=jnp.float32,
                              lengths=lengths)
    check_blocked(q, k, v, lens, seed, f"blocked B={B} T={T} lengths={lengths} tile={tile}",
                  block_q=tile)


# ----------------------------------------------------------------------------- extend attention

def extend_case(seed, *, B, T, S, Hq, H, D):
    """Appended queries at positions start + t (count[b] of them valid) over sequences of S
    keys; keys and values past each request's last valid position are NaN."""
    rng = np.random.default_rng(seed)
    count = rng.integers(0, T + 1, size=B)
    start = np.array([rng.integers(0, S - c + 1) for c in count])
    positions = (start[:, None] + np.arange(T)[None, :]).astype(np.int32)
    valid = np.arange(T)[None, :] < count[:, None]
    q = rng.standard_normal((B, T, Hq, D)).astype(np.float32)
    k = rng.standard_normal((B, S, H, D)).astype(np.float32)
    v = rng.standard_normal((B, S, H, D)).astype(np.float32)
    last = start + count - 1
    past = np.arange(S)[None, :] > last[:, None]
    k[past], v[past] = np.nan, np.nan
    return q, k, v, positions, valid


def extend_numpy(q, k, v, positions, valid):
    """Per request, query and head: softmax over the keys at or before the query's position."""
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    out = np.zeros((B, T, Hq, D), np.float64)
    for b in range(B):
        for t in range(T):
            if not valid[b, t]:
                continue
            n = positions[b, t] + 1
            for i in range(Hq):
                s = k[b, :n, i // G].astype(np.float64) @ q[b, t, i] / np.sqrt(D)
                p = np.exp(s - s.max())
                out[b, t, i] = (p / p.sum()) @ v[b, :n, i // G]
    return out


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 3), T=st.integers(1, 24), S=st.integers(24, 90),
       H=st.sampled_from([1, 2]), G=st.sampled_from([1, 3]),
       block=st.sampled_from([4, 16, 64, 256]), data=st.data())
def test_property_extend_attention_equals_numpy(B, T, S, H, G, block, data):
    """Any start, count (0 included), GQA ratio and key block: the blocked formulation and the
    chunked reference equal the numpy attention, padding rows are zeros, and NaN past each
    request's last position is never read."""
    seed = data.draw(st.integers(0, 2 ** 31 - 1))
    q, k, v, pos, valid = extend_case(seed, B=B, T=T, S=S, Hq=G * H, H=H, D=16)
    want = extend_numpy(q, k, v, pos, valid)
    args = [jnp.asarray(a) for a in (q, k, v, pos, valid)]
    blocked = pa.extend_attention_blocked(*args, block=block)
    xla = pa.extend_attention_xla(*args, max_scores=B * G * H * S * 5)   # chunks of 5 queries
    for got, what in ((blocked, f"blocked {block}"), (xla, "xla")):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5,
                                   err_msg=f"{what} B={B} T={T} S={S} (seed {seed})")


def test_extend_attention_defaults_and_checks():
    q, k, v, pos, valid = (jnp.asarray(a) for a in extend_case(fresh_seed(), B=2, T=8, S=40,
                                                                Hq=4, H=2, D=16))
    want = pa.extend_attention_xla(q, k, v, pos, valid)
    if jax.default_backend() != "gpu":   # the CPU default is the blocked formulation
        assert _common.resolve(pa.OP_EXTEND) is pa.extend_attention_blocked
    # the engine's "pallas" names no implementation of this op: the backend's default
    got = pa.extend_attention(q, k, v, pos, valid, implementation="pallas")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="positions"):
        pa.extend_attention(q, k, v, pos[:, :3], valid)
