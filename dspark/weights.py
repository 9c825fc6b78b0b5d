"""Strict reading of stored tensors into a state dict, shared by the target's and the drafter's
loaders: a missing, unexpected or misshapen tensor raises an error naming the file and the tensor.
Also the parse of a GGUF file, which the target's and the tokenizer's loaders share."""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Callable

import gguf
import torch
from safetensors import SafetensorError, safe_open

# A checkpoint's tensors: stored name -> (the file it is in, for messages; function that reads it).
StoredTensors = dict[str, tuple[str | Path, Callable[[], torch.Tensor]]]


def gguf_reader(path: Path) -> gguf.GGUFReader:
    """The parsed GGUF file; a ValueError naming `path` if it is none."""
    try:
        return gguf.GGUFReader(path)
    except ValueError as e:  # the gguf package's "GGUF magic invalid" names no file
        raise ValueError(f"{path}: not a GGUF file ({e})") from None


def read_state(shapes: dict[str, torch.Size], stored: StoredTensors, where: str | Path,
               dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Reads exactly the tensors `shapes` names (stored name -> the shape the model expects) into
    `dtype` on `device`, each in its own memory rather than a view into the file's buffer."""
    missing = sorted(set(shapes) - set(stored))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{where}: missing tensor {missing[0]!r}{more}")
    unexpected = sorted(set(stored) - set(shapes))
    if unexpected:
        raise ValueError(f"{stored[unexpected[0]][0]}: unexpected tensor {unexpected[0]!r}")
    state = {}
    for name, shape in shapes.items():
        file, read = stored[name]
        tensor = read()
        if tensor.shape != shape:
            raise ValueError(f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
        state[name] = tensor.to(device=device, dtype=dtype, copy=True)
    return state


INDEX = "model.safetensors.index.json"


def read_safetensors(folder: Path, rename: Callable[[str], str] | None = None) -> StoredTensors:
    """The tensors of the files that `folder`'s INDEX maps to (without one: every *.safetensors
    file there), each under `rename(its stored name)`, read lazily. No file, a listed file that is
    absent, a name in two files or an index without a weight map raises an error naming them."""
    index = folder / INDEX
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index with a weight_map ({e!r})") from None
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    tensors: StoredTensors = {}
    for file in files:
        path = folder / file
        if not path.is_file():
            raise FileNotFoundError(f"{folder}: no {file}")
        try:
            handle = safe_open(path, framework="pt")
        except SafetensorError as e:
            raise ValueError(f"{path}: not a safetensors file ({e})") from None
        for source in handle.keys():
            name = source if rename is None else rename(source)
            if name in tensors:
                raise ValueError(f"{path}: tensor {source!r} is also in {tensors[name][0]}")
            tensors[name] = (path, partial(handle.get_tensor, source))
    return tensors
