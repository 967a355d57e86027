"""``python -m rljax.trace check RUN_DIR``: verify a run from its files alone.

Each check returns ``(status, name, detail)`` with ``status`` one of ``PASS``, ``WARN`` (the
run is correct but something deserves a look, e.g. a warning-severity alert fired), ``FAIL``
or ``N/A`` (the check does not apply to this run, e.g. no tool observations); WARN and N/A
are counted apart, never as a pass. :func:`exit_code` turns the results into the CLI's exit
status: 1 on any FAIL (and, with ``strict``, on any WARN), else 0.

The run's mode and settings come from ``config.resolved.yaml`` (the trace's config record
only when that file is missing or unreadable), so a run that stopped before writing its
trace is still checked as what it was configured to be. Producers and consumers in the
trace are what the step runner observed (the stage that wrote a field, the stages that read
it), so these checks compare the run with what the configuration implies, not with a second
hand-kept table. Alerts of ``error`` severity in the run fail it; ``warning`` ones warn.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Callable, Optional

from rljax.config import load_resolved, on_policy_blockers, to_flat_dict
from rljax.trace.alerts import SEVERITY
from rljax.trace.jsonl import JsonLines, read_jsonl
from rljax.trace.metrics import read_metrics
from rljax.trace.tracer import SUMMARY_FILE, TRACE_FILE

Result = tuple[str, str, str]
PASS, WARN, FAIL, NA = "PASS", "WARN", "FAIL", "N/A"
STATUSES = (PASS, WARN, FAIL, NA)


def read_trace(run_dir: str, cut: Optional[list] = None) -> list[dict]:
    """The complete records of ``trace.jsonl``; a line that does not parse (cut short by a full disk
    or a kill) is left out and, when ``cut`` is given, named in it."""
    f = read_jsonl(os.path.join(run_dir, TRACE_FILE))
    if cut is not None and f.problem:
        cut.append(f.problem)
    return f.records


class Run:
    """The files of one run directory, parsed once."""

    def __init__(self, run_dir: str):
        self.dir = run_dir
        self.cut: list[str] = []  # files or lines that do not parse (a write cut short)
        self.files: dict[str, JsonLines] = {name: read_jsonl(os.path.join(run_dir, name))
                                            for name in (TRACE_FILE, "metrics.jsonl", "rollout_uids.jsonl")}
        self.cut += [f.problem for f in self.files.values() if f.problem]
        self.records = self.files[TRACE_FILE].records
        self.groups: dict[tuple, dict[str, dict]] = defaultdict(dict)  # (step, uid) -> stage -> record
        for r in self.records:
            self.groups[(r["step"], r["uid"])][r["stage"]] = r
        self.topology = self._json("topology.json")
        self.summary = self._json(SUMMARY_FILE)
        # the newest launch's record: every launch (a --resume too) rewrites config.resolved.yaml, whose
        # provenance chain then starts from the earlier launch's file
        cfg = next((r.get("config") for r in self.records if r["stage"] == "config_resolve"), None) or {}
        self.config_record = next((r["config"] for r in reversed(self.records)
                                   if r["stage"] == "config_resolve" and (r.get("config") or {}).get("sources")), cfg)
        # The resolved configuration is the authority on what the run was (mode, sizes); the
        # trace's copy of the key fields stands in only when the file is missing or unreadable.
        resolved = self.resolved()
        if resolved is not None:
            self.config_values = to_flat_dict(resolved)
            self.config_from = "config.resolved.yaml"
        else:
            self.config_values = cfg.get("values", {})
            self.config_from = TRACE_FILE if self.config_values else None

        self.metrics = {m["step"]: m for m in read_metrics(run_dir)}

    def _json(self, name):
        path = os.path.join(self.dir, name)
        if not os.path.exists(path):
            return None
        try:
            with open(path) as fh:
                return json.load(fh)
        except ValueError:
            self.cut.append(name)
            return None

    def needs_reference(self) -> bool:
        return bool(self.config_values.get("actor.use_kl_loss") or self.config_values.get("algorithm.use_kl_in_reward"))

    def asynchronous(self) -> Optional[bool]:
        """``trainer.mode == "async"``; None when neither the resolved config nor the trace says."""
        mode = self.config_values.get("trainer.mode")
        return None if mode is None else mode == "async"

    def bypass(self) -> bool:
        return bool(self.config_values.get("algorithm.bypass_mode"))

    def resolved(self):
        """The run's whole resolved configuration (``config.resolved.yaml``), or None."""
        if not hasattr(self, "_resolved"):
            self._resolved = None
            path = os.path.join(self.dir, "config.resolved.yaml")
            if os.path.exists(path):
                try:
                    self._resolved = load_resolved(path)[0]
                except Exception:  # check_config reports an unreadable file
                    pass
        return self._resolved

    def old_logp_in_update(self) -> bool:
        """The configuration has the update produce ``old_logp`` itself (``actor.skip_old_log_prob``
        auto or true, and the update exactly on-policy): no old_log_prob stage."""
        cfg = self.resolved()
        if cfg is None or self.bypass():
            return False

        return cfg.actor.skip_old_log_prob != "false" and not on_policy_blockers(cfg)

    def required_stages(self) -> list[str]:
        """The stages the run's configuration needs (a cross-check of the runner's own record of
        the stages it ran, which is what each group's records are compared with)."""
        stages = ["config_resolve", "dataset_item", "rollout_sessions", "trajectory_fields", "reward"]
        if not self.bypass() and not self.old_logp_in_update():
            stages.append("old_log_prob")
        if self.needs_reference():
            stages.append("reference")
        if self.config_values.get("algorithm.adv_estimator") == "gae":
            stages.append("values")
        stages.append("advantages")
        if self.config_values.get("algorithm.adv_estimator") == "gae":
            stages.append("update_critic")
        return stages + ["actor_minibatch", "weight_sync", "metrics", "cleanup"]

    def by_stage(self, stage: str) -> list[dict]:
        return [r for r in self.records if r["stage"] == stage]


