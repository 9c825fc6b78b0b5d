"""Attention over a paged KV pool at decode and verification shapes (T queries per row, every row
holding `context` tokens in shuffled blocks, queries at the last T positions, causal), four ways in
one process:

- Triton: dspark::paged_attention's CUDA path (reads only the blocks a row holds);
- Flex: FlexAttention over the same paged layout, compiled: the pool viewed as [1, H_kv, blocks *
  block_size, D], a BlockMask whose KV indices are the block tables and a mask_mod that maps a
  physical position back to its logical one (torch's experimental PagedAttention does the same); the
  query heads that share a KV head are folded into its query rows, as the models fold them;
- gathered: what the target reads through on the CPU (and for prompt chunks), its rows' blocks
  gathered contiguous, then SDPA under a mask of the positions up to each query
  (dspark.target.attend_gathered), the gather timed with it;
- dense: the path before the paged cache, SDPA over a dense [B, H_kv, capacity, D] cache with a
  boolean mask (dspark.target.attend), capacity = the context rounded up to a power of two or
  --max-model-len;
- floor: the KV bytes the rows hold divided by the device-to-device copy bandwidth measured in the
  same run (bytes read and written by a 1 GiB copy).

Random bfloat16 data. Each candidate is captured in a CUDA graph and timed by CUDA events over its
replays (median), L2 flushed before each replay (a model's layers never find their KV in L2). The
max |difference| from the dense output checks that the candidates compute the same attention.

    python -m bench.attention [--models llama3-8b smollm2-135m] [--batch 1 32] [--queries 1 8]
                              [--context 256 2048 8192 32768] [--block-size 16] [--no-flex] [--out t.md]
    python -m bench.attention --smoke   # tiny shapes, any device (CPU: the op's torch path, eager Flex)
"""
from __future__ import annotations

import argparse

import torch
import triton
from torch.nn.attention.flex_attention import BlockMask, flex_attention

import dspark.ops.paged_attention  # noqa: F401
from bench.timing import emit_table, median_us
from dspark.ops.paged_attention_kernel import num_splits, row_tile
from dspark.kv_cache import PagedKVCache
from dspark.target import attend, attend_gathered, grouped_mask

MODELS = {"llama3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}  # heads, KV heads, head dim
DTYPE = torch.bfloat16


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy of nbytes, counting bytes read and written."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (median_us(lambda: dst.copy_(src), device, replays=20) * 1e-6)


def paged_case(batch, length, context, heads, kv_heads, head_dim, block_size, capacity, device):
    """Pools with every row's blocks shuffled, block tables [B, capacity / block_size] (zeros past a
    row's blocks), queries [B, H, T, D] at positions context - T .. context - 1, lo = 0, hi = position + 1."""
    g = torch.Generator(device=device).manual_seed(batch * context + length)
    per_row = triton.cdiv(context, block_size)
    num_blocks = 1 + batch * per_row
    k_pool, v_pool = (torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=g, device=device,
                                  dtype=DTYPE) for _ in range(2))
    table = torch.zeros(batch, triton.cdiv(capacity, block_size), dtype=torch.int32, device=device)
    table[:, :per_row] = (torch.randperm(num_blocks - 1, generator=g, device=device) + 1).view(batch, per_row)
    q = torch.randn(batch, heads, length, head_dim, generator=g, device=device, dtype=DTYPE)
    positions = (context - length + torch.arange(length, device=device)).expand(batch, length)
    return q, k_pool, v_pool, table, torch.zeros_like(positions, dtype=torch.int32), (positions + 1).int()


def flex_block_mask(table, lo, hi, context, num_blocks, block_size, rows):
    """The BlockMask of the paged layout for query rows ordered (group, t): each row's KV blocks are
    its table's first blocks; mask_mod maps physical position -> (logical block, offset) and applies
    lo <= p < hi of the row's query t."""
    batch, length = lo.shape
    per_row = triton.cdiv(context, block_size)
    logical = torch.full((batch, num_blocks), -1, dtype=torch.int32, device=table.device)
    logical.scatter_(1, table[:, :per_row].long(),
                     torch.arange(per_row, dtype=torch.int32, device=table.device).expand(batch, per_row))

    def mask_mod(b, h, q_idx, kv_idx):
        block = logical[b, kv_idx // block_size]
        position = block * block_size + kv_idx % block_size
        t = q_idx % length
        return (block >= 0) & (position >= lo[b, t]) & (position < hi[b, t])

    kv_indices = torch.zeros(batch, 1, 1, num_blocks, dtype=torch.int32, device=table.device)
    kv_indices[..., :per_row] = table[:, None, None, :per_row]
    kv_num_blocks = torch.full((batch, 1, 1), per_row, dtype=torch.int32, device=table.device)
    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=(128, block_size), mask_mod=mask_mod,
                                    seq_lengths=(rows, num_blocks * block_size), compute_q_blocks=False)


