"""The naive reference: full ``[N, V]`` float32 logits, ``log_softmax``, ordinary autodiff."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def naive(h, w, y, *, inv_temp, softcap=None):
    """(logp, entropy), float32 [N]. Holds the whole logit matrix; use it to check the others."""
    z = jnp.dot(h, w, preferred_element_type=jnp.float32)
    if softcap is not None:
        z = softcap * jnp.tanh(z / softcap)
    z = z * inv_temp
    logp_all = jax.nn.log_softmax(z, axis=-1)
    logp = jnp.take_along_axis(logp_all, y[:, None], axis=-1)[:, 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy
