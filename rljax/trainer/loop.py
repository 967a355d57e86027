"""The step loop: rollout -> reward -> old/ref log-probs -> advantages -> actor update ->
weight sync, with metrics, validation and checkpoints.

The loop is host code that schedules; every computation is a jitted pure function
(:mod:`rljax.trainer.step`, :mod:`rljax.loss`, the sampler's decode chunks). Randomness is
derived from ``(trainer.seed, step)`` and the sampler's ``(seed, uid, session)`` streams, so
``N`` steps, a resume and ``N`` more steps give the same numbers as ``2N`` steps.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from rljax import loss as rl
from rljax.config import Config
from rljax.trace import MetricsWriter, Tracer, plot_report
from rljax.trainer.checkpoint import Checkpointer
from rljax.trainer.critic import CriticStepConfig, critic_loss, critic_values, init_critic, outcome_token_rewards
from rljax.trainer.step import StepConfig, TrainState, init_state, make_logprob_fn, make_optimizer, make_train_step

log = logging.getLogger("rljax")

STAGES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "update_weights",
          "testing", "save_checkpoint")


@dataclasses.dataclass
class RunSummary:
    steps: int
    tokens: int
    wall_s: float
    stage_s: dict[str, float]
    train_reward: Optional[float]
    val_reward_before: Optional[float]
    val_reward: Optional[float]
    run_dir: str
    resumed_from: Optional[int]
    trace_overhead: Optional[str] = None


def to_host(tree):
    """Device arrays -> NumPy, also for arrays spread over several processes (multi-host)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def place(host: dict, mesh) -> dict:
    """Host NumPy batch fields -> global arrays laid out with the batch specs (``dp`` on rows,
    ``sp`` on the sequence). Every process holds the same host values (the sampler is
    deterministic per ``(seed, uid, session)``), so each fills in the shards it owns."""
    from rljax.sharding import batch_shardings

    shardings = batch_shardings(host, mesh)
    return {k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx]) for k, v in host.items()}


