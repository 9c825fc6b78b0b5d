"""Drafter training's data: the prompt corpus, self-distillation's responses and cache, and the
batches a step reads (anchors, follow-ups, the order of sequences)."""
import copy
import dataclasses
import json

import pytest
import torch

from dspark import train as training
from dspark.data import DOMAINS, Sequence, heldout_prompts, training_prompts
from dspark.train.self_distill import response_params, self_distill
from tiny_training import random_prompts, target  # noqa: F401  (target: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def corpus():
    return training_prompts()


def test_training_prompts_cover_every_domain(corpus):
    counts = {d: sum(p.domain == d for p in corpus) for d in DOMAINS}
    assert all(n >= 200 for n in counts.values()), counts
    assert len({p.text for p in corpus}) == len(corpus)


def test_heldout_prompts_are_disjoint_from_training(corpus):
    heldout = heldout_prompts()
    assert {p.domain for p in heldout} == set(DOMAINS) and len(heldout) >= 60

    def runs(text: str, n: int = 8) -> set:
        words = text.split()
        return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}

    seen = set().union(*(runs(p.text) for p in corpus))
    shared = [p.text[:60] for p in heldout if runs(p.text) & seen]
    assert not shared, f"held-out prompts share 8-word runs with training prompts: {shared}"
    assert not {p.text for p in heldout} & {p.text for p in corpus}


def test_first_response_of_a_prompt_is_greedy_the_others_sampled_with_their_own_seeds():
    params = [response_params(i, 3, seed=5, max_tokens=9, stop_token_ids=[2]) for i in range(6)]
    assert [p.temperature for p in params] == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert len({p.seed for p in params}) == 6
    assert all(p.max_tokens == 9 and p.stop_token_ids == [2] for p in params)


