"""Drafter training on a tiny target: it learns, it resumes exactly, and its corpus is sound.

The tiny target is random but has structure to learn: its LM head is scaled up so its next-token
distributions are peaked (entropy about 1 nat), and its own responses (self-distillation, as in
the real recipe) repeat n-grams of its near-deterministic transitions.
"""
import copy
import dataclasses
import itertools
import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters

from dspark import train as training
from dspark.train import cli, loop, schedule
from dspark.checkpoint import load_drafter
from dspark.config import DrafterConfig, TargetConfig
from dspark.data import DOMAINS, Sequence, heldout_prompts, response_params, self_distill, training_prompts
from dspark.decoder import SpeculativeDecoder
from dspark.drafter import DSparkDrafter
from dspark.sampling import SamplingParams
from dspark.target import TargetModel

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
PROMPT_LEN = 4


def random_prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (count, PROMPT_LEN), generator=generator).tolist()


def tiny_drafter_config(target: TargetModel, markov_rank: int = 16, markov_head_type: str = "vanilla") -> DrafterConfig:
    return DrafterConfig.for_target(
        target.config, num_hidden_layers=1, block_size=4, markov_rank=markov_rank, mask_token_id=0,
        target_layer_ids=[0, 2], enable_confidence_head=True, markov_head_type=markov_head_type)


@pytest.fixture(scope="module")
def target() -> TargetModel:
    torch.manual_seed(0)
    target = TargetModel(TargetConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    return target.eval()


@pytest.fixture(scope="module")
def sequences(target, tmp_path_factory) -> list[Sequence]:
    path = tmp_path_factory.mktemp("data") / "sequences.jsonl"
    prompts = random_prompts(16, seed=1)
    sequences, done = self_distill(target, prompts, path, max_tokens=24, seed=0, stop_token_ids=[],
                                   responses_per_prompt=2, batch_size=32)
    assert done and len(sequences) == 32
    assert [s.tokens[:s.prompt_len] for s in sequences] == [p for p in prompts for _ in range(2)]
    return sequences


def greedy_acceptance_length(target: TargetModel, drafter: DSparkDrafter) -> float:
    decoder = SpeculativeDecoder(target, drafter, num_speculative_tokens=drafter.block_size)
    results = decoder.generate(random_prompts(8, seed=2), SamplingParams(temperature=0.0, max_tokens=24))
    return 1 + sum(sum(r.accepted_per_position) for r in results) / sum(r.num_steps for r in results)


def test_training_lowers_the_loss_and_raises_the_acceptance_length(target, sequences, tmp_path):
    config = training.TrainConfig(steps=60, batch_size=8, num_anchors=24, lr=1e-2)
    torch.manual_seed(0)
    untrained = DSparkDrafter(tiny_drafter_config(target), embed_tokens=target.embed_tokens,
                              lm_head=target.lm_head)
    before = greedy_acceptance_length(target, untrained)
    torch.manual_seed(0)  # the same initial weights
    heldout, _ = self_distill(target, random_prompts(8, seed=4), tmp_path / "heldout.jsonl", max_tokens=24, seed=1,
                              stop_token_ids=[])
    drafter, twin = training.train(target, tiny_drafter_config(target), sequences, tmp_path, config, log_every=5,
                                   heldout={"greedy": heldout}, heldout_every=25)
    after = greedy_acceptance_length(target, drafter.drafter)

    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    trained = [row for row in log if "heldout" not in row]
    first, last = trained[0]["drafter"], trained[-1]["drafter"]
    assert len(trained) == 12
    rate = training.warmup_cosine(60, config.warmup)  # a line's "lr" is its last step's rate
    assert [row["lr"] for row in trained] == pytest.approx([1e-2 * rate(row["step"] - 1) for row in trained])
    assert trained[-1]["lr"] > 0
    assert last["loss"] < 0.7 * first["loss"]
    assert last["al_estimate"] > first["al_estimate"] + 0.5
    assert after > before + 0.5, (before, after)
    # Trained on the same batches, the twin without a Markov head drafts worse after the first slot.
    assert last["al_estimate"] > trained[-1]["drafter-rank0"]["al_estimate"] + 0.1
    # Held-out estimates at steps 25, 50 and the last; they rise too (the prompts were never trained on).
    checks = [row for row in log if "heldout" in row]
    assert [row["step"] for row in checks] == [25, 50, 60]
    first, last = checks[0]["heldout"]["greedy"]["drafter"], checks[-1]["heldout"]["greedy"]["drafter"]
    assert last["al_greedy_estimate"] > first["al_greedy_estimate"]


def test_resume_reproduces_the_uninterrupted_run(target, sequences, tmp_path):
    config = training.TrainConfig(steps=6, batch_size=2, num_anchors=8, lr=3e-3)
    drafter_config = tiny_drafter_config(target)
    torch.manual_seed(0)
    straight = training.train(target, drafter_config, sequences, tmp_path / "straight", config, save_every=4)

    torch.manual_seed(0)
    training.train(target, drafter_config, sequences, tmp_path / "split", config, stop=lambda step: step == 3,
                   save_every=2)
    assert torch.load(tmp_path / "split" / training.CHECKPOINT, weights_only=True)["step"] == 3
    torch.manual_seed(1)  # a resumed run starts from other random weights, then loads the checkpoint
    resumed = training.train(target, drafter_config, sequences, tmp_path / "split", config, resume=True)

    for a, b in zip(straight, resumed, strict=True):
        assert a.scheduler.state_dict() == b.scheduler.state_dict()
        for (name, x), y in zip(a.drafter.state_dict().items(), b.drafter.state_dict().values()):
            assert torch.equal(x, y), name
        state_a, state_b = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
        for key in state_a:
            assert all(torch.equal(state_a[key][k], state_b[key][k]) for k in state_a[key])


def test_resume_refuses_other_settings_and_a_fresh_run_refuses_to_overwrite(target, sequences, tmp_path):
    config = training.TrainConfig(steps=2, batch_size=2, num_anchors=4, rank0_twin=False)
    training.train(target, tiny_drafter_config(target), sequences, tmp_path, config)
    with pytest.raises(FileExistsError, match="--resume"):
        training.train(target, tiny_drafter_config(target), sequences, tmp_path, config)
    with pytest.raises(ValueError, match="markov_rank"):
        training.train(target, tiny_drafter_config(target, markov_rank=8), sequences, tmp_path, config, resume=True)
    with pytest.raises(ValueError, match="lr"):
        training.train(target, tiny_drafter_config(target), sequences, tmp_path, dataclasses.replace(config, lr=1.0),
                       resume=True)
    with pytest.raises(ValueError, match="trained on other data"):  # once it went on, on other batches
        training.train(target, tiny_drafter_config(target), sequences[:-1], tmp_path,
                       dataclasses.replace(config, steps=3), resume=True)
    # a checkpoint saved before --followup-anchors existed resumes as uniform anchors, and only so
    state = torch.load(tmp_path / training.CHECKPOINT, weights_only=True)
    del state["train_config"]["followup_anchors"], state["followups"]
    torch.save(state, tmp_path / training.CHECKPOINT)
    with pytest.raises(ValueError, match="--followup-anchors"):
        training.train(target, tiny_drafter_config(target), sequences, tmp_path,
                       dataclasses.replace(config, followup_anchors=0.5), resume=True)
    with pytest.raises(ValueError, match="at step 2: --steps 2 leaves nothing to train"):
        training.train(target, tiny_drafter_config(target), sequences, tmp_path, config, resume=True)
    training.train(target, tiny_drafter_config(target), sequences, tmp_path, dataclasses.replace(config, steps=3),
                   resume=True)


def test_the_command_line_refuses_a_resume_with_other_options_before_any_data(target, sequences, tmp_path,
                                                                              monkeypatch):
    """--resume --batch-size 4 on a run of batch 2 once failed with a traceback after the data's
    generation and the step's compilation (minutes on the GPU), naming a field, not the flag."""
    given = ["--out", str(tmp_path), "--resume", "--device", "cpu", "--steps", "2", "--num-anchors", "4",
             "--no-rank0-twin"]
    training.train(target, tiny_drafter_config(target), sequences, tmp_path,
                   cli.parse_args([*given, "--batch-size", "2"]).config)
    monkeypatch.setattr(cli, "load_training_target", lambda args: pytest.fail("the target was loaded"))
    monkeypatch.setattr(cli.multiprocessing, "get_context", lambda _: pytest.fail("data was generated"))
    with pytest.raises(SystemExit, match=r"other --batch-size \(2, now 4\):"):
        cli.main([*given, "--batch-size", "4"])
    with pytest.raises(SystemExit, match="at step 2: --steps 2 leaves nothing to train"):
        cli.main([*given, "--batch-size", "2"])


def test_resume_with_a_tied_target_whose_lm_head_is_its_embedding(sequences, tmp_path):
    torch.manual_seed(0)
    tied = TargetModel(TargetConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)).eval()
    config = training.TrainConfig(steps=3, batch_size=2, num_anchors=4)
    training.train(tied, tiny_drafter_config(tied), sequences, tmp_path, config, stop=lambda step: step == 1)
    training.train(tied, tiny_drafter_config(tied), sequences, tmp_path, config, resume=True)
    assert torch.load(tmp_path / training.CHECKPOINT, weights_only=True)["step"] == 3


