"""DAPO dynamic sampling (``algorithm.filter_groups``), the host loop of the synchronous step.

The ``rollout_sessions`` stage of a step with the filter on generates the step's prompt
batch, scores it, keeps the groups :func:`rljax.reward.groups_to_keep` keeps, and while
fewer than ``data.train_batch_size`` groups are kept draws the next prompt batch from the
data iterator and does the same (verl's ``RayDAPOTrainer.fit``). The last batch's kept groups
beyond the batch size are dropped too (``excess``), as verl's ``batch[:traj_bsz]`` does; at
``max_num_gen_batches`` batches without a full batch the step stops with an error, as
verl's (0: no limit). The trained batch is the kept groups in the order they were
generated, group ids renumbered; uids keep ``{step}-{index}`` with the index running on
over the extra batches, so every prompt's uid (and random stream) is its own.

The ``reward`` stage then places the scores computed here (no second scoring). Every
draw goes through the data iterator, whose position the checkpoint records after the step,
so a resumed run draws exactly what the uninterrupted one would.

Multi-turn runs (``env.function``) filter whole episodes the same way, scored by the
episode reward (:func:`rljax.env.episode_scores`); a rollout's episode totals (tool calls,
turns, tool seconds) count every draw's episodes, dropped ones included: the work done.

Several processes (synchronous mode): every process draws every batch and generates and scores
its share (``s.rollout.share``); the processes all-gather each group's keep flag per draw, so
they keep the one-process run's groups, draw the same batches and stop together; the kept
groups are then exchanged (:func:`exchange`) so each process trains its share of the
one-process batch. The kept scores travel with the digests of the tokens they were computed
for (the trace's reward tie, ``scored_rows``). Multi-turn episodes split the same way: each
process runs its share of every draw's episodes, and the exchange moves their per-row fields
too (roles, turn counts, tool facts; the final text and turn spans as JSON).

``trainer.mode=async`` with ``async_training.streaming=false`` runs the same stage on the producer
thread (:mod:`rljax.trainer.producers.batched` runs the synchronous ``rollout_sessions`` and ``reward``);
with streaming (the default) the producer scores each group as it completes and fills the batch
by the same rule and the same draws (the functions at the end of this module):
a queued batch is a full batch of kept groups, its ``dynamic_sampling`` facts travel with it
through the queue (metrics and the trace's dropped uids at the step that trains it), and the
checkpoint's data position is the iterator's after the batch's last draw. On one process only:
the producer threads run no collective beside the learner's
(:func:`rljax.trainer.distribute.check_async_share`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from rljax.errors import RunError
from rljax.reward import filter_values, groups_to_keep, merge_extras

#: Host fields with one entry per row (multi-turn episodes add the final turn's text and the turn spans).
ROW_FIELDS = ("uid", "session", "index", "final_text", "turn_spans")


def _row_fields(traj) -> tuple:
    return tuple(k for k in ROW_FIELDS if hasattr(traj, k) and len(getattr(traj, k)) == traj.batch_size)


def take_groups(traj, groups) -> Any:
    """The rows of ``groups`` (group ids, in this order) of a rollout, group ids renumbered ``0..``."""
    groups = [int(g) for g in groups]
    gid = np.asarray(traj.group_id)
    rows = np.concatenate([np.flatnonzero(gid == g) for g in groups]) if groups else np.zeros(0, int)
    new_id = {g: i for i, g in enumerate(groups)}
    arrays = {k: np.asarray(v)[rows] for k, v in traj.arrays().items()}
    arrays["group_id"] = np.array([new_id[int(g)] for g in gid[rows]], np.int32)
    host = {k: tuple(getattr(traj, k)[r] for r in rows) for k in _row_fields(traj)}
    return traj.replace(**arrays, **host, num_groups=len(groups))


def concat(parts: list) -> Any:
    """One rollout of several (same decode, same response width): prompts left-padded to the
    widest, group ids offset, host keys joined, generation stats summed."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    width = max(p.prompt_ids.shape[1] for p in parts)
    arrays, offset = {}, 0
    for k in first.arrays():
        vals = []
        for p in parts:
            v = np.asarray(getattr(p, k))
            if k in ("prompt_ids", "prompt_mask") and v.shape[1] < width:
                fill = p.pad_id if k == "prompt_ids" else False
                v = np.pad(v, ((0, 0), (width - v.shape[1], 0)), constant_values=fill)
            vals.append(v)
        arrays[k] = np.concatenate(vals, axis=0)
    ids = []
    for p in parts:
        ids.append(np.asarray(p.group_id) + offset)
        offset += p.num_groups
    arrays["group_id"] = np.concatenate(ids).astype(np.int32)
    host = {k: sum((tuple(getattr(p, k)) for p in parts), ()) for k in _row_fields(first)}
    if getattr(first, "episode", ()):  # multi-turn totals (tool calls, turns, seconds): of every draw
        host["episode"] = _merge_totals([dict(p.episode) for p in parts])
    stats = first.stats
    if dataclasses.is_dataclass(stats):
        sums = {f.name: sum(getattr(p.stats, f.name) for p in parts) for f in dataclasses.fields(stats)
                if f.name in ("wall_s", "prefill_s", "decode_s", "weight_sync_s", "generated_tokens", "prefill_calls",
                              "prefill_rows", "decode_chunks")}
        stats = dataclasses.replace(stats, **sums)
    return first.replace(**arrays, **host, num_groups=offset, stats=stats)


