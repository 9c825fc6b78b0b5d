"""Drafter training's checkpoints: a resumed run is the uninterrupted one, a resume with other
settings is refused, and the export holds the trained weights in DeepSpec's format."""
import dataclasses
import json

import pytest
import torch

from dspark import train as training
from dspark.checkpoint import load_drafter
from dspark.config import TargetConfig
from dspark.target import TargetModel
from dspark.train import loop
from tiny_training import VOCAB, sequences, target, tiny_drafter_config  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")


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
