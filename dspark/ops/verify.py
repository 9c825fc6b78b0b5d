"""Verification of a draft block: standard rejection sampling and block verification.

`dspark::verify` takes the target's logits for the K drafts plus the bonus position and the
proposals q the drafts were drawn from, and returns the emitted tokens (the accepted drafts, then one
correction or bonus token) and the accepted count per request. Both rules are lossless: the emitted
tokens follow the target distribution p_i = softmax(logits_i / T) exactly.

- Standard (Leviathan et al.): accept d_i while u_i * q_i(d_i) < p_i(d_i); at the first rejection draw
  from max(p_i - q_i, 0), normalised; if all K are accepted draw the bonus from p_K.
- Block (Sun et al. 2024): rho_0 = 1, rho_i = min(1, rho_{i-1} p(d_i) / q(d_i)) is the capped
  likelihood ratio of the prefix; Z_i = sum_x max(rho_i p_i(x) - q_i(x), 0) the residual mass after it;
  h_i = Z_i / (Z_i + 1 - rho_i) for i < K and h_K = rho_K. The accepted length is
  tau = max{i : eta_i <= h_i} (not the first failure), the next token comes from
  max(rho_tau p_tau - q_tau, 0), normalised, or from p_K when tau = K.
- Greedy rows (T = 0) accept while d_i is the target argmax and emit the argmax after that.

A zero proposal q(d_i) rejects. When a residual has no mass the token is drawn from p instead. Noise is
Philox keyed by (seed, offset) (philox.py): the uniform of draft i is that of token 0 in stream
STREAM_ACCEPT + i (eta_i of block verification is the uniform of its last draft, i - 1); the
correction or bonus token at position i is drawn from weights w by the exponential race
argmax_v w(v) / e_v, with e_v the exponential of token v in stream STREAM_TARGET + i (a Gumbel-max
without logs). Ties go to the smallest token id; NaN logits count as -inf, so padding rows give
in-range tokens.

On CUDA the op runs Triton kernels over vocabulary chunks (per-chunk softmax statistics, a small
per-request acceptance scan, a chunked Gumbel-max resample, as vLLM's Model Runner V2 does); on CPU it
runs `verify_torch`, the same function in plain torch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dspark.ops.checks import check_rows
from dspark.ops.fastmath import fast_divide
from dspark.ops.philox import (STREAM_ACCEPT, STREAM_TARGET, single_uniform, single_uniform_torch,
                               token_exponentials, token_exponentials_torch)
from dspark.ops.temperature import scaled

CHUNK = 4096  # vocabulary columns per program of the statistics passes
RESAMPLE_CHUNK = 1024  # and of the resample, whose Philox noise is compute-bound: more, smaller programs
ACCEPT_STREAM = tl.constexpr(STREAM_ACCEPT)  # kernels read module globals only as constexprs
TARGET_STREAM = tl.constexpr(STREAM_TARGET)


# ---------------------------------------------------------------- torch

def _scaled(target_logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """target_logits [B, N, V], temperature [B] -> [B, N, V]: logits / T in float32 (ops.temperature),
    with NaN as -inf."""
    x = scaled(target_logits.float(), temperature)
    return x.masked_fill(x.isnan(), float("-inf"))


def _race_argmax(weights: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """weights, e [B, V] -> [B]: argmax_v w(v) / e(v) over tokens of positive weight, a draw from
    w / sum(w) when the e(v) are independent Exp(1)."""
    score = torch.where(weights > 0, weights / e, float("-inf"))
    return score.argmax(dim=-1)


def _block_length(probs, proposals, p_draft, q_draft, eta):
    """Block verification's accepted length tau [B] and capped ratios rho [B, K+1].
    probs [B, K+1, V], proposals [B, K, V]; p_draft, q_draft, eta [B, K]."""
    B, K = p_draft.shape
    ratio = torch.where(q_draft > 0, p_draft / q_draft, 0.0)
    rho = [torch.ones(B, device=ratio.device)]
    for i in range(K):
        rho.append((rho[-1] * ratio[:, i]).clamp(max=1.0))
    rho = torch.stack(rho, dim=1)
    mass = (rho[:, :K, None] * probs[:, :K] - proposals).clamp(min=0.0).sum(dim=-1)  # Z_i, [B, K]
    denominator = mass + 1.0 - rho[:, :K]
    h = torch.where(denominator == 0, 1.0, mass / denominator)
    h = torch.cat([h, rho[:, K:]], dim=1)  # h_0 .. h_K
    length = torch.arange(K + 1, device=eta.device)
    tau = torch.where(F.pad(eta, (1, 0)) <= h, length, 0)  # eta_0 = 0: tau >= 0
    return tau.amax(dim=1), rho


def verify_torch(target_logits, draft_tokens, draft_probs, slots, temperature, seed, offset, block: bool):
    """The op in plain torch, for CPU (and as the GPU benchmark's baseline)."""
    B, K1, V = target_logits.shape
    K = K1 - 1
    scaled = _scaled(target_logits, temperature)  # [B, K+1, V]
    probs = (scaled - scaled.logsumexp(dim=-1, keepdim=True)).exp()
    proposals = draft_probs[slots, :K]  # [B, K, V]
    drafts = draft_tokens.unsqueeze(-1)
    p_draft = probs[:, :K].gather(-1, drafts).squeeze(-1)  # [B, K]
    q_draft = proposals.gather(-1, drafts).squeeze(-1)
    position = torch.arange(K, device=target_logits.device)
    u = single_uniform_torch(seed[:, None], offset[:, None], STREAM_ACCEPT + position)

    greedy = temperature == 0
    greedy_emitted, n_greedy = greedy_verify(scaled, draft_tokens)
    if block:
        n, rho = _block_length(probs, proposals, p_draft, q_draft, u)
        scale = torch.where(n < K, rho.gather(1, n[:, None]).squeeze(1), 1.0)
    else:
        accept = (q_draft > 0) & (u * q_draft < p_draft)
        n = accept.long().cumprod(dim=-1).sum(dim=-1)
        scale = torch.ones_like(temperature)
    n = torch.where(greedy, n_greedy, n)

    row = n.view(B, 1, 1).expand(B, 1, V)
    p_row = probs.gather(1, row).squeeze(1)  # [B, V]
    q_row = F.pad(proposals, (0, 0, 0, 1)).gather(1, row).squeeze(1)  # the bonus row has q = 0
    residual = (scale[:, None] * p_row - q_row).clamp(min=0.0)
    e = token_exponentials_torch(seed[:, None], offset[:, None], V, STREAM_TARGET + n[:, None])
    sampled = torch.where(residual.gt(0).any(dim=-1), _race_argmax(residual, e), _race_argmax(p_row, e))
    emitted = torch.where(greedy[:, None], greedy_emitted, _emit(draft_tokens, n, sampled))
    return emitted, n


def greedy_verify(logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Verification of greedy rows: accept while d_i is the target's argmax (smallest id on ties),
    then emit the argmax. What `verify` does for rows with T = 0, without its statistics and noise:
    a batch whose requests are all greedy needs nothing else.

    logits: [B, K+1, V] (any scale); draft_tokens: [B, K] -> emitted [B, K+1] (-1 padded), n [B]
    """
    K = draft_tokens.shape[1]
    logits = logits.float()
    argmax = logits.masked_fill(logits.isnan(), float("-inf")).argmax(dim=-1)  # [B, K+1]
    n = (draft_tokens == argmax[:, :K]).long().cumprod(dim=-1).sum(dim=-1)
    return _emit(draft_tokens, n, argmax.gather(1, n[:, None]).squeeze(1)), n


def _emit(draft_tokens: torch.Tensor, n: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """The n accepted drafts, then `token`, padded with -1. draft_tokens: [B, K]; n, token: [B]."""
    j = torch.arange(draft_tokens.shape[1] + 1, device=n.device)
    emitted = torch.where(j < n[:, None], F.pad(draft_tokens, (0, 1)), -1)
    return torch.where(j == n[:, None], token[:, None], emitted)


# ---------------------------------------------------------------- Triton

@triton.jit
def _load_scaled(ptr, mask, temperature):
    """Logits at ptr times 1 / T in float32, as `_scaled` computes them (one exactly rounded division
    per row instead of one per logit); NaN and masked-out entries are -inf, greedy rows keep their
    logits."""
    inverse = tl.div_rn(tl.full([], 1.0, tl.float32), tl.where(temperature > 0, temperature, 1.0))
    s = tl.load(ptr, mask=mask, other=float("-inf")).to(tl.float32) * inverse
    return tl.where(s != s, float("-inf"), s)


@triton.jit
def _stats_kernel(logits_ptr, temperature_ptr, chunk_max_ptr, chunk_sum_ptr, chunk_arg_ptr, V,
                  ROWS: tl.constexpr, CHUNK: tl.constexpr):
    """Per (logits row, vocabulary chunk): max and sum of exp(s - max) of s = x / T, and for greedy rows
    the first argmax (an argmax reduction costs a third of the kernel; sampled rows never read it)."""
    row, c = tl.program_id(0), tl.program_id(1)
    temperature = tl.load(temperature_ptr + row // ROWS)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    s = _load_scaled(logits_ptr + row.to(tl.int64) * V + cols, cols < V, temperature)
    top = tl.max(s, 0)
    total = tl.where(top > float("-inf"), tl.sum(tl.exp(s - top)), 0.0)
    out = row * tl.num_programs(1) + c
    tl.store(chunk_max_ptr + out, top)
    tl.store(chunk_sum_ptr + out, total)
    if temperature == 0:
        tl.store(chunk_arg_ptr + out, c * CHUNK + tl.argmax(s, 0, tie_break_left=True))


@triton.jit
def _accept_kernel(logits_ptr, draft_tokens_ptr, draft_row_stride, draft_col_stride, draft_probs_ptr, slots_ptr,
                   temperature_ptr, seed_ptr, offset_ptr, chunk_max_ptr, chunk_sum_ptr, chunk_arg_ptr, lse_ptr,
                   argmax_ptr, rho_ptr, num_accepted_ptr, V, KD, NUM_CHUNKS, K: tl.constexpr, ROWS_POW2: tl.constexpr,
                   CHUNKS_POW2: tl.constexpr, BLOCK: tl.constexpr):
    """Per request, all K+1 positions at once: each row's lse and (for greedy rows) argmax from the
    chunk statistics, then the greedy or standard accepted count; for block verification the capped
    ratios rho_i instead (its length comes from _block_length_kernel)."""
    b = tl.program_id(0)
    temperature = tl.load(temperature_ptr + b)
    greedy = temperature == 0
    slot = tl.load(slots_ptr + b).to(tl.int64)
    i = tl.arange(0, ROWS_POW2)  # position
    c = tl.arange(0, CHUNKS_POW2)
    is_row, is_draft = i < K + 1, i < K
    row = b * (K + 1) + i
    tile = row[:, None] * NUM_CHUNKS + c[None, :]
    in_tile = is_row[:, None] & (c[None, :] < NUM_CHUNKS)
    top = tl.load(chunk_max_ptr + tile, mask=in_tile, other=float("-inf"))
    total = tl.load(chunk_sum_ptr + tile, mask=in_tile, other=0.0)
    m, best = tl.max(top, 1, return_indices=True, return_indices_tie_break_left=True)
    lse = m + tl.log(tl.sum(tl.where(top > float("-inf"), total * tl.exp(top - m[:, None]), 0.0), 1))
    # chunk_arg holds greedy rows' argmaxes only (the statistics kernel writes no other)
    argmax = tl.load(chunk_arg_ptr + row * NUM_CHUNKS + best, mask=tl.where(greedy, is_row, False), other=0)
    tl.store(lse_ptr + row, lse, mask=is_row)
    tl.store(argmax_ptr + row, argmax, mask=is_row)

    d = tl.load(draft_tokens_ptr + b * draft_row_stride + i * draft_col_stride, mask=is_draft, other=0)
    p = tl.exp(_load_scaled(logits_ptr + row.to(tl.int64) * V + d, is_draft, temperature) - lse)
    q = tl.load(draft_probs_ptr + (slot * KD + i) * V + d, mask=is_draft, other=0.0)
    if BLOCK:
        ratio = tl.where(q > 0, p / q, 0.0)
        rho = tl.full([], 1.0, tl.float32)
        tl.store(rho_ptr + b * (K + 1), rho)
        for j in tl.static_range(K):
            ratio_j = tl.sum(tl.where(i == j, ratio, 0.0))
            rho = tl.minimum(rho * ratio_j, 1.0, propagate_nan=tl.PropagateNan.ALL)
            tl.store(rho_ptr + b * (K + 1) + j + 1, rho)
        accept = d == argmax
    else:
        u = single_uniform(tl.load(seed_ptr + b), tl.load(offset_ptr + b), i + ACCEPT_STREAM)
        accept = tl.where(greedy, d == argmax, (q > 0) & (u * q < p))
    n = tl.min(tl.where(is_draft & ~accept, i, K))  # the first rejected position
    tl.store(num_accepted_ptr + b, n.to(tl.int64))


@triton.jit
def _residual_mass_kernel(logits_ptr, draft_probs_ptr, slots_ptr, temperature_ptr, lse_ptr, rho_ptr, mass_ptr,
                          V, KD, K: tl.constexpr, CHUNK: tl.constexpr):
    """Per (request, position 1 <= i < K, chunk): the chunk's part of Z_i."""
    pid, c = tl.program_id(0), tl.program_id(1)
    b, i = pid // (K - 1), pid % (K - 1) + 1
    temperature = tl.load(temperature_ptr + b)
    if temperature == 0:
        return
    row = b * (K + 1) + i
    slot = tl.load(slots_ptr + b).to(tl.int64)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    s = _load_scaled(logits_ptr + row.to(tl.int64) * V + cols, cols < V, temperature)
    p = tl.exp(s - tl.load(lse_ptr + row))
    q = tl.load(draft_probs_ptr + (slot * KD + i) * V + cols, mask=cols < V, other=0.0)
    w = tl.maximum(tl.load(rho_ptr + row) * p - q, 0.0, propagate_nan=tl.PropagateNan.ALL)
    tl.store(mass_ptr + pid * tl.num_programs(1) + c, tl.sum(w))


@triton.jit
def _block_length_kernel(temperature_ptr, seed_ptr, offset_ptr, rho_ptr, mass_ptr, num_accepted_ptr,
                         NUM_CHUNKS, K: tl.constexpr, CHUNKS_POW2: tl.constexpr):
    """Per sampled request: tau = max{i : eta_i <= h_i}, written as its accepted count."""
    b = tl.program_id(0)
    if tl.load(temperature_ptr + b) == 0:
        return
    seed, offset = tl.load(seed_ptr + b), tl.load(offset_ptr + b)
    zero = tl.zeros([], tl.int32)
    c = tl.arange(0, CHUNKS_POW2)
    tau = tl.zeros([], tl.int64)
    for i in tl.static_range(1, K + 1):
        rho = tl.load(rho_ptr + b * (K + 1) + i)
        if i < K:
            part = tl.load(mass_ptr + (b * (K - 1) + i - 1) * NUM_CHUNKS + c, mask=c < NUM_CHUNKS, other=0.0)
            mass = tl.sum(part)
            denominator = mass + 1.0 - rho
            h = tl.where(denominator == 0, 1.0, mass / denominator)
        else:
            h = rho
        eta = single_uniform(seed, offset, zero + ACCEPT_STREAM + i - 1)
        tau = tl.where(eta <= h, i, tau)
    tl.store(num_accepted_ptr + b, tau)


@triton.jit
def _resample_kernel(logits_ptr, draft_probs_ptr, slots_ptr, temperature_ptr, seed_ptr, offset_ptr, lse_ptr,
                     rho_ptr, num_accepted_ptr, best_w_ptr, arg_w_ptr, best_p_ptr, arg_p_ptr, V, KD,
                     K: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Per (sampled request, chunk): exponential-race candidates at row n = accepted count, once from
    the residual w = max(scale * p - q, 0) and once from p (the fallback when w has no mass)."""
    b, c = tl.program_id(0), tl.program_id(1)
    temperature = tl.load(temperature_ptr + b)
    if temperature == 0:
        return
    n = tl.load(num_accepted_ptr + b)
    row = b * (K + 1) + n
    slot = tl.load(slots_ptr + b).to(tl.int64)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    s = _load_scaled(logits_ptr + row.to(tl.int64) * V + cols, cols < V, temperature)
    p = tl.exp(s - tl.load(lse_ptr + row))
    q = tl.load(draft_probs_ptr + (slot * KD + n) * V + cols, mask=(cols < V) & (n < K), other=0.0)
    scale = 1.0
    if BLOCK:
        scale = tl.where(n < K, tl.load(rho_ptr + row), 1.0)
    w = tl.maximum(scale * p - q, 0.0, propagate_nan=tl.PropagateNan.ALL)
    counters = c * (CHUNK // 4) + tl.arange(0, CHUNK // 4)
    e = token_exponentials(tl.load(seed_ptr + b), tl.load(offset_ptr + b), counters, n + TARGET_STREAM)
    score_w = tl.where(w > 0, fast_divide(w, e), float("-inf"))
    score_p = tl.where(p > 0, fast_divide(p, e), float("-inf"))
    best_w, arg_w = tl.max(score_w, 0, return_indices=True, return_indices_tie_break_left=True)
    best_p, arg_p = tl.max(score_p, 0, return_indices=True, return_indices_tie_break_left=True)
    out = b * tl.num_programs(1) + c
    tl.store(best_w_ptr + out, best_w)
    tl.store(arg_w_ptr + out, c * CHUNK + arg_w)
    tl.store(best_p_ptr + out, best_p)
    tl.store(arg_p_ptr + out, c * CHUNK + arg_p)


@triton.jit
def _pick_chunk(best_ptr, b, NUM_CHUNKS, CHUNKS_POW2: tl.constexpr):
    c = tl.arange(0, CHUNKS_POW2)
    best = tl.load(best_ptr + b * NUM_CHUNKS + c, mask=c < NUM_CHUNKS, other=float("-inf"))
    return tl.max(best, 0, return_indices=True, return_indices_tie_break_left=True)


@triton.jit
def _emit_kernel(draft_tokens_ptr, draft_row_stride, draft_col_stride, temperature_ptr, argmax_ptr, num_accepted_ptr,
                 best_w_ptr, arg_w_ptr, best_p_ptr, arg_p_ptr, emitted_ptr, NUM_CHUNKS, K: tl.constexpr,
                 CHUNKS_POW2: tl.constexpr, EMIT_POW2: tl.constexpr):
    """Per request: reduce the chunk candidates to the token and write [drafts[:n], token, -1 ...]."""
    b = tl.program_id(0)
    n = tl.load(num_accepted_ptr + b)
    if tl.load(temperature_ptr + b) == 0:
        token = tl.load(argmax_ptr + b * (K + 1) + n)
    else:
        best_w, chunk_w = _pick_chunk(best_w_ptr, b, NUM_CHUNKS, CHUNKS_POW2)
        _, chunk_p = _pick_chunk(best_p_ptr, b, NUM_CHUNKS, CHUNKS_POW2)
        if best_w > float("-inf"):
            token = tl.load(arg_w_ptr + b * NUM_CHUNKS + chunk_w)
        else:
            token = tl.load(arg_p_ptr + b * NUM_CHUNKS + chunk_p)
    j = tl.arange(0, EMIT_POW2)
    drafts = tl.load(draft_tokens_ptr + b * draft_row_stride + j * draft_col_stride, mask=j < n, other=-1)
    emitted = tl.where(j == n, token.to(tl.int64), drafts)
    tl.store(emitted_ptr + b * (K + 1) + j, emitted, mask=j < K + 1)


def launch_verify(wrap, target_logits, draft_tokens, draft_probs, slots, temperature, seed, offset, block: bool,
                  chunk: int = CHUNK, resample_chunk: int = RESAMPLE_CHUNK):
    """Runs the verification kernels; `wrap` is torch.library.wrap_triton inside the op (identity in
    interpreter tests). `chunk` and `resample_chunk` (powers of 2, the latter at least 4) are the
    vocabulary chunks of the statistics passes and of the resample."""
    target_logits, draft_probs = target_logits.contiguous(), draft_probs.contiguous()
    B, K1, V = target_logits.shape
    K = K1 - 1
    num_chunks, num_draws = triton.cdiv(V, chunk), triton.cdiv(V, resample_chunk)
    chunks_pow2, draws_pow2 = triton.next_power_of_2(num_chunks), triton.next_power_of_2(num_draws)
    f32 = dict(device=target_logits.device, dtype=torch.float32)
    i32 = dict(device=target_logits.device, dtype=torch.int32)
    chunk_max, chunk_sum = torch.empty(B * K1, num_chunks, **f32), torch.empty(B * K1, num_chunks, **f32)
    chunk_arg = torch.empty(B * K1, num_chunks, **i32)
    lse, rho = torch.empty(B, K1, **f32), torch.empty(B, K1, **f32)
    argmax = torch.empty(B, K1, **i32)
    best_w, best_p = torch.empty(B, num_draws, **f32), torch.empty(B, num_draws, **f32)
    arg_w, arg_p = torch.empty(B, num_draws, **i32), torch.empty(B, num_draws, **i32)
    num_accepted = torch.empty(B, device=target_logits.device, dtype=torch.int64)
    emitted = torch.empty(B, K1, device=target_logits.device, dtype=torch.int64)
    request = (draft_tokens, *draft_tokens.stride(), draft_probs, slots, temperature, seed, offset)

    wrap(_stats_kernel)[(B * K1, num_chunks)](
        target_logits, temperature, chunk_max, chunk_sum, chunk_arg, V, ROWS=K1, CHUNK=chunk, num_warps=4)
    KD = draft_probs.shape[1]
    wrap(_accept_kernel)[(B,)](
        target_logits, *request, chunk_max, chunk_sum, chunk_arg, lse, argmax, rho, num_accepted, V, KD, num_chunks,
        K=K, ROWS_POW2=triton.next_power_of_2(K1), CHUNKS_POW2=chunks_pow2, BLOCK=block, num_warps=2)
    if block:
        mass = torch.empty(B, max(K - 1, 0), num_chunks, **f32)
        if K > 1:
            wrap(_residual_mass_kernel)[(B * (K - 1), num_chunks)](
                target_logits, draft_probs, slots, temperature, lse, rho, mass, V, KD, K=K, CHUNK=chunk,
                num_warps=8)
        wrap(_block_length_kernel)[(B,)](
            temperature, seed, offset, rho, mass, num_accepted, num_chunks, K=K, CHUNKS_POW2=chunks_pow2,
            num_warps=1)
    wrap(_resample_kernel)[(B, num_draws)](
        target_logits, draft_probs, slots, temperature, seed, offset, lse, rho, num_accepted,
        best_w, arg_w, best_p, arg_p, V, KD, K=K, CHUNK=resample_chunk, BLOCK=block, num_warps=4)
    wrap(_emit_kernel)[(B,)](
        draft_tokens, *draft_tokens.stride(), temperature, argmax, num_accepted, best_w, arg_w, best_p, arg_p, emitted,
        num_draws, K=K, CHUNKS_POW2=draws_pow2, EMIT_POW2=triton.next_power_of_2(K1), num_warps=1)
    return emitted, num_accepted


# ---------------------------------------------------------------- op

def _check_inputs(target_logits, draft_tokens, draft_probs, slots, temperature, seed, offset):
    if target_logits.dim() != 3 or target_logits.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"target_logits must be [B, K+1, V] float32 or bfloat16, got "
                         f"{tuple(target_logits.shape)} {target_logits.dtype}")
    B, K1, V = target_logits.shape
    if tuple(draft_tokens.shape) != (B, K1 - 1) or draft_tokens.dtype != torch.int64:
        raise ValueError(f"draft_tokens must be [{B}, {K1 - 1}] int64, got "
                         f"{tuple(draft_tokens.shape)} {draft_tokens.dtype}")
    if draft_probs.dim() != 3 or draft_probs.shape[1] < K1 - 1 or draft_probs.shape[2] != V \
            or draft_probs.dtype != torch.float32:
        raise ValueError(f"draft_probs must be [S, >= {K1 - 1}, {V}] float32, got "
                         f"{tuple(draft_probs.shape)} {draft_probs.dtype}")
    check_rows(B, slots=(slots, torch.int64), temperature=(temperature, torch.float32),
               seed=(seed, torch.int64), offset=(offset, torch.int64))


@torch.library.triton_op("dspark::verify", mutates_args=())
def verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
           slots: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor,
           block: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify one draft block per request (see the module docstring).

    target_logits [B, K+1, V] float32/bfloat16, filtered but not divided by T; draft_tokens [B, K] int64
    (any strides: the decoder passes its token block's tokens[:, 1:]);
    draft_probs [S, Kd >= K, V] float32, the proposals of request b's drafts at slot slots[b] (its first K:
    a step may verify fewer drafts than were drawn); slots, seed, offset [B]
    int64; temperature [B] float32, 0 = greedy; block selects block verification.
    Returns emitted [B, K+1] int64 (padded with -1) and num_accepted [B] int64.
    Shapes, dtypes and strides are checked; values are not (that would sync with the host): draft
    tokens must lie in [0, V) and slots in [0, S), which on CUDA are read and written unchecked.
    """
    _check_inputs(target_logits, draft_tokens, draft_probs, slots, temperature, seed, offset)
    if target_logits.device.type == "cpu":
        return verify_torch(target_logits, draft_tokens, draft_probs, slots, temperature, seed, offset, block)
    return launch_verify(torch.library.wrap_triton, target_logits, draft_tokens, draft_probs, slots,
                         temperature, seed, offset, block)
