"""The drafting kernels (step, pick) under the Triton interpreter against the plain-torch
implementations: biased logits, tile maxima, winners' token ids and gathered rows exactly; sums and
proposals to float32 rounding (numpy's exp/log may differ from torch's by an ulp).

The step kernel is checked without a bias, with a precomputed bias (in the logits' dtype) and with
the bias as a low-rank product it computes itself (tl.dot; factors whose products and sums are exact
in float32 in any order), one and several vocabulary tiles (holding one group, a part of one or
several groups), one and several rows per tile (B = 3 and 5 cross row tiles of 2 and 4, leaving
masked rows in the last tile), float32 and bfloat16 logits, greedy and NaN padding rows."""
import pytest
import torch

from dspark.ops.gumbel_max import num_units
from dspark.ops.gumbel_pick import gumbel_pick_torch, launch_gumbel_pick
from dspark.ops.gumbel_step import launch_step, low_rank_bias, step_torch

K, V, R = 2, 300, 24

# numpy evaluates log(0) and -inf - -inf in lanes the kernels then discard
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning",
                                        "ignore:invalid value:RuntimeWarning")


def run_kernel(kernel):
    """The launchers' `wrap`: under the interpreter the kernel is launched as it is."""
    return kernel


def inputs(batch, dtype, seed=0):
    """logits [B, K, V], bias [B, V] float32, temperature, seed, offset [B]. Row 1 is greedy with a
    tie across tiles (tokens 7 and 290, the same bias at both), row 2 (if any) a NaN padding row."""
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(batch, K, V, generator=g)).to(dtype)
    bias = torch.randn(batch, V, generator=g)
    temperature = 0.5 + torch.rand(batch, generator=g)
    if batch > 1:
        temperature[1] = 0.0
        logits[1, :, [7, 290]] = 20.0
        bias[:, 290] = bias[:, 7]
    if batch > 2:
        logits[2] = float("nan")
    seeds = torch.randint(-2**62, 2**62, (batch,), generator=g)
    offsets = torch.randint(0, 2**40, (batch,), generator=g)
    return logits, bias, temperature, seeds, offsets


