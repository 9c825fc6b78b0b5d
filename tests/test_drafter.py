"""The DSpark drafter: block attention, context cache, training forward, confidence head, compile."""
import pytest
import torch
import torch.nn.functional as F

from dspark.config import DrafterConfig, TargetConfig
from dspark.drafter import (DSparkDrafter, block_visible, context_visible, merged_block_attention,
                            partial_attention)
from dspark.kv_cache import CacheAccess, PagedKVCache
from paging import paged_caches

TARGET = TargetConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2)
LENGTH = 16  # context positions written into the cache


def make_drafter(window=None, block_size=4, seed=0, **overrides):
    torch.manual_seed(seed)
    config = DrafterConfig.for_target(TARGET, num_hidden_layers=2, block_size=block_size,
                                      target_layer_ids=[0, 2], mask_token_id=95, markov_rank=8,
                                      sliding_window=window, **overrides)
    drafter = DSparkDrafter(config).eval()
    for p in drafter.parameters():  # norms start at 1: randomise them too, so they count
        p.data.normal_(0, 0.3 if p.dim() > 1 else 1)
    return drafter


def make_features(batch=3, length=LENGTH, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, length, 2 * TARGET.hidden_size, generator=g)


def reference_block(drafter, features, anchor, start):
    """DeepSpec's draft forward for one sequence, written out: in every layer the keys/values are
    [k/v_proj(H_ctx) for the context before `start` | k/v_proj(block)], H_ctx bypassing the layer's
    input_layernorm; attention is non-causal (two-sided window |query - key| < W if configured)."""
    c, K = drafter.config, drafter.config.block_size
    context = drafter.hidden_norm(drafter.fc(features[None, :start]))
    context_pos, block_pos = torch.arange(start)[None], start + torch.arange(K)[None]
    context_rope = drafter.rotary(context_pos)
    block_rope = drafter.rotary(block_pos)
    key_pos = torch.cat([context_pos, block_pos], 1)[0]
    mask = None
    if c.sliding_window is not None:
        mask = (block_pos[0, :, None] - key_pos[None, :]).abs() < c.sliding_window
    groups = c.num_attention_heads // c.num_key_value_heads

    x = drafter.embed_tokens(torch.tensor([[anchor] + [c.mask_token_id] * (K - 1)]))
    for layer in drafter.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q, block_k, block_v = attn(h, *block_rope)
        context_k, context_v = attn.keys_values(context, *context_rope)
        k = torch.cat([context_k, block_k], 2).repeat_interleave(groups, 1)
        v = torch.cat([context_v, block_v], 2).repeat_interleave(groups, 1)
        x = x + attn.output(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    hidden = drafter.norm(x)
    return drafter.lm_head(hidden).float()[0], hidden[0]


@torch.no_grad()
@pytest.mark.parametrize("window, block_size", [(None, 4), (5, 4), (3, 4)])  # W=3 < K: block keys windowed too
def test_forward_block_equals_deepspec_block_attention(window, block_size):
    drafter = make_drafter(window, block_size)
    features = make_features()
    table = paged_caches(drafter, [LENGTH + block_size] * 3)
    # The cache holds all LENGTH positions: those at or after a row's start must not be seen.
    drafter.append_context(features, torch.arange(LENGTH).expand(3, LENGTH), table)
    anchor, start = torch.tensor([7, 94, 0]), torch.tensor([1, 9, 16])

    logits, hidden = drafter.forward_block(anchor, start, table)
    assert logits.shape == (3, block_size, TARGET.vocab_size) and logits.dtype == torch.float32
    for b in range(3):
        want_logits, want_hidden = reference_block(drafter, features[b], int(anchor[b]), int(start[b]))
        torch.testing.assert_close(logits[b], want_logits)
        torch.testing.assert_close(hidden[b], want_hidden)


@torch.no_grad()
def test_append_context_in_chunks_equals_at_once():
    drafter = make_drafter(window=6)
    features, positions = make_features(), torch.arange(LENGTH).expand(3, LENGTH)
    anchor, start = torch.tensor([1, 2, 3]), torch.tensor([5, 11, 16])
    table = paged_caches(drafter, [LENGTH + 4] * 3)
    drafter.append_context(features, positions, table)
    at_once = drafter.forward_block(anchor, start, table)

    table = paged_caches(drafter, [LENGTH + 4] * 3, seed=1)
    for chunk in torch.arange(LENGTH).split([5, 1, 7, 3]):
        drafter.append_context(features[:, chunk], positions[:, chunk], table)
    for got, want in zip(drafter.forward_block(anchor, start, table), at_once):
        torch.testing.assert_close(got, want)


@torch.no_grad()
@pytest.mark.parametrize("window", [None, 3])
def test_forward_train_equals_forward_block_anchor_by_anchor(window):
    drafter = make_drafter(window)
    features = make_features(batch=2)
    tokens = torch.randint(0, 95, (2, LENGTH), generator=torch.Generator().manual_seed(2))
    anchors = torch.tensor([[0, 7, 15], [3, 4, 12]])
    logits, hidden = drafter.forward_train(features, tokens, anchors)
    assert logits.shape == (2, 3, 4, TARGET.vocab_size)

    table = paged_caches(drafter, [LENGTH + 4] * 2)
    drafter.append_context(features, torch.arange(LENGTH).expand(2, LENGTH), table)
    for n in range(3):
        block_logits, block_hidden = drafter.forward_block(tokens.gather(1, anchors[:, n:n + 1])[:, 0],
                                                           anchors[:, n], table)
        torch.testing.assert_close(logits[:, n], block_logits, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(hidden[:, n], block_hidden, rtol=1e-4, atol=1e-5)


def test_forward_train_is_differentiable():
    drafter = make_drafter()
    features = make_features(batch=1)
    tokens = torch.randint(0, 95, (1, LENGTH))
    logits, _ = drafter.forward_train(features, tokens, torch.tensor([[2, 9]]))
    logits.logsumexp(-1).sum().backward()
    assert drafter.fc.weight.grad.abs().sum() > 0
    attention = drafter.layers[0].self_attn
    k_rows = attention.qkv_proj.weight.grad[attention.q_size:attention.q_size + attention.kv_size]
    assert k_rows.abs().sum() > 0


@pytest.mark.parametrize("window", [None, 4])
def test_lse_merged_block_attention_equals_dense_masked_attention(window):
    g = torch.Generator().manual_seed(3)
    batch, heads, kv_heads, K, S, D = 3, 4, 2, 5, 12, 8
    q = torch.randn(batch, heads, K, D, generator=g)
    k, v = (torch.randn(batch, kv_heads, K, D, generator=g) for _ in range(2))
    context_k, context_v = (torch.randn(batch, kv_heads, S, D, generator=g) for _ in range(2))
    start = torch.tensor([0, 6, 12])  # row 0 sees no context at all
    key_pos, query_pos = torch.arange(S)[None], start[:, None] + torch.arange(K)
    to_context = context_visible(key_pos, query_pos, start[:, None], window)
    to_block = block_visible(K, window, q.device)

    cache = PagedKVCache(1 + 3 * 3, 4, kv_heads, D, torch.float32, torch.device("cpu"))  # rows of 3 blocks
    table = torch.arange(1, 10, dtype=torch.int32).view(3, 3).flip(1)
    positions = torch.arange(S).expand(batch, S)
    cache.write(CacheAccess.gathered(table, positions, 4, S).slots, context_k, context_v)
    lo = torch.zeros_like(query_pos) if window is None else (query_pos - window + 1).clamp_min(0)
    access = CacheAccess(table, lo=lo, hi=start[:, None].expand(batch, K))
    got = merged_block_attention(q, k, v, context=cache, access=access, block_visible=to_block, scale=D ** -0.5)
    to_block = torch.ones(1, K, K, dtype=torch.bool) if to_block is None else to_block
    mask = torch.cat([to_context.expand(batch, K, S), to_block.expand(batch, K, K)], -1)
    keys = torch.cat([context_k, k], 2).repeat_interleave(2, 1)
    values = torch.cat([context_v, v], 2).repeat_interleave(2, 1)
    want = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None])
    torch.testing.assert_close(got, want)