def test_self_distill_resumes_from_a_cut_cache(target, tmp_path):
    prompts = [p[:n] for p, n in zip(random_prompts(6, seed=3), (4, 2, 3, 1, 4, 2))]
    whole, _ = self_distill(target, prompts, tmp_path / "whole.jsonl", max_tokens=8, seed=0, stop_token_ids=[],
                            batch_size=3)
    lines = (tmp_path / "whole.jsonl").read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:3]) + lines[3][:10])  # header, two sequences, half of the third
    answered = []
    resumed, done = self_distill(target, prompts, cut, max_tokens=8, seed=0, stop_token_ids=[], batch_size=3,
                                 progress=answered.append)
    assert done and resumed == whole
    assert [s.tokens[:s.prompt_len] for s in whole] == prompts  # returned in prompt order
    cached = [json.loads(line)["prompt_len"] for line in lines[1:]]
    assert cached == [1, 2, 2, 3, 4, 4]  # generated shortest first
    assert answered == [2, 3, 1]  # two from the cache, then the rest in batches
    # a complete cache is read, not written again (it may lie in a read-only folder)
    before = cut.stat()
    assert self_distill(target, prompts, cut, max_tokens=8, seed=0, stop_token_ids=[], batch_size=3) == (whole, True)
    assert (cut.stat().st_ino, cut.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    # answers to other stop tokens, or by the target in another dtype, are other data
    with pytest.raises(ValueError, match="generated with"):
        self_distill(target, prompts, cut, max_tokens=8, seed=0, stop_token_ids=[5], batch_size=3)
    with pytest.raises(ValueError, match="generated with"):
        self_distill(copy.deepcopy(target).double(), prompts, cut, max_tokens=8, seed=0, stop_token_ids=[],
                     batch_size=3)
    assert cut.read_text() == (tmp_path / "whole.jsonl").read_text()


def test_batches_anchor_only_response_positions_with_labels():
    sequences = [Sequence(list(range(1, 21)), prompt_len=12), Sequence(list(range(1, 9)), prompt_len=5)]
    config = training.TrainConfig(batch_size=2, num_anchors=6)
    for step in range(4):
        batch = training.make_batch(sequences, step, config, block_size=3)
        for row in range(2):
            length = int((batch.tokens[row] > 0).sum())
            seq = next(s for s in sequences if len(s.tokens) == length)
            used = batch.valid[row, :, 0]
            anchors = batch.anchors[row][used]
            assert len(anchors) == min(6, length - 1 - seq.prompt_len)
            assert anchors.min() >= seq.prompt_len and anchors.max() + 1 < length
            label_at = batch.anchors[row, :, None] + torch.arange(1, 4)
            assert torch.equal(batch.valid[row], used[:, None] & (label_at < length))


def test_heldout_batches_hold_every_heldout_sequence_once_in_order():
    # 10 sequences of distinct lengths, 4 a batch: batches of 4, 4 and 2 (the old cut kept 8)
    sequences = [Sequence(list(range(1, 12 + n)), prompt_len=4) for n in range(10)]
    batches = training.heldout_batches(sequences, training.TrainConfig(batch_size=4, num_anchors=3), block_size=2)
    assert [len(b.tokens) for b in batches] == [4, 4, 2]
    lengths = [int(n) for b in batches for n in (b.tokens > 0).sum(1)]
    assert lengths == [len(s.tokens) for s in sequences]


def test_follow_ups_are_where_a_greedy_decode_drafts_next_and_take_their_share_of_the_anchors():
    sequences = [Sequence(list(range(1, 41)), prompt_len=4), Sequence(list(range(1, 21)), prompt_len=12)]
    config = training.TrainConfig(batch_size=2, num_anchors=8, followup_anchors=0.5)
    batch = training.make_batch(sequences, 0, config, block_size=3)
    # first row: blocks agree for 0, 1, 2, 3 leading slots; a miss inside a run ends it
    agree = torch.zeros(2, 8, 3)
    agree[0, 1, 0] = agree[0, 2, :2] = agree[0, 3] = agree[0, 4, [0, 2]] = 1.0
    followups = training.FollowUps(num_sequences=5, num_anchors=8)
    followups.update([3, 1], batch, agree)
    anchors = batch.anchors[0]
    assert followups.table[3].tolist() == (anchors + torch.tensor([0, 1, 2, 3, 1, 0, 0, 0]) + 1).tolist()
    # the second sequence has 7 response positions: its eighth block is padding, without a follow-up
    assert followups.table[1, 7] == -1 and (followups.table[1, :7] >= 0).all()
    assert followups[[1]][0].tolist() == (batch.anchors[1, :7] + 1).tolist()  # no agreement there
    assert followups[[0]][0].numel() == 0  # never visited

    table = [torch.tensor([30, 30, 6, 39, 2, 20, 11, 17]), torch.tensor([5, 13, 19, 40])]
    for step in range(5):
        plain = training.make_batch(sequences, step, config, block_size=3)
        batch = training.make_batch(sequences, step, config, block_size=3, followups=table)
        first = batch.anchors[0]
        assert len(first.unique()) == 8 and torch.equal(first, first.sort().values)
        inside = {30, 6, 20, 11, 17}  # 39 has no label after it, 2 is in the prompt
        assert len(inside & set(first.tolist())) >= 4  # half of the 8 anchors (a random one may be a fifth)
        assert set(first.tolist()) <= set(plain.anchors[0].tolist()) | inside  # the rest from the random order
        second = batch.anchors[1][batch.valid[1, :, 0]]
        assert 5 not in second and len(second.unique()) == 7  # 5 is in the prompt; 13 is not taken twice
        assert 19 not in batch.anchors[1]  # the last token has no label after it
    no_share = dataclasses.replace(config, followup_anchors=0.0)
    assert torch.equal(training.make_batch(sequences, 2, no_share, 3, followups=table).anchors,
                       training.make_batch(sequences, 2, no_share, 3).anchors)
    with pytest.raises(ValueError, match="followup_anchors"):
        training.TrainConfig(followup_anchors=1.5)


def test_batch_order_sees_every_sequence_once_an_epoch_in_batches_of_similar_lengths():
    lengths = torch.randint(10, 500, (1000,), generator=torch.Generator().manual_seed(0)).tolist()
    padded = {}
    for bucket_batches in (1, 16):
        config = training.TrainConfig(batch_size=10, bucket_batches=bucket_batches, seed=3)
        order = training.BatchOrder(lengths, config)
        for epoch in range(2):
            batches = [order(epoch * 100 + b) for b in range(100)]
            assert sorted(i for batch in batches for i in batch) == list(range(1000))
        assert order(5) == training.BatchOrder(lengths, config)(5)  # a function of (lengths, config, step)
        assert order(5) != order(105)  # another epoch, another order
        padded[bucket_batches] = sum(max(lengths[i] for i in order(b)) * 10 for b in range(100)) / sum(lengths)
    assert padded[1] > 1.5 and padded[16] < 1.1  # random batches against length buckets
    with pytest.raises(ValueError, match="bucket_batches"):
        training.BatchOrder(lengths, training.TrainConfig(bucket_batches=0))
    with pytest.raises(ValueError, match="cannot fill a batch of 64"):
        training.BatchOrder(lengths[:63], training.TrainConfig())
