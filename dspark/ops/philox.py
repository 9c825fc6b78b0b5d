"""Counter-based Philox4x32-10 noise, in Triton and in plain torch: the words and uniforms bit for bit
the same, the exponentials to a float32 ulp or so (the GPU contracts the series into FMAs and divides
approximately; the interpreter computes with numpy).

One evaluation is keyed by the request's `seed` (the Philox key) and a 128-bit counter
`(c0, stream, offset_lo, offset_hi)`, and gives four 32-bit output words. `stream` tells the uses apart
(see the STREAM_* constants; each packs a position below 2**16), `offset` is the request's 64-bit
offset (the sequence position of the step's anchor). Token id t takes word t % 4 of the evaluation
with c0 = t // 4 (words numbered in Philox's output order), so one evaluation serves four tokens.
Nothing else enters, so a draw never depends on batch row, chunk size, padding or tensor-parallel
rank. A single draw per (stream, request), such as an acceptance uniform, is token 0's: word 0 of
counter 0.

`uniform` maps a word to (0, 1) with full resolution near 0; `exponential` maps a uniform to
Exp(1) as -log(1 - u) to a few float32 ulps, small values included (u -> 0, the winning tail of an
exponential race argmax_v w_v / e_v): -log(v) = 2 atanh((1 - m) / (1 + m)) - k log 2 for
v = 1 - u = m 2^k with m in [0.75, 1.5), or, for u < 1/4, -log(1 - u) = 2 atanh(u / (2 - u)) without
rounding 1 - u; atanh as its odd series to s^9 (|s| <= 0.2: truncation below 1e-8). A plain
float32 -log(1 - u) would round 1 - u, off by up to 1e-4 where races are won.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.ops.fastmath import fast_divide

ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85
N_ROUNDS = 10
U32 = 0xFFFFFFFF
TWO_POW_M32 = 2.0 ** -32
TWO_POW_M33 = 2.0 ** -33
U_MAX = 1.0 - 2.0 ** -24  # largest uniform, so log(1 - u) stays finite
LN2 = 0.6931471805599453
M_LOW_BITS = 0x3F400000  # float32 0.75: mantissas are brought into [0.75, 1.5)

# Streams: the high bits of counter word 1. The low 16 bits carry a position.
STREAM_DRAFT = 0 << 16  # noise of draft position k
STREAM_ACCEPT = 1 << 16  # acceptance uniform of verified position i
STREAM_TARGET = 2 << 16  # noise of the correction / bonus token at position i
STREAM_DRAFT_GROUP = 3 << 16  # noise of the vocabulary groups at draft position k (gumbel_max.py)

# Compiled Triton reads module globals only as constexprs: the kernels use these copies.
_ROUND_A, _ROUND_B, _KEY_A, _KEY_B, _N_ROUNDS, _TWO_POW_M32, _TWO_POW_M33, _U_MAX, _LN2, _M_LOW_BITS = (
    tl.constexpr(c) for c in (ROUND_A, ROUND_B, KEY_A, KEY_B, N_ROUNDS, TWO_POW_M32, TWO_POW_M33, U_MAX, LN2,
                              M_LOW_BITS))


# ---------------------------------------------------------------- Triton

@triton.jit
def philox(seed, offset, counter, stream):
    """The four Philox4x32-10 output words (uint32) for key `seed` (int64) and counter
    (counter, stream, offset_lo, offset_hi) (counter, stream int32, offset int64); the arguments
    broadcast together."""
    seed = seed.to(tl.uint64)
    offset = offset.to(tl.uint64)
    c0 = counter.to(tl.uint32)
    c1 = stream.to(tl.uint32)
    c2 = (offset & 0xFFFFFFFF).to(tl.uint32)
    c3 = (offset >> 32).to(tl.uint32)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    a = tl.full([], _ROUND_A, tl.uint32)
    b = tl.full([], _ROUND_B, tl.uint32)
    for _ in tl.static_range(_N_ROUNDS):
        prod_b = b.to(tl.uint64) * c2  # one wide multiply gives both words of the product
        prod_a = a.to(tl.uint64) * c0
        c0 = (prod_b >> 32).to(tl.uint32) ^ c1 ^ k0
        c2 = (prod_a >> 32).to(tl.uint32) ^ c3 ^ k1
        c1 = prod_b.to(tl.uint32)
        c3 = prod_a.to(tl.uint32)
        k0 = k0 + _KEY_A
        k1 = k1 + _KEY_B
    return c0, c1, c2, c3


@triton.jit
def token_words(seed, offset, counter, stream):
    """The words of tokens 4 c + j (j = 0..3) for the counters c [..., N]: [..., 4 N] uint32."""
    w0, w1, w2, w3 = philox(seed, offset, counter, stream)
    return tl.interleave(tl.interleave(w0, w2), tl.interleave(w1, w3))


@triton.jit
def uniform(word):
    u = word.to(tl.float32) * _TWO_POW_M32 + _TWO_POW_M33  # one FMA: (w + 1/2) 2^-32, rounded once
    return tl.minimum(u, _U_MAX)


@triton.jit
def exponential(u):
    v = 1.0 - u
    bits = v.to(tl.int32, bitcast=True)
    k = (bits - _M_LOW_BITS) >> 23  # v = m 2^k, m in [0.75, 1.5)
    m = (bits - (k << 23)).to(tl.float32, bitcast=True)
    small = u < 0.25
    s = fast_divide(tl.where(small, u, 1.0 - m), tl.where(small, 2.0 - u, m + 1.0))  # den in [1.75, 2.5]
    s2 = s * s
    atanh = s + s * s2 * (1 / 3 + s2 * (1 / 5 + s2 * (1 / 7 + s2 * (1 / 9))))
    return 2.0 * atanh - k.to(tl.float32) * _LN2  # k = 0 for u < 1/4


@triton.jit
def token_exponentials(seed, offset, counter, stream):
    """Exp(1) noise of tokens 4 c + j (j = 0..3) for the counters c [..., N]: [..., 4 N] float32."""
    return exponential(uniform(token_words(seed, offset, counter, stream)))


@triton.jit
def single_uniform(seed, offset, stream):
    """The one uniform of a stream that needs a single draw: token 0's (word 0 of counter 0)."""
    word, _, _, _ = philox(seed, offset, stream * 0, stream)
    return uniform(word)