def test_partial_attention_of_a_query_that_sees_nothing_is_empty():
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
    visible = torch.zeros(1, 3, 5, dtype=torch.bool)
    o, lse = partial_attention(q, k, v, visible, scale=0.5)
    assert torch.equal(o, torch.zeros_like(o)) and (lse == float("-inf")).all()


@pytest.mark.parametrize("window", [None, 5])
def test_compiled_step_matches_eager(window):
    drafter = make_drafter(window)
    features, positions = make_features(), torch.arange(LENGTH).expand(3, LENGTH)
    anchor, start = torch.tensor([4, 5, 6]), torch.tensor([3, 8, 16])

    def step(features, positions, anchor, start, table):
        drafter.append_context(features, positions, table)
        return drafter.forward_block(anchor, start, table)

    with torch.no_grad():
        want = step(features, positions, anchor, start, paged_caches(drafter, [LENGTH + 4] * 3))
        table = paged_caches(drafter, [LENGTH + 4] * 3, seed=1)
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(features, positions, anchor, start, table)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_confidence_head_reads_hidden_and_markov_embedding():
    drafter = make_drafter(enable_confidence_head=True)
    hidden, prev = torch.randn(2, 4, 32), torch.randn(2, 4, 8)
    proj = drafter.confidence_head.proj
    assert proj.in_features == 32 + 8
    torch.testing.assert_close(drafter.confidence(hidden, prev),
                               (torch.cat([hidden, prev], -1) @ proj.weight.T + proj.bias)[..., 0])
    with pytest.raises(ValueError, match="prev_embedding"):
        drafter.confidence(hidden)

    plain = make_drafter(enable_confidence_head=True, confidence_head_with_markov=False)
    assert plain.confidence(hidden).shape == (2, 4)
    with pytest.raises(RuntimeError, match="no confidence head"):
        make_drafter().confidence(hidden)


def test_block_needs_caches():
    with pytest.raises(RuntimeError, match="setup_caches"):
        make_drafter().forward_block(torch.tensor([1]), torch.tensor([3]), torch.ones(1, 1, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 5])
def test_cuda_compiled_step_matches_cpu(window):
    drafter = make_drafter(window)
    inputs = (make_features(), torch.arange(LENGTH).expand(3, LENGTH), torch.tensor([4, 5, 6]),
              torch.tensor([3, 8, 16]))

    def step(features, positions, anchor, start, table):
        drafter.append_context(features, positions, table)
        return drafter.forward_block(anchor, start, table)

    with torch.no_grad():
        want = step(*inputs, paged_caches(drafter, [LENGTH + 4] * 3))
        table = paged_caches(drafter.cuda(), [LENGTH + 4] * 3)
        got = torch.compile(step, fullgraph=True)(*(t.cuda() for t in inputs), table.cuda())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-4, atol=1e-4)


def test_rope_frequencies_stay_float32_when_the_drafter_is_cast():
    config = DrafterConfig(vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    drafter = DSparkDrafter(config).to(torch.bfloat16)
    assert drafter.rotary.inv_freq.dtype == torch.float32
