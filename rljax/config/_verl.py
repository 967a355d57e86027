"""verl's configuration keys in rljax: the names, the aliases a verl command line may use, and
the verl settings with no rljax counterpart that are accepted as what rljax does.

A verl user's command line or YAML (``actor_rollout_ref.rollout.n=5``,
``actor_rollout_ref.actor.optim.lr=1e-6``, ``custom_reward_function.path=...``,
``reward_model.reward_manager=naive``, Hydra's ``+key=value``) resolves as the rljax keys it
means; each value's source records the verl key it came from (``cli (verl
actor_rollout_ref.rollout.n)``), and ``config.resolved.yaml`` lists the verl settings rljax has
no key for with what rljax does instead. A verl value rljax cannot honour (``param_offload=true``)
is refused in one line. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable

from rljax.errors import ConfigError

#: verl's key for an rljax key whose name differs (rljax drops verl's ``actor_rollout_ref.``
#: prefix: ``actor.*``, ``rollout.*`` and ``model.*`` live under it in verl). Keys whose
#: verl spelling is the same (``data.*``, ``algorithm.*``, ``critic.*``, most of
#: ``trainer.*``) and rljax-only keys are not listed. A note after the name says where the
#: meaning differs.
VERL_NAMES: dict[str, str] = {
    "actor.ppo_mini_batch_size": "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor.ppo_micro_batch_size": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (per device there; global here)",
    "actor.ppo_epochs": "actor_rollout_ref.actor.ppo_epochs",
    "actor.shuffle": "actor_rollout_ref.actor.shuffle",
    "actor.use_kl_loss": "actor_rollout_ref.actor.use_kl_loss",
    "actor.kl_loss_coef": "actor_rollout_ref.actor.kl_loss_coef",
    "actor.kl_loss_type": "actor_rollout_ref.actor.kl_loss_type",
    "actor.clip_ratio_low": "actor_rollout_ref.actor.clip_ratio_low",
    "actor.clip_ratio_high": "actor_rollout_ref.actor.clip_ratio_high",
    "actor.clip_ratio_c": "actor_rollout_ref.actor.clip_ratio_c",
    "actor.loss_agg_mode": "actor_rollout_ref.actor.loss_agg_mode",
    "actor.policy_loss": "actor_rollout_ref.actor.policy_loss.loss_mode",
    "actor.tau_pos": "actor_rollout_ref.actor.tau_pos",
    "actor.tau_neg": "actor_rollout_ref.actor.tau_neg",
    "actor.clip_cov_ratio": "actor_rollout_ref.actor.policy_loss.clip_cov_ratio",
    "actor.clip_cov_lb": "actor_rollout_ref.actor.policy_loss.clip_cov_lb",
    "actor.clip_cov_ub": "actor_rollout_ref.actor.policy_loss.clip_cov_ub",
    "actor.kl_cov_ratio": "actor_rollout_ref.actor.policy_loss.kl_cov_ratio",
    "actor.ppo_kl_coef": "actor_rollout_ref.actor.policy_loss.ppo_kl_coef",
    "actor.dro_beta": "actor_rollout_ref.actor.policy_loss.dro_beta",
    "actor.entropy_coeff": "actor_rollout_ref.actor.entropy_coeff",
    "actor.grad_clip": "actor_rollout_ref.actor.grad_clip",
    "actor.use_remove_padding": "actor_rollout_ref.model.use_remove_padding",
    "actor.use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor.ppo_max_token_len_per_device": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "actor.log_prob_use_dynamic_bsz": "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
    "actor.log_prob_max_token_len_per_device": "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    "actor.optim.lr": "actor_rollout_ref.actor.optim.lr",
    "actor.optim.weight_decay": "actor_rollout_ref.actor.optim.weight_decay",
    "actor.optim.betas": "actor_rollout_ref.actor.optim.betas",
    "actor.optim.warmup_steps": "actor_rollout_ref.actor.optim.lr_warmup_steps",
    "actor.optim.lr_scheduler": "actor_rollout_ref.actor.optim.lr_scheduler_type",
    "actor.optim.min_lr_ratio": "actor_rollout_ref.actor.optim.min_lr_ratio",
    "actor.lora.rank": "actor_rollout_ref.model.lora_rank",
    "actor.lora.alpha": "actor_rollout_ref.model.lora_alpha",
    "actor.lora.target_modules": "actor_rollout_ref.model.target_modules",
    "critic.cliprange_value": "critic.cliprange_value",
    "rollout.n": "actor_rollout_ref.rollout.n",
    "rollout.temperature": "actor_rollout_ref.rollout.temperature",
    "rollout.top_p": "actor_rollout_ref.rollout.top_p",
    "rollout.top_k": "actor_rollout_ref.rollout.top_k",
    "rollout.tp": "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "rollout.max_slots": "actor_rollout_ref.rollout.max_num_seqs",
    "rollout.val_kwargs.n": "actor_rollout_ref.rollout.val_kwargs.n",
    "rollout.val_kwargs.temperature": "actor_rollout_ref.rollout.val_kwargs.temperature",
    "rollout.val_kwargs.top_p": "actor_rollout_ref.rollout.val_kwargs.top_p",
    "rollout.val_kwargs.top_k": "actor_rollout_ref.rollout.val_kwargs.top_k",
    "reward.function": "custom_reward_function.path + custom_reward_function.name (one 'path:name' here)",
    "reward.model.path": "reward.reward_model.model_path (with reward.reward_model.enable=true; older verl: "
                         "reward_model.model.path with reward_model.enable=true; here the path alone turns it on)",
    "env.max_turns": "actor_rollout_ref.rollout.multi_turn.max_assistant_turns",
    "model.path": "actor_rollout_ref.model.path",
    "model.remat": "actor_rollout_ref.model.enable_gradient_checkpointing",
    "trainer.total_steps": "trainer.total_training_steps",
    "trainer.max_checkpoints": "trainer.max_actor_ckpt_to_keep",
    "trainer.resume_from": "trainer.resume_from_path (a step number here, a path there)",
    "trainer.output_dir": "trainer.default_local_dir",
    "async_training.max_staleness": "async_training.staleness_threshold (a fraction of samples there, weight versions here)",
}


#: verl key -> the rljax key of the same meaning: every :data:`VERL_NAMES` entry without a note,
#: and spellings of the same keys in other verl versions.
ALIASES: dict[str, str] = {
    **{verl: key for key, verl in VERL_NAMES.items() if " " not in verl and verl != key},
    "actor_rollout_ref.actor.ppo_micro_batch_size": "actor.ppo_micro_batch_size",  # global in verl too (deprecated)
    "actor_rollout_ref.actor.optim.warmup_style": "actor.optim.lr_scheduler",
    "reward_model.model.path": "reward.model.path",
    "reward.reward_model.model_path": "reward.model.path",
    "reward_model.reward_kwargs.max_resp_len": "reward.reward_kwargs.max_resp_len",
    **{f"reward_model.reward_kwargs.overlong_buffer_cfg.{k}": f"reward.reward_kwargs.overlong_buffer_cfg.{k}"
       for k in ("enable", "len", "penalty_factor", "log")},
    "actor_rollout_ref.rollout.multi_turn.max_turns": "env.max_turns",
    "critic.optim.lr_warmup_steps": "critic.optim.warmup_steps",
    "algorithm.rollout_correction.bypass_mode": "algorithm.bypass_mode",  # verl keeps it in the section
}
#: verl's run length in epochs: beside ``trainer.total_training_steps`` the step count wins (as in
#: verl); alone it sets ``trainer.total_steps`` from the train split (:func:`steps_from_epochs`).
EPOCHS_KEY = "trainer.total_epochs"
#: The two verl keys that together name the reward function (``reward.function='path:name'``).
REWARD_FUNCTION_KEYS = ("custom_reward_function.path", "custom_reward_function.name")


def _is(*accepted) -> Callable:
    def accepts(v) -> bool:
        return v in accepted

    show = lambda a: "null" if a is None else str(a).lower() if isinstance(a, bool) else str(a)  # noqa: E731
    accepts.accepted = " or ".join(map(show, accepted))  # what a refusal names
    return accepts


def _any(_v) -> bool:
    return True


def _count(v) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0)


_count.accepted = "a positive integer or null"


_MEMORY = ("a memory knob of verl's per-GPU micro-batches; rljax splits the update by actor.ppo_micro_batch_size "
           "(global; null picks it from memory), the same numbers either way")
_VLLM = "a vLLM / SGLang engine setting; rljax generates with its own JAX sampler"
_FSDP = "rljax runs one SPMD program over trainer.mesh (--mesh), not FSDP workers"
_OFFLOAD = ("rljax keeps parameters and optimizer state on the devices (no host offload: the same numbers, more "
            "device memory); python -m rljax.launch ... --plan says whether the run fits and which --mesh shards it")

#: verl settings rljax has no key for: ``verl key -> (accepts(value), what rljax does)``. A value
#: accepted is what rljax does anyway (recorded, nothing set); another one is a usage error.
NO_COUNTERPART: dict[str, tuple[Callable, str]] = {
    "actor_rollout_ref.hybrid_engine": (_is(True), "the actor and the sampler share the weights (rollout.placement)"),
    "actor_rollout_ref.rollout.name": (_any, "rljax generates with its own JAX sampler (no vLLM / SGLang / HF)"),
    "actor_rollout_ref.rollout.mode": (_is("sync", "async"), "the sampler runs in process; trainer.mode=async is "
                                                             "rljax's off-policy schedule"),
    "actor_rollout_ref.rollout.gpu_memory_utilization": (_any, "rljax sizes the sampler's KV cache from "
                                                               "rollout.max_slots and the lengths, not a memory fraction"),
    **{f"actor_rollout_ref.rollout.{k}": (_any, _VLLM) for k in (
        "enforce_eager", "free_cache_engine", "enable_chunked_prefill", "max_num_batched_tokens", "load_format",
        "disable_log_stats", "dtype", "max_model_len", "engine_kwargs.swap_space", "calculate_log_probs")},
    "actor_rollout_ref.rollout.do_sample": (_is(True), "training rollouts sample (rollout.temperature)"),
    "actor_rollout_ref.rollout.val_kwargs.do_sample": (_any, "validation samples when "
                                                             "rollout.val_kwargs.temperature > 0, else greedy"),
    **{k: (_count, _MEMORY) for k in (
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.rollout.log_prob_micro_batch_size",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "actor_rollout_ref.ref.log_prob_micro_batch_size",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "critic.ppo_micro_batch_size_per_gpu",
        "reward_model.micro_batch_size_per_gpu")},
    **{k: (_is("fsdp", "fsdp2"), _FSDP) for k in (
        "actor_rollout_ref.actor.strategy", "actor_rollout_ref.ref.strategy", "critic.strategy", "reward_model.strategy")},
    **{k: (_is(False, True), _OFFLOAD) for k in (
        "actor_rollout_ref.actor.fsdp_config.param_offload", "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
        "actor_rollout_ref.ref.fsdp_config.param_offload", "critic.model.fsdp_config.param_offload",
        "critic.model.fsdp_config.optimizer_offload", "reward_model.model.fsdp_config.param_offload")},
    "actor_rollout_ref.actor.use_torch_compile": (_any, "rljax compiles with XLA (jax.jit) always"),
    "actor_rollout_ref.model.use_liger": (_any, "rljax's kernels are XLA's (and rljax.pallas)"),
    "trainer.n_gpus_per_node": (_count, "rljax uses the devices it sees; --mesh sets their layout"),
    EPOCHS_KEY: (_count, "trainer.total_steps is total_epochs x the train rows left after filtering // "
                         "data.train_batch_size when no trainer.total_training_steps is given beside it (which "
                         "overrides total_epochs, as in verl)"),
    "trainer.nnodes": (_is(1), "one host; several hosts are --coordinator / --num-processes / --process-id"),
    "trainer.critic_warmup": (_is(0), "the critic and the actor update from the first step"),
    "trainer.default_hdfs_dir": (_is(None), "checkpoints go to the run directory only"),
    "data.reward_fn_key": (_is("data_source"), "the reward receives each row's data_source"),
    "data.return_raw_chat": (_any, "rljax keeps each prompt's text and chat messages"),
    **dict.fromkeys(("reward_model.enable", "reward.reward_model.enable"),
                    (_any, "reward.model.path alone turns the reward model on (checked against it)")),
    "reward_model.reward_manager": (_is("naive", "dapo"), "rljax scores each response with the function (verl's "
                                                          "naive manager); dapo's overlong shaping is "
                                                          "reward.reward_kwargs.overlong_buffer_cfg (verl's "
                                                          "reward_model.reward_kwargs)"),
    "reward_model.launch_reward_fn_async": (_any, "rljax's reward runs in worker processes (reward.num_workers)"),
    "ray_init.num_cpus": (_any, "rljax runs no Ray cluster; reward.num_workers sets the reward's processes"),
}


#: ``count(config) -> (where, PromptStats)``: the train split's rows as the trainer prepares them.
#: rljax.data (a layer above this one) installs ``rljax.data.train_prompt_count`` when imported.
_train_rows: Callable | None = None


def set_train_row_counter(count: Callable | None) -> Callable | None:
    """Installs the train-row counter :func:`steps_from_epochs` reads the data with (rljax.data's);
    returns the previous one."""
    global _train_rows
    previous, _train_rows = _train_rows, count
    return previous


def steps_from_epochs(config, epochs: int) -> tuple[int, str]:
    """``(trainer.total_steps, its source)`` for ``trainer.total_epochs`` given without a step count:
    verl's ``len(train_dataloader) * total_epochs``, its dataloader dropping the last partial batch
    (as rljax's train iterator does) over the train rows left after ``data.filter_overlong_prompts``
    and the empty-row skips. Reads the train split as the data pre-flight does (the tokenizer of
    ``config.model``, through the counter rljax.data installs: :func:`set_train_row_counter`);
    :class:`ConfigError` (one line) when no full batch is left."""
    if _train_rows is None:
        raise ConfigError(f"{EPOCHS_KEY}={epochs} (verl's) without trainer.total_training_steps counts the train "
                          "rows, which needs rljax.data imported (the launcher and rljax.train do); or give "
                          "trainer.total_training_steps")
    where, stats = _train_rows(config)
    batch = config.data.train_batch_size
    per_epoch = stats.kept // batch
    rows = (f"{stats.kept} of {stats.total} train rows kept ({where}; {stats.filtered} filtered as overlong"
            + (f", {stats.no_answer + stats.no_prompt} empty" if stats.no_answer + stats.no_prompt else "") + ")")
    if per_epoch == 0:
        raise ConfigError(f"{EPOCHS_KEY}={epochs} (verl's): {rows} make no full batch of data.train_batch_size="
                          f"{batch}, so an epoch has no step; use a smaller batch, more rows, or "
                          "trainer.total_training_steps")
    return per_epoch * epochs, (f"derived: {EPOCHS_KEY}={epochs} x {per_epoch} steps an epoch: {rows} // "
                                f"data.train_batch_size={batch}, the last partial batch dropped")


def verl_key_prefixes() -> frozenset:
    """Every section path of the keys above (``actor_rollout_ref``, ``actor_rollout_ref.rollout`` ...):
    what a nested verl YAML walks through."""
    out = set()
    for k in (*ALIASES, *NO_COUNTERPART, *REWARD_FUNCTION_KEYS):
        parts = k.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return frozenset(out)


def is_verl_key(key: str) -> bool:
    return key in ALIASES or key in NO_COUNTERPART or key in REWARD_FUNCTION_KEYS
