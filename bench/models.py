"""Target shapes the benchmarks build with random weights (no model file needed)."""
import contextlib

import torch

from dspark import SpeculativeDecoder, TargetConfig, TargetModel, load_default
from dspark.loading import fast_dtype

# SmolLM2-135M-Instruct's shapes: the default target's step, on the GPU
SMOLLM2 = TargetConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                       max_position_embeddings=8192, tie_word_embeddings=True)
# the --smoke runs' target on the CPU: checks that a benchmark runs, fast
SMOKE = TargetConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2)
# Llama-3-8B's shapes: the goal's model for step times against the bytes floor (untied embeddings)
LLAMA3_8B = TargetConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                         max_position_embeddings=131072, tie_word_embeddings=False)
# its drafter's shapes, as DeepSpec builds one for an 8B target: 5 layers over 5 target layers
LLAMA3_8B_DRAFTER_LAYERS = dict(num_hidden_layers=5, block_size=7, target_layer_ids=[1, 8, 15, 22, 29],
                                markov_rank=64, mask_token_id=128002)


@contextlib.contextmanager
def built_on(device: torch.device, dtype: torch.dtype):
    """Modules made inside are made on `device` in `dtype` (an 8B model made on the CPU in float32 first
    would take 32 GB and minutes)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(default)


def random_target(config: TargetConfig, device: torch.device, dtype: torch.dtype) -> TargetModel:
    """A target of `config`'s shapes with random weights."""
    with built_on(device, dtype):
        return TargetModel(config).eval()


def default_pair_decoder():
    """The default pair on the fastest device in its fastest dtype, K = 7 -> (decoder, tokenizer,
    device name, dtype), as the serving benchmarks run it."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = fast_dtype(device)
    target, drafter, tokenizer = load_default(dtype=dtype, device=device)
    return SpeculativeDecoder(target, drafter, num_speculative_tokens=7, tokenizer=tokenizer), tokenizer, device, dtype
