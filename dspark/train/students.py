"""A drafter being trained (Student): the drafter, its AdamW optimizer and its learning-rate schedule."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

from dspark.config import DrafterConfig
from dspark.drafter import DSparkDrafter
from dspark.target import TargetModel
from dspark.train.recipe import TrainConfig
from dspark.train.schedule import warmup_cosine


@dataclass
class Student:
    """One drafter being trained, with its optimizer and schedule."""
    name: str  # also its export folder
    drafter: DSparkDrafter
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR

    def trainable(self) -> set[str]:
        """The state-dict names of the drafter's trained weights (the shared embedding and LM head are
        frozen)."""
        frozen = {id(p) for p in self.drafter.parameters() if not p.requires_grad}
        return {n for n, t in self.drafter.state_dict(keep_vars=True).items() if id(t) not in frozen}

    def state_dict(self) -> dict:
        trainable = self.trainable()
        return {"weights": {n: t for n, t in self.drafter.state_dict().items() if n in trainable},
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        missing, unexpected = self.drafter.load_state_dict(state["weights"], strict=False)
        trainable = self.trainable()
        if unexpected or trainable & set(missing):  # frozen (shared, maybe tied) weights are not saved
            raise ValueError(f"checkpoint does not fit drafter {self.name!r}: missing "
                             f"{sorted(trainable & set(missing))}, unexpected {sorted(unexpected)}")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.follow(self.scheduler.lr_lambdas[0])  # the saved rate is the saved schedule's; a resume may change --steps

    def follow(self, schedule: Callable[[int], float]) -> None:
        """Takes `schedule` (step -> learning-rate factor) from the current step on, this step included:
        the optimizer's rate was set by the old schedule when the last step ended."""
        self.scheduler.lr_lambdas[0] = schedule
        step = self.scheduler.last_epoch
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * schedule(step)


def make_student(name: str, target: TargetModel, config: DrafterConfig, train: TrainConfig) -> Student:
    """A fresh drafter, its initial weights a function of `train.seed` alone (the global random
    state is left as it was), so that a twin begins with the drafter's backbone."""
    with torch.random.fork_rng(devices=[]):  # the weights are drawn on the CPU, then moved
        torch.manual_seed(train.seed)
        drafter = DSparkDrafter(config, embed_tokens=target.embed_tokens, lm_head=target.lm_head)
    drafter.to(target.embed_tokens.weight.device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=train.lr, weight_decay=0.0)
    return Student(name, drafter, optimizer, LambdaLR(optimizer, warmup_cosine(train.steps, train.warmup)))


def make_students(target: TargetModel, config: DrafterConfig, train: TrainConfig) -> list[Student]:
    """The drafter, and its rank-0 twin when the recipe asks for one."""
    students = [make_student("drafter", target, config, train)]
    if train.rank0_twin:
        students.append(make_student("drafter-rank0", target, dataclasses.replace(config, markov_rank=0), train))
    return students