def _field(rec: dict, name: str) -> Optional[dict]:
    return next((f for f in rec.get("fields", []) if f["name"] == name), None)


def _mode_result(run: Run, name: str) -> Optional[Result]:
    """N/A for a synchronous run, FAIL when the mode is unknown, None for an asynchronous one."""
    mode = run.asynchronous()
    if mode is None:
        return FAIL, name, "trainer.mode unknown: config.resolved.yaml is missing or unreadable and the trace has none"
    return None if mode else (NA, name, f"synchronous run (trainer.mode=sync in {run.config_from})")


def check_config(run: Run) -> Result:
    path = os.path.join(run.dir, "config.resolved.yaml")
    if not os.path.exists(path):
        return FAIL, "config provenance recorded", "config.resolved.yaml missing"
    try:
        _, prov = load_resolved(path)
    except Exception as e:
        return FAIL, "config provenance recorded", f"config.resolved.yaml unreadable: {e}"
    with open(path) as fh:
        tagged = sum(1 for line in fh if "# from: " in line)
    if tagged == 0:
        return FAIL, "config provenance recorded", "no '# from: <source>' tags in config.resolved.yaml"
    rec = run.config_record
    if not rec.get("sha256") or not rec.get("sources"):
        return FAIL, "config provenance recorded", "trace has no config_resolve record with sources"
    writers = rec.get("writers") or {}
    if not writers:
        return FAIL, "config provenance recorded", "the trace's config record has no writers (chain per key field)"
    for k, chain in writers.items():  # the trace keeps every writer, ending with the one the file names
        if not chain or chain[-1][0] != prov.get(k) or len(chain) != len(prov.chain(k)):
            return FAIL, "config provenance recorded", (f"{k}: the trace's writers {chain} disagree with "
                                                        f"config.resolved.yaml ({prov.get(k)}, {len(prov.chain(k))} "
                                                        "writer(s))")
    sources = sorted({v for v in prov.values()})
    hashes = {r["config"].get("sha256") for r in run.by_stage("config_resolve") if r.get("config")}
    multi = sum(1 for c in writers.values() if len(c) > 2)
    return PASS, "config provenance recorded", (f"{tagged} fields tagged; sources: {', '.join(sources)}; "
                                                f"{len(hashes)} resolved config(s) in the trace; {len(writers)} key "
                                                f"fields with every writer ({multi} set by more than one)")


def check_group_consistency(run: Run) -> Result:
    name = "prompt group uid/sessions/keys consistent across every stage"
    if not run.groups:
        return FAIL, name, f"no records in {TRACE_FILE}"
    required = run.required_stages()
    for (step, uid), stages in sorted(run.groups.items()):
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
        sessions = sorted({int(k.rsplit("_", 2)[1]) for k in r["keys"]})
        if r.get("n") != n or sessions != list(range(n)) or r.get("sessions") != sessions:
            return FAIL, name, (f"step {r['step']} uid {r['uid']}: sessions {sessions} "
                                 f"(recorded {r.get('sessions')}), rollout.n={n}")
    return PASS, name, f"{len(recs)} group(s) with sessions 0..{n - 1}"


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


#: field -> (stage that must produce it, stages of which at least one must consume it), by configuration.
def _expected(run: Run) -> dict[str, tuple[str, tuple[str, ...]]]:
    out = {"scores": ("reward", ("advantages",)),
           "loss_mask": ("trajectory_fields", ("actor_minibatch",)),
           "advantages": ("advantages", ("actor_minibatch",))}
    if run.old_logp_in_update():  # written by the update itself; nothing reads it before
        out["old_logp"] = ("actor_minibatch", ())
    elif not run.bypass():
        out["old_logp"] = ("old_log_prob", ("actor_minibatch", "advantages"))
    if run.needs_reference():
        out["ref_logp"] = ("reference", ("actor_minibatch", "advantages"))
    return out


