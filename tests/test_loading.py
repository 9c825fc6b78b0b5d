"""load_target: tiny random models written as HF folders (single file and sharded) and as GGUF
files (F32 and quantized, q/k in llama.cpp's rotary layout) load back to the same logits; bad
inputs raise errors naming the file and the tensor."""
import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import save_file

from dspark.config import TargetConfig
from dspark.loading import fast_dtype, load_target
from dspark.target import TargetModel

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def make_model(architecture="llama", tie_word_embeddings=True, **overrides) -> TargetModel:
    torch.manual_seed(0)
    shapes = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=500000.0)
    config = TargetConfig(architecture=architecture, tie_word_embeddings=tie_word_embeddings, **{**shapes, **overrides})
    model = TargetModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    return model


def logits_of(model: TargetModel) -> torch.Tensor:
    tokens = torch.arange(0, 96, 7)[None]
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1])[None])[0]


# ---- HF folders ----

def hf_state_dict(model: TargetModel) -> dict[str, torch.Tensor]:
    return {(k if k.startswith("lm_head.") else "model." + k): v.clone()
            for k, v in model.state_dict().items()
            if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}


def save_hf(model: TargetModel, folder, shards: int = 1, dtype=torch.float32):
    folder.mkdir(exist_ok=True)
    config = {k: v for k, v in model.config.to_dict().items() if k != "architecture"}
    config["model_type"] = model.config.architecture
    (folder / "config.json").write_text(json.dumps(config))
    state = {k: v.to(dtype) for k, v in hf_state_dict(model).items()}
    if shards == 1:
        save_file(state, folder / "model.safetensors")
        return
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: state[n] for n in part}, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("architecture,tied,shards", [("llama", True, 1), ("llama", False, 3), ("qwen3", False, 2)])
def test_hf_folder_loads_to_the_same_logits(tmp_path, architecture, tied, shards):
    model = make_model(architecture, tied)
    save_hf(model, tmp_path / "m", shards)
    loaded = load_target(tmp_path / "m")
    assert loaded.config == model.config
    assert (loaded.lm_head.weight is loaded.embed_tokens.weight) == tied
    torch.testing.assert_close(logits_of(loaded), logits_of(model), atol=0, rtol=0)


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_attention_bias_gives_every_attention_projection_a_bias_as_in_hf(tmp_path, architecture):
    """HF's Llama and Qwen3 give o_proj a bias too when attention_bias is set: such a folder was refused
    for an unexpected o_proj.bias."""
    model = make_model(architecture, attention_bias=True)
    assert {f"model.layers.1.self_attn.{p}_proj.bias" for p in "qkvo"} <= set(hf_state_dict(model))
    save_hf(model, tmp_path / "m")
    torch.testing.assert_close(logits_of(load_target(tmp_path / "m")), logits_of(model), atol=0, rtol=0)


