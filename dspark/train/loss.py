"""DeepSpec's loss for a batch of blocks (dspark_loss: 0.1 CE + 0.9 TV + 1.0 BCE(confidence), position
k weighted by exp(-k / gamma), gamma 4; DeepSpec's own 0.9 weighs the L1 distance, 2 TV, so its TV
term weighs twice this one against the CE) and the teacher-forced acceptance estimates that come
with it (Stats).

Reach. Along a response sampled from the target at T = 1, standard verification of the drafts
x_1 .. x_{k-1} (drawn from q, accepted with min(1, p / q)) reaches slot k with the chance that it
would have drawn and accepted the response's own tokens there, relative to the target drawing them:

    reach_k = prod_{j<k} min(1, q_j(x_j) / p_j(x_j))        (reach_1 = 1)

so E[sum_k reach_k (1 - TV_k)] over such responses is the expected number of accepted drafts, the
decoder's AL less the bonus token: teacher forcing with the target's tokens weighs every prefix as
the target draws it, verification as the drafter's drafts survive. `--reach-weights` multiplies
each slot's weight by its reach (detached), divided by the batch's mean reach at its position, so
the position weights stay exp(-k / gamma) on average and, within a position, the prefixes a decode
walks weigh more. It trains worse at both temperatures (docs/training.md, the recipes tried): off
by default."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import dspark.ops.distill_loss  # noqa: F401  (registers torch.ops.dspark.distill_loss)
from dspark.config import DrafterConfig
from dspark.drafter import DSparkDrafter
from dspark.target import TargetModel
from dspark.train.batches import Batch
from dspark.train.recipe import TrainConfig


@dataclass
class Stats:
    """Sums over steps, per position over the valid slots: for the progress display and the log.
    The sums stay on the loss's device: summary() reads them (the one wait for the device), so
    steps in between never wait and the host prepares the next batch while the device computes."""
    loss: torch.Tensor | float = 0.0  # sum of the steps' losses
    accept: torch.Tensor | float = 0.0  # [K] sum of 1 - TV (T = 1 acceptance)
    survive: torch.Tensor | float = 0.0  # [K] sum of prod_{i<=k} (1 - TV_i)
    agree: torch.Tensor | float = 0.0  # [K] slots whose argmax is the target's (T = 0 acceptance)
    agree_survive: torch.Tensor | float = 0.0  # [K] slots agreeing at every position up to k
    reached: torch.Tensor | float = 0.0  # [K] sum of reach_k (1 - TV_k) (standard verification along the text)
    count: torch.Tensor | float = 0.0  # [K] valid slots
    steps: int = 0

    def __add__(self, other: Stats) -> Stats:
        return Stats(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))

    def summary(self) -> dict:
        # [5, K]
        sums = torch.stack([self.accept, self.survive, self.agree, self.agree_survive, self.reached]).cpu()
        count = torch.as_tensor(self.count).cpu().clamp_min(1)
        accept, survive, agree, agree_survive, reached = sums / count
        return {"loss": float(self.loss) / self.steps, "acceptance": accept.tolist(),
                "al_estimate": 1 + survive.sum().item(), "greedy_agreement": agree.tolist(),
                "al_greedy_estimate": 1 + agree_survive.sum().item(),
                "al_reach_estimate": 1 + reached.sum().item()}


def block_views(batch: Batch, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per slot of every block: the label x_{p+k+1}, the token before it x_{p+k} (teacher forcing)
    and the position p+k, where the target's logits give the slot's distribution -> each [B, N, K]."""
    length = batch.tokens.shape[1]
    at = (batch.anchors[..., None] + torch.arange(block_size, device=batch.anchors.device)).clamp_max(length - 1)
    flat = at.flatten(1)  # [B, N*K]
    prev = batch.tokens.gather(1, flat).view_as(at)
    labels = batch.tokens.gather(1, (flat + 1).clamp_max(length - 1)).view_as(at)
    return labels, prev, at


