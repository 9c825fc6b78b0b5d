"""Counter-based Philox4x32-10 noise, in Triton and in plain torch, bit for bit the same.

One draw is keyed by the request's `seed` (the Philox key) and a 128-bit counter
`(token, stream, offset_lo, offset_hi)`: `token` is the vocabulary id, `stream` tells the uses apart
(see the STREAM_* constants; each packs a position below 2**16), `offset` is the request's 64-bit
offset (the sequence position of the step's anchor). Nothing else enters, so a draw never depends on
batch row, chunk size, padding or tensor-parallel rank.

`uniform` maps the first output word to (0, 1) with full resolution near 0; `gumbel` is
-log(-log(1 - u)), computed so that its winning tail (u -> 0) keeps that resolution.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85
N_ROUNDS = 10
U32 = 0xFFFFFFFF
TWO_POW_M32 = 2.0 ** -32
U_MAX = 1.0 - 2.0 ** -24  # largest uniform, so log(1 - u) stays finite
SERIES_BELOW = 2.0 ** -12  # below it, -log(1 - u) = u + u^2 / 2 to float32 precision

# Streams: the high bits of counter word 1. The low 16 bits carry a position.
STREAM_DRAFT = 0 << 16  # Gumbel noise of draft position k
STREAM_ACCEPT = 1 << 16  # acceptance uniform of verified position i
STREAM_TARGET = 2 << 16  # Gumbel noise of the correction / bonus token at position i

# Compiled Triton reads module globals only as constexprs: the kernels use these copies.
_ROUND_A, _ROUND_B, _KEY_A, _KEY_B, _N_ROUNDS, _TWO_POW_M32, _U_MAX, _SERIES_BELOW = (
    tl.constexpr(c) for c in (ROUND_A, ROUND_B, KEY_A, KEY_B, N_ROUNDS, TWO_POW_M32, U_MAX, SERIES_BELOW))


# ---------------------------------------------------------------- Triton

@triton.jit
def philox_word(seed, offset, token, stream):
    """First Philox4x32-10 output word (uint32) for key `seed` (int64 scalar) and counter
    (token [BLOCK] int, stream int, offset int64 scalar)."""
    seed = seed.to(tl.uint64)
    offset = offset.to(tl.uint64)
    c0 = token.to(tl.uint32)
    zero = c0 * 0
    c1 = zero + stream.to(tl.uint32)
    c2 = zero + (offset & 0xFFFFFFFF).to(tl.uint32)
    c3 = zero + (offset >> 32).to(tl.uint32)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    a = tl.full([], _ROUND_A, tl.uint32)
    b = tl.full([], _ROUND_B, tl.uint32)
    for _ in tl.static_range(_N_ROUNDS):
        p0, p2 = c0, c2
        c0 = tl.umulhi(b, p2) ^ c1 ^ k0
        c2 = tl.umulhi(a, p0) ^ c3 ^ k1
        c1 = b * p2
        c3 = a * p0
        k0 = k0 + _KEY_A
        k1 = k1 + _KEY_B
    return c0


@triton.jit
def uniform(seed, offset, token, stream):
    x = philox_word(seed, offset, token, stream)
    u = (x.to(tl.float32) + 0.5) * _TWO_POW_M32
    return tl.minimum(u, _U_MAX)


@triton.jit
def gumbel(seed, offset, token, stream):
    u = uniform(seed, offset, token, stream)
    e = tl.where(u < _SERIES_BELOW, u + 0.5 * u * u, -tl.log(1.0 - u))
    return -tl.log(e)


# ---------------------------------------------------------------- torch

def _mul_hi_lo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32-bit words of a * b for a < 2**32 (int64 tensor) and a 32-bit constant b,
    in two 48-bit partial products so nothing overflows int64."""
    lo, hi = a * (b & 0xFFFF), a * (b >> 16)
    return (hi + (lo >> 16)) >> 16, (((hi & 0xFFFF) << 16) + lo) & U32


def philox_word_torch(seed: torch.Tensor, offset: torch.Tensor, token: torch.Tensor,
                      stream: torch.Tensor | int) -> torch.Tensor:
    """Same as `philox_word`, in int64 arithmetic; all arguments broadcast together. (They are
    broadcast lazily: a per-row counter word stays [B, 1] until mixed with the token word.)"""
    c0 = token.long() & U32
    c1 = torch.as_tensor(stream, device=c0.device).long() & U32
    c2 = offset.long() & U32
    c3 = (offset.long() >> 32) & U32
    k0 = seed.long() & U32
    k1 = (seed.long() >> 32) & U32
    shape = torch.broadcast_shapes(c0.shape, c1.shape, c2.shape, c3.shape, k0.shape)
    for _ in range(N_ROUNDS):
        hi_b, lo_b = _mul_hi_lo(c2, ROUND_B)
        hi_a, lo_a = _mul_hi_lo(c0, ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + KEY_A) & U32, (k1 + KEY_B) & U32
    return c0.expand(shape)


def uniform_torch(seed, offset, token, stream) -> torch.Tensor:
    x = philox_word_torch(seed, offset, token, stream)
    return ((x.float() + 0.5) * TWO_POW_M32).clamp(max=U_MAX)


def gumbel_torch(seed, offset, token, stream) -> torch.Tensor:
    u = uniform_torch(seed, offset, token, stream)
    e = torch.where(u < SERIES_BELOW, u + 0.5 * u * u, -torch.log(1.0 - u))
    return -torch.log(e)
