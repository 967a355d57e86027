"""Checks of the prompts across the run (``rollout_uids.jsonl``): every prompt generated once and
trained once across kills and resumes, and no group dynamic sampling dropped trained."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from rljax.trace.checks.base import FAIL, NA, PASS, Result, Run


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


def _cursors(num_examples: int, batch, batches: int) -> list[tuple[int, int]]:
    """The data iterator's ``(epoch, position)`` after each of the first ``batches`` training batches
    of the data order (``rljax.data.PromptIterator`` with ``drop_last``, as ``train_iterator`` builds it);
    ``batch``: the prompts per batch, or a function of the batch index (a resume changed it)."""
    from rljax.data import PromptIterator  # the data package (~1 s to import) only for an async run's records

    size = batch if callable(batch) else (lambda _b: batch)
    it = PromptIterator(range(num_examples), int(size(1)), seed=0, shuffle=False, drop_last=True)
    out = []
    for b in range(1, batches + 1):
        it.batch_size = int(size(b))  # a restored iterator draws the resumed run's batch size
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
    def want(step):  # the batch size the step ran with (a resume may change it)
        return run.at(step).config_values.get("data.train_batch_size")

    b = _Batches()
    wrong = b.read(by_step, want, filtered) or b.accounted(by_step) or b.positions(want, filtered)
    if wrong:
        return FAIL, name, wrong
    restored = ", ".join(str(r.get("restored_step")) for r in resumes)
    return PASS, name, (f"{len(steps)} step(s), {len(b.seen_uids)} prompts once each"
                        + (f", {len(b.dropped)} batch(es) dropped and counted" if b.dropped else "")
                        + (f", data positions of {len(b.cursors) - b.unknown} batch(es) checked" if b.cursors else "")
                        + (f" ({b.unknown} after a dropped batch's unrecorded draws not)" if b.unknown else "")
                        + (f", {sum(b.draws.values())} prompt batch(es) drawn by dynamic sampling, each prompt "
                           "trained or dropped" if filtered and b.draws else "")
                        + (f"; {len(resumes)} resume(s) from step(s) {restored}" if resumes else ""))


@dataclasses.dataclass
class _Batches:
    """What the standing steps of ``rollout_uids.jsonl`` trained, batch by batch; each method
    returns the first inconsistency it finds (one line), or None."""

    seen_uids: dict = dataclasses.field(default_factory=dict)  # uid -> step
    trained: dict = dataclasses.field(default_factory=dict)  # batch -> step
    dropped: dict = dataclasses.field(default_factory=dict)  # batch -> reason
    cursors: list = dataclasses.field(default_factory=list)  # (batch, step, data position after its draw)
    draws: dict = dataclasses.field(default_factory=dict)  # algorithm.filter_groups: batch -> prompt batches drawn
    unknown: int = 0  # filter_groups: batches whose data position the record cannot tell

    def read(self, by_step: dict, want_at, filtered: bool) -> Optional[str]:
        """Each step trained ``want_at(step)`` prompts of its own batch, no uid twice, no batch twice."""
        for step in sorted(by_step):
            rec, want = by_step[step], want_at(step)
            batch = int(rec.get("batch_index", step))
            if batch in self.trained:
                return f"batch {batch} trained at steps {self.trained[batch]} and {step}"
            self.trained[batch] = step
            uids = [u for us in rec["by_process"].values() for u in us]
            if want is not None and len(set(uids)) != want:
                return f"step {step}: {len(set(uids))} prompt uid(s) trained, data.train_batch_size is {want}"
            for u in uids:
                if not str(u).startswith(f"{batch}-"):
                    return f"step {step}: uid {u} is not a prompt of batch {batch}"
                if u in self.seen_uids:
                    return f"uid {u} trained at steps {self.seen_uids[u]} and {step}"
                self.seen_uids[u] = step
            if filtered and want:  # every prompt the batch drew was trained or dropped with its reason, none lost
                drawn = set(uids) | set(rec.get("dropped") or {})
                count = -(-len(drawn) // int(want))
                if drawn != {f"{batch}-{i}" for i in range(count * int(want))}:
                    return (f"step {step}: the {len(drawn)} uids batch {batch} trained or dropped are not its "
                            f"{count} prompt batch(es) of data.train_batch_size={want}: a drawn prompt was lost")
                self.draws[batch] = count
            for reason, index in rec.get("dropped_batches", []):
                self.dropped.setdefault(int(index), reason)
            if "data_after" in rec:
                self.cursors.append((batch, step, rec["data_after"]))
        return None

    def accounted(self, by_step: dict) -> Optional[str]:
        """No batch both dropped and trained; asynchronous runs: batches 1..max each trained or dropped."""
        both = sorted(set(self.trained) & set(self.dropped))
        if both:
            return f"batch {both[0]} was dropped ({self.dropped[both[0]]}) and trained at step {self.trained[both[0]]}"
        if any("batch_index" in rec for rec in by_step.values()):
            top = max(max(self.trained), max(self.dropped, default=0))
            gaps = sorted(set(range(1, top + 1)) - set(self.trained) - set(self.dropped))
            if gaps:
                return f"batch(es) {gaps[:5]} neither trained nor counted as dropped: their prompts were lost"
        return None

    def positions(self, want, filtered: bool) -> Optional[str]:
        """The data position after each trained batch's draw is the data order's after that many
        prompt batches (with dynamic sampling: the prompt batches drawn so far, when known);
        ``want(step)``: the prompts per batch."""
        if not (self.cursors and want(self.cursors[0][1])):
            return None
        n = self.cursors[0][2].get("num_examples")
        ends = {b: b for b, _, _ in self.cursors}  # the prompt batches of the data order drawn up to each batch's end
        if filtered:
            total, ends = 0, {}
            for b in range(1, max(b for b, _, _ in self.cursors) + 1):
                total = total + self.draws[b] if b in self.draws and total is not None else None
                ends[b] = total
            self.unknown = sum(1 for b, _, _ in self.cursors if ends[b] is None)
        known = [e for e in ends.values() if e is not None]
        expected = _cursors(int(n), want, max(known)) if n and known else None
        for batch, step, cur in self.cursors:
            if ends[batch] is None or expected is None:
                continue
            e = expected[ends[batch] - 1]
            if (cur.get("epoch"), cur.get("position")) != e:
                return (f"step {step}: batch {batch} drew its prompts ending at data position "
                        f"{cur.get('epoch')}/{cur.get('position')} (epoch/position); the data order's "
                        f"batch {batch} ends at {e[0]}/{e[1]}"
                        + (f" (prompt batch {ends[batch]}: dynamic sampling's draws)" if filtered else ""))
        return None


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
    for step, rec in sorted(by_step.items()):
        want = run.at(step).config_values.get("data.train_batch_size")  # the settings the step ran with
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