def slot_losses(logits: torch.Tensor, bias: torch.Tensor | None, confidence: torch.Tensor | None,
                labels: torch.Tensor, target_logits: torch.Tensor, ce_weight: float, tv_weight: float,
                confidence_weight: float, argmax_weight: float = 0.0, kl_weight: float = 0.0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSpec's loss of every slot, unweighted: ce_weight CE + tv_weight TV + confidence_weight
    BCE(confidence, 1 - TV), plus argmax_weight CE against the target's argmax and kl_weight
    KL(target || draft); the acceptance estimate 1 - TV (T = 1) and the argmax agreement (T = 0).
    The terms over the vocabulary are dspark::distill_loss (one Triton kernel on CUDA, with their
    gradient); a function of tensors, so that torch.compile takes it whole (alone with --compile
    loss, inside dspark_loss with the GPU's default, all).

    logits, bias: [B, N, K, V] (the drafter's base logits and the Markov bias, or None);
    confidence: [B, N, K] logits or None; labels: [B, N, K]; target_logits: [B, N, K, V] (the target's
    logits at each slot's position)
    -> terms, accept, agree, log q(label) - log p(label) [B, N, K] float32
    """
    vocab = logits.shape[-1]
    terms, tv, agree, log_ratio, _ = torch.ops.dspark.distill_loss(
        logits.reshape(-1, vocab), None if bias is None else bias.reshape(-1, vocab),
        target_logits.reshape(-1, vocab), labels.reshape(-1), ce_weight, tv_weight, argmax_weight, kl_weight)
    terms, tv, agree, log_ratio = (t.view(labels.shape) for t in (terms, tv, agree, log_ratio))
    accept = (1 - tv).clamp_min(0.0)  # TV can exceed 1 by a rounding error
    if confidence is not None:
        terms = terms + confidence_weight * F.binary_cross_entropy_with_logits(
            confidence.float(), accept, reduction="none")
    return terms, accept, agree, log_ratio


def reach(log_ratio: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """reach_k = prod_{j<k} min(1, q_j(x_j) / p_j(x_j)) of every slot (the module's docstring), from
    log_ratio = log q(label) - log p(label) and valid, both [B, N, K] -> [B, N, K] float32."""
    log_accept = torch.where(valid, log_ratio.clamp(-80.0, 0.0), 0.0)  # -80: exp gives 0, and no -inf - -inf
    before = torch.cat([torch.zeros_like(log_accept[..., :1]), log_accept[..., :-1]], dim=-1)
    return before.cumsum(-1).exp()


def dspark_loss(drafter: DSparkDrafter, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                valid: torch.Tensor, labels: torch.Tensor, prev: torch.Tensor, target_logits: torch.Tensor,
                config: TrainConfig, losses: Callable = slot_losses
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSpec's loss for one drafter: CE + TV + confidence BCE (+ the argmax and KL terms, see
    slot_losses) over the valid slots, position k weighted by exp(-k / decay_gamma) (and with
    `config.reach_weights` by the slot's reach, see the module's docstring). `losses` is
    slot_losses or a compiled copy of it. A function of tensors without host syncs, so the whole of
    it compiles too (see COMPILE_MODES).

    features: [B, S, m * hidden]; tokens: [B, S]; anchors: [B, N]; valid, labels, prev: [B, N, K];
    target_logits: [B, N, K, V] at the slots -> loss (scalar), acceptance estimate 1 - TV, argmax
    agreement and reach [B, N, K]
    """
    base, hidden = drafter.forward_train(features, tokens, anchors)  # [B, N, K, V], [B, N, K, d]
    head = drafter.markov_head
    bias = drafter.teacher_forced_bias(prev, hidden)
    confidence = None
    if drafter.confidence_head is not None:
        prev_embedding = head.markov_w1(prev) if head is not None and drafter.confidence_head.markov_rank else None
        confidence = drafter.confidence(hidden, prev_embedding)
    terms, accept, agree, log_ratio = losses(base, bias, confidence, labels, target_logits, config.ce_weight,
                                             config.tv_weight, config.confidence_weight, config.argmax_weight,
                                             config.kl_weight)
    reached = reach(log_ratio, valid)
    weights = slot_weights(reached, valid, config)
    return (weights * terms).sum() / weights.sum().clamp_min(1e-6), accept, agree, reached


def slot_weights(reached: torch.Tensor, valid: torch.Tensor, config: TrainConfig) -> torch.Tensor:
    """Each valid slot's weight in the loss: exp(-k / decay_gamma) at position k (from 0), and with
    `config.reach_weights` times its reach over its position's mean reach in the batch.
    reached, valid: [B, N, K] -> [B, N, K] float32 (0 on invalid slots)"""
    decay = torch.exp(-torch.arange(valid.shape[-1], device=valid.device) / config.decay_gamma)
    weights = decay * valid
    if config.reach_weights:
        mean_reach = (reached * valid).sum((0, 1)) / valid.sum((0, 1)).clamp_min(1)  # [K]
        weights = weights * reached / mean_reach.clamp_min(1e-6)
    return weights


def step_stats(loss: torch.Tensor, accept: torch.Tensor, agree: torch.Tensor, reached: torch.Tensor,
               valid: torch.Tensor) -> Stats:
    """One step's Stats from its loss, acceptance estimates, argmax agreements and reach [B, N, K]
    over the valid slots [B, N, K], on their device (nothing waits for it)."""
    per_slot = [accept, accept.cumprod(-1), agree, agree.cumprod(-1), reached * accept, valid.float()]
    sums = torch.stack([t * valid for t in per_slot]).sum((1, 2))  # [6, K]
    return Stats(loss.detach().float(), *sums, steps=1)


def target_slots(target: TargetModel, tokens: torch.Tensor, at: torch.Tensor,
                 config: DrafterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's plain causal forward over the batch: its logits at the slots' positions (in the
    target's dtype, as its product gives them; the loss computes in float32) and the drafter's
    context features (the outputs of `config.target_layer_ids`; read from the config, not passed as
    ints, so that a compiled copy keeps them constants rather than symbolic).
    tokens: [B, S]; at: [B, N, K] -> [B, N, K, V], [B, S, m * hidden]"""
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    logits, features = target(tokens, positions, hidden_layer_ids=config.target_layer_ids,
                              logits_at=at.flatten(1), logits_dtype=target.embed_tokens.weight.dtype)
    return logits.view(*at.shape, -1), features
