"""How many drafts each decode step verifies: the K that maximises the tokens per second the step is
expected to give, from the acceptance the engine measures and the step costs it measures per
(bucket, K), for greedy and for sampled batches apart.

Verifying a prefix of the drafted block is lossless for any prefix length, so K may change from
one step to the next without changing what a request's tokens are distributed as (greedy output
stays the target's greedy tokens). A step at K costs the target a forward over K + 1 tokens per row
and the drafter its block; it yields 1 + a_0 + a_0 a_1 + ... (K terms) tokens per row on average,
a_i the chance that draft i is accepted when the ones before it were. At a large batch the target's
forward is bound by its arithmetic, and verifying fewer drafts can be faster (vLLM's users report
speculation slower than none at high batch).

The estimates: a_i from counts of verified and accepted drafts, decayed each step so they follow
the traffic, and shrunk towards the rate pooled over all positions by SHRINK pseudo-counts (a
position verified a few times, as the late ones are while small K are chosen, would otherwise swing
the choice on a handful of draws); a step's cost as an exponential average per (bucket, K, greedy)
of the engine's pace at it, the seconds from the previous step's tokens to its own, each choice
measured once before the first comparison and again after DRIFT steps without it. A choice's first
step is not measured: it pays what is paid once (kernels built for new shapes, a graph's capture),
which would otherwise keep that choice out for DRIFT steps. A rival whose expected rate is within
CLOSE of the best's is measured again sooner, after REMEASURE steps, then twice as many with each
measurement since it was last the best: a step's pace is noisy (the host shares its cores), and a
choice measured once on an unlucky step (or a rival on a lucky one) would otherwise keep the worse
choice for DRIFT steps.

The pace is what the tokens per second follow: the step's kernels and the host's work per step
(reading the tokens, stops, scheduling, the next launch) add up where the host waits for each step,
and the longer of the two sets it where steps overlap; timing the kernels alone misses the host's
share, which grows with the batch and outweighs short kernels (a small model on a GPU).
"""
from __future__ import annotations

PRIOR = (1.0, 0.5)  # pseudo-counts (verified, accepted) of each position before any is measured
DECAY = 0.99  # per step: the counts' memory is about a hundred steps
COST_WEIGHT = 0.2  # a new cost measurement's weight in its average
DRIFT = 200  # steps after which a choice not taken is measured again
CLOSE = 0.15  # a rival within this fraction of the best expected rate is measured again sooner:
REMEASURE = 8  # after these steps, doubling with each of its measurements (up to DRIFT)
SHRINK = 8.0  # pseudo-counts at the pooled rate in each position's estimate


class Acceptance:
    """Decayed counts of the drafts verified and accepted at each position, with every position's
    prior (PRIOR) and its shrinkage towards the pooled rate (SHRINK)."""

    def __init__(self, k: int):
        self.verified, self.accepted = [PRIOR[0]] * k, [PRIOR[1]] * k

    def expected_tokens(self, k: int) -> float:
        """Tokens a row is expected to gain from a step verifying k drafts."""
        pooled = sum(self.accepted) / sum(self.verified) if self.verified else 0.0
        tokens, reach = 1.0, 1.0
        for i in range(k):
            reach *= (self.accepted[i] + SHRINK * pooled) / (self.verified[i] + SHRINK)
            tokens += reach
        return tokens

    def observe(self, k: int, accepted: list[int]) -> None:
        self.verified = [DECAY * v for v in self.verified]
        self.accepted = [DECAY * a for a in self.accepted]
        for n in accepted:
            for i in range(min(n + 1, k)):  # drafts 0 .. n verified with all before them accepted
                self.verified[i] += 1
                self.accepted[i] += i < n


class StepK:
    """Chooses each step's K among `choices` (one choice: a fixed K). Acceptance and step costs are
    kept apart for batches of greedy requests only and for batches with sampled ones: greedy requests
    accept far more drafts, a greedy step skips the noise and the proposals' statistics (another
    graph, cheaper by a share that grows with K), and a server's traffic moves between the two."""

    def __init__(self, k: int, choices: list[int]):
        if not choices or any(not 0 <= c <= k for c in choices):
            raise ValueError(f"the drafts a step verifies must be in [0, {k}], got {choices}")
        self.choices = sorted(set(choices))
        self.acceptance = {greedy: Acceptance(k) for greedy in (True, False)}
        self.cost: dict[tuple[int, int, bool], float] = {}  # (bucket, K, greedy) -> seconds
        self.since_best: dict[tuple[int, int, bool], int] = {}  # (bucket, K, greedy) -> measurements since best
        self.ran: set[tuple[int, int, bool]] = set()  # (bucket, K, greedy) that have run a step
        self.last_taken: dict[tuple[int, int, bool], int] = {}
        self.steps = 0

    def expected_tokens(self, k: int, greedy: bool = False) -> float:
        """Tokens a row is expected to gain from a step verifying k drafts."""
        return self.acceptance[greedy].expected_tokens(k)

    def choose(self, bucket: int, greedy: bool = False) -> int:
        """The K of a step of `bucket` (greedy: its requests are all greedy)."""
        if len(self.choices) == 1:
            return self.choices[0]
        unmeasured = [k for k in self.choices if (bucket, k, greedy) not in self.cost]
        if unmeasured:  # the largest first: it measures every position's acceptance
            return max(unmeasured)
        rate = {k: self.expected_tokens(k, greedy) / self.cost[(bucket, k, greedy)] for k in self.choices}
        best = max(self.choices, key=rate.__getitem__)
        self.since_best[(bucket, best, greedy)] = 1

        def due(k: int) -> bool:
            wait = DRIFT
            if rate[k] >= (1 - CLOSE) * rate[best]:
                wait = min(DRIFT, REMEASURE << (self.since_best[(bucket, k, greedy)] - 1))
            return self.steps - self.last_taken[(bucket, k, greedy)] >= wait

        return max([k for k in self.choices if due(k)] or [best])

    def observe(self, bucket: int, k: int, seconds: float | None, accepted: list[int], greedy: bool = False) -> None:
        """A step of `bucket` verified k drafts and took `seconds` (None: not measured); `accepted`:
        each row's accepted count; greedy: its requests were all greedy."""
        self.steps += 1
        key = (bucket, k, greedy)
        first = key not in self.ran
        self.ran.add(key)
        if seconds is not None and not first:
            before = self.cost.get(key, seconds)
            self.cost[key] = (1 - COST_WEIGHT) * before + COST_WEIGHT * seconds
            self.last_taken[key] = self.steps
            self.since_best[key] = self.since_best.get(key, 0) + 1
        self.acceptance[greedy].observe(k, accepted)