def _merge_totals(totals: list) -> tuple:
    """Sorted ``(name, value)`` items: numbers summed over the draws, anything else the first draw's."""
    out = dict(totals[0])
    for t in totals[1:]:
        for k, v in t.items():
            num = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
            out[k] = out.get(k, 0) + v if num and k in out else out.get(k, v)
    return tuple(sorted(out.items()))


def merge_reports(reports: list):
    """One reward report of several scored batches (a dict's extras over every batch's rows)."""
    first = reports[0]
    errors = [r.first_error for r in reports if r.first_error]
    return dataclasses.replace(
        first, num_scored=sum(r.num_scored for r in reports), num_padding=sum(r.num_padding for r in reports),
        errors=sum(r.errors for r in reports), error_uids=sum((tuple(r.error_uids) for r in reports), ()),
        first_error=errors[0] if errors else None, timeouts=sum(r.timeouts for r in reports),
        worker_restarts=sum(r.worker_restarts for r in reports),
        **merge_extras([r.extras_record() for r in reports]))


def _group_facts(keep, values, traj, real) -> dict:
    """Per group of one generated rollout: ``keep``, the first real row's metric value and the
    number of real rows (what a dropped group's reason names)."""
    gid, values = np.asarray(traj.group_id), np.asarray(values, np.float64)
    first, count = np.zeros(traj.num_groups, np.float64), np.zeros(traj.num_groups, np.int32)
    for g in range(traj.num_groups):
        v = values[(gid == g) & real]
        count[g] = v.size
        first[g] = v[0] if v.size else np.nan
    return {"keep": np.asarray(keep, bool), "first": first, "count": count}


def _take(facts: dict, uids, *, room: int, want: int, metric: str, dropped: dict) -> list:
    """The groups of one generated prompt batch (``facts`` per group, batch order) that fill the
    ``room`` left in the trained batch, in order; the others go into ``dropped`` with their
    reason (zero variance, or the batch was full)."""
    take = []
    for g, keep in enumerate(facts["keep"]):
        if not keep:
            c = int(facts["count"][g])
            dropped[uids[g]] = f"zero variance: {metric}={float(facts['first'][g]) if c else 'none'} in all {c}"
        elif len(take) < room:
            take.append(g)
        else:
            dropped[uids[g]] = f"excess: the batch was full ({want} groups kept)"
    return take


