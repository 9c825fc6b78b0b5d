"""The serving engine: requests in, tokens out, over the models' paged KV caches.

`run()` is the engine's one host loop (on the thread that loaded the models, as dspark.serve runs
it); each `step()` is one iteration:
1. the scheduler (dspark.engine.scheduler) picks the decoding requests and the prompt chunks of this
   iteration, growing or preempting to find their KV blocks;
2. one decode step runs every decoding request: the target verifies its K drafts and the drafter
   drafts the next K (dspark.compile.runner's StepRunner: a static batch of slots, bucketed, replayed
   from CUDA graphs), and the emitted tokens go to their requests, cut at their stops;
3. the prompt chunks run (up to --max-num-batched-tokens prompt tokens per iteration, so a long
   prompt enters over several iterations while the decoding requests keep stepping); a request whose
   prompt is complete draws its first token and takes a free slot (its first drafts are drawn by the
   next step that verifies drafts).

A request's noise is keyed by its seed and its sequence positions only (Philox; a seed is drawn at
submission when the request has none), so its output does not depend on its slot, its blocks or the
other requests in the batch, as far as the arithmetic does not: on the CPU it does not (tested); on
CUDA the rounding can change with the bucket's size (cuBLAS picks its kernels by shape, and small
batches add the Markov bias inside the drafting step), so a near tie can break another way. Which
tokens a sampled request draws depends on how many drafts each of its steps verifies (the law does
not), so when K is chosen per step, a step with a request that came with a seed of its own verifies
all K: the same seed gives the same tokens.
"""
from __future__ import annotations

import dataclasses
import queue
import random
import threading
import time
from dataclasses import dataclass
from itertools import groupby

import torch

from dspark.compile.runner import IDLE, StepRunner, blocks_per_request
from dspark.decoder import Readback, SpeculativeDecoder
from dspark.engine.kv_blocks import BlockPool
from dspark.engine.request import Request, Status
from dspark.engine.scheduler import Chunk, Scheduler
from dspark.engine.speculation import StepK
from dspark.engine.stats import EngineStats
from dspark.kv_cache import KV_BLOCK_SIZE, kv_cache_blocks
from dspark.output import GenerationResult, TokenLogprob
from dspark.sampling import MAX_SEED, SamplingParams

DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cuda": 2048, "cpu": 256}  # prompt tokens per iteration (bench/prefill.py)


class EngineStopped(RuntimeError):
    """The engine has stopped (shut down, or a step failed): it takes no more requests."""


@dataclass
class InFlight:
    """A decode step queued and not yet read: its requests by slot, its batch and K, whether its
    requests are all greedy, its outputs and the copies of those the host reads."""
    requests: dict[int, Request]
    batch: int
    k: int
    greedy: bool
    outputs: tuple
    readback: Readback


def token_entries(logprobs: list | None, row: int, columns, top: int) -> list[TokenLogprob]:
    """The TokenLogprob of `columns` of a row of read-back log-probabilities (chosen [B][N], top ids
    and values [B][N][MAX_LOGPROBS]), with the `top` likeliest alternatives."""
    chosen, ids, values = logprobs
    return [TokenLogprob(chosen[row][j], list(zip(ids[row][j][:top], values[row][j][:top]))) for j in columns]


