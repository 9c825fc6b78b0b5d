"""The decode step over a static batch of slots, as the engine runs it: at the smallest batch-size
bucket that holds the slots in use, and on CUDA replayed from a CUDA graph per (bucket, sampling
variant, and number of drafts verified); and the prompt chunks of a step, eager.

A slot is a row of the step's static tensors: tokens [S, K+1] (anchor, drafts), start [S], the
proposals draft_probs [S, K, V], the sampling tensors and the block table [S, M] that says where the
slot's request keeps its keys and values in the models' paged caches. A step over a bucket of b slots
reads and writes slots 0 .. b-1 only, so an engine that fills its low slots first runs a small bucket
while few requests are in flight. A slot no request uses has a block table of zeros (the null block),
so its step writes and reads nothing another request holds. The tensors never move, so a CUDA graph
replays on the addresses it was captured with. An eager step without graphs (the CPU's) is given the
block table trimmed to the widest row of its bucket, so its attention gathers only the blocks the
rows hold.

A graph is captured at the first step of its key (dspark.decoder.capture_step: two warm-up runs,
then the recording) and replayed from then on; the graphs share one memory pool.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from dspark.decoder import SAMPLING_FIELDS, SpeculativeDecoder, capture_step, sampling_rows
from dspark.sampling import SamplingParams, SamplingTensors

IDLE = SamplingParams(temperature=0.0, max_tokens=1)  # the parameters of a slot no request uses


def blocks_per_request(max_model_len: int, k: int, block_size: int) -> int:
    """The blocks a request holds at most: max_model_len positions and the K + 1 that each of two
    steps may write past them (a step is queued before the host has read the one before)."""
    return -(-(max_model_len + 2 * (k + 1)) // block_size)


def default_k_choices(k: int) -> list[int]:
    """The drafts a step may verify when the engine chooses per step (a graph each): 0 (no
    speculation), 1, 3 and the drafter's K, those up to K."""
    return sorted({c for c in (0, 1, 3, k) if c <= k})


def default_buckets(max_batch: int) -> list[int]:
    """Powers of two below max_batch, and max_batch: 1, 2, 4, 8 for 8; 1, 2, 4, 6 for 6."""
    return sorted({min(1 << i, max_batch) for i in range(max_batch.bit_length() + 1)})


