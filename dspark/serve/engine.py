"""The serving engine: continuous batching of requests over a fixed set of batch slots.

Each slot is one row of the target's KV cache, the drafter's context cache and the step's static
tensors. A request is admitted into a free slot between steps (its prompt prefilled into that
row, its first token and its first drafts drawn, the rows in flight left as they are), decodes in
every step with the other slots (one SpeculativeDecoder step: the target verifies K drafts per row
and the drafter drafts the next K), and leaves its slot when it stops. A step runs the smallest
batch-size bucket that holds every slot in use (admission fills the lowest free slots); free slots
inside it stay frozen (the same inputs at the same positions), so the step keeps its shapes. The
static batch, its buckets and the compiled and CUDA-graphed step are dspark.compile's StepRunner.

A request's noise is keyed by its seed and its sequence positions only (Philox; a seed is drawn
at submission when the request has none), so its output does not depend on its slot or on the
other requests in the batch, as far as the arithmetic does not: on the CPU it does not (tested); on
CUDA the rounding can change with the bucket's size (cuBLAS picks its kernels by shape, and small
batches add the Markov bias inside the drafting step), so a near tie can break another way.
"""
from __future__ import annotations

import bisect
import dataclasses
import queue
import random
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from dspark.compile.runner import IDLE, StepRunner
from dspark.decoder import SpeculativeDecoder
from dspark.output import GenerationResult, StopCondition
from dspark.sampling import MAX_SEED, SamplingParams, SamplingTensors


@dataclass
class Request:
    """One generation request and its output so far. `events` receives lists of new tokens as the
    engine accepts them, then None when the request has finished (or an exception if it failed)."""
    prompt: list[int]
    params: SamplingParams
    id: str = field(default_factory=lambda: uuid.uuid4().hex)  # unique across restarts and replicas, as vLLM's
    result: GenerationResult = field(default_factory=GenerationResult)
    events: queue.Queue = field(default_factory=queue.Queue)
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    stop: StopCondition | None = None
    cancelled: bool = False  # set by the client's side (it went away): the engine frees the slot


@dataclass
class Histogram:
    """Observations in buckets by upper bound (Prometheus' histogram; the last bucket is above every
    bound), with their sum."""
    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)  # per bucket, not cumulative; their sum is the count
    total: float = 0.0

    def __post_init__(self):
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bound >= value
        self.total += value


FIRST_TOKEN_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
REQUEST_BOUNDS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TOKEN_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class EngineStats:
    """Counters and latency histograms since start, read by the metrics endpoint."""
    finished: dict[str, int] = field(default_factory=dict)  # requests by finish reason ("abort": the client
                                                            # left or the engine stopped first)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    drafts: int = 0  # verified draft blocks (one per active row and step)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # seconds: arrival to first token; arrival to admission; arrival to last token and last less
    # first token per later token, of the requests that stopped or reached their length
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(FIRST_TOKEN_BOUNDS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_BOUNDS))
    e2e_latency: Histogram = field(default_factory=lambda: Histogram(REQUEST_BOUNDS))
    time_per_output_token: Histogram = field(default_factory=lambda: Histogram(TOKEN_BOUNDS))


class EngineStopped(RuntimeError):
    """The engine has stopped (shut down, or a step failed): it takes no more requests."""


