"""DSpark's Markov heads: a low-rank bias on draft position k's logits from the token drawn before it.

Parameter names are DeepSpec's (`markov_head.markov_w1.weight` [V, r], `markov_w2.weight` [V, r],
`gate_proj.*`, `joint_proj.*`), so its checkpoints load by name. The three variants:

- vanilla: bias_k = W2 W1[x_{k-1}]
- gated:   g_k = sigmoid(gate_proj([h_k ; W1[x_{k-1}]])),  bias_k = W2 (g_k * W1[x_{k-1}])
- rnn:     gate, cand, out = joint_proj([s_{k-1} ; W1[x_{k-1}] ; h_k]),
           s_k = sigmoid(gate) s_{k-1} + (1 - sigmoid(gate)) tanh(cand),  bias_k = W2 tanh(out),
           with s_0 = 0

h_k is the drafter's final hidden state at block position k and x_{-1} the anchor. Every bias is
W2 times a rank-r vector, `low_rank`'s: drafting steps a head one position at a time through it, with
W1[x_{k-1}] already gathered (the pick op does it for the token it draws), and the step op streams
W2 itself; training runs `forward` over whole teacher-forced blocks.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from dspark.config import DrafterConfig


class VanillaMarkov(nn.Module):
    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def initial_state(self, batch_size: int) -> Tensor | None:
        return None

    def low_rank(self, prev_embedding: Tensor, hidden: Tensor | None,
                 state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """prev_embedding [..., r] = markov_w1[previous token], hidden [..., d] ->
        (v [..., r] in the weights' dtype, next state): the bias is markov_w2(v)."""
        return prev_embedding, state

    def bias(self, prev_embedding: Tensor, hidden: Tensor | None,
             state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """(bias [..., V] in the weights' dtype, next state); arguments as low_rank's."""
        v, state = self.low_rank(prev_embedding, hidden, state)
        return self.markov_w2(v), state

    def forward(self, prev_tokens: Tensor, hidden: Tensor | None) -> Tensor:
        """Teacher-forced bias of whole blocks: prev_tokens [N, K], hidden [N, K, d] -> [N, K, V]."""
        return self.markov_w2(self.block_low_rank(prev_tokens, hidden))

    def block_low_rank(self, prev_tokens: Tensor, hidden: Tensor | None) -> Tensor:
        """forward's rank-r vectors [N, K, r]: a stateless head's at every position at once."""
        return self.low_rank(self.markov_w1(prev_tokens), hidden, None)[0]


class GatedMarkov(VanillaMarkov):
    def __init__(self, vocab_size: int, rank: int, hidden_size: int):
        super().__init__(vocab_size, rank)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def low_rank(self, prev_embedding, hidden, state):
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_embedding], dim=-1)))
        return gate * prev_embedding, state


class RNNMarkov(VanillaMarkov):
    def __init__(self, vocab_size: int, rank: int, hidden_size: int):
        super().__init__(vocab_size, rank)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def initial_state(self, batch_size: int) -> Tensor:
        return self.markov_w1.weight.new_zeros(batch_size, self.rank)

    def low_rank(self, prev_embedding, hidden, state):
        gate, candidate, out = self.joint_proj(
            torch.cat([state, prev_embedding, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(candidate)
        return torch.tanh(out), state

    def block_low_rank(self, prev_tokens, hidden):
        """Unrolls the state over each block, as drafting does; W2 then applies once to all K."""
        embeddings = self.markov_w1(prev_tokens)
        state = self.initial_state(prev_tokens.shape[0])
        vectors = []
        for k in range(prev_tokens.shape[1]):
            v, state = self.low_rank(embeddings[:, k], hidden[:, k], state)
            vectors.append(v)
        return torch.stack(vectors, dim=1)


def build_markov_head(config: DrafterConfig) -> VanillaMarkov | None:
    """The head `config.markov_head_type` names, or None for markov_rank 0 (DFlash-style drafting:
    positions drawn independently)."""
    if config.markov_rank == 0:
        return None
    if config.markov_head_type == "vanilla":
        return VanillaMarkov(config.vocab_size, config.markov_rank)
    head = {"gated": GatedMarkov, "rnn": RNNMarkov}[config.markov_head_type]
    return head(config.vocab_size, config.markov_rank, config.hidden_size)