class StepRunner:
    """Runs `decoder`'s step over up to `max_batch` slots whose requests hold up to `max_blocks`
    blocks each, in paged caches of `num_blocks` blocks of `block_size` positions that it sets up on
    the decoder's models. cuda_graphs: replay the step from CUDA graphs (default: on a CUDA device)."""

    def __init__(self, decoder: SpeculativeDecoder, max_batch: int, max_blocks: int, num_blocks: int,
                 block_size: int, buckets: list[int] | None = None, cuda_graphs: bool | None = None):
        self.decoder, self.max_batch = decoder, max_batch
        self.buckets = sorted(buckets or default_buckets(max_batch))
        if self.buckets[0] < 1 or self.buckets[-1] != max_batch:
            raise ValueError(f"batch-size buckets must be >= 1 and end at max_batch {max_batch}, "
                             f"got {self.buckets}")
        k, device = decoder.k, decoder.device
        self.cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the decoder is on {device}")
        decoder.target.setup_caches(num_blocks, block_size)
        if decoder.drafter is not None:
            decoder.drafter.setup_caches(num_blocks, block_size)
        self.tokens = torch.zeros(max_batch, k + 1, dtype=torch.long, device=device)  # [anchor, drafts]
        self.start = torch.zeros(max_batch, dtype=torch.long, device=device)  # the anchor's position
        self.draft_probs = torch.zeros(max_batch, k, decoder.target.config.vocab_size, device=device)
        self.block_table = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.widths = [0] * max_batch  # blocks listed in each slot's row of block_table
        self.params = [IDLE] * max_batch
        self._sampling = SamplingTensors.from_params(self.params, device)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self._pool = None
        self.caches = self._model_caches()

    def _model_caches(self) -> tuple:
        """The models' first-layer caches (setup_caches and drop_caches replace every layer's at once)."""
        drafter = self.decoder.drafter
        return self.decoder.target.layers[0].kv_cache, drafter and drafter.layers[0].context_cache

    def _check_caches(self) -> None:
        """Refuses to run on caches other than the ones set up here: the requests in flight are in those."""
        if any(now is not ours for now, ours in zip(self._model_caches(), self.caches)):
            raise RuntimeError("the models' caches are no longer this StepRunner's: something set up others on "
                               "the same target or drafter (a generate call?), and the requests in flight lost "
                               "their context; serve and generate with separate model instances")

    def bucket(self, slots: int) -> int:
        """The smallest bucket that holds slots 0 .. slots-1."""
        return next(b for b in self.buckets if b >= slots)

    def set_blocks(self, slot: int, blocks: Sequence[int]) -> None:
        """The slot's row of the block table: its request's blocks (none: the null block)."""
        if len(blocks) == self.widths[slot] and blocks:
            return  # a request's blocks only grow: same count, same blocks
        row = torch.zeros(self.block_table.shape[1], dtype=torch.int32)
        row[:len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.block_table[slot] = row.to(self.block_table.device, non_blocking=True)
        self.widths[slot] = len(blocks)

    def set_params(self, params: list[SamplingParams] | dict[int, SamplingParams]) -> None:
        """The sampling parameters of every slot ([max_batch]) or of some ({slot: params}); IDLE for
        a slot no request uses."""
        changes = params if isinstance(params, dict) else dict(enumerate(params))
        new = SamplingTensors.from_params(list(changes.values()), self.tokens.device)
        index = torch.tensor(list(changes)).to(self.tokens.device, non_blocking=True)  # no wait for a step in flight
        for name in SAMPLING_FIELDS:
            getattr(self._sampling, name)[index] = getattr(new, name)
        for slot, slot_params in changes.items():
            self.params[slot] = slot_params

    def sampling(self, index: slice | torch.Tensor, params: list[SamplingParams]) -> SamplingTensors:
        """The sampling tensors of these slots (views or copies) with their parameters' flags."""
        rows = sampling_rows(self._sampling, index)
        rows.uses_filters = any(p.uses_filters for p in params)
        rows.all_greedy = all(p.greedy for p in params)
        rows.wants_logprobs = any(p.logprobs is not None for p in params)
        return rows

    def _table(self, batch: int) -> torch.Tensor:
        """Slots 0 .. batch-1's block table: whole for a compiled step or a CUDA graph (static shapes),
        else as wide as its widest row."""
        if self.cuda_graphs or self.decoder.compiled:
            return self.block_table[:batch]
        return self.block_table[:batch, :max(1, max(self.widths[:batch]))]

    def draft(self, slots: Sequence[int]) -> None:
        """Draws the drafts of these slots from their anchors (after their admission); the other
        slots' drafts and proposals stay as they are."""
        self._check_caches()
        index = torch.tensor(list(slots), device=self.tokens.device)
        sampling = self.sampling(index, [self.params[slot] for slot in slots])
        table = self.block_table[index, :max(1, max(self.widths[slot] for slot in slots))]
        self.tokens[index, 1:] = self.decoder.draft(self.tokens[index, 0], self.start[index], self.draft_probs,
                                                    sampling, table, slots=index)

    def prefill(self, tokens: list[list[int]], begins: list[int], blocks: list[list[int]],
                params: list[SamplingParams] | None, next_tokens: list[list[int]] | None = None):
        """One chunk of each of some requests' prompts, all of one length (SpeculativeDecoder.prefill):
        tokens [n][L], each at positions begins[i] .. begins[i]+L-1, its request's blocks; with
        `params` (the chunks end their prompts), the requests' first tokens [n]; with next_tokens
        [n][L] (-1 where none), their log-probabilities. -> (first tokens, log-probabilities)."""
        self._check_caches()
        device = self.tokens.device
        table = torch.zeros(len(blocks), max(map(len, blocks)), dtype=torch.int32)
        for row, held in zip(table, blocks):
            row[:len(held)] = torch.tensor(held, dtype=torch.int32)
        sampling = None if params is None else SamplingTensors.from_params(params, device)
        following = None if next_tokens is None else torch.tensor(next_tokens, device=device)
        return self.decoder.prefill(torch.tensor(tokens, device=device), begins, table.to(device), sampling, following)

    def step(self, batch: int, k: int | None = None) -> tuple[torch.Tensor, ...]:
        """One step of slots 0 .. batch-1 (a bucket) verifying k drafts (default all K) -> emitted
        [b, k+1], num_accepted [b], next tokens [b, K+1], next start [b], log-probabilities or None
        (see SpeculativeDecoder._step). It leaves tokens and start as they are; on CUDA graphs the
        outputs are the graph's and hold until the next step."""
        if batch not in self.buckets:
            raise ValueError(f"batch {batch} is not one of the buckets {self.buckets}")
        k = self.decoder.k if k is None else k
        if not 0 <= k <= self.decoder.k:
            raise ValueError(f"a step verifies 0 .. {self.decoder.k} drafts, not {k}")
        self._check_caches()
        args = (self.tokens[:batch], self.start[:batch], self.draft_probs[:batch],
                self.sampling(slice(0, batch), self.params[:batch]), self._table(batch))
        step = functools.partial(self.decoder.step, k=k)
        if not self.cuda_graphs:
            return step(*args)
        sampling = args[3]
        key = (batch, k, sampling.all_greedy, sampling.uses_filters, sampling.wants_logprobs)
        if key not in self.graphs:
            self.graphs[key] = self._capture(step, args)
        graph, outputs = self.graphs[key]
        graph.replay()
        return outputs

    def _capture(self, step, args: tuple) -> tuple[torch.cuda.CUDAGraph, tuple]:
        graph, outputs = capture_step(step, args, self.draft_probs, self._pool)
        self._pool = graph.pool()
        return graph, outputs
