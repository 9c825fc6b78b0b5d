"""dspark::paged_attention: the op against dense masked attention computed independently in float64
from the logical keys (CPU), its registration (opcheck, compile), the KV write, and on CUDA (`gpu`) the
Triton kernels against the CPU implementation, inside CUDA graphs too."""
import pytest
import torch
from torch._inductor.utils import run_and_get_code

import dspark.ops.lse_merge  # noqa: F401
from dspark.kv_cache import PagedKVCache
from dspark.ops.paged_attention import paged_attention_torch, slot_ids, write_kv
from dspark.ops.paged_attention_kernel import MAX_SPLITS, num_splits

attention = torch.ops.dspark.paged_attention
INF = float("inf")


def paged_layout(lengths, kv_heads, head_dim, block_size, dtype, seed=0, shared_blocks=0):
    """Random keys and values for rows holding `lengths` tokens, written through slot_ids / write_kv
    into a pool whose blocks are shuffled; row 1 shares row 0's first `shared_blocks` blocks (same
    keys, same physical blocks). The null block, unused blocks and the tails of last blocks hold NaN.
    -> logical k, v [B, H_kv, S, D], k_pool, v_pool, block_table [B, M] int32 (one spare column)."""
    g = torch.Generator().manual_seed(seed)
    B, S = len(lengths), max(lengths)
    k, v = (torch.randn(B, kv_heads, S, head_dim, generator=g).to(dtype) for _ in range(2))
    if shared_blocks:
        shared = shared_blocks * block_size
        assert shared <= min(lengths[:2])
        k[1, :, :shared], v[1, :, :shared] = k[0, :, :shared], v[0, :, :shared]

    M = -(-S // block_size) + 1
    needed = [-(-n // block_size) for n in lengths]
    physical = (torch.randperm(sum(needed) - shared_blocks, generator=g) + 1).tolist()
    table = torch.zeros(B, M, dtype=torch.int32)
    for b, n in enumerate(needed):
        own = range(shared_blocks, n) if b == 1 else range(n)
        table[b, list(own)] = torch.tensor([physical.pop() for _ in own], dtype=torch.int32)
    if shared_blocks:
        table[1, :shared_blocks] = table[0, :shared_blocks]

    num_blocks = sum(needed) - shared_blocks + 3  # the null block and two never used
    k_pool, v_pool = (torch.full((kv_heads, num_blocks, block_size, head_dim), float("nan"), dtype=dtype)
                      for _ in range(2))
    positions = torch.arange(S).expand(B, S)
    held = positions < torch.tensor(lengths)[:, None]
    write_kv(k_pool, v_pool, slot_ids(table, positions, block_size)[held], k.transpose(1, 2)[held],
             v.transpose(1, 2)[held])
    return k, v, k_pool, v_pool, table


def visible_keys(lo, hi, keys):
    # lo, hi [B, T] -> [B, T, keys] bool: the positions lo <= p < hi
    pos = torch.arange(keys)
    return (pos >= lo[..., None]) & (pos < hi[..., None])


def dense_reference(q, k, v, visible, scale):
    """Masked attention in float64 over the logical keys, each query head with its KV head's keys
    repeated. q [B, H, T, D]; k, v [B, H_kv, S, D]; visible [B, T, S] -> o [B, H, T, D], lse [B, H, T]."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(groups, dim=1) for x in (k, v))
    scores = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~visible[:, None], -INF)
    return scores.softmax(-1).nan_to_num() @ v, scores.logsumexp(-1)


def assert_matches_reference(o, lse, q, k, v, lo, hi, scale):
    o_ref, lse_ref = dense_reference(q, k, v, visible_keys(lo, hi, k.shape[2]), scale)
    assert o.dtype == q.dtype and lse.dtype == torch.float32
    assert not o.isnan().any() and not lse.isnan().any()
    tol = dict(rtol=1e-5, atol=1e-5) if q.dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(o.double(), o_ref, **tol)
    torch.testing.assert_close(lse.double(), lse_ref, rtol=1e-5, atol=1e-5)


def queries(batch, heads, length, head_dim, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, length, head_dim, generator=g).to(dtype)


def verification_bounds(lengths, length):
    """The target's verification: the last `length` tokens of each row, each seeing [0, position]."""
    positions = torch.tensor(lengths)[:, None] - length + torch.arange(length)
    return torch.zeros_like(positions), positions + 1


def context_bounds(starts, length, window):
    """The drafter's context: block queries at start .. start + length - 1 see [lo, start), lo
    max(0, position - window + 1) with a window, else 0."""
    positions = torch.tensor(starts)[:, None] + torch.arange(length)
    hi = torch.tensor(starts)[:, None].expand(-1, length)
    lo = torch.zeros_like(hi) if window is None else (positions - window + 1).clamp(min=0)
    return lo, hi


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [1, 4, 8])
@pytest.mark.parametrize("groups", [1, 3, 4])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_verification_matches_dense_attention(block_size, groups, length, dtype):
    lengths = [37, 9, 64, 16]  # ragged
    k, v, k_pool, v_pool, table = paged_layout(lengths, 2, 16, block_size, dtype)
    q = queries(4, 2 * groups, length, 16, dtype)
    lo, hi = verification_bounds(lengths, length)
    o, lse = attention(q, k_pool, v_pool, table, lo, hi, 0.25)
    assert_matches_reference(o, lse, q, k, v, lo, hi, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 2, 6])
def test_drafter_context_matches_dense_attention(window, dtype):
    starts = [21, 0, 40]  # the second row has no context yet
    k, v, k_pool, v_pool, table = paged_layout([s or 1 for s in starts], 1, 16, 4, dtype)
    q = queries(3, 3, 4, 16, dtype)
    lo, hi = context_bounds(starts, 4, window)
    o, lse = attention(q, k_pool, v_pool, table, lo, hi.int(), 0.3)
    assert_matches_reference(o, lse, q, k, v, lo, hi, 0.3)
    blind = hi <= lo  # queries that see no key: exactly o = 0, lse = -inf
    assert blind[1].all() and (window != 2 or blind[0, 1:].all())
    assert torch.equal(o.transpose(1, 2)[blind], torch.zeros_like(o.transpose(1, 2)[blind]))
    assert (lse.transpose(1, 2)[blind] == -INF).all()


def test_rows_sharing_blocks_read_them_both():
    lengths = [30, 45, 12]
    k, v, k_pool, v_pool, table = paged_layout(lengths, 2, 16, 4, torch.float32, shared_blocks=6)
    assert torch.equal(table[0, :6], table[1, :6]) and not torch.equal(table[0, 6:8], table[1, 6:8])
    q = queries(3, 4, 3, 16, torch.float32)
    lo, hi = verification_bounds(lengths, 3)
    o, lse = attention(q, k_pool, v_pool, table, lo, hi, 0.25)
    assert_matches_reference(o, lse, q, k, v, lo, hi, 0.25)


def test_context_and_block_parts_merge_to_the_drafters_block_attention():
    """The drafter's non-causal block: windowed paged attention over the context, dense attention
    over the block's own keys, joined by lse_merge, equals one attention over both key sets."""
    starts, K, window = [13, 0, 30], 4, 3
    k, v, k_pool, v_pool, table = paged_layout([s or 1 for s in starts], 2, 16, 4, torch.float32)
    q = queries(3, 4, K, 16, torch.float32)
    g = torch.Generator().manual_seed(2)
    k_blk, v_blk = (torch.randn(3, 2, K, 16, generator=g) for _ in range(2))
    lo, hi = context_bounds(starts, K, window)
    o_ctx, lse_ctx = attention(q, k_pool, v_pool, table, lo, hi, 0.25)
    offset = torch.arange(K)
    visible_block = ((offset[:, None] - offset[None, :]).abs() < window).expand(3, K, K)
    o_blk, lse_blk = dense_reference(q, k_blk, v_blk, visible_block, 0.25)

    def tokens_first(x):  # [B, H, K, ...] -> [B * K, H, ...]
        return x.transpose(1, 2).flatten(0, 1)

    o, lse = torch.ops.dspark.lse_merge(tokens_first(o_ctx), tokens_first(lse_ctx),
                                        tokens_first(o_blk.float()), tokens_first(lse_blk.float()))
    visible = torch.cat([visible_keys(lo, hi, k.shape[2]), visible_block], -1)
    o_ref, lse_ref = dense_reference(q, torch.cat([k, k_blk], 2), torch.cat([v, v_blk], 2), visible, 0.25)
    assert (lse_ctx == -INF).any()  # some queries see the block alone
    torch.testing.assert_close(o.double(), tokens_first(o_ref), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), tokens_first(lse_ref), rtol=1e-5, atol=1e-5)