def test_hf_folder_in_bfloat16_loads_in_the_requested_dtype(tmp_path):
    model = make_model()
    save_hf(model, tmp_path / "m", dtype=torch.bfloat16)
    loaded = load_target(tmp_path / "m", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    assert loaded.rotary.inv_freq.dtype == torch.float32
    reference = make_model().to(torch.bfloat16)
    torch.testing.assert_close(logits_of(loaded), logits_of(reference), atol=0, rtol=0)


def test_hf_llama3_rope_scaling_is_read_from_config(tmp_path):
    model = make_model(rope_scaling=LLAMA3_SCALING)
    save_hf(model, tmp_path / "m")
    loaded = load_target(tmp_path / "m")
    assert loaded.config.rope_scaling == LLAMA3_SCALING
    torch.testing.assert_close(logits_of(loaded), logits_of(model), atol=0, rtol=0)


def test_an_hf_config_without_a_key_takes_hfs_default(tmp_path):
    """No tie_word_embeddings: HF's default, untied (once tied, dropping the stored LM head); no
    num_key_value_heads: as many as the attention heads; no rms_norm_eps: 1e-6."""
    model = make_model(tie_word_embeddings=False, num_key_value_heads=4, rms_norm_eps=1e-6)
    save_hf(model, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    for key in ("tie_word_embeddings", "num_key_value_heads", "rms_norm_eps"):
        del config[key]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    loaded = load_target(tmp_path / "m")
    assert loaded.config == model.config and loaded.lm_head.weight is not loaded.embed_tokens.weight
    torch.testing.assert_close(logits_of(loaded), logits_of(model), atol=0, rtol=0)


def test_a_config_of_a_few_keys_is_a_small_llama():
    """DESIGN: from_dict fills sensible defaults for the keys a small test leaves out (it once
    refused a dict that named no architecture)."""
    config = TargetConfig.from_dict({"vocab_size": 64, "hidden_size": 32})
    assert (config.architecture, config.vocab_size, config.hidden_size, config.head_dim) == ("llama", 64, 32, 8)
    assert TargetConfig.from_dict({"architectures": ["Qwen3ForCausalLM"]}).architecture == "qwen3"


@pytest.mark.parametrize("change, words", [({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
                                           ({"model_type": None, "architectures": ["GPT2LMHeadModel"]},
                                            "GPT2LMHeadModel"),
                                           ({"model_type": None, "architectures": ["Qwen2ForCausalLM"]},
                                            "Qwen2ForCausalLM"),
                                           ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
                                            "unsupported rope_scaling type 'yarn'"),
                                           ({"rope_scaling": {"rope_type": "llama3"}}, "needs a 'factor'"),
                                           ({"use_sliding_window": True, "sliding_window": 32}, "sliding-window"),
                                           ({"layer_types": ["sliding_attention", "full_attention"]},
                                            "sliding-window")])
def test_an_hf_config_of_a_model_dspark_does_not_run_is_refused(tmp_path, change, words):
    save_hf(make_model(), tmp_path / "m")
    config = {**json.loads((tmp_path / "m" / "config.json").read_text()), **change}
    (tmp_path / "m" / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    with pytest.raises(ValueError, match=f"config.json: .*{words}"):
        load_target(tmp_path / "m")


@pytest.mark.parametrize("file, text", [("model.safetensors", b"xx"), ("model.safetensors.index.json", b"{}"),
                                        ("model.safetensors.index.json", b"[not json")])
def test_a_corrupt_weights_file_is_named(tmp_path, file, text):
    save_hf(make_model(), tmp_path / "m")
    (tmp_path / "m" / file).write_bytes(text)
    with pytest.raises(ValueError, match=f"{file}: not a safetensors"):
        load_target(tmp_path / "m")


def test_a_file_that_is_no_gguf_is_named(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"x" * 32)
    with pytest.raises(ValueError, match=r"m\.gguf: not a GGUF file"):
        load_target(tmp_path / "m.gguf")


# ---- GGUF files ----

GGUF_NAMES = {  # ours -> llama.cpp's
    "embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def gguf_name(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "layers":
        return f"blk.{parts[1]}.{GGUF_NAMES['.'.join(parts[2:-1])]}.{parts[-1]}"
    return f"{GGUF_NAMES[parts[0]]}.{parts[-1]}"


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    # what llama.cpp's convert_hf_to_gguf.py does to llama's q/k weights (LlamaModel.permute)
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_divisors(config: TargetConfig) -> np.ndarray:
    # llama.cpp's `rope_freqs` tensor for Llama 3 scaling (LlamaModel.generate_extra_tensors)
    s = config.rope_scaling
    freqs = 1.0 / config.rope_theta ** (np.arange(0, config.head_dim, 2) / config.head_dim)
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    divisors = []
    for wavelen in 2 * np.pi / freqs:
        if wavelen < high_wavelen:
            divisors.append(1.0)
        elif wavelen > low_wavelen:
            divisors.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            divisors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(divisors, dtype=np.float32)


def save_gguf(model: TargetModel, path, qtype=GGMLQuantizationType.F32, architecture=None, drop=(), rope_freqs=None):
    """Writes `model` as llama.cpp would; matrices in `qtype`, norms in F32. Returns the state
    dict as the file holds it after quantization (HF layout), to load into a reference model."""
    c = model.config
    writer = GGUFWriter(str(path), architecture or c.architecture)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_rope_dimension_count(c.head_dim)
    if c.architecture == "qwen3":
        writer.add_key_length(c.head_dim)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    held = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w = tensor.numpy()
        if w.ndim == 2 and qtype != GGMLQuantizationType.F32:
            w = dequantize(quantize(w, qtype), qtype)
        held[name] = torch.from_numpy(w.copy())
        if c.architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = llama_cpp_permute(w, c.num_attention_heads if "q_proj" in name else c.num_key_value_heads)
        if gguf_name(name) in drop:
            continue
        if w.ndim == 2 and qtype != GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), w)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if c.tie_word_embeddings:
        held["lm_head.weight"] = held["embed_tokens.weight"]
    return held


@pytest.mark.parametrize("architecture,tied,qtype", [
    ("llama", True, GGMLQuantizationType.F32),
    ("llama", False, GGMLQuantizationType.Q8_0),
    ("llama", True, GGMLQuantizationType.Q4_1),
    ("qwen3", False, GGMLQuantizationType.Q8_0),
])
def test_gguf_loads_to_the_same_logits(tmp_path, architecture, tied, qtype):
    model = make_model(architecture, tied)
    held = save_gguf(model, tmp_path / "m.gguf", qtype)
    loaded = load_target(tmp_path / "m.gguf")
    assert loaded.config.architecture == architecture
    assert loaded.config.tie_word_embeddings == tied
    assert (loaded.config.eos_token_ids, loaded.config.bos_token_id) == ([2], 1)
    reference = make_model(architecture, tied)
    reference.load_state_dict(held)
    if qtype != GGMLQuantizationType.F32:  # the quantization is visible: the reference must hold it
        assert (logits_of(reference) - logits_of(model)).abs().max() > 1e-4
    torch.testing.assert_close(logits_of(loaded), logits_of(reference), atol=1e-5, rtol=1e-5)


def test_gguf_llama3_rope_freqs_become_rope_scaling(tmp_path):
    model = make_model(rope_scaling=LLAMA3_SCALING, head_dim=32, num_attention_heads=2, num_key_value_heads=1)
    save_gguf(model, tmp_path / "m.gguf", rope_freqs=llama3_rope_divisors(model.config))
    loaded = load_target(tmp_path / "m.gguf")
    assert loaded.config.rope_scaling == LLAMA3_SCALING
    torch.testing.assert_close(logits_of(loaded), logits_of(model), atol=1e-5, rtol=1e-5)

    save_gguf(model, tmp_path / "bad.gguf", rope_freqs=np.linspace(1, 3, 16, dtype=np.float32))
    with pytest.raises(ValueError, match=r"bad\.gguf: tensor 'rope_freqs\.weight' is not Llama 3"):
        load_target(tmp_path / "bad.gguf")


# ---- errors ----

def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_target(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty: no config.json"):
        load_target(tmp_path / "empty")


def test_folder_without_safetensors(tmp_path):
    save_hf(make_model(), tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_target(tmp_path / "m")


def test_unknown_architecture(tmp_path):
    save_hf(make_model(), tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="config.json: unknown model_type 'gpt2'"):
        load_target(tmp_path / "m")
    save_gguf(make_model(), tmp_path / "m.gguf", architecture="gpt2")
    with pytest.raises(ValueError, match="m.gguf: unknown architecture 'gpt2'"):
        load_target(tmp_path / "m.gguf")


def test_missing_unexpected_and_misshapen_tensors(tmp_path):
    model = make_model(tie_word_embeddings=False)
    folder = tmp_path / "m"
    save_hf(model, folder)
    state = hf_state_dict(model)

    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_target(folder)

    state = hf_state_dict(model)
    state["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(8, 64)
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"/m/model\.safetensors: tensor 'model\.layers\.0\.self_attn\.q_proj\.weight' "
                                         r"has shape \(8, 64\), expected \(64, 64\)$"):
        load_target(folder)

    state = hf_state_dict(model)
    state["model.layers.0.self_attn.rotary.weight"] = torch.zeros(3)
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors: unexpected tensor 'model.layers.0.self_attn.rotary"):
        load_target(folder)

    save_gguf(model, tmp_path / "m.gguf", drop={"blk.1.ffn_norm.weight"})
    with pytest.raises(ValueError, match="m.gguf: missing tensor 'blk.1.ffn_norm.weight'"):
        load_target(tmp_path / "m.gguf")


def test_sharded_index_naming_a_missing_shard(tmp_path):
    save_hf(make_model(), tmp_path / "m", shards=2)
    (tmp_path / "m" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_target(tmp_path / "m")


def test_transformers5_rope_parameters_are_read(tmp_path):
    # transformers >= 5 writes rope_theta and the scaling together as `rope_parameters`
    model = make_model(rope_scaling=LLAMA3_SCALING)
    save_hf(model, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["rope_parameters"] = {**config.pop("rope_scaling"), "rope_theta": config.pop("rope_theta")}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    loaded = load_target(tmp_path / "m")
    assert (loaded.config.rope_theta, loaded.config.rope_scaling) == (500000.0, LLAMA3_SCALING)
    torch.testing.assert_close(logits_of(loaded), logits_of(model), atol=0, rtol=0)


def test_fast_dtype_is_bfloat16_on_cuda_and_on_cpus_with_bfloat16_kernels(monkeypatch):
    assert fast_dtype("cuda") is torch.bfloat16
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert fast_dtype("cpu") is torch.bfloat16
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert fast_dtype("cpu") is torch.float32
