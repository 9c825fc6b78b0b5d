"""An independent float64 reference of the two verification rules and the target-side filters, written
from the algorithms (shared/reference/kernels.md section 1), for the tests of dspark::verify.

It shares nothing with dspark/ops/verify.py but the noise it is given, which it takes from
dspark.ops.philox's documented streams: the uniform of draft i is token 0 of stream
STREAM_ACCEPT + i; the correction or bonus token at position n is the exponential race
argmax_v w(v) / e_v with e from stream STREAM_TARGET + n. Per request, with p_i the target's law and
q_i the proposal at position i (0-based) and d_i the draft drawn from q_i:

- standard (Leviathan et al.): draft i is accepted iff u_i q_i(d_i) < p_i(d_i), that is u_i < t_i with
  t_i = p_i(d_i) / q_i(d_i) (t_i = 0 where q_i(d_i) = 0), up to the first rejection n; the next token
  comes from max(p_n - q_n, 0), or from p_K when n = K.
- block (Sun et al. 2024): rho_0 = 1, rho_j = min(1, rho_{j-1} t_{j-1}) the capped ratio of the
  first j drafts, Z_j = sum_x max(rho_j p_j(x) - q_j(x), 0), h_j = Z_j / (Z_j + 1 - rho_j) for
  0 < j < K (1 where the denominator is 0) and h_K = rho_K; eta_j is the uniform of draft j - 1; the
  accepted length is tau = max{j : eta_j <= h_j} (0 if none), and the next token comes from
  max(rho_tau p_tau - q_tau, 0), or from p_K when tau = K.
- a residual with no mass gives way to p at the same position; greedy rows (T = 0) accept while the
  draft is the argmax of the logits (the smallest id on ties) and then emit the argmax.
- filters (vLLM's order), on p = softmax(logits / T): min-p keeps p >= min_p max p and top-k the k
  largest and those tied with the k-th; top-p then keeps, of what they kept sorted by probability,
  each token whose predecessors' mass is below top_p times the kept mass (the most likely always).

The op computes in float32, so near a decision's boundary the two may differ. Every decision is a
comparison, and the reference reports per request the smallest distance of one of its decisions to
its boundary (`margin`), each in relative terms: |u q - p| / max(u q, p); |eta - h| (Z + 1 - rho)
(the error h tolerates in Z and rho); for the race, the relative error in the weights' terms (rho p
and q) that would change its winner or its falling back to p; for the filters, p against
min_p max p, the k-th logit against the next, the mass before a token against top_p times the kept
mass, and the two tokens either side of the top-p cut (a tie there makes the cut ambiguous). Greedy
rows compare the given logits themselves, as the op does: exact. The op's float32 rounding moves
these quantities by about 1e-6 at most (a few ulps through a softmax and a sum over at most 64
tokens): the tests skip requests with margin < TIE and check that they are few.

Arrays are numpy float64 with a leading batch axis B; K drafts, V tokens.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from dspark.ops.philox import STREAM_ACCEPT, STREAM_TARGET, single_uniform_torch, token_exponentials_torch

TIE = 1e-5  # requests whose margin is below this are too near a tie for a float32 implementation


def relative_gap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| relative to the larger of the two (inf where both are 0: nothing is decided there)."""
    scale = np.maximum(np.abs(a), np.abs(b))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(scale > 0, np.abs(a - b) / scale, np.inf)


def lowest(x: np.ndarray, axes) -> np.ndarray:
    return x.min(axis=axes, initial=np.inf)


def softmax(x: np.ndarray) -> np.ndarray:
    w = np.exp(x - x.max(-1, keepdims=True))
    return w / w.sum(-1, keepdims=True)


# ---------------------------------------------------------------- the target's law and the filters

