"""The learner's traced log-prob heads: hidden states of the response positions, the fused log-prob
and entropy of the sampled tokens, and the log-probs at given ids (``forward_kl_topk``
distillation's student at the teacher's top-k), on the padded ``[B, S+T]`` layout and on a packed
micro-batch (:mod:`rljax.trainer.packing`), always back in the padded ``[B, T]`` layout. None of
them materialises ``[tokens, vocab]`` logits (:mod:`rljax.pallas`).

Hidden state ``S - 1 + t`` predicts response token ``t``. A model with final-logit soft-capping
(Gemma 2, ``ModelConfig.final_logit_softcapping``) has its logits capped in every head here.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from rljax.models import functional as F
from rljax.pallas import fused_logprob, fused_logprob_at, fused_logprob_at_sharded, fused_logprob_sharded
from rljax.sharding import mesh_batch_axes, with_logical_constraint


def response_hidden(graphdef, params, batch: dict, *, response_len: int, mesh: Optional[Mesh] = None) -> jax.Array:
    """``[B, T, H]`` hidden states predicting the response tokens (state ``S - 1 + t`` predicts token
    ``t``) of a padded ``[B, S+T]`` batch, rows on the batch axes when ``mesh`` is given."""
    ids = batch["input_ids"]
    prompt_len = ids.shape[1] - response_len
    hidden = F.forward(graphdef, params, ids, positions=batch["positions"], mask=batch["attention_mask"], mesh=mesh)
    hidden = hidden[:, prompt_len - 1: prompt_len - 1 + response_len]
    return hidden if mesh is None else with_logical_constraint(hidden, ("batch", "length", "embed"), mesh)


def response_logprobs(graphdef, params, batch: dict, *, response_len: int, temperature: float = 1.0,
                      impl: str = "auto", mesh: Optional[Mesh] = None, at_ids: Optional[jax.Array] = None) -> tuple:
    """``(logp, entropy) [B, T]`` of the response tokens, through the fused log-prob (no ``[B,T,V]`` logits).

    A packed micro-batch (``batch["packed"]``, see :mod:`rljax.trainer.packing`) runs on
    its packed rows and is gathered back to the same ``[B, T]`` layout. With ``at_ids``
    (integer ``[B, T, K]``, e.g. the teacher's top-k ids of ``forward_kl_topk``) a third output:
    the log-probs at those ids ``[B, T, K]`` from the same hidden states
    (:func:`logprob_at`).
    """
    if "packed" in batch:
        rows = batch["packed"]
        return packed_response_logprobs(graphdef, params, rows, rows["gather"], temperature=temperature, impl=impl,
                                        mesh=mesh, at_ids=at_ids)
    hidden = response_hidden(graphdef, params, batch, response_len=response_len, mesh=mesh)
    targets = batch["input_ids"][:, -response_len:]
    unembed, cap = F.unembedding(params), F.logit_softcap(graphdef)
    if mesh is None:
        out = fused_logprob(hidden, unembed, targets, temperature=temperature, impl=impl, softcap=cap)
    else:
        out = fused_logprob_sharded(hidden, unembed, targets, mesh=mesh, batch_axes=mesh_batch_axes(mesh),
                                    temperature=temperature, impl=impl, softcap=cap)
    return out if at_ids is None else (*out, logprob_at(hidden, unembed, at_ids, temperature=temperature, mesh=mesh,
                                                        softcap=cap))


def logprob_at(hidden, unembed, ids, *, temperature: float = 1.0, mesh=None, softcap=None) -> jax.Array:
    """``[B, T, K]`` float32 log-probs of ``softmax(hidden @ unembed / temperature)`` at integer
    ``ids [B, T, K]`` (:func:`rljax.pallas.fused_logprob_at`, no ``[B, T, V]`` logits;
    tokens on the mesh's batch axes and ``sp`` when ``mesh`` is given; the logits soft-capped by
    ``softcap`` first when given)."""
    if mesh is None:
        return fused_logprob_at(hidden, unembed, ids, temperature=temperature, softcap=softcap)
    return fused_logprob_at_sharded(hidden, unembed, ids, mesh=mesh, batch_axes=mesh_batch_axes(mesh),
                                    temperature=temperature, softcap=softcap)


def packed_response_logprobs(graphdef, params, rows: dict, gather: jax.Array, *, temperature: float = 1.0,
                             impl: str = "auto", mesh=None, at_ids: Optional[jax.Array] = None) -> tuple:
    """``(logp, entropy)`` ``[Bm, T]`` of a packed micro-batch, in the padded layout.

    ``rows``: ``tokens, positions, segment_ids, targets [R, L]`` (and a shared-prefix plan's
    ``key_blocks [R, nq, J]``); ``gather [Bm, T]``: flat index into ``R*L`` of the position
    predicting each response token. With ``at_ids [Bm, T, K]`` (padded layout) a third output:
    the log-probs at those ids, from the hidden states gathered to ``[Bm, T, H]``.
    """
    seg = rows["segment_ids"]
    hidden = F.forward(graphdef, params, rows["tokens"], positions=rows["positions"], mask=seg > 0, mesh=mesh,
                       segment_ids=seg, key_blocks=rows.get("key_blocks"))
    unembed, cap = F.unembedding(params), F.logit_softcap(graphdef)
    if mesh is None:
        logp, entropy = fused_logprob(hidden, unembed, rows["targets"], temperature=temperature, impl=impl, softcap=cap)
    else:
        hidden = with_logical_constraint(hidden, ("batch", "length", "embed"), mesh)
        logp, entropy = fused_logprob_sharded(hidden, unembed, rows["targets"], mesh=mesh, temperature=temperature,
                                              batch_axes=mesh_batch_axes(mesh), impl=impl, softcap=cap)
    out = jnp.take(logp.reshape(-1), gather, axis=0), jnp.take(entropy.reshape(-1), gather, axis=0)
    if at_ids is None:
        return out
    at_hidden = jnp.take(hidden.reshape(-1, hidden.shape[-1]), gather, axis=0)  # [Bm, T, H]: the padded layout's
    if mesh is not None:
        at_hidden = with_logical_constraint(at_hidden, ("batch", "length", "embed"), mesh)
    return (*out, logprob_at(at_hidden, unembed, at_ids, temperature=temperature, mesh=mesh, softcap=cap))


__all__ = ["logprob_at", "packed_response_logprobs", "response_hidden", "response_logprobs"]
