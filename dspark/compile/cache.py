"""A file of torch.compile's compiled code (Inductor's Mega-Cache: the FX-graph, AOTAutograd, Triton
and autotuning entries of everything compiled in this process), so a server starts on code that a
warm-up compiled before.

The file is one JSON line naming what the code was compiled for (torch and triton versions, the
device), then the bytes of torch.compiler.save_cache_artifacts(). Code compiled for one version or
device is useless for another (torch checks it too, silently): loading such a file raises an error
that names both.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import triton


def compiled_for(device: torch.device) -> dict:
    """What compiled code depends on: the versions and the device (the GPU's name on CUDA)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {"torch": torch.__version__, "triton": triton.__version__, "device": name}


def save_compile_cache(path: Path, device: torch.device) -> int:
    """Writes everything compiled so far in this process to `path`; returns the artifacts' bytes."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        raise RuntimeError("nothing has been compiled in this process: no compile cache to save")
    artifacts, _ = saved
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        f.write(json.dumps(compiled_for(device)).encode() + b"\n")
        f.write(artifacts)
    return len(artifacts)


def load_compile_cache(path: Path, device: torch.device) -> None:
    """Loads a file of save_compile_cache before anything compiles; ValueError if it was made for
    other versions or another device."""
    with Path(path).open("rb") as f:
        header, artifacts = f.readline(), f.read()
    try:
        made_for = json.loads(header)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not a dspark compile cache (its first line is not JSON)") from error
    here = compiled_for(device)
    if made_for != here:
        raise ValueError(f"{path} holds code compiled for {made_for}, this process runs {here}: "
                         f"run python -m dspark.compile.warmup here to make one")
    torch.compiler.load_cache_artifacts(artifacts)
