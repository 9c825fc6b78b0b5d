"""`python -m dspark.train`: the options it refuses before any work, the drafter it builds for a
target, and a whole run on the default target (--smoke)."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dspark import train as training
from dspark.config import TargetConfig
from dspark.drafter import DSparkDrafter
from dspark.train import cli, probe
from tiny_training import sequences, target, tiny_drafter_config  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")


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


def test_probes_run_in_turn_on_the_first_probes_data_and_each_runs_until_its_estimate(tmp_path, monkeypatch, capsys):
    """python -m dspark.train.probe, with the training command replaced: the second probe reads the
    first one's data, a probe with its held-out estimate is not run again, and one cut before it
    resumes from its checkpoint. A log line cut by a lost machine is passed over."""
    commands = []

    def train(command, check):
        commands.append(command)
        out = Path(command[command.index("--out") + 1])
        if not (out / "sequences.jsonl").exists():
            (out / "sequences.jsonl").write_text(f"generated by {out.name}\n")
        row = {"step": 4, "heldout": {"sampled": {"drafter": {"al_estimate": 1.0 + len(commands)}},
                                      "greedy": {"drafter": {"al_greedy_estimate": 3.0}}}}
        (out / "log.jsonl").write_text(json.dumps(row) + '\n{"step": 5, "heldo')

    monkeypatch.setattr(probe.subprocess, "run", train)
    argv = ["--out", str(tmp_path), "--stop-at", "4", "--probe", "a=", "--probe", "b=--kl-weight 1.0", "--", "--smoke"]
    probe.main(argv)
    assert [c[c.index("--out") + 1] for c in commands] == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert "--kl-weight" in commands[1] and "--kl-weight" not in commands[0]
    assert all("--smoke" in c and "--resume" not in c for c in commands)
    assert (tmp_path / "b" / "sequences.jsonl").read_text() == "generated by a\n"
    table = capsys.readouterr().out
    assert "| a | `` | 2.00 / 3.00 |" in table and "| b | `--kl-weight 1.0` | 3.00 / 3.00 |" in table

    probe.main(argv)  # both have their estimate
    assert len(commands) == 2
    (tmp_path / "b" / "log.jsonl").unlink()
    (tmp_path / "b" / training.CHECKPOINT).write_bytes(b"")
    probe.main(argv)
    assert len(commands) == 3 and "--resume" in commands[2] and str(tmp_path / "b") in commands[2]
    with pytest.raises(SystemExit):
        probe.main(["--out", str(tmp_path), "--stop-at", "4", "--probe", "a=", "--probe", "a=--lr 1e-3"])
