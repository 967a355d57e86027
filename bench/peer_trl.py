"""rljax vs Hugging Face TRL's ``GRPOTrainer`` at equal work, side by side on this machine.

    python bench/peer_trl.py                                   # every case, 2 rounds
    python bench/peer_trl.py --cases 31m:dp1 --rounds 3 --steps 6
    python bench/peer_trl.py --cases default:dp8 --steps 300 --warmup 0 --rounds 1   # reward curves

Needs the ``bench`` extra (``pip install -e '.[bench]'``: torch, transformers, trl, peft,
accelerate, datasets); without TRL only the rljax side runs, with a message.

Equal work. Both sides start from the same weights (``rljax.models.init_params`` exported
with ``save_hf_checkpoint``; rljax loads them back through ``model.path``), the same
tokenizer ids (the built-in character tokenizer, rebuilt as a ``PreTrainedTokenizerFast``
whose ids are checked against rljax's on every prompt), the same prompts in the same order
(rljax's own train iterator, dumped once; TRL reads them unshuffled), the same reward
(``rljax.reward`` embedded_reward on the decoded text), the same GRPO settings: group size,
prompts per step, response length (EOS ends a row early on both), temperature 1, no KL,
clip ratios 0.2 / 0.28, token-mean loss (TRL ``loss_type="dapo"``), group-std scaling,
AdamW (betas 0.9 / 0.99, no weight decay), learning rate with 10 warm-up updates, gradient
clipping 1.0, one PPO epoch, the same number of optimizer updates per generated batch
(TRL's ``steps_per_generation``), float32.

Each side runs in its own subprocess (so peak RSS is its own), the two alternating, ``--rounds``
times. A worker runs ``--warmup`` untimed steps (compilation) and then ``--steps`` timed
ones. Per-step stage times: rljax's own ``timing_s/*`` metrics; TRL's own profiling
contexts (``transformers.generate``, ``_prepare_inputs`` = generation + reward + old
log-probs, ``compute_loss``), with a step being one generated batch (``steps_per_generation``
optimizer steps, timed between ``on_step_end`` callbacks). ``update`` is, for rljax,
``update_actor``; for TRL, the step minus ``_prepare_inputs`` (forward, backward, clipping,
optimizer). The table gives medians over all timed steps of all rounds and, for the ratio, the
spread of the per-round ratios (the machine is shared: check the load average printed).

Cases (``name:mesh``; mesh is rljax's ``--mesh``, TRL always runs one process on the CPU):

* ``default``: ``configs/default.yaml`` (tiny model, 32 prompts x 16, 3 new tokens, 2
  updates per step);
* ``31m``: a 31.6M-parameter Qwen2 (hidden 512, 8 layers, 8 / 4 heads, MLP 2048, the
  character vocabulary), 8 prompts x 8, 32 new tokens, one update per step;
* ``31m-256``: the same with 256 new tokens;
* ``0.5b``: Qwen2.5-0.5B's shape (24 layers, hidden 896, tied 151,936-row embedding; 494M
  parameters), random weights exported once (float32), a byte-level BPE tokenizer whose ids index
  the whole embedding (``bench/_peer_bpe.py``, built here with ``tokenizers``; TRL loads the same
  ``tokenizer.json``), GSM8K-format questions of ~190 tokens (198-213), 2 prompts x 8 samples,
  64 new tokens, one update per step in micro-batches of 4 trajectories on both sides (``--micro``:
  16 at once without recompute needs ~20 GB on TRL's side, over the guard's limit), the reward ``bench/_peer_bpe.py:reward`` (the GSM8K answer,
  else a quarter of the digit share, so a random model's advantages are not all zero); rljax
  computes in bfloat16 (the ``qwen2.5-0.5b`` preset's ``model.dtype``) on float32 parameters, TRL
  in float32 unless ``--trl-bf16`` (its autocast mixed precision); each side's dtype is printed;
* ``bpe-smoke``: the ``0.5b`` case's pipeline on a 2-layer, hidden-64 model with a 2,048-id BPE
  (minutes, not hours: develop here first).

Memory guard (the machine is shared): before each worker starts, the parent waits until
``/proc/meminfo``'s MemAvailable reaches ``--min-available-gb`` (default: 17 for ``0.5b``, 0
otherwise; rljax's 0.5B step peaks near 14 GB RSS) and prints that it waits; while a worker runs
it polls the worker's RSS and kills it past ``--rss-limit-gb`` (default 16), reporting "killed at
RSS X" instead of letting the kernel's OOM killer pick someone else's process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CASES = {
    "default": dict(model="tiny", prompts=32, n=16, new_tokens=3, mini=16),
    "31m": dict(model="31m", prompts=8, n=8, new_tokens=32, mini=8),
    "31m-256": dict(model="31m", prompts=8, n=8, new_tokens=256, mini=8),
    "0.5b": dict(model="qwen2.5-0.5b", prompts=2, n=8, new_tokens=64, mini=2, micro=4, bpe=151936,
                 prompt_tokens=190, dtype="bfloat16", min_available_gb=17),
    "bpe-smoke": dict(model="bpe-smoke", prompts=2, n=4, new_tokens=8, mini=2, bpe=2048, prompt_tokens=190,
                      dtype="bfloat16"),
}
DEFAULT_CASES = "default:dp1,default:dp8,31m:dp1,31m:dp8,31m-256:dp1"
# The default preset's optimisation settings (configs/default.yaml), used by both sides.
LR, WARMUP, BETAS, CLIP_LOW, CLIP_HIGH, GRAD_CLIP = 3e-4, 10, (0.9, 0.99), 0.2, 0.28, 1.0


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --------------------------------------------------------------------------- preparation (parent)


def model_config(name: str, vocab_size: int, eos: int | None = None):
    from rljax.models.config import get_config

    if name in ("qwen2.5-0.5b", "bpe-smoke"):  # Qwen2: EOS pads, no BOS; float32 weights on disk
        base = get_config("qwen2.5-0.5b").replace(vocab_size=vocab_size, pad_token_id=eos, bos_token_id=None,
                                                  eos_token_id=eos, dtype="float32", param_dtype="float32")
        if name == "bpe-smoke":
            base = base.replace(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                                head_dim=16)
        return base
    base = get_config("tiny").replace(vocab_size=vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if name == "31m":
        base = base.replace(hidden_size=512, intermediate_size=2048, num_layers=8, num_heads=8, num_kv_heads=4,
                            head_dim=64)
    return base


def micro_batch(case: dict, spec: dict | None = None) -> int | None:
    """Trajectories per forward/backward on both sides (``--micro``, else the case's; None: the whole mini-batch)."""
    micro = (spec or {}).get("micro")
    micro = case.get("micro") if micro is None else micro
    return micro or None


def rljax_overrides(case: dict, mesh: str, ckpt: str, total_steps: int, data: dict | None = None,
                    micro: int | None = None) -> list[str]:
    if "bpe" in case:  # model.path's tokenizer.json; GSM8K-format files; the case's reward in process
        inputs = [f"model.path={ckpt}", f"model.dtype={case['dtype']}", "data.dataset=gsm8k",
                  f"data.path={data['path']}", "data.apply_chat_template=false", "data.prompt_template={prompt}",
                  f"data.max_prompt_length={data['longest']}", "data.shuffle=false",
                  f"reward.function={os.path.join(HERE, '_peer_bpe.py')}:reward", "reward.num_workers=0"]
    else:
        inputs = [f"model.path={ckpt}", "model.tokenizer=char"]
    return inputs + [f"trainer.mesh={mesh}",
            f"data.train_batch_size={case['prompts']}", f"rollout.n={case['n']}",
            f"data.max_response_length={case['new_tokens']}", f"actor.ppo_mini_batch_size={case['mini']}",
            *([f"actor.ppo_micro_batch_size={micro}"] if micro else []),
            f"trainer.total_steps={total_steps}", "trainer.test_freq=-1", "trainer.save_freq=-1",
            "trainer.val_before_train=false"]


def prepare(case_name: str, total_steps: int, workdir: str) -> dict:
    """Weights (HF checkpoint), the prompt stream and the tokenizer (its vocabulary, or for the BPE
    cases its ``tokenizer.json`` beside the weights), shared by both workers."""
    import jax

    from rljax.config import resolve
    from rljax.data import train_iterator
    from rljax.models import functional as F
    from rljax.models.hf import save_hf_checkpoint
    from rljax.models.tokenizer import SPECIAL_TOKENS, CharTokenizer, load_tokenizer

    case = CASES[case_name]
    ckpt = os.path.join(workdir, f"ckpt-{case['model']}")
    data = None
    if "bpe" in case:
        sys.path.insert(0, HERE)
        import _peer_bpe

        tok_dir = _peer_bpe.build_tokenizer(os.path.join(workdir, f"tok-{case['model']}"), case["bpe"])
        tok = load_tokenizer(tok_dir)
        data = dict(path=os.path.join(workdir, f"data-{case['model']}"))
        data["longest"] = _peer_bpe.write_gsm8k(data["path"], os.path.join(tok_dir, "tokenizer.json"),
                                                case["prompt_tokens"], rows=max(64, case["prompts"] * total_steps))
        mcfg = model_config(case["model"], case["bpe"], eos=tok.eos_id)
    else:
        tok = CharTokenizer()
        mcfg = model_config(case["model"], tok.vocab_size)
    if not os.path.isdir(ckpt):
        _, params = F.init_params(mcfg, seed=0)
        save_hf_checkpoint(ckpt, mcfg, params)
        del params
        if data is not None:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(os.path.join(tok_dir, name), ckpt)
    cfg, _ = resolve("default", rljax_overrides(case, "dp1", ckpt, total_steps, data))
    if data is not None:  # the trainer's own tokenizer and encoding (rljax.trainer.build)
        tok = load_tokenizer(ckpt)
    it = train_iterator(cfg, lambda s: tok.encode(s, add_bos=True), data_dir=os.path.join(workdir, "data"))
    batches = [[dict(text=p.prompt, ids=list(p.ids), answer=p.answer) for p in next(it)] for _ in range(total_steps)]
    vocab = None if data is not None else (
        list(SPECIAL_TOKENS) + [tok.decode([i]) for i in range(len(SPECIAL_TOKENS), tok.vocab_size)])
    jax.clear_caches()
    return dict(ckpt=ckpt, batches=batches, vocab=vocab, params_m=mcfg.num_params() / 1e6,
                data_dir=os.path.join(workdir, "data"), data=data)


# --------------------------------------------------------------------------- rljax worker


def worker_rljax(spec: dict) -> dict:
    from rljax.sharding.mesh import spec_device_count

    devices = spec_device_count(spec["mesh"])
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    t0 = time.perf_counter()
    from rljax.config import resolve
    from rljax.sharding import make_mesh
    from rljax.trainer.loop import Trainer

    case = CASES[spec["case"]]
    total = spec["warmup"] + spec["steps"]
    overrides = (rljax_overrides(case, spec["mesh"], spec["ckpt"], total, spec.get("data"), micro_batch(case, spec))
                 + [f"data.data_dir={spec['data_dir']}"])
    cfg, _ = resolve("default", overrides + spec.get("extra", []))
    run_dir = tempfile.mkdtemp(prefix="peer_trl_rljax_", dir=spec.get("workdir"))
    said: list[str] = []
    trainer = Trainer(cfg, make_mesh(spec["mesh"]), run_dir, echo=lambda *a, **k: said.append(" ".join(map(str, a))))
    startup = time.perf_counter() - t0
    rss_before = _rss_mb()
    steps = []
    for i in range(total):
        m = trainer.train_one_step()
        steps.append(dict(step=m["timing_s/step"], gen=m.get("timing_s/gen", 0.0), reward=m["critic/score/mean"],
                          update=m.get("timing_s/update_actor", 0.0), old_logp=m.get("timing_s/old_log_prob", 0.0),
                          reward_s=m.get("timing_s/reward", 0.0), sync=m.get("timing_s/update_weights", 0.0),
                          response_len=m.get("response_length/mean", float("nan"))))
    return dict(side="rljax", dtype=f"{cfg.model.dtype} compute, {cfg.model.param_dtype} params",
                remat=next((line.split(" (")[0] for line in said if "remat" in line), "?"),
                startup_s=startup, rss_before_first_step_mb=rss_before, peak_rss_mb=_peak_rss_mb(),
                steps=steps)


# --------------------------------------------------------------------------- TRL worker


def _hf_tokenizer(vocab: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    ids = {t: i for i, t in enumerate(vocab) if t and t not in vocab[:i]}
    tok = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok.add_special_tokens(["<pad>", "<bos>", "<eos>", "<unk>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", padding_side="left")


def worker_trl(spec: dict) -> dict:
    t0 = time.perf_counter()
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from trl.extras import profiling

    from rljax.reward._rules import embedded_reward

    case = CASES[spec["case"]]
    torch.manual_seed(0)
    if "bpe" in case:  # the same tokenizer.json rljax loads from model.path
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_file=os.path.join(spec["ckpt"], "tokenizer.json"), eos_token="<|endoftext|>",
            pad_token="<|endoftext|>", padding_side="left")
        sys.path.insert(0, HERE)
        from _peer_bpe import reward as score
    else:
        tokenizer = _hf_tokenizer(spec["vocab"])
        score = embedded_reward
    rows = [p for batch in spec["batches"] for p in batch]
    for p in rows:  # same ids as rljax's tokenizer, or the comparison is off
        got = tokenizer(p["text"])["input_ids"]
        if got != p["ids"]:
            raise SystemExit(f"tokenizer mismatch on {p['text']!r}: {got} vs rljax {p['ids']}")
    dataset = Dataset.from_dict({"prompt": [p["text"] for p in rows], "answer": [p["answer"] for p in rows]})

    def reward(completions, answer, **kw):
        return [score(c, a) for c, a in zip(completions, answer)]

    reward.__name__ = score.__name__
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["ckpt"], dtype=torch.float32)
    updates = case["prompts"] // case["mini"]
    trajectories = case["prompts"] * case["n"]
    micro = micro_batch(case, spec) or trajectories // updates  # one optimizer step per mini-batch either way
    accumulate = trajectories // updates // micro
    total = spec["warmup"] + spec["steps"]
    args = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="peer_trl_trl_", dir=spec.get("workdir")), use_cpu=True, bf16=bool(spec.get("trl_bf16")), fp16=False,
        report_to="none",
        per_device_train_batch_size=micro, gradient_accumulation_steps=accumulate,
        steps_per_generation=updates * accumulate, num_generations=case["n"], max_completion_length=case["new_tokens"],
        max_steps=total * updates, num_iterations=1, learning_rate=LR, lr_scheduler_type="constant_with_warmup",
        warmup_steps=WARMUP, adam_beta1=BETAS[0], adam_beta2=BETAS[1], weight_decay=0.0, max_grad_norm=GRAD_CLIP,
        beta=0.0, epsilon=CLIP_LOW, epsilon_high=CLIP_HIGH, loss_type="dapo", scale_rewards="group",
        temperature=1.0, top_p=1.0, top_k=0, shuffle_dataset=False, logging_steps=1, save_strategy="no",
        seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True, log_completions=False,
        **({} if spec.get("trl_gc") is None else {"gradient_checkpointing": spec["trl_gc"]}),
    )

    stage: dict[str, float] = {}
    original = profiling.ProfilingContext._log_metrics

    def record(self, duration):
        stage[self.name] = stage.get(self.name, 0.0) + duration
        return original(self, duration)

    profiling.ProfilingContext._log_metrics = record
    marks: list[tuple[float, dict]] = []
    rewards: list[float] = []
    lengths: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks.append((time.perf_counter(), dict(stage)))

        def on_step_end(self, *a, **k):
            marks.append((time.perf_counter(), dict(stage)))

        def on_log(self, args, state, control, logs=None, **k):  # logged once per generated batch
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
                lengths.append(float(logs.get("completions/mean_length", float("nan"))))

    trainer = trl.GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[Clock()])
    startup = time.perf_counter() - t0
    rss_before = _rss_mb()
    trainer.train()

    def delta(a, b, key):
        return sum(v for k, v in b.items() if key in k) - sum(v for k, v in a.items() if key in k)

    steps = []
    for i in range(total):  # a step = one generated batch = `updates` optimizer steps
        (ta, sa), (tb, sb) = marks[i * updates], marks[(i + 1) * updates]
        prepare_s, gen_s = delta(sa, sb, "_prepare_inputs"), delta(sa, sb, "transformers.generate")
        reward_s = delta(sa, sb, "_calculate_rewards")
        # _prepare_inputs = generation + reward + old log-probs (when off-policy) + tokenizing / padding
        steps.append(dict(step=tb - ta, gen=gen_s, update=(tb - ta) - prepare_s, old_logp=prepare_s - gen_s - reward_s,
                          prepare=prepare_s, reward_s=reward_s,
                          reward=rewards[i] if i < len(rewards) else float("nan"),
                          response_len=lengths[i] if i < len(lengths) else float("nan")))
    dtype = f"{'bfloat16 autocast' if args.bf16 else 'float32'} compute, {next(model.parameters()).dtype} params"
    return dict(side="trl", dtype=dtype, startup_s=startup, rss_before_first_step_mb=rss_before, peak_rss_mb=_peak_rss_mb(),
                steps=steps, gradient_checkpointing=bool(args.gradient_checkpointing), stage_totals=stage, versions=dict(trl=trl.__version__, torch=torch.__version__,
                                           transformers=transformers.__version__))