def filtered_rollout(s, b, *, rollout_fn, score_fn, shape_fn, digest_fn) -> dict:
    """The ``rollout_sessions`` stage with the filter: generate, score, keep, draw again.

    ``rollout_fn(s, b) -> {"trajectories"}``, ``score_fn(s, traj, prompts) -> (scores, report)``
    (the task reward) and ``shape_fn(s, traj, scores) -> scores`` (the overlong penalty) are the
    step's own; ``digest_fn(traj) -> [B]`` the per-row digest of the response tokens. Returns the
    trained ``trajectories``, its ``prompts`` and ``uids``, and ``dynamic_sampling``: the kept
    scores with the digests of the rows they were computed for (the trace's reward tie) and the
    merged reward report (for the ``reward`` stage), the counts and every dropped uid with its
    reason (for the trace).

    With several processes (``s.rollout.share``) each draw is the whole prompt batch; each
    process generates and scores its share of it, and the processes all-gather every group's
    keep flag (one small collective per draw), so every process takes the same groups, counts
    the same, draws the same number of batches and stops together: the kept groups are the
    one-process run's. After the last draw the kept groups are exchanged (:func:`exchange`) so
    each process holds its share of the one-process batch.
    """
    fg = s.cfg.algorithm.filter_groups
    want, share, step = s.cfg.data.train_batch_size, s.rollout.share, b["step"]
    multi = share.processes > 1
    # the whole batch's prompts and uids (each process draws every batch; it generates its share)
    prompts = list(b["batch_prompts"]) if multi else list(b["prompts"])
    uids = [f"{step}-{i}" for i in range(len(prompts))] if multi else list(b["uids"])
    acc = _Kept()
    while True:
        acc.batches += 1
        lo, hi = (share.lo, share.hi) if multi else (0, len(prompts))
        traj = rollout_fn(s, dict(b, prompts=prompts[lo:hi], uids=uids[lo:hi]))["trajectories"]
        task, report = score_fn(s, traj, prompts[lo:hi])
        shaped = shape_fn(s, traj, task)
        acc.reports.append(report)
        facts = _draw_facts(traj, filter_values(fg.metric, task, shaped, report), share)  # acc: a dict's (issue 38)
        take = _take(facts, uids, room=want - acc.kept, want=want, metric=fg.metric, dropped=acc.dropped)
        acc.add(traj, facts, take, prompts, uids, shaped, digest_fn(traj), share, lo, hi)
        if acc.kept >= want:
            break
        if fg.max_num_gen_batches and acc.batches >= fg.max_num_gen_batches:
            raise too_few_kept(step, acc.kept, acc.batches, acc.zero_var, want=want, fg=fg)
        prompts = list(next(s.rollout.prompts))
        uids = [f"{step}-{acc.batches * want + i}" for i in range(len(prompts))]
        # the next draw's weights: the learner's in the synchronous step; in trainer.mode=async with
        # partial_rollout the producer may have installed a push during the last draw
        b = dict(b, weight_version=int(s.rollout.sampler.version))
    return acc.result(share)


def _draw_facts(traj, values, share) -> dict:
    """Every group's keep flag and facts of one draw; with several processes every process's
    groups, in batch order, so the processes agree on what is kept."""
    real = ~np.asarray(traj.is_padding)
    keep, _ = groups_to_keep(values, traj.group_id, traj.num_groups, real=real)
    facts = _group_facts(keep, values, traj, real)
    if share.processes > 1:
        from rljax.trainer.distribute import allgather  # JAX: only several processes agree on the groups

        facts = allgather(facts, share)
    return facts


@dataclasses.dataclass
class _Kept:
    """What :func:`filtered_rollout` kept over a step's draws, and its counts."""

    groups: list = dataclasses.field(default_factory=list)  # (prompt, uid, owner process) of each kept group
    draws: list = dataclasses.field(default_factory=list)  # (rows generated here, their scores, digests) a draw
    reports: list = dataclasses.field(default_factory=list)
    dropped: dict = dataclasses.field(default_factory=dict)
    zero_var: int = 0
    excess: int = 0
    batches: int = 0

    @property
    def kept(self) -> int:
        return len(self.groups)

    def add(self, traj, facts, take, prompts, uids, shaped, digests, share, lo, hi) -> None:
        """Keeps groups ``take`` (batch indices) of a draw; this process's rows ``[lo, hi)``."""
        self.zero_var += int((~facts["keep"]).sum())
        self.excess += int(facts["keep"].sum()) - len(take)
        self.groups += [(prompts[g], uids[g], _owner(g, share)) for g in take]
        mine = [g - lo for g in take if lo <= g < hi]
        rows = [np.flatnonzero(np.asarray(traj.group_id) == g) for g in mine]
        rows = np.concatenate(rows) if rows else np.zeros(0, int)
        # every draw's part, none kept included: its generation work counts in the rollout's stats;
        # the digests are of the tokens scored, where scored
        self.draws.append((take_groups(traj, mine), np.asarray(shaped, np.float32)[rows],
                           np.asarray(digests, np.uint32)[rows]))

    def result(self, share) -> dict:
        """The stage's outputs: each process's share of the one-process batch, whoever generated it."""
        parts, scores, digests = zip(*self.draws)
        traj, scored = concat(list(parts)), {"scores": np.concatenate(scores), "digest": np.concatenate(digests)}
        prompts, uids, owners = (list(x) for x in zip(*self.groups)) if self.groups else ([], [], [])
        if share.processes > 1:
            traj, scored = exchange(traj, scored, uids, owners, share)
            prompts, uids = prompts[share.lo:share.hi], uids[share.lo:share.hi]
        return {"trajectories": traj, "prompts": prompts, "uids": uids,
                "dynamic_sampling": {"scores": scored["scores"], "scored_rows": scored,
                                     "reward_report": merge_reports(self.reports),
                                     "num_gen_batches": self.batches, "kept_groups": self.kept,
                                     "dropped_groups": self.zero_var, "excess_groups": self.excess,
                                     "dropped": self.dropped}}


