"""The 31.6M update (or forward) compiled with different XLA:CPU options, timed interleaved in one process.

    python bench/peer_xla_options.py                              # value_and_grad of the actor loss, B=32
    MODE=fwd B=64 V=base,ynn_dot python bench/peer_xla_options.py   # the forward-only log-prob pass

Each variant is the same jitted function compiled with ``compiler_options``; the variants run
in turn, ``R`` rounds, so machine load hits them alike. Prints wall and process-CPU medians
relative to XLA's default and the largest relative difference of the results.
Measured here (load ~15): value_and_grad ynn_dot 0.64x base (wall and CPU); forward 1.27x.
"""
import os, sys, time, tempfile
os.environ.setdefault("RLJAX_XLA_CPU_DEFAULTS", "1")
import numpy as np
import jax, jax.numpy as jnp
from rljax.models.config import get_config
from rljax.models import functional as F
from rljax.trainer import step as S

T = int(os.environ.get("T", 32)); Sp = 8; B = int(os.environ.get("B", 32)); R = int(os.environ.get("R", 5))
cfg = get_config("tiny").replace(vocab_size=88, hidden_size=512, intermediate_size=2048, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
g, p = F.init_params(cfg, seed=0)
rng = np.random.default_rng(0)
ids = rng.integers(3, 88, (B, Sp + T)).astype(np.int32)
mask = np.ones((B, Sp + T), bool); mask[:, :2] = False
pos = np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32)
adv = rng.normal(size=(B, 1)).astype(np.float32) * np.ones((B, T), np.float32)
batch = jax.tree.map(jnp.asarray, dict(input_ids=ids, attention_mask=mask, positions=pos, loss_mask=np.ones((B, T), np.float32), advantages=adv))
sc = S.StepConfig(ppo_mini_batch_size=B, ppo_micro_batch_size=B, on_policy=True)
MODE = os.environ.get("MODE", "vg")
if MODE == "vg":
    fn = jax.value_and_grad(lambda p, b: S.actor_loss(p, g, b, (jnp.float32(B*T), jnp.float32(B)), sc, None)[0])
else:
    fn = lambda p, b: S.response_logprobs(g, p, b, response_len=T)
variants = {
  "base": {},
  "onednn": {"xla_cpu_use_onednn": True},
  "xnn": {"xla_cpu_use_xnnpack": True},
  "vw512": {"xla_cpu_prefer_vector_width": 512},
  "ynn_off": {"xla_cpu_experimental_ynn_fusion_type": ""},
  "ynn_dot": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
  "ynn_all": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_ELTWISE,LIBRARY_FUSION_TYPE_REDUCE"},
}
sel = os.environ.get("V", ",".join(variants)).split(",")
compiled = {}
for k in sel:
    try:
        t = time.perf_counter()
        compiled[k] = jax.jit(fn).lower(p, batch).compile(compiler_options=variants[k] or None)
        out = compiled[k](p, batch); jax.block_until_ready(out)
        print(f"compiled {k} in {time.perf_counter()-t:.1f}s", flush=True)
    except Exception as e:
        print(f"variant {k} failed: {str(e)[:300]}", flush=True)
ref = jax.tree.leaves(compiled["base"](p, batch))
for k, c in compiled.items():
    out = jax.tree.leaves(c(p, batch))
    err = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-12)) for a, b in zip(out, ref))
    print(f"  {k}: max rel diff vs base {err:.2e}")
times = {k: [] for k in compiled}
for r in range(R):
    for k, c in compiled.items():
        t, ct = time.perf_counter(), time.process_time()
        jax.block_until_ready(c(p, batch))
        times[k].append((time.perf_counter() - t, time.process_time() - ct))
b = np.median([w for w, _ in times["base"]]); bc = np.median([c for _, c in times["base"]])
for k, v in times.items():
    w = np.median([x for x, _ in v]); c = np.median([y for _, y in v])
    print(f"{MODE} B={B} {k:<8} wall {w:.3f}s ({w/b:.2f}x base)  cpu {c:.3f}s ({c/bc:.2f}x base)  load {os.getloadavg()[0]:.1f}", flush=True)