def check_producers(run: Run) -> Result:
    name = "reward / old,ref log-prob / advantage producers and consumers"
    seen = 0
    expected = _expected(run)
    for (step, uid), stages in sorted(run.groups.items()):
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
    bypass, in_update = run.bypass(), run.old_logp_in_update()
    for r in recs:
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
    if bypass:
        src = "the sampler's rollout_logp (bypass_mode)"
    elif in_update:
        src = ("old_logp from their own log-probs, detached (actor.skip_old_log_prob; exactly on-policy: one epoch "
               "over one mini-batch, no old_log_prob stage)")
    else:
        src = "old_logp from the old_log_prob stage"
    return PASS, name, f"{len(recs)} update(s) used {src}"


def check_masks(run: Run) -> Result:
    """Per traced trajectory, the loss mask the update consumed has exactly the rollout's action tokens."""
    name = "loss_mask consumed by the update == rollout's response_mask"
    checked = 0
    for (step, uid), st in sorted(run.groups.items()):
        tf, am = st.get("trajectory_fields"), st.get("actor_minibatch")
        if tf is None or am is None:
            continue
        lm = _field(am, "loss_mask")
        if lm is None or "mask_sum" not in lm:
            return FAIL, name, f"step {step} group {uid}: the update's loss_mask is not in the trace"
        sampler = [t["response_mask_sum"] for t in tf.get("trajectories", [])]
        learner = lm["mask_sum"]
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
                        if p and m and f["name"] not in ("prompt_ids", "prompt_mask"):
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


def check_minibatch(run: Run) -> Result:
    name = "actor mini-batch metadata present"
    recs = run.by_stage("actor_minibatch")
    if not recs:
        return FAIL, name, "no actor_minibatch records"
    need = ("global_batch_size", "ppo_mini_batch_size", "ppo_micro_batch_size", "ppo_epochs", "mini_batches_per_epoch",
            "loss_tokens")
    n = run.config_values.get("rollout.n")
    mini_prompts = run.config_values.get("actor.ppo_mini_batch_size")
    for r in recs:
        mb = r.get("minibatch") or {}
        missing = [k for k in need if mb.get(k) is None]
        if missing:
            return FAIL, name, f"step {r['step']}: missing {', '.join(missing)}"
        if mb["global_batch_size"] % mb["ppo_mini_batch_size"] or mb["ppo_mini_batch_size"] % mb["ppo_micro_batch_size"]:
            return FAIL, name, f"step {r['step']}: batch {mb['global_batch_size']} / mini {mb['ppo_mini_batch_size']} / " \
                                f"micro {mb['ppo_micro_batch_size']} do not divide"
        if n and mini_prompts and mb["ppo_mini_batch_size"] != n * mini_prompts:
            return FAIL, name, f"step {r['step']}: mini-batch {mb['ppo_mini_batch_size']} trajectories != " \
                                f"actor.ppo_mini_batch_size x rollout.n = {mini_prompts * n}"
    mb = recs[-1]["minibatch"]
    return PASS, name, (f"{len(recs)} record(s); batch {mb['global_batch_size']} = {mb['mini_batches_per_epoch']} "
                        f"mini-batches of {mb['ppo_mini_batch_size']} x {mb['ppo_epochs']} epoch(s), micro "
                        f"{mb['ppo_micro_batch_size']}")


def check_actor_dp(run: Run) -> Result:
    name = "actor_dp explained by the topology, not by rollout TP"
    t = run.topology
    if not t:
        return FAIL, name, "topology.json missing"
    try:
        world, mesh, dp = t["world_size"], t["mesh"], t["actor_dp"]
        expect = world // (mesh.get("tp", 1) * mesh.get("sp", 1))
    except (KeyError, TypeError) as e:
        return FAIL, name, f"topology.json lacks {e}"
    if dp != expect or "actor_dp_derivation" not in t or "rollout_tp" not in t:
        return FAIL, name, f"actor_dp={dp}, world/(tp*sp)={expect}, derivation/rollout_tp recorded: " \
                            f"{'actor_dp_derivation' in t}/{'rollout_tp' in t}"
    if "rollout" in t["actor_dp_derivation"]:
        return FAIL, name, f"actor_dp derivation mentions the rollout layout: {t['actor_dp_derivation']}"
    if mesh.get("dp", dp) != dp:
        return FAIL, name, f"actor_dp={dp} but the mesh's dp axis is {mesh.get('dp')}"
    for r in run.by_stage("actor_minibatch"):
        if r.get("minibatch", {}).get("actor_dp") not in (None, dp):
            return FAIL, name, (f"step {r['step']}: batch dispatched over dp={r['minibatch']['actor_dp']}, "
                                 f"topology says {dp}")
    rtp = t["rollout_tp"]
    return PASS, name, (f"actor_dp = {t['actor_dp_derivation']}; rollout tp={rtp}, replicas={t.get('rollout_replicas')} "
                        "(recorded separately)")


