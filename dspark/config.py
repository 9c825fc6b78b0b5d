"""Model configs. Field names are the keys people already have in their HF / DeepSpec `config.json`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

ARCHITECTURES = ("llama", "qwen3")


def _known_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in d.items() if k in names}


@dataclass
class TargetConfig:
    """A Llama-family (SmolLM2, Llama 3) or Qwen3 decoder. Small defaults, for tests."""

    architecture: str = "llama"  # "llama" | "qwen3" (qwen3 adds per-head q_norm / k_norm)
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None  # default hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # Llama 3: {"rope_type": "llama3", "factor", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.architecture!r}; supported: {ARCHITECTURES}")
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_scaling type {self.rope_type!r} (supported: llama3)")
        if self.rope_type == "llama3" and "factor" not in self.rope_scaling:
            raise ValueError(f"rope_scaling {self.rope_scaling} of type llama3 needs a 'factor'")

    @property
    def rope_type(self) -> str:
        """The rope_scaling type ("rope_type", or older configs' "type"); "default" without one."""
        scaling = self.rope_scaling or {}
        return scaling.get("rope_type", scaling.get("type")) or "default"

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "qwen3"

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TargetConfig":
        """An HF `config.json` (see _hf_defaults); a dict that names no architecture (a test's few
        keys) is a Llama."""
        d = dict(d)
        if "architecture" not in d:
            d["architecture"] = _architecture_of(d)
        windowed = d.get("use_sliding_window") and d.get("sliding_window")
        if windowed or "sliding_attention" in (d.get("layer_types") or ()):
            raise ValueError("sliding-window attention is not supported for a target (it would run as full "
                             "attention and differ past the window)")
        _hf_defaults(d)
        return cls(**_known_fields(cls, d))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _hf_defaults(d: dict[str, Any]) -> None:
    """Gives the keys an HF `config.json` leaves out HF's defaults, not this module's test defaults
    (HF's tie_word_embeddings defaults to false: a model whose config leaves it out has an LM head of
    its own); refuses an MLP other than SwiGLU."""
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (the MLP is SwiGLU: 'silu')")
    d.setdefault("tie_word_embeddings", False)
    d.setdefault("rms_norm_eps", 1e-6)
    if "num_attention_heads" in d:
        d.setdefault("num_key_value_heads", d["num_attention_heads"])
    _flatten_rope_parameters(d)


def _flatten_rope_parameters(d: dict[str, Any]) -> None:
    """transformers >= 5 saves `rope_theta` and `rope_scaling` together as `rope_parameters`."""
    rope = dict(d.get("rope_parameters") or {})
    if "rope_theta" in rope:
        d.setdefault("rope_theta", rope.pop("rope_theta"))
    if rope.get("rope_type", "default") != "default" and not d.get("rope_scaling"):
        d["rope_scaling"] = rope


_HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}


def _architecture_of(d: dict[str, Any]) -> str:
    model_type = d.get("model_type")
    if model_type is None and not d.get("architectures"):
        return "llama"
    if model_type is None:
        archs = d.get("architectures") or []
        known = [_HF_ARCHITECTURES[a] for a in archs if a in _HF_ARCHITECTURES]
        if not known:
            raise ValueError(f"no model_type, and architectures {archs} name none of {sorted(_HF_ARCHITECTURES)}")
        model_type = known[0]
    if model_type not in ARCHITECTURES:
        raise ValueError(f"unknown model_type {model_type!r}; supported: {ARCHITECTURES}")
    return model_type


# DeepSpec / DFlash / TRT-LLM spell the DSpark switches several ways: a nested `dspark_config` or
# `dflash_config`, a top-level `dspark_X`, or a top-level `X`.
_DRAFTER_ALIASES = {"use_confidence_head": "enable_confidence_head", "max_draft_len": "block_size",
                    "noise_token_id": "mask_token_id"}
# speculators' (vLLM's) aux hidden state id i is the input of target layer i, the output of layer
# i - 1: DeepSpec's id i - 1.
_AUX_LAYER_IDS = "aux_hidden_state_layer_ids"


