"""Shared by the update benches of the TRL comparison (``peer_xla_options``, ``peer_remat``,
``peer_profile``): the 31.6M Qwen2 of ``bench/peer_trl.py``'s ``31m`` case, a synthetic
on-policy actor batch, and interleaved timing of compiled variants."""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from rljax.models.config import get_config

PROMPT = 8  # prompt tokens per trajectory (the first PAD are left padding in every row)
#: Left-padding columns of every row: 3 mirrors bench/peer_trl.py's 31m case (prompts of at most 5
#: tokens left-padded to data.max_prompt_length=8, where TRL pads to the batch's longest, 5).
PAD = int(os.environ.get("PAD", 2))


def model_31m(**changes):
    """The 31.6M Qwen2-shaped config (hidden 512, 8 layers, 8 / 4 heads, MLP 2048, vocab 88)."""
    shape = dict(vocab_size=88, hidden_size=512, intermediate_size=2048, num_layers=8, num_heads=8, num_kv_heads=4,
                 head_dim=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return get_config("tiny").replace(**{**shape, **changes})


def actor_batch(b: int, t: int, *, old_logp: bool = False) -> dict:
    """``b`` trajectories of ``PROMPT`` + ``t`` tokens, random ids, advantages per row."""
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 88, (b, PROMPT + t)).astype(np.int32)
    mask = np.ones((b, PROMPT + t), bool)
    mask[:, :PAD] = False
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32)
    adv = rng.normal(size=(b, 1)).astype(np.float32) * np.ones((b, t), np.float32)
    batch = dict(input_ids=ids, attention_mask=mask, positions=pos, loss_mask=np.ones((b, t), np.float32),
                 advantages=adv)
    if old_logp:
        batch["old_logp"] = np.zeros((b, t), np.float32)
    return jax.tree.map(jnp.asarray, batch)


def trimmed(batch: dict) -> dict:
    """``batch`` without its ``PAD`` all-padding prompt columns (what ``data.trim_prompt_padding``
    gives the learner: ``rljax.trainer.stages.learner_layout(trim=True)``)."""
    return {k: v[:, PAD:] if k in ("input_ids", "attention_mask", "positions") else v for k, v in batch.items()}


def max_rel_diff(out, ref) -> float:
    """The largest relative difference between two pytrees of arrays."""
    return max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-12))
               for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))


def time_interleaved(compiled: dict, args: tuple, rounds: int, *, base: str, label: str = "") -> dict:
    """Runs every compiled variant once per round, in turn (so machine load hits them alike),
    and prints wall and process-CPU medians relative to ``base``; returns them, ``{name: (wall, cpu)}``."""
    times = {k: [] for k in compiled}
    for _ in range(rounds):
        for k, c in compiled.items():
            t, ct = time.perf_counter(), time.process_time()
            jax.block_until_ready(c(*args))
            times[k].append((time.perf_counter() - t, time.process_time() - ct))
    w0 = np.median([w for w, _ in times[base]])
    c0 = np.median([c for _, c in times[base]])
    medians = {}
    for k, v in times.items():
        w, c = np.median([x for x, _ in v]), np.median([y for _, y in v])
        medians[k] = (w, c)
        print(f"{label}{k:<10} wall {w:.3f} s ({w / w0:.2f}x {base})  cpu {c:.3f} s ({c / c0:.2f}x {base})  "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
    return medians
