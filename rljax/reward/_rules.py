"""Rule-based rewards: exact match, GSM8K numeric answers, the embedded synthetic task.

Every reward has the plugin signature ``fn(response: str, answer: str, **extra) -> float``
and returns a value in ``[0, 1]``.
"""

from __future__ import annotations

import re
import string
from decimal import Decimal, InvalidOperation

#: A number as written in GSM8K solutions and model outputs: an optional sign (not when
#: it follows a word or digit: ``10-3`` is two numbers), digits with optional thousands
#: commas in groups of three, optional decimals (``-1,234.5``, ``.5``, ``42``).
_NUMBER = re.compile(r"(?:(?<![\w.])[-+])?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)")
_MARKER = "####"


def exact_match_reward(response: str, answer: str, **extra) -> float:
    """1.0 when ``response`` equals ``answer`` after stripping surrounding whitespace, else 0.0."""
    return float(response.strip() == answer.strip())


def normalize_number(text: str) -> str | None:
    """Canonical text of a number: commas, ``$``, a leading ``+`` and a trailing ``.`` removed,
    trailing zeros of the fraction dropped (``"1,234.50"`` -> ``"1234.5"``, ``"42.0"`` -> ``"42"``,
    ``"-0"`` -> ``"0"``). None when ``text`` is not a number."""
    t = text.strip().replace(",", "").replace("$", "").rstrip(".")
    if t.startswith("+"):
        t = t[1:]
    try:
        d = Decimal(t)
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def extract_gsm8k_answer(text: str, *, fallback_last_number: bool = True) -> str | None:
    """The final numeric answer of a GSM8K-style solution or model response.

    Rule: if the text contains the marker ``####``, the answer is the first number after
    the *last* marker; otherwise (when ``fallback_last_number``) it is the last number
    anywhere in the text. Commas are removed and the number is canonicalised by
    :func:`normalize_number`, so ``"#### 1,000"``, ``"... is 1000."`` and ``"1000.00"`` all
    give ``"1000"``. Returns None when no number is found.
    """
    if _MARKER in text:
        tail = text.rsplit(_MARKER, 1)[1]
        m = _NUMBER.search(tail)
        if m:
            return normalize_number(m.group())
        if not fallback_last_number:
            return None
    elif not fallback_last_number:
        return None
    numbers = _NUMBER.findall(text)
    for n in reversed(numbers):
        v = normalize_number(n)
        if v is not None:
            return v
    return None


def gsm8k_ground_truth(solution: str) -> str:
    """The reference answer of a GSM8K ``answer`` field: the text after the last ``####``
    (commas removed, a number canonicalised); the whole stripped text when there is no marker."""
    tail = solution.rsplit(_MARKER, 1)[1] if _MARKER in solution else solution
    tail = tail.strip()
    return normalize_number(tail) or tail.replace(",", "")


def gsm8k_reward(response: str, answer: str, *, format_score: float = 0.0, **extra) -> float:
    """1.0 when the response's answer (:func:`extract_gsm8k_answer`) equals the reference
    numerically; ``format_score`` when a number was found but is wrong; 0.0 when none was."""
    got = extract_gsm8k_answer(response)
    if got is None:
        return 0.0
    want = normalize_number(answer)
    if want is None:
        want = extract_gsm8k_answer(answer)
    return 1.0 if got == want else float(format_score)


#: Partial credits of :func:`embedded_reward` for a response that is not exact.
EMBEDDED_FORMAT_CREDIT = 0.1
EMBEDDED_POSITION_CREDIT = 0.4


def embedded_reward(response: str, answer: str, **extra) -> float:
    """Reward of the embedded synthetic task (:mod:`rljax.data`), in ``[0, 1]``.

    * 1.0 for an exact match (surrounding whitespace stripped);
    * otherwise ``(0.1 * in_alphabet + 0.4 * matched) / max(len(response), len(answer))``:
      ``in_alphabet`` counts the response's characters from the answer's alphabet (digits
      for ``add``, lowercase letters for ``reverse``), ``matched`` the positions where
      response and answer agree. Both credits are per character, so a randomly
      initialised policy gets a graded signal; a non-exact response scores below 0.5, so
      exact match is always strictly best; a response that runs on past the answer (no
      end-of-sequence) is penalised through the longer denominator.
    """
    r, a = response.strip(), answer.strip()
    if r == a:
        return 1.0
    if not r:
        return 0.0
    alphabet = set(string.digits) if a.isdigit() else set(string.ascii_lowercase) if a.isalpha() else set(a)
    in_alphabet = sum(c in alphabet for c in r)
    matched = sum(x == y for x, y in zip(r, a))
    return (EMBEDDED_FORMAT_CREDIT * in_alphabet + EMBEDDED_POSITION_CREDIT * matched) / max(len(r), len(a))
