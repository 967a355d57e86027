"""Model FLOPs of the learner and the sampler, for MFU (model FLOPs utilisation).

Convention (PaLM, Chowdhery et al. 2022, appendix B): a matmul with ``N`` weights costs
``2N`` FLOPs per token forward and ``4N`` backward, so training costs ``6N`` per token;
attention adds, per token of a sequence of length ``T``, ``2 * 2 * L * n_heads * head_dim
* T`` forward (scores and the weighted sum), ``x3`` with the backward: ``12 L H Q T``. The
causal mask is not discounted (as in PaLM), and rematerialisation is not counted (model
FLOPs, not hardware FLOPs). ``N`` counts the weights of every matmul: all layer
projections and the unembedding, not the embedding lookup (a gather); with tied
embeddings the one matrix is the unembedding.

With real lengths the attention term uses each sequence's own length, so a batch of
sequences of lengths ``T_i`` costs ``6 N sum(T_i) + 12 L H Q sum(T_i^2)``; packing and
padding do not change the model FLOPs of a batch, only the time it takes.

Decoding a response of ``r`` tokens after a prompt of ``p``: prefill ``2 N p + 4 L H Q p^2``
and each generated token ``2 N + 4 L H Q c`` at context length ``c``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rljax.models.config import ModelConfig


def matmul_params(config: ModelConfig) -> int:
    """``N``: weights that take part in a matmul per token (every parameter except the
    embedding table when it is not also the unembedding; norms are counted, negligibly)."""
    n = config.num_params()
    return n if config.tie_embeddings else n - config.vocab_size * config.hidden_size


def _attn(config: ModelConfig) -> int:
    return config.num_layers * config.num_heads * config.head_dim


def train_flops(config: ModelConfig, lengths: Sequence[int]) -> float:
    """Forward + backward FLOPs of sequences of real ``lengths``: ``6 N sum(T) + 12 L H Q sum(T^2)``."""
    t = np.asarray(lengths, np.float64)
    return float(6 * matmul_params(config) * t.sum() + 12 * _attn(config) * np.square(t).sum())


def forward_flops(config: ModelConfig, lengths: Sequence[int]) -> float:
    """Forward-only FLOPs (log-prob passes): a third of :func:`train_flops`."""
    return train_flops(config, lengths) / 3


def rollout_flops(config: ModelConfig, prompt_lengths: Sequence[int], response_lengths: Sequence[int]) -> float:
    """Prefill + decode FLOPs of generating ``response_lengths`` tokens after ``prompt_lengths``."""
    p = np.asarray(prompt_lengths, np.float64)
    r = np.asarray(response_lengths, np.float64)
    n, a = matmul_params(config), _attn(config)
    prefill = 2 * n * p.sum() + 4 * a * np.square(p).sum()
    # contexts p, p+1, ..., p+r-1: sum = r p + r (r - 1) / 2
    decode = 2 * n * r.sum() + 4 * a * (r * p + r * (r - 1) / 2).sum()
    return float(prefill + decode)