def test_resume_may_change_the_step_count_and_the_schedule_follows_it(target, sequences, tmp_path):
    config = training.TrainConfig(steps=8, batch_size=2, num_anchors=4, lr=1e-3, warmup=0.25, rank0_twin=False)
    training.train(target, tiny_drafter_config(target), sequences, tmp_path, config, stop=lambda step: step == 3)
    longer = dataclasses.replace(config, steps=12)
    [student] = training.train(target, tiny_drafter_config(target), sequences, tmp_path, longer, resume=True,
                               log_every=1)
    assert torch.load(tmp_path / training.CHECKPOINT, weights_only=True)["step"] == 12
    # the first step after the resume (logged as step 4) runs at the new schedule's rate
    rate = {entry["step"]: entry["lr"] for entry in map(json.loads, (tmp_path / "log.jsonl").open()) if "lr" in entry}
    new_rate, old_rate = (config.lr * training.warmup_cosine(total, config.warmup)(3) for total in (12, 8))
    assert rate[4] == new_rate != old_rate
    expected = config.lr * training.warmup_cosine(12, config.warmup)(12)
    assert student.scheduler.get_last_lr()[0] == pytest.approx(expected)


def test_a_run_lost_between_saves_leaves_the_drafter_of_its_last_save(target, sequences, tmp_path):
    config = training.TrainConfig(steps=6, batch_size=2, num_anchors=8, lr=3e-3)
    drafter_config = tiny_drafter_config(target)

    def lost_at_step_3(step):
        if step == 3:
            raise KeyboardInterrupt("the machine is gone")
        return False

    with pytest.raises(KeyboardInterrupt):
        training.train(target, drafter_config, sequences, tmp_path / "lost", config, stop=lost_at_step_3, save_every=2)
    training.train(target, drafter_config, sequences, tmp_path / "two", config, stop=lambda step: step == 2)
    lost, two = (load_drafter(tmp_path / run / "drafter", target).state_dict() for run in ("lost", "two"))
    assert all(torch.equal(lost[name], two[name]) for name in two)
    assert not any(path.name.endswith(".tmp") for path in (tmp_path / "lost" / "drafter").iterdir())


