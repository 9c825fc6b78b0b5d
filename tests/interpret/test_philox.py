"""The Philox stream: the Triton functions (interpreted) and the torch replica give the same words
bit for bit, for 64-bit seeds and offsets, any stream and token id."""
import torch
import triton
import triton.language as tl

from dspark.ops import philox

N = 256


@triton.jit
def _draw_kernel(seed_ptr, offset_ptr, word_ptr, uniform_ptr, gumbel_ptr, stream_id, N: tl.constexpr):
    row = tl.program_id(0)
    token = tl.arange(0, N)
    seed, offset = tl.load(seed_ptr + row), tl.load(offset_ptr + row)
    stream_id = token * 0 + stream_id
    tl.store(word_ptr + row * N + token, philox.philox_word(seed, offset, token, stream_id).to(tl.int64))
    tl.store(uniform_ptr + row * N + token, philox.uniform(seed, offset, token, stream_id))
    tl.store(gumbel_ptr + row * N + token, philox.gumbel(seed, offset, token, stream_id))


def test_triton_and_torch_draw_the_same_stream():
    seed = torch.tensor([0, 1234, 2**40 + 7, -5, 2**62 + 11])
    offset = torch.tensor([0, 99, 2**33 + 1, 7, 2**50])
    token = torch.arange(N)
    for stream in (philox.STREAM_DRAFT + 3, philox.STREAM_ACCEPT, philox.STREAM_TARGET + 6):
        word = torch.empty(len(seed), N, dtype=torch.int64)
        uniform, gumbel = torch.empty(len(seed), N), torch.empty(len(seed), N)
        _draw_kernel[(len(seed),)](seed, offset, word, uniform, gumbel, stream, N=N)
        args = (seed[:, None], offset[:, None], token[None], stream)
        assert torch.equal(word & philox.U32, philox.philox_word_torch(*args))
        assert torch.equal(uniform, philox.uniform_torch(*args))
        # log differs by an ulp or so between numpy (the interpreter) and torch
        torch.testing.assert_close(gumbel, philox.gumbel_torch(*args), rtol=1e-6, atol=1e-6)


def test_uniforms_stay_inside_the_open_interval_and_streams_differ():
    seed, offset, token = torch.tensor([[3]]), torch.tensor([[5]]), torch.arange(1 << 16)[None]
    u = philox.uniform_torch(seed, offset, token, philox.STREAM_ACCEPT)
    assert 0 < u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01
    other = philox.uniform_torch(seed, offset, token, philox.STREAM_TARGET)
    assert (u != other).float().mean() > 0.99
    assert torch.isfinite(philox.gumbel_torch(seed, offset, token, philox.STREAM_DRAFT)).all()