def test_a_table_trimmed_to_the_longest_row_gives_the_same_result():
    lengths = [10, 23]
    _, _, k_pool, v_pool, table = paged_layout(lengths, 1, 16, 4, torch.float32)
    wide = torch.cat([table, torch.zeros(2, 5, dtype=torch.int32)], 1)  # columns of the null block
    q = queries(2, 2, 2, 16, torch.float32)
    lo, hi = verification_bounds(lengths, 2)
    for got, want in zip(attention(q, k_pool, v_pool, wide, lo, hi, 0.25),
                         attention(q, k_pool, v_pool, table[:, :6], lo, hi, 0.25)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_write_kv_and_slot_ids_round_trip():
    g = torch.Generator().manual_seed(3)
    table = torch.tensor([[3, 1, 0], [2, 4, 5], [0, 0, 0]], dtype=torch.int32)  # the last: a padding row
    positions = torch.tensor([[0, 5, 6], [1, 8, 11], [0, 0, 0]])
    slots = slot_ids(table, positions, 4)
    assert slots.dtype == torch.int64
    assert slots.tolist() == [[12, 5, 6], [9, 20, 23], [0, 0, 0]]
    k_pool, v_pool = torch.zeros(2, 6, 4, 8), torch.zeros(2, 6, 4, 8)
    k, v = torch.randn(6, 2, 8, generator=g), torch.randn(6, 2, 8, generator=g)
    write_kv(k_pool, v_pool, slots[:2].flatten(), k, v)
    for pool, x in ((k_pool, k), (v_pool, v)):
        gathered = pool[:, table[:2].long()].flatten(2, 3)  # [H_kv, B, M * block_size, D]
        assert torch.equal(gathered[:, [0, 0, 0, 1, 1, 1], positions[:2].flatten()], x.transpose(0, 1))
        assert torch.count_nonzero(pool) == x.numel()


def opcheck_inputs(dtype, index_dtype):
    lengths = [9, 3]
    _, _, k_pool, v_pool, table = paged_layout(lengths, 1, 16, 4, dtype)
    lo, hi = verification_bounds(lengths, 2)
    hi[1, 0] = 0  # a query that sees nothing
    return queries(2, 2, 2, 16, dtype), k_pool, v_pool, table, lo.to(index_dtype), hi.to(index_dtype), 0.25


def test_opcheck():
    torch.library.opcheck(attention, opcheck_inputs(torch.float32, torch.int32))
    # the output dtype follows q's: the quick checks suffice for a second dtype
    torch.library.opcheck(attention, opcheck_inputs(torch.bfloat16, torch.int64),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiles_fullgraph(backend):
    args = opcheck_inputs(torch.float32, torch.int32)
    compiled = torch.compile(lambda *a: attention(*a), fullgraph=True, backend=backend)
    for got, want in zip(compiled(*args), attention(*args)):
        torch.testing.assert_close(got, want)


def test_write_and_attend_compile_with_inductor():
    """A layer's use: write the step's keys and values, then attend over the pool."""
    lengths = [9, 14]
    _, _, k_pool, v_pool, table = paged_layout(lengths, 2, 16, 4, torch.float32)
    k_pool, v_pool = k_pool.nan_to_num(), v_pool.nan_to_num()
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, h, 3, 16, generator=g) for h in (4, 2, 2))
    positions = torch.tensor(lengths)[:, None] + torch.arange(3)
    lo, hi = torch.zeros_like(positions), positions + 1

    def step(k_pool, v_pool, q, k, v):
        slots = slot_ids(table, positions, 4).flatten()
        write_kv(k_pool, v_pool, slots, k.transpose(1, 2).flatten(0, 1), v.transpose(1, 2).flatten(0, 1))
        return attention(q, k_pool, v_pool, table, lo, hi, 0.25)

    pools = (k_pool.clone(), v_pool.clone())
    want = step(*pools, q, k, v)
    got = torch.compile(step, fullgraph=True)(k_pool, v_pool, q, k, v)
    for x, y in zip(got + (k_pool, v_pool), want + pools):
        torch.testing.assert_close(x, y)


