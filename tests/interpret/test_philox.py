"""The Philox stream: the Triton functions (interpreted) and the torch replica give the same words
bit for bit, for 64-bit seeds and offsets, any stream and token id; both are Philox4x32-10 (the
Random123 known answers) and give token t word t % 4 of counter t // 4."""
import torch
import triton
import triton.language as tl

from dspark.ops import philox

N = 256  # tokens per row


@triton.jit
def _draw_kernel(seed_ptr, offset_ptr, word_ptr, uniform_ptr, exponential_ptr, stream_id,
                 ROWS: tl.constexpr, N: tl.constexpr):
    rows = tl.arange(0, ROWS)[:, None]
    counters = tl.arange(0, N // 4)[None, :]
    tokens = rows * N + tl.arange(0, N)[None, :]
    words = philox.token_words(tl.load(seed_ptr + rows), tl.load(offset_ptr + rows), counters,
                               counters * 0 + stream_id)
    u = philox.uniform(words)
    tl.store(word_ptr + tokens, words.to(tl.int64))
    tl.store(uniform_ptr + tokens, u)
    tl.store(exponential_ptr + tokens, philox.exponential(u))


@triton.jit
def _words_kernel(seed, offset, counter, stream, out_ptr):
    w0, w1, w2, w3 = philox.philox(seed, offset, counter, stream)
    tl.store(out_ptr + tl.arange(0, 4), tl.join(tl.join(w0, w2), tl.join(w1, w3)).reshape(4).to(tl.int64))


def test_triton_and_torch_draw_the_same_stream():
    seed = torch.tensor([0, 1234, 2**40 + 7, -5, 2**62 + 11, 3, 9, 2**33])
    offset = torch.tensor([0, 99, 2**33 + 1, 7, 2**50, 5, 0, 2**40 - 1])
    for stream in (philox.STREAM_DRAFT + 3, philox.STREAM_ACCEPT, philox.STREAM_TARGET + 6):
        word = torch.empty(len(seed), N, dtype=torch.int64)
        uniform, exponential = torch.empty(len(seed), N), torch.empty(len(seed), N)
        _draw_kernel[(1,)](seed, offset, word, uniform, exponential, stream, ROWS=len(seed), N=N)
        want = philox.token_words_torch(seed[:, None], offset[:, None], N, stream)
        assert torch.equal(word & philox.U32, want)
        assert torch.equal(uniform, philox.uniform_torch(want))
        # log differs by an ulp or so between numpy (the interpreter) and torch
        torch.testing.assert_close(exponential, philox.exponential_torch(philox.uniform_torch(want)),
                                   rtol=1e-6, atol=0)


def test_known_answers_and_four_tokens_per_evaluation():
    """Random123's Philox4x32-10 test vectors, with key (seed_lo, seed_hi) and counter
    (c0, stream, offset_lo, offset_hi)."""
    def signed(x):
        return x - 2**64 if x >= 2**63 else x

    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for (c0, c1, c2, c3), (k0, k1), want in cases:
        seed, offset = signed(k0 | k1 << 32), signed(c2 | c3 << 32)
        words = philox.philox_torch(torch.tensor(seed), torch.tensor(offset), c0, c1)
        assert [int(w) for w in words] == list(want)
        out = torch.empty(4, dtype=torch.int64)
        _words_kernel[(1,)](seed, offset, c0, c1, out)
        assert (out & philox.U32).tolist() == list(want)

    seed, offset = torch.tensor([[2**40 + 9]]), torch.tensor([[77]])
    tokens = philox.token_words_torch(seed, offset, 32, philox.STREAM_TARGET)[0]
    for t in range(32):  # token t takes word t % 4 of counter t // 4
        assert tokens[t] == philox.philox_torch(seed, offset, t // 4, philox.STREAM_TARGET)[t % 4]


def test_uniforms_stay_inside_the_open_interval_and_streams_differ():
    seed, offset = torch.tensor([[3]]), torch.tensor([[5]])
    u = philox.uniform_torch(philox.token_words_torch(seed, offset, 1 << 16, philox.STREAM_ACCEPT))
    assert 0 < u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01
    other = philox.uniform_torch(philox.token_words_torch(seed, offset, 1 << 16, philox.STREAM_TARGET))
    assert (u != other).float().mean() > 0.99
    e = philox.exponential_torch(u)
    assert torch.isfinite(e).all() and (e > 0).all() and abs(e.mean() - 1) < 0.02


@triton.jit
def _exponential_kernel(u_ptr, out_ptr, N: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, N), philox.exponential(tl.load(u_ptr + tl.arange(0, N))))


def test_exponential_is_minus_log_one_minus_u_to_a_few_ulps():
    """Over (0, U_MAX], tiny u included, both implementations are within 2.5 float32 ulps of
    -log1p(-u) in float64; the plain float32 -log(1 - u) is not (it rounds 1 - u), so the
    bound has power."""
    u = torch.cat([torch.logspace(-12, -0.001, 1 << 14, dtype=torch.float64),
                   1 - torch.logspace(-7.2, -0.3, 1 << 14, dtype=torch.float64)]).float()
    u = u.clamp(max=philox.U_MAX)
    want = -torch.log1p(-u.double())
    got = torch.empty_like(u)
    _exponential_kernel[(1,)](u, got, N=len(u))
    bound = 2.5 * 2.0 ** -23
    for e in (got, philox.exponential_torch(u)):
        assert ((e.double() - want) / want).abs().max() < bound
    naive = -torch.log(1.0 - u)
    assert ((naive.double() - want) / want).abs().max() > bound
