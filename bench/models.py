"""Target shapes the benchmarks build with random weights (no model file needed)."""
from dspark import TargetConfig

# SmolLM2-135M-Instruct's shapes: the default target's step, on the GPU
SMOLLM2 = TargetConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                       max_position_embeddings=8192, tie_word_embeddings=True)
# the --smoke runs' target on the CPU: checks that a benchmark runs, fast
SMOKE = TargetConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2)
