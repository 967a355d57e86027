"""rljax on one accelerator chip (GPU or TPU): one command, every part in its own process.

    python bench/accelerator.py [--out DIR] [--parts a,b] [--limit part=seconds ...]
    python bench/accelerator.py --smoke      # the same code paths on CPU at tiny shapes (~1 min)

Needs the chip's image (jax with its plugin, flax, optax, orbax-checkpoint, chex, numpy,
pyarrow, pyyaml, tokenizers, ...) and rljax's other dependencies as wheels: see
docs/benchmarks/accelerator.md and bench/accelerator_wheels.sh. Each part runs as
``python bench/accelerator.py --part NAME`` under its own time limit (a part that fails or
overruns leaves the others' numbers) and writes ``DIR/parts/NAME.json``; the whole writes
``DIR/accelerator.json`` and ``DIR/accelerator.md``. Parts, in order (limits sum to 8 min):

* ``default_run``: the embedded default run (``python -m rljax.launch``, mesh = all devices):
  wall time, time to the first step's record, held-out reward before and after.
* ``qwen``: the ``qwen2.5-0.5b`` preset, random init, a word-level tokenizer of Qwen2.5's
  151,936 ids and a GSM8K-length parquet built here: GRPO, 32 prompts x 8 samples (two mini-batches,
  so the old-log-prob pass runs), ~190-token prompts, 512-token responses. s/step, the gen / old-log-prob / update split, perf/mfu/actor,
  perf/mfu/rollout, decode tokens/s, peak device memory, the weight-sync time; and the async
  model's inputs (t_step, learner_s, sync_s, lengths) saved as ``DIR/async_inputs.json``.
* ``logprob``: the fused log-prob at bench/logprob_accelerator.py's shapes, naive vs chunked vs
  the Pallas kernel of the backend: time, temporaries, error against a float64 reference.
* ``losses``: every array function of rljax.loss on the chip in float32 at matmul precision
  ``default`` and ``highest``, against the function on float64 inputs on the CPU (a float32
  reference where the function casts to float32: its ``reference`` column says which).
* ``async_model``: ``bench/async_pipeline.py --model-from DIR/async_inputs.json``: the
  discrete-event model's sync vs async prediction at 48 rollout + 16 learner devices.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, REPO)
sys.path.insert(0, BENCH)

# name -> (time limit on the chip, time limit with --smoke), in seconds
# (--smoke's are safety nets for a loaded CPU host: its parts take ~5-30 s of CPU each)
LIMITS = {"default_run": (100, 300), "qwen": (180, 300), "logprob": (150, 200), "losses": (35, 150),
          "async_model": (15, 60)}
QWEN_VOCAB = 151936
EOS = "<|endoftext|>"


def _out(args, *names):
    """A file path under the report directory, its folder created."""
    path = os.path.join(args.out, *names)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path


def _fresh(path):
    """``path`` emptied: a run directory left by an earlier report would be resumed."""
    shutil.rmtree(path, ignore_errors=True)
    return path


def _dir(args, *names):
    path = os.path.join(args.out, *names)
    os.makedirs(path, exist_ok=True)
    return path


def _device():
    import jax

    d = jax.devices()[0]
    return {"backend": jax.default_backend(), "device_kind": d.device_kind, "devices": jax.device_count(),
            "jax": jax.__version__}


def _peak_bytes():
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


# ---------------------------------------------------------------------------- default_run


def _records(path):
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as fh:
        for line in fh:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a record being written
                break
    return rows


def part_default_run(args):
    """The embedded default run through the launcher, as a user runs it."""
    run_dir = _fresh(os.path.join(_dir(args, "default_run"), "run"))
    extra = ["trainer.total_steps=2", "trainer.test_freq=2", "data.embedded.num_test=32", "model.num_layers=1",
             "data.train_batch_size=8", "actor.ppo_mini_batch_size=8"] if args.smoke else []
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    metrics = os.path.join(run_dir, "metrics.jsonl")
    start = time.perf_counter()
    first = None
    log = open(run_dir + ".log", "w")  # a file, not a pipe: a full pipe would stall the run
    proc = subprocess.Popen([sys.executable, "-m", "rljax.launch", "--run-dir", run_dir, *extra], env=env,
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    limit = args.inner_limit
    while proc.poll() is None:
        if first is None and any("timing_s/step" in r for r in _records(metrics)):
            first = time.perf_counter() - start
        if limit and time.perf_counter() - start > limit:
            proc.terminate()
            proc.wait()
            break
        time.sleep(0.2)
    wall = time.perf_counter() - start
    log.close()
    with open(run_dir + ".log") as fh:
        err = fh.read()
    rows = _records(metrics)
    steps = [r for r in rows if "timing_s/step" in r]
    if first is None and steps:
        first = wall
    vals = [(r["step"], r["val/score/mean"]) for r in rows if "val/score/mean" in r]
    if not steps:
        raise RuntimeError(f"the launched run wrote no step (exit {proc.returncode}): {err[-1500:]}")
    steady = [r["timing_s/step"] for r in steps[1:]] or [steps[0]["timing_s/step"]]
    return {"finished": proc.returncode == 0, "exit": proc.returncode, "steps": len(steps), "wall_s": wall,
            "time_to_first_step_s": first, "step_s_median": statistics.median(steady),
            "val_reward_before": vals[0][1] if vals else None, "val_reward_after": vals[-1][1] if vals else None,
            "val_steps": [s for s, _ in vals]}


# ---------------------------------------------------------------------------- qwen


def build_qwen_inputs(root, *, vocab, prompt_words, n_train, n_test):
    """A word-level tokenizer of ``vocab`` ids (EOS last) and GSM8K-format train/test parquet files
    whose questions are ``prompt_words`` words (one token each) long."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab - 1)}
    words[EOS] = vocab - 1
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    os.makedirs(root, exist_ok=True)
    tok.save(os.path.join(root, "tokenizer.json"))
    with open(os.path.join(root, "tokenizer_config.json"), "w") as fh:
        json.dump({"eos_token": EOS, "pad_token": EOS}, fh)
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("test", n_test)):
        ids = rng.integers(0, vocab - 1, size=(n, prompt_words))
        questions = [" ".join(f"w{i}" for i in row) for row in ids]
        answers = [f"w1 #### {int(a)}" for a in rng.integers(0, 100, size=n)]
        pq.write_table(pa.table({"question": questions, "answer": answers}), os.path.join(root, f"{split}.parquet"))
    return os.path.join(root, "tokenizer.json"), vocab - 1