def test_bad_shapes_raise_naming_the_tensor():
    q, k_pool, v_pool, table, lo, hi, scale = opcheck_inputs(torch.float32, torch.int64)
    cases = {
        "q": (q[0], k_pool, v_pool, table, lo, hi),
        "k_pool": (q, k_pool[..., :8], v_pool, table, lo, hi),
        "v_pool": (q, k_pool, v_pool[:, :-1], table, lo, hi),
        "KV heads": (q[:, :1], torch.cat([k_pool, k_pool]), torch.cat([v_pool, v_pool]), table, lo, hi),
        "block_table": (q, k_pool, v_pool, table[:1], lo, hi),
        "lo": (q, k_pool, v_pool, table, lo[:, :1], hi),
        "hi": (q, k_pool, v_pool, table, lo, hi.float()),
    }
    for name, args in cases.items():
        with pytest.raises(ValueError, match=name):
            attention(*args, scale)
    with pytest.raises(ValueError, match="v_pool is torch.bfloat16"):
        attention(q, k_pool, v_pool.bfloat16(), table, lo, hi, scale)


def test_split_count_depends_on_shapes_and_fills_the_gpu():
    assert num_splits(programs=8, max_context=32768, sm_count=132) == 33  # B = 1, 8 KV heads
    assert num_splits(programs=8, max_context=512, sm_count=132) == 2  # short contexts: few splits
    assert num_splits(programs=256, max_context=32768, sm_count=132) == 2
    assert num_splits(programs=512, max_context=32768, sm_count=132) == 1  # the grid is full already
    assert num_splits(programs=1, max_context=1 << 20, sm_count=132) == MAX_SPLITS


