"""DSpark drafter checkpoints in DeepSpec's format: a folder with config.json and *.safetensors, tensor
names as in DeepSpec's `Qwen3DSparkModel` (fc, hidden_norm, layers.{i}.*, norm, embed_tokens, lm_head,
markov_head.*, confidence_head.proj.*). DFlash-format DSpark drafts name the heads' tensors
`markov_w1.weight`, `markov_w2.weight` and `confidence_proj.*` at top level; those load too.

A checkpoint without embed_tokens / lm_head (z-lab style) shares the target's. Loading is strict:
a missing, unexpected (a stored mask_embedding aside, which vLLM's loader ignores too) or misshapen
tensor, or a config that does not fit the target, raises an error naming the file and the tensor or
key.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dspark.config import DrafterConfig
from dspark.drafter import DSparkDrafter
from dspark.target import TargetModel
from dspark.weights import INDEX, StoredTensors, read_safetensors, read_state

CHECKPOINT_FILE = "model.safetensors"
_TENSOR_ALIASES = {
    "markov_w1.weight": "markov_head.markov_w1.weight",
    "markov_w2.weight": "markov_head.markov_w2.weight",
    "confidence_proj.weight": "confidence_head.proj.weight",
    "confidence_proj.bias": "confidence_head.proj.bias",
}


def load_drafter(path: str | Path, target: TargetModel, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None) -> DSparkDrafter:
    """Loads a DeepSpec-format drafter for `target`, in the target's dtype and device unless given."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder}: no config.json")
    config = _read_config(config_file)
    try:
        config.check_fits(target.config)
    except ValueError as e:
        raise ValueError(f"{config_file}: {e}") from None
    tensors = _read_tensors(folder)

    reference = target.embed_tokens.weight
    dtype = dtype or reference.dtype
    device = torch.device(device) if device is not None else reference.device
    shared = {name: getattr(target, name) for name in ("embed_tokens", "lm_head") if f"{name}.weight" not in tensors}
    if shared and (dtype != reference.dtype or device.type != reference.device.type
                   or device.index not in (None, reference.device.index)):
        raise ValueError(f"{folder}: the drafter shares the target's embedding and LM head, {reference.dtype} on "
                         f"{reference.device}: it cannot load as {dtype} on {device} (load the target so)")
    with torch.device("meta"):  # no random init: every own parameter is replaced below
        drafter = DSparkDrafter(config, **shared)
    shapes = {name: t.shape for name, t in _own_state(drafter).items()}
    state = read_state(shapes, tensors, folder, dtype, device)
    drafter.load_state_dict(state, strict=False, assign=True)
    drafter.rotary.reset(device)  # a buffer, not in checkpoints: still on meta
    return drafter


def save_drafter(drafter: DSparkDrafter, path: str | Path) -> None:
    """Writes config.json and model.safetensors. Embeddings / lm_head shared with the target are
    not written; loading shares the target's again."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    others = sorted(f.name for f in folder.iterdir() if f.name == INDEX or
                    (f.suffix == ".safetensors" and f.name != CHECKPOINT_FILE))
    if others:  # a loader would read them (an index first) with or instead of the file written here
        raise FileExistsError(f"{folder} holds another checkpoint's files {others}: save into another folder "
                              "or remove them")
    config = {**_hf_identity(drafter.config), **drafter.config.to_dict(),
              "use_sliding_window": drafter.config.sliding_window is not None}
    state = {name: t.detach().clone() for name, t in _own_state(drafter).items()}  # packed weights' parts are views
    for name, write in (("config.json", lambda file: file.write_text(json.dumps(config, indent=2) + "\n")),
                        (CHECKPOINT_FILE, lambda file: save_file(state, str(file)))):
        tmp = folder / (name + ".tmp")  # a reader never meets a half-written file
        write(tmp)
        os.replace(tmp, folder / name)


def _hf_identity(config: DrafterConfig) -> dict[str, Any]:
    """The keys by which HF-style loaders (vLLM's among them) pick a model class: DeepSpec's class
    name for a Qwen3-style drafter."""
    identity = {"model_type": config.architecture}
    if config.architecture == "qwen3":
        identity["architectures"] = ["Qwen3DSparkModel"]
    return identity


def _own_state(drafter: DSparkDrafter) -> dict[str, torch.Tensor]:
    """The drafter's state dict without the modules it shares with the target."""
    return {name: t for name, t in drafter.state_dict().items()
            if name.split(".", 1)[0] not in drafter.shared_modules}


def _read_config(config_file: Path) -> DrafterConfig:
    try:
        raw = json.loads(config_file.read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"a config is a JSON object, not {type(raw).__name__}")
        return dataclasses.replace(DrafterConfig.from_dict(raw), sliding_window=_sliding_window(raw))
    except (TypeError, ValueError) as e:  # json's errors are ValueErrors
        raise ValueError(f"{config_file}: {e}") from None


def _sliding_window(raw: dict[str, Any]) -> int | None:
    """The window, honouring the switches that HF and DFlash configs keep next to the size: HF's
    `sliding_window` is often set while `use_sliding_window` is false; z-lab's DFlash drafts use
    dflash_config.{use_swa, swa_window_size}, which decides where present (the HF keys beside it
    may be the target's); `layer_types` lists "sliding_attention" layers."""
    d = {**raw, **(raw.get("dflash_config") or {}), **(raw.get("dspark_config") or {})}
    if "use_swa" in d:  # the draft's own switch: HF's keys beside it may describe the target's layers
        switches = [bool(d["use_swa"])]
    else:
        switches = [bool(d["use_sliding_window"])] if "use_sliding_window" in d else []
        if "layer_types" in d:
            kinds = set(d["layer_types"])
            if len(kinds) > 1:
                raise ValueError(f"layer_types mixes {sorted(kinds)}; one attention kind for all layers is supported")
            switches.append(kinds == {"sliding_attention"})
    if not all(switches):
        return None
    window = next((d[key] for key in ("swa_window_size", "sliding_window") if d.get(key) is not None), None)
    if window is None and switches:  # else the drafter would attend to all the context, unlike its training
        raise ValueError("the sliding window is switched on, but neither swa_window_size nor sliding_window "
                         "gives its size")
    return window


def _read_tensors(folder: Path) -> StoredTensors:
    """Drafter tensor name (DFlash aliases resolved) -> (file, function that reads it). A stored
    mask_embedding is left out, as vLLM's DSpark loader leaves it: the mask slots embed mask_token_id."""
    tensors = read_safetensors(folder, rename=lambda source: _TENSOR_ALIASES.get(source, source))
    return {name: stored for name, stored in tensors.items() if "mask_embedding" not in name}