@dataclass
class DrafterConfig(TargetConfig):
    """A DSpark drafter: Qwen3-style layers with KV injection of fused target features, a
    non-causal block of `block_size` slots (anchor = first prediction slot), a low-rank Markov
    head and an optional confidence head."""

    architecture: str = "qwen3"
    num_hidden_layers: int = 1
    block_size: int = 7
    target_layer_ids: list[int] = field(default_factory=lambda: [0])
    num_target_layers: int | None = None
    mask_token_id: int = 0
    markov_rank: int = 16  # 0 = no Markov head (DFlash-style drafting)
    markov_head_type: str = "vanilla"  # "vanilla" | "gated" | "rnn"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = True
    sliding_window: int | None = None  # two-sided window over the context; None = full context

    def __post_init__(self):
        super().__post_init__()
        if self.markov_head_type not in ("vanilla", "gated", "rnn"):
            raise ValueError(f"unknown markov_head_type {self.markov_head_type!r}")
        ids = list(self.target_layer_ids)
        if not ids or any(b <= a for a, b in zip(ids, ids[1:])):
            raise ValueError(f"target_layer_ids must be non-empty and strictly increasing: {ids}")
        if self.num_target_layers is not None:
            self.check_target_layers(self.num_target_layers)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0 (0: no Markov head), got {self.markov_rank}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None (the whole context), got {self.sliding_window}")

    def check_fits(self, target: TargetConfig) -> None:
        """ValueError naming the first field in which this drafter does not fit `target`."""
        for key in ("vocab_size", "hidden_size"):
            if getattr(self, key) != getattr(target, key):
                raise ValueError(f"{key} {getattr(self, key)} does not match the target's {getattr(target, key)}")
        layers = target.num_hidden_layers
        if self.num_target_layers is not None and self.num_target_layers != layers:
            raise ValueError(f"num_target_layers {self.num_target_layers} does not match the target's {layers} layers")
        self.check_target_layers(layers)
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")

    def check_target_layers(self, num_target_layers: int) -> None:
        """The features must come from a target of `num_target_layers` layers: ids run from -1 (the
        embeddings) to the last layer but one, as in DeepSpec (HF's last hidden state is post-norm)."""
        if not all(-1 <= i <= num_target_layers - 2 for i in self.target_layer_ids):
            raise ValueError(f"target_layer_ids {self.target_layer_ids} are out of range for a {num_target_layers}-"
                             f"layer target: ids run from -1 (embeddings) to {num_target_layers - 2} (the last "
                             f"layer is excluded, as in DeepSpec)")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DrafterConfig":
        """A drafter's `config.json` in any of DeepSpec's, DFlash's or TRT-LLM's spellings (nested,
        `dspark_`-prefixed, _DRAFTER_ALIASES, speculators' aux layer ids), with HF's defaults for
        what it leaves out."""
        flat = dict(d)
        for nested in ("dflash_config", "dspark_config"):
            flat.update(d.get(nested) or {})
        for key in list(flat):
            if key.startswith("dspark_"):
                flat.setdefault(key[len("dspark_"):], flat[key])
        for alias, name in _DRAFTER_ALIASES.items():
            if alias in flat:
                flat.setdefault(name, flat[alias])
        if _AUX_LAYER_IDS in flat:
            flat.setdefault("target_layer_ids", [i - 1 for i in flat[_AUX_LAYER_IDS]])
        flat.setdefault("architecture", "qwen3")
        _hf_defaults(flat)
        return cls(**_known_fields(cls, flat))

    @classmethod
    def for_target(cls, target: TargetConfig, **overrides) -> "DrafterConfig":
        """Copies the target's layer shapes (DeepSpec's build_draft_config), then applies overrides."""
        shapes = {k: v for k, v in target.to_dict().items() if k not in ("architecture", "num_hidden_layers")}
        shapes["num_target_layers"] = target.num_hidden_layers
        return cls(**{**shapes, **overrides})