# ---------------------------------------------------------------- CUDA

def cuda_case(lengths, heads, kv_heads, head_dim, block_size, length, dtype, window=None, seed=0):
    """A paged layout on CUDA with queries: verification bounds, or the drafter's context bounds when
    a window is given (0 for none)."""
    _, _, k_pool, v_pool, table = paged_layout(lengths, kv_heads, head_dim, block_size, dtype, seed,
                                               shared_blocks=1 if len(lengths) > 1 else 0)
    q = queries(len(lengths), heads, length, head_dim, dtype, seed)
    if window is None:
        lo, hi = verification_bounds(lengths, length)
    else:
        lo, hi = context_bounds(lengths, length, window or None)
    return [x.cuda() for x in (q, k_pool, v_pool, table, lo.int(), hi.int())]


def assert_cuda_matches_cpu(o, lse, q, k_pool, v_pool, table, lo, hi, scale):
    o_ref, lse_ref = paged_attention_torch(*(x.cpu() for x in (q, k_pool, v_pool, table, lo, hi)), scale)
    tol = dict(rtol=1e-5, atol=1e-5) if q.dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(o.cpu(), o_ref, **tol)
    torch.testing.assert_close(lse.cpu(), lse_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("length", [1, 8, 16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 128), (9, 3, 64)])  # Llama-3-8B, SmolLM2
@pytest.mark.parametrize("lengths", [[3000], [700, 40, 1500, 64, 33], [200, 40, 100]],
                         ids=["one-long-row", "ragged", "short"])  # the last: one split
def test_cuda_matches_cpu(lengths, heads, kv_heads, head_dim, block_size, length):
    for window in (None, 0, 5):
        args = cuda_case(lengths, heads, kv_heads, head_dim, block_size, length, torch.bfloat16, window)
        assert_cuda_matches_cpu(*attention(*args, 0.1), *args, 0.1)



