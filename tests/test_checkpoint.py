"""DeepSpec-format drafter checkpoints: save / load round trips, spellings, and strict errors."""
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.checkpoint import load_drafter, save_drafter
from dspark.config import DrafterConfig, TargetConfig
from dspark.drafter import DSparkDrafter
from dspark.target import TargetModel
from paging import paged_caches

TARGET = TargetConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2)


def make_target(config=TARGET):
    torch.manual_seed(0)
    return TargetModel(config)


def make_config(**overrides):
    settings = dict(num_hidden_layers=2, block_size=3, target_layer_ids=[0, 2], mask_token_id=79,
                    markov_rank=8, enable_confidence_head=True)
    return DrafterConfig.for_target(TARGET, **{**settings, **overrides})


def make_drafter(target=None, **overrides):
    torch.manual_seed(1)
    shared = {} if target is None else dict(embed_tokens=target.embed_tokens, lm_head=target.lm_head)
    return DSparkDrafter(make_config(**overrides), **shared)


@torch.no_grad()
def outputs(drafter):
    """Everything the decoder reads from a drafter: base logits, hidden, Markov bias, confidence."""
    g = torch.Generator().manual_seed(2)
    table = paged_caches(drafter, [16, 16])
    drafter.append_context(torch.randn(2, 10, 64, generator=g), torch.arange(10).expand(2, 10), table)
    anchor = torch.tensor([3, 5])
    logits, hidden = drafter.forward_block(anchor, torch.tensor([6, 10]), table)
    prev = drafter.markov_head.markov_w1(anchor)[:, None].expand(-1, 3, -1)
    return logits, hidden, drafter.markov_head.bias(prev, hidden, None)[0], drafter.confidence(hidden, prev)


def assert_same_outputs(a, b):
    for x, y in zip(outputs(a), outputs(b)):
        assert torch.equal(x, y)


def test_round_trip_sharing_the_targets_embeddings(tmp_path):
    target = make_target()
    drafter = make_drafter(target, sliding_window=4)
    save_drafter(drafter, tmp_path)
    assert not {"embed_tokens.weight", "lm_head.weight"} & set(load_file(tmp_path / "model.safetensors"))

    loaded = load_drafter(tmp_path, target)
    assert loaded.config == drafter.config
    assert loaded.embed_tokens is target.embed_tokens and loaded.lm_head is target.lm_head
    assert_same_outputs(loaded, drafter)


def test_a_config_without_a_key_takes_hfs_default_as_a_targets_does(tmp_path):
    """No rms_norm_eps: 1e-6; no num_key_value_heads: as many as the attention heads (the class's
    test defaults, 1e-5 and 2, were taken)."""
    target = make_target()
    drafter = make_drafter(target, rms_norm_eps=1e-6, num_key_value_heads=4)
    save_drafter(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("rms_norm_eps", "num_key_value_heads"):
        del config[key]
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_drafter(tmp_path, target)
    assert loaded.config == drafter.config
    assert_same_outputs(loaded, drafter)


def test_the_config_names_deepspecs_model_class(tmp_path):
    save_drafter(make_drafter(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"


def test_round_trip_with_own_embeddings(tmp_path):
    target = make_target()
    drafter = make_drafter(markov_head_type="gated")
    save_drafter(drafter, tmp_path)
    loaded = load_drafter(tmp_path, target)
    assert loaded.embed_tokens is not target.embed_tokens
    assert torch.equal(loaded.lm_head.weight, drafter.lm_head.weight)
    assert_same_outputs(loaded, drafter)


def test_loads_in_the_asked_dtype_with_float32_rope(tmp_path):
    target = make_target()
    save_drafter(make_drafter(), tmp_path)
    loaded = load_drafter(tmp_path, target, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert loaded.rotary.inv_freq.dtype == torch.float32 and loaded.rotary.inv_freq.device.type == "cpu"


def test_a_drafter_sharing_the_targets_modules_loads_only_in_their_dtype(tmp_path):
    target = make_target()
    save_drafter(make_drafter(target), tmp_path)  # shares the target's embedding and LM head
    with pytest.raises(ValueError, match="shares the target's embedding and LM head, torch.float32"):
        load_drafter(tmp_path, target, dtype=torch.bfloat16)  # once: a float / bfloat16 matmul error later


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_a_config_that_is_no_json_object_is_named(tmp_path, text):
    save_drafter(make_drafter(), tmp_path)
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match="config.json: "):
        load_drafter(tmp_path, make_target())


def test_an_index_names_the_drafters_files(tmp_path):
    """A stray *.safetensors beside an index is not read (every file in the folder once was, and its
    tensors clashed with the drafter's)."""
    target = make_target()
    drafter = make_drafter(target)
    save_drafter(drafter, tmp_path)
    names = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(names, "model.safetensors")}))
    save_file(names, tmp_path / "old-copy.safetensors")
    assert_same_outputs(load_drafter(tmp_path, target), drafter)


