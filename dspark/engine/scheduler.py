"""The scheduler: which requests hold KV blocks, which prompt chunks enter the next step, and who
gives way when the blocks run out.

Each iteration (vLLM's V1 scheduler, with DSpark's decode step):
1. Every decoding request needs blocks for the K + 1 positions its next step writes. Oldest first;
   when the blocks run out, the most recently admitted request is preempted: its blocks are released
   and it waits again, first in line, keeping every token it has produced; a later admission
   recomputes its keys from those tokens (recompute preemption), finding what is still cached.
2. Prompt chunks, up to `max_num_batched_tokens` prompt tokens per iteration: first those of requests
   already prefilling, then new admissions in arrival order while the running requests number fewer
   than `max_num_seqs` and the blocks for a request's prompt and first step are free (after its cached
   prefix). No admission in an iteration that preempted.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dspark.engine.kv_blocks import BlockPool, block_keys
from dspark.engine.request import Request, Status


@dataclass
class Chunk:
    """Positions begin .. end - 1 of a request's tokens, to compute in this iteration."""
    request: Request
    begin: int
    end: int

    def size(self) -> int:
        return self.end - self.begin

    @property
    def last(self) -> bool:
        """Whether the chunk completes the request's prefill."""
        return self.end == self.request.num_to_prefill


@dataclass
class Schedule:
    decode: list[Request] = field(default_factory=list)  # decoding requests that step in this iteration
    prefill: list[Chunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


@dataclass
class SchedulerCounters:
    """Since start: prompt positions looked up in the prefix cache and found there (vLLM's
    prefix_cache_queries / prefix_cache_hits count tokens), and preemptions."""
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int, lookahead: int):
        """lookahead: the positions a decode step writes from its anchor on (K + 1)."""
        self.pool, self.max_num_seqs = pool, max_num_seqs
        self.max_num_batched_tokens, self.lookahead = max_num_batched_tokens, lookahead
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # holding blocks (prefilling or decoding), in admission order
        self.counters = SchedulerCounters()

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> Schedule:
        plan = Schedule()
        for request in list(self.running):
            if request.status is not Status.DECODING:
                continue
            while not self._grow(request, request.num_computed + self.lookahead):
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is request:
                    break
            else:
                plan.decode.append(request)

        budget = self.max_num_batched_tokens
        for request in self.running:
            if request.status is Status.PREFILLING and budget > 0:
                budget -= self._chunk(plan, request, budget)
        while self.waiting and budget > 0 and not plan.preempted and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not self._admit(request):
                break
            self.waiting.popleft()
            self.running.append(request)
            budget -= self._chunk(plan, request, budget)
        return plan

    def computed(self, request: Request, num_computed: int) -> None:
        """Positions < num_computed of the request now hold their keys: its blocks that became full
        enter the prefix cache."""
        first, full = request.num_computed // self.pool.block_size, num_computed // self.pool.block_size
        request.num_computed = num_computed
        keys = self._keys(request, full)
        for i in range(first, full):
            self.pool.register(request.blocks[i], keys[i])

    def finish(self, request: Request) -> None:
        """Takes a request out (finished or aborted), releasing its blocks; its full blocks stay
        cached until they are handed out again."""
        if request in self.running:
            self.running.remove(request)
            self.pool.release(request.blocks)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.blocks = []
        request.status = Status.FINISHED

    def _chunk(self, plan: Schedule, request: Request, budget: int) -> int:
        size = min(request.num_to_prefill - request.num_computed, budget)
        plan.prefill.append(Chunk(request, request.num_computed, request.num_computed + size))
        return size

    def _keys(self, request: Request, full_blocks: int) -> list[bytes]:
        """The request's block keys, computed at least as far as its first `full_blocks` blocks (kept
        on the request: they depend on its tokens only; it may know more of them)."""
        known = len(request.block_keys)
        if known < full_blocks:
            size = self.pool.block_size
            parent = request.block_keys[-1] if known else b""
            request.block_keys += block_keys(request.tokens[known * size:full_blocks * size], size, parent)
        return request.block_keys

    def _admit(self, request: Request) -> bool:
        """Holds the request's cached prefix and allocates the blocks for the rest of its prefill and
        its first step, if they are free. At least one position is left to compute (the prefill
        draws the first token from its logits); a request that wants its prompt's log-probabilities
        computes them all."""
        pool, positions = self.pool, request.num_to_prefill
        reusable = 0 if request.needs_prompt_logprobs else (positions - 1) // pool.block_size
        cached = pool.cached_prefix(self._keys(request, reusable)[:reusable])
        fresh = pool.blocks_for(positions + self.lookahead) - len(cached)
        if fresh + sum(pool.refs[b] == 0 for b in cached) > pool.num_free:
            return False
        pool.hold(cached)
        request.blocks = cached + pool.allocate(fresh)
        request.num_computed = request.num_cached = len(cached) * pool.block_size
        request.status = Status.PREFILLING
        self.counters.prefix_queries += positions
        self.counters.prefix_hits += request.num_cached
        return True

    def _grow(self, request: Request, positions: int) -> bool:
        """Blocks for the request's first `positions` positions, if enough are free."""
        need = self.pool.blocks_for(positions) - len(request.blocks)
        if need > self.pool.num_free:
            return False
        if need > 0:
            request.blocks += self.pool.allocate(need)
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.pool.release(request.blocks)
        request.blocks, request.num_computed, request.status = [], 0, Status.WAITING
        request.num_preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(request)