def _model(cfg: Config, mesh, tokenizer):
    """``(model_config, graphdef, params)``: from ``model.path`` (HF) or a preset sized to the tokenizer."""
    from rljax.models import functional as F
    from rljax.models.config import get_config

    if cfg.model.path:
        from rljax.models.hf import load_hf_checkpoint

        mcfg, params = load_hf_checkpoint(cfg.model.path, dtype=cfg.model.dtype, mesh=mesh)
        graphdef, _ = F.abstract_params(mcfg)
        return mcfg, graphdef, params
    overrides = dict(dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype, remat=cfg.model.remat)
    base = get_config(cfg.model.name)
    if tokenizer.vocab_size != base.vocab_size:
        # A preset trained from scratch takes the tokenizer's vocabulary (the embedded task's
        # character vocabulary is far smaller than the preset's).
        overrides.update(vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_id,
                         bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
    mcfg = base.replace(**overrides)
    graphdef, params = F.init_params(mcfg, seed=cfg.trainer.seed, mesh=mesh)
    return mcfg, graphdef, params


def _optimizer(optim, grad_clip, total_steps: int):
    """AdamW from an ``actor.optim`` / ``critic.optim`` section; ``total_steps`` counts updates."""
    return make_optimizer(lr=optim.lr, weight_decay=optim.weight_decay, warmup_steps=optim.warmup_steps,
                          grad_clip=grad_clip, betas=tuple(optim.betas), eps=optim.eps,
                          scheduler=optim.lr_scheduler, total_steps=total_steps, min_lr_ratio=optim.min_lr_ratio)


def _tokenizer(cfg: Config):
    from rljax.models.tokenizer import CharTokenizer, load_tokenizer

    spec = cfg.model.tokenizer
    if spec in (None, "char") and not (spec is None and cfg.model.path):
        return CharTokenizer()
    return load_tokenizer(spec or cfg.model.path)


class _Timer:
    def __init__(self):
        self.step: dict[str, float] = {}
        self.total: dict[str, float] = {s: 0.0 for s in STAGES}

    def __call__(self, stage: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                dt = time.perf_counter() - self.t
                timer.step[stage] = timer.step.get(stage, 0.0) + dt
                timer.total[stage] = timer.total.get(stage, 0.0) + dt

        return _Ctx()


def _progress(step: int, total: int, reward: float, step_times: list[float]) -> None:
    """One progress line; the ETA uses the median of recent step times (the first step of a
    run compiles everything and would inflate a plain average)."""
    recent = sorted(step_times[1:][-20:] or step_times)
    eta = (total - step) * recent[len(recent) // 2]
    bar_w = 24
    filled = int(bar_w * step / total)
    line = (f"[{'#' * filled}{'.' * (bar_w - filled)}] step {step}/{total} | reward {reward:.3f} | "
            f"{step_times[-1]:.2f}s/step | ETA {int(eta // 60)}m{int(eta % 60):02d}s")
    end = "\r" if sys.stderr.isatty() and step < total else "\n"
    print(line, file=sys.stderr, end=end, flush=True)


class Trainer:
    """Owns the run: model, sampler, optimizer state, data position, outputs.

    Args:
      cfg: the resolved configuration.
      mesh: the learner mesh (``rljax.sharding.make_mesh``).
      run_dir: where outputs and checkpoints go.
      resume: continue from the newest complete checkpoint in ``run_dir``.
    """

    def __init__(self, cfg: Config, mesh, run_dir: str, *, resume: bool = False, echo: Callable = print):
        from rljax.data import train_iterator, val_iterator
        from rljax.reward import get_reward_fn
        from rljax.rollout import DecodeParams, RljaxEngine, Sampler, sampler_mesh

        self.cfg, self.mesh, self.run_dir, self.echo = cfg, mesh, run_dir, echo
        self.sizes = dict(mesh.shape)
        d, a, r = cfg.data, cfg.actor, cfg.rollout
        self.tokenizer = _tokenizer(cfg)
        self.model_config, self.graphdef, params = _model(cfg, mesh, self.tokenizer)
        self.prompt_len, self.response_len = d.max_prompt_length, d.max_response_length
        # The learner's [B, S+T] layout rounds S and T up to multiples of sp, so the sequence
        # splits evenly; the extra columns are padding (masked everywhere).
        sp = self.sizes.get("sp", 1)
        self.learn_prompt_len = -(-self.prompt_len // sp) * sp
        self.learn_response_len = -(-self.response_len // sp) * sp
        self.reward_fn = get_reward_fn(cfg.reward.function, dataset=d.dataset)
        data_dir = d.data_dir or os.path.join(run_dir, "data")
        if jax.process_count() > 1:  # TFDS does not guard two processes building one dataset
            data_dir = os.path.join(data_dir, f"process{jax.process_index()}")
        self.tokenize = lambda text: self.tokenizer.encode(text, add_bos=True)
        self._train_iterator = lambda state=None: train_iterator(cfg, self.tokenize, data_dir=data_dir, state=state)
        self._val_iterator = lambda: val_iterator(cfg, self.tokenize, data_dir=data_dir)
        self.data = self._train_iterator()

        trajectories = d.train_batch_size * r.n
        micro = a.ppo_micro_batch_size or a.ppo_mini_batch_size * r.n
        self.step_config = StepConfig(
            policy_loss=a.policy_loss, clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
            clip_ratio_c=a.clip_ratio_c, loss_agg_mode=a.loss_agg_mode, use_kl_loss=a.use_kl_loss,
            kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type, entropy_coeff=a.entropy_coeff,
            ppo_epochs=a.ppo_epochs, ppo_mini_batch_size=a.ppo_mini_batch_size * r.n, ppo_micro_batch_size=micro,
            temperature=r.temperature, logprob_impl=a.logprob_impl, use_rollout_correction=r.correction != "none")
        updates = cfg.trainer.total_steps * a.ppo_epochs * (trajectories // self.step_config.ppo_mini_batch_size)
        self.optimizer = _optimizer(a.optim, a.grad_clip, updates)
        self.train_step = make_train_step(self.graphdef, self.optimizer, self.step_config, mesh=mesh)
        self.logprob_fn = make_logprob_fn(self.graphdef, response_len=self.learn_response_len, temperature=r.temperature,
                                          impl=a.logprob_impl, mesh=mesh, micro_batch_size=micro)
        self._advantages_fn = jax.jit(self._advantages, static_argnums=4)
        self.critic_state = None
        if cfg.algorithm.adv_estimator == "gae":  # PPO: a value model beside the policy
            c = cfg.critic
            critic_cfg = CriticStepConfig(cliprange_value=c.cliprange_value, loss_agg_mode=c.loss_agg_mode,
                                          ppo_epochs=a.ppo_epochs, ppo_mini_batch_size=self.step_config.ppo_mini_batch_size,
                                          ppo_micro_batch_size=micro)
            critic_opt = _optimizer(c.optim, c.grad_clip, updates)
            self.critic_state = init_state(init_critic(params), critic_opt)
            self.critic_step = make_train_step(self.graphdef, critic_opt, critic_cfg, mesh=mesh, loss_fn=critic_loss)
            self.values_fn = jax.jit(lambda p, b: critic_values(self.graphdef, p, b, response_len=self.learn_response_len,
                                                                mesh=mesh))
        self.needs_ref = a.use_kl_loss or cfg.algorithm.use_kl_in_reward
        self.ref_params = jax.tree.map(jnp.copy, params) if self.needs_ref else None
        self.state = init_state(params, self.optimizer)
        self.version = 0
        self.step = 0
        self.resumed_from = None

        eos = (self.tokenizer.eos_id,)
        top_k = max(r.top_k, 0)
        self.decode = DecodeParams(max_new_tokens=self.response_len, temperature=r.temperature, top_k=top_k,
                                   top_p=r.top_p, seed=cfg.trainer.seed, eos_ids=eos)
        v = r.val_kwargs
        self.val_decode = DecodeParams(max_new_tokens=self.response_len, temperature=v.temperature,
                                       top_k=max(v.top_k, 0), top_p=v.top_p, seed=cfg.trainer.seed + 1, eos_ids=eos)
        engine = RljaxEngine(self.model_config, num_slots=r.max_slots or trajectories,
                             max_prefill_length=self.prompt_len, max_decode_length=self.response_len,
                             mesh=sampler_mesh(r.tp, jax.local_devices()),
                             prefill_batch_size=min(d.train_batch_size, 64))
        # Each process runs a sampler on its own devices (same prompts, same random streams).
        self.sampler = Sampler(engine, self._sampler_weights(params), version=0, truncation="error")

        os.makedirs(run_dir, exist_ok=True)
        self.checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"),
                                         max_to_keep=cfg.trainer.max_checkpoints or 1000)
        if resume:
            self._restore()
        self.main = jax.process_index() == 0
        self.metrics = MetricsWriter(run_dir, enabled=self.main)
        self.timer = _Timer()
        self.tracer = Tracer(cfg, mesh, run_dir, enabled=self.main, owner=self)

    @staticmethod
    def _sampler_weights(params):
        """What the sampler reshards from: the learner's arrays, or their gathered values on
        multi-host (the sampler mesh is process-local)."""
        return params if jax.process_count() == 1 else to_host(params)

    # ------------------------------------------------------------------ checkpoints

    def _restore(self) -> None:
        latest = self.checkpointer.latest_step()
        if latest is None:
            self.echo(f"resume: no complete checkpoint in {self.checkpointer.directory}; starting from step 0")
            return
        state, meta = self.checkpointer.restore(latest, self._checkpoint_state())
        self.state, self.critic_state = state["actor"], state.get("critic")
        self.step, self.version = int(meta["step"]), int(meta["version"])
        self.data = self._train_iterator(state=meta["data"])
        self.sampler.update_weights(self._sampler_weights(self.state.params), self.version)
        self.resumed_from = latest
        self.echo(f"resume: restored step {self.step} (weight version {self.version}) from checkpoint {latest}")

    def save(self) -> None:
        from rljax.config import to_dict

        meta = {"step": self.step, "version": self.version, "data": self.data.state(), "config": to_dict(self.cfg)}
        self.checkpointer.save(self.step, self._checkpoint_state(), meta)

    def _checkpoint_state(self) -> dict:
        state = {"actor": self.state}
        if self.critic_state is not None:
            state["critic"] = self.critic_state
        return state

    # ------------------------------------------------------------------ one step

    def _host_batch(self, traj) -> dict:
        """Learner batch (NumPy) from a rollout: fixed ``[B, S+T]`` layout, left-padded prompts."""
        b, s = traj.prompt_ids.shape
        left = ((0, 0), (self.learn_prompt_len - s, 0))
        right = ((0, 0), (0, self.learn_response_len - traj.response_ids.shape[1]))
        prompt_ids = np.pad(traj.prompt_ids, left, constant_values=traj.pad_id)
        response_ids = np.pad(traj.response_ids, right, constant_values=traj.pad_id)
        attention = np.concatenate([np.pad(traj.prompt_mask, left), np.pad(traj.response_mask, right)], axis=1)
        return {
            "input_ids": np.concatenate([prompt_ids, response_ids], axis=1).astype(np.int32),
            "attention_mask": attention,
            "positions": np.maximum(np.cumsum(attention, axis=1) - 1, 0).astype(np.int32),
            "loss_mask": np.pad(traj.loss_mask, right).astype(np.float32),
            "rollout_logp": np.pad(traj.rollout_logp, right).astype(np.float32),
        }

    def _advantages(self, scores: jax.Array, group_ids: jax.Array, row: jax.Array, mask: jax.Array,
                    num_groups: int) -> jax.Array:
        name = self.cfg.algorithm.adv_estimator
        if name == "grpo":
            adv = rl.grpo_advantages(scores, group_ids, num_groups=num_groups, row_mask=row,
                                     scale_by_std=self.cfg.algorithm.norm_adv_by_std_in_grpo)
        elif name == "rloo":
            adv = rl.rloo_advantages(scores, group_ids, num_groups=num_groups, row_mask=row)
        elif name == "reinforce_plus_plus_baseline":
            return rl.reinforce_pp_baseline_advantages(scores, group_ids, mask, num_groups=num_groups)
        else:
            raise ValueError(f"algorithm.adv_estimator={name!r} is not supported by the trainer; "
                             "accepted: grpo, rloo, reinforce_plus_plus_baseline, gae")
        return adv[:, None] * mask

    def _rollout(self, prompts, decode, uids, n):
        return self.sampler.generate([p.ids for p in prompts], uids=uids, n=n, decode=decode)

    def _score(self, traj, prompts, n) -> tuple[np.ndarray, Any]:
        from rljax.reward import score_batch

        responses = [self.tokenizer.decode(traj.response_ids[i, : traj.response_length[i]])
                     for i in range(traj.batch_size)]
        answers = [prompts[traj.group_id[i]].answer if not traj.is_padding[i] else "" for i in range(traj.batch_size)]
        return score_batch(self.reward_fn, responses, answers, list(traj.uid),
                           max_error_fraction=self.cfg.reward.max_error_fraction, is_padding=traj.is_padding)

    def train_one_step(self) -> dict:
        cfg, timer = self.cfg, self.timer
        timer.step = {}
        t_step = time.perf_counter()
        self.step += 1
        prompts = next(self.data)
        uids = [f"{self.step}-{i}" for i in range(len(prompts))]
        self.tracer.submit(self.step, prompts, uids, version=self.version, decode=self.decode, t_step=t_step)
        with timer("gen"):
            traj = self._rollout(prompts, self.decode, uids, cfg.rollout.n)
        self.tracer.rollout(traj)
        if int(traj.min_version.min()) != self.version:
            raise RuntimeError(f"rollout used weight version {int(traj.min_version.min())}, learner is at {self.version}")
        with timer("reward"):
            scores_np, report = self._score(traj, prompts, cfg.rollout.n)
            host = self._host_batch(traj)
            batch = place(host, self.mesh)
            groups = place({"scores": scores_np.astype(np.float32), "group_id": traj.group_id.astype(np.int32),
                            "row": ~traj.is_padding}, self.mesh)
            scores = groups["scores"]
        self.tracer.reward(scores_np, batch, groups)
        if cfg.algorithm.bypass_mode:  # the sampler's log-probs are the behaviour policy's
            old_logp = batch["old_logp"] = batch["rollout_logp"]
            self.tracer.logprob("old_log_prob", old_logp=old_logp)
        else:
            with timer("old_log_prob"):
                old_logp, old_entropy = self.logprob_fn(self.state.params, batch)
                batch["old_logp"] = old_logp
                jax.block_until_ready(old_logp)
            self.tracer.logprob("old_log_prob", old_logp=old_logp, entropy=old_entropy)
        metrics: dict[str, Any] = {}
        kl_reward = None  # [B, T] KL penalty per token, when it is part of the reward
        if self.needs_ref:
            with timer("ref"):
                batch["ref_logp"] = self.logprob_fn(self.ref_params, batch)[0]
                self.tracer.logprob("reference", ref_logp=batch["ref_logp"])
                if cfg.algorithm.use_kl_in_reward:
                    kl = rl.kl_penalty(old_logp, batch["ref_logp"], kind=cfg.algorithm.kl_penalty)
                    kl_reward = cfg.algorithm.kl_ctrl.kl_coef * kl * batch["loss_mask"]
                    metrics["critic/kl"] = float(to_host(rl.masked_mean(kl, batch["loss_mask"])))
        if self.critic_state is not None:
            with timer("values"):
                values = self.values_fn(self.critic_state.params, batch)
        with timer("adv"):
            if self.critic_state is not None:
                token_rewards = outcome_token_rewards(scores, batch["loss_mask"])
                if kl_reward is not None:
                    token_rewards = token_rewards - kl_reward
                batch["advantages"], returns = rl.gae_advantages(
                    token_rewards, values, batch["loss_mask"], gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam)
            else:
                if kl_reward is not None:
                    scores = scores - jnp.sum(kl_reward, axis=-1)
                batch["advantages"] = self._advantages_fn(
                    scores, groups["group_id"], groups["row"], batch["loss_mask"], traj.num_groups)
            if cfg.rollout.correction != "none":
                batch["rollout_is_weights"] = rl.rollout_correction_weights(
                    old_logp, batch["rollout_logp"], batch["loss_mask"], level=cfg.rollout.correction,
                    threshold=cfg.rollout.correction_threshold)
        self.tracer.advantages(batch)
        key = jax.random.fold_in(jax.random.key(cfg.trainer.seed), self.step)
        if self.critic_state is not None:
            with timer("update_critic"):
                critic_batch = {k: batch[k] for k in ("input_ids", "attention_mask", "positions", "loss_mask")}
                critic_batch.update(old_values=values, returns=returns)
                self.tracer.observe(values=values, returns=returns)
                self.critic_state, critic = self.critic_step(self.critic_state, critic_batch, key)
                critic, value_stats = to_host((critic, (rl.masked_mean(values, batch["loss_mask"]),
                                                        rl.masked_mean(returns, batch["loss_mask"]))))
                metrics.update({"critic/vf_loss": critic["vf_loss"], "critic/vf_clipfrac": critic["vf_clipfrac"],
                                "critic/grad_norm": critic["grad_norm"], "critic/values/mean": value_stats[0],
                                "critic/returns/mean": value_stats[1]})
        with timer("update_actor"):
            self.state, actor = self.train_step(self.state, batch, key)
            actor = to_host(actor)
        self.tracer.actor_update(actor, optimizer_steps=int(self.state.step))
        with timer("update_weights"):
            self.version += 1
            self.sampler.update_weights(self._sampler_weights(self.state.params), self.version)
        self.tracer.weight_sync(self.version, self.sampler)

        real = ~traj.is_padding
        lengths = traj.response_length[real]
        mask_np = host["loss_mask"]
        adv_mean = to_host(rl.masked_mean(batch["advantages"], batch["loss_mask"]))
        metrics.update({
            "actor/pg_loss": actor["pg_loss"], "actor/pg_clipfrac": actor["pg_clipfrac"],
            "actor/pg_clipfrac_lower": actor["pg_clipfrac_lower"], "actor/ppo_kl": actor["ppo_kl"],
            "actor/entropy": actor["entropy"],  # of the policy being updated, as verl reports it
            "actor/grad_norm": actor["grad_norm"], "actor/loss": actor["loss"],
            "actor/skipped_updates": int(actor["skipped_updates"]),
            "actor/lr_step": int(self.state.step),
            "critic/score/mean": float(scores_np[real].mean()), "critic/score/max": float(scores_np[real].max()),
            "critic/score/min": float(scores_np[real].min()),
            "critic/advantages/mean": float(adv_mean),
            "response_length/mean": float(lengths.mean()), "response_length/max": int(lengths.max()),
            "response_length/min": int(lengths.min()),
            "response_length/clip_ratio": float(traj.truncated[real].mean()),
            "prompt_length/mean": float(traj.prompt_length[real].mean()),
            "training/weight_version": self.version,
            **report.metrics(),
        })
        if "kl_loss" in actor:
            metrics["actor/kl_loss"] = actor["kl_loss"]
        if self.cfg.trainer.test_freq > 0 and self.step % self.cfg.trainer.test_freq == 0:
            metrics["val/score/mean"] = self.validate()
        if self.cfg.trainer.save_freq > 0 and self.step % self.cfg.trainer.save_freq == 0:
            with timer("save_checkpoint"):
                self.save()
        step_s = time.perf_counter() - t_step
        tokens = int(mask_np.sum() + traj.prompt_length[real].sum())
        metrics.update({f"timing_s/{k}": v for k, v in timer.step.items()})
        metrics.update({"timing_s/step": step_s, "perf/total_num_tokens": tokens,
                        "perf/throughput": tokens / step_s / max(len(jax.devices()), 1),
                        "perf/rollout_tokens_per_s": traj.stats.tokens_per_s})
        metrics.update(self.tracer.end_step(metrics, host=host))
        self.metrics.write(self.step, metrics)
        return metrics

    def validate(self) -> float:
        """Mean reward on the held-out split with ``rollout.val_kwargs`` decoding (greedy by default)."""
        with self.timer("testing"):
            scores = []
            for i, prompts in enumerate(self._val_iterator()):
                uids = [f"val-{i}-{j}" for j in range(len(prompts))]
                traj = self._rollout(prompts, self.val_decode, uids, self.cfg.rollout.val_kwargs.n)
                s, _ = self._score(traj, prompts, self.cfg.rollout.val_kwargs.n)
                scores.extend(s[~traj.is_padding].tolist())
            return float(np.mean(scores)) if scores else float("nan")

    # ------------------------------------------------------------------ the run

    def run(self) -> RunSummary:
        cfg = self.cfg
        total = cfg.trainer.total_steps
        first = self.step
        t0 = time.perf_counter()
        val_before = None
        stats = getattr(self.data.source, "stats", None)
        if stats is not None:  # what data.filter_overlong_prompts / data.truncation did to the train split
            self.echo(f"train prompts: {stats.total} total, {stats.kept} kept, {stats.filtered} filtered as overlong, "
                      f"{stats.truncated} truncated (max_prompt_length {stats.max_length}, longest {stats.longest})")
        if cfg.trainer.val_before_train and self.step == 0:
            val_before = self.validate()
            self.echo(f"validation before training: val/score/mean = {val_before:.3f}")
        if self.step == 0:
            self.metrics.write(0, {**({} if stats is None else stats.metrics()),
                                   **({} if val_before is None else {"val/score/mean": val_before})})
        tokens = 0
        last: dict = {}
        step_times: list[float] = []
        while self.step < total:
            last = self.train_one_step()
            tokens += int(last["perf/total_num_tokens"])
            step_times.append(last["timing_s/step"])
            if self.main:
                _progress(self.step, total, last["critic/score/mean"], step_times)
        val = last.get("val/score/mean")
        if val is None and self.step > first:
            val = self.validate()
            self.metrics.write(self.step, {"val/score/mean": val})
        if self.step > first and (cfg.trainer.save_freq <= 0 or self.step % cfg.trainer.save_freq):
            with self.timer("save_checkpoint"):
                self.save()
        self.checkpointer.close()
        self.metrics.close()
        trace_overhead = Tracer.describe_overhead(self.tracer.close())
        if self.main:
            plot_report(self.run_dir)
        return RunSummary(steps=self.step, tokens=tokens, wall_s=time.perf_counter() - t0,
                          stage_s=dict(self.timer.total), train_reward=last.get("critic/score/mean"),
                          val_reward_before=val_before, val_reward=val, run_dir=self.run_dir,
                          resumed_from=self.resumed_from, trace_overhead=trace_overhead)


def format_summary(s: RunSummary) -> str:
    """The end-of-run table: steps, tokens, wall time, time by stage, rewards, outputs."""
    rows = [("steps", f"{s.steps}"), ("tokens", f"{s.tokens:,}"), ("wall time", f"{s.wall_s:.1f} s")]
    busy = sum(s.stage_s.values()) or 1.0
    for stage, secs in sorted(s.stage_s.items(), key=lambda kv: -kv[1]):
        if secs > 0:
            rows.append((f"  {stage}", f"{secs:.1f} s ({100 * secs / busy:.0f}%)"))

    def fmt(x):
        return "n/a" if x is None or not np.isfinite(x) else f"{x:.3f}"

    rows += [("train reward (last step)", fmt(s.train_reward)), ("held-out reward before", fmt(s.val_reward_before)),
             ("held-out reward after", fmt(s.val_reward)), ("outputs", s.run_dir)]
    if s.resumed_from is not None:
        rows.append(("resumed from checkpoint", str(s.resumed_from)))
    if s.trace_overhead is not None:
        rows.append(("tracing overhead", s.trace_overhead))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
