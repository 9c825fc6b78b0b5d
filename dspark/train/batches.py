"""What a training step reads: which sequences (BatchOrder), where their blocks start (pick_anchors,
FollowUps), padded into a Batch (make_batch). All functions of (seed, step, follow-ups), so a
resumed run sees the batches an uninterrupted one would."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.data import Sequence
from dspark.train.recipe import TrainConfig

LENGTH_MULTIPLE = 64  # batches are padded to a multiple of this many tokens


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, S] right-padded sequences
    anchors: torch.Tensor  # [B, N] block anchor positions (0 for padding blocks)
    valid: torch.Tensor  # [B, N, K] bool: slot k of block n has a label in the response

    def to(self, device: torch.device) -> Batch:
        """The batch on `device`; to a GPU from pinned memory, without waiting for the work queued
        before it (a copy from pageable memory would wait for the device)."""
        if torch.device(device).type != "cuda":
            return Batch(self.tokens.to(device), self.anchors.to(device), self.valid.to(device))
        tensors = (self.tokens, self.anchors, self.valid)
        return Batch(*(t.pin_memory().to(device, non_blocking=True) for t in tensors))


class BatchOrder:
    """Which sequences each step trains on. Every epoch is a seeded permutation of the sequences,
    cut into runs of `config.bucket_batches` batches; each run is sorted by length and cut into
    batches, and the epoch's batches are shuffled. So every sequence is seen once an epoch (but for
    the last len % batch_size of the permutation). With bucket_batches = 1 (the default) a batch
    holds random sequences, padded to its longest: about twice its real tokens on the self-distilled
    data's lengths (short chat prompts beside stdlib code of up to 512 tokens); buckets pad far less,
    and the target's forward shrinks with them. But buckets of similar lengths are batches of similar
    prompts (the long ones are code), and the run trained with them reached lower estimates at a
    given step than random batches, by more than its faster steps made up (docs/training.md, the
    recipes tried). A function of (lengths, config, step), so a resumed run sees the same batches."""

    def __init__(self, lengths: list[int], config: TrainConfig):
        if len(lengths) < config.batch_size:
            raise ValueError(f"{len(lengths)} sequences cannot fill a batch of {config.batch_size}")
        if config.bucket_batches < 1:
            raise ValueError(f"bucket_batches must be >= 1, got {config.bucket_batches}")
        self.lengths, self.batch_size, self.seed = lengths, config.batch_size, config.seed
        self.bucket_batches = config.bucket_batches
        self.batches_per_epoch = len(lengths) // config.batch_size
        self.cached: tuple[int, list[list[int]]] | None = None  # (epoch, its batches)

    def epoch(self, epoch: int) -> list[list[int]]:
        """The batches of `epoch`, in their order (sequence indices)."""
        if self.cached is None or self.cached[0] != epoch:
            self.cached = epoch, self._batches(epoch)
        return self.cached[1]

    def _batches(self, epoch: int) -> list[list[int]]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        order = order[:self.batches_per_epoch * self.batch_size]
        run = self.bucket_batches * self.batch_size
        order = [i for begin in range(0, len(order), run)
                 for i in sorted(order[begin:begin + run], key=self.lengths.__getitem__)]
        batches = [order[b * self.batch_size:(b + 1) * self.batch_size] for b in range(self.batches_per_epoch)]
        return [batches[b] for b in torch.randperm(len(batches), generator=generator).tolist()]

    def __call__(self, step: int) -> list[int]:
        return self.epoch(step // self.batches_per_epoch)[step % self.batches_per_epoch]


class FollowUps:
    """Where a greedy decode would draft next from each sequence's anchors at its last visit. From
    anchor p, whose first n(p) slots agree with the target's argmax, a decoder at T = 0 accepts n(p)
    drafts and drafts its next block from p + n(p) + 1, the target's own token (after a miss, unless
    all K drafts agreed). Uniform anchors under-sample those positions, so the log's estimates
    exceed the decoded AL (docs/training.md, "The log's estimates and decoded AL"); make_batch places a share `config.followup_anchors` of a sequence's anchors on them. Exact
    on greedy responses; on sampled ones, whose tokens leave the argmax path, a proxy for the same
    (positions after a disagreement). Saved with the checkpoint, so a resumed run continues exactly."""

    def __init__(self, num_sequences: int, num_anchors: int):
        self.table = torch.full((num_sequences, num_anchors), -1, dtype=torch.int32)  # -1: none

    def __getitem__(self, indices: list[int]) -> list[torch.Tensor]:
        """The follow-up positions of these sequences (none before their first visit)."""
        return [row[row >= 0].long() for row in self.table[indices]]

    def update(self, indices: list[int], batch: Batch, agree: torch.Tensor) -> None:
        """Records the follow-ups of the batch (on the CPU) of sequences `indices`, from its argmax
        agreements agree [B, N, K] (1.0 where the slot's argmax is the target's)."""
        runs = (agree * batch.valid).cumprod(-1).sum(-1).long()  # [B, N] leading agreements
        self.table[indices] = torch.where(batch.valid[..., 0], batch.anchors + runs + 1, -1).int()


def pick_anchors(seq: Sequence, generator: torch.Generator, config: TrainConfig,
                 followed_up: torch.Tensor | None) -> torch.Tensor:
    """Up to `num_anchors` sorted anchors p among the response positions with a label at p + 1
    (prompt_len <= p < len - 1): the sequence's follow-up positions `followed_up` that are such
    positions (a share `followup_anchors` of the anchors at most, a random choice when there are
    more), the rest random."""
    order = torch.randperm(len(seq.tokens) - 1 - seq.prompt_len, generator=generator) + seq.prompt_len
    if followed_up is None or not config.followup_anchors:
        return order[:config.num_anchors].sort().values
    inside = followed_up[(followed_up >= seq.prompt_len) & (followed_up < len(seq.tokens) - 1)].unique()
    share = round(config.followup_anchors * config.num_anchors)
    followed = inside[torch.randperm(len(inside), generator=generator)][:share]
    rest = order[~torch.isin(order, followed)][:config.num_anchors - len(followed)]
    return torch.cat([followed, rest]).sort().values


def make_batch(chosen: list[Sequence], step: int, config: TrainConfig, block_size: int,
               followups: list[torch.Tensor] | None = None) -> Batch:
    """Step `step`'s sequences (see BatchOrder), padded to a multiple of LENGTH_MULTIPLE, with up to
    `num_anchors` anchors each (pick_anchors; `followups`: each sequence's, see FollowUps; always
    `num_anchors` blocks, the missing ones padding). So a batch's shape varies only in its length,
    and only in whole multiples: a compiled step (COMPILE_MODES) then compiles once, where other
    lengths' alignments would each compile again. The anchors are a function of (seed, step,
    followups)."""
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    followups = followups or [None] * len(chosen)
    picked = [pick_anchors(s, generator, config, f) for s, f in zip(chosen, followups, strict=True)]
    longest = max(len(s.tokens) for s in chosen)
    length, num_blocks = -(-longest // LENGTH_MULTIPLE) * LENGTH_MULTIPLE, config.num_anchors
    tokens = torch.zeros(len(chosen), length, dtype=torch.long)
    anchors = torch.zeros(len(chosen), num_blocks, dtype=torch.long)
    valid = torch.zeros(len(chosen), num_blocks, block_size, dtype=torch.bool)
    for row, (seq, p) in enumerate(zip(chosen, picked)):
        tokens[row, :len(seq.tokens)] = torch.tensor(seq.tokens)
        anchors[row, :len(p)] = p
        valid[row, :len(p)] = p[:, None] + torch.arange(1, block_size + 1) < len(seq.tokens)
    return Batch(tokens, anchors, valid)


def heldout_batches(sequences: list[Sequence], config: TrainConfig, block_size: int) -> list[Batch]:
    """Fixed batches (sequences and anchors) of every held-out sequence, in order, `config.batch_size`
    a batch (the last may be shorter), to follow generalization."""
    size = config.batch_size
    return [make_batch(sequences[begin:begin + size], begin // size, config, block_size)
            for begin in range(0, len(sequences), size)]
