"""TargetModel: the forward over paged caches (prefill chunks, decode, ragged batches whose blocks lie
anywhere in the pool, rewrites) equals the plain causal forward; hidden-layer outputs are the
residual stream; it compiles with fullgraph."""
import pytest
import torch
import torch._dynamo.testing

from dspark.config import TargetConfig
from dspark.layers import project_vocab, rope_inv_freq
from dspark.target import TargetModel
from paging import paged_caches

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}
VARIANTS = {
    "llama-tied": dict(architecture="llama", tie_word_embeddings=True),
    "llama-untied": dict(architecture="llama", tie_word_embeddings=False),
    "llama3-scaled": dict(architecture="llama", rope_scaling=LLAMA3_SCALING, rope_theta=500000.0),
    "qwen3": dict(architecture="qwen3", tie_word_embeddings=False, head_dim=24),
}
TOL = 1e-5  # float32 rounding: attention over a cache vs over the sequence sums in another order


def make_model(seed=0, **overrides) -> TargetModel:
    torch.manual_seed(seed)
    config = TargetConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                          num_attention_heads=6, num_key_value_heads=2, **overrides)
    model = TargetModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norms: not all ones, so that a skipped or misplaced norm shows
                p.uniform_(0.5, 1.5)
    return model


def full_forward(model, tokens, ids=()):
    # tokens: [T] -> logits [T, V], hidden [T, ...] of the plain causal forward (call before setup_caches)
    logits, hidden = model(tokens[None], torch.arange(len(tokens))[None], hidden_layer_ids=ids)
    return logits[0], None if hidden is None else hidden[0]


def make_model_like(model):
    copy = TargetModel(model.config).eval()
    copy.load_state_dict(model.state_dict())
    return copy


@pytest.mark.parametrize("variant", VARIANTS)
@torch.no_grad()
def test_prefill_then_decode_matches_full_forward(variant):
    model = make_model(**VARIANTS[variant])
    tokens = torch.randint(0, 97, (12,))
    ids = (-1, 0, 2)
    ref_logits, ref_hidden = full_forward(model, tokens, ids)

    table = paged_caches(model, [32])
    logits, hidden = model(tokens[None, :3], torch.arange(3)[None], table, length=3, hidden_layer_ids=ids)
    torch.testing.assert_close(logits[0], ref_logits[:3], atol=TOL, rtol=TOL)
    later, hidden_later = model(tokens[None, 3:5], torch.arange(3, 5)[None], table, length=5, hidden_layer_ids=ids)
    torch.testing.assert_close(later[0], ref_logits[3:5], atol=TOL, rtol=TOL)  # a second prompt chunk
    torch.testing.assert_close(hidden_later[0], ref_hidden[3:5], atol=TOL, rtol=TOL)
    for t in range(5, 12):
        logits, hidden = model(tokens[None, t:t + 1], torch.tensor([[t]]), table, hidden_layer_ids=ids)
        torch.testing.assert_close(logits[0, 0], ref_logits[t], atol=TOL, rtol=TOL)
        torch.testing.assert_close(hidden[0, 0], ref_hidden[t], atol=TOL, rtol=TOL)


@torch.no_grad()
def test_causal_forward_does_not_see_later_tokens():
    model = make_model()
    a = torch.randint(0, 97, (1, 10))
    b = a.clone()
    b[0, 6:] = (b[0, 6:] + 1) % 97
    pos = torch.arange(10)[None]
    la, lb = model(a, pos)[0], model(b, pos)[0]
    torch.testing.assert_close(la[:, :6], lb[:, :6], atol=0, rtol=0)
    assert (la[:, 6:] - lb[:, 6:]).abs().max() > 1e-3


@torch.no_grad()
def test_ragged_batch_of_paged_rows_matches_full_forward():
    model = make_model(architecture="qwen3")
    seqs = {2: torch.randint(0, 97, (11,)), 0: torch.randint(0, 97, (8,))}  # request -> tokens
    refs = {row: full_forward(model, s)[0] for row, s in seqs.items()}
    table = paged_caches(model, [16, 16, 16])
    prompt_len = {2: 6, 0: 3}
    for row, s in seqs.items():  # prefill each request into its own blocks
        n = prompt_len[row]
        logits, _ = model(s[None, :n], torch.arange(n)[None], table[row:row + 1], length=n)
        torch.testing.assert_close(logits[0], refs[row][:n], atol=TOL, rtol=TOL)

    rows = torch.tensor([2, 0])
    # a 2-token step (like verifying a draft), then single tokens, at different positions per row
    for step in (2, 1, 1, 1):
        pos = torch.stack([torch.arange(prompt_len[r], prompt_len[r] + step) for r in rows.tolist()])
        tokens = torch.stack([seqs[r][p] for r, p in zip(rows.tolist(), pos)])
        logits, _ = model(tokens, pos, table[rows])
        for i, r in enumerate(rows.tolist()):
            torch.testing.assert_close(logits[i], refs[r][pos[i]], atol=TOL, rtol=TOL)
            prompt_len[r] += step


