"""The trainer: holds the run's state and runs the stage list step after step.

A step is the list of named stages of :func:`rljax.trainer.stages.sync_stages` (rollout ->
trajectory fields -> reward -> old / ref log-prob -> values -> advantages -> critic /
actor update -> weight sync -> metrics), run by :class:`rljax.trainer.runner.StepRunner`,
which times each stage and hands what it read and wrote to the observers (the trace).
The trainer builds the components (model, optimizer states, sampler, data, reward),
validates, checkpoints and writes one ``metrics.jsonl`` record per step. Every
computation is a jitted pure function (:mod:`rljax.trainer.step`,
:mod:`rljax.trainer.prepare`, the sampler's decode chunks). Randomness is derived from
``(trainer.seed, step)`` and the sampler's ``(seed, uid, session)`` streams, so ``N``
steps, a resume and ``N`` more steps give the same numbers as ``2N`` steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from rljax.config import Config, derive, on_policy_blockers
from rljax.loss import adaptive_kl_coef
from rljax.sharding import split_devices, to_host
from rljax.trace import Tracer, plot_report
from rljax.trace.loggers import open_run_logs
from rljax.trace.samples import TrainSamples, sample_rows
from rljax.trainer.checkpoint import Checkpointer
from rljax.trainer.guard import (NONFINITE_ALERT, NonFiniteMonitor, NonFiniteUpdateError, StopRequested, StopSignals,
                                 RUN_RECORDS, cut_jsonl, wait_for_save)
from rljax.trainer.critic import CriticStepConfig, critic_loss, critic_values, init_critic, make_packed_values_fn
from rljax.trainer.prepare import PrepareConfig, load_estimator, make_prepare_fn
from rljax.trainer.runner import StepRunner
from rljax.trainer.stages import Components, actor_batch, model_inputs, score, sync_stages
from rljax.models.lora import LoRAParams, disable
from rljax.models.lora import merge as lora_merge
from rljax.models.remat import for_run as remat_for_run
from rljax.trainer.packing import AutoPacking, pack_configs
from rljax.trainer.step import (PackedLogprob, PackedTrainStep, StepConfig, init_state, make_logprob_fn,
                                make_optimizer, make_train_step, trainable)

log = logging.getLogger("rljax")


@dataclasses.dataclass
class RunSummary:
    steps: int  # the step the run ended at
    first_step: int  # the step this launch started from (> 0 after a resume)
    tokens: int  # tokens of the steps this launch ran
    wall_s: float
    stage_s: dict[str, float]
    train_reward: Optional[float]
    val_reward_before: Optional[float]
    val_reward: Optional[float]
    run_dir: str
    resumed_from: Optional[int]
    trace_overhead: Optional[str] = None
    error_alerts: dict = dataclasses.field(default_factory=dict)  # name -> trace summary entry (severity error)


def _model(cfg: Config, mesh, tokenizer):
    """``(model_config, graphdef, params)``: from ``model.path`` (HF) or a preset sized to the tokenizer."""
    from rljax.models import functional as F
    from rljax.config import apply_model_overrides
    from rljax.models.config import get_config

    if cfg.model.path:
        from rljax.models.hf import load_hf_checkpoint

        mcfg, params = load_hf_checkpoint(cfg.model.path, dtype=cfg.model.dtype, mesh=mesh)
        remat = remat_for_run(cfg, mcfg, mesh)  # training choices, not the checkpoint's
        mcfg = mcfg.replace(remat=remat.remat, remat_policy=remat.policy, scan_layers=cfg.model.scan_layers)
        graphdef, _ = F.abstract_params(mcfg)
        return mcfg, graphdef, params
    overrides = dict(dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype, scan_layers=cfg.model.scan_layers)
    base = apply_model_overrides(get_config(cfg.model.name), cfg.model)  # model.hidden_size=... etc.
    if tokenizer.vocab_size != base.vocab_size:
        # A preset trained from scratch takes the tokenizer's vocabulary (the embedded task's
        # character vocabulary is far smaller than the preset's).
        overrides.update(vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_id,
                         bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
    mcfg = base.replace(**overrides)
    remat = remat_for_run(cfg, mcfg, mesh)  # model.remat / remat_policy (auto: rljax.models.remat)
    mcfg = mcfg.replace(remat=remat.remat, remat_policy=remat.policy)
    graphdef, params = F.init_params(mcfg, seed=cfg.trainer.seed, mesh=mesh)
    return mcfg, graphdef, params


def _lora(cfg: Config, mcfg, params, mesh):
    """``(params, base signature)``: with ``actor.lora.rank > 0`` the actor trains float32 adapters
    (B = 0: it starts as the base) on its frozen base; else the params as they are."""
    from rljax.models import lora as L

    lc = cfg.actor.lora
    if lc.rank == 0:
        return params, None
    lcfg = L.LoRAConfig(rank=lc.rank, alpha=lc.alpha, target_modules=tuple(lc.target_modules), dropout=lc.dropout,
                        modules_to_save=tuple(lc.modules_to_save))
    adapters = L.init_adapters(mcfg, lcfg, seed=cfg.trainer.seed, mesh=mesh, base=params)
    name = cfg.model.path or f"{cfg.model.name} (seed {cfg.trainer.seed})"
    return L.LoRAParams(base=params, adapters=adapters, config=lcfg), L.base_signature(params, name=name)


def policy_params(cfg: Config, mesh, tokenizer):
    """``(model_config, graphdef, params, lora_base)``: the policy a run of ``cfg`` starts from (its
    HF checkpoint or seeded preset; with LoRA, adapters at init on that base and the base's
    signature). ``python -m rljax.export`` rebuilds it to put a checkpoint's weights on."""
    mcfg, graphdef, params = _model(cfg, mesh, tokenizer)
    params, base = _lora(cfg, mcfg, params, mesh)
    return mcfg, graphdef, params, base


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


