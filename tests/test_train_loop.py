"""Drafter training's loop: it learns, it logs, its students start from the seed, and its time
budget ends the run (and fits the schedule) on time."""
import dataclasses
import json

import pytest
import torch

from dspark import train as training
from dspark.decoder import SpeculativeDecoder
from dspark.engine import generate
from dspark.drafter import DSparkDrafter
from dspark.train.self_distill import self_distill
from dspark.sampling import SamplingParams
from dspark.target import TargetModel
from dspark.train import loop, schedule
from tiny_training import random_prompts, sequences, target, tiny_drafter_config  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")


def greedy_acceptance_length(target: TargetModel, drafter: DSparkDrafter) -> float:
    decoder = SpeculativeDecoder(target, drafter, num_speculative_tokens=drafter.block_size)
    results = generate(decoder, random_prompts(8, seed=2), SamplingParams(temperature=0.0, max_tokens=24))
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
