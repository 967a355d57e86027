"""The 31.6M update (or forward) compiled with different XLA:CPU options, timed interleaved in one process.

    python bench/peer_xla_options.py                              # value_and_grad of the actor loss, B=32
    MODE=fwd B=64 V=base,ynn_dot python bench/peer_xla_options.py   # the forward-only log-prob pass

Each variant is the same jitted function compiled with ``compiler_options``; the variants run
in turn, ``R`` rounds, so machine load hits them alike. Prints wall and process-CPU medians
relative to XLA's default and the largest relative difference of the results.
Measured here (load ~15): value_and_grad ynn_dot 0.64x base (wall and CPU); forward 1.27x.
"""
import os, time
os.environ.setdefault("RLJAX_XLA_CPU_DEFAULTS", "1")
import jax, jax.numpy as jnp
from rljax.models import functional as F
from rljax.trainer import step as S
from _peer_update import actor_batch, max_rel_diff, model_31m, time_interleaved

T = int(os.environ.get("T", 32)); B = int(os.environ.get("B", 32)); R = int(os.environ.get("R", 5))
g, p = F.init_params(model_31m(), seed=0)
batch = actor_batch(B, T)
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
ref = compiled["base"](p, batch)
for k, c in compiled.items():
    print(f"  {k}: max rel diff vs base {max_rel_diff(c(p, batch), ref):.2e}")
time_interleaved(compiled, (p, batch), R, base="base", label=f"{MODE} B={B} ")