def filtered(x: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray):
    """x [B, N, V] scaled logits; top_k, top_p, min_p [B] (0, 1, 0: off) -> x with the removed tokens
    at -inf, and the margin [B] of the cut-offs."""
    B, _, V = x.shape
    p = softmax(x)
    keep = np.ones(x.shape, dtype=bool)
    margin = np.full(B, np.inf)

    bound = min_p[:, None, None] * p.max(-1, keepdims=True)
    keep &= p >= bound
    margin = np.where(min_p > 0, np.minimum(margin, lowest(relative_gap(p, bound), (1, 2))), margin)

    k = np.where((top_k > 0) & (top_k < V), top_k, V).astype(np.int64)[:, None, None]
    ordered = -np.sort(-x, axis=-1)
    kth = np.take_along_axis(ordered, k - 1, -1)
    keep &= x >= kth
    after = np.take_along_axis(ordered, np.minimum(k, V - 1), -1)
    gap = np.where(kth > after, relative_gap(kth, after), np.inf)  # tokens tied with the k-th stay: exact
    margin = np.where(k[:, 0, 0] < V, np.minimum(margin, lowest(gap, (1, 2))), margin)

    kept = np.where(keep, p, 0.0)
    order = np.argsort(-kept, axis=-1, kind="stable")  # most likely first, the removed ones last
    ranked = np.take_along_axis(kept, order, -1)
    before = np.cumsum(ranked, -1) - ranked  # each token's predecessors' mass
    total = ranked.sum(-1, keepdims=True)
    cut = top_p[:, None, None] * total
    stays = ((before < cut) | (top_p[:, None, None] >= 1)) & (ranked > 0)
    stays[..., 0] = True
    np.put_along_axis(keep, order, stays, -1)
    near_cut = np.where((ranked > 0) & (np.arange(V) > 0), np.abs(before - cut) / total, np.inf)
    last = stays.sum(-1, keepdims=True) - 1  # the kept and the removed token either side of the cut
    pair = np.take_along_axis(ranked, np.concatenate([last, np.minimum(last + 1, V - 1)], -1), -1)
    swap = np.where((last[..., 0] + 1 < V) & (pair[..., 1] > 0), relative_gap(pair[..., 0], pair[..., 1]), np.inf)
    top_p_margin = np.minimum(lowest(near_cut, (1, 2)), lowest(swap, 1))
    margin = np.where(top_p < 1, np.minimum(margin, top_p_margin), margin)
    return np.where(keep, x, -np.inf), margin


def target_probs(logits: np.ndarray, temperature: np.ndarray, top_k=None, top_p=None, min_p=None):
    """logits [B, N, V], temperature [B] (> 0) -> p = softmax of the filtered logits / T [B, N, V], and
    the filters' margin [B]."""
    x = logits / temperature[:, None, None]
    margin = np.full(len(x), np.inf)
    if top_k is not None:
        x, margin = filtered(x, top_k, top_p, min_p)
    return softmax(x), margin


# ---------------------------------------------------------------- the rules

def drafted(law: np.ndarray, drafts: np.ndarray) -> np.ndarray:
    """law [B, N >= K, V], drafts [B, K] -> the law at each draft [B, K]."""
    K = drafts.shape[1]
    return np.take_along_axis(law[:, :K], drafts[..., None], -1)[..., 0]


def ratios(p: np.ndarray, q: np.ndarray, drafts: np.ndarray) -> np.ndarray:
    """t_i = p_i(d_i) / q_i(d_i) [B, K], 0 where the proposal is 0 (such a draft is rejected)."""
    pd, qd = drafted(p, drafts), drafted(q, drafts)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(qd > 0, pd / qd, 0.0)


def capped_ratios(t: np.ndarray) -> np.ndarray:
    """rho_0 .. rho_K [B, K+1] of block verification from t [B, K]."""
    rho = [np.ones(len(t))]
    for i in range(t.shape[1]):
        rho.append(np.minimum(1.0, rho[-1] * t[:, i]))
    return np.stack(rho, 1)


def residual_mass(p: np.ndarray, q: np.ndarray, rho: np.ndarray) -> np.ndarray:
    """Z_j = sum_x max(rho_j p_j(x) - q_j(x), 0) for j = 0 .. K-1: [B, K]."""
    K = q.shape[1]
    return np.maximum(rho[:, :K, None] * p[:, :K] - q, 0.0).sum(-1)


def thresholds(p: np.ndarray, q: np.ndarray, drafts: np.ndarray, block: bool) -> np.ndarray:
    """The K thresholds [B, K] the rule compares its uniforms with; p [B, K+1, V], q [B, K, V].
    standard: t_0 .. t_{K-1} (draft i is accepted iff u_i < t_i); block: h_1 .. h_K (eta_j <= h_j)."""
    t = ratios(p, q, drafts)
    if not block:
        return t
    rho = capped_ratios(t)
    mass, K = residual_mass(p, q, rho), t.shape[1]
    denominator = mass[:, 1:] + 1 - rho[:, 1:K]
    with np.errstate(invalid="ignore", divide="ignore"):
        h = np.where(denominator > 0, mass[:, 1:] / denominator, 1.0)
    return np.concatenate([h, rho[:, K:]], 1)


