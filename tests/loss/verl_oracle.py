"""verl's policy losses and rollout correction written out again in NumPy (float64), from
``verl/trainer/ppo/core_algos.py`` and ``rollout_corr_helper.py``, line by line, for the
tests to compare rljax against. Independent of rljax: nothing here imports it.

Arguments follow verl's order (``old_log_prob, log_prob, advantages, response_mask``);
``advantages`` are ``[B, T]``. Where rljax differs on purpose (rows with no valid token),
the tests use batches without such rows.
"""

import math

import numpy as np

SAFETY = 20.0


def masked_sum(v, m, axis=None):
    return (np.where(m.astype(bool), v, 0.0) * m).sum(axis=axis)


def masked_mean(v, m, axis=None):
    return masked_sum(v, m, axis) / (m.sum(axis=axis) + 1e-8)


def agg_loss(loss_mat, mask, mode, horizon=None):
    if mode == "token-mean":
        return masked_sum(loss_mat, mask) / mask.sum()
    if mode == "token-sum":
        return masked_sum(loss_mat, mask)
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq = (loss_mat * mask).sum(-1)
        seq_mask = (mask.sum(-1) > 0).astype(float)
        loss = masked_sum(seq, seq_mask) / seq_mask.sum()
        return loss / (mask.shape[-1] if horizon is None else horizon) if mode.endswith("norm") else loss
    counts = mask.sum(-1)
    seq = (loss_mat * mask).sum(-1) / (counts + 1e-8)
    seq_mask = (counts > 0).astype(float)
    return masked_sum(seq, seq_mask) / seq_mask.sum()


def vanilla(old, lp, adv, mask, mode, *, low=0.2, high=0.2, c=3.0, w=None):
    nkl = np.clip(lp - old, -20, 20)
    ratio = np.exp(nkl)
    ppo_kl = masked_mean(-nkl, mask)
    l1, l2 = -adv * ratio, -adv * np.clip(ratio, 1 - low, 1 + high)
    cl1 = np.maximum(l1, l2)
    clipfrac = masked_mean((l2 > l1).astype(float), mask)
    l3 = -adv * c
    lower = masked_mean((cl1 > l3) * (adv < 0).astype(float), mask)
    pg = np.where(adv < 0, np.minimum(l3, cl1), cl1)
    if w is not None:
        pg = pg * w
    return agg_loss(pg, mask, mode), dict(pg_clipfrac=clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=lower)


def _dppo(old, lp, adv, mask, mode, valid, c, w):
    nkl = np.clip(lp - old, -20, 20)
    ratio = np.exp(nkl)
    trunc = np.minimum(ratio, c)
    valid = valid.astype(float)
    pg = -adv * trunc * lp * valid
    if w is not None:
        pg = pg * w
    return agg_loss(pg, mask, mode), dict(pg_clipfrac=masked_mean(1 - valid, mask), ppo_kl=masked_mean(-nkl, mask),
                                          pg_clipfrac_lower=masked_mean((ratio > c) * valid, mask))


def dppo_tv(old, lp, adv, mask, mode, *, low=0.2, high=0.2, c=3.0, w=None):
    d = np.exp(lp) - np.exp(old)
    return _dppo(old, lp, adv, mask, mode, np.where(adv > 0, d <= high, d >= -low), c, w)


def dppo_kl(old, lp, adv, mask, mode, *, low=0.2, high=0.2, c=3.0, w=None):
    p, po = np.exp(lp), np.exp(old)
    bkl = po * (old - lp) + (1 - po) * np.log((1.0 - po + 1e-8) / (1.0 - p + 1e-8))
    valid = np.where(adv > 0, (bkl <= high) | (p <= po), (bkl <= low) | (p >= po))
    return _dppo(old, lp, adv, mask, mode, valid, c, w)


def sapo(old, lp, adv, mask, mode, *, tau_pos=1.0, tau_neg=1.05, w=None):
    ratio = np.exp(np.clip(lp - old, -20, 20))
    taus = np.where(adv > 0, tau_pos, tau_neg)
    gates = 1 / (1 + np.exp(-taus * (ratio - 1.0))) * (4.0 / taus)
    pg = -gates * adv
    if w is not None:
        pg = pg * w
    return agg_loss(pg, mask, "seq-mean-token-mean"), dict(ppo_kl=masked_mean(-np.clip(lp - old, -20, 20), mask))


def gpg(old, lp, adv, mask, mode, *, w=None):
    pg = -lp * adv
    if w is not None:
        pg = pg * w
    return agg_loss(pg, mask, mode), {}