@torch.no_grad()
def test_what_a_row_has_not_written_never_reaches_its_logits():
    """Pools full of NaN (the null block, blocks no row holds, the positions past a row's own): a
    ragged batch's prompt chunks and decode steps, through a table wider than its rows, still give
    the full forward's logits. On the CPU both read gathered blocks (attend_gathered)."""
    model = make_model()
    seqs = [torch.randint(0, 97, (13,)), torch.randint(0, 97, (7,))]
    refs = [full_forward(model, s)[0] for s in seqs]
    table = paged_caches(model, [16, 16, 16])[:2]
    for layer in model.layers:
        layer.kv_cache.k_pool.fill_(float("nan")), layer.kv_cache.v_pool.fill_(float("nan"))
    begins = [0, 0]
    for length in (3, 2):  # two chunks of both prompts, one batch each
        tokens = torch.stack([s[b:b + length] for s, b in zip(seqs, begins)])
        positions = torch.tensor(begins)[:, None] + torch.arange(length)
        logits, _ = model(tokens, positions, table, length=max(begins) + length)
        for row in range(2):
            torch.testing.assert_close(logits[row], refs[row][positions[row]], atol=TOL, rtol=TOL)
        begins = [b + length for b in begins]
    begins[1] -= 1  # rows at different positions from here
    for step in (2, 1):
        positions = torch.tensor(begins)[:, None] + torch.arange(step)
        tokens = torch.stack([s[p] for s, p in zip(seqs, positions)])
        logits, _ = model(tokens, positions, table)
        for row in range(2):
            torch.testing.assert_close(logits[row], refs[row][positions[row]], atol=TOL, rtol=TOL)
        begins = [b + step for b in begins]


@torch.no_grad()
def test_rejected_tokens_are_masked_then_overwritten():
    model = make_model()
    accepted = torch.randint(0, 97, (9,))
    ref = full_forward(model, accepted)[0]
    table = paged_caches(model, [16])
    model(accepted[None, :5], torch.arange(5)[None], table, length=5)
    # a draft of 4 tokens at positions 5..8 of which none is accepted: its k/v stay in the cache
    model(torch.randint(0, 97, (1, 4)), torch.arange(5, 9)[None], table)
    # the accepted token at 5 must not see the stale entries at 6..8, and rewrites them
    logits, _ = model(accepted[None, 5:6], torch.tensor([[5]]), table)
    torch.testing.assert_close(logits[0, 0], ref[5], atol=TOL, rtol=TOL)
    logits, _ = model(accepted[None, 6:9], torch.arange(6, 9)[None], table)
    torch.testing.assert_close(logits[0], ref[6:9], atol=TOL, rtol=TOL)


def test_tied_and_untied_embeddings():
    tied, untied = make_model(tie_word_embeddings=True), make_model(tie_word_embeddings=False)
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert untied.lm_head.weight is not untied.embed_tokens.weight
    assert "lm_head.weight" not in dict(tied.named_parameters())
    assert isinstance(tied.embed_tokens, torch.nn.Embedding) and isinstance(tied.lm_head, torch.nn.Linear)


def test_module_names_match_hf():
    names = set(make_model(architecture="qwen3", tie_word_embeddings=False).state_dict())
    layer = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
             "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
             "input_layernorm.weight", "post_attention_layernorm.weight"}
    expected = {"embed_tokens.weight", "norm.weight", "lm_head.weight"}
    expected |= {f"layers.{i}.{n}" for i in range(3) for n in layer}
    assert names == expected