def accepted(limits: np.ndarray, uniforms: np.ndarray, block: bool) -> np.ndarray:
    """The accepted count [B] from the thresholds and the uniforms [B, K] (u_i of draft i; block: eta_j
    is the uniform of draft j - 1)."""
    B, K = limits.shape
    if not block:
        rejected = np.concatenate([uniforms >= limits, np.ones((B, 1), dtype=bool)], 1)
        return rejected.argmax(1)  # the first rejection
    passed = uniforms <= limits  # eta_j <= h_j at column j - 1
    return np.where(passed, np.arange(1, K + 1), 0).max(1, initial=0)


def residual_terms(p: np.ndarray, q: np.ndarray, drafts: np.ndarray, n: np.ndarray, block: bool):
    """The next token's weights after n [B] accepted drafts as (s p_n - q_n, s p_n + q_n) [B, V]: the
    weight is the first one's positive part, and the second bounds the first's rounding. s = rho_n in
    block verification, 1 in standard; at n = K the bonus: (p_K, p_K)."""
    B, K = drafts.shape
    rows = np.arange(B)
    scale = capped_ratios(ratios(p, q, drafts))[rows, n] if block else np.ones(B)
    q_row = np.concatenate([q, np.zeros_like(p[:, :1])], 1)[rows, n]  # the bonus position has none
    p_row = p[rows, n]
    return scale[:, None] * p_row - q_row, scale[:, None] * p_row + q_row


def next_token_weights(p, q, drafts, n, block: bool, terms=residual_terms) -> np.ndarray:
    """The (unnormalised) law [B, V] of the token after n [B] accepted drafts: the residual, or p_n
    where the residual has no mass."""
    difference, _ = terms(p, q, drafts, n, block)
    w = np.maximum(difference, 0.0)
    return np.where(w.sum(-1, keepdims=True) > 0, w, p[np.arange(len(n)), n])


def race(w: np.ndarray, e: np.ndarray) -> np.ndarray:
    """argmax_v w(v) / e_v [B] over the tokens of positive weight, the smallest id on ties."""
    with np.errstate(divide="ignore"):
        return np.where(w > 0, w / e, -np.inf).argmax(-1)


def race_margin(difference: np.ndarray, size: np.ndarray, e: np.ndarray, winner: np.ndarray) -> np.ndarray:
    """The largest relative error eps of the weights' terms under which `winner` [B] still wins, each
    weight max(d, 0) moving by up to eps c (d = difference, c = size, [B, V]): min over the other
    tokens v of (d_w / e_w - d_v / e_v) / (c_w / e_w + c_v / e_v), and d_w / c_w (its weight stays
    positive)."""
    rows = np.arange(len(winner))
    d, c = difference / e, size / e
    d_w, c_w = d[rows, winner][:, None], c[rows, winner][:, None]
    other = (size > 0) & (np.arange(d.shape[1]) != winner[:, None])
    gaps = np.where(other, (d_w - d) / (c_w + np.where(other, c, 1.0)), np.inf)
    return np.minimum(d_w[:, 0] / c_w[:, 0], lowest(gaps, 1))


# ---------------------------------------------------------------- a batch

def decision_margin(p, q, drafts, n, limits, uniforms, block: bool) -> np.ndarray:
    """The acceptance decisions' margin [B]: standard, of the decisions made (the acceptances and the
    rejection), |u q - p| / max(u q, p) where p and q are positive (else the decision is exact);
    block, of all K, |eta_j - h_j| (Z_j + 1 - rho_j) for j < K and |eta_K - rho_K|."""
    B, K = drafts.shape
    if block:
        rho = capped_ratios(ratios(p, q, drafts))
        weight = np.concatenate([residual_mass(p, q, rho)[:, 1:] + 1 - rho[:, 1:K], np.ones((B, 1))], 1)
        return lowest(np.abs(uniforms - limits) * weight, 1)
    pd, qd = drafted(p, drafts), drafted(q, drafts)
    made = np.arange(K) <= n[:, None]
    gap = np.where(made & (pd > 0) & (qd > 0), relative_gap(uniforms * qd, pd), np.inf)
    return lowest(gap, 1)