def check_versions(run: Run) -> Result:
    name = "weight version after each sync == next rollout's version"
    if run.asynchronous() and run.config_values.get("async_training.max_staleness"):
        return NA, name, ("asynchronous run with max_staleness > 0: a rollout may use older weights "
                          "(see 'trained staleness within tau')")
    syncs = {r["step"]: r for r in run.by_stage("weight_sync")}
    rollouts = defaultdict(list)
    for r in run.by_stage("rollout_sessions"):
        rollouts[r["step"]].append(r)
    if not syncs:
        return FAIL, name, "no weight_sync records"
    pairs = 0
    for step, s in sorted(syncs.items()):
        v = s.get("learner_version")
        if v is None or s.get("sampler_version") != v or s.get("next_rollout_version") != v:
            return FAIL, name, f"step {step}: learner version {v}, sampler {s.get('sampler_version')}, next rollout " \
                                f"{s.get('next_rollout_version')}"
        for r in rollouts.get(step + 1, []):
            if r.get("min_version") != v or r.get("max_version") != v:
                return FAIL, name, (f"step {step + 1}: rollout used versions {r.get('min_version')}..{r.get('max_version')}"
                                     f", the sync after step {step} installed {v}")
            pairs += 1
    for step, rs in rollouts.items():  # the version the rollout was asked for is the one it sampled with
        for r in rs:
            if r.get("weight_version") is not None and r.get("min_version") != r.get("weight_version"):
                return FAIL, name, f"step {step}: submitted at version {r.get('weight_version')}, sampled with " \
                                    f"{r.get('min_version')}"
    return PASS, name, f"{len(syncs)} sync(s), {pairs} followed by a traced rollout with the synced version"


def check_token_versions(run: Run) -> Result:
    """Every traced trajectory's per-token weight versions (``token_versions``: spans ``[first token,
    version]`` of ``Trajectories.token_version``) tie to its row versions: they start at token 0, never
    go down along the row (a push applies from the next token on, under partial_rollout keep and
    recompute alike), their minimum is ``min_version`` (staleness is measured from it) and none is
    above ``max_version``."""
    name = "token versions tie to min_version"
    seen = 0
    for r in run.by_stage("rollout_sessions"):
        for t in r.get("trajectories", []):
            spans = t.get("token_versions")
            if spans is None:
                continue
            seen += 1
            where = f"step {r.get('step')} {t.get('key')}"
            if not spans:
                return FAIL, name, f"{where}: no sampled token has a version"
            starts, versions = [s[0] for s in spans], [s[1] for s in spans]
            if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
                return FAIL, name, f"{where}: spans {spans} do not start at token 0 in order"
            if any(b < a for a, b in zip(versions, versions[1:])):
                return FAIL, name, f"{where}: token versions go down along the row: {spans}"
            if min(versions) != t.get("min_version") or max(versions) > t.get("max_version", max(versions)):
                return FAIL, name, (f"{where}: token versions {min(versions)}..{max(versions)}, row versions "
                                    f"{t.get('min_version')}..{t.get('max_version')}")
    if not seen:
        return NA, name, "no traced trajectory records token_versions (a trace written before per-token versions)"
    return PASS, name, f"{seen} traced trajectories: token versions non-decreasing, their minimum min_version"


def check_cleanup(run: Run) -> Result:
    name = "nothing left in the buffer after cleanup"
    recs = run.by_stage("cleanup")
    if not recs:
        return FAIL, name, "no cleanup records"
    for r in recs:
        if "tracked_objects" not in r:
            return FAIL, name, f"step {r['step']}: the cleanup record has no live-batch registry report"
        if r.get("remaining_keys") or not r.get("released"):
            return FAIL, name, (f"step {r['step']}: {len(r.get('remaining_keys') or [])} batch field(s) still "
                                f"referenced after the step: {', '.join((r.get('remaining_keys') or [])[:5])}")
    tracked = max(r["tracked_objects"] for r in recs)
    return PASS, name, (f"{len(recs)} cleanup record(s): every batch field released "
                        f"(up to {tracked} objects followed per step)")


def check_alerts(run: Run) -> Result:
    """Error-severity alerts fail the run; warnings are reported."""
    name = "no error-severity alerts"
    alerts = dict((run.summary or {}).get("alerts") or {})
    for step, m in sorted(run.metrics.items()):  # also alerts that only reached metrics.jsonl
        for k, v in m.items():
            if k.startswith("alerts/") and v:
                a = k.split("/", 1)[1]
                if a not in alerts:
                    alerts[a] = {"count": 1, "severity": SEVERITY.get(a, "warning"), "first_step": step}
    errors = {k: v for k, v in alerts.items() if isinstance(v, dict) and v.get("severity") == "error"}
    if errors:
        k, v = next(iter(sorted(errors.items())))
        return FAIL, name, (f"{len(errors)} error alert kind(s): {k} x{v.get('count')} (first at step "
                            f"{v.get('first_step')}: {v.get('message', '')})")
    warns = {k: v for k, v in alerts.items()}
    if warns:
        return WARN, name, "warning alert(s): " + "; ".join(
            f"{k} x{v.get('count')} (first at step {v.get('first_step')}: {v.get('message', '')})"
            if isinstance(v, dict) else f"{k} x{v}" for k, v in sorted(warns.items()))
    return PASS, name, "no alerts"