class FixedKLController:
    """``algorithm.kl_ctrl.type=fixed``: the KL-in-reward coefficient stays ``kl_coef``."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """``algorithm.kl_ctrl.type=adaptive``: verl's adaptive controller; after each step the
    coefficient follows :func:`rljax.loss.adaptive_kl_coef` of the step's KL (it grows while
    the measured KL is above ``target_kl`` and shrinks below it)."""

    def __init__(self, kl_coef: float, *, target_kl: float, horizon: int):
        self.value, self.target, self.horizon = float(kl_coef), float(target_kl), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        if math.isfinite(current_kl):
            self.value = float(adaptive_kl_coef(self.value, current_kl, n_steps, target_kl=self.target,
                                                horizon=self.horizon))


def kl_controller(kl_ctrl):
    if kl_ctrl.type == "adaptive":
        return AdaptiveKLController(kl_ctrl.kl_coef, target_kl=kl_ctrl.target_kl, horizon=kl_ctrl.horizon)
    return FixedKLController(kl_ctrl.kl_coef)


def _progress(step: int, total: int, reward: float, step_times: list[float]) -> None:
    """One progress line. The ETA uses the median of recent step times after this process's
    first step (which compiles everything); before there is one, it says so."""
    recent = sorted(step_times[1:][-20:])
    if recent:
        eta = (total - step) * recent[len(recent) // 2]
        eta_s = f"ETA {int(eta // 60)}m{int(eta % 60):02d}s"
    else:
        eta_s = "ETA after the compiling step"
    bar_w = 24
    filled = int(bar_w * step / total)
    line = (f"[{'#' * filled}{'.' * (bar_w - filled)}] step {step}/{total} | reward {reward:.3f} | "
            f"{step_times[-1]:.2f}s/step | {eta_s}")
    end = "\r" if sys.stderr.isatty() and step < total else "\n"
    print(line, file=sys.stderr, end=end, flush=True)


class Trainer:
    """Owns the run's state: model, optimizer states, sampler, data position, outputs.

    Args:
      cfg: the resolved configuration.
      mesh: the learner mesh (``rljax.sharding.make_mesh``).
      run_dir: where outputs and checkpoints go.
      resume: continue from the newest complete checkpoint in ``run_dir``.
      resume_unverified: also restore a checkpoint without a digest (refused otherwise).
      resume_from_weights: take only the policy (and critic) weights of the checkpoint; the
        optimizer state and the data position start fresh (a resume under another task).
    """

    def __init__(self, cfg: Config, mesh, run_dir: str, *, resume: bool = False, echo: Callable = print,
                 resume_unverified: bool = False, resume_from_weights: bool = False):
        from rljax.data import train_iterator, val_iterator
        from rljax.reward import make_reward
        from rljax.rollout import DecodeParams, RljaxEngine, Sampler, sampler_mesh

        self.cfg, self.mesh, self.run_dir, self.echo = cfg, mesh, run_dir, echo
        d, a, r = cfg.data, cfg.actor, cfg.rollout
        self.tokenizer = _tokenizer(cfg)
        self.model_config, self.graphdef, params = _model(cfg, mesh, self.tokenizer)
        echo(remat_for_run(cfg, self.model_config, mesh).line())  # what model.remat resolved to, and why
        params, self.lora_base = _lora(cfg, self.model_config, params, mesh)
        base = disable(params)
        # Sizes in trajectories and the learner's [B, S+T] layout (S and T rounded up to
        # multiples of sp, the extra columns masked everywhere), derived once from the config.
        self.sizes = sizes = derive(cfg, sp=dict(mesh.shape).get("sp", 1))
        prompt_len, response_len = sizes.learner_prompt_length, sizes.learner_response_length
        data_dir = d.data_dir or os.path.join(run_dir, "data")
        if jax.process_count() > 1:  # TFDS does not guard two processes building one dataset
            data_dir = os.path.join(data_dir, f"process{jax.process_index()}")
        tokenize = lambda text: self.tokenizer.encode(text, add_bos=True)  # noqa: E731
        chat = self.tokenizer.apply_chat_template if getattr(self.tokenizer, "chat_template", None) else None
        self._train_iterator = lambda state=None: train_iterator(cfg, tokenize, data_dir=data_dir, state=state,
                                                                 chat_template=chat)
        self._val_iterator = lambda: val_iterator(cfg, tokenize, data_dir=data_dir, chat_template=chat)

        trajectories, micro = sizes.trajectories_per_step, sizes.micro_batch_trajectories
        # actor.skip_old_log_prob: old_logp from the update itself (detached) when it is exactly
        # on-policy (auto) or required (true; validated); no old_log_prob stage then
        self.old_logp_in_update = a.skip_old_log_prob != "false" and not on_policy_blockers(cfg)
        self.step_config = StepConfig(
            policy_loss=a.policy_loss, clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
            clip_ratio_c=a.clip_ratio_c, loss_agg_mode=a.loss_agg_mode, use_kl_loss=a.use_kl_loss,
            kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type, entropy_coeff=a.entropy_coeff,
            ppo_epochs=a.ppo_epochs, ppo_mini_batch_size=sizes.mini_batch_trajectories, ppo_micro_batch_size=micro,
            temperature=r.temperature, logprob_impl=a.logprob_impl, use_rollout_correction=r.correction != "none",
            shuffle=a.shuffle, on_policy=self.old_logp_in_update)
        updates = sizes.optimizer_updates
        optimizer = _optimizer(a.optim, a.grad_clip, updates)
        al = cfg.algorithm
        prepare_cfg = PrepareConfig(
            estimator=al.adv_estimator, num_groups=d.train_batch_size,
            algorithm=(("gamma", al.gamma), ("lam", al.lam), ("norm_adv_by_std_in_grpo", al.norm_adv_by_std_in_grpo)),
            use_kl_in_reward=al.use_kl_in_reward, kl_penalty=al.kl_penalty, correction=r.correction,
            correction_threshold=r.correction_threshold,
            behaviour_logp="rollout_logp" if al.bypass_mode else "old_logp")
        needs_ref = a.use_kl_loss or al.use_kl_in_reward
        # packing configuration (validated for every run; used with actor.use_remove_padding)
        mesh_sizes = dict(mesh.shape)
        update_pack, logprob_pack = pack_configs(cfg, dp=mesh_sizes.get("dp", 1), sp=mesh_sizes.get("sp", 1),
                                                 row_len=prompt_len + response_len, micro_batch_size=micro)
        packing = {"true": True, "false": False, "auto": "auto"}[a.use_remove_padding]  # auto: per batch, by lengths
        if packing == "auto" and a.lora.rank > 0 and a.lora.dropout > 0:
            packing = False  # the packed update applies no LoRA dropout
        if packing:  # packed rows with segment ids (rljax.trainer.packing)
            train_step = PackedTrainStep(self.graphdef, optimizer, self.step_config, update_pack, mesh,
                                         response_len=response_len)
            logprob_fn = PackedLogprob(self.graphdef, logprob_pack, response_len=response_len,
                                       temperature=r.temperature, impl=a.logprob_impl, mesh=mesh)
        if packing is not True:
            padded_step = make_train_step(self.graphdef, optimizer, self.step_config, mesh=mesh)
            padded_logprob = make_logprob_fn(self.graphdef, response_len=response_len, temperature=r.temperature,
                                             impl=a.logprob_impl, mesh=mesh, micro_batch_size=micro)
            if packing == "auto":
                train_step, logprob_fn = AutoPacking(padded_step, train_step), AutoPacking(padded_logprob, logprob_fn)
            else:
                train_step, logprob_fn = padded_step, padded_logprob
        critic = critic_step = values_fn = None
        if al.adv_estimator == "gae":  # PPO: a value model beside the policy, packed like the actor
            cc = cfg.critic
            critic_cfg = CriticStepConfig(cliprange_value=cc.cliprange_value, loss_agg_mode=cc.loss_agg_mode,
                                          ppo_epochs=a.ppo_epochs, ppo_mini_batch_size=self.step_config.ppo_mini_batch_size,
                                          ppo_micro_batch_size=micro, shuffle=a.shuffle)
            critic_opt = _optimizer(cc.optim, cc.grad_clip, updates)
            critic = init_state(init_critic(base), critic_opt)
            graphdef = self.graphdef
            if packing:
                critic_step = PackedTrainStep(graphdef, critic_opt, critic_cfg, update_pack, mesh,
                                              response_len=response_len, loss_fn=critic_loss)
                values_fn = PackedLogprob(graphdef, logprob_pack, response_len=response_len, mesh=mesh,
                                          packed_fn=make_packed_values_fn(graphdef, mesh=mesh))
            if packing is not True:
                padded_critic = make_train_step(graphdef, critic_opt, critic_cfg, mesh=mesh, loss_fn=critic_loss)
                padded_values = jax.jit(lambda p, b: critic_values(graphdef, p, b, response_len=response_len, mesh=mesh))
                if packing == "auto":
                    critic_step = AutoPacking(padded_critic, critic_step)
                    values_fn = AutoPacking(padded_values, values_fn)
                else:
                    critic_step, values_fn = padded_critic, padded_values

        eos = (self.tokenizer.eos_id,)
        decode = DecodeParams(max_new_tokens=d.max_response_length, temperature=r.temperature, top_k=max(r.top_k, 0),
                              top_p=r.top_p, seed=cfg.trainer.seed, eos_ids=eos)
        v = r.val_kwargs
        self.val_decode = DecodeParams(max_new_tokens=d.max_response_length, temperature=v.temperature,
                                       top_k=max(v.top_k, 0), top_p=v.top_p, seed=cfg.trainer.seed + 1, eos_ids=eos)
        env_runtime = None
        if cfg.env.function is not None:  # multi-turn episodes (rljax.env): a turn's prompt is the whole context
            from rljax.env import EnvRuntime

            env_runtime = EnvRuntime.from_config(cfg, self.tokenizer)
            turn = cfg.env.max_turn_tokens or d.max_response_length
            decode = dataclasses.replace(decode, max_new_tokens=min(turn, d.max_response_length))
            self.val_decode = dataclasses.replace(self.val_decode, max_new_tokens=decode.max_new_tokens)
        context = d.max_prompt_length + (d.max_response_length if env_runtime is not None else 0)
        engine = RljaxEngine(self.model_config, num_slots=r.max_slots or trajectories,
                             max_prefill_length=context, max_decode_length=d.max_response_length,
                             mesh=sampler_mesh(r.tp, rollout_devices(cfg, mesh)),
                             prefill_batch_size=min(d.train_batch_size, 64))
        # Each process runs a sampler on its own devices (same prompts, same random streams).
        sampler = Sampler(engine, _sampler_weights(params), version=0, truncation="error")
        self.c = Components(
            cfg=cfg, mesh=mesh, data=self._train_iterator(), sampler=sampler, decode=decode, tokenizer=self.tokenizer,
            reward_fn=make_reward(cfg.reward, dataset=d.dataset),  # a worker pool or the function itself
            logprob_fn=logprob_fn,
            prepare_fn=make_prepare_fn(prepare_cfg, load_estimator(al.adv_estimator)), prepare_inputs=prepare_cfg.inputs(critic=critic is not None),
            train_step=train_step,
            actor=init_state(params, optimizer), prompt_len=prompt_len, response_len=response_len,
            sampler_weights=_sampler_weights,
            ref_params=jax.tree.map(jnp.copy, params) if needs_ref and self.lora_base is None else None,
            ref_is_base=needs_ref and self.lora_base is not None,
            critic=critic, critic_step=critic_step, values_fn=values_fn,
            kl_ctrl=kl_controller(al.kl_ctrl) if al.use_kl_in_reward else None, env=env_runtime,
            old_logp_in_update=self.old_logp_in_update)
        self.step = 0
        self.resumed_from = None
        self.val_env: dict = {}  # held-out tool-call rate and turns of the last validation (env.function)
        self._restored_meta: dict = {}

        os.makedirs(run_dir, exist_ok=True)
        self.main = jax.process_index() == 0
        self.checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"), max_to_keep=cfg.trainer.max_checkpoints,
                                         echo=echo)
        if resume:
            self._restore(unverified=resume_unverified, weights_only=resume_from_weights)
        self.nonfinite = NonFiniteMonitor(cfg.trainer.max_skipped_updates, echo=echo)
        self.stop_save_timeout_s = cfg.trainer.stop_save_timeout_s  # how long a stop waits for a save
        self._skipped = {"actor": int(self.c.actor.skipped),
                         "critic": int(self.c.critic.skipped) if self.c.critic is not None else 0}
        self.metrics, self.samples = open_run_logs(cfg, run_dir, enabled=self.main)  # + wandb / mlflow, samples
        self.stage_s: dict[str, float] = {}
        self.tracer = Tracer(cfg, mesh, run_dir, enabled=self.main, ledger_sources=self.ledger_sources)
        if env_runtime is not None and env_runtime.sandbox_probe is not None:  # what the python tool's sandbox holds
            echo(env_runtime.sandbox_probe["line"])
            self.tracer.sandbox = env_runtime.sandbox_probe
        self.schedule = None
        if cfg.trainer.mode == "async":
            from rljax.trainer.async_loop import AsyncSchedule

            self.schedule = AsyncSchedule(self)
            if self._restored_meta.get("async"):
                self.schedule.restore(self._restored_meta["async"])
        observers = [self.tracer]
        if cfg.trace.log_train_generations:
            observers.append(TrainSamples(self.samples, decode=self.tokenizer.decode,
                                          limit=cfg.trace.log_train_generations))
        self.runner = StepRunner(sync_stages(self.c) if self.schedule is None else self.schedule.stages,
                                 observers=observers)

    @property
    def state(self):
        """The actor's :class:`TrainState`."""
        return self.c.actor

    @property
    def version(self) -> int:
        return self.c.version

    def ledger_sources(self) -> dict:
        """What the ledgers compile and measure, named explicitly (read once, after step 1)."""
        c = self.c
        return {"model_config": self.model_config, "step_config": self.step_config, "graphdef": self.graphdef,
                "params": c.actor.params, "opt_state": c.actor.opt_state,
                "lower_update": lambda fields: c.train_step.lower(c.actor, actor_batch(c, fields), jax.random.key(0)),
                "lower_logprob": lambda fields: c.logprob_fn.lower(c.actor.params, model_inputs(fields)),
                "sampler_engine": c.sampler.engine, "sampler_params": c.sampler.params, "decode": c.decode}

    # ------------------------------------------------------------------ checkpoints

    def _restore(self, *, unverified: bool = False, weights_only: bool = False) -> None:
        """Restores the newest checkpoint (or ``trainer.resume_from``) after verifying it; a damaged
        or unverified one is a :class:`~rljax.trainer.checkpoint.CheckpointError` naming the newest
        intact one. ``metrics.jsonl``, ``trace.jsonl`` and ``rollout_uids.jsonl`` are cut back to the
        restored step, so every step appears once. ``weights_only``: the policy's weights alone."""
        chosen = self.cfg.trainer.resume_from
        latest = self.checkpointer.select(chosen)
        if latest is None:
            self.echo(f"resume: no complete checkpoint in {self.checkpointer.directory}; starting from step 0")
            self._cut_records(-1)
            return
        c = self.c
        try:
            saved = self.checkpointer.read_meta(latest)
        except Exception:  # noqa: BLE001 - unreadable: restore() below names the damage
            saved = None
        if saved is not None and (self.lora_base is not None or "lora" in saved):
            self._check_lora_checkpoint(latest, saved.get("lora"))
        state, meta = self.checkpointer.restore(latest, self._checkpoint_state(), allow_unverified=unverified)
        if chosen is not None:
            self.checkpointer.discard_newer(latest)
        if self.lora_base is not None:  # adapters only were saved: they go back onto this run's base
            state["actor"] = state["actor"].replace(params=c.actor.params.replace(adapters=state["actor"].params))
        self.step, c.version = int(meta["step"]), int(meta["version"])
        self.resumed_from = latest
        if weights_only:  # another task: this run's fresh optimizer states and data position, the saved weights
            c.actor = c.actor.replace(params=state["actor"].params)
            if c.critic is not None:
                c.critic = c.critic.replace(params=state["critic"].params)
            task = (meta.get("config") or {}).get("data", {})
            self.echo(f"resume: --resume-from-weights: the policy weights of checkpoint {latest} (trained on "
                      f"data.dataset={task.get('dataset', '?')}); the optimizer state and the data position start "
                      f"fresh; steps continue from {self.step + 1}")
        else:
            c.actor, c.critic = state["actor"], state.get("critic")
            if c.kl_ctrl is not None and "kl_coef" in meta:
                c.kl_ctrl.value = float(meta["kl_coef"])
            c.data = self._train_iterator(state=meta["data"])
            self._restored_meta = dict(meta)
            self.echo(f"resume: restored step {self.step} (weight version {c.version}) from checkpoint {latest}")
        c.sampler.update_weights(_sampler_weights(c.actor.params), c.version)
        self._cut_records(self.step)

    def _cut_records(self, step: int) -> None:
        """The records a previous launch wrote after ``step`` are dropped: those steps run again."""
        if not self.main:
            return
        for name in RUN_RECORDS:
            dropped = cut_jsonl(os.path.join(self.run_dir, name), step)
            if dropped:
                self.echo(f"resume: removed {dropped} {name} record(s) after step {max(step, 0)} (they are run again)")

    def intact_point(self) -> str:
        """The newest verified checkpoint (hashed) and where ``--resume`` continues: for a run
        stopped by a failed write."""
        try:
            step = self.checkpointer.newest_intact()
        except OSError:
            step = None
        if step is None:
            return f"no intact checkpoint in {self.checkpointer.directory}"
        return (f"the newest intact checkpoint is step {step} in {self.checkpointer.directory}: --resume continues "
                f"from step {step + 1}")

    def resume_point(self) -> str:
        """Which checkpoint the next ``--resume`` restores and the step it starts from."""
        steps = self.checkpointer.all_steps()
        pending = self.checkpointer.pending
        if pending is not None and pending not in steps:
            steps = sorted(steps + [pending])
        if not steps:
            return "no checkpoint was saved: the next --resume starts from step 1"
        return f"the newest checkpoint is step {steps[-1]}: the next --resume starts from step {steps[-1] + 1}"

    def _check_lora_checkpoint(self, step: int, saved: Optional[dict]) -> None:
        """``CheckpointError`` unless checkpoint ``step`` holds adapters of this run's LoRA shape
        trained on this run's base (or full parameters, for a run without LoRA)."""
        from rljax.models.lora import check_base
        from rljax.trainer.checkpoint import CheckpointError

        rank = self.cfg.actor.lora.rank
        if saved is None or self.lora_base is None:
            raise CheckpointError(f"checkpoint {step} holds {'every parameter' if saved is None else 'LoRA adapters'}; "
                                  f"this run has actor.lora.rank={rank}")
        have = dataclasses.asdict(self.c.actor.params.config)
        saved = {"modules_to_save": [], **saved}  # checkpoints from before modules_to_save existed
        diff = [f"{k}={saved.get(k)!r} (now {v!r})" for k, v in have.items() if k != "dropout"
                and (list(v) if isinstance(v, tuple) else v) != saved.get(k)]
        if diff:
            raise CheckpointError(f"checkpoint {step} holds other LoRA adapters: actor.lora.{', '.join(diff)}")
        try:
            check_base(saved["base"], self.lora_base)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {step}: {e}") from None

    def save(self) -> None:
        from rljax.config import to_dict

        c = self.c
        meta = {"step": self.step, "version": c.version, "data": c.data.state(), "config": to_dict(self.cfg)}
        if self.schedule is not None:  # async: the data position after the last trained batch (in-flight prompts replay)
            meta["data"] = self.schedule.data_state
            meta["async"] = self.schedule.checkpoint_meta()
        if c.kl_ctrl is not None:
            meta["kl_coef"] = c.kl_ctrl.value
        if self.lora_base is not None:  # adapter-only checkpoint: name the base it belongs to
            meta["lora"] = {"base": self.lora_base, **dataclasses.asdict(c.actor.params.config)}
        t = time.perf_counter()
        self.checkpointer.save(self.step, self._checkpoint_state(), meta)
        self._time("save_checkpoint", t)

    def _checkpoint_state(self) -> dict:
        """The actor's state (its trainable part: a LoRA run saves its adapters, not the frozen base)."""
        state = {"actor": self.c.actor.replace(params=trainable(self.c.actor.params))}
        if self.c.critic is not None:
            state["critic"] = self.c.critic
        return state

    def _time(self, key: str, t0: float) -> float:
        dt = time.perf_counter() - t0
        self.stage_s[key] = self.stage_s.get(key, 0.0) + dt
        return dt

    # ------------------------------------------------------------------ steps

    def train_one_step(self) -> dict:
        """Runs the stage list once; returns the step's metrics (also written to ``metrics.jsonl``)."""
        self.step += 1
        if self.schedule is None:
            metrics, timings = self.runner.run(self.step, {"step": self.step})
        else:
            seed, prior = self.schedule.next_batch(self.step)
            facts = seed["queue_item"]
            metrics, timings = self.runner.run(self.step, seed, prior=prior)
            del prior
            self.schedule.trained()
            metrics.update(self.schedule.metrics(facts))
        for k, v in timings.items():
            self.stage_s[k] = self.stage_s.get(k, 0.0) + v
        tokens = metrics["perf/total_num_tokens"]
        metrics["perf/throughput"] = tokens / metrics["timing_s/step"] / max(len(jax.devices()), 1)
        metrics.update(self._perf_metrics(metrics))
        return metrics

    def _perf_metrics(self, metrics: dict) -> dict:
        """Packed-learner statistics and MFU (``perf/mfu/*``: absent off the peak table, e.g. on CPU)."""
        from rljax.trace.mfu import mfu

        out = {}
        step = self.c.train_step
        if isinstance(step, AutoPacking) and step.last_packed is not None:
            out["perf/learner_packed"] = float(step.last_packed)  # actor.use_remove_padding=auto's choice
        if isinstance(step, (PackedTrainStep, AutoPacking)) and step.stats:
            if "dp_token_imbalance" in step.stats:
                out["perf/dp_token_imbalance"] = step.stats["dp_token_imbalance"]  # of the packed learner rows
            out["perf/learner_padding_frac"] = step.stats["padding_frac"]
            out["perf/learner_compiles"] = step.compiles + getattr(self.c.logprob_fn, "compiles", 0)
        for key, timing in (("actor", "timing_s/update_actor"), ("rollout", "timing_s/gen")):
            flops = metrics.get(f"perf/model_flops/{key}")
            if flops is not None and timing in metrics:
                v = mfu(flops, metrics[timing], jax.devices())
                if v is not None:
                    out[f"perf/mfu/{key}"] = v
        return out

    def _due(self, freq: int) -> bool:
        return freq > 0 and self.step % freq == 0

    def validate(self) -> float:
        """Mean reward on the held-out split with ``rollout.val_kwargs`` decoding (greedy by default)."""
        t = time.perf_counter()
        c = self.c
        scores = []
        env_rows: list = []
        with contextlib.ExitStack() as stack:
            if self.schedule is not None:  # pause the rollout thread; validate the newest pushed weights
                stack.enter_context(self.schedule.sampler_lock)
                self.schedule.install_pending()
            samples, reports = self._validate_batches(c, scores, env_rows)
        self.samples.write("val", self.step, samples)
        self._time("testing", t)
        errors, scored = sum(r.errors for r in reports), sum(r.num_scored for r in reports)
        # held-out reward failures, counted like the training ones
        self.val_env = {"val/reward/errors": float(errors), "val/reward/error_fraction": errors / max(scored, 1)}
        if env_rows:  # held-out tool use, logged beside val/score/mean
            called, turns = (np.concatenate(x) for x in zip(*env_rows))
            self.val_env.update({"val/env/tool_call_rate": float(called.mean()),
                                 "val/env/num_turns/mean": float(turns.mean())})
        return float(np.mean(scores)) if scores else float("nan")

    def _validate_batches(self, c, scores, env_rows) -> tuple[list[dict], list]:
        """Scores the held-out split into ``scores``; returns the first ``trainer.log_val_generations``
        samples and each batch's reward report."""
        samples, keep = [], self.cfg.trainer.log_val_generations
        reports = []
        for i, prompts in enumerate(self._val_iterator()):
            uids = [f"val-{i}-{j}" for j in range(len(prompts))]
            if c.env is not None:  # multi-turn: episodes, scored by their final reward
                from rljax.env import episode_scores

                traj = c.env.run(c.sampler, prompts, uids, n=self.cfg.rollout.val_kwargs.n, decode=self.val_decode,
                                 tokenizer=c.tokenizer)
                s, report = episode_scores(traj, c.reward_fn, prompts,
                                           max_error_fraction=self.cfg.reward.max_error_fraction)
                real = ~np.asarray(traj.is_padding)
                env_rows.append((traj.tool_calls[real] > 0, traj.num_turns[real]))
            else:
                traj = c.sampler.generate([p.ids for p in prompts], uids=uids, n=self.cfg.rollout.val_kwargs.n,
                                          decode=self.val_decode)
                s, report = score(c, traj, prompts, max_error_fraction=self.cfg.reward.max_error_fraction)
            reports.append(report)
            scores.extend(s[~traj.is_padding].tolist())
            if len(samples) < keep:
                samples += sample_rows(traj, prompts, s, decode=c.tokenizer.decode, step=self.step, split="val",
                                       limit=keep - len(samples))
        return samples, reports

    def run(self) -> RunSummary:
        """Trains to ``trainer.total_steps``. Any stop (an exception in a stage, the reward error
        bound, too many non-finite updates, Ctrl-C) first waits, at most
        ``trainer.stop_save_timeout_s``, for an in-flight checkpoint save to commit. SIGTERM ends
        the current step, saves it and raises :class:`~rljax.trainer.guard.StopRequested`."""
        try:
            with StopSignals() as self._stop:
                return self._run()
        except BaseException as e:  # the trace summary says how the run ended
            if self.schedule is not None:
                self.schedule.close()
                self.tracer.async_totals(self.schedule.queue.stats.snapshot())
            if not isinstance(e, StopRequested):
                wait_for_save(self.checkpointer, self.stop_save_timeout_s, self.echo)
            try:
                self.tracer.close(error=f"{type(e).__name__}: {e}", step=self.step)
            except OSError:  # the disk that stopped the run may not take the summary either: report the first error
                pass
            raise
        finally:
            close = getattr(self.c.reward_fn, "close", None)
            if close is not None:  # the reward worker pool
                close()

    def _check_update(self, metrics: dict) -> bool:
        """Logs and alerts a step whose update was skipped as non-finite (stops the run after
        ``trainer.max_skipped_updates`` such steps in a row); True when the update applied."""
        skipped = {}
        for role, state in (("actor", self.c.actor), ("critic", self.c.critic)):
            if state is None:
                continue
            now = int(state.skipped)
            detail = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith(f"{role}/")}
            skipped[role], self._skipped[role] = (now - self._skipped[role], detail), now
        metrics.update(self.nonfinite.observe(self.step, skipped))
        return not any(n for n, _ in skipped.values())

    def _stop_requested(self) -> None:
        """SIGTERM arrived: save this step (if not just saved), wait for it, stop."""
        if self.checkpointer.pending != self.step and self.step not in self.checkpointer.all_steps():
            self.save()
        done = wait_for_save(self.checkpointer, self.stop_save_timeout_s, self.echo)
        saved = f"saved checkpoint {self.step}" if done else f"the save of step {self.step} did not finish"
        self.metrics.close()
        raise StopRequested(f"stopped by {self._stop.requested} after step {self.step}; {saved}; "
                            f"{self.resume_point()}", self._stop.requested)

    def _run(self) -> RunSummary:
        cfg = self.cfg
        total = cfg.trainer.total_steps
        first = self.step
        t0 = time.perf_counter()
        val_before = None
        val_before_env: dict = {}
        stats = getattr(self.c.data.source, "stats", None)
        if stats is not None:  # what data.filter_overlong_prompts / data.truncation did to the train split
            no_answer = (f", {stats.no_answer} skipped for an empty answer (first: row {stats.first_no_answer})"
                         if stats.no_answer else "")
            self.echo(f"train prompts: {stats.total} total, {stats.kept} kept, {stats.filtered} filtered as overlong, "
                      f"{stats.truncated} truncated (max_prompt_length {stats.max_length}, longest {stats.longest})"
                      f"{no_answer}")
        if cfg.trainer.val_before_train and self.step == 0:
            val_before = self.validate()
            val_before_env = dict(self.val_env)
            self.echo(f"validation before training: val/score/mean = {val_before:.3f}")
        if self.step == 0:
            self.metrics.write(0, {**({} if stats is None else stats.metrics()),
                                   **({} if val_before is None else {"val/score/mean": val_before}),
                                   **val_before_env})
        tokens = 0
        last: dict = {}
        val = None
        step_times: list[float] = []
        while self.step < total:
            last = self.train_one_step()
            try:
                applied = self._check_update(last)
            except NonFiniteUpdateError:
                self.metrics.write(self.step, {**last, NONFINITE_ALERT: 1.0})
                raise
            # Validation and the checkpoint belong to the step's one metrics.jsonl record; the
            # last step always validates (the run's final held-out score).
            if self._due(cfg.trainer.test_freq) or self.step == total:
                val = last["val/score/mean"] = self.validate()
                last.update(self.val_env)
                if self.main:
                    self.echo(f"step {self.step}: val/score/mean = {val:.3f}")
            if (self._due(cfg.trainer.save_freq) or self.step == total) and applied:
                self.save()  # a step whose update was skipped is not saved: the last good checkpoint stays
            tokens += int(last["perf/total_num_tokens"])
            step_times.append(last["timing_s/step"])
            self.metrics.write(self.step, last)
            if self.main and (self._due(cfg.trainer.log_freq) or self.step == total):
                _progress(self.step, total, last["critic/score/mean"], step_times)
            if self._stop.requested:
                self._stop_requested()
        if self.schedule is not None:
            self.schedule.close()
            self.tracer.async_totals(self.schedule.queue.stats.snapshot())
        self.checkpointer.close()
        self.metrics.close()
        traced = self.tracer.close()
        trace_overhead = Tracer.describe_overhead(traced)
        if self.main:
            plot_report(self.run_dir)
        return RunSummary(steps=self.step, first_step=first, tokens=tokens, wall_s=time.perf_counter() - t0,
                          stage_s=dict(self.stage_s), train_reward=last.get("critic/score/mean"),
                          val_reward_before=val_before, val_reward=val, run_dir=self.run_dir,
                          resumed_from=self.resumed_from, trace_overhead=trace_overhead,
                          error_alerts={k: v for k, v in traced["alerts"].items() if v.get("severity") == "error"})