def sampled_rows(logits, drafts, q, temperature, u, exponentials, block: bool, filters):
    """verify of rows with T > 0 -> emitted [B, K+1], n [B], margin [B]; exponentials(n) gives the
    race's noise [B, V] at positions n [B]."""
    B, K = drafts.shape
    p, margin = target_probs(logits, temperature, *filters)
    limits = thresholds(p, q, drafts, block)
    n = accepted(limits, u, block)
    margin = np.minimum(margin, decision_margin(p, q, drafts, n, limits, u, block))
    difference, size = residual_terms(p, q, drafts, n, block)
    e_n = exponentials(n)
    has_mass = (difference > 0).any(-1)
    p_n = p[np.arange(B), n]
    token = np.where(has_mass, race(np.maximum(difference, 0.0), e_n), race(p_n, e_n))
    with np.errstate(invalid="ignore", divide="ignore"):
        clearly_not = lowest(np.where(size > 0, -difference / size, np.inf), 1)  # no mass: all clearly <= 0
    margin = np.minimum(margin, np.where(has_mass, race_margin(difference, size, e_n, token),
                                         np.minimum(race_margin(p_n, p_n, e_n, token), clearly_not)))
    return emit(drafts, n, token), n, margin


def greedy_rows(logits, drafts):
    """verify of rows with T = 0 (no filters) -> emitted [B, K+1], n [B], margin [B]: inf, for the
    rows compare the given logits themselves (float32 or bfloat16 values, exact in float64), as the op
    does; the top two logits' gap is no boundary (ties go to the smallest id in both)."""
    B, K = drafts.shape
    top = logits.argmax(-1)  # the first maximum: the smallest id on ties
    n = np.concatenate([drafts != top[:, :K], np.ones((B, 1), dtype=bool)], 1).argmax(1)
    return emit(drafts, n, top[np.arange(B), n]), n, np.full(B, np.inf)


def emit(drafts: np.ndarray, n: np.ndarray, token: np.ndarray) -> np.ndarray:
    """[d_0 .. d_{n-1}, token, -1 ...] [B, K+1]."""
    B, K = drafts.shape
    j = np.arange(K + 1)
    padded = np.concatenate([drafts, np.zeros((B, 1), dtype=drafts.dtype)], 1)
    return np.where(j < n[:, None], padded, np.where(j == n[:, None], token[:, None], -1))


def acceptance_uniforms(seed: torch.Tensor, offset: torch.Tensor, K: int) -> np.ndarray:
    """u [B, K]: the uniform of draft i is token 0 of stream STREAM_ACCEPT + i."""
    return single_uniform_torch(seed[:, None], offset[:, None], STREAM_ACCEPT + torch.arange(K)).double().numpy()


def race_exponentials(seed: torch.Tensor, offset: torch.Tensor, V: int, n: np.ndarray) -> np.ndarray:
    """e [B, V]: the exponentials of the race at position n [B], stream STREAM_TARGET + n."""
    stream = STREAM_TARGET + torch.from_numpy(n)[:, None]
    return token_exponentials_torch(seed[:, None], offset[:, None], V, stream).double().numpy()


def verify_reference(logits, drafts, proposals, temperature, seed, offset, block: bool,
                     top_k=None, top_p=None, min_p=None):
    """The op's result for a batch. logits [B, K+1, V] (any float dtype; unfiltered), drafts [B, K],
    proposals [B, K, V] (the requests' rows, not slots), temperature, seed, offset [B], and the filters'
    top_k, top_p, min_p [B] (or None) -> emitted [B, K+1] int64, n [B] int64, margin [B] float64."""
    B, K1, V = logits.shape
    seed, offset = seed.cpu(), offset.cpu()
    u = acceptance_uniforms(seed, offset, K1 - 1)
    x, q = logits.cpu().double().numpy(), proposals.cpu().double().numpy()
    d, T = drafts.cpu().numpy(), temperature.cpu().double().numpy()
    emitted, n, margin = np.zeros((B, K1), dtype=np.int64), np.zeros(B, dtype=np.int64), np.zeros(B)
    greedy = T == 0
    sampled = torch.from_numpy(~greedy)
    filters = (None,) * 3 if top_k is None else tuple(f.cpu().double().numpy()[~greedy] for f in (top_k, top_p, min_p))
    exponentials = lambda at: race_exponentials(seed[sampled], offset[sampled], V, at)  # noqa: E731
    for rows, result in ((greedy, greedy_rows(x[greedy], d[greedy])),
                         (~greedy, sampled_rows(x[~greedy], d[~greedy], q[~greedy], T[~greedy], u[~greedy],
                                                exponentials, block, filters))):
        emitted[rows], n[rows], margin[rows] = result
    return torch.from_numpy(emitted), torch.from_numpy(n), torch.from_numpy(margin)