def check_summary(run: Run) -> Result:
    name = "trace summary saved"
    s = run.summary
    if not s:
        return FAIL, name, f"{SUMMARY_FILE} missing"
    if s.get("status") == "failed":
        return FAIL, name, f"the run failed at step {s.get('failed_at_step')}: {s.get('error')}"
    if s.get("status") == "running":
        return FAIL, name, (f"the run stopped after step {s.get('last_step')} without closing its summary (killed, or "
                            "still running): --resume trains the rest (or completes the summary of a run that "
                            "trained every step)")
    if not s.get("records") or not s.get("traced_uids"):
        return FAIL, name, f"{SUMMARY_FILE} records no trace"
    uids = {r["uid"] for r in run.records}
    missing = [u for u in s["traced_uids"] if u not in uids]
    if missing:
        return FAIL, name, f"{SUMMARY_FILE} lists uid(s) absent from {TRACE_FILE}: {missing[:3]}"
    files = [f for f in ("shape_ledger.json", "memory_ledger.json") if not os.path.exists(os.path.join(run.dir, f))]
    note = f"; missing ledger(s): {', '.join(files)}" if files else "; shape and memory ledgers present"
    frac = 100 * s.get("overhead_frac_median", 0)
    if s.get("faults"):
        return WARN, name, (f"faults switched on (rljax.trace.faults, tests only): {', '.join(s['faults'])}; "
                            f"{s['records']} records, {s['steps']} steps")
    return PASS, name, (f"{s['records']} records, {s['steps']} steps, overhead {frac:.1f}% "
                        f"of step time{note}")


def check_updates(run: Run) -> Result:
    """Every training step applied its update: no ``alerts/nonfinite_update``, the cumulative
    ``actor/skipped_updates`` never grows, loss and gradient norm are finite (not null)."""
    name = "updates finite"
    bad, prev, steps = [], 0, 0
    for step, m in sorted(run.metrics.items()):
        if "actor/skipped_updates" not in m and "alerts/nonfinite_update" not in m:
            continue
        steps += 1
        skipped = m.get("actor/skipped_updates")
        grew = skipped is not None and skipped > prev
        nulls = [k for k in ("actor/loss", "actor/grad_norm") if k in m and m[k] is None]
        if m.get("alerts/nonfinite_update") or grew or nulls:
            bad.append(f"step {step}" + (f" ({', '.join(nulls)} null)" if nulls else ""))
        prev = skipped if skipped is not None else prev
    if bad:
        return FAIL, name, f"{len(bad)} of {steps} step(s) skipped their update as non-finite: {', '.join(bad[:5])}"
    if not steps:
        return NA, name, "no training steps in metrics.jsonl"
    return PASS, name, f"{steps} step(s), every update applied"


def _dequeues(run: Run) -> list[dict]:
    return run.by_stage("dequeue")


def check_async_staleness(run: Run) -> Result:
    """trainer.mode=async: every trained row's staleness (learner version - oldest version it saw) is within tau,
    in the trace (traced groups), in metrics.jsonl (every step's maximum) and in the summary's histogram."""
    name = "trained staleness within tau"
    na = _mode_result(run, name)
    if na is not None:
        return na
    tau = run.config_values.get("async_training.max_staleness")
    bad = []
    for r in _dequeues(run):
        for s in (r.get("group") or {}).get("staleness") or []:
            if s > tau:
                bad.append(f"step {r['step']} uid {r['uid']}: staleness {s}")
    steps = 0
    for step, m in sorted(run.metrics.items()):
        if "async/staleness_max" in m:
            steps += 1
            if m["async/staleness_max"] is None or m["async/staleness_max"] > tau:
                bad.append(f"step {step}: async/staleness_max {m['async/staleness_max']}")
    hist = ((run.summary or {}).get("async") or {}).get("staleness_hist") or {}
    bad += [f"summary histogram: {n} row(s) at staleness {k}" for k, n in hist.items() if int(k) > tau]
    if bad:
        return FAIL, name, f"tau={tau}: " + "; ".join(bad[:3])
    if not steps:
        return FAIL, name, "no async/staleness_max in metrics.jsonl"
    return PASS, name, f"tau={tau}: {steps} step(s), histogram {dict(sorted(hist.items()))}"


def check_async_future(run: Run) -> Result:
    """trainer.mode=async: no trained trajectory saw a weight version newer than the learner's."""
    name = "no future weight version trained"
    na = _mode_result(run, name)
    if na is not None:
        return na
    recs = _dequeues(run)
    for r in recs:
        g = r.get("group") or {}
        if g.get("max_version") is not None and g["max_version"] > r.get("learner_version", -1):
            return FAIL, name, (f"step {r['step']} uid {r['uid']}: max_version {g['max_version']} > learner version "
                                f"{r.get('learner_version')}")
    for step, m in sorted(run.metrics.items()):
        if "async/max_version" in m and m["async/max_version"] is not None and \
                m["async/max_version"] > m.get("training/weight_version", 0) - 1:
            return FAIL, name, (f"step {step}: async/max_version {m['async/max_version']} > the learner version "
                                f"{m.get('training/weight_version', 0) - 1} it trained at")
    if not recs:
        return FAIL, name, "no dequeue records in the trace"
    return PASS, name, f"{len(recs)} traced dequeue(s): every version <= the learner's"


