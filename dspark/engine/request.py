"""One generation request as the engine holds it: what it asked for, what it has produced, and
where its state lives (KV blocks, a decode slot)."""
from __future__ import annotations

import enum
import queue
import time
import uuid
from dataclasses import dataclass, field

from dspark.output import GenerationResult, StopCondition
from dspark.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued, or preempted: no blocks, no slot
    PREFILLING = "prefilling"  # holds its blocks; its prompt (or, resumed, its tokens so far) enters in chunks
    DECODING = "decoding"  # in a decode slot: every step verifies its drafts and drafts anew
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """`events` receives lists of new tokens as the engine accepts them, then None when the request
    has finished (or an exception if it failed)."""
    prompt: list[int]
    params: SamplingParams
    id: str = field(default_factory=lambda: uuid.uuid4().hex)  # unique across restarts and replicas, as vLLM's
    result: GenerationResult = field(default_factory=GenerationResult)
    events: queue.Queue = field(default_factory=queue.Queue)
    arrival: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None  # when its first prompt chunk ran
    first_token_at: float | None = None
    stop: StopCondition | None = None
    cancelled: bool = False  # set by the client's side (it went away): the engine frees its blocks and slot
    seeded: bool = False  # it came with a seed of its own: its steps verify all K drafts (see Engine)
    # the engine's state
    status: Status = Status.WAITING
    blocks: list[int] = field(default_factory=list)  # KV blocks: position p is in blocks[p // block_size]
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks, as far as known
    num_computed: int = 0  # positions whose keys and values are in the blocks
    num_cached: int = 0  # of those, positions found in the prefix cache at its last admission
    slot: int | None = None  # its row of the decode step, while decoding
    num_preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        """The prompt and the tokens generated so far."""
        return self.prompt + self.result.tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether its prefill must give the prompt tokens' log-probabilities (not yet all given)."""
        given = self.result.prompt_logprobs
        return given is not None and len(given) < len(self.prompt)

    @property
    def num_to_prefill(self) -> int:
        """The positions an admission computes: the prompt, or after a preemption every token but the
        newest, which is the anchor of the next step."""
        return len(self.prompt) + max(len(self.result.tokens) - 1, 0)
