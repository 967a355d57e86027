"""``model.remat`` off vs on for the 31.6M update of ``bench/peer_trl.py``: time (interleaved, one process) and memory.

    python bench/peer_remat.py                  # B=64 trajectories of 8 + 32 tokens, 5 rounds
    T=256 R=0 python bench/peer_remat.py        # memory only (compile, no run) at 256 new tokens
    PAD=3 THREADS=1 taskset -c 1 python bench/peer_remat.py   # one core; 3 padding columns as in peer_trl's 31m

value_and_grad of the actor loss, compiled as the trainer compiles its update (the CPU
options of ``rljax.trainer.step.cpu_compiler_options``), once with each layer
rematerialised in the backward pass (``model.remat_policy`` full: keep each layer's input;
minimal: also the projections' outputs) and once without. Prints XLA's ``memory_analysis``
temporaries of each program, then (``R`` > 0) wall and process-CPU medians of ``R``
interleaved rounds and the largest relative difference of the results.
"""
import os
import time

import jax
import jax.numpy as jnp

from _peer_update import PROMPT, actor_batch, max_rel_diff, model_31m, time_interleaved
from rljax.models import functional as F
from rljax.trainer import step as S

T = int(os.environ.get("T", 32))
B = int(os.environ.get("B", 64))
R = int(os.environ.get("R", 5))
batch = actor_batch(B, T)
sc = S.StepConfig(ppo_mini_batch_size=B, ppo_micro_batch_size=B, on_policy=True)
counts = (jnp.float32(B * T), jnp.float32(B))
compiled, params = {}, None
variants = [("remat off", False, "full"), ("remat full", True, "full"), ("remat minimal", True, "minimal")]
for name, remat, policy in variants:
    g, p = F.init_params(model_31m(remat=remat, remat_policy=policy), seed=0)
    params = p if params is None else params  # the same weights for both
    fn = jax.value_and_grad(lambda q, b, g=g: S.actor_loss(q, g, b, counts, sc, None)[0])
    t = time.perf_counter()
    c = jax.jit(fn).lower(params, batch).compile(compiler_options=S.cpu_compiler_options())
    m = c.memory_analysis()
    print(f"{name}: compiled in {time.perf_counter() - t:.1f} s; temp {m.temp_size_in_bytes / 2**20:.0f} MiB, "
          f"arguments {m.argument_size_in_bytes / 2**20:.0f} MiB (B={B}, {PROMPT}+{T} tokens)", flush=True)
    compiled[name] = c
if R > 0:
    err = max(max_rel_diff(compiled[k](params, batch), compiled["remat off"](params, batch))
              for k in ("remat full", "remat minimal"))
    print(f"max relative difference of loss and gradients: {err:.1e}")
    time_interleaved(compiled, (params, batch), R, base="remat off")
