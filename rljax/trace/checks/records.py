"""Checks of each traced prompt group's records: every stage the runner ran is recorded with the
group's keys, producers and consumers as the configuration implies, masks, padding, timestamps,
and the whole-batch invariants the tracer computed on every row."""

from __future__ import annotations

from typing import Optional

from rljax.trace.batch_fields import BATCH_FIELDS, names
from rljax.trace.checks.base import FAIL, NA, PASS, Result, Run, field
from rljax.trace.tracer import SUMMARY_FILE, TRACE_FILE


#: The prompt's fields (a padding row keeps its prompt: their mask sums may be nonzero).
PROMPT_FIELDS = names(valid="prompt")


def check_group_consistency(run: Run) -> Result:
    name = "prompt group uid/sessions/keys consistent across every stage"
    if not run.groups:
        return FAIL, name, f"no records in {TRACE_FILE}"
    for (step, uid), stages in sorted(run.groups.items()):
        required = run.at(step).required_stages()  # the settings the step ran with
        ran = stages_run(stages)
        if ran is None:
            why = ("the trace predates stage records (its cleanup records do not list the stages the runner ran): "
                   "re-run to check it" if "cleanup" in stages else "no cleanup record (it lists the stages run)")
            return FAIL, name, f"step {step} group {uid}: {why}"
        missing = [s for s in ran if s not in stages]
        if missing:
            return FAIL, name, (f"step {step} group {uid}: no record of stage(s) the runner ran: "
                                f"{', '.join(missing)}")
        unexpected = [s for s in stages if s not in ran]
        if unexpected:
            return FAIL, name, (f"step {step} group {uid}: record(s) of stage(s) the runner did not run: "
                                f"{', '.join(unexpected)}")
        not_run = [s for s in required if s not in ran]
        if not_run:  # the cross-check: what this configuration needs, against what ran
            return FAIL, name, (f"step {step} group {uid}: stage(s) missing: {', '.join(not_run)} (the configuration "
                                f"needs them; the runner ran {', '.join(ran[1:-1])})")
        keys = stages["rollout_sessions"]["keys"]
        if not keys or any(not k.startswith(f"{uid}_") for k in keys):
            return FAIL, name, f"step {step} group {uid}: trajectory keys {keys[:3]}... do not carry the uid"
        for s, r in stages.items():
            if r["keys"] != keys:
                return FAIL, name, f"step {step} group {uid}: keys at stage {s} differ from rollout_sessions"
        traj = [t["key"] for t in stages["rollout_sessions"].get("trajectories", [])]
        if traj != keys:
            return FAIL, name, f"step {step} group {uid}: rollout_sessions trajectories differ from its keys"
    first = sorted(run.groups)[0]
    n = sorted({len(stages_run(g)) for g in run.groups.values()})
    return PASS, name, (f"{len(run.groups)} traced group(s), each with a record of every stage the runner ran "
                        f"({'/'.join(map(str, n))} with config_resolve and cleanup); e.g. step {first[0]} "
                        f"uid {first[1]}: {len(run.groups[first]['rollout_sessions']['keys'])} keys")


def stages_run(group: dict) -> Optional[list[str]]:
    """The records a traced group must have: ``config_resolve``, the stages the runner ran that
    step (its cleanup record's ``stages``, in order), ``cleanup``; None without that record."""
    cleanup = group.get("cleanup")
    if cleanup is None or "stages" not in cleanup:
        return None
    return ["config_resolve", *cleanup["stages"], "cleanup"]


def check_sessions(run: Run) -> Result:
    name = "sessions per uid == rollout.n"
    n = run.config_values.get("rollout.n")
    recs = run.by_stage("rollout_sessions")
    if not recs or n is None:
        return FAIL, name, "no rollout_sessions records or rollout.n unknown"
    for r in recs:
        n = run.at(r["step"]).config_values.get("rollout.n")  # a resume may have changed it
        sessions = sorted({int(k.rsplit("_", 2)[1]) for k in r["keys"]})
        if r.get("n") != n or sessions != list(range(n)) or r.get("sessions") != sessions:
            return FAIL, name, (f"step {r['step']} uid {r['uid']}: sessions {sessions} "
                                 f"(recorded {r.get('sessions')}), rollout.n={n}")
    ns = sorted({len(r.get("sessions") or []) for r in recs})
    return PASS, name, f"{len(recs)} group(s) with sessions 0..{n - 1}" + (
        f" (rollout.n {', '.join(map(str, ns))} by the settings of each step)" if len(ns) > 1 else "")