def geo_mean(old, lp, adv, mask, mode, *, low=0.2, high=0.2, w=None):
    nkl = lp - old
    sgn = np.sign(adv)
    clamp = np.clip(nkl, -low, high)
    mn = sgn * np.minimum(sgn * nkl, sgn * clamp)
    n = mask.sum(-1)
    ratio = np.exp((mn * mask).sum(-1) / (n + 1e-8))
    a = (adv * mask).sum(-1) / (n + 1e-8)
    pg = -a * ratio
    if w is not None:
        pg = pg * np.exp((np.log(w + 1e-10) * mask).sum(-1) / (n + 1e-8))
    clipped = nkl != clamp
    return pg.mean(), dict(pg_clipfrac=masked_mean(clipped * (adv > 0), mask), ppo_kl=masked_mean(-nkl, mask),
                           pg_clipfrac_lower=masked_mean(clipped * (adv < 0), mask))


def dro(old, lp, adv, mask, mode, *, beta, w=None):
    lr = lp - old
    pg = -(lp * adv - 0.5 * beta * lr ** 2)
    if w is not None:
        pg = pg * w
    return agg_loss(pg, mask, mode), dict(ppo_kl=masked_mean(-lr, mask))


def clip_cov(old, lp, adv, mask, mode, *, low=0.2, high=0.2, ratio_=0.0002, lb=1.0, ub=5.0, pick=None):
    """``pick(candidates [n, 2], clip_num) -> chosen [k, 2]`` replaces torch.randperm's draw."""
    nkl = lp - old
    ratio = np.exp(nkl)
    l1, l2 = -adv * ratio, -adv * np.clip(ratio, 1 - low, 1 + high)
    by_origin = (l2 > l1) & (mask > 0)
    cov = (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask))
    cov[mask == 0] = -np.inf
    cov[by_origin] = -np.inf
    clip_num = max(int(ratio_ * mask.sum()), 1)
    idx = np.argwhere((cov < ub) & (cov > lb) & (mask > 0))
    chosen = (pick or (lambda i, k: i[:k]))(idx, clip_num) if len(idx) else idx
    corr = np.ones_like(adv)
    corr[chosen[:, 0], chosen[:, 1]] = 0
    pg = np.maximum(l1, l2) * corr
    return agg_loss(pg, mask, mode), dict(pg_clipfrac=masked_mean((corr == 0).astype(float), mask),
                                          ppo_kl=masked_mean(-nkl, mask)), idx, clip_num


