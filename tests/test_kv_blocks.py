"""The engine's KV block bookkeeping: the block pool (holding, freeing, LRU eviction, prefix keys)
and the scheduler (admission by blocks, prompt chunks within the token budget, preemption of the
newest request). Host-side logic only: no model runs here."""
import pytest

from dspark.engine.kv_blocks import NULL_BLOCK, BlockPool, block_keys
from dspark.engine.request import Request, Status
from dspark.engine.scheduler import Scheduler
from dspark.sampling import SamplingParams


def test_block_keys_name_the_whole_prefix_and_only_full_blocks():
    keys = block_keys(list(range(10)), 4)
    assert len(keys) == 2  # the last two tokens fill no block
    assert block_keys(list(range(8)), 4) == keys
    assert block_keys([0, 1, 2, 3, 9, 9, 9, 9], 4)[0] == keys[0]  # same first block, same key
    assert block_keys([9, 1, 2, 3, 4, 5, 6, 7], 4)[1] != keys[1]  # same second block after another first: not
    assert block_keys(list(range(4, 8)), 4, parent=keys[0]) == keys[1:]


def test_blocks_are_handed_out_least_recently_freed_first_and_never_the_null_block():
    pool = BlockPool(6, 4)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert NULL_BLOCK not in a + b and sorted(a + b) == [1, 2, 3, 4, 5] and pool.num_free == 0
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.release(a)  # a request's last block is freed first: its prefix outlives its tail
    pool.release(b)
    assert pool.allocate(5) == [a[2], a[1], a[0], b[1], b[0]]
    assert pool.usage == 1.0


def test_a_cached_prefix_is_found_held_and_survives_until_its_blocks_are_handed_out_again():
    pool = BlockPool(5, 2)
    tokens = [1, 2, 3, 4, 5]
    keys = block_keys(tokens, 2)
    blocks = pool.allocate(3)
    for block, key in zip(blocks, keys):
        pool.register(block, key)
    assert pool.cached_prefix(keys) == blocks[:2]
    assert pool.cached_prefix(block_keys([1, 2, 9, 9], 2)) == blocks[:1]  # up to the first miss
    pool.hold(blocks[:2])  # a second request on the same prefix
    assert pool.refs[blocks[0]] == 2
    pool.release(blocks)  # the first request ends: its shared blocks stay held
    assert pool.num_free == 2 and pool.cached_prefix(keys) == blocks[:2]
    pool.release(blocks[:2])  # the second ends: free, still cached
    assert pool.num_free == 4 and pool.cached_prefix(keys) == blocks[:2]
    pool.hold(pool.cached_prefix(keys))  # a third finds it, taking it off the free list
    assert pool.num_free == 2
    pool.release(blocks[:2])
    fresh = pool.allocate(4)  # every free block handed out: the cached ones are evicted
    assert set(blocks[:2]) <= set(fresh) and pool.cached_prefix(keys) == []
    uncached = BlockPool(5, 2, enable_prefix_caching=False)
    uncached.register(1, keys[0])
    assert uncached.cached_prefix(keys) == []


def test_a_prefix_cached_under_one_block_keeps_that_block():
    pool = BlockPool(4, 2)
    first, second = pool.allocate(1), pool.allocate(1)
    key = block_keys([7, 7], 2)[0]
    pool.register(first[0], key)
    pool.register(second[0], key)  # the same prompt computed twice at once
    assert pool.cached_prefix([key]) == first
    pool.release(second)
    pool.allocate(pool.num_free)  # handing out the second block does not evict the first's key
    assert pool.cached_prefix([key]) == first


def request(prompt_len, first=1):
    """A request whose prompt is first, first + 1, ...: requests of another `first` share no block."""
    return Request(list(range(first, first + prompt_len)), SamplingParams(temperature=0.0, max_tokens=8))


def test_admission_needs_blocks_for_the_prompt_and_the_first_step_and_a_free_seat():
    pool = BlockPool(11, 4)  # 10 usable blocks
    scheduler = Scheduler(pool, max_num_seqs=2, max_num_batched_tokens=100, lookahead=5)
    a, b, c = request(15), request(16, first=100), request(1, first=200)
    for r in (a, b, c):
        scheduler.add(r)
    plan = scheduler.schedule()
    # a: 15 positions + 5 = 20 -> 5 blocks; b: 21 -> 6 blocks, only 5 free: b waits, and c behind it
    assert [(ch.request, ch.begin, ch.end) for ch in plan.prefill] == [(a, 0, 15)]
    assert a.status is Status.PREFILLING and len(a.blocks) == 5 and list(scheduler.waiting) == [b, c]
    scheduler.finish(a)
    plan = scheduler.schedule()
    assert [ch.request for ch in plan.prefill] == [b, c] and b.status is c.status is Status.PREFILLING
    for ch in plan.prefill:
        decoding(scheduler, ch.request, ch.end)
    scheduler.add(request(1, first=300))
    assert scheduler.schedule().prefill == [] and len(scheduler.waiting) == 1  # two running: max_num_seqs


