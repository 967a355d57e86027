"""Discriminative reward models: Hugging Face ``LlamaForSequenceClassification`` /
``Qwen2ForSequenceClassification`` checkpoints as the rljax transformer plus a score head.

The checkpoint is the causal LM's backbone (``model.*``, no ``lm_head``) and ``score.weight``
(``[num_labels, hidden]``, no bias). :func:`reward_scores` is HF's pooling: the score head on
the final hidden state of each row's last real token (HF takes the rightmost token that is
not ``pad_token_id``; here the rightmost position of the attention mask, the same token for
rows whose padding is ``pad_token_id`` and whose attention mask marks the rest).

The backbone loads with :func:`rljax.models.hf.load_params` (sharded on a mesh if given); the
score head is small and replicated. Export writes a checkpoint ``transformers`` loads as the
same ``*ForSequenceClassification`` class.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from rljax.models import hf
from rljax.models.config import ModelConfig
from rljax.models.functional import forward

#: Sequence-classification architectures -> the causal LM whose backbone they share.
SEQ_CLS_ARCHITECTURES = {"LlamaForSequenceClassification": "LlamaForCausalLM",
                         "Qwen2ForSequenceClassification": "Qwen2ForCausalLM"}


@dataclasses.dataclass(frozen=True)
class RewardHead:
    """What a reward checkpoint has beyond its backbone's :class:`ModelConfig`."""

    architecture: str  # LlamaForSequenceClassification | Qwen2ForSequenceClassification
    num_labels: int
    tie_word_embeddings: bool  # config.json's flag (the checkpoint has no lm_head either way)
    extra: tuple = ()  # (key, value) pairs of config.json kept on export (id2label, label2id, problem_type)


def config_from_hf(cfg: dict, *, dtype=None) -> tuple[ModelConfig, RewardHead]:
    """``(backbone config, head)`` of a sequence-classification ``config.json`` dict."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SEQ_CLS_ARCHITECTURES:
        raise ValueError(f"unsupported reward model architecture {arch!r}; supported: "
                         f"{', '.join(SEQ_CLS_ARCHITECTURES)}")
    # The backbone has no unembedding: read it as tied (no lm_head parameter).
    config = hf.config_from_hf(dict(cfg, architectures=[SEQ_CLS_ARCHITECTURES[arch]], tie_word_embeddings=True),
                               dtype=dtype)
    num_labels = int(cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2)
    extra = tuple((k, cfg[k]) for k in ("id2label", "label2id", "problem_type") if k in cfg)
    return config, RewardHead(arch, num_labels, bool(cfg.get("tie_word_embeddings", False)), extra)


def config_to_hf(config: ModelConfig, head: RewardHead) -> dict:
    out = hf.config_to_hf(config)
    out.update(architectures=[head.architecture], tie_word_embeddings=head.tie_word_embeddings,
               num_labels=head.num_labels, **dict(head.extra))
    if "id2label" not in out:
        out["id2label"] = {str(i): f"LABEL_{i}" for i in range(head.num_labels)}
        out["label2id"] = {f"LABEL_{i}": i for i in range(head.num_labels)}
    return out


def load_hf_reward_model(path: str, *, dtype=None, mesh: Mesh | None = None,
                         rules=None) -> tuple[ModelConfig, RewardHead, dict, jax.Array]:
    """``(config, head, params, score)`` of a local sequence-classification checkpoint:
    ``params`` the backbone (the graphdef is ``rljax.models.abstract_params(config)[0]``),
    ``score`` the head ``[hidden, num_labels]`` (float32, replicated on ``mesh``)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"{path} is not a Hugging Face checkpoint directory: config.json is missing")
    with open(cfg_path) as f:
        config, head = config_from_hf(json.load(f), dtype=dtype)
    tensors = hf.open_tensors(path)
    if "score.weight" not in tensors:
        raise ValueError(f"reward model checkpoint {path} has no score.weight tensor ({head.architecture})")
    w = np.asarray(tensors["score.weight"], np.float32)
    if w.shape != (head.num_labels, config.hidden_size):
        raise ValueError(f"score.weight in {path} has shape {w.shape}; config.json says "
                         f"({head.num_labels}, {config.hidden_size})")
    params = hf.load_params(path, config, tensors, mesh=mesh, rules=rules)
    sharding = NamedSharding(mesh, PartitionSpec()) if mesh is not None else SingleDeviceSharding(jax.devices()[0])
    return config, head, params, jax.device_put(np.ascontiguousarray(w.T), sharding)


def save_hf_reward_model(path: str, config: ModelConfig, head: RewardHead, params: dict, score) -> None:
    """Writes a checkpoint ``transformers`` loads as ``head.architecture``. Multi-host: every
    process calls it; process 0 writes."""
    tensors = hf.hf_tensors(config, params)
    tensors["score.weight"] = np.ascontiguousarray(np.asarray(jax.device_get(score)).T.astype(
        tensors["model.norm.weight"].dtype))
    hf.write_checkpoint(path, config_to_hf(config, head), tensors)


def reward_scores(graphdef, params: dict, score: jax.Array, tokens, *, mask, positions=None,
                  mesh: Mesh | None = None) -> jax.Array:
    """``[B, num_labels]`` float32: the score head on each row's last real token's final hidden state.

    Args:
      tokens: ``[B, L]`` int32 prompt + response.
      mask: ``[B, L]`` bool attention mask (left or right padding; a row needs one real token).
      positions: ``[B, L]`` (default: the mask's running count).
    """
    hidden = forward(graphdef, params, tokens, positions=positions, mask=mask, mesh=mesh)
    mask = jnp.asarray(mask)
    last = mask.shape[1] - 1 - jnp.argmax(mask[:, ::-1], axis=1)  # the rightmost real position
    pooled = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    return pooled.astype(jnp.float32) @ score.astype(jnp.float32)