def _qwen_config(args, data_dir, tokenizer, eos_id, n_devices):
    from rljax.config import resolve

    if args.smoke:
        shape = ["model.name=tiny", "data.train_batch_size=4", "rollout.n=2", "data.max_prompt_length=16",
                 "data.max_response_length=8", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=4",
                 "rollout.max_slots=8", "model.dtype=float32", "model.num_layers=1"]
    else:
        shape = ["model.name=qwen2.5-0.5b", "data.train_batch_size=32", "rollout.n=8", "data.max_prompt_length=192",
                 "data.max_response_length=512", "actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size=64",
                 "rollout.max_slots=256"]
    cfg, _ = resolve("qwen2_5_0_5b_gsm8k", shape + [
        f"data.path={data_dir}", "data.apply_chat_template=false", "data.prompt_template={prompt}", "model.path=null", f"model.tokenizer={tokenizer}",
        f"model.eos_token_id={eos_id}", f"trainer.total_steps={args.qwen_steps}", f"trainer.mesh=dp{n_devices}",
        "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=false", "trace.groups=0",
        "trace.ledgers=false", "trainer.logger=[console]"])
    return cfg


def _record_decode(sampler):
    """Wraps the sampler's generate / assemble to record decode seconds per decode step and the
    response lengths (the async model's t_step and length distribution), as async_pipeline does."""
    rec = {"decode_s": 0.0, "decode_steps": 0, "calls": 0, "lengths": []}
    gen, assemble = sampler.generate, sampler.assemble

    def recording_assemble(*a, **k):
        traj = assemble(*a, **k)
        rec["lengths"].extend(np.asarray(traj.response_length)[~np.asarray(traj.is_padding)].tolist())
        return traj

    def recording_generate(*a, **k):
        user, last = k.pop("on_chunk", None), {"steps": 0}

        def on_chunk(info):
            last["steps"] = info.total_steps
            if user is not None:
                user(info)

        traj = gen(*a, on_chunk=on_chunk, **k)
        rec["calls"] += 1
        if rec["calls"] > 1:  # the first call compiles the decode chunk
            rec["decode_s"] += traj.stats.decode_s
            rec["decode_steps"] += last["steps"]
        return traj

    sampler.generate, sampler.assemble = recording_generate, recording_assemble
    return rec