def rollout_devices(cfg: Config, mesh) -> list:
    """The sampler's devices (:func:`rljax.sharding.split_devices`): every local device (colocated),
    or the last ``rollout.num_devices`` local ones, which the learner mesh must not hold
    (``rollout.placement=disaggregated``)."""
    n = cfg.rollout.num_devices if cfg.rollout.placement == "disaggregated" else 0
    sampler = split_devices(jax.local_devices(), n)[1]
    if n == 0:
        return sampler
    shared = {d.id for d in mesh.devices.flat} & {d.id for d in sampler}
    if shared:
        raise ValueError(f"rollout.num_devices={cfg.rollout.num_devices}: the sampler's devices {sorted(shared)} are "
                         "in the learner mesh; the learner takes all but the last rollout.num_devices local devices")
    return sampler


_merge = jax.jit(lora_merge)


def _sampler_weights(params):
    """What the sampler reshards from: the learner's arrays (a LoRA actor's merged on device,
    ``W + scale * A @ B``), or their gathered values on multi-host (the sampler mesh is
    process-local)."""
    if isinstance(params, LoRAParams):
        params = _merge(params)
    return params if jax.process_count() == 1 else to_host(params)


def format_summary(s: RunSummary) -> str:
    """The end-of-run table: steps, tokens, wall time, time by stage, rewards, outputs."""
    ran = s.steps - s.first_step
    if s.first_step:  # a resumed run: say what this launch did and what the run holds
        rows = [("steps", f"{s.steps} in the run; {ran} run now (steps {s.first_step + 1}-{s.steps})"),
                ("tokens (this launch)", f"{s.tokens:,}"), ("wall time (this launch)", f"{s.wall_s:.1f} s")]
    else:
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
    for name, a in sorted(s.error_alerts.items()):
        rows.append((f"error alert {name}", f"x{a.get('count')} from step {a.get('first_step')}: {a.get('message')}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
