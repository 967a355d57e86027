"""Where a decode step's time goes at a large vocabulary, this tree vs. a git revision, side by side.

    python bench/decode_profile.py                              # qwen2.5-0.5b shape, vs. 66bbdf8
    python bench/decode_profile.py --ref HEAD~3 --rounds 3 --steps 8
    python bench/decode_profile.py --preset qwen2.5-0.5b --slots 16 --group 8 --new-tokens 32

On the ``--preset`` model's shape (default ``qwen2.5-0.5b``: 24 layers, hidden 896, 151,936-token
vocabulary, bfloat16; random-initialised weights, seed 0) with ``--slots`` decode slots filled by
``--slots / --group`` prompts of ``--prompt-len`` random tokens, each inserted into ``--group``
slots (the RL shape: a prompt's ``n`` samples), the script times, per sampling setting
(``--settings``: greedy, ``t1`` = temperature 1 (rljax's and verl's default), ``topk50``,
``topp95``, ``topk50-topp95``):

* ``model``: one decode step of the transformer layers (attention, MLP, norms; the model's
  matmuls) over the slots, no LM head;
* ``head``: the LM head, ``[slots, hidden] @ [hidden, vocab]`` -> float32 logits;
* ``sample``: ``sample_tokens`` on those logits (temperature, top-k / top-p, the draw, the
  recorded log-probs);
* ``step``: one step of the engine's device decode loop (``generate_chunk`` of ``--steps``
  steps, divided by the steps), which is all of the above plus the state updates;
* ``outside``: the share of ``step`` that is neither ``model`` nor ``head``;
* ``gen tok/s``: ``Sampler.generate`` end to end (prefill, decode chunks, the driver's host
  work, result assembly) for the same prompts, ``--new-tokens`` each, no EOS; ``host``: its
  wall time minus the prefill and decode-chunk time, as a share of the wall.

Both implementations run in one process, on the same weights, prompts and keys, alternating
``--rounds`` times: this tree's, and ``--ref``'s ``rljax/rollout/sampling.py`` and LM head
(``compute_logits`` / ``unembedding`` of ``rljax/models/functional.py``), patched into the
engine for the engines built for it. Each cell is the median over rounds of the median of
``--reps`` calls after a warm-up call. Ratios are ref / this tree (> 1: this tree is faster).
The load average is printed before and after; on a shared machine compare ratios, not seconds.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import inspect
import os
import statistics
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from rljax.models import functional as F
from rljax.models.config import get_config
from rljax.rollout import DecodeParams, RljaxEngine, Sampler
from rljax.rollout import engine as engine_mod
from rljax.rollout import sampling as sampling_mod

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = {
    "greedy": dict(temperature=0.0),
    "t1": dict(temperature=1.0),
    "topk50": dict(temperature=1.0, top_k=50),
    "topp95": dict(temperature=1.0, top_p=0.95),
    "topk50-topp95": dict(temperature=1.0, top_k=50, top_p=0.95),
}


def _git_show(ref: str, path: str) -> str:
    return subprocess.run(["git", "-C", ROOT, "show", f"{ref}:{path}"], check=True, capture_output=True,
                          text=True).stdout


class Impl:
    """A sampling module and an LM head: this tree's, or a git revision's."""

    def __init__(self, name: str, sampling, compute_logits):
        self.name, self.sampling, self.compute_logits = name, sampling, compute_logits
        proxy = types.ModuleType(f"_functional_{name}")
        proxy.__dict__.update(F.__dict__)
        proxy.compute_logits = compute_logits
        self.functional = proxy

    @classmethod
    def current(cls):
        return cls("this tree", sampling_mod, F.compute_logits)

    @classmethod
    def revision(cls, ref: str):
        mod = types.ModuleType("_ref_sampling")
        mod.__file__ = f"<{ref}:rljax/rollout/sampling.py>"
        sys.modules[mod.__name__] = mod  # dataclasses look their module up
        exec(compile(_git_show(ref, "rljax/rollout/sampling.py"), mod.__file__, "exec"), mod.__dict__)  # noqa: S102
        # the revision's LM head: its compute_logits / unembedding, run against this tree's functional module
        tree = ast.parse(_git_show(ref, "rljax/models/functional.py"))
        defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("unembedding", "compute_logits")]
        scope = dict(F.__dict__)
        exec(compile(ast.Module(body=defs, type_ignores=[]), f"<{ref}:functional.py>", "exec"), scope)  # noqa: S102
        head = scope["compute_logits"]
        if "softcap" not in inspect.signature(head).parameters:  # a revision before Gemma 2's logit soft-capping
            head = lambda params, hidden, softcap=None, old=head: F.softcap_logits(old(params, hidden), softcap)  # noqa: E731
        return cls(ref, mod, head)

    @contextlib.contextmanager
    def patched(self):
        """The engine module's sampling and LM head are this implementation's (jit traces inside)."""
        saved = engine_mod.sample_tokens, engine_mod.F
        engine_mod.sample_tokens, engine_mod.F = self.sampling.sample_tokens, self.functional
        try:
            yield
        finally:
            engine_mod.sample_tokens, engine_mod.F = saved


def timed(fn, *args, reps: int, fresh=None) -> float:
    """Median seconds of ``reps`` calls after a warm-up; ``fresh()`` gives new args per call (donated inputs)."""
    call = (lambda: fn(*fresh())) if fresh else (lambda: fn(*args))
    jax.block_until_ready(call())
    times = []
    for _ in range(reps):
        a = fresh() if fresh else args
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*a))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_tree(tree):
    return jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, tree)


@contextlib.contextmanager
def no_sampling(no_head: bool = False):
    """Engines built inside take a trivial token choice (and, ``no_head``, a trivial LM head) in
    place of sampling: each keeps a data dependence on the step's output, so nothing upstream is
    dropped; the differences in step time are the sampling's and the head's cost in the loop."""
    saved = engine_mod.sample_tokens, engine_mod.F
    head = types.ModuleType("_no_head")
    head.__dict__.update(engine_mod.F.__dict__)
    head.compute_logits = lambda params, hidden, softcap=None: hidden[..., :8].astype(jnp.float32)

    def pick(logits, keys, **_):
        return (logits[:, 0] > 0).astype(jnp.int32), logits[:, 1]

    engine_mod.sample_tokens = pick
    if no_head:
        engine_mod.F = head
    try:
        yield
    finally:
        engine_mod.sample_tokens, engine_mod.F = saved


def profile(impl: Impl, config, params, prompts, args) -> dict:
    """One round of every measurement for ``impl``: ``{setting: {model, head, sample, step, tok_s, host}}``."""
    out = {}
    with impl.patched():
        engine = RljaxEngine(config, num_slots=args.slots, max_prefill_length=args.max_prompt,
                             max_decode_length=args.new_tokens + args.steps + 1, prefill_batch_size=len(prompts))
        eng_params = engine.load_params(params)
        layers = engine.decode_layers(eng_params)
        prefix = engine.prefill_batch(eng_params, prompts)
        keys = sampling_mod.trajectory_keys(0, [i // args.group for i in range(args.slots)],
                                            [i % args.group for i in range(args.slots)])
        rows = np.arange(args.slots) // args.group
        sampler = Sampler(engine, eng_params, steps_per_sync=16)
        base = {}
        for name in args.settings:
            decode = DecodeParams(max_new_tokens=args.new_tokens + args.steps, eos_ids=(), seed=0, **SETTINGS[name])
            state = engine.insert_many(prefix, engine.init_decode_state(decode), rows=rows,
                                       slots=np.arange(args.slots), keys=keys)
            jax.block_until_ready(state)
            row = dict(step=timed(lambda st: engine.generate_chunk(eng_params, st, num_steps=args.steps, layers=layers),
                                  reps=args.reps, fresh=lambda: (copy_tree(state),)) / args.steps)
            if not base:  # the variants without sampling (and head) do not depend on the setting: once per round
                for part, patch in (("no_sample", no_sampling()), ("model", no_sampling(no_head=True))):
                    with patch:  # a fresh engine traces the variant; same weights, layers and state
                        variant = RljaxEngine(config, num_slots=args.slots, max_prefill_length=args.max_prompt,
                                              max_decode_length=engine.max_decode_length,
                                              prefill_batch_size=len(prompts))
                        base[part] = timed(lambda st, v=variant: v.generate_chunk(
                            eng_params, st, num_steps=args.steps, layers=layers),
                            reps=args.reps, fresh=lambda: (copy_tree(state),)) / args.steps
            row.update(base)
            row["head"] = max(0.0, row["no_sample"] - row["model"])
            row["sample"] = max(0.0, row["step"] - row["no_sample"])
            gen_decode = decode.replace(max_new_tokens=args.new_tokens)
            uids = list(range(len(prompts)))
            sampler.generate(prompts, uids=uids, n=args.group, decode=gen_decode)  # warm-up (compiles)
            walls, hosts, toks = [], [], []
            for _ in range(max(1, args.reps // 2)):
                st = sampler.generate(prompts, uids=uids, n=args.group, decode=gen_decode).stats
                walls.append(st.wall_s)
                hosts.append(max(0.0, st.wall_s - st.prefill_s - st.decode_s) / st.wall_s)
                toks.append(st.generated_tokens / st.wall_s)
            row["tok_s"], row["host"] = statistics.median(toks), statistics.median(hosts)
            row["outside"] = max(0.0, row["step"] - row["model"] - row["head"]) / row["step"]
            out[name] = row
            del state
        del engine, eng_params, layers, prefix, sampler
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b", help="model preset (rljax.models.config.get_config)")
    ap.add_argument("--ref", default="66bbdf8", help="git revision to compare with ('none': this tree only)")
    ap.add_argument("--settings", default="greedy,t1,topk50,topp95",
                    help=f"comma-separated, from {', '.join(SETTINGS)}")
    ap.add_argument("--slots", type=int, default=16, help="decode slots (trajectories decoded together)")
    ap.add_argument("--group", type=int, default=8, help="slots per prompt (rollout.n)")
    ap.add_argument("--prompt-len", type=int, default=190, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens per trajectory in the end-to-end generate")
    ap.add_argument("--steps", type=int, default=4, help="decode steps per timed chunk")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per cell")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of both implementations")
    args = ap.parse_args(argv)
    args.settings = args.settings.split(",")
    for s in args.settings:
        if s not in SETTINGS:
            ap.error(f"unknown setting {s!r}; accepted: {', '.join(SETTINGS)}")
    if args.slots < 1 or args.group < 1 or args.slots % args.group:
        ap.error(f"--slots {args.slots} must be a positive multiple of --group {args.group}")
    if min(args.prompt_len, args.new_tokens, args.steps, args.reps, args.rounds) < 1:
        ap.error("--prompt-len, --new-tokens, --steps, --reps and --rounds must be >= 1")
    config = get_config(args.preset)
    args.max_prompt = 1 << (args.prompt_len - 1).bit_length()
    impls = [Impl.current()]
    if args.ref != "none":
        impls.append(Impl.revision(args.ref))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config.vocab_size, args.prompt_len).astype(np.int32).tolist()
               for _ in range(args.slots // args.group)]
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cpus), load "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at start; {args.preset} ({config.num_params() / 1e6:.0f}M, "
          f"vocab {config.vocab_size}, {config.dtype}); {args.slots} slots = {len(prompts)} prompts x {args.group}, "
          f"prompt {args.prompt_len}, {args.steps}-step chunks, {args.new_tokens} new tokens end to end, "
          f"{args.rounds} rounds", flush=True)
    params = F.init_params(config, seed=0)[1]
    results = {impl.name: [] for impl in impls}
    for r in range(args.rounds):
        for impl in (impls if r % 2 == 0 else impls[::-1]):
            t0 = time.perf_counter()
            results[impl.name].append(profile(impl, config, params, prompts, args))
            for s, row in results[impl.name][-1].items():  # per round, to judge the spread
                print(f"    {s}: " + " ".join(f"{k} {v * 1e3:.1f} ms" if k not in ("tok_s", "host", "outside")
                                           else f"{k} {v:.3g}" for k, v in row.items()), file=sys.stderr)
            print(f"  round {r + 1} {impl.name}: {time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.2f}",
                  file=sys.stderr, flush=True)
    med = lambda name, s, k: statistics.median(rd[s][k] for rd in results[name])  # noqa: E731
    print(f"\n{'setting':<15}{'impl':<11}{'model ms':>9}{'head ms':>9}{'sample ms':>10}{'step ms':>9}{'outside':>9}"
          f"{'decode tok/s':>13}{'gen tok/s':>10}{'host':>7}")
    for s in args.settings:
        for impl in impls:
            n = impl.name
            step = med(n, s, "step")
            print(f"{s:<15}{n[:10]:<11}{med(n, s, 'model') * 1e3:>9.1f}{med(n, s, 'head') * 1e3:>9.1f}"
                  f"{med(n, s, 'sample') * 1e3:>10.1f}{step * 1e3:>9.1f}{med(n, s, 'outside'):>9.0%}"
                  f"{args.slots / step:>13.1f}{med(n, s, 'tok_s'):>10.1f}{med(n, s, 'host'):>7.1%}")
        if len(impls) == 2:
            a, b = impls[1].name, impls[0].name
            ratio = lambda k: [ra[s][k] / rb[s][k] if rb[s][k] > 0 else float("nan")  # noqa: E731
                             for ra, rb in zip(results[a], results[b])]
            cells = []
            for k in ("head", "sample", "step"):
                rs = ratio(k)
                cells.append(f"{k} {statistics.median(rs):.2f}x [{min(rs):.2f}-{max(rs):.2f}]")
            rs = [rb[s]["tok_s"] / ra[s]["tok_s"] for ra, rb in zip(results[a], results[b])]
            cells.append(f"gen tok/s {statistics.median(rs):.2f}x [{min(rs):.2f}-{max(rs):.2f}]")
            print(f"{'':<15}{'ref/this':<11}" + "  ".join(cells))
    print(f"\nload {' '.join(f'{x:.2f}' for x in os.getloadavg())} at end")


if __name__ == "__main__":
    main()
