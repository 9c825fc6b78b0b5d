"""Drafter training by self-distillation, DeepSpec's recipe: `python -m dspark.train --help` (cli.py)
tells the whole of it. One job per module, each importing only those above it in this list:

    recipe    TrainConfig, the drafter trained for a target
    schedule  the learning-rate schedule, the time budget
    batches   which sequences a step reads, its anchors, the padded Batch
    loss      DeepSpec's loss and the acceptance estimates (Stats)
    students  a drafter with its optimizer and schedule
    step      one optimizer step, eager or compiled; compiling ahead; held-out estimates
    resume    the run's checkpoint and the export in DeepSpec's format
    loop      train(): steps, logs, checks, checkpoints
    cli       the command: data generation beside compilation, then train()

Two tools stand beside the command (they import from the package; nothing in it imports them):

    probe              python -m dspark.train.probe: recipes trained to one step on one data set
    heldout_estimates  python -m dspark.train.heldout_estimates: the log's held-out estimates of
                       trained drafters, without decoding
"""
from dspark.train.batches import Batch, BatchOrder, FollowUps, heldout_batches, make_batch
from dspark.train.cli import MASK_TOKEN, generate_data, heldout_sequences, main, parse_args
from dspark.train.loop import train
from dspark.train.loss import Stats, dspark_loss, reach, slot_losses, slot_weights, step_stats
from dspark.train.recipe import TrainConfig, build_target_layer_ids, default_drafter_config
from dspark.train.resume import CHECKPOINT, export
from dspark.train.schedule import TimeBudget, warmup_cosine
from dspark.train.step import COMPILE_MODES, compile_ahead, evaluate_students, student_losses, train_step
from dspark.train.students import Student, make_student, make_students

__all__ = ["Batch", "BatchOrder", "CHECKPOINT", "COMPILE_MODES", "FollowUps", "MASK_TOKEN", "Stats", "Student",
           "TimeBudget", "TrainConfig", "build_target_layer_ids", "compile_ahead", "default_drafter_config",
           "dspark_loss", "evaluate_students", "export", "generate_data", "heldout_batches", "heldout_sequences",
           "main", "make_batch", "make_student", "make_students", "parse_args", "reach", "slot_losses",
           "slot_weights", "step_stats", "student_losses", "train", "train_step", "warmup_cosine"]
