"""The decode step over a static batch of cache rows, as a server runs it: at the smallest batch-size
bucket that holds the rows in use, and on CUDA replayed from a CUDA graph per (bucket, sampling
variant).

Rows are the target's and the drafter's cache rows. A step over a bucket of b rows reads and writes
rows 0 .. b-1 only (the models' default rows, views of their caches), so a server that fills its low
rows first runs a small bucket while few requests are in flight. The step's inputs live in buffers
that never move (tokens, start, draft_probs and the sampling tensors, updated in place), so a CUDA
graph replays on the addresses it was captured with.

A graph is captured at the first step of its key (dspark.decoder.capture_step: two warm-up runs,
then the recording) and replayed from then on; the graphs share one memory pool.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from dspark.decoder import SpeculativeDecoder, capture_step
from dspark.sampling import SamplingParams, SamplingTensors

IDLE = SamplingParams(temperature=0.0, max_tokens=1)  # the parameters of a row no request uses
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed")


def default_buckets(max_batch: int) -> list[int]:
    """Powers of two below max_batch, and max_batch: 1, 2, 4, 8 for 8; 1, 2, 4, 6 for 6."""
    return sorted({min(1 << i, max_batch) for i in range(max_batch.bit_length() + 1)})


class StepRunner:
    """Runs `decoder`'s step over up to `max_batch` cache rows of `max_model_len` tokens (plus the
    K + 2 a last step may write past it). cuda_graphs: replay the step from CUDA graphs (default:
    on a CUDA device)."""

    def __init__(self, decoder: SpeculativeDecoder, max_batch: int, max_model_len: int,
                 buckets: list[int] | None = None, cuda_graphs: bool | None = None):
        self.decoder, self.max_batch = decoder, max_batch
        self.buckets = sorted(buckets or default_buckets(max_batch))
        if self.buckets[0] < 1 or self.buckets[-1] != max_batch:
            raise ValueError(f"batch-size buckets must be >= 1 and end at max_batch {max_batch}, "
                             f"got {self.buckets}")
        k, device = decoder.k, decoder.device
        self.cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the decoder is on {device}")
        cache_len = max_model_len + k + 2
        decoder.target.setup_caches(max_batch, cache_len)
        if decoder.drafter is not None:
            decoder.drafter.setup_caches(max_batch, cache_len)
        self.tokens = torch.zeros(max_batch, k + 1, dtype=torch.long, device=device)  # [anchor, drafts]
        self.start = torch.zeros(max_batch, dtype=torch.long, device=device)  # the anchor's position
        self.draft_probs = torch.zeros(max_batch, k, decoder.target.config.vocab_size, device=device)
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
        """Refuses to run on caches other than the ones set up here: the rows in flight are in those."""
        if any(now is not ours for now, ours in zip(self._model_caches(), self.caches)):
            raise RuntimeError("the models' caches are no longer this StepRunner's: something set up others on "
                               "the same target or drafter (a generate call?), and the requests in flight lost "
                               "their context; serve and generate with separate model instances")

    def bucket(self, rows: int) -> int:
        """The smallest bucket that holds rows 0 .. rows-1."""
        return next(b for b in self.buckets if b >= rows)

    def set_params(self, params: list[SamplingParams]) -> None:
        """Every row's sampling parameters ([max_batch]; IDLE for rows no request uses)."""
        new = SamplingTensors.from_params(params, self.tokens.device)
        for name in SAMPLING_FIELDS:
            getattr(self._sampling, name).copy_(getattr(new, name))
        self.params = list(params)

    def sampling(self, batch: int) -> SamplingTensors:
        """The sampling tensors of rows 0 .. batch-1 (views) with their flags."""
        return self._sampling_of(slice(0, batch), self.params[:batch])

    def _sampling_of(self, index: slice | torch.Tensor, params: list[SamplingParams]) -> SamplingTensors:
        return dataclasses.replace(self._sampling, **{n: getattr(self._sampling, n)[index] for n in SAMPLING_FIELDS},
                                   uses_filters=any(p.uses_filters for p in params),
                                   all_greedy=all(p.greedy for p in params))

    def draft(self, rows: Sequence[int]) -> None:
        """Draws the drafts of these rows from their anchors (after their admission); the other
        rows' drafts and proposals stay as they are."""
        self._check_caches()
        index = torch.tensor(list(rows), device=self.tokens.device)
        sampling = self._sampling_of(index, [self.params[row] for row in rows])
        self.tokens[index, 1:] = self.decoder.draft(self.tokens[index, 0], self.start[index], self.draft_probs,
                                                    sampling, rows=index)

    def step(self, batch: int) -> tuple[torch.Tensor, ...]:
        """One step of rows 0 .. batch-1 (a bucket) -> emitted [b, K+1], num_accepted [b], next
        tokens [b, K+1], next start [b] (see SpeculativeDecoder._step). It leaves tokens and start
        as they are; on CUDA graphs the outputs are the graph's and hold until the next step."""
        if batch not in self.buckets:
            raise ValueError(f"batch {batch} is not one of the buckets {self.buckets}")
        self._check_caches()
        args = (self.tokens[:batch], self.start[:batch], self.draft_probs[:batch], self.sampling(batch))
        if not self.cuda_graphs:
            return self.decoder.step(*args)
        key = (batch, args[-1].all_greedy, args[-1].uses_filters)
        if key not in self.graphs:
            self.graphs[key] = self._capture(args)
        graph, outputs = self.graphs[key]
        graph.replay()
        return outputs

    def _capture(self, args: tuple) -> tuple[torch.cuda.CUDAGraph, tuple]:
        graph, outputs = capture_step(self.decoder.step, args, self.draft_probs, self._pool)
        self._pool = graph.pool()
        return graph, outputs