def test_each_step_is_exported_once(target, sequences, tmp_path, monkeypatch):
    """Saves at steps 2 and 4 of 4 export the drafters twice, not three times (the last step used to
    be exported again at the end); a resumed run stopped before its first step exports once."""
    exported = []
    monkeypatch.setattr(loop, "export", lambda students, out: exported.append(out))
    config = training.TrainConfig(steps=4, batch_size=2, num_anchors=4)
    training.train(target, tiny_drafter_config(target), sequences, tmp_path, config, save_every=2)
    assert len(exported) == 2
    more = dataclasses.replace(config, steps=6)
    training.train(target, tiny_drafter_config(target), sequences, tmp_path, more, save_every=2, resume=True,
                   stop=lambda step: True)
    assert len(exported) == 3


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_export_holds_the_trained_weights_in_bf16_and_the_twin_has_no_markov_head(target, sequences, tmp_path, head):
    config = training.TrainConfig(steps=2, batch_size=2, num_anchors=4)
    students = training.train(target, tiny_drafter_config(target, markov_head_type=head), sequences, tmp_path, config)
    for student in students:
        loaded = load_drafter(tmp_path / student.name, target)
        trained = student.drafter.state_dict()
        for name, tensor in loaded.state_dict().items():
            expected = trained[name] if name.split(".")[0] in loaded.shared_modules else trained[name].bfloat16()
            assert torch.equal(tensor, expected.float()), name
    assert load_drafter(tmp_path / "drafter", target).config.markov_head_type == head
    assert students[0].drafter.markov_head is not None
    assert load_drafter(tmp_path / "drafter-rank0", target).markov_head is None


def test_initial_weights_are_a_function_of_the_seed_and_the_twin_starts_from_the_drafters_backbone(target):
    config = training.TrainConfig(steps=2)
    state = torch.random.get_rng_state()
    first, twin = training.make_students(target, tiny_drafter_config(target), config)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global random state is left alone
    again, _ = training.make_students(target, tiny_drafter_config(target), config)
    other, _ = training.make_students(target, tiny_drafter_config(target), dataclasses.replace(config, seed=1))
    weights = first.drafter.state_dict()
    assert all(torch.equal(w, again.drafter.state_dict()[n]) for n, w in weights.items())
    assert not torch.equal(weights["fc.weight"], other.drafter.state_dict()["fc.weight"])
    assert twin.drafter.markov_head is None and first.drafter.markov_head is not None
    backbone = [n for n in weights if n.startswith(("fc.", "layers."))]
    assert backbone and all(torch.equal(weights[n], twin.drafter.state_dict()[n]) for n in backbone)


def test_the_command_line_refuses_counts_that_would_fail_later_or_quietly():
    probe = training.parse_args(["--out", "x", "--steps", "100", "--stop-at", "20", "--heldout-every", "10"])
    assert probe.stop_at == 20
    for bad in (["--stop-at", "0"], ["--steps", "100", "--stop-at", "200", "--heldout-every", "100"],
                ["--stop-at", "20", "--heldout-every", "20", "--fit-steps", "--time-budget-s", "60"],
                ["--stop-at", "30", "--heldout-every", "20"],  # would end without a held-out estimate
                ["--log-every", "0"], ["--batch-size", "0"], ["--heldout-every", "0"], ["--heldout-prompts", "-1"],
                ["--steps", "200", "--fit-steps", "--time-budget-s", "60"]):  # the fit comes after step 220
        with pytest.raises(SystemExit):
            training.parse_args(["--out", "x", *bad])
    assert training.parse_args(["--out", "x", "--stop-at", "30", "--heldout-prompts", "0"]).stop_at == 30


def test_target_layer_ids_beyond_the_target_exit_naming_them(target, tmp_path, monkeypatch):
    """They once ended the command in a traceback (DrafterConfig's ValueError)."""
    class Idle:  # the data's process, never started here
        def __init__(self, **_):
            pass

        def start(self):
            pass

    monkeypatch.setattr(cli, "load_training_target", lambda args: (target, SimpleNamespace(token_to_id=lambda _: 3)))
    monkeypatch.setattr(cli.multiprocessing, "get_context", lambda _: SimpleNamespace(Process=Idle))
    with pytest.raises(SystemExit, match=r"python -m dspark.train: target_layer_ids \[0, 9\] are out of range"):
        cli.main(["--out", str(tmp_path), "--device", "cpu", "--target-layer-ids", "0,9"])


def test_an_out_that_is_a_file_is_refused_naming_it(tmp_path, capsys):
    """It once ran the compilation, then failed in the data's process with a traceback."""
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        training.parse_args(["--out", str(tmp_path / "file")])
    assert "is a file, not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--grad-clip", "-1"), ("--grad-clip", "0"), ("--decay-gamma", "0"),
                                         ("--lr", "-1e-3"), ("--warmup", "5"), ("--kl-weight", "-0.1"),
                                         ("--tv-weight", "nan"), ("--followup-anchors", "2"), ("--time-budget-s", "0"),
                                         ("--time-budget-s", "inf"), ("--max-prompt-tokens", "0"),
                                         ("--synthetic-max-tokens", "0")])
def test_the_command_line_refuses_a_recipe_that_trains_garbage(flag, value, capsys):
    """A negative clip norm ascended the gradient, gamma 0 made the loss NaN, warmup 5 kept the
    rate at a fifth of its peak: each ran without a word, after minutes of generation."""
    with pytest.raises(SystemExit):
        training.parse_args(["--out", "x", flag, value])
    assert flag in capsys.readouterr().err


def test_a_run_folder_with_a_checkpoint_is_refused_before_any_work(tmp_path):
    (tmp_path / training.CHECKPOINT).write_bytes(b"")
    with pytest.raises(SystemExit, match="pass --resume"):
        training.main(["--out", str(tmp_path), "--smoke"])
    assert not (tmp_path / "synthetic.jsonl").exists()  # no data generated into it


def test_a_budget_spent_in_generation_ends_the_run_there(tmp_path, monkeypatch, capsys):
    """The generation process says the deadline came first (its exit code), and this process trains
    nothing and generates nothing more: it once went on generating, with a fresh time budget that
    let one more batch start after the deadline."""
    def generate_data(*args):
        raise AssertionError("the training process generated")
    monkeypatch.setattr(cli, "generate_data", generate_data)
    training.main(["--out", str(tmp_path), "--smoke", "--time-budget-s", "0.001"])
    assert not (tmp_path / training.CHECKPOINT).exists() and not (tmp_path / "drafter").exists()