def check_async_drops(run: Run) -> Result:
    """trainer.mode=async: every dropped row is counted: the queue's final counts equal the last metrics' plus
    what was dropped after the last trained batch, and batches put = trained + dropped + left in flight."""
    name = "every dropped row counted"
    na = _mode_result(run, name)
    if na is not None:
        return na
    a = (run.summary or {}).get("async")
    if not a:
        return FAIL, name, "trace_summary.json has no async section"
    last = [m for _, m in sorted(run.metrics.items()) if "async/dropped_stale" in m]
    if not last:
        return FAIL, name, "no async/dropped_* in metrics.jsonl"
    m = last[-1]
    for kind in ("stale", "overflow"):
        logged, final = m.get(f"async/dropped_{kind}"), a.get(f"final_dropped_{kind}")
        if final is None or logged is None or final < logged:
            return FAIL, name, f"dropped_{kind}: metrics say {logged}, the queue's final count {final}"
    rows_per_batch = a["trained_rows"] / max(a["trained_batches"], 1)
    dropped = (a["final_dropped_stale"] + a["final_dropped_overflow"]) / rows_per_batch if rows_per_batch else 0
    put = a.get("batches_put", 0)
    if a["trained_batches"] + dropped > put + 1e-6:
        return FAIL, name, (f"{a['trained_batches']} trained + {dropped:g} dropped batch(es) > {put} put into the "
                            "queue")
    qsize = run.config_values.get("async_training.queue_size")
    if run.config_values.get("async_training.overflow") == "drop_stalest" and rows_per_batch and qsize:
        over = a["final_dropped_overflow"] / rows_per_batch  # the throttle: <= queue_size per trained batch
        if over > qsize * (a["trained_batches"] + 1) + 1e-6:
            return FAIL, name, (f"{over:g} batch(es) dropped for overflow to train {a['trained_batches']}: more than "
                                f"async_training.queue_size={qsize} per trained batch (the producer was not throttled)")
    return PASS, name, (f"{a['final_dropped_stale']} stale and {a['final_dropped_overflow']} overflow row(s) dropped "
                        f"and counted; {a['trained_batches']} of {put} queued batch(es) trained")


def _rollout_steps(recs: list) -> tuple[dict, list, list]:
    """``rollout_uids.jsonl`` read in file order: ``(the record of each step that stands, the resume
    markers, the steps recorded twice with no resume between)``. A resume marker
    ``{"resume": {"restored_step": c}}`` (written by ``--resume``) supersedes the records of steps
    after ``c`` written before it: their updates were lost with the process that trained them."""
    by_step: dict[int, dict] = {}
    resumes, twice = [], []
    for rec in recs:
        if isinstance(rec.get("resume"), dict):
            c = int(rec["resume"].get("restored_step", -1))
            resumes.append(rec["resume"])
            by_step = {k: v for k, v in by_step.items() if k <= c}
            continue
        step = int(rec["step"])
        if step in by_step:
            twice.append(step)
        by_step[step] = rec
    return by_step, resumes, twice


def _cursors(num_examples: int, batch: int, batches: int) -> list[tuple[int, int]]:
    """The data iterator's ``(epoch, position)`` after each of the first ``batches`` training batches
    of the data order (``rljax.data.PromptIterator`` with ``drop_last``, as ``train_iterator`` builds it)."""
    from rljax.data import PromptIterator  # the data package (~1 s to import) only for an async run's records

    it = PromptIterator(range(num_examples), batch, seed=0, shuffle=False, drop_last=True)
    out = []
    for _ in range(batches):
        it.next_positions()
        st = it.state()
        out.append((st["epoch"], st["position"]))
    return out


