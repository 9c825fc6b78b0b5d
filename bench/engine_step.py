"""The engine's decode step over paged KV caches against the dense caches it replaced, in one process:
ms per step by context length, batch and speculation, with the bytes floor beside it.

Each row holds `context` positions of random keys and values (never zeros); the step verifies K + 1
tokens per row at positions context .. context + K and drafts the next block. Two attention paths
over the same pools:
- paged: dspark::paged_attention reads the blocks a row holds (the engine's path);
- dense: each row owns a contiguous capacity of `--capacity` positions, read whole through a mask
  (SDPA for the target, a masked softmax for the drafter's context), which is what a cache of
  max_model_len rows per slot costs.
The target has random weights of SmolLM2-135M's or Llama-3-8B's shapes; the drafter is the shipped one
(SmolLM2) or a random 5-layer one (Llama-3-8B). K = 7 accepts `--accepted` drafts every step
(forced_num_accepted), K = 0 runs no drafter. A step is timed as CUDA-graph replays (bench.timing),
median. The floor is the bytes the step must read at least (the weights it streams, the embedding
tables left out, and the KV the rows hold) over the copy bandwidth measured in the same run.

    python -m bench.engine_step [--models smollm2 llama3-8b] [--contexts 256 2048 8192 32768] [--batches 1 32]
    python -m bench.engine_step --smoke        # CPU, a tiny target: checks that it runs
"""
from __future__ import annotations

import argparse
import contextlib
import datetime

import torch
import torch.nn.functional as F

from bench.models import LLAMA3_8B, LLAMA3_8B_DRAFTER_LAYERS, SMOKE, SMOLLM2, built_on, random_target
from bench.timing import emit_table, median_us
from dspark import DrafterConfig, DSparkDrafter, SamplingParams, SpeculativeDecoder, TargetModel, load_drafter
from dspark.drafter import partial_attention
from dspark.kv_cache import PagedKVCache, kv_block_bytes
from dspark.loading import DEFAULT_DRAFTER, measuring_dtype
from dspark.sampling import SamplingTensors

BLOCK = 16
MODELS = {"smollm2": SMOLLM2, "llama3-8b": LLAMA3_8B}


def make_drafter(name: str, target: TargetModel) -> DSparkDrafter:
    if name == "smollm2":
        return load_drafter(DEFAULT_DRAFTER, target)
    config = DrafterConfig.for_target(target.config, **(LLAMA3_8B_DRAFTER_LAYERS if name == "llama3-8b" else dict(
        num_hidden_layers=1, block_size=7, target_layer_ids=[-1, 0], markov_rank=8, mask_token_id=1)))
    weight = target.embed_tokens.weight
    with built_on(weight.device, weight.dtype):
        return DSparkDrafter(config, embed_tokens=target.embed_tokens, lm_head=target.lm_head).eval()


def random_pair(name: str, device: torch.device, dtype: torch.dtype, smoke: bool) -> tuple[TargetModel, DSparkDrafter]:
    """A target of `name`'s shapes (the tiny one for --smoke) with random weights of a trained model's
    scale (seed 0), and its drafter (make_drafter)."""
    torch.manual_seed(0)
    target = random_target(SMOKE if smoke else MODELS[name], device, dtype)
    for p in target.parameters():
        p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return target, make_drafter("smoke" if smoke else name, target)


