"""The generative judge's host side: its prompt template, its verdict parser and the verdicts' report.

A judge (``reward.judge.path``) is a causal language model that reads each trajectory through
``reward.judge.prompt_template`` and answers in text; ``reward.judge.parse`` (``path.py:fn``,
``fn(text) -> float``; default :func:`first_number`) turns that text into the reward. The
generation itself runs on the rollout engine (:mod:`rljax.trainer.judge`); this module is pure
Python, so the launcher checks the template and the parser before JAX starts.

Verdicts are scored like rewards (:func:`rljax.reward.score_batch`): a parser that raises or
returns a non-number or a non-finite value is an *error*; one that returns ``None`` marks the
verdict *unparseable*. Either scores 0 and counts against ``reward.max_error_fraction``.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
import string
from collections.abc import Callable, Sequence

import numpy as np

from rljax.errors import ConfigError
from rljax.reward._batch import RewardError, _as_score, _short
from rljax.reward._plugin import load_function

logger = logging.getLogger("rljax.reward")

#: The fields a judge template may name; ``{response}`` is required.
JUDGE_FIELDS = ("prompt", "response", "answer")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def first_number(text: str) -> float | None:
    """The default parser: the first number in the judge's text (``"Score: 7/10"`` -> 7.0), or
    ``None`` (unparseable) when it has none."""
    m = _NUMBER.search(text)
    return float(m.group()) if m else None


def check_judge_template(template: str, key: str = "reward.judge.prompt_template") -> None:
    """A judge template is a format string naming ``{response}`` and at most ``{prompt}``, ``{answer}``.

    Raises:
      ConfigError: one line naming ``key`` and the accepted fields.
    """
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ConfigError(f"{key}={template!r} is not a valid format string ({e}); use "
                          f"{{response}} and double other braces") from None
    unknown = sorted(fields - set(JUDGE_FIELDS))
    if unknown:
        raise ConfigError(f"{key}={template!r} names {', '.join('{' + f + '}' for f in unknown)}; accepted fields: "
                          + ", ".join("{" + f + "}" for f in JUDGE_FIELDS))
    if "response" not in fields:
        raise ConfigError(f"{key}={template!r} has no {{response}} placeholder: the judge would never read the "
                          "policy's response; accepted fields: " + ", ".join("{" + f + "}" for f in JUDGE_FIELDS))


def judge_prompt(template: str, *, prompt: str, response: str, answer: str) -> str:
    """The judge's input text for one trajectory (``prompt``: the task prompt as text)."""
    return template.format(prompt=prompt, response=response, answer=answer)


def load_judge_parse(spec: str | None, key: str = "reward.judge.parse") -> Callable[[str], float | None]:
    """``reward.judge.parse``: :func:`first_number` for ``None``, else ``path/to/file.py:function``
    taking the judge's text as its one positional argument.

    Raises:
      ConfigError: the file or function is missing, not callable, or cannot take one argument.
    """
    if spec is None:
        return first_number
    fn = load_function(spec, key=key, prefix="rljax_judge_parse")
    try:
        inspect.signature(fn).bind("verdict")
    except TypeError as e:
        raise ConfigError(f"{key}={spec!r}: the parse function must take the judge's text as its one argument "
                          f"(fn(text) -> float); {e}") from None
    except ValueError:  # a builtin without a signature: accepted, the call will tell
        pass
    return fn