def test_prompts_enter_in_chunks_within_the_token_budget_oldest_first():
    pool = BlockPool(40, 4)
    scheduler = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=10, lookahead=1)
    a, b = request(23), request(6, first=100)
    scheduler.add(a)
    scheduler.add(b)
    chunks = []
    for _ in range(4):
        plan = scheduler.schedule()
        chunks.append([(ch.request is a, ch.begin, ch.end, ch.last) for ch in plan.prefill])
        for ch in plan.prefill:
            scheduler.computed(ch.request, ch.end)
            if ch.last:
                ch.request.status = Status.DECODING
    assert chunks == [[(True, 0, 10, False)], [(True, 10, 20, False)], [(True, 20, 23, True), (False, 0, 6, True)],
                      []]


def decoding(scheduler, r, computed):
    """Marks an admitted request as having prefilled `computed` positions and decoding."""
    scheduler.computed(r, computed)
    r.status = Status.DECODING


def test_when_blocks_run_out_the_newest_request_gives_way_and_keeps_its_tokens():
    pool = BlockPool(9, 4)  # 8 usable
    scheduler = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=100, lookahead=4)
    old, new = request(8), request(8, first=100)
    scheduler.add(old)
    scheduler.add(new)
    scheduler.schedule()  # each: 8 + 4 positions = 3 blocks; 2 free
    for r in (old, new):
        decoding(scheduler, r, 8)
    new.result.tokens = [5, 6, 7]  # what it has produced so far
    old.num_computed = 10  # its next step reaches position 14: a fourth block
    new.num_computed = 11
    plan = scheduler.schedule()
    assert plan.decode == [old, new] and pool.num_free == 0  # 2 free blocks: one each
    old.num_computed = 14  # its next step needs a fifth block: none free
    plan = scheduler.schedule()
    assert plan.preempted == [new] and plan.decode == [old] and len(old.blocks) == 5
    assert new.status is Status.WAITING and new.blocks == [] and new.num_computed == 0
    assert list(scheduler.waiting) == [new] and new.result.tokens == [5, 6, 7] and new.num_preemptions == 1
    assert new.num_to_prefill == 8 + 2  # resumed: every token but the newest, the next step's anchor
    scheduler.finish(old)
    plan = scheduler.schedule()
    assert [(ch.request, ch.begin, ch.end) for ch in plan.prefill] == [(new, 8, 10)]  # its prompt's 2 blocks cached
    assert scheduler.counters.preemptions == 1


def decoding_alone(num_blocks: int, block_size: int, prompt_len: int) -> tuple[Scheduler, Request]:
    """A scheduler (lookahead 1) whose one request has prefilled its prompt and decodes."""
    scheduler = Scheduler(BlockPool(num_blocks, block_size), max_num_seqs=4, max_num_batched_tokens=100, lookahead=1)
    r = request(prompt_len)
    scheduler.add(r)
    scheduler.schedule()
    decoding(scheduler, r, prompt_len)
    return scheduler, r


def test_a_request_alone_that_cannot_grow_preempts_itself():
    scheduler, r = decoding_alone(5, 4, 8)
    r.num_computed = 16  # positions up to 16: a fifth block, beyond the pool
    plan = scheduler.schedule()
    assert plan.preempted == [r] and plan.decode == []


def test_a_cached_prompt_leaves_its_last_position_to_compute_and_counts_hits():
    pool = BlockPool(20, 4)
    scheduler = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=100, lookahead=1)
    first = request(12)
    scheduler.add(first)
    for ch in scheduler.schedule().prefill:
        scheduler.computed(ch.request, ch.end)
    blocks = first.blocks
    scheduler.finish(first)
    again = request(12)  # the same 12 tokens: 3 full blocks cached, but the prefill needs the last logits
    scheduler.add(again)
    plan = scheduler.schedule()
    assert [(ch.begin, ch.end) for ch in plan.prefill] == [(8, 12)] and again.num_cached == 8
    assert again.blocks[:2] == blocks[:2]
    assert (scheduler.counters.prefix_queries, scheduler.counters.prefix_hits) == (24, 8)


def test_a_resumed_request_whose_whole_prefill_is_cached_still_computes_its_last_position():
    """Its block keys were known past its prefill before it gave way: the cached prefix it takes is
    still cut where the prefill leaves a position to compute (an empty chunk once followed)."""
    scheduler, r = decoding_alone(20, 2, 4)
    r.result.tokens = [12]
    scheduler.computed(r, 5)  # its first token's key is in: block 2 covers positions 4..5
    scheduler._preempt(r)
    assert r.num_to_prefill == 4 and len(r.block_keys) == 2
    plan = scheduler.schedule()
    assert [(ch.begin, ch.end) for ch in plan.prefill] == [(2, 4)] and r.num_cached == 2
