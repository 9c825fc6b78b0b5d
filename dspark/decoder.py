"""Speculative decoding: one static step function, and the prompt chunks before it.

The step is a function of static-shaped tensors (no `.item()`, no host sync, no branch on tensor
values), so torch.compile compiles it whole and a CUDA graph can capture it:

    target forward over [anchor, d_1 .. d_K]  ->  verification  ->  drafter context append
    ->  drafter block  ->  ancestral drafting + proposal write

The host loop that runs it is the engine's (dspark.engine; offline generation is a client of it,
dspark.engine.offline.generate). On CUDA a step replays from a CUDA graph (`capture_step`; a large
batch's eager step is bound by its kernel launches), and the host reads a step's tokens through
`Readback` while the next step runs.
`drafter=None` (K = 0) runs the same step without speculation: the baseline of every benchmark.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from dspark.drafter import DSparkDrafter
from dspark.drafting import ancestral_draft, greedy_draft
from dspark.ops.verify import greedy_verify, verify
from dspark.output import StopCondition
from dspark.sampling import SamplingParams, SamplingTensors, apply_filters, is_int, token_logprobs
from dspark.target import TargetModel

VERIFY_METHODS = ("standard", "block")
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed")  # SamplingTensors' per-row tensors
RECOMPILE_LIMIT = 64  # graphs of a compiled step: 3 sampling variants x cache shapes (powers of two)
# The attention kernels a prompt chunk may use: not cuDNN's, which builds an execution plan for every
# new shape (python -m bench.prefill compares), and chunks meet a new shape with every length. Decode
# steps read the cache through dspark::paged_attention.
PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sampling_rows(sampling: SamplingTensors, index: torch.Tensor | slice) -> SamplingTensors:
    """The sampling tensors of some rows of a batch, with the batch's flags (a row without a filter
    passes through apply_filters unchanged, and a greedy row takes its argmax on either path)."""
    return dataclasses.replace(sampling, **{name: getattr(sampling, name)[index] for name in SAMPLING_FIELDS})


class Readback:
    """The copies to the host of some of a step's outputs (its emitted tokens, accepted counts, ...),
    into buffers made once (pinned on CUDA): `start` queues them behind the step, `lists` waits for
    them, so the host may queue the next step in between."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        pinned = tensors[0].device.type == "cuda"
        self.buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in tensors]
        self.copied = torch.cuda.Event() if pinned else None

    def start(self, tensors: Sequence[torch.Tensor]) -> None:
        for buffer, source in zip(self.buffers, tensors):
            buffer.copy_(source, non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def lists(self) -> list[list]:
        if self.copied is not None:
            self.copied.synchronize()
        return [buffer.tolist() for buffer in self.buffers]


def capture_step(step: Callable, args: tuple, scratch: torch.Tensor, pool=None):
    """A CUDA graph of `step(*args)`, whose inputs are buffers that never move -> (graph, outputs);
    a replay runs the step on the buffers' current values and writes `outputs` in place. The step
    runs twice on a side stream to warm up (compiling it, if compiled) before it is recorded. That
    leaves what one plain call leaves, because the step is a function of its buffers (noise keyed by
    seeds and positions) and a rerun writes the same cache entries; only `scratch` (the proposals
    each run overwrites) is put back before each rerun. `pool`: a memory pool to share."""
    saved = scratch.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step(*args)
            scratch.copy_(saved)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = step(*args)
    return graph, outputs


def _compile_step(step: Callable) -> Callable:
    """torch.compile(fullgraph=True) of the step. Dynamo keeps the models' cache buffers static,
    so each cache shape is a graph of its own: offline generation sizes a compiled decoder's caches
    in powers of two (dspark.engine.offline), and the recompile limit is raised from Dynamo's 8 to what the
    sampling variants times those shapes can need."""
    compiled = torch.compile(step, fullgraph=True)

    @functools.wraps(step)
    def run(*args, **kwargs):
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return compiled(*args, **kwargs)
    return run


class SpeculativeDecoder:
    """Lossless speculative decoding with a DSpark drafter (or none).

    num_speculative_tokens: K drafts per step (alias max_draft_len), at most the drafter's
        block size; defaults to it. K = 0 or drafter=None decodes without speculation.
    rejection_sample_method: "standard" (token-level) or "block" (Sun et al. 2024).
    use_rejection_sampling: False drafts the greedy argmax chain with one-hot proposals
        (still lossless: verification accepts a one-hot draft with probability p(d)).
    forced_num_accepted: benchmarks only. Every step accepts exactly this many drafts, so a
        step can be timed at a fixed acceptance length. The output is then NOT the target's.
    compile: torch.compile(fullgraph=True) the step function (see _compile_step).
    """

    def __init__(self, target: TargetModel, drafter: DSparkDrafter | None = None,
                 num_speculative_tokens: int | None = None, rejection_sample_method: str = "standard",
                 use_rejection_sampling: bool = True, tokenizer=None,
                 forced_num_accepted: int | None = None, compile: bool = False,
                 max_draft_len: int | None = None):
        if None not in (num_speculative_tokens, max_draft_len) and num_speculative_tokens != max_draft_len:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} and its alias "
                             f"max_draft_len={max_draft_len} disagree")
        k = num_speculative_tokens if num_speculative_tokens is not None else max_draft_len
        if k is None:
            k = drafter.config.block_size if drafter is not None else 0
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"num_speculative_tokens must be an int >= 0, got {k!r}")
        if drafter is None and k > 0:
            raise ValueError(f"num_speculative_tokens={k} needs a drafter (got drafter={drafter!r})")
        if drafter is not None and k > drafter.config.block_size:
            raise ValueError(f"num_speculative_tokens={k} exceeds the drafter's block_size "
                             f"{drafter.config.block_size}")
        if drafter is not None:
            drafter.config.check_fits(target.config)
            ours, theirs = drafter.fc.weight, target.embed_tokens.weight
            if (ours.dtype, ours.device) != (theirs.dtype, theirs.device):
                raise ValueError(f"the drafter is {ours.dtype} on {ours.device}, the target {theirs.dtype} on "
                                 f"{theirs.device}: load them in one dtype on one device")
        if rejection_sample_method not in VERIFY_METHODS:
            raise ValueError(f"rejection_sample_method must be one of {VERIFY_METHODS}, "
                             f"got {rejection_sample_method!r}")
        if forced_num_accepted is not None and not 0 <= forced_num_accepted <= k:
            raise ValueError(f"forced_num_accepted={forced_num_accepted} is not in [0, {k}]")
        self.target, self.drafter = target, (drafter if k > 0 else None)
        self.k = k
        self.block_verify = rejection_sample_method == "block"
        self.greedy_drafts = not use_rejection_sampling
        self.tokenizer = tokenizer
        self.forced_num_accepted = forced_num_accepted
        self.layer_ids = tuple(self.drafter.config.target_layer_ids) if self.drafter else ()
        self.compiled = compile
        self._compiled_steps: dict[int, Callable] = {}  # per number of drafts verified

    @property
    def device(self) -> torch.device:
        return self.target.embed_tokens.weight.device

    def check_prompt(self, prompt, name: str = "the prompt") -> None:
        """Raises ValueError, naming `name`, unless `prompt` is a non-empty list of the target's token ids."""
        if not (isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt)):
            raise ValueError(f"{name} must be a list of token ids (ints), got {prompt!r:.80}")
        if not prompt:
            raise ValueError(f"{name} is empty: it needs at least one token")
        vocab = self.target.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name} has token ids outside [0, {vocab}): {bad[:5]}")

    def stop_condition(self, params: SamplingParams, prompt: Sequence[int] = ()) -> StopCondition:
        """The stop condition of a request: its stops, max_tokens, and the model's EOS tokens; stop
        strings are looked for in the text the tokens add to `prompt`'s."""
        eos = set(self.target.config.eos_token_ids) | set(getattr(self.tokenizer, "eos_token_ids", ()) or ())
        return StopCondition(params, sorted(eos), self.tokenizer, prompt)

    # ------------------------------------------------------------------ the static step

    def step(self, tokens: torch.Tensor, start: torch.Tensor, draft_probs: torch.Tensor, sampling: SamplingTensors,
             block_table: torch.Tensor, k: int | None = None):
        """One step (`_step`), through torch.compile when the decoder compiles (a graph per k)."""
        k = self.k if k is None else k
        if not self.compiled:
            return self._step(tokens, start, draft_probs, sampling, block_table, k)
        if k not in self._compiled_steps:
            self._compiled_steps[k] = _compile_step(functools.partial(self._step, k=k))
        return self._compiled_steps[k](tokens, start, draft_probs, sampling, block_table)

    def _step(self, tokens: torch.Tensor, start: torch.Tensor, draft_probs: torch.Tensor,
              sampling: SamplingTensors, block_table: torch.Tensor, k: int):
        """tokens: [B, K+1] (anchor, drafts); start: [B] position of the anchor;
        draft_probs: [B, K, V] proposals of the drafts; block_table: [B, M] the rows' KV blocks, which
        must hold positions start .. start+k (written here). k <= K: the drafts verified (a prefix of
        the block verifies losslessly; the drafter still drafts all K for the next step, but at k = 0
        it drafts nothing: the next tokens keep the old drafts, which a later step may verify only
        after they are drawn again from the new anchor).
        Returns emitted [B, k+1] (-1 padded), num_accepted [B], next tokens [B, K+1], next start [B],
        and when the batch wants them, the emitted tokens' log-probabilities (sampling.token_logprobs:
        chosen [B, k+1], top ids and values [B, k+1, MAX_LOGPROBS]), else None."""
        positions = start[:, None] + torch.arange(k + 1, device=start.device)
        logits, hidden = self.target(tokens[:, :k + 1], positions, block_table, hidden_layer_ids=self.layer_ids)
        emitted, num_accepted = self._verify(logits, tokens[:, 1:k + 1], draft_probs, sampling, start)
        if self.forced_num_accepted is not None:
            emitted, num_accepted = self._force_acceptance(tokens[:, :k + 1], logits)
        logprobs = token_logprobs(logits, emitted) if sampling.wants_logprobs else None
        anchor = emitted.gather(1, num_accepted[:, None]).squeeze(1)
        next_start = start + num_accepted + 1
        if self.drafter is None:
            return emitted, num_accepted, anchor[:, None], next_start, logprobs
        self.drafter.append_context(hidden, positions, block_table)
        drafts = self.draft(anchor, next_start, draft_probs, sampling, block_table) if k else tokens[:, 1:]
        return emitted, num_accepted, torch.cat([anchor[:, None], drafts], dim=1), next_start, logprobs

    def _verify(self, logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor,
                sampling: SamplingTensors, offset: torch.Tensor):
        """logits: [B, K+1, V]; drafts: [B, K]; offset: [B] -> emitted [B, K+1], num_accepted [B].
        The batch's static flags pick the path: filters only when a request asks for one, and
        neither statistics nor noise when every request is greedy."""
        if sampling.all_greedy:
            return greedy_verify(logits, drafts)
        if sampling.uses_filters:
            logits = apply_filters(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
        slots = torch.arange(drafts.shape[0], device=drafts.device)
        return verify(logits, drafts, draft_probs, slots, sampling.temperature, sampling.seed, offset,
                      self.block_verify)

    def draft(self, anchor: torch.Tensor, start: torch.Tensor, draft_probs: torch.Tensor, sampling: SamplingTensors,
              block_table: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """anchor, start: [B]; block_table: [B, M] the rows' KV blocks; slots: [B] the rows' slots in
        draft_probs [S, K, V] (default 0 .. B-1) -> drafts [B, K]; writes their proposals into draft_probs."""
        base_logits, hidden = self.drafter.forward_block(anchor, start, block_table)
        if sampling.all_greedy:
            return greedy_draft(base_logits[:, :self.k], hidden[:, :self.k], self.drafter.markov_head, anchor)
        temperature = torch.zeros_like(sampling.temperature) if self.greedy_drafts else sampling.temperature
        slots = torch.arange(anchor.shape[0], device=anchor.device) if slots is None else slots
        return ancestral_draft(base_logits[:, :self.k], hidden[:, :self.k], self.drafter.markov_head,
                               anchor, temperature, sampling.seed, start, slots, draft_probs)

    def _force_acceptance(self, tokens: torch.Tensor, logits: torch.Tensor):
        """Accept exactly `forced_num_accepted` drafts (at most those verified), then the target's argmax."""
        n = min(self.forced_num_accepted, tokens.shape[1] - 1)
        emitted = torch.full_like(tokens, -1)
        emitted[:, :n] = tokens[:, 1:n + 1]
        emitted[:, n] = logits[:, n].argmax(-1)
        return emitted, torch.full_like(tokens[:, 0], n)

    # ------------------------------------------------------------------ prompts

    def prefill(self, tokens: torch.Tensor, begins: list[int], block_table: torch.Tensor,
                sampling: SamplingTensors | None, next_tokens: torch.Tensor | None = None):
        """Runs one chunk of each row's prompt through the target into its KV blocks and the drafter's
        context; with `sampling` (the chunk ends the prompt), draws each row's first token.

        tokens: [B, L], row b's positions begins[b] .. begins[b]+L-1 (the positions before them are in
        the cache already); block_table: [B, M] the rows' blocks; next_tokens: [B, L], the token that
        follows each position where one is known (-1 elsewhere), whose log-probabilities are wanted
        (a prompt's). Returns the first tokens [B] (None without `sampling`) and the log-probabilities
        (sampling.token_logprobs) of next_tokens at every position [B, L, ...], the first token's at
        the last, or, without next_tokens, of the first tokens alone [B, 1, ...] when `sampling` wants
        them; else None.
        """
        device = self.device
        length = tokens.shape[1]
        begin = torch.tensor(begins, device=device)
        positions = begin[:, None] + torch.arange(length, device=device)
        last = None if next_tokens is not None else torch.full((len(begins), 1), length - 1, device=device)
        with sdpa_kernel(PREFILL_ATTENTION):
            logits, hidden = self.target(tokens, positions, block_table, length=max(begins) + length,
                                         hidden_layer_ids=self.layer_ids, logits_at=last)
        if self.drafter is not None:
            self.drafter.append_context(hidden, positions, block_table)
        first = None
        if sampling is not None:
            no_drafts = torch.empty(len(begins), 0, dtype=torch.long, device=device)
            no_probs = torch.empty(len(begins), 0, logits.shape[-1], device=device)
            first = self._verify(logits[:, -1:], no_drafts, no_probs, sampling, begin + length - 1)[0][:, 0]
        if next_tokens is not None:
            if first is not None:
                next_tokens = torch.cat([next_tokens[:, :-1], first[:, None]], dim=1)
            return first, token_logprobs(logits, next_tokens)
        wanted = sampling is not None and sampling.wants_logprobs
        return first, token_logprobs(logits, first[:, None]) if wanted else None
