"""The typed configuration schema: every field, its type, its default and its bounds.

Names follow verl wherever the meaning is the same (``data.train_batch_size``,
``actor.ppo_mini_batch_size``, ``rollout.n``, ``algorithm.adv_estimator`` ...), with
verl's ``actor_rollout_ref.`` prefix dropped. Units of the batch sizes:

* ``data.train_batch_size``: **prompts** per training step (verl's meaning); the step
  generates ``train_batch_size * rollout.n`` trajectories.
* ``actor.ppo_mini_batch_size``: **prompts** per optimizer update (verl's meaning); one
  update consumes ``ppo_mini_batch_size * rollout.n`` trajectories, so a step makes
  ``train_batch_size / ppo_mini_batch_size`` updates per PPO epoch.
* ``actor.ppo_micro_batch_size``: **trajectories** per forward/backward pass, *global*
  (summed over data-parallel devices, unlike verl's ``*_per_gpu``); gradients of
  ``ppo_mini_batch_size * rollout.n / ppo_micro_batch_size`` micro-batches are
  accumulated into one update. ``null`` means one micro-batch per mini-batch.

This module is pure Python: the launcher resolves and validates the configuration before
JAX initialises.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "gae")
#: Estimators that compare the samples of one prompt group and so need ``rollout.n >= 2``.
GROUP_ESTIMATORS = ("grpo", "rloo")
KL_LOSS_TYPES = ("k1", "kl", "k2", "k3", "low_var_kl", "abs", "mse", "k1+", "k3+")
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSSES = ("vanilla", "gspo", "cispo", "dppo_tv", "dppo_kl", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro",
                 "bypass_mode")
#: ``algorithm.rollout_correction.rollout_is`` levels and the bypass mode's loss types (verl's).
ROLLOUT_IS_LEVELS = ("token", "sequence")
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")
LOGPROB_IMPLS = ("auto", "chunked", "naive", "pallas")
TRUNCATIONS = ("error", "left", "right")
CORRECTIONS = ("none", "token", "sequence")
DATASETS = ("embedded", "gsm8k", "local")
#: Experiment loggers of ``trainer.logger`` (:mod:`rljax.trace.loggers`).
LOGGERS = ("console", "tensorboard", "wandb", "mlflow")
EMBEDDED_TASKS = ("add", "reverse", "lookup")
DTYPES = ("float32", "bfloat16")
#: ``model.matmul_precision`` values (rljax.models.precision.MATMUL_PRECISIONS, kept in sync by a test).
MATMUL_PRECISIONS = ("default", "high", "highest")
#: Projections that may carry LoRA adapters (rljax.models.lora.TARGETS; HF / PEFT names).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Modules a LoRA run may train in full beside the adapters (rljax.models.lora.SAVE_MODULES).
LORA_SAVE_MODULES = ("lm_head", "embed_tokens")
#: Model presets of :mod:`rljax.models.config` (kept in sync by a test; listed here so
#: that validating a config does not import JAX).
MODEL_PRESETS = ("tiny", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama-3.2-1b", "llama-3.1-8b")
#: Each preset's ``max_position_embeddings`` (kept in sync by the same test), for the pre-flight.
PRESET_POSITIONS = {"tiny": 512, "qwen2.5-0.5b": 32768, "qwen2.5-1.5b": 131072, "qwen2.5-7b": 131072,
                    "llama-3.2-1b": 131072, "llama-3.1-8b": 131072}
#: ``model.*`` keys that override a preset's ``rljax.models.ModelConfig`` field of the same name
#: (the vocabulary is the tokenizer's).
MODEL_SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                      "head_dim", "max_position_embeddings", "rope_theta", "tie_embeddings", "qkv_bias")
#: ``algorithm.filter_groups.metric`` values (rljax.reward.FILTER_METRICS, kept in sync by a test).
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
#: Built-in reward functions (see :mod:`rljax.reward`); ``auto`` picks the dataset's own.
REWARD_BUILTINS = ("auto", "embedded", "gsm8k", "exact_match")
#: ``distillation.distillation_loss.loss_mode`` values (rljax.loss.DISTILLATION_LOSS_MODES, kept in sync by a test):
#: the reverse-KL estimators of the sampled token (verl's kl_penalty names) and the forward KL over the teacher's top-k.
DISTILLATION_LOSS_MODES = ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs", "forward_kl_topk")


def _f(default, doc: str, *, gt=None, ge=None, lt=None, le=None, factory=None, needs: tuple[str, ...] = ()):
    """A leaf key. ``needs``: full keys of which at least one must be set (not null / false / 0),
    or ``key=pattern`` (that key's value matches the ``fnmatch`` pattern), for the run to read
    this one; set to a non-default without them it is a usage error
    (:func:`rljax.config._validate.check_switched_off`)."""
    meta = {"doc": doc, "gt": gt, "ge": ge, "lt": lt, "le": le}
    if needs:
        meta["needs"] = tuple(needs)
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _section(cls, doc: str, *, switch: Optional[tuple] = None):
    """A nested section. ``switch=(key, what)``: the section's feature (``what``, e.g. "the judge")
    is off while its field ``key`` (or, dotted, the key of that full name elsewhere) is null /
    false / 0, and then none of its other keys (nested sections' keys included) may differ from
    their defaults (a usage error, :func:`rljax.config._validate.check_switched_off`).
    ``switch=(key, what, value)``: on only while ``key`` equals ``value`` (``critic`` <-
    ``algorithm.adv_estimator=gae``)."""
    meta = {"doc": doc} if switch is None else {"doc": doc, "switch": switch}
    return dataclasses.field(default_factory=cls, metadata=meta)


@dataclasses.dataclass(frozen=True)
class EmbeddedTaskConfig:
    task: Literal[EMBEDDED_TASKS] = _f("add", "add: 'a+b=' -> decimal sum; reverse: 'rev abc=' -> 'cba'; lookup: "
                                              "'key xy=' -> a digit only the lookup tool knows (env.function=lookup)")
    max_operand: int = _f(9, "add: operands are drawn uniformly from [0, max_operand]; lookup: so is the answer "
                             "digit (<= 9)", ge=1, le=10**6)
    length: int = _f(3, "reverse: length of the lowercase string", ge=1, le=64)
    num_train: int = _f(2048, "examples in the train split", ge=1)
    num_test: int = _f(128, "examples in the test split", ge=1)
    seed: int = _f(0, "generation seed of the dataset content (independent of trainer.seed)")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    dataset: Literal[DATASETS] = _f(
        "embedded", "embedded synthetic task; gsm8k (local GSM8K-format files); local (any local jsonl / json / "
        "parquet files or a datasets.save_to_disk directory, verl's parquet layout as is)")
    path: Optional[str] = _f(None, "gsm8k / local: directory holding train* and test* (local: also validation*) "
                                   ".jsonl, .json or .parquet files, or a datasets.save_to_disk directory")
    train_files: Optional[str] = _f(None, "local, instead of data.path (verl's key): the train file, a "
                                          "datasets.save_to_disk directory, or a list [a.parquet,b.parquet]")
    val_files: Optional[str] = _f(None, "local, with data.train_files (verl's key): the validation file(s), as "
                                        "data.train_files")
    data_dir: Optional[str] = _f(None, "TFDS data_dir for the prepared array_record files (null: TFDS default)")
    prompt_key: Optional[str] = _f(None, "field holding the prompt: text, or a list of {role, content} messages "
                                         "(null: gsm8k 'question'; local the first of prompt, question, problem, "
                                         "query, instruction)")
    answer_key: Optional[str] = _f(None, "field holding the reference answer given to the reward; a dotted key "
                                         "reaches into nested fields (null: gsm8k 'answer', '... #### 42'; local the "
                                         "first of reward_model.ground_truth, ground_truth, answer, solution, target)")
    messages_key: Optional[str] = _f(None, "local: field holding a whole conversation (TRL's messages); the prompt "
                                           "is the messages before the last assistant one, whose content is the "
                                           "answer unless data.answer_key names one")
    prompt_template: Optional[str] = _f(None, "format string with one '{prompt}' field for text prompts (null: the "
                                              "dataset's own)")
    apply_chat_template: Literal["auto", "true", "false"] = _f(
        "auto", "render prompts with the tokenizer's chat template (tokenizer_config.json chat_template), with a "
        "generation prompt: auto: message-list prompts; true: text prompts too (as the user message, after "
        "prompt_template); false: never (message contents joined by blank lines)")
    system_prompt: Optional[str] = _f(None, "a system message put first in chat-templated prompts that have none")
    train_batch_size: int = _f(32, "prompts per training step", ge=1)
    val_batch_size: Optional[int] = _f(None, "prompts per validation batch (null: the whole test split)", ge=1)
    max_prompt_length: int = _f(16, "prompt tokens after formatting", ge=1)
    max_response_length: int = _f(8, "generated tokens per response", ge=1)
    filter_overlong_prompts: bool = _f(False, "drop prompts longer than max_prompt_length before training")
    truncation: Literal[TRUNCATIONS] = _f("error", "what to do with an overlong prompt that was not filtered (and with an "
                                           "empty or null prompt: error refuses it, left / right skip and count it)")
    trim_prompt_padding: bool = _f(
        True, "learner passes (old/ref log-probs, values, update) drop the prompt columns that are left padding in "
        "every row of the step's batch: the width is the batch's longest prompt rounded up to 4 lengths per octave "
        "(5, 6, 7, 8, 10, 12, 14, 16, 20, ...) and to a multiple of sp, at most max_prompt_length; same numbers, one "
        "program per width (several processes agree on the width of the whole batch: one int all-gathered per step; "
        "false: always max_prompt_length columns)")
    shuffle: bool = _f(True, "shuffle the train split each epoch, from (seed, epoch)")
    seed: Optional[int] = _f(None, "seed of the epoch shuffles (null: trainer.seed)")
    embedded: EmbeddedTaskConfig = _section(EmbeddedTaskConfig, "the embedded synthetic task")


@dataclasses.dataclass(frozen=True)
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = _f("fixed", "KL-in-reward coefficient: fixed kl_coef, or adaptive (verl's "
                                            "AdaptiveKLController, starting at kl_coef)")
    kl_coef: float = _f(0.001, "KL-in-reward coefficient (initial value when adaptive)", ge=0.0)
    target_kl: float = _f(0.1, "adaptive: the KL (per-token mean over a sequence, batch mean) the coefficient steers to", gt=0.0)
    horizon: int = _f(10000, "adaptive: each step multiplies the coefficient by 1 + clip(kl/target_kl - 1, +-0.2) * trajectories / horizon",
                      ge=1)


@dataclasses.dataclass(frozen=True)
class FilterGroupsConfig:
    enable: bool = _f(False, "DAPO dynamic sampling: after the reward, drop the prompt groups whose metric has zero "
                             "variance (no GRPO signal) and draw more prompt batches until data.train_batch_size groups "
                             "are kept (the surplus of the last batch is dropped too); metrics train/num_gen_batches, "
                             "train/kept_groups, train/dropped_groups, train/excess_groups; sync or async (the producer "
                             "fills each queued batch), single- or multi-turn; several processes agree on the kept "
                             "groups each draw (sync only)")
    metric: Literal[FILTER_METRICS] = _f("acc", "the per-trajectory value whose variance decides: acc (the task "
                                                "reward), score / seq_reward / seq_final_reward (after the overlong "
                                                "penalty)")
    max_num_gen_batches: int = _f(10, "prompt batches one step may draw before it stops with an error (the data are "
                                      "too easy or too hard for the filter); 0: no limit (verl's 0)", ge=0)


#: ``needs`` entry: an estimator of one's own (``path/to/file.py:function``) is handed every
#: ``algorithm.*`` hyper-parameter, so it may read any of them.
_OWN_ESTIMATOR = "algorithm.adv_estimator=*:*"


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionConfig:
    rollout_is: Optional[Literal[ROLLOUT_IS_LEVELS]] = _f(
        None, "importance weights pi_old / pi_rollout on the policy loss: token, sequence (their product over the "
              "response), null: none (rollout.correction is the older spelling of token / sequence)")
    rollout_is_threshold: str = _f(
        "2.0", "a number U: truncated IS, weights min(w, U); 'L_U' (e.g. 0.5_5.0): IcePop, weights outside [L, U] "
               "are zeroed", needs=("algorithm.rollout_correction.rollout_is",))
    rollout_is_batch_normalize: bool = _f(False, "divide the weights by their mean over the batch (per sequence for "
                                                 "sequence)", needs=("algorithm.rollout_correction.rollout_is",))
    rollout_rs: Optional[str] = _f(
        None, "rejection by divergence, comma separated, every option must pass: token_k1..3, seq_sum_k1..3, "
              "seq_mean_k1..3, seq_max_k2, seq_max_k3 (k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r); a "
              "rejected token gets weight 0; null: none")
    rollout_rs_threshold: Optional[str] = _f(
        None, "bounds of rollout_rs: one for all options or one per option, comma separated; k1 options take 'L_U' "
              "(or U, then L = 1/U), k2 / k3 options an upper bound", needs=("algorithm.rollout_correction.rollout_rs",))
    loss_type: Literal[BYPASS_LOSS_TYPES] = _f(
        "ppo_clip", "with algorithm.bypass_mode: ppo_clip (the PPO ratio against the sampler is the correction; "
                    "weights computed for their metrics) or reinforce (-w A log pi with the weights)",
        needs=("algorithm.bypass_mode",))


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str = _f("grpo", "advantage estimator: grpo, rloo, reinforce_plus_plus_baseline, gae, or "
                                    "path/to/file.py:function (your own, with the registry's signature)")
    norm_adv_by_std_in_grpo: bool = _f(True, "grpo: divide by the group standard deviation (false: Dr. GRPO); read "
                                             "by grpo and an estimator of your own only (with another, a usage error)",
                                       needs=("algorithm.adv_estimator=grpo", _OWN_ESTIMATOR))
    use_kl_in_reward: bool = _f(False, "subtract a KL penalty to the reference policy from the token rewards")
    kl_penalty: Literal[KL_LOSS_TYPES] = _f(
        "kl", "KL estimator of the in-reward penalty"
    )
    kl_ctrl: KLControlConfig = _section(KLControlConfig, "KL-in-reward controller",
                                        switch=("algorithm.use_kl_in_reward", "the KL penalty in the reward"))
    gamma: float = _f(1.0, "discount factor; read by gae and an estimator of your own only (with another, a usage "
                           "error)", ge=0.0, le=1.0, needs=("algorithm.adv_estimator=gae", _OWN_ESTIMATOR))
    lam: float = _f(1.0, "GAE lambda; read by gae and an estimator of your own only (with another, a usage error)",
                    ge=0.0, le=1.0, needs=("algorithm.adv_estimator=gae", _OWN_ESTIMATOR))
    bypass_mode: bool = _f(
        False, "use the sampler's rollout_logp as old_logp (skip the learner's old log-prob pass; "
        "PPO ratios are then taken against the sampling policy)"
    )
    rollout_correction: RolloutCorrectionConfig = _section(
        RolloutCorrectionConfig, "verl's rollout correction: importance weights (TIS / IcePop) and rejection sampling "
                                 "between the sampler's and the learner's log-probs; with algorithm.bypass_mode, verl's "
                                 "bypass_mode loss against the current policy")
    filter_groups: FilterGroupsConfig = _section(FilterGroupsConfig, "DAPO dynamic sampling (verl's "
                                                                      "algorithm.filter_groups)",
                                                 switch=("enable", "dynamic sampling"))


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = _f(1e-6, "peak learning rate (AdamW)", gt=0.0)
    weight_decay: float = _f(0.01, "AdamW weight decay", ge=0.0)
    betas: tuple[float, float] = _f((0.9, 0.999), "AdamW (beta1, beta2)")
    eps: float = _f(1e-8, "AdamW epsilon", gt=0.0)
    warmup_steps: int = _f(0, "linear warm-up steps", ge=0)
    lr_scheduler: Literal["constant", "cosine"] = _f("constant", "schedule after warm-up")
    min_lr_ratio: float = _f(0.0, "cosine: final lr as a fraction of lr", ge=0.0, le=1.0)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = _f(0, "LoRA rank of the actor's adapters (0: off, every parameter trains)", ge=0)
    alpha: float = _f(16.0, "LoRA alpha: the adapters' update is scaled by alpha / rank", gt=0.0)
    target_modules: tuple[Literal[LORA_TARGETS], ...] = _f(LORA_TARGETS, "projections that get adapters")
    dropout: float = _f(0.0, "dropout on the adapters' input, in the update pass only", ge=0.0, lt=1.0)
    modules_to_save: tuple[Literal[LORA_SAVE_MODULES], ...] = _f(
        (), "modules trained in full beside the adapters (PEFT's modules_to_save; untied embeddings only)")


@dataclasses.dataclass(frozen=True)
class ActorConfig:
    ppo_mini_batch_size: int = _f(16, "prompts per optimizer update; divides data.train_batch_size", ge=1)
    ppo_micro_batch_size: Optional[int] = _f(
        None, "trajectories per forward/backward (global); divides ppo_mini_batch_size*rollout.n; null: no accumulation", ge=1
    )
    ppo_epochs: int = _f(1, "passes over each step's batch", ge=1)
    shuffle: bool = _f(True, "shuffle the step's trajectories before splitting them into mini-batches "
                       "(each epoch, from trainer.seed and the step; false: batch order)")
    use_kl_loss: bool = _f(False, "add a KL loss to the reference policy")
    kl_loss_coef: float = _f(0.001, "KL loss coefficient", ge=0.0)
    kl_loss_type: Literal[KL_LOSS_TYPES] = _f(
        "low_var_kl", "KL estimator of the KL loss"
    )
    clip_ratio_low: float = _f(0.2, "PPO lower clip epsilon", ge=0.0, lt=1.0)
    clip_ratio_high: float = _f(0.2, "PPO upper clip epsilon (raise for clip-higher / DAPO)", ge=0.0)
    clip_ratio_c: float = _f(3.0, "dual-clip constant for negative advantages", gt=1.0)
    loss_agg_mode: Literal[LOSS_AGG_MODES] = _f("token-mean", "how token losses are reduced")
    policy_loss: Literal[POLICY_LOSSES] = _f(
        "vanilla", "policy loss (verl's loss_mode): vanilla (dual-clip PPO), gspo, cispo, dppo_tv / dppo_kl (DPPO: "
        "clip_ratio_low/high are divergence thresholds, clip_ratio_c truncates the ratio), sapo, gpg, clip_cov, kl_cov, "
        "geo_mean (GMPO), dro, bypass_mode (with algorithm.bypass_mode; see algorithm.rollout_correction)")
    tau_pos: float = _f(1.0, "sapo: gate temperature of tokens with a positive advantage", gt=0.0,
                        needs=("actor.policy_loss=sapo",))
    tau_neg: float = _f(1.05, "sapo: gate temperature of the others (> tau_pos for asymmetry)", gt=0.0,
                        needs=("actor.policy_loss=sapo",))
    clip_cov_ratio: float = _f(0.0002, "clip_cov: fraction of the tokens whose gradient is detached", gt=0.0,
                               needs=("actor.policy_loss=clip_cov",))
    clip_cov_lb: float = _f(1.0, "clip_cov: lower bound of the covariance of the tokens it may detach",
                            needs=("actor.policy_loss=clip_cov",))
    clip_cov_ub: float = _f(5.0, "clip_cov: upper bound of that covariance", needs=("actor.policy_loss=clip_cov",))
    kl_cov_ratio: float = _f(0.0002, "kl_cov: fraction of the tokens (largest covariance) that get the KL penalty",
                             gt=0.0, needs=("actor.policy_loss=kl_cov",))
    ppo_kl_coef: float = _f(0.1, "kl_cov: coefficient of its |log ratio| penalty", ge=0.0,
                            needs=("actor.policy_loss=kl_cov",))
    dro_beta: Optional[float] = _f(None, "dro: coefficient of the quadratic log-ratio penalty (required with dro)",
                                   gt=0.0, needs=("actor.policy_loss=dro",))
    entropy_coeff: float = _f(0.0, "entropy bonus coefficient", ge=0.0)
    grad_clip: Optional[float] = _f(1.0, "global gradient-norm clip (null: none)", gt=0.0)
    logprob_impl: Literal[LOGPROB_IMPLS] = _f("auto", "fused log-prob/entropy kernel")
    skip_old_log_prob: Literal["auto", "true", "false"] = _f(
        "auto", "take old_logp from the update's own log-probs (detached) instead of a separate old_log_prob pass; "
        "equal when the update is exactly on-policy (one epoch, one mini-batch, nothing reads old_logp before the "
        "update). auto: whenever it is; true: required (a usage error otherwise); false: always the separate pass")
    use_remove_padding: Literal["auto", "true", "false"] = _f(
        "auto", "pack trajectories' real tokens into rows with segment ids for the learner passes (no padding); "
        "auto: per batch, packed when its real tokens fill at most half of the padded [B, S+T] layout")
    shared_prefix: Literal["auto", "on", "off"] = _f(
        "auto", "lay each group's prompt once in the packed learner rows, its rollout.n responses after it (each "
        "response attends to the prompt and itself, positions continue from the prompt): the actor's old / reference "
        "log-prob passes and update compute the prompt once instead of n times, with the unshared layout's log-probs, "
        "loss and gradients (the critic's passes stay unshared). auto: per packed batch, when it saves at least 20% "
        "of the learner's tokens and the sequence is not split (trainer.mesh sp=1); on: every batch, which needs the "
        "packed layout (use_remove_padding=true, or auto, which on makes packed for every batch); off: never")
    use_dynamic_bsz: bool = _f(
        True, "packed update micro-batches by token budget (ppo_max_token_len_per_device) instead of trajectory count "
        "(packed passes only; false: ppo_micro_batch_size trajectories per packed micro-batch)")
    ppo_max_token_len_per_device: Optional[int] = _f(
        None, "tokens per device per packed update micro-batch (null: the padded micro-batch's, "
        "ppo_micro_batch_size / dp rows of S+T / sp tokens)", ge=1)
    log_prob_use_dynamic_bsz: bool = _f(
        True, "packed old/ref log-prob passes in chunks of log_prob_max_token_len_per_device tokens per device")
    log_prob_max_token_len_per_device: Optional[int] = _f(
        None, "tokens per device per packed log-prob chunk (null: as ppo_max_token_len_per_device)", ge=1)
    optim: OptimConfig = _section(OptimConfig, "actor optimizer")
    lora: LoraConfig = _section(LoraConfig, "LoRA: train low-rank adapters on a frozen base (rank 0: off)",
                                switch=("rank", "LoRA"))


@dataclasses.dataclass(frozen=True)
class CriticConfig:
    cliprange_value: float = _f(0.5, "value clipping range", gt=0.0)
    grad_clip: Optional[float] = _f(1.0, "global gradient-norm clip (null: none)", gt=0.0)
    loss_agg_mode: Literal[LOSS_AGG_MODES] = _f("token-mean", "how token value losses are reduced")
    optim: OptimConfig = _f(None, "critic optimizer", factory=lambda: OptimConfig(lr=1e-5))


@dataclasses.dataclass(frozen=True)
class ValKwargsConfig:
    n: int = _f(1, "samples per validation prompt", ge=1)
    temperature: float = _f(0.0, "validation temperature (0: greedy)", ge=0.0)
    top_p: float = _f(1.0, "validation nucleus mass", gt=0.0, le=1.0)
    top_k: int = _f(-1, "validation top-k (-1 or 0: off)", ge=-1)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    n: int = _f(8, "samples per prompt (the group size)", ge=1)
    temperature: float = _f(1.0, "sampling temperature", gt=0.0)
    top_p: float = _f(1.0, "nucleus sampling mass", gt=0.0, le=1.0)
    top_k: int = _f(-1, "top-k sampling (-1 or 0: off)", ge=-1)
    tp: int = _f(1, "sampler tensor parallelism; replicas = devices / tp", ge=1)
    max_slots: Optional[int] = _f(None, "concurrent decode slots of the sampler (null: the whole batch; on several "
                                        "processes, the process's share of it)", ge=1)
    correction: Literal[CORRECTIONS] = _f("none", "rollout-vs-learner importance correction (TIS)")
    correction_threshold: float = _f(2.0, "truncation C of the correction weights", gt=0.0)
    placement: Literal["colocated", "disaggregated"] = _f(
        "colocated", "colocated: the sampler shares the learner's devices; disaggregated: the sampler runs on "
        "rollout.num_devices devices of its own per process, the learner mesh (--mesh) on the rest")
    num_devices: Optional[int] = _f(None, "disaggregated: sampler devices per process (a multiple of rollout.tp)", ge=1)
    val_kwargs: ValKwargsConfig = _section(ValKwargsConfig, "decoding for validation")


@dataclasses.dataclass(frozen=True)
class OverlongBufferConfig:
    enable: bool = _f(False, "DAPO's soft overlong penalty: add min(-(l - (max_resp_len - len)) / len * penalty_factor, 0) "
                             "to the reward of a response of l tokens (0 until the last len tokens before the limit, "
                             "then linear down to -penalty_factor); its metrics reward/overlong_penalty/mean and "
                             "reward/overlong_frac")
    len: int = _f(0, "the buffer: penalised tokens before the limit (1..max_resp_len when enabled)", ge=0)
    penalty_factor: float = _f(1.0, "the penalty of a response that reaches the limit", ge=0.0)
    log: bool = _f(True, "log reward/overlong_penalty/mean and reward/overlong_frac (verl: the per-sample "
                         "overlong_reward / overlong extra info)")


@dataclasses.dataclass(frozen=True)
class RewardKwargsConfig:
    max_resp_len: Optional[int] = _f(None, "the length limit of the overlong penalty (null: "
                                           "data.max_response_length)", ge=1)
    overlong_buffer_cfg: OverlongBufferConfig = _section(OverlongBufferConfig, "DAPO's overlong reward shaping",
                                                         switch=("enable", "the overlong penalty"))


@dataclasses.dataclass(frozen=True)
class RewardModelConfig:
    path: Optional[str] = _f(None, "a local Hugging Face LlamaForSequenceClassification / "
                                   "Qwen2ForSequenceClassification checkpoint that scores prompt + response on the "
                                   "learner mesh (the reward_model stage; it reads the policy's token ids, so it must "
                                   "share the policy's tokenizer); null: no reward model")
    label: int = _f(0, "which of the head's num_labels outputs is the reward", ge=0)


@dataclasses.dataclass(frozen=True)
class RewardJudgeConfig:
    path: Optional[str] = _f(None, "a generative judge: ref (the policy's initial weights, i.e. the reference model) or "
                                   "a local Hugging Face LlamaForCausalLM / Qwen2ForCausalLM checkpoint; it reads each "
                                   "trajectory through prompt_template on the rollout engine (the reward_judge stage) "
                                   "and parse turns its text into a reward; null: no judge")
    prompt_template: str = _f("{prompt}{response}\nVerdict:", "the judge's input: a format string with {response} "
                                                                "and optionally {prompt} and {answer} (ground truth)")
    parse: Optional[str] = _f(None, "path/to/file.py:function, fn(text) -> float (None: unparseable); null: the first "
                                    "number in the judge's text. A parser that raises or returns None scores 0 and "
                                    "counts in reward/judge/errors or reward/judge/unparseable (and against "
                                    "reward.max_error_fraction)")
    temperature: float = _f(0.0, "the judge's sampling temperature (0: greedy)", ge=0.0)
    response_length: int = _f(16, "most tokens of a verdict (verl's rollout.response_length)", ge=1)
    prompt_length: Optional[int] = _f(None, "most tokens of a judge input; longer ones keep their end (null: "
                                            "data.max_prompt_length + data.max_response_length + the template's own "
                                            "tokens)", ge=1)


@dataclasses.dataclass(frozen=True)
class RewardCombineConfig:
    function_weight: float = _f(1.0, "with reward.model.path or reward.judge.path: weight of reward.function's score "
                                     "in the step's reward (0: the learned rewards alone; the rule reward is still "
                                     "logged and validated)", needs=("reward.model.path", "reward.judge.path"))
    model_weight: float = _f(1.0, "with reward.model.path: weight of the reward model's score in the step's reward",
                             needs=("reward.model.path",))
    judge_weight: float = _f(1.0, "with reward.judge.path: weight of the judge's parsed verdict in the step's reward",
                             needs=("reward.judge.path",))


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    function: str = _f("auto", "auto | embedded | gsm8k | exact_match | path/to/file.py:function_name")
    functions: tuple[str, ...] = _f((), "several reward functions (TRL's reward_funcs), each as reward.function "
                                        "names one; the score is their reward.weights-weighted sum, each logged as "
                                        "reward/fn/<name>/mean with its errors (reward.max_error_fraction holds for "
                                        "each); [] uses reward.function alone")
    weights: tuple[float, ...] = _f((), "weights of reward.functions, in order (TRL's reward_weights; [] gives each "
                                        "1.0)")
    max_error_fraction: float = _f(0.1, "fail the step when more of the batch raises in the reward", ge=0.0, le=1.0)
    num_workers: Optional[int] = _f(
        None, "reward worker processes (0: in the trainer's process, no timeout or crash isolation; "
              "null: 0 for the built-in rewards, min(8, CPUs) for a path:function plugin)", ge=0)
    timeout_s: Optional[float] = _f(
        None, "per-sample time limit of a reward in a worker (null: 30 s); over it the sample scores 0 and counts in "
              "reward/timeouts; a limit needs workers: with reward.num_workers=0 it must stay null", gt=0.0)
    memory_mb: Optional[int] = _f(4096, "memory (data segment: heap and private mappings) limit of each reward "
                                        "worker (null: none); a sample over it scores 0 and its worker is replaced",
                                  ge=64)
    clip: Optional[float] = _f(None, "clip scores to [-clip, clip] (null: a score beyond 1e6 in magnitude stops the "
                                     "run as a bug)", gt=0.0)
    import_timeout_s: float = _f(60.0, "the plugin is first imported in a child process before the run starts; an "
                                       "import that takes longer (or exits the process) is a one-line error", gt=0.0)
    model: RewardModelConfig = _section(RewardModelConfig, "a discriminative reward model (verl's reward_model)",
                                        switch=("path", "the reward model"))
    judge: RewardJudgeConfig = _section(RewardJudgeConfig, "a generative judge (an LLM that reads the response and "
                                                           "answers with a verdict; verl's GenRM)",
                                        switch=("path", "the judge"))
    combine: RewardCombineConfig = _section(RewardCombineConfig, "the step's reward = function_weight * "
                                            "reward.function + model_weight * reward model + judge_weight * judge "
                                            "(+ the overlong penalty)")
    reward_kwargs: RewardKwargsConfig = _section(RewardKwargsConfig, "reward shaping (verl's reward_kwargs of the DAPO "
                                                                      "reward manager)")


SANDBOX_PROTECTIONS = ("non_root", "private_uid", "private_tmp", "no_network")


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    require: tuple[Literal[SANDBOX_PROTECTIONS], ...] = _f(
        SANDBOX_PROTECTIONS, "protections of the python tool's sandbox without which the run refuses to start (probed "
                             "at start); non_root holds always: model code never runs as root")
    tmp_mb: int = _f(64, "size of a call's private tmpfs (/tmp, /var/tmp, /dev/shm, /run/lock, ...)", ge=1)
    max_files: int = _f(1024, "files (inodes) of a call's private tmpfs", ge=16)


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    function: Optional[str] = _f(None, "multi-turn environment: lookup | tools | path/to/file.py:ClassName "
                                       "(null: single-turn rollouts)")
    max_turns: int = _f(2, "model turns per episode (each tool call is one)", ge=1, le=64)
    stop: str = _f("?", "the token that ends a turn as a tool call (one token of the tokenizer)")
    max_obs_tokens: int = _f(16, "an observation is cut to this many tokens", ge=1)
    max_turn_tokens: Optional[int] = _f(None, "most tokens of one model turn (null: data.max_response_length)",
                                        ge=1)
    timeout_s: float = _f(5.0, "python tool: wall-clock limit per call", gt=0.0)
    memory_mb: int = _f(256, "python tool: address-space limit per call", ge=64)
    continuation: Literal["kv", "reprefill"] = _f(
        "kv", "how a turn continues the context: kv (the session keeps its slot and KV cache; observations are "
              "appended by an extend prefill) | reprefill (each turn re-prefills the whole context; the reference)")
    sandbox: SandboxConfig = _section(SandboxConfig, "the python tool's sandbox: required protections, tmpfs quota")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str = _f("tiny", "model preset of rljax.models")
    path: Optional[str] = _f(None, "local Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json)")
    tokenizer: Optional[str] = _f(None, "'char', or a tokenizer.json path (null: model.path's, else 'char')")
    eos_token_id: Optional[int] = _f(None, "the token id that ends a response (null: the tokenizer's EOS: "
                                           "\"eos_token\" of its tokenizer_config.json, else \"eos_token_id\" of "
                                           "the config.json beside it)", ge=0)
    dtype: Literal[DTYPES] = _f("float32", "compute dtype")
    param_dtype: Literal[DTYPES] = _f("float32", "parameter storage dtype")
    matmul_precision: Literal[MATMUL_PRECISIONS] = _f(
        "default", "precision of float32 matmuls in the learner and sampler programs: default (the backend's "
        "fastest: full float32 on CPU, TF32 on recent NVIDIA GPUs, one bfloat16 pass on TPU) | high (TPU: three "
        "bfloat16 passes; GPU: TF32) | highest (full float32 everywhere, the slowest); bfloat16 operands are exact "
        "in every mode (docs/guides/performance.md)")
    remat: Literal["auto", "true", "false"] = _f(
        "auto", "rematerialise each layer in the backward pass (less activation memory, ~1/3 more update compute); "
        "auto: on when the update micro-batch's estimated activations per device exceed both the training state "
        "(parameters + gradients + AdamW moments) and 1/64 of the device's memory (rljax.models.remat; the trainer "
        "prints its choice)")
    remat_policy: Literal["auto", "full", "minimal"] = _f(
        "auto", "what a rematerialised layer keeps for the backward pass: full (its input only) | minimal (also its "
        "projections' outputs, MaxText's name; recomputes norms, SwiGLU and attention: 0.87x the update time of no "
        "remat at 31.6M on CPU, full 0.98x); auto: minimal when what it keeps is at most twice the training state, "
        "else full")
    scan_layers: bool = _f(True, "run the layers as one scanned body (compile time independent of depth); false: "
                            "unrolled (fewer update temporaries: no stacked per-layer residuals; longer compiles)")
    # Shape overrides of the preset named by model.name (null: the preset's value). With
    # hidden_size or num_heads set and head_dim null, head_dim = hidden_size / num_heads.
    hidden_size: Optional[int] = _f(None, "override the preset's hidden size", ge=1)
    intermediate_size: Optional[int] = _f(None, "override the preset's MLP hidden size", ge=1)
    num_layers: Optional[int] = _f(None, "override the preset's number of layers", ge=1)
    num_heads: Optional[int] = _f(None, "override the preset's query heads", ge=1)
    num_kv_heads: Optional[int] = _f(None, "override the preset's key/value heads (divides num_heads)", ge=1)
    head_dim: Optional[int] = _f(None, "override the preset's head size (even; null: hidden_size / num_heads when "
                                       "either is overridden)", ge=2)
    max_position_embeddings: Optional[int] = _f(None, "override the preset's longest sequence", ge=1)
    rope_theta: Optional[float] = _f(None, "override the preset's rotary base", gt=0.0)
    tie_embeddings: Optional[bool] = _f(None, "override the preset's tied input/output embeddings")
    qkv_bias: Optional[bool] = _f(None, "override the preset's QKV bias (Qwen2: true, Llama: false)")


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    total_steps: int = _f(200, "training steps", ge=1)
    seed: int = _f(0, "seed of parameter init, sampling and data order")
    mesh: Optional[str] = _f(None, "mesh spec such as dp8 or dp2,tp2,sp2 (null: dp over all devices)")
    save_freq: int = _f(-1, "checkpoint every this many steps (<= 0: only at the end)", ge=-1)
    test_freq: int = _f(-1, "validate every this many steps (<= 0: never)", ge=-1)
    val_before_train: bool = _f(False, "validate once before the first step")
    max_checkpoints: Optional[int] = _f(3, "checkpoints kept (null: all)", ge=1)
    resume_mode: Literal["auto", "disable"] = _f(
        "disable", "auto: continue from the newest complete checkpoint in the run directory (--resume); "
        "disable: start fresh and refuse a run directory that holds checkpoints")
    resume_from: Optional[int] = _f(None, "resume from checkpoint N (--resume=N; null: the newest)", ge=0)
    max_skipped_updates: int = _f(3, "stop (exit 1) after this many consecutive steps whose update was skipped "
                                     "as non-finite", ge=1)
    stop_save_timeout_s: float = _f(300.0, "on a stop, wait at most this long for an in-flight checkpoint save",
                                    gt=0.0)
    project_name: str = _f("rljax", "project name: the default run directory is runs/<project_name>/<experiment_name>")
    experiment_name: str = _f("default", "experiment name: the default run directory is runs/<project_name>/<experiment_name>")
    output_dir: Optional[str] = _f(None, "run directory: config, trace, metrics, checkpoints "
                                         "(null: runs/<project_name>/<experiment_name>; --run-dir sets it)")
    log_freq: int = _f(1, "print a progress line every this many steps", ge=1)
    mode: Literal["sync", "async"] = _f(
        "sync", "sync: generate, score, update, sync in turn; async: a rollout thread keeps generating into a "
        "bounded versioned queue (async_training.*) while the learner trains")
    balance_batch: bool = _f(
        True, "packed learner: deal each micro-batch's rows to dp shards by token count (perf/dp_token_imbalance)")
    logger: tuple[Literal[LOGGERS], ...] = _f(
        ("console", "tensorboard"), "experiment loggers (verl's key): console (progress lines), tensorboard "
        "(<run dir>/tensorboard), wandb (pip install 'rljax[wandb]'; WANDB_MODE=offline works without network), "
        "mlflow (pip install 'rljax[mlflow]'; MLFLOW_TRACKING_URI, default sqlite:///<run dir>/mlflow.db); every "
        "one gets the metrics.jsonl names, wandb and mlflow also the config and the sample tables")
    log_val_generations: int = _f(0, "validation samples (prompt, response, reward, ground truth, uid) written per "
                                     "evaluation to generations.jsonl and each logger's table (verl's key)", ge=0)
    compilation_cache_dir: Optional[str] = _f(
        "auto", "persistent compilation cache: compiled programs are stored here and loaded by later launches "
        "instead of compiled (rljax.compilation_cache). auto: $JAX_COMPILATION_CACHE_DIR if set, else "
        "$XDG_CACHE_HOME/rljax/jax, else ~/.cache/rljax/jax; null: off")


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    groups: int = _f(1, "prompt groups traced per step into trace.jsonl (0: off)", ge=0)
    ledgers: bool = _f(True, "write shape_ledger and memory_ledger (.json, .md) after the first step")
    alert_dp_imbalance: float = _f(1.5, "alert when per-dp-shard tokens max/mean exceeds this", ge=1.0)
    alert_memory_frac: float = _f(0.9, "alert when device memory in use exceeds this fraction of the limit",
                                  gt=0.0, le=1.0)
    alert_spike_factor: float = _f(10.0, "alert when KL / grad norm / entropy is this many times its running median",
                                   gt=1.0)
    alert_spike_window: int = _f(20, "steps in the running median of the spike alerts", ge=1)
    alert_rollout_probs_diff_max: float = _f(
        0.5, "alert (rollout_mismatch) when training/rollout_probs_diff_max, the largest gap between a response "
        "token's sampler and learner probability, exceeds this", gt=0.0, le=1.0)
    log_train_generations: int = _f(0, "training samples per step written to generations.jsonl and each "
                                       "logger's table (python -m rljax.trace samples RUN_DIR prints them)", ge=0)
    alert_drop_rate: float = _f(0.5, "trainer.mode=async: alert (drop_rate) when more than this fraction of the "
                                     "generated rows was dropped (stale or overflow), over the run so far",
                                ge=0.0, le=1.0)
    rescore_rows: int = _f(8, "rows per step scored again by the reward function from their recorded response and "
                              "their own prompt's answer, besides the traced rows (a mismatch fails the step's "
                              "invariants; rljax.trace.rescore; 0: the traced rows only)", ge=0)
    alert_rollout_probs_diff_max_sync: float = _f(
        1e-3, "trainer.mode=sync: alert (rollout_mismatch) when training/rollout_probs_diff_max exceeds this; the "
        "sampler decodes with the learner's very weights, so the gap is float noise (~1e-8 in float32 on CPU); "
        "raise it for a bfloat16 sampler", gt=0.0, le=1.0)
    rollout_dump: bool = _f(False, "every process writes the trajectories it generated (uids, sessions, token ids, "
                                   "rollout log-probs) to rollouts/process<p>/step<k>.npz (debugging; multi-process "
                                   "checks)")


@dataclasses.dataclass(frozen=True)
class AsyncTrainingConfig:
    max_staleness: int = _f(1, "tau: the most weight versions a trained trajectory may lag the learner "
                               "(learner version - the oldest version it saw); staler batches are dropped and "
                               "counted; 0 reproduces trainer.mode=sync step for step", ge=0)
    queue_size: int = _f(2, "bound of the trajectory queue, in batches (backpressure)", ge=1)
    overflow: Literal["block", "drop_stalest"] = _f(
        "block", "when the queue is full: the rollout side waits (block), or the stalest queued batch is dropped "
        "and counted (drop_stalest; the rollout side then waits once queue_size batches were dropped since the "
        "learner last took one, so at most queue_size batches are dropped per trained batch)")
    trigger_parameter_sync_step: int = _f(1, "learner updates per weight push to the rollout side "
                                             "(needs max_staleness >= this - 1)", ge=1)
    partial_rollout: Literal["false", "keep", "recompute", "true"] = _f(
        "false", "what a weight push does to trajectories in generation. false: it is installed between batches (with "
        "streaming: once no slot holds the old weights; no trajectory spans versions); keep: installed between "
        "decode chunks, trajectories in flight keep their KV cache and sample their next tokens with the new "
        "weights; recompute: as keep, but each single-turn trajectory in flight first re-prefills its context "
        "(prompt + tokens so far) with the new weights (AReaL's interruptible generation; multi-turn sessions keep). "
        "Tokens sampled before a push keep their version (token_version) and rollout_logp. true: the earlier "
        "boolean spelling of keep")
    streaming: bool = _f(True, "streaming admission (verl fully-async's / AReaL's streaming rollout): the rollout "
                               "side keeps its decode slots full across batch boundaries, admitting the next "
                               "batches' prompts as slots free while their batch can still be trained within "
                               "max_staleness; a batch is queued when all its groups are complete. Single-turn "
                               "rollouts without algorithm.filter_groups (else one batch per "
                               "generate call, as with false)")


_DL = "distillation.distillation_loss"


@dataclasses.dataclass(frozen=True)
class DistillationLossConfig:
    loss_mode: Literal[DISTILLATION_LOSS_MODES] = _f(
        "k3", "the per-token distillation loss: k1 / kl, k2 / mse, k3 / low_var_kl, abs (single-sample estimates of "
              "the reverse KL(student || teacher) at the sampled token, from the teacher's log-prob of it) or "
              "forward_kl_topk (the forward KL over the teacher's topk most likely tokens at each position: the "
              "teacher stage keeps [B, T, topk] ids and log-probs, the update scores the student at those ids; no "
              "[B, T, vocab] logits)")
    topk: int = _f(128, "forward_kl_topk: how many of the teacher's most likely tokens per position (more than the "
                        "vocabulary: all of it, the exact forward KL)", ge=1,
                   needs=(f"{_DL}.loss_mode=forward_kl_topk",))
    use_task_rewards: bool = _f(True, "true: the task's policy loss (from the rewards) plus distillation_loss_coef "
                                      "times the distillation loss; false: the distillation loss alone (rewards are "
                                      "still computed and logged)")
    distillation_loss_coef: float = _f(1.0, "weight of the distillation loss beside the task's policy loss (with "
                                            "use_task_rewards; alone it has weight 1)", ge=0.0,
                                       needs=(f"{_DL}.use_task_rewards",))
    loss_max_clamp: Optional[float] = _f(10.0, "clamp each token's distillation loss to [-c, c] (null: none)", gt=0.0)
    log_prob_min_clamp: Optional[float] = _f(-10.0, "forward_kl_topk: clamp both models' top-k log-probs below at this "
                                                    "value (null: none)",
                                             needs=(f"{_DL}.loss_mode=forward_kl_topk",))
    use_policy_gradient: bool = _f(True, "true: minus each token's distillation loss is its advantage in a PPO-clip "
                                         "policy loss (on-policy distillation as a reward; k1 recommended); false: the "
                                         "distillation loss is differentiated directly (k3 or forward_kl_topk; k1 is "
                                         "refused: its gradient does not depend on the teacher)")
    clip_ratio_low: float = _f(0.2, "use_policy_gradient: the PPO clip's lower bound of the distillation policy loss",
                               ge=0.0, needs=(f"{_DL}.use_policy_gradient",))
    clip_ratio_high: float = _f(0.2, "use_policy_gradient: the PPO clip's upper bound of the distillation policy loss",
                                ge=0.0, needs=(f"{_DL}.use_policy_gradient",))


@dataclasses.dataclass(frozen=True)
class DistillationTeacherModelConfig:
    model_path: Optional[str] = _f(None, "the teacher: ref (the policy's initial weights, the reference model) or a "
                                         "local Hugging Face Llama / Qwen2 / Qwen3 / Mistral / Gemma 2 / Gemma 3 "
                                         "directory with the policy's vocabulary; loaded on the learner mesh beside the policy (the "
                                         "teacher stage)")


@dataclasses.dataclass(frozen=True)
class DistillationConfig:
    enabled: bool = _f(False, "on-policy distillation: a teacher scores every sampled response token and the policy "
                              "is trained toward it per token (the teacher stage; metrics distillation/*)")
    teacher_model: DistillationTeacherModelConfig = _section(DistillationTeacherModelConfig, "the teacher model")
    distillation_loss: DistillationLossConfig = _section(DistillationLossConfig, "the distillation loss and how it "
                                                                                 "joins the policy loss")


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole run configuration; see :func:`rljax.config.resolve`."""

    data: DataConfig = _section(DataConfig, "dataset, batch sizes and prompt lengths")
    algorithm: AlgorithmConfig = _section(AlgorithmConfig, "advantage estimator and KL-in-reward")
    actor: ActorConfig = _section(ActorConfig, "policy update")
    critic: CriticConfig = _section(CriticConfig, "value model (adv_estimator=gae)",
                                    switch=("algorithm.adv_estimator", "the value model (critic)", "gae"))
    rollout: RolloutConfig = _section(RolloutConfig, "sampler")
    reward: RewardConfig = _section(RewardConfig, "reward function")
    env: EnvConfig = _section(EnvConfig, "multi-turn environment and tools (agentic RL)")
    model: ModelConfig = _section(ModelConfig, "policy model")
    trainer: TrainerConfig = _section(TrainerConfig, "step loop, checkpoints, mesh")
    trace: TraceConfig = _section(TraceConfig, "stage tracing")
    async_training: AsyncTrainingConfig = _section(AsyncTrainingConfig, "asynchronous training (trainer.mode=async)")
    distillation: DistillationConfig = _section(DistillationConfig, "on-policy distillation from a teacher (verl's "
                                                                    "distillation.*)",
                                                switch=("enabled", "distillation"))
