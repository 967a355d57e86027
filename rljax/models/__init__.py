"""Llama / Qwen2-family policy model in Flax NNX, with a pure functional API.

Build and split::

    from rljax import models, sharding
    config = models.get_config("tiny")                  # or a preset / load_hf_checkpoint
    mesh = sharding.make_mesh("dp2,tp2,sp2")
    graphdef, params = models.init_params(config, seed=0, mesh=mesh)   # sharded at birth
    # or: model = models.create_model(config); graphdef, params = models.split(model)
    # or: config, params = models.load_hf_checkpoint(path, mesh=mesh)
    #     graphdef = models.abstract_params(config)[0]

``params`` is a plain nested dict of arrays, ready for ``jax.grad``, optax and orbax. The
layers are stacked on a leading axis and run under ``jax.lax.scan``:
``params["layers"]["attn"]["q_proj"]`` is ``[L, H, N, D]`` (layer ``i`` is ``[i]``).
``graphdef`` is a leafless pytree: pass it to ``jax.jit`` as an ordinary argument or close
over it; ``mesh`` must be static (close over it or use ``static_argnames="mesh"``).
``param_shardings(config, mesh)`` gives the params' ``NamedSharding`` tree and
``param_logical_axes(config)`` the logical axis names behind it.

Training / scoring (pure, jit-able)::

    hidden = models.forward(graphdef, params, tokens, positions=None, mask=None, mesh=mesh)
    # tokens [B,T] int, mask [B,T] bool (True on real tokens, either padding side),
    # positions [B,T] (default cumsum(mask)-1). hidden [B,T,H] after the final norm.
    unembed = models.unembedding(params)              # [H,V] (embedding.T when tied)
    logits = models.compute_logits(params, hidden)    # [B,T,V] float32, when you need them
    # a Gemma 2 model caps its logits: compute_logits(..., softcap=models.logit_softcap(graphdef))

Attention is causal by token index, never attends to padding, runs blockwise
(flash-style, custom VJP, no ``[T,T]`` scores) past ``config.attn_block_size`` keys, and
with ``sp > 1`` runs sequence-parallel in ``jax.shard_map`` (keys/values all-gathered
over ``sp``). Passing ``mesh`` only adds sharding constraints and the SP shard_map: the
numbers equal the single-device ones (tested to 1e-5 relative on five meshes).

KV-cached decoding (for the sampler / JetStream engine)::

    cache = models.init_kv_cache(config, num_slots=S, max_len=M, mesh=mesh)
    # KVCache(k, v), each [L, S, M, K, D], logical axes sharding.KV_CACHE_AXES
    # (slots on dp, kv heads on tp); models.kv_cache_shardings(cache, mesh).
    hidden, kv = models.prefill(graphdef, params, prompt_tokens, mask=prompt_mask)
    # prompts RIGHT-padded [B,P]: real tokens at 0..len-1; kv is KVCache [L,B,P,K,D]
    cache = models.insert_kv(cache, kv, slots)        # slots [B] int: rows 0..P-1 of each slot
    first = argmax(compute_logits(params, hidden[b, len_b - 1]))
    hidden, cache = models.decode(graphdef, params, cache, tokens, cache_index=lengths)
    # tokens [S] (or [S,Tn]); lengths [S] = tokens already in each slot, different per
    # slot; the new token is written at cache index lengths[s] and attends to 0..lengths[s].
    # positions default to lengths; returns hidden [S,H] (or [S,Tn,H]).

Entries past a slot's length are never read, so stale data from a previous occupant or
from prompt padding is harmless; writes at or past ``M`` are dropped (keep
``lengths + Tn <= M``). ``decode`` is jit-able with ``cache`` donated.

Sharding: the model names logical axes only; activations follow
``rljax.sharding.LOGICAL_AXIS_RULES`` (batch on ``dp``, sequence on ``sp``, heads / MLP
hidden / vocab on ``tp``), and ``param_shardings`` / ``load_hf_checkpoint`` accept
``rules=`` for the parameters. Head counts that do not divide ``tp`` are replicated.

Hugging Face checkpoints: :func:`load_hf_checkpoint` / :func:`save_hf_checkpoint` for
``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``MistralForCausalLM``,
``Gemma2ForCausalLM`` (with its attention and final-logit soft-capping) and ``Gemma3ForCausalLM``
(no torch needed). Tokenizers:
:class:`CharTokenizer` (built in) and :func:`load_tokenizer` (``tokenizer.json``).
"""

from rljax.models.config import PRESETS, ModelConfig, get_config
from rljax.models.functional import (
    KV_CACHE_LOGICAL_AXES,
    KVCache,
    abstract_params,
    compute_logits,
    create_model,
    decode,
    default_positions,
    forward,
    init_kv_cache,
    init_params,
    insert_kv,
    kv_cache_shardings,
    logit_softcap,
    merge,
    model_config,
    param_logical_axes,
    param_shardings,
    prefill,
    split,
    unembedding,
)
from rljax.models.hf import SUPPORTED_ARCHITECTURES, config_from_hf, config_to_hf, load_hf_checkpoint, save_hf_checkpoint
from rljax.models.reward_model import (
    SEQ_CLS_ARCHITECTURES,
    RewardHead,
    load_hf_reward_model,
    reward_scores,
    save_hf_reward_model,
)
from rljax.models.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer
from rljax.models.attention import (
    attention,
    blockwise_attention,
    dense_attention,
    live_decode_attention,
    slot_cache_attention,
)
from rljax.models.transformer import Transformer, sequence_parallel_attention

__all__ = [
    "SEQ_CLS_ARCHITECTURES",
    "RewardHead",
    "load_hf_reward_model",
    "reward_scores",
    "save_hf_reward_model",
    "KV_CACHE_LOGICAL_AXES",
    "PRESETS",
    "SUPPORTED_ARCHITECTURES",
    "CharTokenizer",
    "HFTokenizer",
    "KVCache",
    "ModelConfig",
    "Transformer",
    "abstract_params",
    "attention",
    "blockwise_attention",
    "compute_logits",
    "config_from_hf",
    "config_to_hf",
    "create_model",
    "decode",
    "default_positions",
    "dense_attention",
    "live_decode_attention",
    "slot_cache_attention",
    "forward",
    "get_config",
    "init_kv_cache",
    "init_params",
    "insert_kv",
    "kv_cache_shardings",
    "logit_softcap",
    "model_config",
    "load_hf_checkpoint",
    "load_tokenizer",
    "merge",
    "param_logical_axes",
    "param_shardings",
    "prefill",
    "save_hf_checkpoint",
    "sequence_parallel_attention",
    "split",
    "unembedding",
]