def check_response_len(run: Run) -> Result:
    name = "response_len and response_mask.sum() told apart"
    recs = run.by_stage("trajectory_fields")
    trajs = [t for r in recs for t in r.get("trajectories", [])]
    if not trajs:
        return FAIL, name, "no trajectory_fields records"
    bad = [t for t in trajs if t["response_mask_sum"] > t["response_len"]
           or t["observation_tokens"] != t["response_len"] - t["response_mask_sum"]]
    if bad:
        return FAIL, name, f"{bad[0]['key']}: response_mask.sum() {bad[0]['response_mask_sum']} inconsistent with " \
                            f"response_len {bad[0]['response_len']}"
    apart = [t for t in trajs if t["observation_tokens"] > 0]
    # Multi-turn runs (rljax.env): the rollout recorded, per trajectory, the observation tokens'
    # mask and log-prob and the policy tokens left out of the mask; all must be 0.
    episodes = [t for r in run.by_stage("rollout_sessions") for t in r.get("trajectories", []) if "obs_mask_sum" in t]
    wrong = [t for t in episodes if t["obs_mask_sum"] or t["obs_logp_abs_sum"] or t["policy_unmasked"]]
    if wrong:
        w = wrong[0]
        return FAIL, name, (f"{w['key']}: observation tokens with mask 1: {w['obs_mask_sum']}, |rollout_logp| on "
                            f"observations {w['obs_logp_abs_sum']:g}, policy tokens with mask 0: {w['policy_unmasked']}")
    if apart and episodes:
        turns = max(t.get("num_turns", 1) for t in episodes)
        return PASS, name, (f"{len(apart)} trajectory(ies) with observation tokens (mask 0, rollout log-prob 0; "
                            f"every policy token mask 1; up to {turns} turns), e.g. {apart[0]['key']}")
    if apart:
        return PASS, name, f"{len(apart)} trajectory(ies) with observation tokens, e.g. {apart[0]['key']}"
    return NA, name, (f"no tool observations in this run (response_len == response_mask.sum() "
                      f"for all {len(trajs)} traced trajectories)")


def check_invariants(run: Run) -> Result:
    """Whole-batch invariants (rljax.trace.invariants) held on every row of every step: loss tokens
    and mask positions of the update == the rollout's, the same response tokens, no future version,
    no observation token with mask 1."""
    name = "whole-batch invariants on every row"
    if run.summary is None:
        return NA, name, f"{SUMMARY_FILE} missing (see 'trace summary saved')"
    inv = run.summary.get("invariants")
    if inv is None:
        return FAIL, name, f"{SUMMARY_FILE} has no invariants section"
    if inv.get("error"):  # the tracer failed to compute them: the rows went unchecked
        return FAIL, name, inv["error"]
    if inv.get("skipped"):
        return NA, name, inv["skipped"]
    if inv.get("violations"):
        v = inv["violations"][0]
        return FAIL, name, (f"{inv.get('violating_rows')} row(s) in all; first: step {v['step']} tensor {v['tensor']} "
                            f"at {v['stage']}, {v['key']} (uid {v['uid']}): {v['detail']}")
    if not inv.get("rows"):
        return FAIL, name, "no rows checked"
    return PASS, name, (f"{inv['rows']} rows over {inv['steps']} step(s), as read by {', '.join(inv.get('stages', []))}: "
                        "loss tokens, mask positions, tokens, versions agree with the rollout")


def check_timestamps(run: Run) -> Result:
    """Per traced group: every stage ends after it starts and starts no earlier than the stage
    before it; every trajectory was submitted, inserted into a slot and finished in that order,
    within its rollout stage."""
    name = "stage and trajectory timestamps ordered"
    eps = 2e-6  # the trace rounds to microseconds
    n = 0
    for (step, uid), stages in sorted(run.groups.items()):
        prev = None
        for st, r in stages.items():
            t0, t1 = r.get("t_start"), r.get("t_end")
            if t0 is None or t1 is None:
                continue
            if t1 < t0 - eps or (prev is not None and t0 < prev[1] - eps):
                return FAIL, name, (f"step {step} uid {uid} stage {st}: [{t0}, {t1}]"
                                    + (f" starts before {prev[0]} started ({prev[1]})" if prev else " ends first"))
            prev = (st, t0)
        ro = stages.get("rollout_sessions")
        if ro is None:
            continue
        sub, end = ro.get("t_submit"), ro.get("t_end")
        for t in ro.get("trajectories", []):
            ins, fin = t.get("t_insert"), t.get("t_finish")
            if None in (sub, ins, fin, end):
                return FAIL, name, f"step {step} {t.get('key')}: submit/insert/finish timestamps missing"
            if not (ro["t_start"] - eps <= sub <= ins + eps and ins <= fin + eps and fin <= end + eps):
                return FAIL, name, (f"step {step} {t['key']}: submitted {sub}, inserted {ins}, finished {fin}, "
                                    f"rollout stage [{ro['t_start']}, {end}]: out of order")
            n += 1
    if not n:
        return FAIL, name, "no traced trajectory with submit/insert/finish timestamps"
    return PASS, name, f"{len(run.groups)} traced group(s), {n} trajectories: submit <= insert <= finish within the rollout"