def part_qwen(args):
    import jax

    from rljax.sharding import make_mesh
    from rljax.trainer.loop import Trainer

    root = _dir(args, "qwen", "data")
    vocab, prompt_words = (300, 12) if args.smoke else (QWEN_VOCAB, 190)
    tokenizer, eos_id = build_qwen_inputs(root, vocab=vocab, prompt_words=prompt_words, n_train=256, n_test=32)
    n = jax.device_count()
    cfg = _qwen_config(args, root, tokenizer, eos_id, n)
    trainer = Trainer(cfg, make_mesh(f"dp{n}", jax.devices()), _fresh(os.path.join(_dir(args, "qwen"), "run")),
                      echo=lambda *a: None)
    rec = _record_decode(trainer.services.rollout.sampler)
    rows = []
    try:
        for _ in range(args.qwen_steps):
            rows.append(trainer.train_one_step())
    finally:
        trainer.schedule.close()
        trainer.tracer.close()
    steady = rows[1:] or rows  # the first step compiles

    def med(key):
        vals = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    learner_s = statistics.median(sum(r.get(f"timing_s/{k}", 0) for k in ("old_log_prob", "ref", "adv", "update_actor"))
                                  for r in steady)
    t_step = rec["decode_s"] / max(rec["decode_steps"], 1)
    inputs = {"t_step": t_step, "learner_s": learner_s, "sync_s": med("timing_s/update_weights") or 0.0,
              "devices": n, "lengths": rec["lengths"], "measured_at": time.strftime("%Y-%m-%d %H:%M"),
              "source": f"bench/accelerator.py qwen part ({_device()['device_kind']})"}
    with open(_out(args, "async_inputs.json"), "w") as fh:
        json.dump(inputs, fh)
    return {"steps": len(rows), "first_step_s": rows[0].get("timing_s/step"), "step_s": med("timing_s/step"),
            "gen_s": med("timing_s/gen"), "old_log_prob_s": med("timing_s/old_log_prob"), "ref_s": med("timing_s/ref"),
            "update_actor_s": med("timing_s/update_actor"), "weight_sync_s": med("timing_s/update_weights"),
            "mfu_actor": med("perf/mfu/actor"), "mfu_rollout": med("perf/mfu/rollout"),
            "rollout_tokens_per_s": med("perf/rollout_tokens_per_s"),
            "decode_tokens_per_s": (cfg.data.train_batch_size * cfg.rollout.n) / t_step if t_step else None,
            "decode_step_s": t_step, "response_length_mean": med("response_length/mean"),
            "peak_device_bytes": _peak_bytes(), "learner_s": learner_s, "vocab": vocab,
            "model": cfg.model.name, "trajectories": cfg.data.train_batch_size * cfg.rollout.n}


# ---------------------------------------------------------------------------- logprob


def part_logprob(args):
    import jax
    import jax.numpy as jnp

    import logprob_accelerator as lp

    backend = jax.default_backend()
    variants = lp.variants_for(backend, args.smoke)
    if args.smoke:  # the TPU kernel's interpreter is slow here; the GPU kernel's covers the path
        for label in ("pallas", "chunk-L"):
            variants.pop(label, None)
    shapes = lp.SMOKE_SHAPES[:1] if args.smoke else lp.SHAPES
    rows = []
    for n, h, v in shapes:
        for dtype in (jnp.float32, jnp.bfloat16):
            for r in lp.run_shape(n, h, v, dtype, variants, 1 if args.smoke else 5, "default"):
                rows.append(dict(r, N=n, H=h, V=v, dtype=jnp.dtype(dtype).name))
    return {"rows": rows, "variants": {k: list(v) for k, v in variants.items()}, "reference": "float64 (NumPy)"}


# ---------------------------------------------------------------------------- losses


