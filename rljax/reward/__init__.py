"""Rewards: rule-based functions, ``path/to/file.py:function_name`` plugins, error isolation.

A reward function has the signature ``fn(response: str, answer: str, **extra) -> float``.
:func:`score_batch` calls it per row, scores failures 0, counts them and raises
:class:`RewardError` when too many fail. :func:`make_reward` gives the function itself or,
with ``reward.num_workers > 0``, a :class:`RewardPool` of worker processes (per-sample
timeouts, crash isolation, parallel scoring). A generative judge's template, parser and
verdict report are here too (:func:`parse_verdicts`; its generation runs in
:mod:`rljax.trainer.judge`). Pure Python and NumPy.
"""

from rljax.reward._batch import MAX_ABS_SCORE, RewardError, RewardReport, as_result, merge_extras, score_batch
from rljax.reward._check import check, probe_plugin
from rljax.reward._filter import FILTER_METRICS, filter_values, groups_to_keep
from rljax.reward._judge import (
    JUDGE_FIELDS,
    JudgeReport,
    check_judge_template,
    first_number,
    judge_prompt,
    load_judge_parse,
    parse_verdicts,
)
from rljax.reward._overlong import overlong_metrics, overlong_penalty
from rljax.reward._plugin import (
    BUILTIN_REWARDS,
    DATA_SOURCES,
    DATA_SOURCE_REWARDS,
    DATASET_REWARDS,
    InProcessReward,
    WeightedRewards,
    get_reward_fn,
    register_callable,
    reward_spec,
    load_function,
    load_reward_plugin,
)
from rljax.reward._make import make_reward
from rljax.reward._pool import Outcome, RewardPool, RewardWorkerError, default_num_workers
from rljax.reward._val_metrics import ValidationBySource, validation_metrics
from rljax.reward._rules import (
    embedded_reward,
    exact_match_reward,
    extract_gsm8k_answer,
    gsm8k_ground_truth,
    gsm8k_reward,
    normalize_number,
)

__all__ = [
    "BUILTIN_REWARDS",
    "InProcessReward",
    "WeightedRewards",
    "as_result",
    "reward_spec",
    "register_callable",
    "JUDGE_FIELDS",
    "JudgeReport",
    "check_judge_template",
    "first_number",
    "judge_prompt",
    "load_judge_parse",
    "parse_verdicts",
    "MAX_ABS_SCORE",
    "check",
    "probe_plugin",
    "DATA_SOURCES",
    "FILTER_METRICS",
    "DATA_SOURCE_REWARDS",
    "DATASET_REWARDS",
    "Outcome",
    "RewardError",
    "RewardPool",
    "RewardReport",
    "merge_extras",
    "RewardWorkerError",
    "default_num_workers",
    "embedded_reward",
    "exact_match_reward",
    "extract_gsm8k_answer",
    "get_reward_fn",
    "load_function",
    "gsm8k_ground_truth",
    "groups_to_keep",
    "filter_values",
    "gsm8k_reward",
    "load_reward_plugin",
    "make_reward",
    "normalize_number",
    "overlong_metrics",
    "overlong_penalty",
    "score_batch",
    "ValidationBySource",
    "validation_metrics",
]