# --------------------------------------------------------------------------- parent


def mem_available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024**2
    return float("nan")


def wait_for_memory(need_gb: float, label: str, poll_s: float = 10.0) -> None:
    """Blocks until MemAvailable >= ``need_gb``, saying so (once, then every minute) while it waits."""
    said = 0.0
    while (have := mem_available_gb()) < need_gb:
        if time.monotonic() - said > 60:
            print(f"  {label}: waiting for MemAvailable >= {need_gb:.0f} GiB (now {have:.1f} GiB, load "
                  f"{os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
            said = time.monotonic()
        time.sleep(poll_s)


def _tree_rss_mb(pid: int) -> float:
    """RSS of ``pid`` and its descendants (a reward worker or compiler child counts too)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0) / 1024
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def guarded_run(cmd: list[str], env: dict, workdir: str, tag: str, *, timeout: float, rss_limit_mb: float,
                poll_s: float = 0.5) -> tuple[int, str, str, float, str | None]:
    """Runs ``cmd`` and polls its RSS; past ``rss_limit_mb`` (or ``timeout``) kills it (its own process
    group). Returns ``(exit code, stdout, stderr, highest RSS seen in MB, why it was killed or None)``."""
    out_path, err_path = os.path.join(workdir, f"{tag}.out"), os.path.join(workdir, f"{tag}.err")
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            high, killed = _watch(proc, time.monotonic(), timeout, rss_limit_mb, poll_s)
        finally:  # the parent stopped (Ctrl-C, SIGTERM): its worker's own session goes with it
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    with open(out_path) as out, open(err_path) as err:
        return proc.returncode, out.read(), err.read(), high, killed


def _watch(proc, start: float, timeout: float, rss_limit_mb: float, poll_s: float) -> tuple[float, str | None]:
    """Polls ``proc``'s RSS until it exits; kills it (its process group) past the limit or the timeout."""
    high = 0.0
    while proc.poll() is None:
        rss = _tree_rss_mb(proc.pid)
        high = max(high, rss)
        killed = (f"killed at RSS {rss / 1024:.1f} GiB (limit {rss_limit_mb / 1024:.1f} GiB)" if rss > rss_limit_mb
                  else f"killed after {timeout:.0f} s (--timeout)" if time.monotonic() - start > timeout else None)
        if killed:
            os.killpg(proc.pid, 9)
            proc.wait()
            return high, killed
        time.sleep(poll_s)
    return high, None


def run_worker(side: str, spec: dict, workdir: str, timeout: float, rss_limit_gb: float = 16.0,
               min_available_gb: float = 0.0) -> dict:
    path = os.path.join(workdir, f"spec-{side}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    wait_for_memory(min_available_gb, f"{spec['case']} {side}")
    code, stdout, stderr, high, killed = guarded_run(
        [sys.executable, os.path.abspath(__file__), "--worker", side, "--spec", path], env, workdir,
        f"worker-{side}", timeout=timeout, rss_limit_mb=rss_limit_gb * 1024)
    if killed:
        raise RuntimeError(f"{side} worker {killed}; its last output:\n{stderr[-2000:]}")
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[len("RESULT "):])
            res["polled_rss_mb"] = high
            return res
    raise RuntimeError(f"{side} worker failed (exit {code}):\n{stderr[-4000:]}")


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def summarise(case_label: str, params_m: float, results: dict[str, list[dict]], warmup: int,
              batches: list | None = None, case: dict | None = None) -> list[str]:
    """The table's rows of one case: per side the stage medians, tokens/s (prompt + response tokens of
    the step's trajectories over its median time) and RSS; then the ratios rljax / TRL."""
    lines = []
    timed = {side: [s for r in runs for s in r["steps"][warmup:]] for side, runs in results.items()}
    med = {side: {k: _median([s[k] for s in steps]) for k in ("step", "gen", "update", "old_logp", "reward_s")}
           for side, steps in timed.items()}
    rss = {side: max(r["peak_rss_mb"] for r in runs) for side, runs in results.items()}
    base = {side: max(r["rss_before_first_step_mb"] for r in runs) for side, runs in results.items()}
    prompt_tokens = (statistics.mean(sum(len(p["ids"]) for p in b) for b in batches[warmup:] or batches) * case["n"]
                     if batches and case else float("nan"))
    trajectories = case["prompts"] * case["n"] if case else float("nan")
    for side in results:
        m = med[side]
        resp = _median([s.get("response_len", float("nan")) for s in timed[side]])
        tok_s = (prompt_tokens + trajectories * resp) / m["step"]
        lines.append(f"{case_label:<14}{params_m:>7.1f}M  {side:<6}{m['step']:>8.3f}{m['gen']:>8.3f}{m['update']:>8.3f}"
                     f"{m['old_logp']:>8.3f}{tok_s:>8.0f}{base[side]:>9.0f}{rss[side]:>9.0f}  "
                     f"{results[side][0].get('dtype', '?')}; resp {resp:.1f} tok")
    if "trl" in results and "rljax" in results:
        ratios = {}
        for key in ("step", "gen", "update"):
            per_round = [_median([s[key] for s in a["steps"][warmup:]]) / _median([s[key] for s in b["steps"][warmup:]])
                         for a, b in zip(results["rljax"], results["trl"])]
            ratios[key] = (med["rljax"][key] / med["trl"][key], min(per_round), max(per_round))
        lines.append(f"{'':<14}{'':>8}  {'ratio':<6}" + "".join(
            f"  {k} {r:.2f}x [{lo:.2f}-{hi:.2f}]" for k, (r, lo, hi) in ratios.items())
            + f"  peak RSS {rss['rljax'] / rss['trl']:.2f}x")
    return lines


def reward_curves(case_label: str, results: dict[str, list[dict]], points: int = 8) -> list[str]:
    lines = []
    for side, runs in results.items():
        curve = [statistics.mean(r["steps"][i]["reward"] for r in runs) for i in range(len(runs[0]["steps"]))]
        idx = sorted({round(j * (len(curve) - 1) / max(points - 1, 1)) for j in range(points)})
        lines.append(f"  {case_label} {side:<6} reward by step: " + ", ".join(f"{i + 1}:{curve[i]:.3f}" for i in idx))
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help=f"comma-separated name:mesh, names from {', '.join(CASES)}")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rljax / TRL runs per case")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per run (compilation)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run")
    ap.add_argument("--only", choices=("rljax", "trl"), help="run one side only")
    ap.add_argument("--rljax-extra", default="", help="extra rljax overrides (space-separated key=value)")
    ap.add_argument("--trl-gc", choices=("default", "on", "off"), default="default",
                    help="TRL gradient checkpointing (GRPOConfig's default is on)")
    ap.add_argument("--micro", type=int, default=None,
                    help="trajectories per forward/backward on both sides (rljax actor.ppo_micro_batch_size, TRL "
                         "per_device_train_batch_size with gradient accumulation); default: the case's "
                         "(4 for 0.5b, else the whole mini-batch); 0: the whole mini-batch")
    ap.add_argument("--trl-bf16", action="store_true",
                    help="TRL in bfloat16 mixed precision (GRPOConfig bf16=True: autocast); default float32")
    ap.add_argument("--rss-limit-gb", type=float, default=16.0,
                    help="kill a worker whose RSS (with its children) passes this many GiB")
    ap.add_argument("--min-available-gb", type=float, default=None,
                    help="wait before each worker until MemAvailable reaches this (default: the case's, 17 for 0.5b)")
    ap.add_argument("--verbose", action="store_true", help="print each worker's raw result")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per worker run")
    ap.add_argument("--worker", choices=("rljax", "trl", "prepare"), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # unwinds guarded_run's finally: no orphaned worker

    if args.worker:
        with open(args.spec) as f:
            spec = json.load(f)
        work = dict(rljax=worker_rljax, trl=worker_trl, prepare=lambda sp: prepare(sp["case"], sp["steps"], sp["workdir"]))
        out = work[args.worker](spec)
        print("RESULT " + json.dumps(out), flush=True)
        return

    cases = []
    for item in args.cases.split(","):
        name, _, mesh = item.partition(":")
        if name not in CASES:
            ap.error(f"unknown case {name!r}; accepted: {', '.join(CASES)}")
        cases.append((name, mesh or "dp1"))
    sides = ["rljax", "trl"]
    try:
        import trl  # noqa: F401
    except ImportError:
        print("bench/peer_trl.py: TRL is not installed (pip install -e '.[bench]'); running the rljax side only",
              file=sys.stderr)
        sides = ["rljax"]
    if args.only:
        sides = [args.only]

    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average {os.getloadavg()[0]:.2f} at start; {os.cpu_count()} cpus; {args.rounds} rounds, "
          f"{args.warmup} warm-up + {args.steps} timed steps per run")
    header = (f"{'case':<14}{'params':>8}  {'side':<6}{'step s':>8}{'gen s':>8}{'upd s':>8}{'oldlp s':>8}{'tok/s':>8}"
              f"{'RSS0 MB':>9}{'peak MB':>9}  dtype")
    table, curves = [], []
    with tempfile.TemporaryDirectory(prefix="peer_trl_") as workdir:
        prepared = {}
        for name, mesh in cases:
            need = CASES[name].get("min_available_gb", 0) if args.min_available_gb is None else args.min_available_gb
            if name not in prepared:  # in a guarded child too: a 0.5B init + export holds a few GB
                prepared[name] = run_worker("prepare", dict(case=name, steps=args.warmup + args.steps, workdir=workdir),
                                            workdir, args.timeout, args.rss_limit_gb, min(need, 8))
            prep = prepared[name]
            label = f"{name}:{mesh}"
            results: dict[str, list[dict]] = {s: [] for s in sides}
            killed = None
            for r in range(args.rounds if killed is None else 0):
                for side in (sides if r % 2 == 0 else sides[::-1]):
                    spec = dict(case=name, mesh=mesh, ckpt=prep["ckpt"], batches=prep["batches"], vocab=prep["vocab"],
                                data_dir=prep["data_dir"], data=prep["data"], workdir=workdir, warmup=args.warmup, steps=args.steps,
                                extra=args.rljax_extra.split(), trl_bf16=args.trl_bf16, micro=args.micro,
                                trl_gc=None if args.trl_gc == "default" else args.trl_gc == "on")
                    t = time.perf_counter()
                    try:
                        res = run_worker(side, spec, workdir, args.timeout, args.rss_limit_gb, need)
                    except RuntimeError as e:
                        if " killed " not in str(e):
                            raise
                        killed = f"{label} round {r + 1} {side} worker {str(e).split(' worker ', 1)[1].splitlines()[0]}"
                        print("  " + killed, file=sys.stderr, flush=True)
                        break
                    results[side].append(res)
                    med = _median([s["step"] for s in res["steps"][args.warmup:]])
                    if args.verbose:
                        print(json.dumps({k: v for k, v in res.items() if k != "steps"}), res["steps"], file=sys.stderr)
                    print(f"  {label} round {r + 1} {side}: {med:.3f} s/step (median), peak RSS "
                          f"{res['peak_rss_mb']:.0f} MB, startup {res['startup_s']:.1f} s, run {time.perf_counter() - t:.0f} s, "
                          f"load {os.getloadavg()[0]:.2f}; {res.get('dtype', '')}; "
                          + (f"gradient checkpointing {res['gradient_checkpointing']}" if side == "trl"
                             else str(res.get("remat", "")).strip()), file=sys.stderr, flush=True)
                if killed:
                    break
            if killed:
                table.append(f"{label:<14} {killed}")
            results = {side: runs for side, runs in results.items() if runs}
            if results:
                table += summarise(label, prep["params_m"], results, args.warmup, prep["batches"], CASES[name])
                curves += reward_curves(label, results)
            print("\n".join([header] + table[-3:]), flush=True)
    print(f"\nload average {os.getloadavg()[0]:.2f} at end")
    print(header)
    print("\n".join(table))
    print("\n".join(curves))


if __name__ == "__main__":
    main()