def check_every_prompt_trained_once(run: Run) -> Result:
    """Across kills and resumes, every prompt of the data order was trained exactly once, from
    ``rollout_uids.jsonl`` with its resume markers applied (:func:`_rollout_steps`): the steps that
    stand are 1..N, each recorded once; each trained ``data.train_batch_size`` prompts of its own
    batch (uids ``{batch}-{i}``), no uid twice; asynchronous runs: the batches trained and the
    batches the staleness gate or a full queue dropped (``dropped_batches``: counted, not replayed)
    are 1..max once each, and the data position after each trained batch's draw is the data
    order's position after that many batches (so a resume restarted at the oldest untrained batch's
    prompts, not at a later data position)."""
    name = "every prompt trained once"
    f = run.files["rollout_uids.jsonl"]
    if not os.path.exists(f.path):
        return NA, name, "no rollout_uids.jsonl in the run directory"
    filtered = bool(run.config_values.get("algorithm.filter_groups.enable"))
    by_step, resumes, twice = _rollout_steps(f.records)
    if twice:
        return FAIL, name, f"step {twice[0]} recorded twice with no resume between: its prompts were trained twice"
    if not by_step:
        return FAIL, name, "rollout_uids.jsonl has no records"
    steps = sorted(by_step)
    if steps != list(range(1, steps[-1] + 1)):
        missing = sorted(set(range(1, steps[-1] + 1)) - set(steps))
        return FAIL, name, f"step(s) {missing[:5]} have no record: their prompts were lost"
    want = run.config_values.get("data.train_batch_size")
    seen_uids: dict[str, int] = {}
    trained: dict[int, int] = {}  # batch -> step
    dropped: dict[int, str] = {}  # batch -> reason
    cursors = []
    draws: dict[int, int] = {}  # algorithm.filter_groups: batch -> prompt batches it drew
    for step in steps:
        rec = by_step[step]
        batch = int(rec.get("batch_index", step))
        if batch in trained:
            return FAIL, name, f"batch {batch} trained at steps {trained[batch]} and {step}"
        trained[batch] = step
        uids = [u for us in rec["by_process"].values() for u in us]
        if want is not None and len(set(uids)) != want:
            return FAIL, name, f"step {step}: {len(set(uids))} prompt uid(s) trained, data.train_batch_size is {want}"
        for u in uids:
            if not str(u).startswith(f"{batch}-"):
                return FAIL, name, f"step {step}: uid {u} is not a prompt of batch {batch}"
            if u in seen_uids:
                return FAIL, name, f"uid {u} trained at steps {seen_uids[u]} and {step}"
            seen_uids[u] = step
        if filtered and want:  # every prompt the batch drew was trained or dropped with its reason, none lost
            drawn = set(uids) | set(rec.get("dropped") or {})
            count = -(-len(drawn) // int(want))
            if drawn != {f"{batch}-{i}" for i in range(count * int(want))}:
                return FAIL, name, (f"step {step}: the {len(drawn)} uids batch {batch} trained or dropped are not its "
                                    f"{count} prompt batch(es) of data.train_batch_size={want}: a drawn prompt was lost")
            draws[batch] = count
        for reason, index in rec.get("dropped_batches", []):
            dropped.setdefault(int(index), reason)
        if "data_after" in rec:
            cursors.append((batch, step, rec["data_after"]))
    both = sorted(set(trained) & set(dropped))
    if both:
        return FAIL, name, f"batch {both[0]} was dropped ({dropped[both[0]]}) and trained at step {trained[both[0]]}"
    if any("batch_index" in by_step[s] for s in steps):
        top = max(max(trained), max(dropped, default=0))
        gaps = sorted(set(range(1, top + 1)) - set(trained) - set(dropped))
        if gaps:
            return FAIL, name, f"batch(es) {gaps[:5]} neither trained nor counted as dropped: their prompts were lost"
    unknown = 0  # filter_groups: batches whose data position the record cannot tell (after a dropped batch's draws)
    if cursors and want:
        n = cursors[0][2].get("num_examples")
        ends = {b: b for b, _, _ in cursors}  # the prompt batches of the data order drawn up to each batch's end
        if filtered:
            total, ends = 0, {}
            for b in range(1, max(b for b, _, _ in cursors) + 1):
                total = total + draws[b] if b in draws and total is not None else None
                ends[b] = total
            unknown = sum(1 for b, _, _ in cursors if ends[b] is None)
        known = [e for e in ends.values() if e is not None]
        expected = _cursors(int(n), int(want), max(known)) if n and known else None
        for batch, step, cur in cursors:
            if ends[batch] is None:
                continue
            if expected is not None and (cur.get("epoch"), cur.get("position")) != expected[ends[batch] - 1]:
                e = expected[ends[batch] - 1]
                return FAIL, name, (f"step {step}: batch {batch} drew its prompts ending at data position "
                                    f"{cur.get('epoch')}/{cur.get('position')} (epoch/position); the data order's "
                                    f"batch {batch} ends at {e[0]}/{e[1]}"
                                    + (f" (prompt batch {ends[batch]}: dynamic sampling's draws)" if filtered else ""))
    restored = ", ".join(str(r.get("restored_step")) for r in resumes)
    return PASS, name, (f"{len(steps)} step(s), {len(seen_uids)} prompts once each"
                        + (f", {len(dropped)} batch(es) dropped and counted" if dropped else "")
                        + (f", data positions of {len(cursors) - unknown} batch(es) checked" if cursors else "")
                        + (f" ({unknown} after a dropped batch's unrecorded draws not)" if unknown else "")
                        + (f", {sum(draws.values())} prompt batch(es) drawn by dynamic sampling, each prompt "
                           "trained or dropped" if filtered and draws else "")
                        + (f"; {len(resumes)} resume(s) from step(s) {restored}" if resumes else ""))


def check_rollout_unique(run: Run) -> Result:
    """No trajectory generated twice, none missing: in every step's ``rollout_uids.jsonl`` record (the uids
    every process's rows carried, gathered by the learner), each prompt uid (whose ``rollout.n`` sessions one
    process generates) belongs to one process, once, and there are ``data.train_batch_size`` of them."""
    name = "no uid generated twice"
    f = run.files["rollout_uids.jsonl"]
    if not os.path.exists(f.path):
        return NA, name, "no rollout_uids.jsonl in the run directory"
    by_step = _rollout_steps(f.records)[0]  # a resumed run writes its re-run steps again: the last counts
    totals: dict[str, int] = {}
    want = run.config_values.get("data.train_batch_size")
    for step, rec in sorted(by_step.items()):
        owner: dict[str, str] = {}
        for p, uids in rec["by_process"].items():
            totals[p] = totals.get(p, 0) + len(uids)
            for u in uids:
                if u in owner:
                    where = f"processes {owner[u]} and {p}" if owner[u] != p else f"process {p} twice"
                    return FAIL, name, f"step {step}: uid {u} generated by {where}"
                owner[u] = p
        if want is not None and len(owner) != want:
            return FAIL, name, f"step {step}: {len(owner)} prompt uid(s) generated, data.train_batch_size is {want}"
    if not by_step:
        return FAIL, name, "rollout_uids.jsonl has no records"
    counts = ", ".join(f"process {p}: {n}" for p, n in sorted(totals.items()))
    return PASS, name, f"{len(by_step)} step(s), every prompt uid generated once ({counts} uids)"


def check_filtered_groups(run: Run) -> Result:
    """``algorithm.filter_groups``: no uid the dynamic sampling dropped (zero variance, or past the full
    batch) was trained: none is among the step's trained uids (``rollout_uids.jsonl``) or in a
    trace record of the update, and the step's ``train/dropped_groups`` + ``train/excess_groups``
    count them."""
    name = "no dropped group trained (dynamic sampling)"
    if not run.config_values.get("algorithm.filter_groups.enable"):
        return NA, name, "algorithm.filter_groups.enable is false"
    path = os.path.join(run.dir, "rollout_uids.jsonl")
    if not os.path.exists(path):
        return FAIL, name, "no rollout_uids.jsonl in the run directory"
    by_step = _rollout_steps(run.files["rollout_uids.jsonl"].records)[0]
    traced: dict[int, set] = {}
    for r in run.records:
        if r.get("stage") == "actor_minibatch" and "uid" in r:
            traced.setdefault(int(r["step"]), set()).add(str(r["uid"]))
    total = 0
    for step, rec in sorted(by_step.items()):
        if "dropped" not in rec:
            return FAIL, name, f"step {step}: its rollout_uids.jsonl record does not list the dropped uids"
        dropped = rec["dropped"]
        trained = {u for uids in rec["by_process"].values() for u in uids}
        both = sorted(set(dropped) & (trained | traced.get(step, set())))
        if both:
            return FAIL, name, f"step {step}: dropped uid {both[0]} ({dropped[both[0]]}) was trained"
        m = run.metrics.get(step)
        if m is not None and "train/dropped_groups" in m:
            counted = int(m["train/dropped_groups"]) + int(m.get("train/excess_groups", 0))
            if counted != len(dropped):
                return FAIL, name, (f"step {step}: {len(dropped)} uids dropped, train/dropped_groups + "
                                    f"train/excess_groups = {counted}")
        total += len(dropped)
    if not by_step:
        return FAIL, name, "rollout_uids.jsonl has no records"
    return PASS, name, f"{len(by_step)} step(s), {total} dropped group(s), none trained"


def check_files_whole(run: Run) -> Result:
    """The JSON-lines files and the JSON summaries parse: a cut last line (a kill or a full disk
    while writing it) or a damaged line is named here; the other checks read the complete records."""
    name = "record files whole"
    if run.cut:
        return FAIL, name, (f"cut short or unreadable: {'; '.join(run.cut[:4])}{' ...' if len(run.cut) > 4 else ''} "
                            "(a write that did not finish: a full disk or a kill)")
    present = [n for n, f in run.files.items() if os.path.exists(f.path)]
    return PASS, name, ", ".join(f"{n}: {len(run.files[n].records)} records" for n in present) + \
        f"; {SUMMARY_FILE} parses"


CHECKS: tuple[Callable[[Run], Result], ...] = (
    check_files_whole, check_config, check_group_consistency, check_sessions, check_response_len, check_producers,
    check_behaviour_logp, check_masks, check_invariants, check_timestamps, check_padding, check_minibatch,
    check_actor_dp, check_versions, check_token_versions, check_cleanup,
    check_alerts, check_updates, check_summary, check_async_staleness, check_async_future, check_async_drops,
    check_rollout_unique, check_every_prompt_trained_once, check_filtered_groups)


def exit_code(results: list[Result], *, strict: bool = False) -> int:
    """1 when a check failed (or, ``strict``, warned), else 0."""
    bad = (FAIL, WARN) if strict else (FAIL,)
    return 1 if any(r[0] in bad for r in results) else 0


def run_checks(run_dir: str) -> list[Result]:
    try:
        run = Run(run_dir)
    except Exception as e:  # e.g. topology.json or trace_summary.json is not JSON
        return [(FAIL, "run files readable", f"{type(e).__name__}: {e}")]
    out = []
    for check in CHECKS:
        try:
            out.append(check(run))
        except Exception as e:  # a malformed file fails its check, not the tool
            out.append((FAIL, check.__name__.removeprefix("check_"), f"{type(e).__name__}: {e}"))
    return out
