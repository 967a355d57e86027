"""``build(cfg, mesh) -> (services, state, stages)``: everything a run needs, made once.

* **services** (:class:`~rljax.trainer.services.Services`): what does not change during the run: the model's
  functions, the jitted learner passes of each role, the sampler and its decode settings,
  the prompt feed, the reward, the mesh. Frozen dataclasses: no stage rebinds a member (the
  sampler installs weights and the prompt feed advances, as I/O services do; their
  positions are recorded in the state).
* **state** (:class:`~rljax.trainer.state.RunState`): what changes: train states, weight
  version, KL coefficient, data position, root key, producer position.
* **stages**: the synchronous step's stage list (:func:`rljax.trainer.stages.sync_stages`);
  the asynchronous scheduler splits the same functions between its producer and learner.

:func:`learner_fns` builds a role's (actor or critic) update and forward passes, padded,
packed or chosen per batch (``actor.use_remove_padding``), for both roles alike.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

import jax
import jax.numpy as jnp

from rljax.config import Config, apply_model_overrides, derive, on_policy_blockers
from rljax.data import build_prompts, train_iterator, val_iterator
from rljax.env import EnvRuntime
from rljax.models import functional as F, lora as L
from rljax.models.config import get_config
from rljax.models.hf import load_hf_checkpoint
from rljax.models import abstract_params, load_hf_reward_model, reward_scores
from rljax.models.lora import LoRAParams, disable, merge as lora_merge
from rljax.models.precision import traced_at
from rljax.models.remat import for_run as remat_for_run
from rljax.models.tokenizer import CharTokenizer, load_tokenizer
from rljax.reward import make_reward
from rljax.rollout import DecodeParams, RljaxEngine, Sampler, sampler_mesh
from rljax.rollout.mesh import kv_heads_note
from rljax.sharding import data_shards, to_host
from rljax.sharding.placement import Placement
from rljax.trainer import distribute, prefix, stages as S
from rljax.trainer.clients import EpisodeClient, TurnClient
from rljax.trainer.judge import Judge, initial_policy_params
from rljax.trainer.loss_config import decoupled_correction, decoupled_correction_options, policy_loss_config
from rljax.trainer.critic import CriticStepConfig, critic_loss, critic_values, init_critic, make_packed_values_fn
from rljax.trainer.packing import AutoPacking, pack_configs
from rljax.trainer.prepare import PrepareConfig, load_estimator, make_prepare_fn
from rljax.trainer.services import Lazy, Learner, Model, Reward, RoleFns, Rollout, Services
from rljax.trainer.state import RunState
from rljax.trainer.teacher import distillation_spec, teacher_service
from rljax.trainer.step import (PackedLogprob, PackedTrainStep, StepConfig, init_state, make_logprob_fn, make_optimizer,
                                make_train_step)
from rljax.trainer.weights import WeightSync


# ---------------------------------------------------------------------------- the model


def tokenizer_for(cfg: Config):
    spec = cfg.model.tokenizer
    if spec in (None, "char") and not (spec is None and cfg.model.path):
        return CharTokenizer()
    return load_tokenizer(spec or cfg.model.path, eos_id=cfg.model.eos_token_id)  # model.eos_token_id: hook for issue 38


def model_for(cfg: Config, mesh, tokenizer):
    """``(model_config, graphdef, params)``: from ``model.path`` (HF) or a preset sized to the tokenizer."""
    if cfg.model.path:
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


def with_lora(cfg: Config, mcfg, params, mesh):
    """``(params, base signature)``: with ``actor.lora.rank > 0`` the actor trains float32 adapters
    (B = 0: it starts as the base) on its frozen base; else the params as they are."""
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
    mcfg, graphdef, params = model_for(cfg, mesh, tokenizer)
    params, base = with_lora(cfg, mcfg, params, mesh)
    return mcfg, graphdef, params, base


def optimizer_for(optim, grad_clip, total_steps: int):
    """AdamW from an ``actor.optim`` / ``critic.optim`` section; ``total_steps`` counts updates."""
    return make_optimizer(lr=optim.lr, weight_decay=optim.weight_decay, warmup_steps=optim.warmup_steps,
                          grad_clip=grad_clip, betas=tuple(optim.betas), eps=optim.eps,
                          scheduler=optim.lr_scheduler, total_steps=total_steps, min_lr_ratio=optim.min_lr_ratio)


def step_config_for(cfg: Config, sizes, *, on_policy: bool) -> StepConfig:
    a, r = cfg.actor, cfg.rollout
    mode, options = policy_loss_config(cfg)
    return StepConfig(
        policy_loss=mode, policy_loss_options=tuple(options.items()), clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c, loss_agg_mode=a.loss_agg_mode, use_kl_loss=a.use_kl_loss,
        kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type, entropy_coeff=a.entropy_coeff,
        ppo_epochs=a.ppo_epochs, ppo_mini_batch_size=sizes.mini_batch_trajectories,
        ppo_micro_batch_size=sizes.micro_batch_trajectories, temperature=r.temperature, logprob_impl=a.logprob_impl,
        use_rollout_correction=r.correction != "none" or decoupled_correction(cfg), shuffle=a.shuffle, on_policy=on_policy,
        matmul_precision=cfg.model.matmul_precision, distillation=distillation_spec(cfg))


# ---------------------------------------------------------------------------- learner passes


def packing_mode(cfg: Config):
    """``actor.use_remove_padding`` as True / False / "auto" (auto: per batch, by lengths); a LoRA
    run with dropout keeps the padded passes under auto (the packed update applies no dropout);
    ``actor.shared_prefix=on`` packs every batch under auto (the shared layout is a packed one)."""
    packing = {"true": True, "false": False, "auto": "auto"}[cfg.actor.use_remove_padding]
    if packing == "auto" and cfg.actor.lora.rank > 0 and cfg.actor.lora.dropout > 0:
        return False
    if packing == "auto" and cfg.actor.shared_prefix == "on":
        return True
    return packing


def learner_fns(role: str, *, packing, graphdef, optimizer, step_config, mesh, packs, response_len: int,
                micro_batch: int, temperature: float = 1.0, logprob_impl: str = "auto", shared_prefix=False) -> RoleFns:
    """``role``'s (``"actor"`` or ``"critic"``) update and forward passes: packed rows with segment
    ids (:mod:`rljax.trainer.packing`), the padded ``[B, S+T]`` layout, or both behind
    :class:`~rljax.trainer.packing.AutoPacking`. ``packs``: ``(update_pack, forward_pack)``
    of :func:`~rljax.trainer.packing.pack_configs`. The critic's update is the actor's with
    the value loss; its forward pass returns values. ``shared_prefix``: the actor's packed
    layout (:func:`rljax.trainer.prefix.plan_layout`; the critic's passes stay unshared)."""
    if role not in ("actor", "critic"):
        raise ValueError(f"role={role!r}: a learner role is 'actor' or 'critic'")
    update_pack, forward_pack = packs
    loss = {} if role == "actor" else {"loss_fn": critic_loss}
    precision = step_config.matmul_precision  # hook for model.matmul_precision
    update = forward = None
    if packing:
        shared = {"shared_prefix": shared_prefix} if role == "actor" else {}  # hook for actor.shared_prefix
        update = PackedTrainStep(graphdef, optimizer, step_config, update_pack, mesh, response_len=response_len,
                                 **loss, **shared)
        if role == "actor":
            forward = PackedLogprob(graphdef, forward_pack, response_len=response_len, temperature=temperature,
                                    impl=logprob_impl, mesh=mesh, matmul_precision=precision, **shared)
        else:
            forward = PackedLogprob(graphdef, forward_pack, response_len=response_len, mesh=mesh,
                                    packed_fn=make_packed_values_fn(graphdef, mesh=mesh, matmul_precision=precision))
    if packing is not True:
        padded_update = make_train_step(graphdef, optimizer, step_config, mesh=mesh, **loss)
        if role == "actor":
            padded_forward = make_logprob_fn(graphdef, response_len=response_len, temperature=temperature,
                                             impl=logprob_impl, mesh=mesh, micro_batch_size=micro_batch,
                                             matmul_precision=precision)
        else:
            padded_forward = jax.jit(traced_at(
                lambda p, b: critic_values(graphdef, p, b, response_len=response_len, mesh=mesh), precision))
        if packing == "auto":
            update, forward = AutoPacking(padded_update, update), AutoPacking(padded_forward, forward)
        else:
            update, forward = padded_update, padded_forward
    return RoleFns(update=update, forward=forward)


def _learner(cfg: Config, mesh, model: Model, params, *, old_logp_in_update: bool):
    """``(Learner, actor train state, critic train state or None)``."""
    a, al, sizes = cfg.actor, cfg.algorithm, model.sizes
    prompt_len, response_len = sizes.learner_prompt_length, sizes.learner_response_length
    mesh_sizes = dict(mesh.shape)
    packs = pack_configs(cfg, dp=data_shards(mesh), sp=mesh_sizes.get("sp", 1),
                         row_len=prompt_len + response_len, micro_batch_size=sizes.micro_batch_trajectories)
    common = dict(packing=packing_mode(cfg), graphdef=model.graphdef, mesh=mesh, packs=packs,
                  response_len=response_len, micro_batch=sizes.micro_batch_trajectories)
    optimizer = optimizer_for(a.optim, a.grad_clip, sizes.optimizer_updates)
    actor = learner_fns("actor", optimizer=optimizer, step_config=model.step_config,
                        temperature=cfg.rollout.temperature, logprob_impl=a.logprob_impl,
                        shared_prefix=prefix.mode_of(a.shared_prefix), **common)
    critic = critic_state = None
    if al.adv_estimator == "gae":  # PPO: a value model beside the policy, packed like the actor
        cc = cfg.critic
        critic_cfg = CriticStepConfig(cliprange_value=cc.cliprange_value, loss_agg_mode=cc.loss_agg_mode,
                                      ppo_epochs=a.ppo_epochs, ppo_mini_batch_size=model.step_config.ppo_mini_batch_size,
                                      ppo_micro_batch_size=sizes.micro_batch_trajectories, shuffle=a.shuffle,
                                      matmul_precision=cfg.model.matmul_precision)
        critic_opt = optimizer_for(cc.optim, cc.grad_clip, sizes.optimizer_updates)
        critic_state = init_state(init_critic(disable(params)), critic_opt)
        critic = learner_fns("critic", optimizer=critic_opt, step_config=critic_cfg, **common)
    prepare_cfg = PrepareConfig(
        estimator=al.adv_estimator, num_groups=cfg.data.train_batch_size,
        algorithm=(("gamma", al.gamma), ("lam", al.lam), ("norm_adv_by_std_in_grpo", al.norm_adv_by_std_in_grpo)),
        use_kl_in_reward=al.use_kl_in_reward, kl_penalty=al.kl_penalty, correction=cfg.rollout.correction,
        correction_threshold=cfg.rollout.correction_threshold,
        rollout_correction=decoupled_correction_options(cfg),
        behaviour_logp="rollout_logp" if al.bypass_mode else "old_logp")
    needs_ref = a.use_kl_loss or al.use_kl_in_reward
    learner = Learner(actor=actor, critic=critic,
                      prepare=make_prepare_fn(prepare_cfg, load_estimator(al.adv_estimator)),
                      prepare_inputs=prepare_cfg.inputs(critic=critic is not None),
                      ref_params=jax.tree.map(jnp.copy, params) if needs_ref and model.lora_base is None else None,
                      ref_is_base=needs_ref and model.lora_base is not None, old_logp_in_update=old_logp_in_update,
                      prompt_len=prompt_len, response_len=response_len)
    return learner, init_state(params, optimizer), critic_state


# ---------------------------------------------------------------------------- the rollout side


def placement_for(cfg: Config, mesh) -> Placement:
    """The placement around a learner ``mesh`` built by a program (the launcher computes its own
    and hands it to :func:`build`): the sampler's devices by the placement rule
    (:class:`rljax.sharding.placement.Placement`)."""
    return Placement.around(mesh, mode=cfg.rollout.placement, num_devices=cfg.rollout.num_devices,
                            local_devices=jax.local_devices(), processes=jax.process_count())


_merge = jax.jit(lora_merge)


def sampler_weights(params):
    """What the sampler reshards from: the learner's arrays (a LoRA actor's merged on device,
    ``W + scale * A @ B``), or their gathered values on multi-host (the sampler mesh is
    process-local)."""
    if isinstance(params, LoRAParams):
        params = _merge(params)
    return params if jax.process_count() == 1 else to_host(params)


def _held_out(cfg: Config, tokenize, data_dir: str, chat) -> Callable:
    """``() -> a fresh pass over the test split``: the split is read and tokenized at the first
    evaluation only (each evaluation read and tokenized it again)."""
    split = []

    def passes():
        if not split:
            split.append(build_prompts(cfg, "test", tokenize, data_dir=data_dir, chat_template=chat))
        return val_iterator(cfg, tokenize, prompts=split[0])

    return passes


def _rollout(cfg: Config, mesh, placement: Placement, model: Model, tokenizer, params, run_dir: str) -> Rollout:
    d, r = cfg.data, cfg.rollout
    data_dir = d.data_dir or os.path.join(run_dir, "data")
    if jax.process_count() > 1:  # TFDS does not guard two processes building one dataset
        data_dir = os.path.join(data_dir, f"process{jax.process_index()}")
    tokenize = lambda text: tokenizer.encode(text, add_bos=True)  # noqa: E731
    chat = tokenizer.apply_chat_template if getattr(tokenizer, "chat_template", None) else None
    eos = (tokenizer.eos_id,)
    decode = DecodeParams(max_new_tokens=d.max_response_length, temperature=r.temperature, top_k=max(r.top_k, 0),
                          top_p=r.top_p, seed=cfg.trainer.seed, eos_ids=eos)
    v = r.val_kwargs
    val_decode = DecodeParams(max_new_tokens=d.max_response_length, temperature=v.temperature,
                              top_k=max(v.top_k, 0), top_p=v.top_p, seed=cfg.trainer.seed + 1, eos_ids=eos)
    # The one choice of single- or multi-turn: the rollout client the stages call (rljax.trainer.clients).
    client, context = TurnClient, d.max_prompt_length
    if cfg.env.function is not None:  # multi-turn episodes (rljax.env): a turn's prompt is the whole context
        env = EnvRuntime.from_config(cfg, tokenizer)
        turn = cfg.env.max_turn_tokens or d.max_response_length
        decode = dataclasses.replace(decode, max_new_tokens=min(turn, d.max_response_length))
        val_decode = dataclasses.replace(val_decode, max_new_tokens=decode.max_new_tokens)
        client, context = functools.partial(EpisodeClient, env=env, tokenizer=tokenizer), context + d.max_response_length
    # Each process runs a sampler on its own devices (same prompts, same random streams); with
    # several processes each generates train_batch_size / P whole groups (single- or multi-turn).
    share = distribute.rollout_share(mesh, d.train_batch_size, r.n)
    # slots for the sessions this process generates (its share: a process sized for the whole
    # batch decoded half-empty slots on 2 processes)
    engine = RljaxEngine(model.config, num_slots=r.max_slots or share.num_rows,
                         max_prefill_length=context, max_decode_length=d.max_response_length,
                         mesh=sampler_mesh(r.tp, list(placement.sampler)),
                         prefill_batch_size=min(d.train_batch_size, 64),
                         matmul_precision=cfg.model.matmul_precision)
    partial = "recompute" if cfg.async_training.partial_rollout == "recompute" else "keep"
    sampler = Sampler(engine, sampler_weights(params), version=0, truncation="error", partial_rollout=partial)
    return Rollout(sampler=sampler, decode=decode,
                   val_decode=val_decode, tokenizer=tokenizer, client=client(sampler),
                   prompts=train_iterator(cfg, tokenize, data_dir=data_dir, chat_template=chat),
                   val_prompts=_held_out(cfg, tokenize, data_dir, chat),
                   share=share, to_sampler=sampler_weights, weights=WeightSync(sampler, sampler_weights))


# ---------------------------------------------------------------------------- reward services


def load_reward_model(s: Services) -> Callable:
    """``inputs -> [B]`` scores of ``reward.model.path`` (:func:`rljax.models.load_hf_reward_model`),
    parameters sharded on the learner mesh, in the policy's compute dtype."""
    rm = s.cfg.reward.model
    config, head, params, head_w = load_hf_reward_model(rm.path, dtype=s.cfg.model.dtype, mesh=s.mesh)
    if rm.label >= head.num_labels:
        raise ValueError(f"reward.model.label={rm.label}, but {rm.path} has {head.num_labels} label(s)")
    policy = getattr(getattr(s.rollout.sampler, "engine", None), "config", None)
    if policy is not None and policy.vocab_size > config.vocab_size:
        raise ValueError(f"reward.model.path={rm.path} has a vocabulary of {config.vocab_size} tokens, the policy's "
                         f"{policy.vocab_size}: the reward model reads the policy's token ids (same tokenizer needed)")
    graphdef, mesh, label = abstract_params(config)[0], s.mesh, rm.label
    fn = jax.jit(lambda p, w, x: reward_scores(graphdef, p, w, x["input_ids"], mask=x["attention_mask"],
                                               positions=x["positions"], mesh=mesh)[:, label])
    return lambda inputs: fn(params, head_w, inputs)


def load_judge(s: Services, state: RunState):
    """The :class:`~rljax.trainer.judge.Judge` of ``reward.judge``, on the policy sampler's devices,
    with a slot for each row this process judges (its share of the batch); ``path=ref``: the
    policy's initial weights (the reference's copy when the run keeps one; on several processes
    their gathered values, as the policy's sampler takes its weights: its mesh is process-local)."""
    engine, share = s.rollout.sampler.engine, s.rollout.share

    def initial():
        if s.learner.ref_params is not None:
            params = s.learner.ref_params
        elif s.learner.ref_is_base:
            params = disable(state.actor.params)
        else:
            params = initial_policy_params(s.cfg, engine.config, s.mesh)
        return to_host(params) if jax.process_count() > 1 else params

    return Judge.from_config(s.cfg, policy_config=engine.config, policy_tokenizer=s.rollout.tokenizer,
                             devices=list(engine.mesh.devices.flat), initial_params=initial, rows=share.num_rows)


# ---------------------------------------------------------------------------- build


def build(cfg: Config, mesh, *, run_dir: str, echo: Callable = print, placement: Placement | None = None):
    """``(services, state, stages)`` of a run of ``cfg`` on the learner ``mesh``, from step 0
    (a resume replaces the state: :func:`rljax.trainer.state.from_checkpoint`). ``run_dir``
    holds the prepared datasets unless ``data.data_dir`` is set; ``placement`` (the launcher's)
    gives the sampler its devices (default: :func:`placement_for` ``mesh``)."""
    placement = placement or placement_for(cfg, mesh)
    tokenizer = tokenizer_for(cfg)
    mcfg, graphdef, params = model_for(cfg, mesh, tokenizer)
    echo(remat_for_run(cfg, mcfg, mesh).line())  # what model.remat resolved to, and why
    if (note := kv_heads_note(mcfg.num_kv_heads, cfg.rollout.tp)) is not None:
        echo(note)  # the sampler's KV cache does not split over rollout.tp
    params, lora_base = with_lora(cfg, mcfg, params, mesh)
    # Sizes in trajectories and the learner's [B, S+T] layout (S and T rounded up to
    # multiples of sp, the extra columns masked everywhere), derived once from the config.
    sizes = derive(cfg, sp=dict(mesh.shape).get("sp", 1))
    # actor.skip_old_log_prob: old_logp from the update itself (detached) when it is exactly
    # on-policy (auto) or required (true; validated); no old_log_prob stage then
    in_update = cfg.actor.skip_old_log_prob != "false" and not on_policy_blockers(cfg)
    model = Model(config=mcfg, graphdef=graphdef, lora_base=lora_base, sizes=sizes,
                  step_config=step_config_for(cfg, sizes, on_policy=in_update))
    learner, actor, critic = _learner(cfg, mesh, model, params, old_logp_in_update=in_update)
    rollout = _rollout(cfg, mesh, placement, model, tokenizer, params, run_dir)
    services = Services(cfg=cfg, mesh=mesh, model=model, rollout=rollout, learner=learner, reward=None)
    rm = Lazy(lambda: load_reward_model(services)) if cfg.reward.model.path is not None else None
    judge = Lazy(lambda state: load_judge(services, state)) if cfg.reward.judge.path is not None else None
    services = dataclasses.replace(services, reward=Reward(fn=make_reward(cfg.reward, dataset=cfg.data.dataset),
                                                           model=rm, judge=judge),
                                   teacher=teacher_service(services))
    al = cfg.algorithm
    state = RunState(actor=actor, critic=critic, key=jax.random.key(cfg.trainer.seed),
                     kl_coef=float(al.kl_ctrl.kl_coef) if al.use_kl_in_reward else 0.0,
                     data=rollout.prompts.state())
    return services, state, S.sync_stages(services)
