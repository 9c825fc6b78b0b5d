"""The engine's decode step by how it is executed, in one process: eager kernels, a CUDA graph of them,
and the step compiled by torch.compile (fullgraph, Inductor) inside a CUDA graph, for K = 0 and for
K = 7 with forced acceptance; beside it gpt-fast's way of decoding one token of the same target.

The step is bench.engine_step's (random weights of SmolLM2-135M's or Llama-3-8B's shapes, the
shipped or a random 5-layer drafter, rows holding `--context` positions of random keys and values in
paged pools sized for the largest batch, as a server's pool is sized once). A compiled step's first
graph has static shapes; Dynamo compiles the next ones (other batches) with dynamic shapes, as in a
server's later buckets, unless --static-shapes. Eager is the mean of back-to-back calls (the host
launching every kernel); the graph rows are medians of replays (bench.timing). Tokens per second of
a K = 7 step count its accepted drafts and the bonus token, `--accepted` + 1 per row, against 1 for
K = 0.

gpt-fast's decode (pytorch-labs/gpt-fast, restated here on the target's own layers and weights): a
contiguous KV cache per layer [B, H_kv, S, D] written in place at the new position, SDPA over the
whole cache under a mask of the positions up to it, the next token sampled with exponential noise
(no host sync); the function of one token is compiled whole and replayed from a CUDA graph.

    python -m bench.step_modes [--models smollm2 llama3-8b] [--context 8192] [--batches 1 32] [--static-shapes]
    python -m bench.step_modes --smoke       # CPU, a tiny target, eager rows only: checks that it runs
"""
from __future__ import annotations

import argparse
import datetime

import torch
import torch.nn.functional as F

from bench.engine_step import MODELS, prepared_step, random_pair
from bench.timing import eager_us, median_us
from dspark import SpeculativeDecoder, TargetModel
from dspark.layers import DecoderLayer
from dspark.loading import measuring_dtype


def gpt_fast_decode(target: TargetModel, batch: int, context: int):
    """gpt-fast's one-token decode of `batch` rows at position `context` over dense caches of random
    keys and values -> a function of no argument that runs it."""
    c, weight = target.config, target.embed_tokens.weight
    device, dtype = weight.device, weight.dtype
    length = -(-(context + 1) // 16) * 16
    caches = [tuple(torch.randn(batch, c.num_key_value_heads, length, c.head_dim, device=device, dtype=dtype)
                    for _ in range(2)) for _ in target.layers]
    token = torch.randint(0, c.vocab_size, (batch, 1), device=device)
    position = torch.tensor([context], device=device)

    def decode(token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        # token: [B, 1]; position: [1] -> the next token [B, 1]
        x = target.embed_tokens(token)
        cos, sin = target.rotary(position.expand(batch, 1))
        visible = (torch.arange(length, device=device) <= position)[None, None, None]  # [1, 1, 1, S]
        for layer, (k_cache, v_cache) in zip(target.layers, caches):
            def attend(q, k, v, k_cache=k_cache, v_cache=v_cache):
                k_cache.index_copy_(2, position, k)
                v_cache.index_copy_(2, position, v)
                return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=visible, enable_gqa=True)
            x = DecoderLayer.forward(layer, x, cos, sin, attend)
        probs = torch.softmax(target.lm_head(target.norm(x[:, -1])).float(), -1)
        return torch.argmax(probs / torch.empty_like(probs).exponential_(1), -1, keepdim=True)

    compiled = torch.compile(decode, fullgraph=True) if device.type == "cuda" else decode
    return lambda: token.copy_(compiled(token, position))


def mode_ms(decoder: SpeculativeDecoder, batch: int, context: int, pool_rows: int, graphed: bool) -> float:
    with prepared_step(decoder, batch, context, context, pool_rows) as step:
        timer = median_us if graphed else eager_us
        return timer(step, decoder.device, 30) / 1e3


@torch.inference_mode()
def run(names: list[str], context: int, batches: list[int], accepted: int, device: torch.device,
        smoke: bool) -> list[str]:
    dtype = measuring_dtype(device)
    cuda = device.type == "cuda"
    lines = []

    def add(line: str) -> None:  # printed as measured: a run cut short keeps its rows
        lines.append(line)
        print(line, flush=True)

    add("| model | B | speculation | eager ms | CUDA graph ms | compiled + graph ms | tokens/s vs K = 0 (compiled) |")
    add("|---|---|---|---|---|---|---|")
    for name in names:
        target, drafter = random_pair(name, device, dtype, smoke)
        for batch in batches:
            base = None
            for k in (0, 7):
                ms = {}
                for compiled in (False, True) if cuda else (False,):
                    decoder = SpeculativeDecoder(target, drafter if k else None, num_speculative_tokens=k or None,
                                                 forced_num_accepted=accepted if k else None, compile=compiled)
                    if not compiled:
                        ms["eager"] = mode_ms(decoder, batch, context, max(batches), graphed=False)
                    ms["graph" if not compiled else "compiled"] = mode_ms(decoder, batch, context, max(batches),
                                                                          graphed=cuda)
                best = ms.get("compiled", ms["graph"])
                rate = (accepted + 1 if k else 1) / best
                base = base or rate
                label = "K = 0" if k == 0 else f"K = 7, {accepted} accepted"
                add(f"| {name} | {batch} | {label} | {ms['eager']:.3f} | {ms['graph']:.3f} | "
                             f"{ms.get('compiled', float('nan')):.3f} | {rate / base:.2f}x |")
            if cuda:
                torch.cuda.empty_cache()  # the pools of the steps above, before the dense caches
            decode = gpt_fast_decode(target, batch, context)
            ms = median_us(decode, device, 30) / 1e3 if cuda else eager_us(decode, device, 30) / 1e3
            add(f"| {name} | {batch} | gpt-fast's decode, compiled + graph | - | - | {ms:.3f} | - |")
        del target, drafter
        if cuda:
            torch.cuda.empty_cache()
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--accepted", type=int, default=3, help="drafts every K = 7 step accepts")
    p.add_argument("--static-shapes", action="store_true",
                   help="compile a graph per shape (no automatic dynamic shapes after the first recompile)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch._dynamo.config.automatic_dynamic_shapes = not args.static_shapes
    if args.smoke:
        device, names, context, batches = torch.device("cpu"), ["smollm2"], 48, [1, 2]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA device; use --smoke for a CPU check")
        device, names, context, batches = torch.device("cuda"), args.models, args.context, args.batches
    torch._dynamo.config.recompile_limit = 64  # a graph per (K, batch): each sets up pools of its own shape
    card = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    header = (f"Engine step by execution mode, {context} positions held per row, "
              f"{'static' if args.static_shapes else 'automatic dynamic'} shapes; random weights, "
              f"{str(measuring_dtype(device)).split('.')[-1]}; {card}, torch {torch.__version__}, "
              f"{datetime.date.today()}.\n")
    print(header, flush=True)
    lines = run(names, context, batches, args.accepted, device, args.smoke)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join([header, *lines]) + "\n")


if __name__ == "__main__":
    main()
