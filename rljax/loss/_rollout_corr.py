r"""verl's rollout correction: importance weights (TIS, IcePop), rejection sampling by
divergence, batch normalisation and the off-policy diagnostics, under verl's names.

With :math:`\log\rho_t = \log\pi_{old,t} - \log\pi_{rollout,t}` (``old`` is the learner's
log-prob; in bypass mode the current policy's), clamped to :math:`\pm 20` where it is
exponentiated (verl's ``SAFETY_BOUND``):

* **IS weights** (``rollout_is``): ``token``: :math:`w_t = \rho_t`; ``sequence``:
  :math:`w_t = \exp(\mathrm{clip}(\sum_s m_s\log\rho_s))` for every token of the sequence.
  ``rollout_is_threshold`` ``U`` (a number): truncated IS, :math:`\min(w, U)`;
  ``"L_U"`` (a string): IcePop, :math:`w\,[L \le w \le U]` (weights outside are zeroed).
  ``rollout_is_batch_normalize``: divided by their masked mean (per sequence for
  ``sequence``) when that mean is above 1e-8. The weights carry no gradient.
* **Rejection** (``rollout_rs``, comma separated, every option must pass): per token
  :math:`k_1 = -\log\rho`, :math:`k_2 = \tfrac12(\log\rho)^2`, :math:`k_3 = \rho - 1 - \log\rho`;
  ``token_k*`` tests each token, ``seq_sum_k*`` / ``seq_mean_k*`` / ``seq_max_k*`` the
  sequence's masked sum / mean / max and reject the whole sequence. ``k1`` options keep
  :math:`\log L \le k_1 \le \log U` (``rollout_rs_threshold`` ``"L_U"``, or ``U`` alone
  meaning ``L = 1/U``); ``k2`` / ``k3`` keep :math:`k \le U`. ``rollout_rs_threshold`` is
  one value for every option or one per option, comma separated.

Metrics are verl's (``rollout_corr/rollout_is_*``, ``rollout_corr/rollout_rs_<option>_*``,
``rollout_corr/rollout_rs_masked_fraction``, ``rollout_corr/kl``, ``k3_kl``, ``chi2_token``,
``chi2_seq``, perplexities). Deliberate differences from ``rollout_corr_helper.py``:

* A batch with no valid token is not an error (verl raises): the weights and the mask are
  zero and the metrics 0. Everything here is jittable; thresholds are parsed on the host.
* Statistics "over sequences" are over sequences with at least one valid token; verl takes
  some of them (``rollout_is_max`` / ``_min`` and the fractions of ``sequence`` IS, the
  ``_seq_*`` weight statistics, ``rollout_rs_seq_masked_fraction``, the perplexities,
  ``chi2_seq``) over every row, where a padding row counts as a sequence of ratio 1. With
  no empty rows the two agree.
* ``rollout_rs_<option>_seq_fraction_low`` is reported for ``k1`` options only (verl adds it,
  as 0, to the others when no sequence is valid).
"""

from __future__ import annotations

import math
from typing import Optional

import chex
import jax
import jax.numpy as jnp

from rljax._rollout_thresholds import IS_LEVELS, RS_OPTIONS, Threshold, parse_is_threshold, parse_rs_thresholds
from rljax.loss._masked import masked_mean, masked_sum

__all__ = ["IS_LEVELS", "RS_OPTIONS", "Threshold", "parse_is_threshold", "parse_rs_thresholds", "offpolicy_metrics",
           "rollout_correction", "rollout_is_weights", "rollout_rejection_mask"]

SAFETY_BOUND = 20.0


def _valid_rows(mask: jax.Array) -> jax.Array:
    return jnp.sum(mask, axis=-1) > 0


def _row_mean(x: jax.Array, rows: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(rows, x, 0.0)) / jnp.maximum(jnp.sum(rows), 1)


def _row_std(x: jax.Array, rows: jax.Array) -> jax.Array:
    n = jnp.sum(rows).astype(x.dtype)
    mean = _row_mean(x, rows)
    var = jnp.sum(jnp.where(rows, jnp.square(x - mean), 0.0)) / jnp.maximum(n - 1.0, 1.0)
    return jnp.where(n > 1, jnp.sqrt(var), 0.0)


