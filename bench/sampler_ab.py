"""The sampler now vs. the sampler of a git revision, side by side in one process (ratios, same tokens).

    python bench/sampler_ab.py --ref b15071b                 # 31.6M, 8 prompts x 8, 256 new tokens
    python bench/sampler_ab.py --ref b15071b --shape 8x8x32 --rounds 3
    PROFILE=1 python bench/sampler_ab.py --ref b15071b       # + jax.profiler thunk sums of one call each
    python bench/sampler_ab.py --ref . --ref-sampler compact_per_octave=1   # this tree, two Sampler settings

``rljax/rollout/engine.py`` and ``sampler.py`` of ``--ref`` are loaded from git as modules of
their own (the rest of rljax is this tree's, so the revision's engine must still run on it);
both samplers get the same weights (``bench/peer_trl.py``'s 31.6M Qwen2), prompts and
:class:`DecodeParams` (temperature 1, EOS id 2, seed 0: ``bench/sampler.py --rl``'s RL
shape) and run in turn, ``--rounds`` times after a warm-up call each. Prints per-call wall
medians, their ratio, generated tokens, and whether tokens are identical and log-probs
agree (max abs difference). ``THREADS=1`` (with ``taskset -c 1``) runs XLA on one thread.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types

if os.environ.get("THREADS") == "1":
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"

import jax
import numpy as np

from rljax.models import functional as F
from rljax.rollout import DecodeParams, RljaxEngine, Sampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _peer_update import model_31m  # noqa: E402
from sampler import make_prompts  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_revision(ref: str):
    """``(RljaxEngine, Sampler)`` classes of ``rljax/rollout/{engine,sampler}.py`` at git ``ref``."""
    mods = {}
    for name in ("engine", "sampler"):
        src = subprocess.run(["git", "-C", ROOT, "show", f"{ref}:rljax/rollout/{name}.py"], check=True,
                             capture_output=True, text=True).stdout
        src = src.replace("from rljax.rollout.engine import", "from _ab_engine import")
        mod = types.ModuleType(f"_ab_{name}")
        mod.__file__ = f"<{ref}:rljax/rollout/{name}.py>"
        sys.modules[mod.__name__] = mod
        exec(compile(src, mod.__file__, "exec"), mod.__dict__)  # pylint: disable=exec-used
        mods[name] = mod
    return mods["engine"].RljaxEngine, mods["sampler"].Sampler


def thunk_seconds(fn, top=12):
    """Runs ``fn`` under ``jax.profiler`` and returns the ``top`` XLA thunks by summed seconds
    (``ynn_fusion``: dots; ``*copy*`` / ``*transpose*``: materialised copies; ``*dynamic-slice*``:
    slices copied out of a bigger buffer)."""
    d = tempfile.mkdtemp(prefix="sampler_ab_")
    with jax.profiler.trace(d):
        fn()
    f = sorted(glob.glob(d + "/**/*.trace.json.gz", recursive=True), key=os.path.getmtime)[-1]
    ev = json.load(gzip.open(f))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    agg, cnt = collections.Counter(), collections.Counter()
    for e in ev:
        name = e.get("name", "")
        if e.get("ph") == "X" and "dur" in e and not name.startswith(("$", "Thunk", "while", "conditional", "np.")):
            name = re.sub(r"\.\d+$", "", name)  # the unrolled layers' copies of one op: summed
            agg[name] += e["dur"] / 1e6
            cnt[name] += 1
    return [(n, s, cnt[n]) for n, s in agg.most_common(top)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", default=None, help="git revision whose engine and sampler are the baseline "
                    "(none: time and profile this tree's only)")
    ap.add_argument("--shape", default="8x8x256", help="PROMPTSxNxNEW_TOKENS")
    ap.add_argument("--ref-model", default="", help="ModelConfig fields for the --ref side only, e.g. "
                    "decode_block_size=256 (integers; the rest of rljax is this tree's, config defaults too)")
    ap.add_argument("--ref-sampler", default="", help="Sampler keyword arguments for the --ref side only, e.g. "
                    "compact_per_octave=1 (integers); --ref . is this tree")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=32)
    args = ap.parse_args(argv)
    try:
        p, n, t = (int(x) for x in args.shape.split("x"))
    except ValueError:
        ap.error(f"--shape {args.shape!r}; accepted: PROMPTSxNxNEW_TOKENS such as 8x8x256")
    config = model_31m()
    try:
        ref_changes = {k: int(v) for k, v in (kv.split("=") for kv in args.ref_model.split())}
    except ValueError:
        ap.error(f"--ref-model {args.ref_model!r}; accepted: space-separated FIELD=INTEGER")
    try:
        ref_kw = {k: int(v) for k, v in (kv.split("=") for kv in args.ref_sampler.split())}
    except ValueError:
        ap.error(f"--ref-sampler {args.ref_sampler!r}; accepted: space-separated NAME=INTEGER")
    params = F.init_params(config, seed=0)[1]
    prompts = make_prompts(p, args.prompt_len, config.vocab_size)
    uids = [f"p{i}" for i in range(p)]
    decode = DecodeParams(temperature=1.0, max_new_tokens=t, eos_ids=(2,), seed=0)
    variants = [("now", RljaxEngine, Sampler)]
    if args.ref:
        variants.insert(0, (args.ref, *((RljaxEngine, Sampler) if args.ref == "." else load_revision(args.ref))))
    samplers = {}
    for label, eng_cls, smp_cls in variants:
        cfg = config.replace(**ref_changes) if label != "now" else config
        eng = eng_cls(cfg, num_slots=p * n, max_prefill_length=args.prompt_len, max_decode_length=t,
                      prefill_batch_size=min(p, 64))
        samplers[label] = smp_cls(eng, params, **(ref_kw if label != "now" else {}))
    run = lambda s: s.generate(prompts, uids=uids, n=n, decode=decode)
    print(f"jax {jax.__version__}, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}; 31.6M, {args.shape}, "
          f"sampling T=1, EOS 2", flush=True)
    out, first = {}, {}
    for k, s in samplers.items():  # compile + warm-up
        t0 = time.perf_counter()
        out[k] = run(s)
        first[k] = time.perf_counter() - t0
    times = {k: [] for k in samplers}
    for r in range(args.rounds):  # ABBA order: a load that drifts over the run favours neither side
        for k, s in (list(samplers.items())[::-1] if r % 2 else samplers.items()):
            t0 = time.perf_counter()
            out[k] = run(s)
            times[k].append(time.perf_counter() - t0)
    ref = args.ref or "now"
    base = float(np.median(times[ref]))
    for k, v in times.items():
        med = float(np.median(v))
        tr = out[k]
        print(f"{k:<12} {med:8.2f} s  ({med / base:.2f}x {ref})  tokens {int(tr.response_length.sum()):6d}  "
              f"decode chunks {tr.stats.decode_chunks:3d}  runs {', '.join(f'{x:.2f}' for x in v)}  "
              f"first call (compiles) {first[k]:.2f} s", flush=True)
    for k, s in samplers.items():  # the decode-state sizes one call runs chunks at (one compile each)
        infos = []
        s.generate(prompts, uids=uids, n=n, decode=decode, on_chunk=infos.append)
        infos = [types.SimpleNamespace(steps=i.steps, slots=getattr(i, "slots", 0)) for i in infos]
        work = sum(i.steps * i.slots for i in infos) if infos and infos[0].slots else None
        print(f"{k:<12} chunks run at state sizes {sorted(set(i.slots for i in infos), key=lambda x: -(x or 0))}"
              f"  row-steps (steps x slots) {work}")
    a, b = out[ref], out["now"]
    same = bool((a.response_ids == b.response_ids).all() and (a.response_length == b.response_length).all())
    dlogp = float(np.abs(a.rollout_logp - b.rollout_logp).max())
    print(f"same tokens: {same}; max |log-prob difference|: {dlogp:.2e}; load {os.getloadavg()[0]:.1f}")
    if os.environ.get("PROFILE"):
        for k, s in samplers.items():
            print(f"--- {k}: XLA thunks of one call (seconds, count)")
            for name, secs, c in thunk_seconds(lambda s=s: run(s)):
                print(f"  {secs:8.3f} {c:6d}  {name[:90]}")


if __name__ == "__main__":
    main()