def _expected(run: Run) -> dict[str, tuple[str, tuple[str, ...]]]:
    """field -> (the stage that must produce it, stages of which at least one must consume it): the
    batch-field table's expectations (:data:`rljax.trace.batch_fields.BATCH_FIELDS`), as this
    configuration changes them."""
    out = {f.name: (f.producer, f.consumers) for f in BATCH_FIELDS if f.producer is not None}
    if run.old_logp_in_update():  # written by the update itself; nothing reads it before
        out["old_logp"] = ("actor_minibatch", ())
    elif run.bypass():  # the update's behaviour log-prob is the sampler's: no old_logp
        del out["old_logp"]
    if not run.needs_reference():
        del out["ref_logp"]
    topk = run.config_values.get("distillation.distillation_loss.loss_mode") == "forward_kl_topk"
    for name in ("teacher_logp", "teacher_topk_ids", "teacher_topk_logp"):  # the teacher's fields of this loss_mode
        if not run.distills() or (name == "teacher_logp") == topk:
            del out[name]
    return out


def check_producers(run: Run) -> Result:
    name = "reward / old,ref log-prob / advantage producers and consumers"
    seen = 0
    for (step, uid), stages in sorted(run.groups.items()):
        expected = _expected(run.at(step))
        found: dict[str, tuple[str, set]] = {}
        for st, r in stages.items():
            for f in r.get("fields", []):
                if f["name"] in expected:
                    prod, cons = found.get(f["name"], (f["producer"], set()))
                    found[f["name"]] = (prod, cons | set(f.get("consumers", [])))
        for fname, (prod, cons) in expected.items():
            if fname not in found:
                return FAIL, name, f"step {step} group {uid}: field {fname} never appears in the trace"
            p, c = found[fname]
            if p != prod or (cons and not c & set(cons)):
                return FAIL, name, (f"step {step} group {uid}: {fname} produced by {p!r}, consumed by "
                                    f"{sorted(c)}; expected {prod} -> {'/'.join(cons)}")
            seen += 1
    if not run.groups:
        return FAIL, name, "no trace records"
    note = "" if run.needs_reference() else " (no reference policy in this run)"
    return PASS, name, f"{seen} field checks as expected{note}"


def check_behaviour_logp(run: Run) -> Result:
    """The update's behaviour log-prob is the learner's old_logp, or the sampler's in bypass mode."""
    name = "behaviour log-prob from the right producer (bypass_mode)"
    recs = run.by_stage("actor_minibatch")
    if not recs:
        return FAIL, name, "no actor_minibatch records"
    used: dict[str, int] = {}  # source -> updates (a resume may change the settings that decide it)
    for r in recs:
        bypass, in_update = run.at(r["step"]).bypass(), run.at(r["step"]).old_logp_in_update()
        b = r.get("behaviour_logp") or {}
        field, prod = b.get("field"), b.get("producer")
        if bypass and (field != "rollout_logp" or prod not in ("rollout_sessions", "trajectory_fields")):
            return FAIL, name, (f"step {r['step']}: algorithm.bypass_mode=true but the update's behaviour log-prob is "
                                f"{field!r} produced by {prod!r} (expected the sampler's rollout_logp)")
        if in_update:  # the configuration makes the update exactly on-policy (rljax.config.on_policy_blockers)
            if field != "old_logp" or prod != "actor_minibatch" or not b.get("in_update"):
                return FAIL, name, (f"step {r['step']}: the update's behaviour log-prob is {field!r} produced by "
                                    f"{prod!r} (expected old_logp from the update itself: actor.skip_old_log_prob "
                                    "and the update is exactly on-policy)")
        elif not bypass and (field != "old_logp" or prod != "old_log_prob"):
            why = (" inside an update that is not exactly on-policy" if prod == "actor_minibatch" else "")
            return FAIL, name, (f"step {r['step']}: the update's behaviour log-prob is {field!r} produced by {prod!r}"
                                f"{why} (expected old_logp from old_log_prob)")
        used[_behaviour_source(bypass, in_update)] = used.get(_behaviour_source(bypass, in_update), 0) + 1
    return PASS, name, "; ".join(f"{n} update(s) used {src}" for src, n in used.items())


