"""SamplingParams validation, SamplingTensors packing and the top-k / top-p / min-p filters."""
import numpy as np
import pytest
import torch

from dspark.sampling import SamplingParams, SamplingTensors, apply_filters


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
    ("top_k", 2.5), ("min_p", -0.1), ("min_p", 1.1), ("max_tokens", 0), ("seed", -2**63 - 1), ("seed", 2**63),
    ("stop", [""]), ("stop", [3]), ("stop_token_ids", [-2]),
    # neither infinities, strings nor bools pass for numbers (inf once sampled uniformly)
    ("temperature", float("inf")), ("temperature", "1"), ("temperature", None), ("top_p", "0.5"),
    ("top_k", True), ("max_tokens", True), ("seed", True), ("stop_token_ids", [True]), ("ignore_eos", "no"),
    ("stop", 5), ("stop_token_ids", 2), ("stop", {"a": 1}),  # once a TypeError from list()
])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_seeds_span_int64():
    assert SamplingParams(seed=-2**63).seed == -2**63 and SamplingParams(seed=2**63 - 1).seed == 2**63 - 1


def test_numpy_numbers_are_numbers():
    params = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), max_tokens=np.int32(4))
    assert params.temperature == 0.5 and params.top_k == 3 and params.max_tokens == 4


def test_params_normalise_stops_and_know_their_filters():
    params = SamplingParams(stop="\n\n")
    assert params.stop == ["\n\n"] and params.stop_token_ids == []
    assert not params.uses_filters
    assert SamplingParams(top_k=5).uses_filters and SamplingParams(top_p=0.9).uses_filters
    assert SamplingParams(min_p=0.1).uses_filters
    assert not SamplingParams(temperature=0.0, top_k=5).uses_filters  # greedy never filters


def test_sampling_tensors_pack_the_batch():
    params = [SamplingParams(temperature=0.7, top_k=3, seed=11), SamplingParams(temperature=0.0),
              SamplingParams(top_p=0.9, min_p=0.05), SamplingParams()]
    tensors = SamplingTensors.from_params(params)
    assert tensors.temperature.dtype == torch.float32 and tensors.seed.dtype == torch.int64
    assert tensors.temperature.tolist() == pytest.approx([0.7, 0.0, 1.0, 1.0])
    assert tensors.top_k.tolist() == [3, 0, 0, 0]
    assert tensors.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9, 1.0])
    assert tensors.min_p.tolist() == pytest.approx([0.0, 0.0, 0.05, 0.0])
    assert tensors.uses_filters
    seeds = tensors.seed.tolist()
    assert seeds[0] == 11 and all(0 <= s < 2**63 for s in seeds) and len(set(seeds[1:])) == 3
    assert not SamplingTensors.from_params([SamplingParams(), SamplingParams(temperature=0)]).uses_filters


def reference_kept(logits: np.ndarray, t: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The kept token set of one row, in float64: min-p and top-k, then top-p over what is left."""
    z = logits.astype(np.float64) / t
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    kth = probs[order[min(top_k, len(order)) - 1]] if top_k else 0.0  # tokens tied with the k-th stay
    kept = [v for v in order if probs[v] >= kth and probs[v] >= min_p * probs[order[0]]]
    mass = probs[kept] / probs[kept].sum()
    before = np.cumsum(mass) - mass
    return {v for v, m in zip(kept, before) if top_p >= 1 or m < top_p}


def test_filters_keep_exactly_the_reference_sets():
    generator = torch.Generator().manual_seed(0)
    combos = [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.1),  # (top_k, top_p, min_p)
              (10, 0.8, 0.0), (0, 0.5, 0.05), (3, 0.95, 0.2), (40, 0.99, 0.01)] * 3
    B, N, V = len(combos), 3, 64
    logits = torch.randn(B, N, V, generator=generator) * 3
    temperature = torch.rand(B, generator=generator) * 1.5 + 0.3
    top_k, top_p, min_p = (torch.tensor(column) for column in zip(*combos))
    filtered = apply_filters(logits, temperature, top_k, top_p, min_p)
    sizes = []
    for b in range(B):
        for i in range(N):
            kept = torch.isfinite(filtered[b, i])
            expected = reference_kept(logits[b, i].numpy(), temperature[b].item(), top_k[b].item(),
                                      top_p[b].item(), min_p[b].item())
            assert set(kept.nonzero().flatten().tolist()) == expected, (b, i)
            assert torch.equal(filtered[b, i][kept], logits[b, i][kept])
            sizes.append(len(expected))
    assert min(sizes) < 5 and max(sizes) == V  # the cases cover heavy filtering and none


def test_top_k_keeps_the_tokens_tied_with_the_kth_as_vllm_does():
    """Which of two tied tokens a sort puts first is no rule (it may differ by device); vLLM keeps both."""
    logits = torch.tensor([[[1.0, 3.0, 1.0, 0.0, 3.0]]])
    one = torch.tensor([1.0])
    for k, kept in [(1, [1, 4]), (2, [1, 4]), (3, [0, 1, 2, 4]), (9, [0, 1, 2, 3, 4])]:
        filtered = apply_filters(logits, one, torch.tensor([k]), one, torch.tensor([0.0]))
        assert torch.isfinite(filtered[0, 0]).nonzero().flatten().tolist() == kept, k


def test_neutral_temperature_only_and_greedy_rows_are_unchanged():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 2, 32, generator=generator)
    logits[3] = float("nan")  # a padding row with neutral parameters
    temperature = torch.tensor([0.5, 1.0, 0.0, 1.0])
    top_k = torch.tensor([0, 0, 3, 0])
    top_p = torch.tensor([1.0, 1.0, 0.5, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.3, 0.0])
    filtered = apply_filters(logits, temperature, top_k, top_p, min_p)
    torch.testing.assert_close(filtered, logits, rtol=0, atol=0, equal_nan=True)


def test_filters_compile_fullgraph():
    generator = torch.Generator().manual_seed(2)
    args = (torch.randn(3, 2, 40, generator=generator), torch.tensor([0.8, 1.0, 0.0]),
            torch.tensor([5, 0, 0]), torch.tensor([1.0, 0.7, 1.0]), torch.tensor([0.1, 0.0, 0.0]))
    compiled = torch.compile(apply_filters, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(*args), apply_filters(*args))


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    """top_p = 1e-300 is valid (> 0) but 0 in float32: it once removed every token."""
    logits = torch.tensor([[[0.0, 3.0, 1.0, 2.0]]])
    one = torch.ones(1)
    filtered = apply_filters(logits, one, torch.zeros(1, dtype=torch.long), torch.tensor([1e-300]), torch.zeros(1))
    assert filtered[0, 0].isfinite().tolist() == [False, True, False, False]