# ---------------------------------------------------------------- torch

def _mul_hi_lo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32-bit words of a * b for a < 2**32 (int64 tensor) and a 32-bit constant b,
    in two 48-bit partial products so nothing overflows int64 (a wrapping product would be shorter,
    but Inductor's C++ code treats the overflow as undefined: its draws then differ from eager)."""
    lo, hi = a * (b & 0xFFFF), a * (b >> 16)
    return (hi + (lo >> 16)) >> 16, (((hi & 0xFFFF) << 16) + lo) & U32


def philox_torch(seed: torch.Tensor, offset: torch.Tensor, counter: torch.Tensor | int,
                 stream: torch.Tensor | int) -> tuple[torch.Tensor, ...]:
    """Same as `philox`, in int64 arithmetic (words in [0, 2**32)); all arguments broadcast together.
    (They are broadcast lazily: a per-row counter word stays [B, 1] until mixed with a wider one.)"""
    c0, c1 = (w.long() & U32 if isinstance(w, torch.Tensor) else seed.new_full((), w & U32, dtype=torch.long)
              for w in (counter, stream))  # new_full, not as_tensor: no host copy inside a CUDA graph
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
    return tuple(c.expand(shape) for c in (c0, c1, c2, c3))


def token_words_torch(seed: torch.Tensor, offset: torch.Tensor, num_tokens: int,
                      stream: torch.Tensor | int, first: torch.Tensor | int = 0) -> torch.Tensor:
    """The words of tokens first .. first + num_tokens - 1: [..., num_tokens], where ... is the
    broadcast shape of seed, offset, stream and first (give them a trailing axis of size 1; first a
    multiple of 4)."""
    counter = first // 4 + torch.arange(triton.cdiv(num_tokens, 4), device=seed.device)
    words = torch.stack(philox_torch(seed, offset, counter, stream), dim=-1)  # [..., N / 4, 4]
    return words.flatten(-2)[..., :num_tokens]


def uniform_torch(word: torch.Tensor) -> torch.Tensor:
    return ((word.float() + 0.5) * TWO_POW_M32).clamp(max=U_MAX)


def exponential_torch(u: torch.Tensor) -> torch.Tensor:
    v = 1.0 - u
    bits = v.view(torch.int32)
    k = (bits - M_LOW_BITS) >> 23
    m = (bits - (k << 23)).view(torch.float32)
    small = u < 0.25
    s = torch.where(small, u, 1.0 - m) / torch.where(small, 2.0 - u, m + 1.0)
    s2 = s * s
    atanh = s + s * s2 * (1 / 3 + s2 * (1 / 5 + s2 * (1 / 7 + s2 * (1 / 9))))
    return 2.0 * atanh - k.float() * LN2  # k = 0 for u < 1/4


def token_exponentials_torch(seed: torch.Tensor, offset: torch.Tensor, num_tokens: int,
                             stream: torch.Tensor | int, first: torch.Tensor | int = 0) -> torch.Tensor:
    """Same as `token_exponentials`, for tokens first .. first + num_tokens - 1 (shapes as
    token_words_torch)."""
    return exponential_torch(uniform_torch(token_words_torch(seed, offset, num_tokens, stream, first)))


def single_uniform_torch(seed: torch.Tensor, offset: torch.Tensor, stream: torch.Tensor | int) -> torch.Tensor:
    """Same as `single_uniform`; the arguments broadcast together."""
    return uniform_torch(philox_torch(seed, offset, 0, stream)[0])