def test_saving_over_another_checkpoints_files_is_refused(tmp_path):
    """An index (or other shards) left in the folder would be read instead of (or with) the file
    saved: the old weights under the new config, once, without a word."""
    target = make_target()
    save_drafter(make_drafter(target), tmp_path)
    names = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors")}))
    save_file(names, tmp_path / "model-00001-of-00001.safetensors")
    with pytest.raises(FileExistsError, match=r"another checkpoint's files \['model-00001-of-00001.safetensors', "
                                              r"'model.safetensors.index.json'\]"):
        save_drafter(make_drafter(target), tmp_path)
    save_drafter(make_drafter(target), tmp_path / "fresh")  # a folder of its own: saved
    save_drafter(make_drafter(target), tmp_path / "fresh")  # and again over its own file


@pytest.mark.parametrize("switch", [{"use_sliding_window": True}, {"dflash_config": {"use_swa": True}},
                                    {"layer_types": ["sliding_attention"] * 2}])
def test_a_sliding_window_switched_on_without_a_size_is_refused(tmp_path, switch):
    """It once loaded as a drafter attending to the whole context, unlike the one trained."""
    save_drafter(make_drafter(), tmp_path)
    config = {k: v for k, v in json.loads((tmp_path / "config.json").read_text()).items()
              if k not in ("sliding_window", "use_sliding_window")}
    (tmp_path / "config.json").write_text(json.dumps({**config, **switch}))
    with pytest.raises(ValueError, match="config.json: the sliding window is switched on, but neither"):
        load_drafter(tmp_path, make_target())


@pytest.mark.parametrize("change, words", [(dict(markov_rank=-1), "markov_rank must be >= 0"),
                                           (dict(sliding_window=0), "sliding_window must be >= 1")])
