"""Per-op profile of the compiled 31.6M update on CPU (jax.profiler perfetto trace, summed by op name).

    python bench/peer_profile.py          # B=64 trajectories of 8 + 32 tokens; HLO=1 also writes the HLO text

Prints the XLA thunks that took the most time in one update step (ynn_fusion = YNNPACK
dots; copy_bitcast_fusion = materialised transposes). Set RLJAX_XLA_CPU_DEFAULTS=1 to
profile XLA's default options.
"""
import os, time, glob, gzip, json, collections, tempfile
import jax, jax.numpy as jnp
from rljax.models import functional as F
from rljax.trainer import step as S
from _peer_update import actor_batch, model_31m
T = int(os.environ.get("T", 32)); B = int(os.environ.get("B", 64))
g, p = F.init_params(model_31m(), seed=0)
batch = actor_batch(B, T, old_logp=True)
sc = S.StepConfig(ppo_mini_batch_size=B, ppo_micro_batch_size=B, on_policy=True)
opt = S.make_optimizer(lr=1e-5)
step = S.make_train_step(g, opt, sc)
state = S.init_state(jax.tree.map(jnp.copy, p), opt)
key = jax.random.key(0)
state, m = step(state, batch, key); jax.block_until_ready(m)
if os.environ.get("HLO"):
    open(os.environ.get("HLO_OUT", "/tmp/peer_profile_step.hlo.txt"), "w").write(step.lower(state, batch, key).compile().as_text())
state, m = step(state, batch, key); jax.block_until_ready(m)
d = tempfile.mkdtemp(prefix="peer_profile_")
t = time.perf_counter()
with jax.profiler.trace(d, create_perfetto_trace=True):
    state, m = step(state, batch, key); jax.block_until_ready(m)
print("step", time.perf_counter() - t)
f = sorted(glob.glob(d + "/**/*.trace.json.gz", recursive=True), key=os.path.getmtime)[-1]
ev = json.load(gzip.open(f))
ev = ev["traceEvents"] if isinstance(ev, dict) else ev
agg = collections.Counter(); cnt = collections.Counter()
for e in ev:
    if e.get("ph") == "X" and "dur" in e:
        agg[e["name"]] += e["dur"] / 1e6; cnt[e["name"]] += 1
for n, s in agg.most_common(45):
    print(f"{s:8.3f}s {cnt[n]:6d}  {n[:110]}")