def kl_cov(old, lp, adv, mask, mode, *, ratio_=0.0002, coef=0.1):
    nkl = lp - old
    ratio = np.exp(nkl)
    pg1 = -adv * ratio
    pgk = -adv * ratio + coef * np.abs(nkl)
    pg = pg1.copy()
    valid = mask > 0
    flat_idx = np.nonzero(valid.reshape(-1))[0]
    a, p = adv[valid], lp[valid]
    if len(a):
        cov = (a - a.mean()) * (p - p.mean())
        k = max(1, int(len(cov) * ratio_))
        top = np.argsort(-cov, kind="stable")[:k]
        big = flat_idx[top]
        pg[big // adv.shape[1], big % adv.shape[1]] = pgk[big // adv.shape[1], big % adv.shape[1]]
    return agg_loss(pg, mask, mode), dict(ppo_kl=masked_mean(np.abs(nkl), mask))


# ---------------------------------------------------------------------------- rollout correction


def is_weights(log_ratio, mask, level, upper, lower=None, normalize=False):
    """compute_rollout_correction_weights + compute_is_metrics (no empty rows)."""
    if level == "token":
        lr_m = log_ratio
        raw = np.exp(np.clip(log_ratio, -SAFETY, SAFETY))
    else:
        lr_m = masked_sum(log_ratio, mask, -1)[:, None]
        raw = np.broadcast_to(np.exp(np.clip(lr_m, -SAFETY, SAFETY)), log_ratio.shape)
    raw = raw * mask
    w = np.minimum(raw, upper) if lower is None else np.where((raw >= lower) & (raw <= upper), raw, 0.0)
    m = {}
    low = 1.0 / upper if lower is None else lower
    if level == "sequence":
        m["rollout_is_max"] = math.exp(min(lr_m.max(), SAFETY))
        m["rollout_is_min"] = math.exp(lr_m.min())
        m["rollout_is_mean"] = masked_mean(w, mask)
        m["rollout_is_ratio_fraction_high"] = (lr_m > math.log(upper)).mean()
        m["rollout_is_ratio_fraction_low"] = (lr_m < math.log(low)).mean()
    else:
        m["rollout_is_mean"] = masked_mean(w, mask)
        m["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).astype(float), mask)
        m["rollout_is_ratio_fraction_low"] = masked_mean((raw < low).astype(float), mask)
        m["rollout_is_max"] = np.where(mask > 0, w, -np.inf).max()
        m["rollout_is_min"] = np.where(mask > 0, w, np.inf).min()
    if mask.sum() > 1:
        c = np.clip(w, 0.0, upper)
        var = masked_mean(c ** 2, mask) - masked_mean(c, mask) ** 2
        m["rollout_is_std"] = math.sqrt(max(var, 0.0))
    else:
        m["rollout_is_std"] = 0.0
    c = np.clip(w, 0.0, upper)
    m["rollout_is_eff_sample_size"] = 1.0 / masked_mean((c / (masked_mean(c, mask) + 1e-8)) ** 2, mask)
    s = masked_mean(w, mask, -1)
    m["rollout_is_seq_mean"] = s.mean()
    m["rollout_is_seq_std"] = s.std(ddof=1) if s.size > 1 else 0.0
    m["rollout_is_seq_max"], m["rollout_is_seq_min"] = s.max(), s.min()
    m["rollout_is_seq_max_deviation"] = np.abs(s - 1.0).max()
    rs = masked_mean(raw, mask, -1)
    m["rollout_is_seq_fraction_high"] = (rs > upper).mean()
    m["rollout_is_seq_fraction_low"] = (rs < low).mean()
    if lower is not None:
        m["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).astype(float), mask)
    if normalize:
        mean = masked_mean(w, mask) if level == "token" else masked_mean(w, mask, -1).mean()
        if mean > 1e-8:
            w = w / mean
            m["rollout_is_batch_norm_factor"] = mean
        else:
            m["rollout_is_batch_norm_factor"] = 1.0
    return w, m


def _seq_max(v, mask):
    mv = np.where(mask > 0, v, -np.inf).max(-1)
    return np.where(mv == -np.inf, 0.0, mv)


def rejection(log_ratio, mask, options, thresholds):
    """compute_rollout_rejection_mask + compute_rs_metrics; ``thresholds``: option -> (lower|None, upper)."""
    safe = np.clip(log_ratio, -SAFETY, SAFETY)
    stats = {"k1": -safe, "k2": 0.5 * safe ** 2, "k3": np.exp(safe) - 1.0 - safe}
    combined = np.ones_like(mask, dtype=float)
    seq_valid = mask.sum(-1) > 0
    m = {}
    for opt in options:
        lower, upper = thresholds[opt]
        k1 = opt.endswith("k1")
        lo_log, up_log = (math.log(lower), math.log(upper)) if k1 else (None, None)
        tok = stats[opt[-2:]]
        seq_stat = None
        if opt.startswith("token"):
            per_tok = tok
            keep = (per_tok >= lo_log) & (per_tok <= up_log) if k1 else per_tok <= upper
        else:
            kind = opt.split("_")[1]
            seq_stat = {"sum": lambda v: masked_sum(v, mask, -1), "mean": lambda v: masked_mean(v, mask, -1),
                        "max": lambda v: _seq_max(v, mask)}[kind](tok)
            keep_s = (seq_stat >= lo_log) & (seq_stat <= up_log) if k1 else seq_stat <= upper
            keep = np.broadcast_to(keep_s[:, None], mask.shape)
            per_tok = np.broadcast_to(seq_stat[:, None], mask.shape)
        hi = up_log if k1 else upper
        lo = lo_log if k1 else 0.0
        p = f"rollout_rs_{opt}"
        sv = masked_mean(per_tok, mask, -1) if seq_stat is None else seq_stat
        svv = sv[seq_valid]
        m[f"{p}_mean"] = masked_mean(per_tok, mask)
        if seq_stat is not None:
            m[f"{p}_max"], m[f"{p}_min"] = svv.max(), svv.min()
            m[f"{p}_fraction_high"] = (svv > hi).mean()
            m[f"{p}_fraction_low"] = (svv < lo).mean() if k1 else 0.0
        else:
            m[f"{p}_max"] = np.where(mask > 0, per_tok, -np.inf).max()
            m[f"{p}_min"] = np.where(mask > 0, per_tok, np.inf).min()
            m[f"{p}_fraction_high"] = masked_mean((per_tok > hi).astype(float), mask)
            m[f"{p}_fraction_low"] = masked_mean((per_tok < lo).astype(float), mask) if k1 else 0.0
        if mask.sum() > 1:
            c = np.clip(per_tok, lo, hi)
            m[f"{p}_std"] = math.sqrt(max(masked_mean(c ** 2, mask) - masked_mean(c, mask) ** 2, 0.0))
        else:
            m[f"{p}_std"] = 0.0
        m[f"{p}_seq_mean"] = svv.mean()
        m[f"{p}_seq_std"] = svv.std(ddof=1) if svv.size > 1 else 0.0
        m[f"{p}_seq_max"], m[f"{p}_seq_min"] = svv.max(), svv.min()
        m[f"{p}_seq_max_deviation"] = np.abs(svv).max()
        m[f"{p}_seq_fraction_high"] = (svv > hi).mean()
        if k1:
            m[f"{p}_seq_fraction_low"] = (svv < lo).mean()
        keepf = keep.astype(float)
        combined = combined * keepf
        seq_keep = (~((~keep) & (mask > 0))).all(-1)
        m[f"{p}_masked_fraction"] = masked_mean(1 - keepf, mask)
        m[f"{p}_seq_masked_fraction"] = ((1.0 - seq_keep) * seq_valid).sum() / seq_valid.sum()
    m["rollout_rs_masked_fraction"] = masked_mean(1 - combined, mask)
    final_keep = (combined > 0.5) & (mask > 0)
    m["rollout_rs_seq_masked_fraction"] = (~final_keep & (mask > 0)).any(-1).mean()
    return mask * combined, m


def offpolicy(old, roll, mask):
    m_old = masked_mean(old, mask, -1)
    m_roll = masked_mean(roll, mask, -1)
    lr = old - roll
    diff = m_roll - m_old
    return {
        "training_ppl": np.exp(-m_old).mean(), "training_log_ppl": (-m_old).mean(),
        "kl": masked_mean(roll - old, mask), "k3_kl": masked_mean(np.exp(lr) - lr - 1, mask),
        "rollout_ppl": np.exp(-m_roll).mean(), "rollout_log_ppl": (-m_roll).mean(),
        "log_ppl_diff": diff.mean(), "log_ppl_abs_diff": np.abs(diff).mean(), "log_ppl_diff_max": diff.max(),
        "log_ppl_diff_min": diff.min(), "ppl_ratio": np.exp(diff).mean(),
        "chi2_token": masked_mean(np.exp(np.clip(lr, -SAFETY, SAFETY)) ** 2, mask) - 1.0,
        "chi2_seq": np.exp(2.0 * np.clip(masked_sum(lr, mask, -1), -SAFETY, SAFETY)).mean() - 1.0,
    }


# ---------------------------------------------------------------------------- distillation


def kl_penalty(lp, ref, kind):
    """core_algos.kl_penalty (the estimators distillation reuses)."""
    if kind in ("kl", "k1"):
        return lp - ref
    if kind == "abs":
        return np.abs(lp - ref)
    if kind in ("mse", "k2"):
        return 0.5 * (lp - ref) ** 2
    kl = np.clip(ref - lp, -20, 20)
    return np.clip(np.exp(kl) - kl - 1, -10, 10)


def forward_kl_topk(student_topk, teacher_topk, clamp=None):
    """fsdp/losses.compute_forward_kl_topk's loss and masses, then the registered loss's clamp_min(0)."""
    s_mass, t_mass = np.exp(student_topk).sum(-1), np.exp(teacher_topk).sum(-1)
    if clamp is not None:
        student_topk, teacher_topk = np.maximum(student_topk, clamp), np.maximum(teacher_topk, clamp)
    p = np.exp(teacher_topk)
    return np.maximum((p * (teacher_topk - student_topk)).sum(-1), 0.0), s_mass, t_mass


def distillation_loss(token_losses, mask, mode, clamp=None):
    valid = mask > 0
    lo, hi = token_losses[valid].min(), token_losses[valid].max()
    if clamp is not None:
        token_losses = np.clip(token_losses, -clamp, clamp)
    return agg_loss(token_losses, mask, mode), {"distillation/loss_min": lo, "distillation/loss_max": hi}


def distillation_ppo_loss(task_loss, old, lp, teacher, mask, agg, *, loss_mode, use_task_rewards, coef,
                          use_policy_gradient, clamp, low=0.2, high=0.2):
    """verl's distillation_ppo_loss with the estimator losses: the clamped per-token losses,
    as a PPO-clip loss of advantages -loss (use_policy_gradient) or aggregated directly, added to
    the task's loss with coef (use_task_rewards) or alone."""
    d = kl_penalty(lp, teacher, loss_mode)
    if clamp is not None:
        d = np.clip(d, -clamp, clamp)
    if use_policy_gradient:
        distill = vanilla(old, lp, -d, mask, agg, low=low, high=high)[0]
    else:
        distill = agg_loss(d, mask, agg)
    return (task_loss + coef * distill if use_task_rewards else distill), distill