@torch.inference_mode()
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_compiled_kv_write_touches_only_the_written_slots(device):
    """No loop of a compiled write spans a whole pool: torch 2.11's Inductor copied both pools whole on
    CUDA (every layer, every step) when they were written through a flat view of them. The control: a
    compiled op over the whole pool is seen by the same check."""
    cache = PagedKVCache(num_blocks=1009, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                         device=torch.device(device))
    slots = torch.tensor([[17, 18], [16 * 500, 16 * 1008 + 15]], device=device)
    k, v = (torch.randn(2, 2, 2, 64, device=device, dtype=torch.bfloat16) for _ in range(2))  # [B, H_kv, T, D]

    def spans_the_pool(function, *args) -> bool:
        _, code = run_and_get_code(torch.compile(function, fullgraph=True), *args)
        return str(cache.k_pool.numel()) in "\n".join(code)

    assert not spans_the_pool(cache.write, slots, k, v)
    assert torch.equal(cache.k_pool[:, 500, 0], k[1, :, 0]) and torch.equal(cache.v_pool[:, 1008, 15], v[1, :, 1])
    assert spans_the_pool(lambda: cache.k_pool.mul_(2))


@pytest.mark.gpu
def test_cuda_float32_is_not_tf32():
    args = cuda_case([900, 40], 8, 2, 64, 16, 4, torch.float32)
    assert_cuda_matches_cpu(*attention(*args, 0.125), *args, 0.125)


@pytest.mark.gpu
def test_cuda_opcheck_and_compile():
    args = cuda_case([300, 17], 8, 2, 64, 16, 4, torch.bfloat16)
    torch.library.opcheck(attention, (*args, 0.125))
    compiled = torch.compile(lambda *a: attention(*a, 0.125), fullgraph=True)
    for got, want in zip(compiled(*args), attention(*args, 0.125)):
        torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_graph_replays_follow_changed_lengths(compiled):
    """One capture, replayed with other tables and lengths written into its static inputs: the
    kernels read the bounds at run time (the grid and split count depend only on shapes)."""
    first = cuda_case([2000, 50, 700, 8], 32, 8, 128, 16, 8, torch.bfloat16, seed=0)
    step = (lambda *a: attention(*a, 0.1))
    if compiled:
        step = torch.compile(step, fullgraph=True)
    static = [x.clone() for x in first]
    static[1], static[2] = (torch.zeros(8, 512, 16, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*static)
    for seed, lengths in enumerate([[2000, 50, 700, 8], [40, 1900, 30, 1200], [64, 64, 64, 64]]):
        case = cuda_case(lengths, 32, 8, 128, 16, 8, torch.bfloat16, seed=seed)
        q, k_pool, v_pool, table, lo, hi = case
        static[0].copy_(q)
        static[1][:, :k_pool.shape[1]].copy_(k_pool)
        static[2][:, :v_pool.shape[1]].copy_(v_pool)
        static[3].zero_()[:, :table.shape[1]].copy_(table)
        static[4].copy_(lo)
        static[5].copy_(hi)
        graph.replay()
        assert_cuda_matches_cpu(*out, *static, 0.1)


@pytest.mark.gpu
def test_cuda_graph_writes_then_attends():
    """A layer's step captured once: write the step's keys and values, attend over the pool; replayed
    with other tokens at other slots."""
    q, k_pool, v_pool, table, lo, hi = cuda_case([300, 90, 41], 8, 2, 64, 16, 4, torch.bfloat16)
    positions = hi.long() - 1  # the step's tokens: the last 4 of each row
    slots = slot_ids(table, positions, 16).flatten()
    k, v = torch.randn(2, 12, 2, 64, dtype=torch.bfloat16, device="cuda")
    k_pool, v_pool = k_pool.nan_to_num(), v_pool.nan_to_num()

    def step():
        write_kv(k_pool, v_pool, slots, k, v)
        return attention(q, k_pool, v_pool, table, lo, hi, 0.125)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in range(2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        k.copy_(torch.randn(k.shape, generator=g, device="cuda"))
        v.copy_(torch.randn(v.shape, generator=g, device="cuda"))
        slots.copy_(slot_ids(table, positions - seed, 16).flatten())
        lo.fill_(seed)
        graph.replay()
        heads_first = k_pool.view(2, -1, 64)[:, slots].transpose(0, 1)
        assert torch.equal(heads_first, k) and torch.equal(v_pool.view(2, -1, 64)[:, slots].transpose(0, 1), v)
        assert_cuda_matches_cpu(*out, q, k_pool, v_pool, table, lo, hi, 0.125)