# ---------------------------------------------------------------- inputs for the tests

@dataclass
class Requests:
    """A batch of verifier inputs: what the op takes (draft_probs at slots) and the per-request rows."""
    logits: torch.Tensor  # [B, K+1, V], unfiltered
    drafts: torch.Tensor  # [B, K] int64
    proposals: torch.Tensor  # [B, K, V] float32, the rows of the requests
    temperature: torch.Tensor  # [B] float32, 0 = greedy
    seed: torch.Tensor  # [B] int64
    offset: torch.Tensor  # [B] int64
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off
    min_p: torch.Tensor  # [B] float32, 0 = off
    slots: torch.Tensor  # [B] int64, each request's slot in draft_probs
    draft_probs: torch.Tensor  # [B + 3, K, V] float32

    def op_args(self, logits: torch.Tensor | None = None) -> tuple:
        """The op's arguments (but `block`), with `logits` (filtered) in place of the unfiltered ones."""
        return (self.logits if logits is None else logits, self.drafts, self.draft_probs, self.slots,
                self.temperature, self.seed, self.offset)

    def reference(self, block: bool, filters: bool):
        """verify_reference of these requests -> emitted, n, margin."""
        extra = (self.top_k, self.top_p, self.min_p) if filters else ()
        return verify_reference(self.logits, self.drafts, self.proposals, self.temperature, self.seed,
                                self.offset, block, *extra)

    def to(self, device) -> Requests:
        return Requests(**{name: t.to(device) for name, t in self.__dict__.items()})


def random_requests(B: int, K: int, V: int, seed: int, dtype=torch.float32, filters: bool = False) -> Requests:
    """Requests that reach every accepted count: a sixth greedy (their drafts the argmax chain for a
    random number of positions, then another token), the others at T in [0.5, 1.5] with proposals
    q = softmax((logits + sigma noise) / T), sigma log-uniform in [0.05, 3] (drafts near the target
    and far from it), a quarter of them with q = 0 at random tokens (where p > 0), drafts drawn from
    q. `filters`: each of top-k, top-p and min-p on for half the sampled requests."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    if dtype == torch.bfloat16:  # distinct multiples of 1/16 in [-4, 4), exact in bfloat16: tied logits
        logits = torch.rand(B, K + 1, 128, generator=g).argsort(-1)[..., :V] / 16 - 4  # make top-p's cut ambiguous
    temperature = torch.rand(B, generator=g) + 0.5
    temperature[torch.rand(B, generator=g) < 1 / 6] = 0.0
    greedy = temperature == 0
    sigma = torch.exp(torch.empty(B, 1, 1).uniform_(-3.0, 1.1, generator=g))
    scale = torch.where(greedy, 1.0, temperature).view(B, 1, 1)
    q = torch.softmax((logits[:, :K] + sigma * torch.randn(B, K, V, generator=g)) / scale, -1)
    holes = (torch.rand(B, 1, 1, generator=g) < 0.25) & (torch.rand(B, K, V, generator=g) < 0.3)
    holes &= q < q.amax(-1, keepdim=True)  # every row keeps its most likely token
    q = q.masked_fill(holes, 0.0)
    q = q / q.sum(-1, keepdim=True)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, K)
    argmax = logits.to(dtype).float().argmax(-1)[:, :K]
    agree = torch.randint(0, K + 1, (B, 1), generator=g)
    other = (argmax + torch.randint(1, max(V, 2), (B, K), generator=g)) % V
    chain = torch.where(torch.arange(K) < agree, argmax, other)
    drafts = torch.where(greedy[:, None], chain, drafts)
    on = [(torch.rand(B, generator=g) < 0.5) & filters & ~greedy for _ in range(3)]
    top_k = torch.where(on[0], torch.randint(1, V + 1, (B,), generator=g), 0)
    top_p = torch.where(on[1], 0.5 + 0.5 * torch.rand(B, generator=g), 1.0)
    min_p = torch.where(on[2], 0.3 * torch.rand(B, generator=g), 0.0)
    slots = torch.randperm(B + 3, generator=g)[:B]
    draft_probs = torch.rand(B + 3, K, V, generator=g)  # slots no request uses hold garbage
    draft_probs[slots] = q
    seeds = torch.randint(-2**63, 2**63 - 1, (B,), generator=g)
    offsets = torch.randint(0, 2**40, (B,), generator=g)
    return Requests(logits.to(dtype), drafts, q, temperature, seeds, offsets, top_k, top_p, min_p, slots,
                    draft_probs)


# ---------------------------------------------------------------- the reference's law, exactly

def pieces(limits: np.ndarray):
    """For thresholds [S, K]: each combination of the pieces [0, c) and [c, 1] of the K uniforms
    (c the threshold clipped to [0, 1]) -> (the pieces' midpoints [S, K], the product of their
    lengths [S]). The reference's decisions are constant on each piece."""
    c = np.clip(limits, 0.0, 1.0)
    for upper in itertools.product((False, True), repeat=limits.shape[1]):
        upper = np.array(upper)
        yield np.where(upper, (1 + c) / 2, c / 2), np.where(upper, 1 - c, c).prod(1)