class Engine:
    """Runs `decoder` over requests; submit() from any thread, run() in one thread.

    max_num_seqs (alias max_batch): requests running at once (decode slots); max_model_len: prompt +
    completion tokens per request; block_size: positions per KV block; num_blocks: the KV cache's
    blocks (default: sized by kv_cache_blocks from gpu_memory_utilization or kv_cache_memory GiB);
    max_num_batched_tokens: prompt tokens per iteration; enable_prefix_caching: reuse the cached
    blocks of a prompt's prefix; k_choices: the drafts a step may verify, chosen per step
    (dspark.engine.speculation; default: the decoder's K, fixed); cuda_graphs: replay the decode step
    from CUDA graphs (default on CUDA); overlap: queue each decode step before reading the one before
    (default on CUDA, where steps run asynchronously; on the CPU nothing would overlap).
    """

    def __init__(self, decoder: SpeculativeDecoder, max_num_seqs: int | None = None, max_model_len: int | None = None,
                 cuda_graphs: bool | None = None, *, max_batch: int | None = None, block_size: int = KV_BLOCK_SIZE,
                 num_blocks: int | None = None, gpu_memory_utilization: float = 0.9,
                 kv_cache_memory: float | None = None, max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool = True, k_choices: list[int] | None = None, overlap: bool | None = None):
        if None not in (max_num_seqs, max_batch) and max_num_seqs != max_batch:
            raise ValueError(f"max_num_seqs={max_num_seqs} and its alias max_batch={max_batch} disagree")
        max_num_seqs = next((n for n in (max_num_seqs, max_batch) if n is not None), 8)
        config = decoder.target.config
        self.max_model_len = config.max_position_embeddings if max_model_len is None else max_model_len
        if not 1 <= self.max_model_len <= config.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [1, {config.max_position_embeddings}], "
                             f"got {self.max_model_len}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if kv_cache_memory is not None and not kv_cache_memory > 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {kv_cache_memory}")
        if max_num_batched_tokens is None:
            max_num_batched_tokens = self.default_batched_tokens(decoder.device.type)
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if num_blocks is None:
            num_blocks = kv_cache_blocks(decoder.target, decoder.drafter, block_size, gpu_memory_utilization,
                                         kv_cache_memory)
        self.decoder, self.max_num_seqs = decoder, max_num_seqs
        longest = blocks_per_request(self.max_model_len, decoder.k, block_size)
        if longest > num_blocks - 1:
            raise ValueError(f"the KV cache holds {(num_blocks - 1) * block_size} tokens ({num_blocks - 1} blocks of "
                             f"{block_size}), less than one request of max_model_len {self.max_model_len} needs "
                             f"({longest * block_size} with two steps' {decoder.k + 1} positions): give the cache "
                             f"more memory or lower max_model_len")
        self.overlap = decoder.device.type == "cuda" if overlap is None else overlap
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        # the positions a step writes past the host's count of a request's: K + 1, or two steps' when the host lags one
        lookahead = (decoder.k + 1) * (2 if self.overlap else 1)
        self.scheduler = Scheduler(self.pool, max_num_seqs, max_num_batched_tokens, lookahead=lookahead)
        self.runner = StepRunner(decoder, max_num_seqs, longest, num_blocks, block_size, cuda_graphs=cuda_graphs)
        self.speculation = StepK(decoder.k, [decoder.k] if k_choices is None or decoder.drafter is None else k_choices)
        # slots without drafts from their anchor: newly admitted, or left by a step that verified none
        self.undrafted: set[int] = set()
        # the engine's pace: seconds from one step's read to the next's, unless prompt chunks or drafts
        # drawn again ran in between (costs of admission and of a step at K = 0, not of the step read)
        self.last_read: float | None = None
        self.pace_disturbed = False
        self.in_flight: InFlight | None = None  # with overlap: the step queued, to read in the next iteration
        self.last_step: InFlight | None = None  # the step whose outputs the next step's inputs come from
        self.readbacks: dict[tuple, Readback] = {}  # host buffers, by the shapes copied and the launch's parity
        self.launches = 0
        self.slots: list[Request | None] = [None] * max_num_seqs
        self.new_params: dict[int, SamplingParams] = {}  # slots' parameters the runner has yet to be given
        self.incoming: queue.Queue[Request | None] = queue.Queue()  # from submit(), for the engine's thread
        self.stats = EngineStats(accepted_per_position=[0] * decoder.k)
        self.stopped = threading.Event()
        self.lock = threading.Lock()  # submit() queues nothing once `stopped` is set under it

    @staticmethod
    def default_batched_tokens(device_type: str) -> int:
        """max_num_batched_tokens when none is given: DEFAULT_MAX_NUM_BATCHED_TOKENS of the device."""
        return DEFAULT_MAX_NUM_BATCHED_TOKENS.get(device_type, DEFAULT_MAX_NUM_BATCHED_TOKENS["cuda"])

    @property
    def capacity(self) -> int:
        """The tokens the KV cache holds."""
        return (self.pool.num_blocks - 1) * self.pool.block_size

    @property
    def full_length_requests(self) -> int:
        """How many requests of max_model_len tokens the KV cache holds at once."""
        return (self.pool.num_blocks - 1) // self.runner.block_table.shape[1]

    # ------------------------------------------------------------------ any thread

    def submit(self, prompt: list[int], params: SamplingParams, events=None) -> Request:
        """Queues a request; raises ValueError (naming the value) for one the engine cannot serve,
        EngineStopped once the engine has stopped. `events`: what receives the request's events
        (anything with put(item), called on the engine's thread); a new queue.Queue by default."""
        self.decoder.check_prompt(prompt)
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt length {len(prompt)} + max_tokens {params.max_tokens} exceeds the "
                             f"maximum model length {self.max_model_len} (the KV cache holds {self.capacity} "
                             f"tokens in all)")
        seeded = params.seed is not None
        if not seeded:
            params = dataclasses.replace(params, seed=random.SystemRandom().randrange(MAX_SEED))
        result = GenerationResult(accepted_per_position=[0] * self.decoder.k,
                                  logprobs=None if params.logprobs is None else [],
                                  prompt_logprobs=None if params.prompt_logprobs is None else [None])
        request = Request(list(prompt), params, result=result, events=queue.Queue() if events is None else events,
                          seeded=seeded)
        request.stop = self.decoder.stop_condition(params, prompt)
        with self.lock:
            if self.stopped.is_set():
                raise EngineStopped("the engine has stopped")
            self.incoming.put(request)
        return request

    def num_running(self) -> int:
        """Requests holding KV blocks (prefilling or decoding) whose client is still there."""
        return sum(not r.cancelled for r in self.scheduler.running)

    def num_waiting(self) -> int:
        """Requests waiting for KV blocks or a slot (preempted ones included) whose client is still there."""
        with self.incoming.mutex:
            incoming = [r for r in self.incoming.queue if r is not None]
        return sum(not r.cancelled for r in [*incoming, *self.scheduler.waiting])

    def shutdown(self) -> None:
        self.stopped.set()
        self.incoming.put(None)  # wakes run()

    # ------------------------------------------------------------------ the engine thread

    @torch.inference_mode()
    def run(self) -> None:
        """Steps until shutdown(), then every request in flight or waiting receives EngineStopped. If
        a prefill fails, the requests it was for receive its exception and the others go on; if a
        decode step fails, every request receives it and the engine stops (raising it)."""
        try:
            while not self.stopped.is_set():
                self._take_incoming(block=not (self.scheduler.running or self.scheduler.waiting))
                self.step()
        except Exception as error:
            self._fail_pending(error)
            raise
        self._fail_pending(EngineStopped("the engine was shut down"))

    def step(self) -> None:
        """One iteration: schedule, one decode step, this iteration's prompt chunks. With `overlap`,
        the step is queued before the one before it is read, so the device does not wait for the
        host's bookkeeping; the host then lags a step, and a request that finished in a step runs
        in the next one too, which hands it nothing."""
        self._take_incoming(block=False)
        self._drop_cancelled()
        plan = self.scheduler.schedule()
        for request in plan.preempted:
            if request.slot is not None:
                self._vacate(request)
        launched = self._launch(plan.decode) if plan.decode else None
        if self.overlap:  # read the step before while this one runs
            before, self.in_flight = self.in_flight, launched
        else:
            before, self.in_flight = launched, None
        if before is not None:
            self._read(before)
        else:  # no step read in this iteration: the next one's pace starts afresh
            self.last_read = None
        ready = []
        for _, chunks in groupby(sorted(plan.prefill, key=Chunk.size), key=Chunk.size):
            ready += self._prefill(list(chunks))
        self.pace_disturbed |= bool(plan.prefill)
        if ready:  # slots in admission order
            order = {chunk.request: i for i, chunk in enumerate(plan.prefill)}
            self._start_decoding(sorted(ready, key=order.__getitem__))

    def _take_incoming(self, block: bool) -> None:
        """Moves submitted requests to the scheduler (waiting for one when `block`)."""
        while True:
            try:
                request = self.incoming.get(block=block)
            except queue.Empty:
                return
            block = False
            if request is not None:
                self.scheduler.add(request)

    def _fail_pending(self, error: Exception) -> None:
        """Stops taking requests and hands `error` to every request in flight or waiting (each counted
        as aborted)."""
        with self.lock:
            self.stopped.set()
        self._take_incoming(block=False)
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            self._count_finished("abort")
            request.events.put(error)
            self.scheduler.finish(request)
        self.slots = [None] * self.max_num_seqs

    def _drop_cancelled(self) -> None:
        """Finishes, as aborted, the requests whose client has left: their blocks and slots are freed
        and their handlers let go now."""
        for request in [r for r in [*self.scheduler.running, *self.scheduler.waiting] if r.cancelled]:
            request.result.finish_reason = "abort"
            self._finish(request)

    def _launch(self, requests: list[Request]) -> InFlight:
        """Queues one decode step of these requests: first their inputs from the step before
        (on the device: the host has not read that step yet when steps overlap), then, if the step
        verifies drafts, those of the slots without any from their anchor, then the step and the
        copies of its outputs to the host."""
        runner = self.runner
        self._advance()
        for request in requests:
            runner.set_blocks(request.slot, request.blocks)
        self._set_params()
        batch = runner.bucket(1 + max(r.slot for r in requests))
        greedy = all(r.params.greedy for r in requests)
        k = self.decoder.k if any(r.seeded for r in requests) else self.speculation.choose(batch, greedy)
        if k and self.undrafted:
            runner.draft(sorted(self.undrafted))
            self.undrafted.clear()
            self.pace_disturbed = True  # (a cost of the admissions and of the steps at 0 before)
        graphs = len(runner.graphs)
        outputs = runner.step(batch, k)
        self.pace_disturbed |= len(runner.graphs) > graphs  # a graph captured: paid once, not the pace
        if not k and self.decoder.drafter is not None:
            self.undrafted.update(r.slot for r in requests)
        emitted, num_accepted, _, _, logprobs = outputs
        copied = [emitted, num_accepted, *(logprobs or ())]
        self.launches += 1
        key = (self.launches % 2, *(t.shape for t in copied))  # two sets: the step read while this one runs
        if key not in self.readbacks:
            self.readbacks[key] = Readback(copied)
        readback = self.readbacks[key]
        readback.start(copied)
        self.last_step = InFlight({r.slot: r for r in requests}, batch, k, greedy, outputs, readback)
        return self.last_step

    def _advance(self) -> None:
        """The inputs of the slots the last step ran, from its outputs, for those whose request is still
        in its slot (the others are idle, or a new request's, admitted since)."""
        last = self.last_step
        if last is None:
            return
        runner, (_, _, next_tokens, next_start, _) = self.runner, last.outputs
        # (non_blocking from pageable memory: staged at once, without waiting for the step in flight)
        kept = torch.tensor([last.requests.get(slot) is request and request is not None
                             for slot, request in enumerate(self.slots[:last.batch])]).to(next_start.device,
                                                                                           non_blocking=True)
        runner.tokens[:last.batch] = torch.where(kept[:, None], next_tokens, runner.tokens[:last.batch])
        runner.start[:last.batch] = torch.where(kept, next_start, runner.start[:last.batch])
        self.last_step = None

    def _read(self, step: InFlight) -> None:
        """Waits for a step's outputs and hands each request its tokens, cut at its stop. A request
        that finished (or was preempted or cancelled) since the step was queued gets nothing from it."""
        emitted, num_accepted, *logprobs = step.readback.lists()
        now = time.perf_counter()
        logprobs = logprobs or None
        requests = [(slot, r) for slot, r in step.requests.items() if r.status is Status.DECODING and r.slot == slot]
        pace = None if self.last_read is None or self.pace_disturbed else now - self.last_read
        self.speculation.observe(step.batch, step.k, pace, [num_accepted[slot] for slot, _ in requests], step.greedy)
        self.last_read, self.pace_disturbed = now, False
        stats = self.stats
        stats.steps += 1
        for slot, request in requests:
            taken, accepted = request.stop.take_step(request.result, emitted[slot], num_accepted[slot])
            if request.result.logprobs is not None:
                request.result.logprobs += token_entries(logprobs, slot, range(len(taken)), request.params.logprobs)
            for position in range(accepted):
                stats.accepted_per_position[position] += 1
            if step.k:
                stats.drafts += 1
                stats.draft_tokens += step.k
                stats.accepted_tokens += accepted
            self._hand_out(request, taken)
            if request.status is Status.DECODING:
                self.scheduler.computed(request, request.num_computed + num_accepted[slot] + 1)

    def _prefill(self, chunks: list[Chunk]) -> list[Request]:
        """Chunks of one length: their positions' keys and values, and the first tokens of the fresh
        requests whose prompts they complete -> the requests ready to decode."""
        now = time.monotonic()
        for chunk in chunks:
            if chunk.request.scheduled_at is None:
                chunk.request.scheduled_at = now
                self.stats.queue_time.observe(now - chunk.request.arrival)
        fresh = [c.last and not c.request.result.tokens for c in chunks]
        params = [c.request.params for c in chunks] if any(fresh) else None
        following = None
        if any(c.request.needs_prompt_logprobs for c in chunks):  # each position's next prompt token
            following = [[c.request.prompt[p + 1] if p + 1 < len(c.request.prompt) else -1
                          for p in range(c.begin, c.end)] for c in chunks]
        try:
            first, logprobs = self.runner.prefill([c.request.tokens[c.begin:c.end] for c in chunks],
                                                  [c.begin for c in chunks], [c.request.blocks for c in chunks],
                                                  params, following)
        except Exception as error:  # e.g. out of memory: these requests fail, the others go on
            for chunk in chunks:
                self._count_finished("abort")
                chunk.request.events.put(error)
                self.scheduler.finish(chunk.request)
            return []
        first = first.tolist() if first is not None else [None] * len(chunks)
        logprobs = None if logprobs is None else [t.tolist() for t in logprobs]
        ready = []
        for row, (chunk, token, is_fresh) in enumerate(zip(chunks, first, fresh)):
            request = chunk.request
            if request.needs_prompt_logprobs:  # position p's entry is prompt token p + 1's; those known stay
                given = request.result.prompt_logprobs
                columns = range(max(chunk.begin, len(given) - 1) - chunk.begin,
                                min(chunk.end, len(request.prompt) - 1) - chunk.begin)
                given += token_entries(logprobs, row, columns, request.params.prompt_logprobs)
            self.scheduler.computed(request, chunk.end)
            if not chunk.last:
                continue
            if is_fresh:
                if request.result.logprobs is not None:  # the first token's: the chunk's last position
                    request.result.logprobs += token_entries(logprobs, row, [-1], request.params.logprobs)
                request.first_token_at = time.monotonic()
                self.stats.prompt_tokens += len(request.prompt)
                self.stats.time_to_first_token.observe(request.first_token_at - request.arrival)
                self._hand_out(request, request.stop.extend(request.result, [token]))
                if request.result.finished:
                    continue
            ready.append(request)
        return ready

    def _start_decoding(self, requests: list[Request]) -> None:
        """Gives each request a free slot and its anchor (the newest token); its first drafts are drawn
        when a step first verifies drafts (none are wasted while steps verify none), with any others due."""
        runner = self.runner
        free = (slot for slot, r in enumerate(self.slots) if r is None)
        for request in requests:
            request.slot = next(free)
            request.status = Status.DECODING
            self.slots[request.slot] = request
            runner.set_blocks(request.slot, request.blocks)
        index = torch.tensor([r.slot for r in requests], device=runner.tokens.device)
        runner.tokens[index, 0] = torch.tensor([r.result.tokens[-1] for r in requests], device=index.device)
        runner.start[index] = torch.tensor([r.num_computed for r in requests], device=index.device)
        self.new_params.update((r.slot, r.params) for r in requests)
        if self.decoder.drafter is not None:  # drawn by the first step that verifies drafts
            self.undrafted.update(r.slot for r in requests)

    def _vacate(self, request: Request) -> None:
        """Frees the request's slot: its row reads and writes the null block from now on."""
        self.slots[request.slot] = None
        self.undrafted.discard(request.slot)
        self.runner.set_blocks(request.slot, [])
        self.runner.start[request.slot] = 0
        self.new_params[request.slot] = IDLE
        request.slot = None

    def _set_params(self) -> None:
        """Hands the runner the sampling parameters of the slots that changed hands since it last had them."""
        if self.new_params:
            self.runner.set_params(self.new_params)
            self.new_params = {}

    def _hand_out(self, request: Request, taken: list[int]) -> None:
        """Hands the request the tokens it has just taken; finishes it when it is done."""
        self.stats.generation_tokens += len(taken)
        if taken:
            request.events.put(taken)
        if request.result.finished:
            self._finish(request)

    def _finish(self, request: Request) -> None:
        """Frees the request's slot and blocks, counts it by its finish reason and its latencies,
        then tells its waiter it is done (so a client that has its answer finds it counted in /metrics)."""
        if request.slot is not None:
            self._vacate(request)
        self.scheduler.finish(request)
        self._count_finished(request.result.finish_reason)
        if request.result.finish_reason != "abort":  # an abort's end is when the engine noticed it
            now, later_tokens = time.monotonic(), len(request.result.tokens) - 1
            self.stats.e2e_latency.observe(now - request.arrival)
            if later_tokens:
                self.stats.time_per_output_token.observe((now - request.first_token_at) / later_tokens)
        request.events.put(None)

    def _count_finished(self, reason: str) -> None:
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