def test_packed_projections_save_and_load_as_hfs_separate_ones():
    model = make_model(architecture="qwen3", attention_bias=True, tie_word_embeddings=False)
    attention, mlp = model.layers[1].self_attn, model.layers[1].mlp
    state = model.state_dict()
    q_rows = attention.q_size
    assert torch.equal(state["layers.1.self_attn.q_proj.weight"], attention.qkv_proj.weight[:q_rows])
    assert torch.equal(state["layers.1.self_attn.v_proj.bias"], attention.qkv_proj.bias[-attention.kv_size:])
    assert torch.equal(state["layers.1.mlp.up_proj.weight"], mlp.gate_up_proj.weight[mlp.down_proj.in_features:])
    edited = {name: t.clone() for name, t in state.items()}
    edited["layers.1.self_attn.k_proj.weight"].fill_(0.5)
    copy = make_model(architecture="qwen3", attention_bias=True, tie_word_embeddings=False)
    copy.load_state_dict(edited)
    k_rows = copy.layers[1].self_attn.qkv_proj.weight[q_rows:q_rows + attention.kv_size]
    assert torch.equal(k_rows, torch.full_like(k_rows, 0.5))
    del edited["layers.1.mlp.gate_proj.weight"]  # a missing part is reported by its own name
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*layers\.1\.mlp\.gate_proj\.weight"):
        copy.load_state_dict(edited)

def test_llama3_rope_scaling_changes_low_frequencies_only():
    c = TargetConfig(head_dim=64, num_attention_heads=1, num_key_value_heads=1, rope_theta=500000.0)
    scaled_config = TargetConfig(**{**c.to_dict(), "rope_scaling": LLAMA3_SCALING})
    plain, scaled = rope_inv_freq(c), rope_inv_freq(scaled_config)
    wavelen = 2 * torch.pi / plain
    old_len, factor = 64, 8.0
    high = wavelen < old_len / 4  # short wavelengths: unchanged
    low = wavelen > old_len / 1  # long wavelengths: slowed down by `factor`
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()
    torch.testing.assert_close(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / factor)
    smooth = (old_len / wavelen[mid] - 1) / (4 - 1)
    torch.testing.assert_close(scaled[mid], (1 - smooth) * plain[mid] / factor + smooth * plain[mid])

    # the model uses them: same weights, different positions' outputs
    model = make_model(rope_scaling=LLAMA3_SCALING, rope_theta=500000.0)
    unscaled = TargetModel(TargetConfig(**{**model.config.to_dict(), "rope_scaling": None})).eval()
    unscaled.load_state_dict(model.state_dict())
    torch.testing.assert_close(model.rotary.inv_freq, rope_inv_freq(model.config))
    tokens, pos = torch.randint(0, 97, (1, 8)), torch.arange(8)[None]
    with torch.no_grad():
        a, b = model(tokens, pos)[0], unscaled(tokens, pos)[0]
    assert (a[0, 1:] - b[0, 1:]).abs().max() > 1e-4


@torch.no_grad()
def test_hidden_layers_are_the_residual_stream():
    model = make_model(tie_word_embeddings=False)
    tokens, pos = torch.randint(0, 97, (2, 6)), torch.arange(6).expand(2, 6)
    captured = {}
    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(lambda mod, args, out, i=i: captured.__setitem__(i, out))
    logits, hidden = model(tokens, pos, hidden_layer_ids=(2, -1, 0))
    d = model.config.hidden_size
    assert hidden.shape == (2, 6, 3 * d)
    torch.testing.assert_close(hidden[..., :d], captured[2], atol=0, rtol=0)
    torch.testing.assert_close(hidden[..., d:2 * d], model.embed_tokens(tokens), atol=0, rtol=0)
    torch.testing.assert_close(hidden[..., 2 * d:], captured[0], atol=0, rtol=0)
    torch.testing.assert_close(model.lm_head(model.norm(hidden[..., :d])), logits, atol=0, rtol=0)
    assert model(tokens, pos)[1] is None
    with pytest.raises(ValueError, match="hidden layer id 3"):
        model(tokens, pos, hidden_layer_ids=(3,))


@torch.no_grad()
def test_logits_at_projects_only_the_chosen_tokens():
    model = make_model()
    tokens, pos = torch.randint(0, 97, (2, 6)), torch.arange(6).expand(2, 6)
    every, hidden = model(tokens, pos, hidden_layer_ids=(1,))
    at = torch.tensor([[5, 0, 5], [2, 3, 1]])
    chosen, same_hidden = model(tokens, pos, hidden_layer_ids=(1,), logits_at=at)
    torch.testing.assert_close(chosen, every.gather(1, at[..., None].expand(-1, -1, every.shape[-1])),
                               atol=TOL, rtol=TOL)
    torch.testing.assert_close(same_hidden, hidden, atol=0, rtol=0)