def _owner(g: int, share) -> int:
    """The process that generates group ``g`` of a drawn prompt batch."""
    per = share.num_prompts // share.processes
    return next(q for q, lo in enumerate(share.starts) if lo <= g < lo + per)


def exchange(traj, scored: dict, kept_uids: list, owners: list, share):
    """Several processes: this process's share (``[share.lo, share.hi)`` of the trained batch's
    groups, the one-process layout) of the kept groups, gathered from the processes that
    generated them. ``traj`` / ``scored`` (per-row ``scores`` and ``digest``): the kept groups
    this process generated (in trained order), ``kept_uids`` / ``owners``: every trained
    group's uid and generating process. Returns ``(trajectories, scored)``.

    One all-gather of the kept rows (token arrays, multi-turn episodes' per-row arrays, scores,
    session / index keys: :func:`~rljax.trainer.distribute.allgather_blocks`), one of the prompt
    width, and for multi-turn episodes their per-row host fields (final text, turn spans) as JSON
    (:func:`~rljax.trainer.distribute.allgather_texts`): the cost of the filter's agreement beyond
    the per-draw keep flags. ``stats`` and the episode totals (``episode``) stay this process's own
    (its generation work, every draw; ``gather_rollout`` sums the tool counts over processes)."""
    from rljax.trainer.distribute import allgather_blocks, allgather_texts, per_process  # JAX: several processes

    n = share.n
    counts = [owners.count(q) for q in range(share.processes)]
    if traj.batch_size != counts[share.process] * n:
        raise RuntimeError(f"process {share.process} kept {traj.batch_size} rows, expected {counts[share.process]} "
                           f"groups x rollout.n={n} (dynamic sampling over processes needs n rows per group)")
    width = int(per_process(np.array([traj.prompt_ids.shape[1]], np.int32)).max())
    local = dict(traj.arrays(), scores=np.asarray(scored["scores"], np.float32),
                 digest=np.asarray(scored["digest"], np.uint32),
                 session=np.asarray(traj.session, np.int32), index=np.asarray(traj.index, np.int32))
    for k in ("prompt_ids", "prompt_mask"):  # left-padded to the widest prompt of any process
        v = local[k]
        local[k] = np.pad(v, ((0, 0), (width - v.shape[1], 0)), constant_values=traj.pad_id if k == "prompt_ids" else 0)
    every = allgather_blocks(local, share)  # every process's kept rows, in process-index order
    # multi-turn episodes: the final turn's text and the turn spans of every process's kept rows, same order
    texts = {k: allgather_texts([json.dumps(v) for v in getattr(traj, k)], share)
             for k in _row_fields(traj) if k not in ("uid", "session", "index")}
    start = np.concatenate([[0], np.cumsum(counts)[:-1]]) * n  # each process's first row there
    picks, seen = [], [0] * share.processes
    for q in owners:
        picks.append((q, seen[q]))
        seen[q] += 1
    mine = picks[share.lo:share.hi]
    take = np.concatenate([np.arange(start[q] + j * n, start[q] + (j + 1) * n) for q, j in mine]) if mine else \
        np.zeros(0, int)
    rows = {k: v[take] for k, v in every.items()}
    host = {k: tuple(_frozen(json.loads(t[i])) for i in take) for k, t in texts.items()}
    out_scored = {"scores": rows.pop("scores"), "digest": rows.pop("digest")}
    session, index = rows.pop("session"), rows.pop("index")
    rows["group_id"] = np.repeat(np.arange(len(mine), dtype=np.int32), n)
    uids = tuple(u for u in kept_uids[share.lo:share.hi] for _ in range(n))
    return traj.replace(**rows, **host, uid=uids, session=tuple(int(x) for x in session),
                        index=tuple(int(x) for x in index), num_groups=len(mine)), out_scored


