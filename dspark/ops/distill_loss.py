"""dspark::distill_loss: the drafter's per-slot distillation loss over the vocabulary, with its gradient.

For each slot (a row of the drafter's logits z = base + Markov bias, and the target's logits t at the
same position), with q = softmax(z), p = softmax(t), label y and the target's argmax a:

    terms = w_ce CE + w_tv TV + w_am AM + w_kl KL
    CE = -log q_y        TV = 1/2 sum |q - p|        AM = -log q_a        KL = sum p (log p - log q)

the argmax agreement [argmax z == a] (first index of a tie, as torch.argmax) and the label's log
ratio log q_y - log p_y (the training loss's reach weights, dspark.train.loss). Its gradient
with respect to z is known in closed form (s = sign(q - p)):

    d terms / d z_j = (w_ce + w_am + w_kl) q_j - w_ce [j = y] - w_am [j = a] - w_kl p_j
                      + w_tv / 2 q_j (s_j - sum_i s_i q_i)

so the op returns it beside the terms: the backward only scales each row by its upstream gradient,
and no float32 copy of the [slots, vocabulary] logits is kept for it. On CUDA one Triton program per
row makes three passes over the row, each reading z's two parts and t in vocabulary chunks: online
softmax statistics and argmaxes (and the KL term's sum), then TV and sum_i s_i q_i, then the
gradient. Inductor's fused forward and backward of the same formulas read the row more often. On the
CPU the op runs `distill_loss_torch`, the same function in plain torch.

TV, the agreement and the log ratio carry no gradient (the loss uses 1 - TV only as a detached
confidence target, the log ratio only as a detached weight).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Vocabulary columns a program reads at a time, and its warps: the fastest of the tilings
# `python -m bench.distill_loss --tilings` compares at the training step's shapes.
CHUNK = 2048
NUM_WARPS = 4


@triton.jit
def _load_chunk(logits_ptr, bias_ptr, target_ptr, at, ok, HAS_BIAS: tl.constexpr):
    """z = logits + bias and t at `at` in float32, -inf where not `ok` (so no mass there)."""
    z = tl.load(logits_ptr + at, mask=ok, other=float("-inf")).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(bias_ptr + at, mask=ok, other=0.0).to(tl.float32)
    return z, tl.load(target_ptr + at, mask=ok, other=float("-inf")).to(tl.float32)


@triton.jit
def _chunk_probabilities(logits_ptr, bias_ptr, target_ptr, offset, idx, z_lse, t_lse, V, HAS_BIAS: tl.constexpr):
    """At columns idx of the row at `offset`: in range, q, p (0 out of range) and sign(q - p)."""
    ok = idx < V
    z, t = _load_chunk(logits_ptr, bias_ptr, target_ptr, offset + idx, ok, HAS_BIAS)
    q, p = tl.exp(z - z_lse), tl.exp(t - t_lse)
    return idx, ok, q, p, tl.where(q > p, 1.0, tl.where(q < p, -1.0, 0.0))


@triton.jit
def _distill_loss_kernel(logits_ptr, bias_ptr, target_ptr, labels_ptr, terms_ptr, tv_ptr, agree_ptr, ratio_ptr,
                         grad_ptr, ce_weight, tv_weight, argmax_weight, kl_weight,
                         V: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row; every tensor is contiguous: [M, V] logits, bias, target, grad; [M] the rest.
    # (V a compile-time constant: the interpreter cannot loop to a run-time bound.)
    row = tl.program_id(0).to(tl.int64)
    offset = row * V
    cols = tl.arange(0, BLOCK)

    # Pass 1: running max (= best value), its first index and the sum of exponentials, for z and t;
    # and sum exp(t - t_max) (t - z) for the KL term.
    z_max = tl.full((), float("-inf"), tl.float32)
    t_max = tl.full((), float("-inf"), tl.float32)
    z_sum = tl.zeros((), tl.float32)
    t_sum = tl.zeros((), tl.float32)
    cross = tl.zeros((), tl.float32)
    z_arg = tl.zeros((), tl.int32)
    t_arg = tl.zeros((), tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + cols
        ok = idx < V
        z, t = _load_chunk(logits_ptr, bias_ptr, target_ptr, offset + idx, ok, HAS_BIAS)
        chunk_z, chunk_t = tl.max(z, 0), tl.max(t, 0)
        z_arg = tl.where(chunk_z > z_max, start + tl.argmax(z, 0), z_arg)
        t_arg = tl.where(chunk_t > t_max, start + tl.argmax(t, 0), t_arg)
        new_z, new_t = tl.maximum(z_max, chunk_z), tl.maximum(t_max, chunk_t)
        # While every value so far is -inf, exponentiate against 0: -inf - -inf would be NaN.
        pivot_z = tl.where(new_z == float("-inf"), 0.0, new_z)
        pivot_t = tl.where(new_t == float("-inf"), 0.0, new_t)
        z_sum = z_sum * tl.exp(z_max - pivot_z) + tl.sum(tl.exp(z - pivot_z), 0)
        e = tl.exp(t - pivot_t)
        rescale = tl.exp(t_max - pivot_t)
        t_sum = t_sum * rescale + tl.sum(e, 0)
        cross = cross * rescale + tl.sum(e * (tl.where(ok, t, 0.0) - tl.where(ok, z, 0.0)), 0)  # no inf - inf
        z_max, t_max = new_z, new_t
    z_lse = z_max + tl.log(z_sum)
    t_lse = t_max + tl.log(t_sum)
    label = tl.load(labels_ptr + row).to(tl.int32)
    z_label = tl.load(logits_ptr + offset + label).to(tl.float32)
    z_at_t_arg = tl.load(logits_ptr + offset + t_arg).to(tl.float32)
    if HAS_BIAS:
        z_label += tl.load(bias_ptr + offset + label).to(tl.float32)
        z_at_t_arg += tl.load(bias_ptr + offset + t_arg).to(tl.float32)
    kl = cross / t_sum - t_lse + z_lse
    t_label = tl.load(target_ptr + offset + label).to(tl.float32)

    # Pass 2: TV and sum_i s_i q_i.
    distance = tl.zeros((), tl.float32)
    signed_q = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        _, _, q, p, sign = _chunk_probabilities(logits_ptr, bias_ptr, target_ptr, offset, start + cols, z_lse, t_lse,
                                                V, HAS_BIAS)
        distance += tl.sum(tl.abs(q - p), 0)
        signed_q += tl.sum(sign * q, 0)
    tv = 0.5 * distance

    # Pass 3: the gradient.
    for start in range(0, V, BLOCK):
        idx, ok, q, p, sign = _chunk_probabilities(logits_ptr, bias_ptr, target_ptr, offset, start + cols, z_lse,
                                                   t_lse, V, HAS_BIAS)
        grad = ((ce_weight + argmax_weight + kl_weight) * q - kl_weight * p
                + 0.5 * tv_weight * q * (sign - signed_q)
                - tl.where(idx == label, ce_weight, 0.0) - tl.where(idx == t_arg, argmax_weight, 0.0))
        tl.store(grad_ptr + offset + idx, grad.to(grad_ptr.dtype.element_ty), mask=ok)

    terms = (ce_weight * (z_lse - z_label) + tv_weight * tv + argmax_weight * (z_lse - z_at_t_arg)
             + kl_weight * kl)
    tl.store(terms_ptr + row, terms)
    tl.store(tv_ptr + row, tv)
    tl.store(agree_ptr + row, (z_arg == t_arg).to(tl.float32))
    tl.store(ratio_ptr + row, (z_label - z_lse) - (t_label - t_lse))


def launch_distill_loss(wrap, logits, bias, target_logits, labels, weights, terms, tv, agree, log_ratio, grad,
                        chunk: int = CHUNK, num_warps: int = NUM_WARPS):
    """Launches the kernel through `wrap` (torch.library.wrap_triton, or identity in interpreter
    tests). logits, bias (or None), target_logits, grad: contiguous [M, V]; labels: contiguous [M]
    int64; weights: (ce, tv, argmax, kl); terms, tv, agree, log_ratio: float32 [M]; chunk: a power of
    two."""
    rows, vocab = logits.shape
    wrap(_distill_loss_kernel)[(rows,)](logits, logits if bias is None else bias, target_logits, labels,
                                        terms, tv, agree, log_ratio, grad, *weights, V=vocab, HAS_BIAS=bias is not None,
                                        BLOCK=min(chunk, triton.next_power_of_2(vocab)), num_warps=num_warps)


def _log_probs(logits: torch.Tensor, bias: torch.Tensor | None, target_logits: torch.Tensor, labels: torch.Tensor):
    """z = logits + bias in float32, log q, log p and the picked tokens [M, 2]: the label and the target's
    argmax, taken of its logits as the kernel takes it (log_softmax can round near-maxima into a tie)."""
    z = logits.float() if bias is None else logits.float() + bias.float()
    t = target_logits.float()
    return z, z.log_softmax(-1), t.log_softmax(-1), torch.stack([labels, t.argmax(-1)], dim=-1)


def _terms(log_q: torch.Tensor, log_p: torch.Tensor, picks: torch.Tensor,
           weights: tuple[float, float, float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted terms [M] and TV [M] from log q, log p [M, V] and the picks [M, 2]."""
    ce_weight, tv_weight, argmax_weight, kl_weight = weights
    ce, am = (-log_q.gather(-1, picks)).unbind(-1)
    tv = 0.5 * (log_q.exp() - log_p.exp()).abs().sum(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return ce_weight * ce + tv_weight * tv + argmax_weight * am + kl_weight * kl, tv


def distill_terms(logits: torch.Tensor, bias: torch.Tensor | None, target_logits: torch.Tensor,
                  labels: torch.Tensor, ce_weight: float, tv_weight: float, argmax_weight: float,
                  kl_weight: float) -> torch.Tensor:
    """The op's terms [M] in differentiable torch: what its gradient is the derivative of (the tests'
    reference for the op's values and gradient)."""
    _, log_q, log_p, picks = _log_probs(logits, bias, target_logits, labels)
    return _terms(log_q, log_p, picks, (ce_weight, tv_weight, argmax_weight, kl_weight))[0]


def distill_loss_torch(logits: torch.Tensor, bias: torch.Tensor | None, target_logits: torch.Tensor,
                       labels: torch.Tensor, ce_weight: float, tv_weight: float, argmax_weight: float,
                       kl_weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op in plain torch (the CPU implementation); arguments and results as distill_loss's."""
    z, log_q, log_p, picks = _log_probs(logits, bias, target_logits, labels)
    terms, tv = _terms(log_q, log_p, picks, (ce_weight, tv_weight, argmax_weight, kl_weight))
    q, p = log_q.exp(), log_p.exp()
    sign = (q - p).sign()
    grad = ((ce_weight + argmax_weight + kl_weight) * q - kl_weight * p
            + 0.5 * tv_weight * q * (sign - (sign * q).sum(-1, keepdim=True)))
    grad = grad.scatter_add(-1, picks, q.new_tensor([-ce_weight, -argmax_weight]).expand(len(q), 2))
    agree = (z.argmax(-1) == picks[:, 1]).float()
    label = picks[:, :1]
    log_ratio = (log_q.gather(-1, label) - log_p.gather(-1, label)).squeeze(-1)
    return terms, tv, agree, log_ratio, grad.to(logits.dtype)


def _check(logits: torch.Tensor, bias: torch.Tensor | None, target_logits: torch.Tensor,
           labels: torch.Tensor) -> None:
    if logits.dim() != 2 or target_logits.shape != logits.shape or (bias is not None and bias.shape != logits.shape):
        raise ValueError(f"distill_loss: logits {tuple(logits.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)} and target_logits "
                         f"{tuple(target_logits.shape)} must all be [M, V]")
    if labels.shape != logits.shape[:1] or labels.dtype != torch.long:
        raise ValueError(f"distill_loss: labels must be int64 [{logits.shape[0]}], got {labels.dtype} "
                         f"{tuple(labels.shape)}")


@torch.library.triton_op("dspark::distill_loss", mutates_args=())
def distill_loss(logits: torch.Tensor, bias: torch.Tensor | None, target_logits: torch.Tensor,
                 labels: torch.Tensor, ce_weight: float, tv_weight: float, argmax_weight: float,
                 kl_weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits, bias (or None), target_logits: [M, V]; labels: [M] int64 -> terms, TV, agreement,
    log q_label - log p_label (float32 [M]) and d terms / d (logits + bias) ([M, V] in logits' dtype)."""
    _check(logits, bias, target_logits, labels)
    if logits.device.type == "cpu":
        return distill_loss_torch(logits, bias, target_logits, labels, ce_weight, tv_weight, argmax_weight,
                                  kl_weight)
    rows, device = logits.shape[0], logits.device
    terms, tv, agree, log_ratio = (torch.empty(rows, dtype=torch.float32, device=device) for _ in range(4))
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=device)
    launch_distill_loss(torch.library.wrap_triton, logits.contiguous(),
                        None if bias is None else bias.contiguous(), target_logits.contiguous(),
                        labels.contiguous(), (ce_weight, tv_weight, argmax_weight, kl_weight), terms, tv, agree,
                        log_ratio, grad)
    return terms, tv, agree, log_ratio, grad


def _setup_context(ctx, inputs, output) -> None:
    ctx.has_bias = inputs[1] is not None
    ctx.bias_dtype = None if inputs[1] is None else inputs[1].dtype
    ctx.save_for_backward(output[4])
    ctx.mark_non_differentiable(*output[1:])


def _backward(ctx, d_terms, d_tv, d_agree, d_log_ratio, d_grad):
    grad, = ctx.saved_tensors
    scaled = grad.float() * d_terms[:, None]
    d_bias = scaled.to(ctx.bias_dtype) if ctx.has_bias else None
    return scaled.to(grad.dtype), d_bias, None, None, None, None, None, None


distill_loss.register_autograd(_backward, setup_context=_setup_context)