def test_time_budget_stops_before_a_step_that_would_end_late(monkeypatch):
    clock = [0.0, 20.0, 24.0, 28.0]  # the first step compiles (20 s), the others take 4 s
    monkeypatch.setattr(schedule.time, "monotonic", lambda: clock.pop(0) if clock else 28.0)
    budget = training.TimeBudget(deadline=30.0)
    # judged by the compiling step, 20 + 20 > 30 would stop at step 1; 28 + 4 > 30 stops at step 3
    assert [budget(step) for step in range(4)] == [False, False, False, True]
    assert not any(training.TimeBudget(None)(step) for step in range(3))


def test_time_budget_counts_the_steps_left_at_the_median_step_length(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(schedule, "time", type("Clock", (), {"monotonic": staticmethod(lambda: now[0])}))
    budget = training.TimeBudget(deadline=100.0, window=5)
    # a compiling step, then steps of 1 and 2 s and one that compiles again (40 s)
    for t in (0.0, 30.0, 31.0, 33.0, 73.0, 74.0, 76.0):
        now[0] = t
        budget(0)
    assert budget.steps_left() == 12  # 24 s left at 2 s a step; the mean step (9.2 s) would leave 2
    with pytest.raises(RuntimeError, match="deadline"):
        training.TimeBudget(None).steps_left()


def test_a_fitted_schedule_ends_with_the_time_budget(target, sequences, tmp_path, monkeypatch):
    """fit_schedule: FIT_AFTER_STEPS steps in, the total becomes the steps that fit before the deadline
    (here 1 s a step on a fake clock), and the learning rate decays to zero exactly at that step."""
    now = [0.0]

    def tick() -> float:  # each call of the budget (one per step) is a second later
        now[0] += 1.0
        return now[0]

    monkeypatch.setattr(loop, "FIT_AFTER_STEPS", 3)
    config = training.TrainConfig(steps=50, batch_size=2, num_anchors=4, rank0_twin=False)
    budget = training.TimeBudget(deadline=12.5)
    monkeypatch.setattr(schedule, "time", type("Clock", (), {"monotonic": staticmethod(tick)}))
    [student] = training.train(target, tiny_drafter_config(target), sequences, tmp_path, config, stop=budget,
                               fit_schedule=True, log_every=1)
    fitted = int(loop.FIT_MARGIN * 9)  # 3 steps in, the budget's last call read 3.0: 9.5 s, 9 steps left
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert {"step": 3, "fitted_steps": 3 + fitted} in log
    # the fourth step (logged as step 4) already runs at the fitted schedule's rate, not the old one's
    rate = {entry["step"]: entry["lr"] for entry in log if "lr" in entry}
    fitted_rate, old_rate = (config.lr * training.warmup_cosine(total, config.warmup)(3) for total in (3 + fitted, 50))
    assert rate[4] == fitted_rate != old_rate
    assert torch.load(tmp_path / training.CHECKPOINT, weights_only=True)["step"] == 3 + fitted
    assert student.scheduler.get_last_lr()[0] == 0.0
    with pytest.raises(ValueError, match="TimeBudget"):
        training.train(target, tiny_drafter_config(target), sequences, tmp_path / "b", config, fit_schedule=True)


def test_default_drafter_config_fits_the_size_budget():
    smollm2 = TargetConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0)
    config = training.default_drafter_config(smollm2, mask_token_id=16)
    assert config.target_layer_ids == [1, 8, 14, 20, 27] and config.block_size == 7
    with torch.device("meta"):
        embed = torch.nn.Embedding(smollm2.vocab_size, smollm2.hidden_size)
        lm_head = torch.nn.Linear(smollm2.hidden_size, smollm2.vocab_size)
        drafter = DSparkDrafter(config, embed_tokens=embed, lm_head=lm_head)
    saved = sum(t.numel() for name, t in drafter.state_dict().items()
                if name.split(".")[0] not in drafter.shared_modules)
    assert 2 * saved <= 40e6  # bytes in bf16


def test_target_layer_ids_can_be_chosen_but_never_the_last_layer():
    smollm2 = TargetConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0)
    late = training.default_drafter_config(smollm2, 16, target_layer_ids=[25, 26, 27])
    assert late.target_layer_ids == [25, 26, 27]
    with pytest.raises(ValueError, match=r"\[26, 28, 29\] are out of range for a 30-layer target"):
        training.default_drafter_config(smollm2, 16, target_layer_ids=[26, 28, 29])
    assert training.parse_args(["--out", "x", "--target-layer-ids", "25,26,27"]).target_layer_ids == [25, 26, 27]


def test_target_layer_ids_follow_z_labs_spacing():
    assert training.build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B DFlash's published ids
    assert training.build_target_layer_ids(30, 1) == [15]
    assert all(max(training.build_target_layer_ids(n, m)) < n - 1 for n in (8, 30, 40) for m in (2, 3, 5))


def test_batches_anchor_only_response_positions_with_labels():
    sequences = [Sequence(list(range(1, 21)), prompt_len=12), Sequence(list(range(1, 9)), prompt_len=5)]
    config = training.TrainConfig(batch_size=2, num_anchors=6)
    for step in range(4):
        batch = training.make_batch(sequences, step, config, block_size=3)
        for row in range(2):
            length = int((batch.tokens[row] > 0).sum())
            seq = next(s for s in sequences if len(s.tokens) == length)
            used = batch.valid[row, :, 0]
            anchors = batch.anchors[row][used]
            assert len(anchors) == min(6, length - 1 - seq.prompt_len)
            assert anchors.min() >= seq.prompt_len and anchors.max() + 1 < length
            label_at = batch.anchors[row, :, None] + torch.arange(1, 4)
            assert torch.equal(batch.valid[row], used[:, None] & (label_at < length))


def test_heldout_batches_hold_every_heldout_sequence_once_in_order():
    # 10 sequences of distinct lengths, 4 a batch: batches of 4, 4 and 2 (the old cut kept 8)
    sequences = [Sequence(list(range(1, 12 + n)), prompt_len=4) for n in range(10)]
    batches = training.heldout_batches(sequences, training.TrainConfig(batch_size=4, num_anchors=3), block_size=2)
    assert [len(b.tokens) for b in batches] == [4, 4, 2]
    lengths = [int(n) for b in batches for n in (b.tokens > 0).sum(1)]
    assert lengths == [len(s.tokens) for s in sequences]