def _behaviour_source(bypass: bool, in_update: bool) -> str:
    if bypass:
        return "the sampler's rollout_logp (bypass_mode)"
    if in_update:
        return ("old_logp from their own log-probs, detached (actor.skip_old_log_prob; exactly on-policy: one epoch "
                "over one mini-batch, no old_log_prob stage)")
    return "old_logp from the old_log_prob stage"


def check_masks(run: Run) -> Result:
    """Per traced trajectory, the loss mask the update consumed has exactly the rollout's action tokens."""
    name = "loss_mask consumed by the update == rollout's response_mask"
    checked = 0
    for (step, uid), st in sorted(run.groups.items()):
        tf, am = st.get("trajectory_fields"), st.get("actor_minibatch")
        if tf is None or am is None:
            continue
        lm = field(am, "loss_mask")
        if lm is None or "mask_sum" not in lm:
            return FAIL, name, f"step {step} group {uid}: the update's loss_mask is not in the trace"
        sampler = [t["response_mask_sum"] for t in tf.get("trajectories", [])]
        learner = lm["mask_sum"]
        if not len(am["keys"]) == len(sampler) == len(learner):  # zip would leave the extra ones uncompared
            return FAIL, name, (f"step {step} group {uid}: the update's loss_mask has {len(learner)} trajectories "
                                f"({len(am['keys'])} keys), the rollout's trajectory_fields {len(sampler)}")
        for key, a, b in zip(am["keys"], sampler, learner):
            if a != b:
                return FAIL, name, (f"step {step} {key}: the update's loss_mask has {b} tokens, the rollout's "
                                    f"response_mask {a}")
            checked += 1
    if not checked:
        return FAIL, name, "no traced trajectory with both trajectory_fields and actor_minibatch records"
    return PASS, name, f"{checked} traced trajectories: loss tokens == action tokens"


def check_padding(run: Run) -> Result:
    name = "padding rows excluded from reward, metrics and loss"
    pad_rows = 0
    masked_nonzero = False
    for (step, uid), st in sorted(run.groups.items()):
        mb = st.get("actor_minibatch", {}).get("minibatch", {})
        if mb.get("loss_tokens_on_padding_rows", 0):
            return FAIL, name, f"step {step}: {mb['loss_tokens_on_padding_rows']} loss tokens on padding rows"
        if mb.get("advantages_on_padding_rows_abs_sum"):
            return FAIL, name, f"step {step}: padding rows carry advantages ({mb['advantages_on_padding_rows_abs_sum']})"
        rw = st.get("reward", {})
        if rw.get("padding_reward_abs_sum", 0):
            return FAIL, name, f"step {step}: padding rows carry reward {rw['padding_reward_abs_sum']}"
        pad_rows = max(pad_rows, rw.get("padding_rows", 0))
        for s, r in st.items():
            for f in r.get("fields", []):
                if "is_padding" in f and "mask_sum" in f:
                    for p, m in zip(f["is_padding"], f["mask_sum"]):
                        if p and m and f["name"] not in PROMPT_FIELDS:
                            return FAIL, name, f"step {step} {s}: padding row counted in {f['name']} (mask_sum {m})"
                if f["name"] == "advantages" and f.get("outside_mask_abs_sum"):
                    masked_nonzero = True  # e.g. whitened GAE; harmless while every consumer masks
        m = st.get("metrics", {})
        if "rows_counted" in m and mb.get("global_batch_size") is not None:
            if m["rows_counted"] != mb["global_batch_size"] - m.get("padding_rows", 0):
                return FAIL, name, f"step {step}: metrics counted {m['rows_counted']} rows of " \
                                    f"{mb['global_batch_size']} with {m.get('padding_rows')} padding"
        logged = run.metrics.get(step, {}).get("response_length/mean")
        real = m.get("response_length_mean_real")
        if logged is not None and real is not None and abs(logged - real) > 1e-4 * max(1.0, abs(real)):
            return FAIL, name, f"step {step}: metrics.jsonl response_length/mean {logged} != mean over real rows {real}"
    if not run.groups:
        return FAIL, name, "no trace records"
    note = f"{pad_rows} padding row(s) per step" if pad_rows else "no padding rows in this run; masks and means checked"
    if masked_nonzero:
        note += "; note: advantages are nonzero on masked tokens of real rows (the loss masks them)"
    return PASS, name, note
