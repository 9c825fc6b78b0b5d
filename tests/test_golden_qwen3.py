"""A tiny random Qwen3 target (per-head q/k RMSNorm before RoPE) against an independent
implementation: transformers' Qwen3ForCausalLM on the same weights, read from the same HF folder.

The literals below were obtained on 2026-12-05 with transformers 5.25.0 (dev-only tool), torch
2.13.0+cpu, float32: `save_hf(qwen3(), folder)`, then

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)   # Qwen3ForCausalLM
    logits = hf(torch.tensor([IDS])).logits[0]
    print(logits.argmax(-1).tolist(), [round(v, 4) for v in logits[-1].tolist()])

dspark's logits differed from transformers' by at most 4.3e-6 there.
"""
import torch

from dspark.config import TargetConfig
from dspark.loading import load_target
from dspark.target import TargetModel
from test_loading import save_hf

IDS = [3, 17, 42, 5, 9, 60, 1, 33]
ARGMAX = [59, 40, 12, 52, 4, 12, 29, 40]
LAST_LOGITS = [3.8942, 0.9819, -2.3328, -1.1624, -0.0477, -2.5298, -1.3407, -0.6006, -1.3332, 4.1087, 1.3041,
               0.5586, 3.419, 0.7025, 2.594, 2.2875, -3.4941, 0.5249, -3.4665, 2.0965, -1.3425, -1.7178, -0.419,
               -3.3141, -2.3646, -4.4931, 2.866, -2.9568, 4.2948, 2.4762, -0.5949, 1.4209, 1.1065, -1.5719, 2.3663,
               -0.7905, -2.8295, -0.756, 1.6734, -2.6507, 5.2708, -2.2696, 1.3394, -0.9761, -0.2545, -1.1903,
               3.4922, 2.5567, 1.8094, 3.0378, -0.8374, 2.2551, -0.6868, 4.5133, 1.8865, -1.9128, 2.8933, 1.8758,
               1.821, 1.0459, 0.4475, -0.5569, -2.3492, -0.9316]


def qwen3() -> TargetModel:
    """Two layers, head_dim 32 (not hidden / heads), norm weights around 1, the rest around 0."""
    config = TargetConfig(architecture="qwen3", vocab_size=64, hidden_size=64, intermediate_size=96,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)
    model = TargetModel(config).eval()
    g = torch.Generator().manual_seed(0)
    state = {name: (1.0 if t.ndim == 1 else 0.0) + 0.3 * torch.randn(t.shape, generator=g)
             for name, t in sorted(model.state_dict().items())}  # HF's names, in their order
    model.load_state_dict(state)
    return model


@torch.no_grad()
def test_qwen3_from_an_hf_folder_matches_transformers(tmp_path):
    save_hf(qwen3(), tmp_path)
    model = load_target(tmp_path, dtype=torch.float32)
    logits = model(torch.tensor([IDS]), torch.arange(len(IDS))[None])[0][0]
    assert logits.argmax(-1).tolist() == ARGMAX
    torch.testing.assert_close(logits[-1], torch.tensor(LAST_LOGITS), atol=2e-4, rtol=0)
