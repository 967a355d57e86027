r"""Rollout/learner mismatch: how far the sampler's token probabilities are from the learner's.

The sampler records :math:`\log\pi_{rollout}` of every token it draws; the learner recomputes
:math:`\log\pi_{old}` of the same tokens before its update. With the same weights, inputs and
model functions the two differ only by floating-point reduction order (KV-cache decode vs. a
full forward, the sampler's log-softmax vs. the fused log-prob kernel); a stale weight
version, a weight sync that did not land, a lower-precision sampler or another engine shows
up here first. verl reports the same statistics (``verl/utils/debug/metrics.py``):

* ``probs_diff_{max,mean,std}``: of :math:`|\exp\log\pi_{old} - \exp\log\pi_{rollout}|` over the
  masked tokens; ``std`` is the unbiased (``n - 1``) standard deviation, as ``torch.std``, 0
  for fewer than two tokens.
* ``logprobs_diff_{max,mean,std}``: the same of :math:`|\log\pi_{old} - \log\pi_{rollout}|`.
* ``pearson_corr``: Pearson's correlation of the two probabilities over the masked tokens
  (``torch.corrcoef``); NaN when either side has zero variance, as torch's.
* ``tokens``: how many tokens the statistics are over.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp


def _stats(x: jax.Array, valid: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    mean = jnp.sum(jnp.where(valid, x, 0.0)) / jnp.maximum(n, 1.0)
    var = jnp.sum(jnp.where(valid, jnp.square(x - mean), 0.0)) / jnp.maximum(n - 1.0, 1.0)
    biggest = jnp.max(jnp.where(valid, x, -jnp.inf))
    return jnp.where(n > 0, biggest, 0.0), mean, jnp.where(n > 1, jnp.sqrt(var), 0.0)


def rollout_mismatch(old_logp: chex.Array, rollout_logp: chex.Array, mask: chex.Array) -> dict[str, jax.Array]:
    """Statistics of the sampler/learner difference over the masked (response) tokens.

    Args:
      old_logp: ``[B, T]`` learner log-probs of the sampled tokens (before the update).
      rollout_logp: ``[B, T]`` the sampler's log-probs of the same tokens.
      mask: ``[B, T]`` the tokens to compare (the loss mask: generated tokens of real rows).

    Returns:
      float32 scalars ``probs_diff_{max,mean,std}``, ``logprobs_diff_{max,mean,std}``,
      ``pearson_corr`` and ``tokens`` (see the module docstring); the differences are 0 when no
      token is masked in.
    """
    chex.assert_rank([old_logp, rollout_logp, mask], 2)
    chex.assert_equal_shape([old_logp, rollout_logp, mask])
    valid = jnp.asarray(mask).astype(bool)
    old = jnp.where(valid, old_logp, 0.0).astype(jnp.float32)
    rollout = jnp.where(valid, rollout_logp, 0.0).astype(jnp.float32)
    n = jnp.sum(valid).astype(jnp.float32)
    p_old, p_rollout = jnp.exp(old), jnp.exp(rollout)
    out = {}
    for name, x in (("probs_diff", jnp.abs(p_old - p_rollout)), ("logprobs_diff", jnp.abs(old - rollout))):
        out[f"{name}_max"], out[f"{name}_mean"], out[f"{name}_std"] = _stats(x, valid, n)
    m_old = jnp.sum(jnp.where(valid, p_old, 0.0)) / jnp.maximum(n, 1.0)
    m_rollout = jnp.sum(jnp.where(valid, p_rollout, 0.0)) / jnp.maximum(n, 1.0)
    d_old = jnp.where(valid, p_old - m_old, 0.0)
    d_rollout = jnp.where(valid, p_rollout - m_rollout, 0.0)
    out["pearson_corr"] = jnp.sum(d_old * d_rollout) / jnp.sqrt(jnp.sum(d_old**2) * jnp.sum(d_rollout**2))
    out["tokens"] = n
    return out
