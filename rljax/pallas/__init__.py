"""Fused per-token log-prob + entropy over a large vocabulary, without ``[N, V]`` logits.

``fused_logprob(hidden, unembed, targets, temperature=..., impl=...)`` returns float32
``(logp, entropy)`` for ``z = hidden @ unembed / temperature``. Three paths give the same
numbers (tested against each other):

* ``"naive"``: full float32 logits and ``log_softmax``; the reference. Memory O(N V).
* ``"chunked"``: ``lax`` loops over ``[block_t, block_v]`` logit tiles with running
  max / sum-exp / target-logit / entropy statistics and a ``custom_vjp`` that recomputes
  the tiles in the backward. Memory O(block_t block_v). Default on CPU and GPU.
* ``"pallas"``: the same algorithm as Pallas kernels, those of the backend it runs on:
  ``"pallas_tpu"`` (Mosaic; the default on TPU) or ``"pallas_gpu"`` (Triton). Either can be
  named explicitly; off its own backend a kernel runs in interpret mode (correct, slow: for
  tests only), and ``"pallas"`` on CPU interprets the TPU kernel. ``"auto"`` stays chunked on
  GPUs until a measurement there shows the kernel faster (bench/accelerator.py).

Precision: the logit matmul takes operands in the input dtype with float32 accumulation
(exact products for bfloat16); softmax statistics and the logit cotangent ``dz`` are float32.
The backward matmuls multiply the float32 ``dz`` with the input-dtype operand: naive and
chunked do it as XLA's autodiff does (float32 ``dz``, the other operand upcast); the Pallas
kernels use full fp32 contraction for float32 inputs (IEEE on GPUs, never TF32) and, for
bfloat16 inputs, split ``dz`` into hi + lo bfloat16 halves (two MXU / tensor-core passes, ~16
mantissa bits) instead of rounding it. The kernels pin these precisions, so a global
``jax_default_matmul_precision`` (``model.matmul_precision``) does not change them.
Gradients are returned in the dtype of ``hidden`` / ``unembed``.

Soft-capping (Gemma 2's ``final_logit_softcapping``): ``softcap=c`` takes
``z = c * tanh(hidden @ unembed / c) / temperature`` (the backward multiplies ``dz`` by
``1 - tanh^2``). The chunked and naive paths, and the top-k / log-prob-at functions, apply it;
the Pallas kernels refuse it in one line (``ValueError``), and ``"auto"`` then resolves to
``"chunked"`` on every backend.

``fused_logprob_sharded(..., mesh=...)`` runs it under ``jax.shard_map`` with tokens split
over ``dp`` / ``sp`` and the vocabulary over ``tp`` (per-shard statistics merged with
``pmax`` / ``psum``). Inside a ``shard_map`` of your own, call ``fused_logprob`` on the
local shards, with ``vocab_axis="tp"`` if ``unembed``'s columns are split (this needs the
default ``check_vma=True``, which types gradients of replicated inputs; otherwise a ValueError).

Block sizes (``block_t`` tokens x ``block_v`` vocabulary columns per tile):

* chunked (any backend): any positive ints. Defaults 1024 x 2048 (an 8 MiB float32 tile;
  fastest on CPU in bench/logprob.py; on a GPU larger tiles may pay off). Ragged tails are
  processed as one statically shaped extra step.
* pallas on TPU: ``block_t`` a multiple of 8 (16 is the native bfloat16 sublane tile) and
  ``block_v`` a multiple of 128; a block larger than its dimension is clamped to the full
  dimension, which is always legal. ``H`` is not tiled: one ``[block_t, H]`` hidden block,
  one ``[H, block_v]`` unembed block (both double-buffered) and the float32 accumulators
  (``[block_t, H]`` for d hidden, ``[H, block_v]`` for d unembed) must fit in VMEM; the
  kernels request up to 64 MiB of scoped VMEM (all current TPU generations have it).
  Defaults 256 x 512. Edge blocks are masked in-kernel, inputs are never padded.
* pallas on GPU (Triton): ``block_t`` and ``block_v`` powers of two >= 16 (Triton's tile
  rule); ``H`` is contracted in chunks of 64, so it needs no particular size. Defaults
  64 x 128; a block larger than its dimension shrinks to the smallest power of two covering
  it. Each program keeps one ``[block_t, block_v]`` float32 logit tile and its statistics in
  registers; the backward accumulates ``d hidden`` / ``d unembed`` chunk by chunk in float32
  outputs that only one program writes (deterministic, no atomics; ``d unembed`` is cast to
  ``unembed``'s dtype afterwards, so its float32 [H, V] buffer is a temporary of the backward).
* pallas in interpret mode (off the kernel's backend): the same constraints are enforced so
  that a config tested here compiles there; keep grids to ~100 steps. The GPU kernels' interpret
  mode (JAX's generic Pallas interpreter) does not run inside ``shard_map`` with check_vma on
  jax 0.10.

``fused_topk_logprob`` / ``fused_logprob_at`` (and their ``*_sharded`` versions,
:mod:`rljax.pallas._topk`, chunked path only): the ``k`` most likely tokens and their log-probs,
and the log-probs at given ids, for ``forward_kl_topk`` distillation.
"""

from rljax.pallas._api import IMPLS, fused_logprob, fused_logprob_sharded
from rljax.pallas._common import MASK_VALUE
from rljax.pallas._topk import (fused_logprob_at, fused_logprob_at_sharded, fused_topk_logprob,
                                fused_topk_logprob_sharded)

__all__ = ["IMPLS", "MASK_VALUE", "fused_logprob", "fused_logprob_at", "fused_logprob_at_sharded", "fused_logprob_sharded",
           "fused_topk_logprob", "fused_topk_logprob_sharded"]
