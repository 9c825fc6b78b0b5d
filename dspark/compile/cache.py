"""A file of torch.compile's compiled code (Inductor's Mega-Cache: the FX-graph, AOTAutograd, Triton
and autotuning entries of everything compiled in this process), so a server starts on code that a
warm-up compiled before.

The file is one JSON line naming what the code was compiled for (torch and triton versions, the
device, and the options the compiled step is specialized to: models, K, batch, cache length), then
the bytes of torch.compiler.save_cache_artifacts(). Code compiled for one version, device or set of
options is useless for another (torch finds out silently, and compiles again): loading such a file
raises an error that names what differs.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import triton


def compiled_for(device: torch.device, options: dict | None = None) -> dict:
    """What compiled code depends on: the versions, the device (the GPU's name on CUDA) and the
    caller's `options` (JSON values)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {"torch": torch.__version__, "triton": triton.__version__, "device": name, **(options or {})}


def save_compile_cache(path: Path, device: torch.device, options: dict | None = None) -> int:
    """Writes everything compiled so far in this process to `path`, marked as compiled for
    `device` and `options`; returns the artifacts' bytes."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        raise RuntimeError("nothing has been compiled in this process: no compile cache to save")
    artifacts, _ = saved
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")  # a warm-up killed while writing leaves no cut file behind
    with tmp.open("wb") as f:
        f.write(json.dumps(compiled_for(device, options)).encode() + b"\n")
        f.write(artifacts)
    os.replace(tmp, path)
    return len(artifacts)


def load_compile_cache(path: Path, device: torch.device, options: dict | None = None) -> None:
    """Loads a file of save_compile_cache before anything compiles; ValueError, naming what
    differs, if it was made for other versions, another device or other options."""
    with Path(path).open("rb") as f:
        header, artifacts = f.readline(), f.read()
    try:
        made_for = json.loads(header)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not a dspark compile cache (its first line is not JSON)") from error
    if not isinstance(made_for, dict):
        raise ValueError(f"{path} is not a dspark compile cache (its first line is not a JSON object)")
    here = compiled_for(device, options)
    differ = {key: (made_for.get(key), here[key]) for key in here if made_for.get(key) != here[key]}
    if differ:
        raise ValueError(f"{path} holds code compiled for other {', '.join(differ)} (the file's, this "
                         f"process's: {differ}): run python -m dspark.compile.warmup with this process's "
                         f"options to make one")
    try:
        loaded = torch.compiler.load_cache_artifacts(artifacts)
    except Exception as error:  # noqa: BLE001 - torch's deserializer raises many kinds
        raise ValueError(f"{path}: its compiled code does not load ({type(error).__name__}: {error})") from None
    if loaded is None:  # torch only logs a warning for bytes it cannot read
        raise ValueError(f"{path}: its compiled code does not load (cut or damaged): run the warm-up again")
