"""The ops' kernels (drafting, verification, LSE merge, the training loss) compile for the H200 (sm_90) as the ops
launch them there, on the CPU: the launchers run with a LaunchRecorder and meta tensors at the
benchmarks' shapes (V = 200064, rank 256, K = 7) and every recorded launch is compiled. The
interpreter tests run the kernels' logic but not the compiler (a branch that retyped a variable ran
under the interpreter and failed to compile on the H200)."""
import pytest
import torch

from dspark.ops.aot import LaunchRecorder
from dspark.ops.distill_loss import launch_distill_loss
from dspark.ops.gumbel_max import GROUP_SIZE, num_units, step_tiles
from dspark.ops.gumbel_pick import launch_gumbel_pick
from dspark.ops.gumbel_step import launch_step
from dspark.ops.lse_merge import launch_lse_merge
from dspark.ops.verify import launch_verify

V, R, K = 200064, 256, 7


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("batch", [1, 8, 88])
@pytest.mark.parametrize("bias_kind", ["none", "dense", "low-rank"])
@pytest.mark.parametrize("pdl", [False, True], ids=["compiled", "eager"])
def test_drafting_kernels_compile_for_sm90(batch, bias_kind, pdl):
    """The step and the pick of one position, as ancestral_draft launches them for this bias: eagerly
    as programmatic dependent launches, or as torch.compile launches them (without)."""
    low_rank = bias_kind == "low-rank"
    block_v, block_b = step_tiles(batch, low_rank)
    logits = meta(batch, K, V, dtype=torch.bfloat16)
    bias = {"none": None, "dense": meta(batch, V, dtype=torch.bfloat16),
            "low-rank": meta(batch, R, dtype=torch.bfloat16)}[bias_kind]
    w2 = meta(V, R, dtype=torch.bfloat16) if low_rank else None
    biased = meta(batch, K, V) if low_rank else None
    units = [meta(batch, num_units(V, block_v, GROUP_SIZE)) for _ in range(2)]
    units.append(meta(batch, num_units(V, block_v, GROUP_SIZE), dtype=torch.int64))
    rows = [meta(batch, dtype=torch.float32)] + [meta(batch, dtype=torch.int64) for _ in range(3)]
    temperature, seed, offset, slots = rows
    table = meta(V, R, dtype=torch.bfloat16)
    recorder = LaunchRecorder()
    launch_step(recorder, logits, bias, w2, temperature, 3, biased, block_v, block_b, GROUP_SIZE, *units, pdl=pdl)
    source, added = (biased, None) if low_rank else (logits, bias)
    launch_gumbel_pick(recorder, *units, source, added, temperature, seed, offset, table, 3, block_v, GROUP_SIZE,
                       meta(batch, K, dtype=torch.int64), slots, meta(batch + 1, K, V),
                       meta(batch, R, dtype=torch.bfloat16), pdl=pdl)
    compiled = recorder.compile_all()
    assert len(compiled) == 2 and all(kernel.asm["cubin"] for kernel in compiled)


@pytest.mark.parametrize("block", [False, True], ids=["standard", "block"])
def test_verification_kernels_compile_for_sm90(block):
    """Every kernel of one verification, the drafts a view of the decoder's token block."""
    batch = 8
    recorder = LaunchRecorder()
    ids = [meta(batch, dtype=torch.int64) for _ in range(3)]
    drafts = meta(batch, K + 1, dtype=torch.int64)[:, 1:]
    launch_verify(recorder, meta(batch, K + 1, V, dtype=torch.bfloat16), drafts, meta(batch, K, V), ids[0],
                  meta(batch), ids[1], ids[2], block)
    compiled = recorder.compile_all()
    assert len(compiled) == len(recorder.launches) >= 4 and all(kernel.asm["cubin"] for kernel in compiled)


def test_lse_merge_kernel_compiles_for_sm90():
    """The default drafter's attention shapes: 9 heads of 64, bfloat16 outputs."""
    n, heads, dim = 64, 9, 64
    recorder = LaunchRecorder()
    o1, o2, o = (meta(n, heads, dim, dtype=torch.bfloat16) for _ in range(3))
    launch_lse_merge(recorder, o1, meta(n, heads), o2, meta(n, heads), o, meta(n, heads))
    compiled = recorder.compile_all()
    assert len(compiled) == len(recorder.launches) == 1 and all(kernel.asm["cubin"] for kernel in compiled)


@pytest.mark.parametrize("with_bias", [False, True])
def test_distill_loss_kernel_compiles_for_sm90(with_bias):
    """The training step's shapes: 64 x 64 blocks of 7 slots over SmolLM2's vocabulary, bfloat16."""
    rows, vocab = 64 * 64 * 7, 49152
    logits, bias, target_logits, grad = (meta(rows, vocab, dtype=torch.bfloat16) for _ in range(4))
    recorder = LaunchRecorder()
    launch_distill_loss(recorder, logits, bias if with_bias else None, target_logits, meta(rows, dtype=torch.int64),
                        (0.1, 0.9, 0.3, 1.0), meta(rows), meta(rows), meta(rows), meta(rows), grad)
    compiled = recorder.compile_all()
    assert len(compiled) == len(recorder.launches) == 1 and all(kernel.asm["cubin"] for kernel in compiled)