@torch.no_grad()
def test_dtype_of_caches_logits_and_hidden():
    model = make_model().to(torch.bfloat16)
    model.setup_caches(num_blocks=5, block_size=4)
    assert model.layers[0].kv_cache.k_pool.shape == (2, 5, 4, 8)  # [H_kv, blocks, block size, head_dim]
    assert model.layers[0].kv_cache.v_pool.dtype == torch.bfloat16
    assert model.rotary.inv_freq.dtype == torch.float32  # RoPE angles stay float32
    tokens, positions = torch.zeros(2, 3, dtype=torch.long), torch.arange(3).expand(2, 3)
    logits, hidden = model(tokens, positions, hidden_layer_ids=(1,))
    assert logits.dtype == torch.float32 and hidden.dtype == torch.bfloat16
    # in the model's dtype (as training asks), the same values: the product gives no more digits
    own, _ = model(tokens, positions, logits_dtype=torch.bfloat16)
    assert own.dtype == torch.bfloat16
    torch.testing.assert_close(own.float(), logits, atol=0, rtol=0)


@torch.no_grad()
def test_compiled_fullgraph_matches_eager_without_recompiling():
    eager = make_model(architecture="qwen3")
    compiled_model = make_model_like(eager)
    tables = [paged_caches(m, [16, 16]) for m in (eager, compiled_model)]
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    step = torch.compile(compiled_model, fullgraph=True, backend=counter, dynamic=False)
    tokens = torch.randint(0, 97, (2, 10))

    def run(model, table, t0, t1, offsets):
        pos = torch.arange(t0, t1)[None] + offsets[:, None]
        length = int(pos.max()) + 1 if t0 == 0 else None  # the prompt chunk is gathered, decode steps paged
        return model(tokens[:, t0:t1], pos, table, length=length, hidden_layer_ids=(0, 2))

    offsets = torch.tensor([0, 2])  # ragged: the second row is two tokens further along
    for t0, t1 in ((0, 4), (4, 5), (5, 6), (6, 7), (7, 8)):
        want, got = run(eager, tables[0], t0, t1, offsets), run(step, tables[1], t0, t1, offsets)
        torch.testing.assert_close(got[0], want[0], atol=TOL, rtol=TOL)
        torch.testing.assert_close(got[1], want[1], atol=TOL, rtol=TOL)
    assert counter.frame_count == 2  # one graph for the prefill shape, one for all decode steps


def test_dropped_caches_give_plain_causal_forwards_again():
    model = make_model()
    tokens = torch.randint(0, model.config.vocab_size, (6,))
    want, _ = full_forward(model, tokens)
    model(tokens[None, 3:], torch.arange(3)[None], paged_caches(model, [4]), length=3)
    model.drop_caches()
    torch.testing.assert_close(full_forward(model, tokens)[0], want)


@pytest.mark.parametrize("shape", [(1, 16), (3, 16), (1, 7, 16), (2, 4, 16), (9, 16)])
def test_vocabulary_projection_pads_few_rows_on_cpu_and_gives_the_plain_product(shape):
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(shape)
    logits = project_vocab(lm_head, hidden)
    assert logits.shape == (*shape[:-1], 50) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, lm_head(hidden), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@torch.no_grad()
def test_cuda_causal_forward_matches_the_masked_cached_one_eager_and_compiled():
    """Training's forward on CUDA (no caches: SDPA's causal kernels, grouped heads, no mask) in
    bfloat16, eager and compiled, is as close to the float32 cached forward (a mask over the gathered
    cache) as the bfloat16 cached forward is: the two paths differ by rounding only. A wrong causal
    mask or head grouping misses by the size of the outputs themselves."""
    model = make_model(architecture="qwen3", head_dim=64).to("cuda")
    tokens = torch.randint(0, 97, (3, 70), device="cuda")
    positions = torch.arange(70, device="cuda").expand(3, 70)

    def outputs(model, cached=False):  # logits and the two hidden states, flattened into one vector
        table = paged_caches(model, [70] * 3).cuda() if cached else None
        logits, hidden = model(tokens, positions, table, length=70 if cached else None, hidden_layer_ids=(0, 2))
        return torch.cat([t.float().flatten() for t in (logits, *hidden)])

    bf16 = make_model_like(model).to("cuda", torch.bfloat16)
    reference = outputs(model, cached=True)
    causal, compiled = outputs(bf16), outputs(torch.compile(bf16, dynamic=True))
    masked_error = (outputs(bf16, cached=True) - reference).abs().max()
    for got in (causal, compiled):
        assert (got - reference).abs().max() <= 2 * masked_error, (got - reference).abs().max() / masked_error