def test_follow_ups_are_where_a_greedy_decode_drafts_next_and_take_their_share_of_the_anchors():
    sequences = [Sequence(list(range(1, 41)), prompt_len=4), Sequence(list(range(1, 21)), prompt_len=12)]
    config = training.TrainConfig(batch_size=2, num_anchors=8, followup_anchors=0.5)
    batch = training.make_batch(sequences, 0, config, block_size=3)
    # first row: blocks agree for 0, 1, 2, 3 leading slots; a miss inside a run ends it
    agree = torch.zeros(2, 8, 3)
    agree[0, 1, 0] = agree[0, 2, :2] = agree[0, 3] = agree[0, 4, [0, 2]] = 1.0
    followups = training.FollowUps(num_sequences=5, num_anchors=8)
    followups.update([3, 1], batch, agree)
    anchors = batch.anchors[0]
    assert followups.table[3].tolist() == (anchors + torch.tensor([0, 1, 2, 3, 1, 0, 0, 0]) + 1).tolist()
    # the second sequence has 7 response positions: its eighth block is padding, without a follow-up
    assert followups.table[1, 7] == -1 and (followups.table[1, :7] >= 0).all()
    assert followups[[1]][0].tolist() == (batch.anchors[1, :7] + 1).tolist()  # no agreement there
    assert followups[[0]][0].numel() == 0  # never visited

    table = [torch.tensor([30, 30, 6, 39, 2, 20, 11, 17]), torch.tensor([5, 13, 19, 40])]
    for step in range(5):
        plain = training.make_batch(sequences, step, config, block_size=3)
        batch = training.make_batch(sequences, step, config, block_size=3, followups=table)
        first = batch.anchors[0]
        assert len(first.unique()) == 8 and torch.equal(first, first.sort().values)
        inside = {30, 6, 20, 11, 17}  # 39 has no label after it, 2 is in the prompt
        assert len(inside & set(first.tolist())) >= 4  # half of the 8 anchors (a random one may be a fifth)
        assert set(first.tolist()) <= set(plain.anchors[0].tolist()) | inside  # the rest from the random order
        second = batch.anchors[1][batch.valid[1, :, 0]]
        assert 5 not in second and len(second.unique()) == 7  # 5 is in the prompt; 13 is not taken twice
        assert 19 not in batch.anchors[1]  # the last token has no label after it
    no_share = dataclasses.replace(config, followup_anchors=0.0)
    assert torch.equal(training.make_batch(sequences, 2, no_share, 3, followups=table).anchors,
                       training.make_batch(sequences, 2, no_share, 3).anchors)
    with pytest.raises(ValueError, match="followup_anchors"):
        training.TrainConfig(followup_anchors=1.5)


def test_resume_with_follow_up_anchors_reproduces_the_uninterrupted_run(target, sequences, tmp_path):
    """With batches of 8 of the 32 sequences the second epoch (from step 4) meets follow-ups; the
    run is cut after step 5, inside it."""
    config = training.TrainConfig(steps=7, batch_size=8, num_anchors=8, lr=3e-3, followup_anchors=0.5,
                                  rank0_twin=False)
    drafter_config = tiny_drafter_config(target)
    torch.manual_seed(0)
    straight = training.train(target, drafter_config, sequences, tmp_path / "straight", config)
    torch.manual_seed(0)
    training.train(target, drafter_config, sequences, tmp_path / "split", config, stop=lambda step: step == 5)
    torch.manual_seed(1)
    resumed = training.train(target, drafter_config, sequences, tmp_path / "split", config, resume=True)
    for (name, x), y in zip(straight[0].drafter.state_dict().items(), resumed[0].drafter.state_dict().values()):
        assert torch.equal(x, y), name
    control = dataclasses.replace(config, followup_anchors=0.0)
    torch.manual_seed(0)
    uniform = training.train(target, drafter_config, sequences, tmp_path / "uniform", control)
    assert not torch.equal(uniform[0].drafter.fc.weight, straight[0].drafter.fc.weight)


def test_batch_order_sees_every_sequence_once_an_epoch_in_batches_of_similar_lengths():
    lengths = torch.randint(10, 500, (1000,), generator=torch.Generator().manual_seed(0)).tolist()
    padded = {}
    for bucket_batches in (1, 16):
        config = training.TrainConfig(batch_size=10, bucket_batches=bucket_batches, seed=3)
        order = training.BatchOrder(lengths, config)
        for epoch in range(2):
            batches = [order(epoch * 100 + b) for b in range(100)]
            assert sorted(i for batch in batches for i in batch) == list(range(1000))
        assert order(5) == training.BatchOrder(lengths, config)(5)  # a function of (lengths, config, step)
        assert order(5) != order(105)  # another epoch, another order
        padded[bucket_batches] = sum(max(lengths[i] for i in order(b)) * 10 for b in range(100)) / sum(lengths)
    assert padded[1] > 1.5 and padded[16] < 1.1  # random batches against length buckets
    with pytest.raises(ValueError, match="bucket_batches"):
        training.BatchOrder(lengths, training.TrainConfig(bucket_batches=0))
    with pytest.raises(ValueError, match="cannot fill a batch of 64"):
        training.BatchOrder(lengths[:63], training.TrainConfig())


# ---------------------------------------------------------------------------- corpus


@pytest.fixture(scope="module")
def corpus():
    return training_prompts()


def test_training_prompts_cover_every_domain(corpus):
    counts = {d: sum(p.domain == d for p in corpus) for d in DOMAINS}
    assert all(n >= 200 for n in counts.values()), counts
    assert len({p.text for p in corpus}) == len(corpus)


