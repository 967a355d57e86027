"""The batch fields as the trace reads them: one table (:data:`BATCH_FIELDS`), read by the tracer
(how a field is summarised), the shape ledger (its rows) and ``trace check`` (who must produce
and consume it).

Every field a stage may write (the stage declarations, :data:`rljax.trainer.stages.WRITES`) has a
row, and so do the sampler's arrays the trace follows inside ``trajectories``; a test fails when a
declared field has none (``tests/trace/test_trace_run.py``). ``docs/concepts/batch-contract.md``
explains the contract in prose.
"""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class LedgerRow:
    """A field's row of ``shape_ledger.json``: the stage it belongs to, the tensor's label, what
    masks or broadcasts it, where it is produced, consumed and freed (the runner's observed
    producer and consumers replace ``produced`` / ``consumed`` when it saw them), and the bug the
    field is known for."""

    stage: str
    mask: str
    produced: str
    consumed: str
    bug: str
    freed: str = "cleanup"
    label: Optional[str] = None  # the tensor column, when not the field's name
    sampler: bool = False  # the sampler's host array (``trajectories``), as the rollout returned it
    critic: bool = False  # a row only with a critic (``values`` in the batch)
    stage_from_producer: bool = False  # the stage column is the observed producer (old_logp: the update's own)


@dataclasses.dataclass(frozen=True)
class BatchField:
    """One batch field.

    Attributes:
      name: the batch key (or the trace's name of a sampler array, ``sampler_loss_mask``).
      shape: its shape in the batch contract (``[B,T]``, ``[B,S+T]``, ``[B,S]``, ``[B]``) or
        ``step`` for a step-level value (a record, a counter, host lists).
      valid: which per-row valid length the trace reports with it (``prompt``, ``response``,
        ``sequence``), None for none; ``response`` fields are the response-position fields the
        learner's ``loss_mask`` governs, whose widths and mask sums the records' signatures compare.
      mask: a mask: the trace reports its own per-row sums.
      values: the trace summarises the traced rows' values (masked row means).
      trajectory: the ``Trajectories`` array it is traced from (the sampler's host copy), if any.
      producer: the stage ``trace check`` expects to write it (None: not checked).
      consumers: the stages of which ``trace check`` expects at least one to read it.
      ledger: its row of the shape ledger (None: not in the ledger).
    """

    name: str
    shape: str
    valid: Optional[str] = None
    mask: bool = False
    values: bool = False
    trajectory: Optional[str] = None
    producer: Optional[str] = None
    consumers: tuple[str, ...] = ()
    ledger: Optional[LedgerRow] = None