@contextlib.contextmanager
def dense_attention(capacity_blocks: int, target_caches: set):
    """PagedKVCache.attend as the dense caches computed it: rows laid out contiguously, row b's
    capacity read whole and masked."""
    paged = PagedKVCache.attend

    def attend(self, q, access, scale):
        B, H, T, D = q.shape
        H_kv = self.k_pool.shape[0]
        k, v = (pool[:, 1:1 + B * capacity_blocks].reshape(H_kv, B, -1, D).transpose(0, 1)
                for pool in (self.k_pool, self.v_pool))  # [B, H_kv, capacity, D]
        positions = torch.arange(k.shape[2], device=q.device)
        visible = (positions >= access.lo[..., None]) & (positions < access.hi[..., None])  # [B, T, S]
        if self in target_caches:  # the target read its cache through SDPA with a mask
            mask = visible[:, None, None].expand(B, 1, H // H_kv, T, -1).flatten(2, 3)
            o = F.scaled_dot_product_attention(q.reshape(B, H_kv, -1, D), k, v, attn_mask=mask, scale=scale)
            return o.reshape(B, H, T, D), None
        return partial_attention(q, k, v, visible, scale)

    PagedKVCache.attend = attend
    try:
        yield
    finally:
        PagedKVCache.attend = paged


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy (read + written)."""
    src = torch.randn(2**28, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (median_us(lambda: dst.copy_(src), device, replays=20) / 1e6)


def floor_ms(decoder: SpeculativeDecoder, batch: int, context: int, bandwidth: float) -> float:
    """The bytes a step reads at least over the bandwidth: streamed weights (embedding tables are
    gathered, not streamed) and the KV every row holds."""
    models = [decoder.target] + ([decoder.drafter] if decoder.drafter is not None else [])
    params = {id(p): p for m in models for name, p in m.named_parameters() if "embed_tokens" not in name}
    weights = sum(p.numel() * p.element_size() for p in params.values())
    dtype = decoder.target.embed_tokens.weight.dtype
    kv = sum(kv_block_bytes(m.config, 1, dtype) for m in models) * context * batch
    return 1e3 * (weights + kv) / bandwidth


def row_blocks(capacity: int, k: int) -> int:
    """The blocks a row owns: `capacity` positions and the K + 1 a step writes past them."""
    return -(-(capacity + k + 1) // BLOCK)


@contextlib.contextmanager
def prepared_step(decoder: SpeculativeDecoder, batch: int, context: int, capacity: int, pool_rows: int | None = None):
    """Yields one step (a function of no argument) of `batch` rows at positions context .. context + K,
    in pools whose rows each own `capacity` positions (contiguous, so the dense path can read them as one
    tensor) of random keys and values, sized for `pool_rows` rows (default: the batch's); frees the
    pools after."""
    k, device = decoder.k, decoder.device
    per_row = row_blocks(capacity, k)
    models = [decoder.target] + ([decoder.drafter] if decoder.drafter is not None else [])
    for model in models:
        model.setup_caches(1 + max(batch, pool_rows or 0) * per_row, BLOCK)
        for layer in model.layers:
            cache = layer.kv_cache if model is decoder.target else layer.context_cache
            cache.k_pool.normal_(), cache.v_pool.normal_()
    table = (1 + torch.arange(batch * per_row, device=device)).view(batch, per_row).to(torch.int32)
    vocab = decoder.target.config.vocab_size
    tokens = torch.randint(0, vocab, (batch, k + 1), device=device)
    start = torch.full((batch,), context, device=device)
    draft_probs = torch.softmax(torch.randn(batch, k, vocab, device=device), -1)
    sampling = SamplingTensors.from_params([SamplingParams(temperature=1.0, seed=row) for row in range(batch)], device)
    try:
        yield lambda: decoder.step(tokens, start, draft_probs, sampling, table)
    finally:
        for model in models:
            model.drop_caches()


def step_ms(decoder: SpeculativeDecoder, batch: int, context: int, capacity: int, dense: bool) -> float:
    """Median ms of one step (prepared_step) replayed from a CUDA graph, over the paged pools or
    read as dense per-row capacities."""
    with prepared_step(decoder, batch, context, capacity) as step:
        target_caches = {layer.kv_cache for layer in decoder.target.layers}
        with dense_attention(row_blocks(capacity, decoder.k), target_caches) if dense else contextlib.nullcontext():
            return median_us(step, decoder.device, replays=30) / 1e3


@torch.inference_mode()
def run(names: list[str], contexts: list[int], batches: list[int], accepted: int, device: torch.device,
        smoke: bool) -> list[str]:
    dtype = measuring_dtype(device)
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else float("nan")
    lines = [f"Copy bandwidth {bandwidth / 1e12:.2f} TB/s.", "",
             "| model | B | context | speculation | paged ms | dense ms | dense / paged | floor ms | paged / floor |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        target, drafter = random_pair(name, device, dtype, smoke)
        decoders = {"K = 0": SpeculativeDecoder(target, None),
                    f"K = 7, {accepted} accepted": SpeculativeDecoder(target, drafter, num_speculative_tokens=7,
                                                                      forced_num_accepted=accepted)}
        for batch in batches:
            capacity = max(c for c in contexts if fits(target, drafter, batch, c, device))
            for context in (c for c in contexts if c <= capacity):
                for speculation, decoder in decoders.items():
                    paged = step_ms(decoder, batch, context, capacity, dense=False)
                    dense = step_ms(decoder, batch, context, capacity, dense=True)
                    floor = floor_ms(decoder, batch, context, bandwidth)
                    lines.append(f"| {name} | {batch} | {context} | {speculation} | {paged:.3f} | {dense:.3f} | "
                                 f"{dense / paged:.2f}x | {floor:.3f} | {paged / floor:.2f}x |")
                    print(lines[-1], flush=True)  # as measured: a run cut short keeps its rows
        del target, drafter, decoders
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return lines


def fits(target: TargetModel, drafter: DSparkDrafter, batch: int, context: int, device: torch.device) -> bool:
    """Whether `batch` rows of `context` positions (and the step's temporaries) fit the device."""
    if device.type != "cuda":
        return True
    dtype = target.embed_tokens.weight.dtype
    kv = sum(kv_block_bytes(m.config, 1, dtype) for m in (target, drafter)) * batch * (context + 8)
    free, _ = torch.cuda.mem_get_info(device)
    return kv + 8 * 2**30 < free  # room for logits, proposals and the dense path's scores


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 2048, 8192, 32768])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--accepted", type=int, default=3, help="drafts every K = 7 step accepts")
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny target, two short contexts")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        device, names, contexts, batches = torch.device("cpu"), ["smollm2"], [16, 48], [1, 2]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA device; use --smoke for a CPU check")
        device, names, contexts, batches = torch.device("cuda"), args.models, args.contexts, args.batches
    lines = run(names, contexts, batches, args.accepted, device, args.smoke)
    card = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    header = (f"Engine step, paged vs dense KV; random weights, {str(measuring_dtype(device)).split('.')[-1]}; "
              f"{card}, torch {torch.__version__}, {datetime.date.today()}.\n")
    emit_table([header, *lines], args.out)


if __name__ == "__main__":
    main()
