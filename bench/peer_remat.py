"""``model.remat`` off vs on for the 31.6M update of ``bench/peer_trl.py``: time (interleaved, one process) and memory.

    python bench/peer_remat.py                  # B=64 trajectories of 8 + 32 tokens, 5 rounds
    T=256 R=0 python bench/peer_remat.py        # memory only (compile, no run) at 256 new tokens

value_and_grad of the actor loss, compiled as the trainer compiles its update (the CPU
options of ``rljax.trainer.step.cpu_compiler_options``), once with each layer
rematerialised in the backward pass and once without. Prints XLA's ``memory_analysis``
temporaries of each program, then (``R`` > 0) wall and process-CPU medians of ``R``
interleaved rounds and the largest relative difference of the results.
"""
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from rljax.models import functional as F
from rljax.models.config import get_config
from rljax.trainer import step as S

T = int(os.environ.get("T", 32))
B = int(os.environ.get("B", 64))
R = int(os.environ.get("R", 5))
SP = 8
base = get_config("tiny").replace(vocab_size=88, hidden_size=512, intermediate_size=2048, num_layers=8, num_heads=8,
                                  num_kv_heads=4, head_dim=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
rng = np.random.default_rng(0)
ids = rng.integers(3, 88, (B, SP + T)).astype(np.int32)
mask = np.ones((B, SP + T), bool)
mask[:, :2] = False
pos = np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32)
adv = rng.normal(size=(B, 1)).astype(np.float32) * np.ones((B, T), np.float32)
batch = jax.tree.map(jnp.asarray, dict(input_ids=ids, attention_mask=mask, positions=pos,
                                       loss_mask=np.ones((B, T), np.float32), advantages=adv))
sc = S.StepConfig(ppo_mini_batch_size=B, ppo_micro_batch_size=B, on_policy=True)
counts = (jnp.float32(B * T), jnp.float32(B))
compiled, params = {}, None
for name, remat in (("remat off", False), ("remat on", True)):
    g, p = F.init_params(base.replace(remat=remat), seed=0)
    params = p if params is None else params  # the same weights for both
    fn = jax.value_and_grad(lambda q, b, g=g: S.actor_loss(q, g, b, counts, sc, None)[0])
    t = time.perf_counter()
    c = jax.jit(fn).lower(params, batch).compile(compiler_options=S.cpu_compiler_options())
    m = c.memory_analysis()
    print(f"{name}: compiled in {time.perf_counter() - t:.1f} s; temp {m.temp_size_in_bytes / 2**20:.0f} MiB, "
          f"arguments {m.argument_size_in_bytes / 2**20:.0f} MiB (B={B}, {SP}+{T} tokens)", flush=True)
    compiled[name] = c
if R > 0:
    out = {k: jax.tree.leaves(c(params, batch)) for k, c in compiled.items()}
    err = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-12))
              for a, b in zip(out["remat on"], out["remat off"]))
    print(f"max relative difference of loss and gradients: {err:.1e}")
    times = {k: [] for k in compiled}
    for _ in range(R):
        for k, c in compiled.items():
            t, ct = time.perf_counter(), time.process_time()
            jax.block_until_ready(c(params, batch))
            times[k].append((time.perf_counter() - t, time.process_time() - ct))
    w0 = np.median([w for w, _ in times["remat off"]])
    c0 = np.median([c for _, c in times["remat off"]])
    for k, v in times.items():
        w, c = np.median([x for x, _ in v]), np.median([y for _, y in v])
        print(f"{k:<10} wall {w:.3f} s ({w / w0:.2f}x)  cpu {c:.3f} s ({c / c0:.2f}x)  load {os.getloadavg()[0]:.1f}")