def test_heldout_prompts_are_disjoint_from_training(corpus):
    heldout = heldout_prompts()
    assert {p.domain for p in heldout} == set(DOMAINS) and len(heldout) >= 60

    def runs(text: str, n: int = 8) -> set:
        words = text.split()
        return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}

    seen = set().union(*(runs(p.text) for p in corpus))
    shared = [p.text[:60] for p in heldout if runs(p.text) & seen]
    assert not shared, f"held-out prompts share 8-word runs with training prompts: {shared}"
    assert not {p.text for p in heldout} & {p.text for p in corpus}


def test_first_response_of_a_prompt_is_greedy_the_others_sampled_with_their_own_seeds():
    params = [response_params(i, 3, seed=5, max_tokens=9, stop_token_ids=[2]) for i in range(6)]
    assert [p.temperature for p in params] == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert len({p.seed for p in params}) == 6
    assert all(p.max_tokens == 9 and p.stop_token_ids == [2] for p in params)


def test_self_distill_resumes_from_a_cut_cache(target, tmp_path):
    prompts = [p[:n] for p, n in zip(random_prompts(6, seed=3), (4, 2, 3, 1, 4, 2))]
    whole, _ = self_distill(target, prompts, tmp_path / "whole.jsonl", max_tokens=8, seed=0, stop_token_ids=[],
                            batch_size=3)
    lines = (tmp_path / "whole.jsonl").read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:3]) + lines[3][:10])  # header, two sequences, half of the third
    answered = []
    resumed, done = self_distill(target, prompts, cut, max_tokens=8, seed=0, stop_token_ids=[], batch_size=3,
                                 progress=answered.append)
    assert done and resumed == whole
    assert [s.tokens[:s.prompt_len] for s in whole] == prompts  # returned in prompt order
    cached = [json.loads(line)["prompt_len"] for line in lines[1:]]
    assert cached == [1, 2, 2, 3, 4, 4]  # generated shortest first
    assert answered == [2, 3, 1]  # two from the cache, then the rest in batches
    # a complete cache is read, not written again (it may lie in a read-only folder)
    before = cut.stat()
    assert self_distill(target, prompts, cut, max_tokens=8, seed=0, stop_token_ids=[], batch_size=3) == (whole, True)
    assert (cut.stat().st_ino, cut.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    # answers to other stop tokens, or by the target in another dtype, are other data
    with pytest.raises(ValueError, match="generated with"):
        self_distill(target, prompts, cut, max_tokens=8, seed=0, stop_token_ids=[5], batch_size=3)
    with pytest.raises(ValueError, match="generated with"):
        self_distill(copy.deepcopy(target).double(), prompts, cut, max_tokens=8, seed=0, stop_token_ids=[],
                     batch_size=3)
    assert cut.read_text() == (tmp_path / "whole.jsonl").read_text()


@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_a_compiled_step_computes_the_eager_losses_and_gradients_and_compiles_once(target, sequences, head):
    """COMPILE_MODES "all" (target forward and each drafter's loss compiled with Inductor) against
    "none": same losses, acceptance estimates and gradients, for the drafter and its rank-0 twin, on
    batches of two lengths; the second length compiles nothing new (make_batch pads the length to a
    multiple of LENGTH_MULTIPLE and always makes num_anchors blocks; without that every new length
    compiled the target's forward and both losses again). The rnn head unrolls its state along the
    block inside the compiled loss; its case weighs the slots by their reach (--reach-weights)."""
    config = training.TrainConfig(batch_size=4, num_anchors=6, reach_weights=head == "rnn")
    longer = [Sequence(s.tokens * 3, s.prompt_len) for s in sequences]  # past one LENGTH_MULTIPLE
    results, graphs, lengths = {}, [], set()
    for compile in ("none", "all"):
        torch.manual_seed(0)
        students = [training.make_student("drafter", target, tiny_drafter_config(target, markov_head_type=head),
                                          config),
                    training.make_student("twin", target, tiny_drafter_config(target, markov_rank=0), config)]
        results[compile] = []
        for data in (sequences, longer):
            batch = training.make_batch(data[:config.batch_size], 3, config, students[0].drafter.block_size)
            lengths.add(batch.tokens.shape[1])
            for student, loss, stats, _ in training.student_losses(target, students, batch, config, compile):
                grads = torch.autograd.grad(loss, [p for p in student.drafter.parameters() if p.requires_grad])
                results[compile].append((loss.detach(), stats.accept, stats.reached, *grads))
            if compile == "all":
                graphs.append(counters["stats"]["unique_graphs"])
    assert len(lengths) == 2
    assert graphs[1] == graphs[0]  # the second length reuses the first one's graphs
    for want, got in zip(results["none"], results["all"], strict=True):
        for a, b in zip(want, got, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="compile must be one of"):
        next(training.student_losses(target, students, batch, config, "everything"))


@pytest.mark.gpu
def test_a_training_step_on_cuda_never_waits_for_the_device(target, sequences):
    """The batch's copy (from pinned memory) and the step (forward, loss, backward, optimizer, the
    statistics) queue work without a synchronizing call, so the host makes the next batch while the
    device computes; reading the statistics is the wait (the control: it fails under the same mode)."""
    target = copy.deepcopy(target).cuda()
    config = training.TrainConfig(batch_size=4, num_anchors=6, rank0_twin=False)
    students = training.make_students(target, tiny_drafter_config(target), config)
    batch = training.make_batch(sequences[:4], 0, config, 4)
    training.train_step(target, students, batch.to("cuda"), config, "none")  # the first calls set things up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stats, _ = training.train_step(target, students, batch.to("cuda"), config, "none")
        with pytest.raises(RuntimeError, match="synchroniz"):
            stats[0].summary()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert stats[0].summary()["loss"] > 0


def test_after_compile_ahead_no_training_step_compiles_again(target, sequences):
    """compile_ahead (run while the data is generated) with throwaway students: the training steps
    of other students, on batches of every length up to its `longest`, compile nothing new. With one
    length (128) ahead, a batch of 704 compiled the drafter's loss again."""
    config = training.TrainConfig(batch_size=4, num_anchors=6, rank0_twin=False)
    drafter_config = tiny_drafter_config(target)
    training.compile_ahead(target, drafter_config, config, longest=700, compile="all")
    graphs = counters["stats"]["unique_graphs"]
    students = training.make_students(target, drafter_config, config)
    generator = torch.Generator().manual_seed(0)
    for step, length in enumerate((690, 300, 130, 512, 641)):
        data = [Sequence(torch.randint(1, VOCAB, (length - 9 * i,), generator=generator).tolist(), 4 + i)
                for i in range(config.batch_size)]
        training.train_step(target, students, training.make_batch(data, step, config, 4), config, "all")
    assert counters["stats"]["unique_graphs"] == graphs

def test_compiled_slot_losses_equal_the_eager_ones():
    """train_step compiles slot_losses on the GPU: the compiled function gives the eager terms,
    acceptance and gradients (Inductor on the CPU; two block counts, one compilation)."""
    g = torch.Generator().manual_seed(0)
    compiled = torch.compile(training.slot_losses, dynamic=True)
    for blocks in (3, 5):
        logits = torch.randn(2, blocks, 4, 50, generator=g, requires_grad=True)
        bias = torch.randn(2, blocks, 4, 50, generator=g, requires_grad=True)
        confidence = torch.randn(2, blocks, 4, generator=g, requires_grad=True)
        labels = torch.randint(0, 50, (2, blocks, 4), generator=g)
        target_logits = torch.randn(2, blocks, 4, 50, generator=g)
        results = []
        for losses in (training.slot_losses, compiled):
            terms, accept, agree, log_ratio = losses(logits, bias, confidence, labels, target_logits,
                                                     0.1, 0.9, 1.0, 0.5, 0.3)
            grads = torch.autograd.grad(terms.sum(), (logits, bias, confidence))
            results.append((terms, accept, agree, log_ratio, *grads))
        for want, got in zip(*results):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_kl_term_is_the_targets_kl_to_the_draft_and_pulls_up_what_the_draft_nearly_zeroes():
    """kl_weight adds w * KL(p || q) to each slot's terms, zero where the draft is the target. On a
    token the draft nearly zeroes (q = 1e-6, p = 0.3) TV's gradient on its logit is about q, and the
    KL's is q - p: only the KL term moves that logit."""
    g = torch.Generator().manual_seed(3)
    logits, target_logits = torch.randn(2, 3, 4, 50, generator=g), torch.randn(2, 3, 4, 50, generator=g)
    labels = torch.randint(0, 50, (2, 3, 4), generator=g)
    plain, _, _, _ = training.slot_losses(logits, None, None, labels, target_logits, 0.1, 0.9, 1.0)
    weighted, _, _, _ = training.slot_losses(logits, None, None, labels, target_logits, 0.1, 0.9, 1.0, 0.0, 0.5)
    p, log_q = target_logits.softmax(-1), logits.log_softmax(-1)
    torch.testing.assert_close(weighted - plain, 0.5 * (p * (p.log() - log_q)).sum(-1))
    same, _, _, _ = training.slot_losses(target_logits, None, None, labels, target_logits, 0.0, 0.0, 1.0, 0.0, 1.0)
    torch.testing.assert_close(same, torch.zeros_like(same), atol=1e-6, rtol=0)

    target = torch.tensor([0.3, 0.7, 0.0]).clamp_min(1e-12).log()
    draft = torch.tensor([1e-6, 1 - 1e-6, 1e-12]).log().requires_grad_()
    label = torch.tensor(1)
    tv_only, = torch.autograd.grad(training.slot_losses(draft, None, None, label, target, 0.0, 1.0, 0.0)[0], draft)
    kl_only, = torch.autograd.grad(
        training.slot_losses(draft, None, None, label, target, 0.0, 0.0, 0.0, 0.0, 1.0)[0], draft)
    assert abs(tv_only[0]) < 1e-5 and kl_only[0] == pytest.approx(-0.3, abs=1e-5)


def test_argmax_term_is_the_cross_entropy_of_the_targets_argmax_and_agreement_counts_argmaxes():
    """argmax_weight adds w * -log q(argmax p) to each slot's terms; agree is 1 exactly where the
    drafter's biased argmax is the target's, and the greedy AL estimate multiplies agreements along a
    block (a drafter equal to the target agrees everywhere: AL 1 + K)."""
    g = torch.Generator().manual_seed(1)
    logits, bias = torch.randn(2, 3, 4, 50, generator=g), torch.randn(2, 3, 4, 50, generator=g)
    labels = torch.randint(0, 50, (2, 3, 4), generator=g)
    target_logits = torch.randn(2, 3, 4, 50, generator=g)
    plain, _, agree, _ = training.slot_losses(logits, bias, None, labels, target_logits, 0.1, 0.9, 1.0)
    weighted, _, _, _ = training.slot_losses(logits, bias, None, labels, target_logits, 0.1, 0.9, 1.0, 0.5)
    log_q = (logits + bias).log_softmax(-1)
    target_ce = -log_q.gather(-1, target_logits.argmax(-1, keepdim=True)).squeeze(-1)
    torch.testing.assert_close(weighted - plain, 0.5 * target_ce)
    assert torch.equal(agree, ((logits + bias).argmax(-1) == target_logits.argmax(-1)).float())
    assert 0 < agree.mean() < 1

    _, _, same, _ = training.slot_losses(target_logits, None, None, labels, target_logits, 0.1, 0.9, 1.0)
    valid = torch.ones(2, 3, 4, dtype=torch.bool)
    summary = training.step_stats(torch.tensor(1.0), torch.ones(2, 3, 4), same, torch.ones(2, 3, 4), valid).summary()
    assert summary["greedy_agreement"] == [1.0] * 4 and summary["al_greedy_estimate"] == 5.0
    mixed = agree.clone()
    mixed[..., 1] = 0  # nothing survives position 1
    summary = training.step_stats(torch.tensor(1.0), torch.ones(2, 3, 4), mixed, torch.ones(2, 3, 4), valid).summary()
    assert summary["al_greedy_estimate"] == pytest.approx(1 + agree[..., 0].mean().item())


def test_reach_estimate_is_the_expected_acceptance_length_of_standard_verification():
    """Along text the target samples, sum_k E[reach_k (1 - TV_k)] is the expected number of drafts
    standard verification accepts. Exact on a toy pair (3 tokens, 3 slots, p and q depending on the
    whole prefix): every text weighed by its probability under p, against the verification process
    itself (draft from q, accept with min(1, p / q), stop at a rejection), enumerated. The control:
    the log's other estimate, prod (1 - TV) along the text, is not it."""
    vocab, slots = 3, 3
    g = torch.Generator().manual_seed(0)
    logits = {}

    def law(prefix: tuple, who: str) -> torch.Tensor:  # log p or log q of the next token after prefix
        if (prefix, who) not in logits:
            logits[prefix, who] = (torch.randn(vocab, generator=g) * 1.5).log_softmax(-1)
        return logits[prefix, who]

    def accepted(prefix: tuple) -> float:  # expected accepted drafts from here on, by the process
        if len(prefix) == slots:
            return 0.0
        p, q = law(prefix, "p").exp(), law(prefix, "q").exp()
        return sum(float(q[x] * min(1.0, p[x] / q[x])) * (1 + accepted(prefix + (x,))) for x in range(vocab))

    texts = list(itertools.product(range(vocab), repeat=slots))
    draft = torch.stack([torch.stack([law(t[:k], "q") for k in range(slots)]) for t in texts])[:, None]
    target_logits = torch.stack([torch.stack([law(t[:k], "p") for k in range(slots)]) for t in texts])[:, None]
    labels = torch.tensor(texts)[:, None]  # [texts, 1 block, slots]
    chance = (target_logits.gather(-1, labels[..., None]).squeeze(-1).sum(-1).exp())[:, 0]  # P(text) under p
    _, accept, _, log_ratio = training.slot_losses(draft, None, None, labels, target_logits, 0.1, 0.9, 1.0)
    reached = training.reach(log_ratio, torch.ones_like(labels, dtype=torch.bool))
    want = accepted(())
    assert (chance * (reached * accept).sum(-1)[:, 0]).sum().item() == pytest.approx(want, abs=1e-5)
    assert abs((chance * accept.cumprod(-1).sum(-1)[:, 0]).sum().item() - want) > 0.01
    assert torch.equal(reached[..., 0], torch.ones(len(texts), 1))


def test_reach_multiplies_min_1_ratio_before_each_slot_and_survives_a_zero_draft_chance():
    log_ratio = torch.tensor([[[0.5, 0.5 ** 0.5, 0.25, 2.0]]]).log()
    log_ratio[0, 0, 1] = float("-inf")  # the draft gives the label no chance: nothing after it is reached
    valid = torch.tensor([[[True, True, True, False]]])
    got = training.reach(log_ratio, valid)
    assert got.isfinite().all()
    torch.testing.assert_close(got, torch.tensor([[[1.0, 0.5, 0.0, 0.0]]]))
    log_ratio[0, 0, 1] = math.log(0.25)
    torch.testing.assert_close(training.reach(log_ratio, valid), torch.tensor([[[1.0, 0.5, 0.125, 0.03125]]]))


def test_reach_weights_keep_each_positions_mean_weight_and_follow_the_reach_within_it():
    g = torch.Generator().manual_seed(0)
    reached = torch.rand(3, 5, 4, generator=g)
    reached[..., 0] = 1.0
    valid = torch.rand(3, 5, 4, generator=g) > 0.2
    plain = training.slot_weights(reached, valid, training.TrainConfig())
    decay = torch.exp(-torch.arange(4) / 4.0)
    torch.testing.assert_close(plain, decay * valid)
    weighted = training.slot_weights(reached, valid, training.TrainConfig(reach_weights=True))
    torch.testing.assert_close((weighted * valid).sum((0, 1)) / valid.sum((0, 1)), decay)
    assert torch.equal(weighted == 0, ~valid)
    torch.testing.assert_close(weighted[valid] / plain[valid], (reached / (reached * valid).sum((0, 1))
                                                                 * valid.sum((0, 1)))[valid])
    assert not torch.allclose(weighted, plain)  # the control: the reach moves the weights


def test_the_command_line_runs_end_to_end_on_the_default_target(tmp_path):
    """`python -m dspark.train --smoke`: the data (4 template prompts and the user messages the
    target wrote, answered) generated by a process of its own while this one compiles the step, then
    a few steps; the drafter is exported and the data caches are complete. A probe of the same
    recipe (--stop-at) on those caches ends at its step, and resumed it ends as the run did."""
    training.main(["--out", str(tmp_path), "--smoke"])
    assert (tmp_path / "drafter" / "model.safetensors").exists()
    written = (tmp_path / "synthetic.jsonl").read_text().splitlines()
    assert len(written) == 1 + 8  # the target's 8 attempts at a user message
    lines = (tmp_path / "sequences.jsonl").read_text().splitlines()
    num_prompts = json.loads(lines[0])["num_prompts"]
    assert 4 < num_prompts <= 4 + 8 and len(lines) == 1 + num_prompts * 6  # the 4 and those it ended
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in log if "loss" in row.get("drafter", {})]
    assert steps == [1, 2, 3, 4]
    # The held-out estimates at steps 2 and 4, on each held-out prompt's greedy and sampled response.
    checks = [row for row in log if "heldout" in row]
    assert [(row["step"], sorted(row["heldout"])) for row in checks] == [(2, ["greedy", "sampled"]),
                                                                          (4, ["greedy", "sampled"])]

    probe = tmp_path / "probe"
    probe.mkdir()
    for cache in ("synthetic.jsonl", "sequences.jsonl", "heldout.jsonl"):
        (probe / cache).write_bytes((tmp_path / cache).read_bytes())
    training.main(["--out", str(probe), "--smoke", "--stop-at", "2"])
    assert torch.load(probe / training.CHECKPOINT, weights_only=True)["step"] == 2
    log = [json.loads(line) for line in (probe / "log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log if "heldout" in row] == [2]
    training.main(["--out", str(probe), "--smoke", "--resume"])
    assert (probe / "drafter" / "model.safetensors").read_bytes() == \
        (tmp_path / "drafter" / "model.safetensors").read_bytes()
