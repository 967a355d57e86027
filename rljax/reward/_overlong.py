r"""DAPO's overlong reward shaping: a soft penalty for responses near the length limit.

With a buffer of ``len`` tokens before the limit ``L`` (``data.max_response_length``, or
``reward.reward_kwargs.max_resp_len``) and a response of ``l`` tokens, the penalty added to the
task reward is (DAPO, arXiv:2503.14476, eq. 13; verl's ``DAPORewardManager``):

.. math:: r_{\mathrm{overlong}}(l) = \min\Big(-\frac{l - (L - \mathrm{len})}{\mathrm{len}}
          \cdot \mathrm{penalty\_factor},\; 0\Big)

0 up to ``L - len`` tokens, then falling linearly to ``-penalty_factor`` at ``l = L``. ``l`` is
the response's length in tokens as the sampler returned it (EOS included; in multi-turn runs
the tool observations too: verl's ``valid_response_length``, the response's attention mask).
Like verl's, the formula is not clipped below: a response longer than ``L`` (only possible
with ``max_resp_len < data.max_response_length``) gets more than ``penalty_factor``.

Pure NumPy; the reward stage adds the penalty to each real row's score.
"""

from __future__ import annotations

import numpy as np


def overlong_penalty(lengths, *, max_resp_len: int, buffer_len: int, penalty_factor: float) -> np.ndarray:
    """The overlong penalty (``<= 0``, float32 ``[B]``) of responses of ``lengths`` tokens.

    Args:
      lengths: ``[B]`` response lengths in tokens.
      max_resp_len: the length limit ``L``.
      buffer_len: ``len``, the soft buffer before the limit (``1 <= len <= L``).
      penalty_factor: the penalty at the limit (``>= 0``).
    """
    if not 1 <= buffer_len <= max_resp_len:
        raise ValueError(f"overlong buffer len={buffer_len} must be in [1, max_resp_len={max_resp_len}]")
    if not penalty_factor >= 0:
        raise ValueError(f"overlong penalty_factor={penalty_factor} must be >= 0")
    exceed = np.asarray(lengths, np.float64) - (max_resp_len - buffer_len)
    return np.minimum(-exceed / buffer_len * penalty_factor, 0.0).astype(np.float32)


def overlong_metrics(penalty, real) -> dict[str, float]:
    """``reward/overlong_penalty/mean`` (over real rows, 0 included) and ``reward/overlong_frac``
    (the fraction of real rows penalised)."""
    p = np.asarray(penalty)[np.asarray(real, bool)]
    if p.size == 0:
        return {"reward/overlong_penalty/mean": 0.0, "reward/overlong_frac": 0.0}
    return {"reward/overlong_penalty/mean": float(p.mean()), "reward/overlong_frac": float((p < 0).mean())}