def _max(x: jax.Array, where: jax.Array) -> jax.Array:
    return jnp.where(jnp.any(where), jnp.max(jnp.where(where, x, -jnp.inf)), 0.0)


def _min(x: jax.Array, where: jax.Array) -> jax.Array:
    return jnp.where(jnp.any(where), jnp.min(jnp.where(where, x, jnp.inf)), 0.0)


def _clamped_std(x: jax.Array, mask: jax.Array, low, high) -> jax.Array:
    c = jnp.clip(x, low, high)
    var = masked_mean(jnp.square(c), mask) - jnp.square(masked_mean(c, mask))
    return jnp.where(jnp.sum(mask) > 1, jnp.sqrt(jnp.maximum(var, 0.0)), 0.0)


def _is_metrics(w, raw, log_ratio_rows, mask, *, level, upper, lower) -> dict:
    """verl's ``compute_is_metrics`` (see the module docstring for where the rows differ)."""
    valid, rows = mask.astype(bool), _valid_rows(mask)
    low = 1.0 / upper if lower is None else lower
    m = {"rollout_is_mean": masked_mean(w, mask)}
    if level == "sequence":
        m["rollout_is_max"] = jnp.exp(jnp.minimum(_max(log_ratio_rows, rows), SAFETY_BOUND))
        m["rollout_is_min"] = jnp.exp(_min(log_ratio_rows, rows))
        m["rollout_is_ratio_fraction_high"] = _row_mean((log_ratio_rows > math.log(upper)).astype(w.dtype), rows)
        m["rollout_is_ratio_fraction_low"] = _row_mean((log_ratio_rows < math.log(low)).astype(w.dtype), rows)
    else:
        m["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).astype(w.dtype), mask)
        m["rollout_is_ratio_fraction_low"] = masked_mean((raw < low).astype(w.dtype), mask)
        m["rollout_is_max"], m["rollout_is_min"] = _max(w, valid), _min(w, valid)
    m["rollout_is_std"] = _clamped_std(w, mask, 0.0, upper)
    c = jnp.clip(w, 0.0, upper)
    normalised = c / (masked_mean(c, mask) + 1e-8)
    m["rollout_is_eff_sample_size"] = jnp.where(jnp.any(valid), 1.0 / masked_mean(jnp.square(normalised), mask), 0.0)
    seq_w = masked_mean(w, mask, axis=-1)
    m["rollout_is_seq_mean"] = _row_mean(seq_w, rows)
    m["rollout_is_seq_std"] = _row_std(seq_w, rows)
    m["rollout_is_seq_max"], m["rollout_is_seq_min"] = _max(seq_w, rows), _min(seq_w, rows)
    m["rollout_is_seq_max_deviation"] = _max(jnp.abs(seq_w - 1.0), rows)
    raw_seq = masked_mean(raw, mask, axis=-1)
    m["rollout_is_seq_fraction_high"] = _row_mean((raw_seq > upper).astype(w.dtype), rows)
    m["rollout_is_seq_fraction_low"] = _row_mean((raw_seq < low).astype(w.dtype), rows)
    if lower is not None:
        m["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).astype(w.dtype), mask)
    return m


def rollout_is_weights(
    log_ratio: chex.Array,
    mask: chex.Array,
    *,
    rollout_is: str = "token",
    rollout_is_threshold: Threshold = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""verl's ``compute_rollout_correction_weights``: truncated (TIS) or two-sided (IcePop) IS weights.

    See the module docstring for the formulas and the differences from verl.

    Args:
      log_ratio: ``[B, T]`` :math:`\log\pi_{old} - \log\pi_{rollout}`.
      mask: ``[B, T]`` the response tokens.
      rollout_is: ``"token"`` or ``"sequence"``.
      rollout_is_threshold: ``U`` (truncate) or ``"L_U"`` (IcePop: zero outside ``[L, U]``).
      rollout_is_batch_normalize: divide the weights by their mean over the batch.

    Returns:
      ``(weights [B, T] float32, 0 outside the mask, gradient stopped; metrics without the
      rollout_corr/ prefix)``.
    """
    if rollout_is not in IS_LEVELS:
        raise ValueError(f"unknown rollout_is {rollout_is!r}; accepted: {', '.join(IS_LEVELS)} (or null: off)")
    upper, lower = parse_is_threshold(rollout_is_threshold)
    chex.assert_rank([log_ratio, mask], 2)
    chex.assert_equal_shape([log_ratio, mask])
    mask = jnp.asarray(mask, jnp.float32)
    log_ratio = jnp.where(mask > 0, jax.lax.stop_gradient(log_ratio), 0.0).astype(jnp.float32)
    rows_log_ratio = masked_sum(log_ratio, mask, axis=-1)  # read by the sequence level's metrics
    if rollout_is == "token":
        raw = jnp.exp(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    else:
        raw = jnp.broadcast_to(jnp.exp(jnp.clip(rows_log_ratio, -SAFETY_BOUND, SAFETY_BOUND))[:, None], mask.shape)
    raw = raw * mask
    if lower is None:
        w = jnp.minimum(raw, upper)
    else:
        w = jnp.where((raw >= lower) & (raw <= upper), raw, 0.0)
    metrics = _is_metrics(w, raw, rows_log_ratio, mask, level=rollout_is, upper=upper, lower=lower)
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = masked_mean(w, mask)
        else:
            rows = _valid_rows(mask).astype(w.dtype)
            mean = jnp.sum(masked_mean(w, mask, axis=-1) * rows) / jnp.maximum(jnp.sum(rows), 1e-8)
        ok = mean > 1e-8
        w = jnp.where(ok, w / jnp.where(ok, mean, 1.0), w)
        metrics["rollout_is_batch_norm_factor"] = jnp.where(ok, mean, 1.0)
    return jax.lax.stop_gradient(w), metrics


def _token_stats(log_ratio: jax.Array) -> dict[str, jax.Array]:
    safe = jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    return {"k1": -safe, "k2": 0.5 * jnp.square(safe), "k3": jnp.exp(safe) - 1.0 - safe}


def _sequence_stat(kind: str, stat: jax.Array, mask: jax.Array) -> jax.Array:
    if kind == "sum":
        return masked_sum(stat, mask, axis=-1)
    if kind == "mean":
        return masked_mean(stat, mask, axis=-1)
    return _max_rows(stat, mask)


def _max_rows(stat: jax.Array, mask: jax.Array) -> jax.Array:
    valid = mask.astype(bool)
    top = jnp.max(jnp.where(valid, stat, -jnp.inf), axis=-1)
    return jnp.where(jnp.any(valid, axis=-1), top, 0.0)


def _rs_metrics(prefix, token_stat, seq_stat, mask, *, high, low) -> dict:
    """verl's ``compute_rs_metrics`` for one option (``low`` is None for k2 / k3)."""
    valid, rows = mask.astype(bool), _valid_rows(mask)
    f = token_stat.dtype
    seq_values = masked_mean(token_stat, mask, axis=-1) if seq_stat is None else seq_stat
    m = {f"{prefix}_mean": masked_mean(token_stat, mask)}
    if seq_stat is None:
        m[f"{prefix}_max"], m[f"{prefix}_min"] = _max(token_stat, valid), _min(token_stat, valid)
        m[f"{prefix}_fraction_high"] = masked_mean((token_stat > high).astype(f), mask)
        m[f"{prefix}_fraction_low"] = (masked_mean((token_stat < low).astype(f), mask) if low is not None
                                       else jnp.zeros((), f))
    else:
        m[f"{prefix}_max"], m[f"{prefix}_min"] = _max(seq_stat, rows), _min(seq_stat, rows)
        m[f"{prefix}_fraction_high"] = _row_mean((seq_stat > high).astype(f), rows)
        m[f"{prefix}_fraction_low"] = (_row_mean((seq_stat < low).astype(f), rows) if low is not None
                                       else jnp.zeros((), f))
    m[f"{prefix}_std"] = _clamped_std(token_stat, mask, 0.0 if low is None else low, high)
    m[f"{prefix}_seq_mean"] = _row_mean(seq_values, rows)
    m[f"{prefix}_seq_std"] = _row_std(seq_values, rows)
    m[f"{prefix}_seq_max"], m[f"{prefix}_seq_min"] = _max(seq_values, rows), _min(seq_values, rows)
    m[f"{prefix}_seq_max_deviation"] = _max(jnp.abs(seq_values), rows)
    m[f"{prefix}_seq_fraction_high"] = _row_mean((seq_values > high).astype(f), rows)
    if low is not None:
        m[f"{prefix}_seq_fraction_low"] = _row_mean((seq_values < low).astype(f), rows)
    return m


def rollout_rejection_mask(
    log_ratio: chex.Array,
    mask: chex.Array,
    *,
    rollout_rs: str,
    rollout_rs_threshold: Threshold,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""verl's ``compute_rollout_rejection_mask``: drop tokens / sequences whose divergence is out of bounds.

    See the module docstring for the options, the threshold forms and the differences from verl.

    Args:
      log_ratio: ``[B, T]`` :math:`\log\pi_{old} - \log\pi_{rollout}`.
      mask: ``[B, T]`` the response tokens.
      rollout_rs: options, comma separated (``token_k1``, ``seq_mean_k3``, ...); all must pass.
      rollout_rs_threshold: one threshold for all options or one per option, comma separated.

    Returns:
      ``(mask [B, T] with rejected tokens 0, in mask's dtype; metrics without the prefix)``.
    """
    specs = parse_rs_thresholds(rollout_rs, rollout_rs_threshold)
    chex.assert_rank([log_ratio, mask], 2)
    chex.assert_equal_shape([log_ratio, mask])
    maskf = jnp.asarray(mask, jnp.float32)
    valid, rows = maskf > 0, _valid_rows(maskf)
    stats = _token_stats(jnp.where(valid, jax.lax.stop_gradient(log_ratio), 0.0).astype(jnp.float32))
    keep_all = jnp.ones(maskf.shape, bool)
    metrics: dict[str, jax.Array] = {}
    for option, lower, upper in specs:
        level, kind = option.rsplit("_", 1)  # ("token" | "seq_sum" | "seq_mean" | "seq_max", "k1" | "k2" | "k3")
        high, low = (math.log(upper), math.log(lower)) if kind == "k1" else (upper, None)
        token_stat = stats[kind]
        seq_stat = None if level == "token" else _sequence_stat(level[4:], token_stat, maskf)
        value = token_stat if seq_stat is None else jnp.broadcast_to(seq_stat[:, None], maskf.shape)
        keep = value <= high if low is None else (value >= low) & (value <= high)
        keep_all = keep_all & keep
        prefix = f"rollout_rs_{option}"
        metrics.update(_rs_metrics(prefix, value, seq_stat, maskf, high=high, low=low))
        metrics[f"{prefix}_masked_fraction"] = masked_mean((~keep).astype(jnp.float32), maskf)
        rejected_row = jnp.any(~keep & valid, axis=-1)
        metrics[f"{prefix}_seq_masked_fraction"] = _row_mean(rejected_row.astype(jnp.float32), rows)
    metrics["rollout_rs_masked_fraction"] = masked_mean((~keep_all).astype(jnp.float32), maskf)
    metrics["rollout_rs_seq_masked_fraction"] = _row_mean(jnp.any(~keep_all & valid, axis=-1).astype(jnp.float32), rows)
    mask = jnp.asarray(mask)
    return jnp.where(keep_all, mask, jnp.zeros_like(mask)), metrics


def offpolicy_metrics(old_logp: chex.Array, rollout_logp: chex.Array, mask: chex.Array) -> dict[str, jax.Array]:
    r"""verl's ``compute_offpolicy_metrics`` (without the prefix): ``training_ppl``,
    ``training_log_ppl``, ``rollout_ppl``, ``rollout_log_ppl``, ``kl`` (:math:`E[\log\pi_{roll} -
    \log\pi_{old}]`), ``k3_kl``, ``log_ppl_diff`` (``_abs_diff``, ``_max``, ``_min``),
    ``ppl_ratio``, ``chi2_token`` (:math:`E[\rho^2] - 1`) and ``chi2_seq``
    (:math:`E_{seq}[(\prod\rho)^2] - 1`); per-sequence means are over non-empty sequences."""
    chex.assert_rank([old_logp, rollout_logp, mask], 2)
    chex.assert_equal_shape([old_logp, rollout_logp, mask])
    maskf = jnp.asarray(mask, jnp.float32)
    valid, rows = maskf > 0, _valid_rows(maskf)
    old = jnp.where(valid, jax.lax.stop_gradient(old_logp), 0.0).astype(jnp.float32)
    rollout = jnp.where(valid, rollout_logp, 0.0).astype(jnp.float32)
    m_old, m_roll = masked_mean(old, maskf, axis=-1), masked_mean(rollout, maskf, axis=-1)
    log_ratio = old - rollout
    diff = m_roll - m_old
    rho = jnp.exp(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    seq = jnp.exp(2.0 * jnp.clip(masked_sum(log_ratio, maskf, axis=-1), -SAFETY_BOUND, SAFETY_BOUND))
    return {
        "training_ppl": _row_mean(jnp.exp(-m_old), rows), "training_log_ppl": _row_mean(-m_old, rows),
        "kl": masked_mean(rollout - old, maskf),
        "k3_kl": masked_mean(jnp.exp(log_ratio) - log_ratio - 1.0, maskf),
        "rollout_ppl": _row_mean(jnp.exp(-m_roll), rows), "rollout_log_ppl": _row_mean(-m_roll, rows),
        "log_ppl_diff": _row_mean(diff, rows), "log_ppl_abs_diff": _row_mean(jnp.abs(diff), rows),
        "log_ppl_diff_max": _max(diff, rows), "log_ppl_diff_min": _min(diff, rows),
        "ppl_ratio": _row_mean(jnp.exp(diff), rows),
        "chi2_token": jnp.where(jnp.any(valid), masked_mean(jnp.square(rho), maskf) - 1.0, 0.0),
        "chi2_seq": jnp.where(jnp.any(rows), _row_mean(seq, rows) - 1.0, 0.0),
    }


def rollout_correction(
    old_logp: chex.Array,
    rollout_logp: chex.Array,
    mask: chex.Array,
    *,
    rollout_is: Optional[str] = None,
    rollout_is_threshold: Threshold = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: Optional[str] = None,
    rollout_rs_threshold: Optional[Threshold] = None,
) -> tuple[Optional[jax.Array], jax.Array, dict[str, jax.Array]]:
    r"""verl's ``compute_rollout_correction_and_rejection_mask``: IS weights, rejection, diagnostics.

    Args:
      old_logp: ``[B, T]`` the learner's log-probs (bypass mode: the current policy's).
      rollout_logp: ``[B, T]`` the sampler's log-probs of the same tokens.
      mask: ``[B, T]`` the response tokens.
      rollout_is: ``None`` (no weights), ``"token"`` or ``"sequence"``; see :func:`rollout_is_weights`.
      rollout_is_threshold / rollout_is_batch_normalize: see :func:`rollout_is_weights`.
      rollout_rs / rollout_rs_threshold: ``None`` (no rejection) or see :func:`rollout_rejection_mask`.

    Returns:
      ``(weights [B, T] or None, mask with rejections, metrics)``; the metrics carry verl's
      ``rollout_corr/`` prefix.
    """
    chex.assert_rank([old_logp, rollout_logp, mask], 2)
    chex.assert_equal_shape([old_logp, rollout_logp, mask])
    log_ratio = jax.lax.stop_gradient(old_logp) - rollout_logp
    metrics: dict[str, jax.Array] = {}
    weights = None
    if rollout_is is not None:
        weights, m = rollout_is_weights(log_ratio, mask, rollout_is=rollout_is, rollout_is_threshold=rollout_is_threshold,
                                        rollout_is_batch_normalize=rollout_is_batch_normalize)
        metrics.update(m)
    kept = mask
    if rollout_rs is not None:
        kept, m = rollout_rejection_mask(log_ratio, mask, rollout_rs=rollout_rs, rollout_rs_threshold=rollout_rs_threshold)
        metrics.update(m)
    metrics.update(offpolicy_metrics(old_logp, rollout_logp, mask))  # over every response token, as verl's
    return weights, kept, {f"rollout_corr/{k}": v for k, v in metrics.items()}