def test_a_drafter_config_out_of_range_is_refused_naming_the_field(tmp_path, change, words):
    save_drafter(make_drafter(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match="config.json: " + words):
        load_drafter(tmp_path, make_target())


def write_deepspec_folder(folder, drafter, config_update, renames=None):
    """A checkpoint as another tool writes it: config keys spelled its way, tensors renamed."""
    save_drafter(drafter, folder)
    config = {k: v for k, v in json.loads((folder / "config.json").read_text()).items()
              if k not in {"block_size", "target_layer_ids", "mask_token_id", "markov_rank",
                           "enable_confidence_head", "sliding_window", "use_sliding_window"}}
    (folder / "config.json").write_text(json.dumps({**config, **config_update}))
    tensors = load_file(folder / "model.safetensors")
    save_file({(renames or {}).get(k, k): v for k, v in tensors.items()}, folder / "model.safetensors")


@pytest.mark.parametrize("spelling", [
    {"dflash_config": {"block_size": 3, "target_layer_ids": [0, 2], "mask_token_id": 79, "markov_rank": 8,
                       "use_confidence_head": True}},
    {"dspark_config": {"block_size": 3, "markov_rank": 8}, "dspark_target_layer_ids": [0, 2],
     "dspark_noise_token_id": 79, "enable_confidence_head": True},
    # speculators' aux ids are vLLM's: the input of layer i, DeepSpec's i - 1
    {"block_size": 3, "aux_hidden_state_layer_ids": [1, 3], "mask_token_id": 79, "dspark_markov_rank": 8,
     "use_confidence_head": True, "sliding_window": 4096, "use_sliding_window": False},
])
def test_deepspec_config_spellings_load(tmp_path, spelling):
    target = make_target()
    drafter = make_drafter(target)
    write_deepspec_folder(tmp_path, drafter, spelling)
    loaded = load_drafter(tmp_path, target)
    assert loaded.config == drafter.config
    assert_same_outputs(loaded, drafter)


def test_dflash_format_head_tensors_and_window_switch_load(tmp_path):
    target = make_target()
    drafter = make_drafter(target, sliding_window=5)
    renames = {"markov_head.markov_w1.weight": "markov_w1.weight",
               "markov_head.markov_w2.weight": "markov_w2.weight",
               "confidence_head.proj.weight": "confidence_proj.weight",
               "confidence_head.proj.bias": "confidence_proj.bias"}
    dflash_config = {"block_size": 3, "target_layer_ids": [0, 2], "mask_token_id": 79, "markov_rank": 8,
                     "use_confidence_head": True, "use_swa": True, "swa_window_size": 5}
    # the target's HF keys, copied beside it, once switched the draft's window off
    write_deepspec_folder(tmp_path, drafter, {"dflash_config": dflash_config, "use_sliding_window": False,
                                              "layer_types": ["full_attention"] * 2}, renames)
    loaded = load_drafter(tmp_path, target)
    assert loaded.config.sliding_window == 5
    assert_same_outputs(loaded, drafter)


def edit_tensors(folder, edit):
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_missing_tensor_is_named(tmp_path):
    save_drafter(make_drafter(), tmp_path)
    edit_tensors(tmp_path, lambda t: t.pop("layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'layers\.1\.self_attn\.k_norm\.weight'"):
        load_drafter(tmp_path, make_target())


def test_unexpected_tensor_is_named_with_its_file(tmp_path):
    save_drafter(make_drafter(), tmp_path)
    edit_tensors(tmp_path, lambda t: t.update({"layers.2.mlp.up_proj.weight": torch.zeros(64, 32)}))
    with pytest.raises(ValueError, match=r"model\.safetensors: unexpected tensor 'layers\.2\.mlp\.up_proj"):
        load_drafter(tmp_path, make_target())


def test_a_stored_mask_embedding_is_left_out_as_vllm_leaves_it(tmp_path):
    target = make_target()
    drafter = make_drafter(target)
    save_drafter(drafter, tmp_path)
    edit_tensors(tmp_path, lambda t: t.update({"mask_embedding": torch.ones(1, 32)}))
    assert_same_outputs(load_drafter(tmp_path, target), drafter)


def test_misshapen_tensor_is_named_with_its_file(tmp_path):
    save_drafter(make_drafter(), tmp_path)
    edit_tensors(tmp_path, lambda t: t.update({"fc.weight": torch.zeros(32, 96)}))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'fc\.weight' has shape \(32, 96\), "
                                         r"expected \(32, 64\)"):
        load_drafter(tmp_path, make_target())


@pytest.mark.parametrize("drafter_change, target_change, message", [
    ({}, dict(vocab_size=81), "vocab_size 80 does not match the target's 81"),
    ({}, dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2),
     "hidden_size 32 does not match the target's 48"),
    ({}, dict(num_hidden_layers=5), "num_target_layers 4 does not match the target's 5 layers"),
    (dict(mask_token_id=80), {}, r"mask_token_id 80 is outside the vocabulary \[0, 80\)"),
])
def test_config_that_does_not_fit_the_target_is_refused(tmp_path, drafter_change, target_change, message):
    save_drafter(make_drafter(**drafter_change), tmp_path)
    target = make_target(TargetConfig(**{**TARGET.to_dict(), "head_dim": None, **target_change}))
    with pytest.raises(ValueError, match=r"config\.json: " + message):
        load_drafter(tmp_path, target)


@pytest.mark.parametrize("layer_ids, num_target_layers", [
    ([0, 3], 4),  # DeepSpec never feeds the drafter the target's last layer
    ([0, 3], None),  # without num_target_layers, checked against the target's layers
    ([-2, 1], None),  # -1 (the embeddings) is the lowest
])
def test_target_layer_ids_outside_the_target_are_refused(tmp_path, layer_ids, num_target_layers):
    save_drafter(make_drafter(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(target_layer_ids=layer_ids, num_target_layers=num_target_layers)
    (tmp_path / "config.json").write_text(json.dumps(config))
    message = f"config.json: target_layer_ids {layer_ids} are out of range for a 4-layer target"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_drafter(tmp_path, make_target())


def test_embedding_output_is_a_valid_target_layer(tmp_path):
    drafter = make_drafter(target_layer_ids=[-1, 2])
    save_drafter(drafter, tmp_path)
    assert_same_outputs(load_drafter(tmp_path, make_target()), drafter)