def _frozen(v):
    """A JSON value back as the host field held it: lists as tuples (turn spans: ``((start, end, role), ...)``)."""
    return tuple(_frozen(x) for x in v) if isinstance(v, list) else v


def metrics(facts: dict) -> dict:
    """``train/num_gen_batches`` (verl's name), ``train/kept_groups``, ``train/dropped_groups`` (zero
    variance), ``train/excess_groups`` (kept, but past the full batch)."""
    return {f"train/{k}": int(facts[k]) for k in ("num_gen_batches", "kept_groups", "dropped_groups", "excess_groups")}


# ---------------------------------------------------------------------------- streaming admission
# (trainer.mode=async with async_training.streaming: rljax.trainer.producers.filtered.Filtered)


def group_facts(traj, values) -> dict:
    """Every group's keep flag (:func:`rljax.reward.groups_to_keep`, the synchronous rule), its
    first real row's metric value and its number of real rows, of one process's rollout (e.g. the
    groups of a streamed prompt batch that completed in one round)."""
    real = ~np.asarray(traj.is_padding)
    keep, _ = groups_to_keep(values, traj.group_id, traj.num_groups, real=real)
    return _group_facts(keep, values, traj, real)


def streamed_rollout(draws: list, *, want: int, metric: str, share) -> dict:
    """The ``rollout_sessions`` outputs of a batch whose prompt batches (draws) were generated by
    a streaming producer and scored group by group as each group completed: the kept groups, the
    dropped uids with their reasons and the counts, exactly as :func:`filtered_rollout` accounts
    for the same draws (the first ``want`` kept groups in draw and group order; kept groups past
    them are ``excess``). ``draws``: per draw, in data order, a dict of ``traj`` (the whole draw),
    ``facts`` (:func:`group_facts` over the draw's groups, batch order), ``shaped`` and ``digests``
    (``[B]``, the scores placed and the digest of the tokens they were computed for), ``report``,
    ``prompts`` and ``uids``. One process (``share.processes == 1``)."""
    acc = _Kept()
    for d in draws:
        acc.batches += 1
        acc.reports.append(d["report"])
        take = _take(d["facts"], d["uids"], room=want - acc.kept, want=want, metric=metric, dropped=acc.dropped)
        acc.add(d["traj"], d["facts"], take, d["prompts"], d["uids"], d["shaped"], d["digests"], share, 0,
                len(d["prompts"]))
    return acc.result(share)


def fill_state(draws: list, want: int) -> tuple[bool, int, int, int]:
    """Where a streamed batch stands: ``(full, kept, open, zero_var)``. ``draws``: per draw, in data
    order, the keep flag of each group (``None`` while undecided). ``full``: the first ``want``
    kept groups in order are decided (no undecided group before the ``want``-th kept one);
    ``kept``: groups decided kept; ``open``: undecided groups; ``zero_var``: decided dropped. A
    further draw is needed only when ``kept + open < want`` (even if every undecided group is kept,
    the batch stays short): then, and only then, the synchronous filter draws again, so the draws
    are the synchronous ones."""
    kept = opened = zero = 0
    counted, blocked, full = 0, False, False
    for keep in draws:
        for k in keep:
            if k is None:
                opened += 1
                blocked = True
            elif k:
                kept += 1
                if not blocked:
                    counted += 1
                    full = full or counted >= want
            else:
                zero += 1
    return full, kept, opened, zero


def too_few_kept(step: int, kept: int, batches: int, zero_var: int, *, want: int, fg) -> RunError:
    """The error at ``max_num_gen_batches`` draws without a full batch (:func:`filtered_rollout`,
    the streaming producer)."""
    return RunError(f"step {step}: {kept} of data.train_batch_size={want} prompt groups kept after "
                        f"{batches} prompt batches (algorithm.filter_groups.max_num_gen_batches="
                        f"{fg.max_num_gen_batches}; {zero_var} groups had zero {fg.metric} variance): the "
                        "data are too easy or too hard for the filter; raise max_num_gen_batches (0: no limit)")