class Engine:
    """Runs `decoder` over `max_batch` slots. submit() from any thread; run() in one thread."""

    def __init__(self, decoder: SpeculativeDecoder, max_batch: int = 8, max_model_len: int | None = None,
                 cuda_graphs: bool | None = None):
        config = decoder.target.config
        self.max_model_len = config.max_position_embeddings if max_model_len is None else max_model_len
        if not 1 <= self.max_model_len <= config.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [1, {config.max_position_embeddings}], "
                             f"got {self.max_model_len}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.decoder, self.max_batch = decoder, max_batch
        self.runner = StepRunner(decoder, max_batch, self.max_model_len, cuda_graphs=cuda_graphs)
        self.slots: list[Request | None] = [None] * max_batch
        self.waiting: queue.Queue[Request] = queue.Queue()
        self.stats = EngineStats(accepted_per_position=[0] * decoder.k)
        self.stopped = threading.Event()
        self.lock = threading.Lock()  # submit() queues nothing once `stopped` is set under it

    # ------------------------------------------------------------------ any thread

    def submit(self, prompt: list[int], params: SamplingParams) -> Request:
        """Queues a request; raises ValueError (naming the value) for one the engine cannot serve,
        EngineStopped once the engine has stopped."""
        self.decoder.check_prompt(prompt)
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt length {len(prompt)} + max_tokens {params.max_tokens} exceeds the "
                             f"maximum model length {self.max_model_len}")
        if params.seed is None:
            params = dataclasses.replace(params, seed=random.SystemRandom().randrange(MAX_SEED))
        request = Request(list(prompt), params,
                          result=GenerationResult(accepted_per_position=[0] * self.decoder.k))
        request.stop = self.decoder.stop_condition(params, prompt)
        with self.lock:
            if self.stopped.is_set():
                raise EngineStopped("the engine has stopped")
            self.waiting.put(request)
        return request

    def num_running(self) -> int:
        """Requests in a batch slot whose client is still there (as num_waiting counts them)."""
        return sum(request is not None and not request.cancelled for request in self.slots)

    def num_waiting(self) -> int:
        """Requests queued for a slot whose client is still there (a cancelled one is dropped before
        the next step)."""
        with self.waiting.mutex:
            return sum(request is not None and not request.cancelled for request in self.waiting.queue)

    def shutdown(self) -> None:
        self.stopped.set()
        self.waiting.put(None)  # wakes run()

    # ------------------------------------------------------------------ the engine thread

    @torch.inference_mode()
    def run(self) -> None:
        """Admits and steps until shutdown(), then every request in flight or waiting receives
        EngineStopped. If a prefill fails, the requests it admitted receive its exception and the
        others go on; if a step fails, every request receives it and the engine stops (raising it)."""
        try:
            while not self.stopped.is_set():
                self._admit(block=not any(self.slots))
                if any(self.slots):
                    self._drop_left()
                    self._step()
        except Exception as error:
            self._fail_pending(error)
            raise
        self._fail_pending(EngineStopped("the engine was shut down"))

    def _fail_pending(self, error: Exception) -> None:
        """Stops taking requests and hands `error` to every request in flight or waiting (each counted
        as aborted)."""
        with self.lock:
            self.stopped.set()
        pending = [r for r in self.slots if r is not None]
        while not self.waiting.empty():
            pending.append(self.waiting.get())
        for request in filter(None, pending):  # None: shutdown's wake-up
            self._count_finished("abort")
            request.events.put(error)
        self.slots = [None] * self.max_batch

    def _admit(self, block: bool) -> None:
        """Moves waiting requests into free slots: prefill, first token, then the block's drafts."""
        free = [row for row, request in enumerate(self.slots) if request is None]
        new: list[Request] = []
        while len(new) < len(free):
            try:
                request = self.waiting.get(block=block and not new)
            except queue.Empty:
                break
            if request is None:  # shutdown: what it took waits again, for run() to fail it
                for taken in new:
                    self.waiting.put(taken)
                return
            if request.cancelled:  # its client left while it waited: no prefill for it
                request.result.finish_reason = "abort"
                self._finish(request)
                continue
            new.append(request)
        if not new:
            return
        rows = free[:len(new)]
        runner, device = self.runner, self.decoder.device
        admitted_at = time.monotonic()
        try:
            first, start = self.decoder.prefill([r.prompt for r in new],
                                                 SamplingTensors.from_params([r.params for r in new], device), rows)
        except Exception as error:  # e.g. out of memory: these requests fail, the ones in flight go on
            for request in new:
                self._count_finished("abort")
                request.events.put(error)
            return
        for row, request in zip(rows, new):
            self.slots[row] = request
        index = torch.tensor(rows, device=device)
        runner.tokens[index, 0], runner.start[index] = first, start
        for row, request, token in zip(rows, new, first.tolist()):
            request.first_token_at = time.monotonic()
            self.stats.prompt_tokens += len(request.prompt)
            self.stats.queue_time.observe(admitted_at - request.arrival)
            self.stats.time_to_first_token.observe(request.first_token_at - request.arrival)
            self._hand_out(row, request.stop.extend(request.result, [token]))
        self._set_params()
        admitted = [row for row in rows if self.slots[row] is not None]  # not those done at their first token
        if self.decoder.drafter is not None and admitted:  # their drafts; the rows in flight keep theirs
            runner.draft(admitted)

    def _drop_left(self) -> None:
        """Finishes, as aborted, the waiting requests whose client has left: their handlers are let go
        now, not when a slot frees for them."""
        with self.waiting.mutex:
            left = [r for r in self.waiting.queue if r is not None and r.cancelled]
            for request in left:
                self.waiting.queue.remove(request)
        for request in left:
            request.result.finish_reason = "abort"
            self._finish(request)

    def _bucket(self) -> int:
        """The step's batch: the smallest bucket that holds every row in use."""
        return self.runner.bucket(1 + max(row for row, r in enumerate(self.slots) if r is not None))

    def _step(self) -> None:
        batch, runner = self._bucket(), self.runner
        emitted, num_accepted, next_tokens, next_start = runner.step(batch)
        emitted, num_accepted = emitted.tolist(), num_accepted.tolist()  # one copy each
        stats, k = self.stats, self.decoder.k
        stats.steps += 1
        for row, request in enumerate(self.slots[:batch]):
            if request is None:
                continue
            if request.cancelled:
                request.result.finish_reason = "abort"
                self._free(row)
                continue
            taken, accepted = request.stop.take_step(request.result, emitted[row], num_accepted[row])
            self._hand_out(row, taken)
            for pos in range(accepted):
                stats.accepted_per_position[pos] += 1
            if k:
                stats.drafts += 1
                stats.draft_tokens += k
                stats.accepted_tokens += accepted
        keep = torch.tensor([r is not None for r in self.slots[:batch]], device=next_start.device)
        runner.tokens[:batch] = torch.where(keep[:, None], next_tokens, runner.tokens[:batch])  # the rest: frozen
        runner.start[:batch] = torch.where(keep, next_start, runner.start[:batch])
        self._set_params()  # rows that left are idle: the step may run a cheaper sampling variant

    def _set_params(self) -> None:
        params = [IDLE if r is None else r.params for r in self.slots]
        if params != self.runner.params:
            self.runner.set_params(params)

    def _hand_out(self, row: int, taken: list[int]) -> None:
        """Hands the request in `row` the tokens it has just taken; frees the slot when it has finished."""
        request = self.slots[row]
        self.stats.generation_tokens += len(taken)
        if taken:
            request.events.put(taken)
        if request.result.finished:
            self._free(row)

    def _free(self, row: int) -> None:
        request, self.slots[row] = self.slots[row], None
        self._finish(request)

    def _finish(self, request: Request) -> None:
        """Counts the request by its finish reason and its latencies, then tells its waiter it is
        done (so a client that has its answer finds it counted in /metrics)."""
        self._count_finished(request.result.finish_reason)
        if request.result.finish_reason != "abort":  # an abort's end is when the engine noticed it
            now, later_tokens = time.monotonic(), len(request.result.tokens) - 1
            self.stats.e2e_latency.observe(now - request.arrival)
            if later_tokens:
                self.stats.time_per_output_token.observe((now - request.first_token_at) / later_tokens)
        request.events.put(None)

    def _count_finished(self, reason: str) -> None:
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