def measure(model, batch, length, context, args, device, flex, bandwidth):
    heads, kv_heads, head_dim = MODELS[model]
    groups = heads // kv_heads
    capacity = max(args.max_model_len or triton.next_power_of_2(context), context)
    q, k_pool, v_pool, table, lo, hi = paged_case(batch, length, context, heads, kv_heads, head_dim,
                                                  args.block_size, capacity, device)
    scale = head_dim ** -0.5
    row = {"model": model, "B": batch, "T": length, "context": context}
    times, outputs = {}, {}

    def paged():
        return torch.ops.dspark.paged_attention(q, k_pool, v_pool, table, lo, hi, scale)[0]

    outputs["Triton"], times["Triton"] = paged(), median_us(paged, device, args.replays, flush_l2=True)
    if device.type == "cuda":
        programs = batch * kv_heads * row_tile(groups, length)[1]
        row["splits"] = num_splits(programs, table.shape[1] * args.block_size,
                                   torch.cuda.get_device_properties(device).multi_processor_count)

    if flex is not None:
        try:
            num_blocks = k_pool.shape[1]
            mask = flex_block_mask(table, lo, hi, context, num_blocks, args.block_size, groups * length)
            k_flat, v_flat = (x.view(1, kv_heads, -1, head_dim) for x in (k_pool, v_pool))
            q_rows = q.view(batch, kv_heads, groups * length, head_dim)

            def flex_paged():
                return flex(q_rows, k_flat, v_flat, block_mask=mask, scale=scale).view(q.shape)

            outputs["Flex"], times["Flex"] = flex_paged(), median_us(flex_paged, device, args.replays,
                                                                     flush_l2=True)
        except Exception as error:  # noqa: BLE001  (a candidate that fails is reported, not fatal)
            print(f"Flex skipped at {model} B={batch} T={length} context={context}: "
                  f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")

    cache = PagedKVCache(k_pool.shape[1], args.block_size, kv_heads, head_dim, DTYPE, device)
    cache.k_pool.copy_(k_pool), cache.v_pool.copy_(v_pool)
    width = table[:, :triton.cdiv(context, args.block_size)]  # as the step's table: as wide as its widest row

    def gathered():
        return attend_gathered(q, cache, width, hi.long() - 1, width.shape[1] * args.block_size)

    outputs["gathered"], times["gathered"] = gathered(), median_us(gathered, device, args.replays, flush_l2=True)
    k_dense, v_dense = (x[:, table.long()].flatten(2, 3).transpose(0, 1).contiguous() for x in (k_pool, v_pool))
    visible = torch.arange(k_dense.shape[2], device=device) < hi[..., None]
    dense_mask = grouped_mask(visible, groups)

    def dense():
        return attend(q, k_dense, v_dense, dense_mask)

    outputs["dense"], times["dense"] = dense(), median_us(dense, device, args.replays, flush_l2=True)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * DTYPE.itemsize
    row["floor"] = kv_bytes / bandwidth * 1e6
    row.update(times)
    row["fastest"] = min(times, key=times.get)
    row["error"] = {name: (out.float() - outputs["dense"].float()).abs().max().item()
                    for name, out in outputs.items() if name != "dense"}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--queries", type=int, nargs="+", default=[1, 8], help="T, queries per row")
    p.add_argument("--context", type=int, nargs="+", default=[256, 2048, 8192, 32768])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the dense cache's capacity and the block tables' width (default: the context "
                        "rounded up to a power of two)")
    p.add_argument("--no-flex", action="store_true", help="leave FlexAttention out")
    p.add_argument("--replays", type=int, default=100)
    p.add_argument("--smoke", action="store_true", help="SmolLM2 heads, B = 1, 2, T = 1, 3, context 40, 3 replays")
    p.add_argument("--out", default=None, help="write the table as markdown here")
    args = p.parse_args()
    if args.smoke:
        args.models, args.batch, args.queries, args.context, args.replays = ["smollm2-135m"], [1, 2], [1, 3], [40], 3
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    flex = None
    if not args.no_flex:  # compiled per shape (its block mask's shapes and closure change)
        torch._dynamo.config.recompile_limit = 1024
        torch._dynamo.config.accumulated_recompile_limit = 4096
        flex = torch.compile(flex_attention, fullgraph=True, dynamic=False) if device.type == "cuda" else flex_attention
    bandwidth = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 24))

    rows = [measure(model, batch, length, context, args, device, flex, bandwidth)
            for model in args.models for batch in args.batch for length in args.queries for context in args.context]

    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (the op runs its torch path, Flex eager)"
    lines = [f"Paged attention, bfloat16, block size {args.block_size}; {where}; torch {torch.__version__}, "
             f"triton {triton.__version__}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; median µs of "
             f"{args.replays} {'CUDA-graph replays, L2 flushed' if device.type == 'cuda' else 'calls'}",
             "", "| model | B | T | context | splits | Triton | Flex | gathered | dense | floor | Triton / floor "
             "| fastest | max abs diff from dense (Triton, Flex, gathered) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(row, name):
        return f"{row[name]:.1f}" if name in row else "n/a"

    for row in rows:
        error = ", ".join(f"{row['error'].get(name, float('nan')):.1e}" for name in ("Triton", "Flex", "gathered"))
        lines.append(f"| {row['model']} | {row['B']} | {row['T']} | {row['context']} | {row.get('splits', '-')} | "
                     f"{cell(row, 'Triton')} | {cell(row, 'Flex')} | {cell(row, 'gathered')} | {cell(row, 'dense')} | "
                     f"{row['floor']:.1f} | "
                     f"{row['Triton'] / row['floor']:.2f}x | {row['fastest']} | {error} |")
    emit_table(lines, args.out)


if __name__ == "__main__":
    main()