def factors(batch, dtype, rank=24, seed=0):
    """A low-rank bias's factor v [B, r] and W2 [V, r]: multiples of 1/4 and 1/8, so that v W2^T is
    exact in float32 whatever the order of its sums (r = 24: a masked rank chunk)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(-4, 5, (batch, rank), generator=g) / 4
    return v.to(dtype), (torch.randint(-4, 5, (V, rank), generator=g) / 8).to(dtype)


def kernel_steps(logits, bias, temperature, block_v, block_b, group_size, w2=None, write=True):
    """All K steps of the kernel into fresh buffers -> biased (-1 where not written),
    [(unit_max, unit_sum, unit_index)]."""
    batch = logits.shape[0]
    biased = torch.full((batch, K, V), -1.0)
    outputs = []
    for k in range(K):
        shape = (batch, num_units(V, block_v, group_size))
        out = (torch.full(shape, -1.0), torch.full(shape, -1.0), torch.full(shape, -1, dtype=torch.int64))
        launch_step(run_kernel, logits, bias, w2, temperature, k, biased if write else None, block_v, block_b,
                    group_size, *out)
        outputs.append(out)
    return biased, outputs


def torch_steps(logits, bias, temperature, block_v, group_size):
    biased = torch.full((logits.shape[0], K, V), -1.0)
    bias = None if bias is None else bias.float()
    return biased, [step_torch(logits, bias, temperature, k, biased, block_v, group_size) for k in range(K)]


def assert_steps_equal(got, want):
    assert torch.equal(got[0], want[0])  # biased logits: exact
    for (m, s, index), (want_m, want_s, want_index) in zip(got[1], want[1]):
        assert torch.equal(index, want_index)
        assert torch.equal(m, want_m)  # unit maxima of the correctly rounded biased * (1 / T)
        torch.testing.assert_close(s, want_s, rtol=1e-6, atol=0)


TILES = [(512, 1, 512), (128, 1, 32), (64, 4, 128), (16, 2, 64)]  # (block_v, block_b, group_size)


LOW_RANK_TILES = [(512, 16, 512), (128, 16, 32), (64, 32, 128), (128, 1, 32), (64, 1, 128)]


@pytest.mark.parametrize("bias_kind, tiles", [(kind, tiles) for kind in ("dense", "none") for tiles in TILES]
                         + [("low-rank", tiles) for tiles in LOW_RANK_TILES],
                         ids=[f"{kind}-{tiles[0]}x{tiles[1]}-group{tiles[2]}"
                              for kind in ("dense", "none") for tiles in TILES]
                         + [f"low-rank-{tiles[0]}x{tiles[1]}-group{tiles[2]}" for tiles in LOW_RANK_TILES])
@pytest.mark.parametrize("batch", [1, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_kernel_matches_torch(dtype, tiles, batch, bias_kind):
    """The dense bias (if any) in the logits' dtype; the low-rank factors in float32 (the interpreter's
    tl.dot multiplies bfloat16 operands as their raw 16-bit integers; the gpu tests run bfloat16
    factors)."""
    logits, bias, temperature, seed, offset = inputs(batch, dtype)
    w2 = None
    if bias_kind == "low-rank":
        bias, w2 = factors(batch, torch.float32)
        w2[290] = w2[7]  # the greedy row's tie, as inputs() makes it for a dense bias
    elif bias_kind == "dense":
        bias = bias.to(dtype)
    else:
        bias = None
    block_v, block_b, group_size = tiles
    got = kernel_steps(logits, bias, temperature, *tiles, w2=w2)
    dense = bias if w2 is None else low_rank_bias(bias, w2)
    assert_steps_equal(got, torch_steps(logits, dense, temperature, block_v, group_size))
    if batch > 2:  # the padding row: the bias alone
        want = torch.zeros(V) if bias is None else dense[2].float()
        assert torch.equal(got[0][2], want.expand(K, V))
    if w2 is None:  # without the biased logits written: the same statistics
        unwritten = kernel_steps(logits, bias, temperature, *tiles, write=False)
        assert (unwritten[0] == -1).all()
        assert_steps_equal((got[0], unwritten[1]), got)
    if batch > 1:
        tokens, slots, probs = pick_buffers(batch)
        gumbel_pick_torch(*got[1][0], got[0], None, temperature, seed, offset, None, 0, block_v, group_size, tokens,
                          slots, probs)
        assert tokens[1, 0] == 7  # the greedy row's tie: the smaller id


def pick_buffers(batch):
    """tokens [B, K], slots [B] (distinct, two slots of no row), draft_probs [B + 2, K, V]."""
    return (torch.full((batch, K), -1, dtype=torch.int64), torch.randperm(batch + 2)[:batch],
            torch.full((batch + 2, K, V), -1.0))


@pytest.mark.parametrize("source", ["logits+bias", "biased"])
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16, None])
@pytest.mark.parametrize("tiles", [(16, 64, 4096), (64, 32, 64), (512, 512, 128)],
                         ids=["4units-per-group", "tile-of-2-groups-5chunks", "1group-3chunks"])
def test_pick_kernel_matches_torch(tiles, table_dtype, source):
    """Rows 0, 3: sampled; row 1: greedy with a tie between units (the first unit wins); row 2:
    sampled with units without mass. The position's logits as the base logits (bfloat16, a NaN row)
    plus a bfloat16 bias, or as biased logits the step wrote (float32)."""
    block_v, group_size, chunk = tiles
    logits, bias, temperature, seed, offset = inputs(4, torch.bfloat16, seed=1)
    temperature[1] = 0
    logits[1, 1, [7, 290]] = 50.0
    logits[2] = float("nan")
    bias = bias.bfloat16()
    biased, steps = torch_steps(logits, bias, temperature, block_v, group_size)
    unit_max, unit_sum, unit_index = steps[1]
    if unit_max.shape[1] > 4:
        unit_max[2, [0, 4]] = float("-inf")  # units without mass
        unit_sum[2, [0, 4]] = 0.0
    given, added = (logits, bias) if source == "logits+bias" else (biased, None)
    table = None if table_dtype is None else torch.randn(V, R).to(table_dtype)
    got, want = pick_buffers(4), pick_buffers(4)
    want[1].copy_(got[1])
    rows = torch.empty(4, 0) if table is None else torch.empty(4, R, dtype=table_dtype)
    args = (unit_max, unit_sum, unit_index, given, added, temperature, seed, offset, table, 1, block_v, group_size)
    launch_gumbel_pick(run_kernel, *args, *got, rows, chunk=chunk)
    want_rows = gumbel_pick_torch(*args, *want)
    assert torch.equal(got[0], want[0]) and got[0][1, 1] == 7
    assert (got[0][:, 0] == -1).all()  # other positions untouched
    assert torch.equal(rows, want_rows)
    probs, want_probs = got[2], want[2]
    torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-7)
    assert (probs[:, 0] == -1).all()  # other positions
    assert (probs[[s for s in range(6) if s not in got[1].tolist()]] == -1).all()  # slots of no row
    assert torch.equal(probs[got[1][1], 1], torch.nn.functional.one_hot(got[0][1, 1], V).float())
    full = got[1][[0, 1, 3]]  # row 2's statistics lost two units' mass
    torch.testing.assert_close(probs[full, 1].sum(-1), torch.ones(3))