def _loss_cases(np_rng, b, t, n_groups):
    """name -> (function of float arrays, inputs) for every array function of rljax.loss."""
    import jax.numpy as jnp

    import rljax.loss as L

    logp = np_rng.normal(-2.0, 1.0, (b, t))
    old = logp + np_rng.normal(0, 0.1, (b, t))
    ref = logp + np_rng.normal(0, 0.2, (b, t))
    adv = np_rng.normal(0, 1, (b, t))
    mask = (np_rng.random((b, t)) > 0.2).astype(float)
    scores = np_rng.normal(0, 1, (b,))
    groups = np.repeat(np.arange(n_groups), b // n_groups)
    values = np_rng.normal(0, 1, (b, t))
    logits = np_rng.normal(0, 3, (b, 64))
    cases = {}
    for mode in ("vanilla", "gspo", "cispo"):
        cases[f"policy_loss[{mode}]"] = (lambda lp_, o, a, m, mode=mode: L.policy_loss(lp_, o, a, m, mode=mode)[0],
                                         (logp, old, adv, mask))
    for kind in ("k1", "k2", "k3", "low_var_kl", "abs", "mse"):
        cases[f"kl_penalty[{kind}]"] = (lambda a, r, kind=kind: L.kl_penalty(a, r, kind=kind), (logp, ref))
    for mode in L.AGGREGATION_MODES:
        cases[f"aggregate[{mode}]"] = (lambda x, m, mode=mode: L.aggregate(x, m, mode=mode), (adv, mask))
    cases["value_loss"] = (lambda v, o, r, m: L.value_loss(v, o, r, m)[0], (values, values + 0.1, adv, mask))
    cases["grpo_advantages"] = (lambda s: L.grpo_advantages(s, groups, num_groups=n_groups), (scores,))
    cases["rloo_advantages"] = (lambda s: L.rloo_advantages(s, groups, num_groups=n_groups), (scores,))
    cases["reinforce_pp_baseline_advantages"] = (
        lambda s, m: L.reinforce_pp_baseline_advantages(s, groups, m, num_groups=n_groups), (scores, mask))
    cases["gae_advantages"] = (lambda r, v, m: L.gae_advantages(r, v, m, gamma=0.99, lam=0.95)[0], (adv, values, mask))
    cases["masked_whiten"] = (lambda x, m: L.masked_whiten(x, m), (adv, mask))
    cases["masked_var"] = (lambda x, m: L.masked_var(x, m), (adv, mask))
    cases["entropy_from_logits"] = (L.entropy_from_logits, (logits,))
    cases["rollout_correction_weights"] = (lambda o, r, m: L.rollout_correction_weights(o, r, m), (old, logp, mask))
    cases["mean_sequence_kl"] = (lambda k, m: L.mean_sequence_kl(k, m), (adv ** 2, mask))
    cases["rollout_mismatch"] = (lambda o, r, m: jnp.stack([v for _, v in sorted(L.rollout_mismatch(o, r, m).items())]),
                                 (old, logp, mask))
    return cases


def _errors(fn, inputs, cpu):
    """Per key of ``fn``'s dict of outputs: {precision: max |chip float32 - CPU reference| / max
    |CPU reference|, "reference": the reference's dtype}. The reference is ``fn`` on float64 inputs
    on the CPU; a function that computes in float32 whatever its inputs (most of rljax.loss casts)
    gives a float32 reference, and the row then compares the chip with the CPU, not with exact."""
    import jax
    import jax.numpy as jnp

    x64 = [jax.device_put(np.asarray(x, np.float64), cpu) for x in inputs]  # committed: runs on the CPU
    reference = jax.jit(fn)(*x64)
    out = {k: {"reference": str(w.dtype)} for k, w in reference.items()}
    want = {k: np.asarray(w, np.float64) for k, w in reference.items()}
    x32 = [jax.device_put(jnp.asarray(x, jnp.float32)) for x in inputs]
    for precision in ("default", "highest"):
        with jax.default_matmul_precision(precision):
            got = jax.jit(fn)(*x32)
        for k, w in want.items():
            scale = max(float(np.max(np.abs(w))), 1e-30)
            out[k][precision] = float(np.max(np.abs(np.asarray(got[k], np.float64) - w))) / scale
    return out


def part_losses(args):
    import jax

    jax.config.update("jax_enable_x64", True)  # the reference; the chip's inputs stay float32

    cpu = jax.devices("cpu")[0]
    b, t = (16, 24) if args.smoke else (256, 512)
    cases = _loss_cases(np.random.default_rng(0), b, t, 4)
    names = list(cases)
    arrays = [x for _, inputs in cases.values() for x in inputs]
    spans = np.cumsum([0] + [len(inputs) for _, inputs in cases.values()])

    def all_cases(*xs):  # one program per precision instead of one per function
        return {n: cases[n][0](*xs[spans[i]:spans[i + 1]]) for i, n in enumerate(names)}

    try:
        errors = _errors(all_cases, arrays, cpu)
    except Exception:  # find the failing function: one at a time, each its own row
        errors = {}
        for n in names:
            try:
                errors.update(_errors(lambda *xs, n=n: {n: cases[n][0](*xs)}, cases[n][1], cpu))
            except Exception as err:
                errors[n] = {"error": f"{type(err).__name__}: {str(err)[:160]}"}
    rows = [dict(function=n, **errors[n]) for n in names]
    return {"rows": rows, "batch": [b, t], "metric": "max |chip - CPU reference| / max |CPU reference|"}


# ---------------------------------------------------------------------------- async_model


# a row of async_pipeline's model table: "<placement>   <step s> <steps/h> <speed-up>x ..."
_SPEEDUP = re.compile(r"^((?:sync|async) .+?)\s{2,}\S+\s+\S+\s+([\d.]+)x\s")


def part_async_model(args):
    src = os.path.join(args.out, "async_inputs.json")
    if not os.path.exists(src):
        raise RuntimeError("no async_inputs.json: the qwen part did not finish")
    cmd = [sys.executable, os.path.join(BENCH, "async_pipeline.py"), "--model-from", src, "--length-scale", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    if p.returncode:
        raise RuntimeError(f"async_pipeline.py exit {p.returncode}: {p.stderr[-1500:]}")
    with open(src) as fh:
        inputs = json.load(fh)
    lines = p.stdout.strip().splitlines()
    speedups = {m.group(1): float(m.group(2)) for m in map(_SPEEDUP.match, lines) if m}
    return {"t_step": inputs["t_step"], "learner_s": inputs["learner_s"], "sync_s": inputs["sync_s"],
            "devices": inputs["devices"], "command": f"python bench/async_pipeline.py --model-from {src} "
            "--length-scale 1", "prediction": lines[-25:], "speedups": speedups}


PARTS = {"default_run": part_default_run, "qwen": part_qwen, "logprob": part_logprob, "losses": part_losses,
         "async_model": part_async_model}


# ---------------------------------------------------------------------------- the reports


def _fmt(x, spec=".3g"):
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)


def _md_part(name, res):
    out = [f"## {name}", ""]
    if res.get("status") != "ok":
        return out + [f"**{res.get('status', 'failed').upper()}** after {_fmt(res.get('seconds'))} s: "
                      f"`{res.get('error', '')[-400:]}`", ""]
    r = res["result"]
    if name == "logprob":
        out += ["| N | H | V | dtype | impl | temp GiB | fwd ms | fwd+bwd ms | err values | err grads | grad scale |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            if "error" in row:
                out.append(f"| {row['N']} | {row['H']} | {row['V']} | {row['dtype']} | {row['impl']} | "
                           f"{row['error'][:80]} | | | | | |")
                continue
            out.append(f"| {row['N']} | {row['H']} | {row['V']} | {row['dtype']} | {row['impl']} | "
                       f"{row['temp'] / 2**30:.3f} | {row['fwd'] * 1e3:.2f} | {row['fwdbwd'] * 1e3:.2f} | "
                       f"{row['diff_values']:.2e} | {row['diff_grads']:.2e} | {row['grad_scale']:.2e} |")
        out.append(f"\nerrors: max |impl - {r['reference']}|")
    elif name == "losses":
        out += [f"{r['metric']}, batch {r['batch']}; reference: the function on float64 inputs on the CPU "
                "(float32 where the function casts)", "", "| function | default | highest | reference |",
                "|---|---|---|---|"]
        for row in r["rows"]:
            if "error" in row:
                out.append(f"| {row['function']} | {row['error'][:80]} | | |")
            else:
                out.append(f"| {row['function']} | {row['default']:.2e} | {row['highest']:.2e} | "
                           f"{row['reference']} |")
    elif name == "async_model":
        out += [f"inputs: t_step {r['t_step']:.4g} s, learner_s {r['learner_s']:.4g} s, sync_s {r['sync_s']:.4g} s, "
                f"{r['devices']} device(s); `{r['command']}`", "", "```", *r["prediction"], "```"]
    else:
        out += ["| metric | value |", "|---|---|"]
        out += [f"| {k} | {_fmt(v)} |" for k, v in r.items() if not isinstance(v, (list, dict))]
    return out + [""]


def write_reports(args, results, device):
    doc = {"device": device, "smoke": args.smoke, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "load": os.getloadavg()[0], "parts": results}
    with open(_out(args, "accelerator.json"), "w") as fh:
        json.dump(doc, fh, indent=1, default=str)
    md = [f"# rljax on {device.get('device_kind', '?')} ({device.get('backend', '?')}, {device.get('devices', '?')} "
          f"device(s), jax {device.get('jax', '?')})", "",
          f"`python bench/accelerator.py{' --smoke' if args.smoke else ''}`, {doc['date']}, load {doc['load']:.2f}", ""]
    for name, res in results.items():
        md += _md_part(name, res)
    with open(_out(args, "accelerator.md"), "w") as fh:
        fh.write("\n".join(md))
    return "\n".join(md)


def _run_part(args, name):
    limit = args.limits[name]
    cmd = [sys.executable, os.path.abspath(__file__), "--part", name, "--out", args.out, "--qwen-steps",
           str(args.qwen_steps), "--inner-limit", str(max(limit - 10, 5))] + (["--smoke"] if args.smoke else [])
    start = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=REPO)
    except subprocess.TimeoutExpired as err:
        tail = (err.stderr or b"")[-1500:]
        return {"status": "timeout", "seconds": limit, "error": tail.decode() if isinstance(tail, bytes) else tail}
    seconds = time.perf_counter() - start
    path = os.path.join(args.out, "parts", f"{name}.json")
    if p.returncode or not os.path.exists(path):
        return {"status": "failed", "seconds": seconds, "error": (p.stderr or p.stdout)[-1500:]}
    with open(path) as fh:
        return {"status": "ok", "seconds": seconds, "result": json.load(fh)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="report directory (default: bench_out/accelerator[-smoke])")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on whatever backend (CPU: ~1 min)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    ap.add_argument("--limit", action="append", default=[], metavar="PART=SECONDS", help="override a part's limit")
    ap.add_argument("--qwen-steps", type=int, default=None, help="GRPO steps of the qwen part (default 3, smoke 2)")
    ap.add_argument("--part", choices=tuple(PARTS), help=argparse.SUPPRESS)
    ap.add_argument("--inner-limit", type=float, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.out = os.path.abspath(args.out or os.path.join(REPO, "bench_out", "accelerator" + ("-smoke" if args.smoke else "")))
    args.qwen_steps = args.qwen_steps or (2 if args.smoke else 3)
    if args.part:
        result = PARTS[args.part](args)
        with open(_out(args, "parts", f"{args.part}.json"), "w") as fh:
            json.dump(dict(result, device=_device()), fh, default=str)
        return
    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    args.limits = {n: LIMITS[n][1 if args.smoke else 0] for n in PARTS}
    for item in args.limit:
        key, _, value = item.partition("=")
        if key not in PARTS or not value.replace(".", "", 1).isdigit():
            ap.error(f"--limit {item!r}; accepted: PART=SECONDS with PART one of {', '.join(PARTS)}")
        args.limits[key] = float(value)
    if unknown or not names:
        ap.error(f"--parts {args.parts!r}; accepted: a comma-separated subset of {', '.join(PARTS)}")
    os.makedirs(os.path.join(args.out, "parts"), exist_ok=True)
    results = {}
    for name in names:
        results[name] = _run_part(args, name)
        print(f"{name}: {results[name]['status']} in {results[name]['seconds']:.1f} s", flush=True)
    device = next((r["result"]["device"] for r in results.values() if r.get("status") == "ok"), {})
    print(write_reports(args, results, device))
    print(f"\nreports: {_out(args, 'accelerator.json')}, {_out(args, 'accelerator.md')}")


if __name__ == "__main__":
    main()