@dataclasses.dataclass(frozen=True)
class JudgeReport:
    """The verdicts of one batch.

    Attributes:
      num_scored: rows the judge read (padding excluded).
      errors: verdicts whose parser raised or returned a non-number / non-finite value.
      unparseable: verdicts whose parser returned ``None``.
      truncated: verdicts cut at ``reward.judge.response_length`` (no EOS).
      prompt_truncated: judge inputs longer than ``reward.judge.prompt_length`` (their start dropped).
      first_error: ``"<key>: <what>"`` of the first error or unparseable verdict, or None.
    """

    num_scored: int
    errors: int
    unparseable: int
    truncated: int = 0
    prompt_truncated: int = 0
    first_error: str | None = None

    @property
    def error_fraction(self) -> float:
        return (self.errors + self.unparseable) / self.num_scored if self.num_scored else 0.0

    def check(self, max_error_fraction: float, *, where: str = "") -> None:
        """Raises :class:`~rljax.reward.RewardError` (one line) when more than
        ``max_error_fraction`` of the verdicts failed or did not parse; ``where`` as
        :meth:`RewardReport.check`'s."""
        if self.error_fraction > max_error_fraction:
            raise RewardError(f"the judge's verdict failed to parse for {self.errors + self.unparseable}/"
                              f"{self.num_scored} rows ({self.errors} error(s), {self.unparseable} unparseable){where}, "
                              f"more than reward.max_error_fraction={max_error_fraction}; first: {self.first_error}")

    def metrics(self) -> dict[str, float]:
        """``reward/judge/{errors,unparseable,error_fraction,truncated,prompt_truncated}``."""
        return {"reward/judge/errors": float(self.errors), "reward/judge/unparseable": float(self.unparseable),
                "reward/judge/error_fraction": self.error_fraction, "reward/judge/truncated": float(self.truncated),
                "reward/judge/prompt_truncated": float(self.prompt_truncated)}


#: A verdict's status in the trace: parsed, unparseable (the parser returned None) or error.
STATUSES = ("ok", "unparseable", "error")


def parse_verdicts(parse: Callable[[str], float | None], texts: Sequence[str], keys: Sequence[str], *,
                   max_error_fraction: float, is_padding=None, truncated=None,
                   prompt_truncated: int = 0) -> tuple[np.ndarray, list[str], JudgeReport]:
    """Each row's verdict score ``parse(text)``, isolating failures.

    Args:
      parse: ``fn(text) -> float`` (``None``: unparseable).
      texts: the judge's text per row; keys: the rows' trace keys (``{uid}_{session}_{index}``).
      max_error_fraction: ``reward.max_error_fraction``: the largest accepted fraction of
        errors plus unparseable verdicts.
      is_padding: ``[B]`` rows never judged (score 0, status ``""``, not counted).
      truncated: ``[B]`` verdicts cut at the judge's response length (counted).
      prompt_truncated: judge inputs that were cut (counted).

    Returns:
      ``(scores [B] float32, statuses [B] (STATUSES, "" on padding), report)``.

    Raises:
      RewardError: errors plus unparseable verdicts over ``max_error_fraction`` of the rows.
    """
    n = len(texts)
    if len(keys) != n:
        raise ValueError(f"parse_verdicts: {n} texts and {len(keys)} keys must match")
    pad = np.zeros(n, bool) if is_padding is None else np.asarray(is_padding, bool).reshape(-1)
    cut = np.zeros(n, bool) if truncated is None else np.asarray(truncated, bool).reshape(-1)
    scores = np.zeros(n, np.float32)
    statuses = [""] * n
    errors = unparseable = 0
    first = None
    for i in range(n):
        if pad[i]:
            continue
        try:
            value = parse(texts[i])
            if value is None:
                statuses[i], what = "unparseable", f"unparseable verdict {_short(texts[i])[:60]!r}"
                unparseable += 1
            else:
                scores[i], statuses[i], what = _as_score(value), "ok", None
        except (Exception, SystemExit) as e:  # noqa: BLE001 - a user parser may raise anything; isolate it
            statuses[i], what = "error", f"{type(e).__name__}: {_short(e)}"
            errors += 1
        if what is not None:
            first = first or f"{keys[i]}: {what}"
    scored = int((~pad).sum())
    report = JudgeReport(scored, errors, unparseable, int(cut[~pad].sum()), int(prompt_truncated), first)
    report.check(max_error_fraction)
    if errors + unparseable:
        logger.warning("judge: %d verdict error(s), %d unparseable of %d (scored 0); first: %s", errors, unparseable,
                       scored, first)
    return scores, statuses, report
