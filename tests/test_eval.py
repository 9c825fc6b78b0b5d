"""The evaluation's numbers are the decoder's counters, summed over prompts, for a tiny target and drafter."""
from pathlib import Path

import pytest
import torch

from dspark.config import DrafterConfig, TargetConfig
from dspark.data import DOMAINS, Prompt
from dspark.decoder import SpeculativeDecoder
from dspark.engine import generate
from dspark.drafter import DSparkDrafter
from dspark import eval as evaluation
from dspark.eval import drafter_labels, evaluate, markdown_table
from dspark.sampling import SamplingParams
from dspark.target import TargetModel

pytestmark = pytest.mark.usefixtures("one_thread")

K = 3


class ByteTokenizer:
    """Stands in for a real tokenizer: a prompt's bytes, folded into the tiny vocabulary."""
    eos_token_ids = [1]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [2 + b % 30 for b in messages[-1]["content"].encode()]


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    target = TargetModel(TargetConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)).eval()
    with torch.no_grad():  # peaked enough that a random drafter is sometimes right, at several positions
        target.lm_head.weight.mul_(3.0)
    config = DrafterConfig.for_target(target.config, num_hidden_layers=1, block_size=K, target_layer_ids=[0],
                                      markov_rank=8, mask_token_id=0)
    drafter = DSparkDrafter(config, embed_tokens=target.embed_tokens, lm_head=target.lm_head).eval()
    return target, drafter


PROMPTS = [Prompt(text, domain) for text, domain in
           [("two plus two", "math"), ("say hello", "chat"), ("def f(x):", "code"), ("once upon", "prose"),
            ("a b c d", "chat"), ("x = 1", "code")]]


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (1.0, 1.0), (1.0, 0.6)])
def test_rows_are_the_decoders_counters(pair, temperature, top_p):
    target, drafter = pair
    tokenizer = ByteTokenizer()
    rows = evaluate(target, {"tiny": drafter}, PROMPTS, tokenizer, temperatures=[temperature],
                    num_speculative_tokens=K, max_tokens=12, batch_size=4, seed=5, top_p=top_p)
    assert [(r.method, r.temperature) for r in rows] == [("standard", temperature), ("block", temperature)]

    for row in rows:
        decoder = SpeculativeDecoder(target, drafter, num_speculative_tokens=K, rejection_sample_method=row.method)
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p.text}]) for p in PROMPTS]
        params = [SamplingParams(temperature=temperature, top_p=top_p, seed=5 + i, max_tokens=12, stop_token_ids=[1])
                  for i in range(len(PROMPTS))]
        results = generate(decoder, prompts, params)
        steps = sum(r.num_steps for r in results)
        accepted = [sum(r.accepted_per_position[k] for r in results) for k in range(K)]
        assert row.total.steps == steps and row.total.accepted == accepted
        assert row.total.tokens == sum(len(r.tokens) for r in results)
        assert row.total.per_position == pytest.approx([a / steps for a in accepted])
        assert row.total.acceptance_length == pytest.approx(1 + sum(row.total.per_position))
        assert 0 < accepted[0] < steps and accepted[1] > 0  # the counts say something
        assert all(a >= b for a, b in zip(accepted, accepted[1:]))  # a draft counts only after its prefix
        code = [r for r, p in zip(results, PROMPTS) if p.domain == "code"]
        assert row.by_domain["code"].steps == sum(r.num_steps for r in code)
        assert sum(d.steps for d in row.by_domain.values()) == steps
    if top_p < 1:  # the control: the nucleus changes the text, so the counters are not plain T = 1's
        plain = evaluate(target, {"tiny": drafter}, PROMPTS, tokenizer, temperatures=[temperature], methods=["block"],
                         num_speculative_tokens=K, max_tokens=12, batch_size=4, seed=5)[0]
        assert (plain.total.steps, plain.total.accepted) != (rows[1].total.steps, rows[1].total.accepted)
        cell = markdown_table(rows).splitlines()[2].split("|")[2].strip()
        assert cell == f"1, top-p {top_p:g}"


def test_markdown_table_has_a_line_per_row(pair):
    target, drafter = pair
    rows = evaluate(target, {"a": drafter, "b": drafter}, PROMPTS[:2], ByteTokenizer(), temperatures=[0.0],
                    methods=["standard"], num_speculative_tokens=K, max_tokens=6)
    lines = markdown_table(rows).splitlines()
    assert len(lines) == 2 + len(rows)
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:4] == ["drafter", "T", "verify", "AL"] and f"acc@{K}" in header
    for line, row in zip(lines[2:], rows):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == row.drafter and float(cells[3]) == pytest.approx(row.total.acceptance_length, abs=1e-3)
        assert cells[4 + DOMAINS.index("code")] == "-"  # no code prompt among the first two


def test_drafters_of_the_same_folder_name_keep_a_row_each():
    """run/drafter and assets/drafter once shared the label "drafter", and one's rows replaced the other's."""
    paths = [Path("run/drafter"), Path("assets/drafter"), Path("run/drafter-rank0")]
    assert drafter_labels(paths) == ["run/drafter", "assets/drafter", "drafter-rank0"]
    with pytest.raises(ValueError, match="given twice"):
        drafter_labels([Path("run/drafter"), Path("run/drafter")])


def test_dtype_option_reaches_the_model_loader(monkeypatch):
    """--dtype picks the weights' dtype; without it the CPU evaluates in float32."""
    seen = {}

    def loader(dtype, device):
        seen.update(dtype=dtype, device=device)
        raise SystemExit  # stop before any decoding

    monkeypatch.setattr(evaluation, "load_default", loader)
    for argv, want in ((["--device", "cpu"], torch.float32), (["--device", "cpu", "--dtype", "bfloat16"], torch.bfloat16)):
        with pytest.raises(SystemExit):
            evaluation.main(argv)
        assert seen == {"dtype": want, "device": "cpu"}


def test_more_prompts_than_the_set_holds_is_an_error_not_a_smaller_run(monkeypatch):
    """--num-prompts 500 once evaluated the 80 held-out prompts without a word."""
    monkeypatch.setattr(evaluation, "load_default", lambda **_: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit, match="--num-prompts 500: the heldout set has 80 prompts"):
        evaluation.main(["--num-prompts", "500", "--device", "cpu"])


@pytest.mark.parametrize("bad", [["--batch-size", "0"], ["--batch-size", "-1"], ["--num-prompts", "0"],
                                 ["--num-prompts", "-5"], ["-k", "-1"], ["--max-tokens", "0"],
                                 ["--temperatures", "0", "-1"], ["--temperatures", "nan"], ["--seed", "-1"],
                                 ["--top-p", "0"], ["--top-p", "1.5"], ["--top-p", "nan"]])
def test_the_command_line_refuses_counts_that_would_mislead(bad, capsys):
    """A batch size below 1 once printed AL 1.000 over no steps; -5 prompts dropped the last five."""
    with pytest.raises(SystemExit):
        evaluation.parse_args(bad)
    assert bad[0] in capsys.readouterr().err