def continuations(P: np.ndarray, K: int) -> list[np.ndarray]:
    """c[j] [V]*(j+1): the law of j target tokens after each token y, c[j][y, z_1 .. z_j]."""
    c = [np.ones(P.shape[0])]
    for _ in range(K):
        c.append(np.einsum("yz,z...->yz...", P, c[-1]))
    return c


def reference_law(P, Q, x0: int, K: int, block: bool, terms=residual_terms, draw=None) -> np.ndarray:
    """The joint law [V]*(K+1) of the first K+1 tokens after x0 when the drafts come from the bigram
    `draw` (default Q), the reference verifies them against the bigram target P and the bigram
    proposal Q (with the residual `terms`), and the target continues after the emitted tokens;
    and the law [K+1] of the accepted count. The uniforms are integrated exactly (`pieces`)."""
    V = P.shape[0]
    draw = Q if draw is None else draw
    drafts = np.array(list(itertools.product(range(V), repeat=K)), dtype=np.int64).reshape(-1, K)
    prev = np.concatenate([np.full((len(drafts), 1), x0), drafts], 1)  # [S, K+1]: every draft sequence
    p, q = P[prev], Q[prev[:, :K]]  # [S, K+1, V], [S, K, V]
    chance = draw[prev[:, :K], drafts].prod(1)  # [S]
    limits = thresholds(p, q, drafts, block)
    after = continuations(P, K)
    law, counts = np.zeros((V,) * (K + 1)), np.zeros(K + 1)
    for uniforms, length in pieces(limits):
        n = accepted(limits, uniforms, block)
        w = next_token_weights(p, q, drafts, n, block, terms)
        w = w / w.sum(-1, keepdims=True)
        mass = chance * length
        np.add.at(counts, n, mass)
        for s in np.flatnonzero(mass > 0):
            law[tuple(drafts[s, :n[s]])] += mass[s] * np.einsum("y,y...->y...", w[s], after[K - n[s]])
    return law, counts


def rho_dropped(p, q, drafts, n, block):
    """The block residual without rho_tau: max(p_tau - q_tau, 0)."""
    return residual_terms(p, q, drafts, n, False)


def residual_from_p(p, q, drafts, n, block):
    """The correction drawn from p_n where the residual is due (the bonus's rule at a rejection)."""
    return residual_terms(p, np.zeros_like(q), drafts, n, block)


def residual_at_bonus(p, q, drafts, n, block):
    """A residual taken at the bonus position too, against the last proposal: max(p_K - q_{K-1}, 0)."""
    difference, size = residual_terms(p, q, drafts, n, block)
    B, K = drafts.shape
    bonus = (n == K)[:, None]
    return (np.where(bonus, p[:, K] - q[:, K - 1], difference),
            np.where(bonus, p[:, K] + q[:, K - 1], size))


def residual_on_q_support(p, q, drafts, n, block):
    """The residual restricted to the tokens the proposal can draw (q > 0): the tokens the drafter
    never proposes are never corrected to (a residual normalised over q's support)."""
    difference, size = residual_terms(p, q, drafts, n, block)
    q_row = np.concatenate([q, np.zeros_like(p[:, :1])], 1)[np.arange(len(n)), n]
    return np.where(q_row > 0, difference, -size), size


BROKEN_RESIDUALS = {"rho dropped": rho_dropped, "residual from p": residual_from_p,
                    "residual at the bonus": residual_at_bonus, "residual on q's support": residual_on_q_support}