_LEARNER = "old_log_prob, actor_minibatch"
#: Every batch field, in the order of a step (the shape ledger's rows follow it).
BATCH_FIELDS: tuple[BatchField, ...] = (
    # the sampler's arrays, traced from ``trajectories`` (host NumPy)
    BatchField("prompt_ids", "[B,S]", valid="prompt", trajectory="prompt_ids", ledger=LedgerRow(
        "rollout_sessions", "prompt_mask (left-padded)", "rollout_sessions", "trajectory_fields",
        "left vs right padding mixed up: the prompt must end at column S so hidden S-1+t predicts token t",
        sampler=True)),
    BatchField("prompt_mask", "[B,S]", valid="prompt", mask=True, trajectory="prompt_mask"),
    BatchField("response_ids", "[B,T]", valid="response", trajectory="response_ids", ledger=LedgerRow(
        "rollout_sessions", "response_mask (right-padded)", "rollout_sessions", "reward, trajectory_fields",
        "response_len counts tool observations too: policy tokens are response_mask.sum()", sampler=True)),
    BatchField("response_mask", "[B,T]", valid="response", mask=True, trajectory="response_mask", ledger=LedgerRow(
        "rollout_sessions", "itself", "rollout_sessions", "trajectory_fields",
        "observation tokens left at 1 train the policy on text it did not generate", sampler=True)),
    BatchField("sampler_loss_mask", "[B,T]", mask=True, trajectory="loss_mask"),  # its sums: its own valid tokens
    BatchField("token_version", "[B,T]", valid="response"),
    BatchField("trajectories", "step"),
    # the learner layout (trajectory_fields)
    BatchField("input_ids", "[B,S+T]", valid="sequence", ledger=LedgerRow(
        "trajectory_fields", "attention_mask", "trajectory_fields", "old_log_prob, reference, actor_minibatch",
        "batch split (dp) confused with sequence split (sp): local shard shape must be [B/dp, (S+T)/sp]",
        label="full_sequence (input_ids)")),
    BatchField("attention_mask", "[B,S+T]", valid="sequence", mask=True, ledger=LedgerRow(
        "trajectory_fields", "prompt_mask | response_mask", "trajectory_fields", _LEARNER,
        "positions not recomputed from the mask: left padding shifts the rotary positions")),
    BatchField("positions", "[B,S+T]", valid="sequence", ledger=LedgerRow(
        "trajectory_fields", "cumsum(attention_mask) - 1", "trajectory_fields", _LEARNER,
        "positions counted from the padded start")),
    BatchField("loss_mask", "[B,T]", valid="response", mask=True, producer="trajectory_fields",
               consumers=("actor_minibatch",), ledger=LedgerRow(
                   "trajectory_fields", "itself", "trajectory_fields", "actor_minibatch, metrics",
                   "padding rows left at 1 enter the token mean")),
    BatchField("rollout_logp", "[B,T]", valid="response", trajectory="rollout_logp", ledger=LedgerRow(
        "trajectory_fields", "loss_mask", "rollout_sessions", "advantages (correction), actor_minibatch",
        "sampler temperature not applied the same way as the learner's")),
    BatchField("group_id", "[B]"),
    BatchField("row_mask", "[B]"),
    # the learner's passes
    BatchField("old_logp", "[B,T]", valid="response", values=True, producer="old_log_prob",
               consumers=("actor_minibatch", "advantages"), ledger=LedgerRow(
                   "old_log_prob", "loss_mask", "old_log_prob", "actor_minibatch (ratio)",
                   "recomputed after the update (ratio stuck at 1) or misaligned by one position",
                   stage_from_producer=True)),
    BatchField("entropy", "[B,T]", valid="response", values=True, ledger=LedgerRow(
        "old_log_prob", "loss_mask", "old_log_prob", "metrics", "averaged over padding", freed="metrics")),
    BatchField("rollout_mismatch", "step"),
    BatchField("ref_logp", "[B,T]", valid="response", values=True, producer="reference",
               consumers=("actor_minibatch", "advantages"), ledger=LedgerRow(
                   "reference", "loss_mask", "reference", "actor_minibatch (kl_loss) / reward (kl_in_reward)",
                   "reference weights updated with the actor")),
    BatchField("teacher_logp", "[B,T]", valid="response", values=True, producer="teacher",
               consumers=("actor_minibatch",), ledger=LedgerRow(
                   "teacher", "loss_mask", "teacher", "actor_minibatch (distillation loss)",
                   "the teacher's hidden state S-1+t not aligned with response token t (scored one position off)")),
    # distillation.distillation_loss.loss_mode=forward_kl_topk: the teacher's top-k instead of teacher_logp
    BatchField("teacher_topk_ids", "[B,T,K]", producer="teacher", consumers=("actor_minibatch",), ledger=LedgerRow(
        "teacher", "loss_mask (broadcast over K)", "teacher", "actor_minibatch (student log-probs at these ids)",
        "top-k taken at hidden S+t instead of S-1+t (the next position's distribution)")),
    BatchField("teacher_topk_logp", "[B,T,K]", producer="teacher", consumers=("actor_minibatch",), ledger=LedgerRow(
        "teacher", "loss_mask (broadcast over K)", "teacher", "actor_minibatch (forward_kl_topk)",
        "kept in float32 when the teacher runs in bfloat16 (2x the memory of the teacher's dtype)")),
    BatchField("advantages", "[B,T]", valid="response", values=True, producer="advantages",
               consumers=("actor_minibatch",), ledger=LedgerRow(
                   "advantages", "loss_mask (per-sequence value broadcast over T)", "advantages", "actor_minibatch",
                   "group statistics over padding rows or across uids")),
    # rewards
    BatchField("scores", "[B]", values=True, producer="reward", consumers=("advantages",), ledger=LedgerRow(
        "reward", "sequence-level [B]; broadcast to tokens by the advantage", "reward", "advantages",
        "outcome reward placed on every token (counted T times)", freed="advantages", label="scores (rewards)")),
    BatchField("rm_scores", "[B]", values=True),
    BatchField("judge_scores", "[B]", values=True),
    BatchField("function_scores", "[B]", values=True),
    BatchField("scored_rows", "step"),
    BatchField("reward_report", "step"),
    BatchField("judge_texts", "step"),
    BatchField("judge_status", "step"),
    BatchField("judge_report", "step"),
    # the critic (GAE)
    BatchField("values", "[B,T]", valid="response", values=True, ledger=LedgerRow(
        "values", "loss_mask", "values", "update_critic", "value of the token after the last one not zeroed",
        freed="update_critic", critic=True)),
    BatchField("returns", "[B,T]", valid="response", values=True, ledger=LedgerRow(
        "advantages", "loss_mask", "advantages", "update_critic", "returns computed from whitened advantages",
        freed="update_critic", critic=True)),
    BatchField("token_level_rewards", "[B,T]", valid="response", values=True),
    BatchField("rollout_is_weights", "[B,T]", valid="response", values=True),
    # step-level values
    BatchField("prompts", "step"),
    BatchField("uids", "step"),
    BatchField("batch_prompts", "step"),
    BatchField("weight_version", "step"),
    BatchField("dynamic_sampling", "step"),
    BatchField("rollout_rows", "step"),
    BatchField("rollout_tokens_per_s", "step"),
    BatchField("kl", "step"),
    BatchField("kl_coef", "step"),
    BatchField("kl_in_reward", "step"),
    BatchField("rollout_corr", "step"),  # verl's rollout_corr/* metrics of the decoupled correction
    BatchField("actor_metrics", "step"),
    BatchField("critic_metrics", "step"),
    BatchField("optimizer_steps", "step"),
    BatchField("update_sizes", "step"),
    BatchField("weight_version_after", "step"),
    BatchField("sampler_version", "step"),
    BatchField("weight_sync_s", "step"),
    BatchField("metrics", "step"),
    # trainer.mode=async: the queue between the producer and the learner
    BatchField("queue_item", "step"),
    BatchField("enqueue", "step"),
    BatchField("dequeue", "step"),
    BatchField("weight_pushed", "step"),
    BatchField("weight_pushes", "step"),  # the pushes so far (async/weight_pushes)
)

BY_NAME = {f.name: f for f in BATCH_FIELDS}


def names(**where) -> tuple[str, ...]:
    """The names of the fields whose columns have the given values, in table order
    (``names(valid="response")``, ``names(mask=True)``)."""
    return tuple(f.name for f in BATCH_FIELDS if all(getattr(f, k) == v for k, v in where.items()))


#: The sampler's arrays the trace follows in ``trajectories``: array name -> the trace's field name.
TRAJECTORY_ARRAYS = {f.trajectory: f.name for f in BATCH_FIELDS if f.trajectory}
