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

``trainer.mode=async`` runs the same stage on the producer thread
(:mod:`rljax.trainer.async_loop` takes the synchronous ``rollout_sessions`` and ``reward``):
a queued batch is a full batch of kept groups, its ``dynamic_sampling`` facts travel with it
through the queue (metrics and the trace's dropped uids at the step that trains it), and the
checkpoint's data position is the iterator's after the batch's last draw.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

#: Host fields with one entry per row (multi-turn episodes add the final turn's text and the turn spans).
ROW_FIELDS = ("uid", "session", "index", "final_text", "turn_spans")


def _row_fields(traj) -> tuple:
    return tuple(k for k in ROW_FIELDS if len(getattr(traj, k, ())) == traj.batch_size)


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
    """One reward report of several scored batches."""
    first = reports[0]
    errors = [r.first_error for r in reports if r.first_error]
    return dataclasses.replace(
        first, num_scored=sum(r.num_scored for r in reports), num_padding=sum(r.num_padding for r in reports),
        errors=sum(r.errors for r in reports), error_uids=sum((tuple(r.error_uids) for r in reports), ()),
        first_error=errors[0] if errors else None, timeouts=sum(r.timeouts for r in reports),
        worker_restarts=sum(r.worker_restarts for r in reports))


def _take(keep, values, traj, real, uids, *, room: int, want: int, metric: str, dropped: dict) -> list:
    """The groups of one generated batch that fill the ``room`` left in the trained batch, in order;
    the others go into ``dropped`` with their reason (zero variance, or the batch was full)."""
    take = []
    for g in range(traj.num_groups):
        if not keep[g]:
            v = np.asarray(values)[(np.asarray(traj.group_id) == g) & real]
            dropped[uids[g]] = f"zero variance: {metric}={float(v[0]) if v.size else 'none'} in all {v.size}"
        elif len(take) < room:
            take.append(g)
        else:
            dropped[uids[g]] = f"excess: the batch was full ({want} groups kept)"
    return take


def filtered_rollout(s, b, *, rollout_fn, score_fn, shape_fn) -> dict:
    """The ``rollout_sessions`` stage with the filter: generate, score, keep, draw again.

    ``rollout_fn(s, b) -> {"trajectories"}``, ``score_fn(s, traj, prompts) -> (scores, report)``
    (the task reward) and ``shape_fn(s, traj, scores) -> scores`` (the overlong penalty) are the
    step's own. Returns the trained ``trajectories``, its ``prompts`` and ``uids``, and
    ``dynamic_sampling``: the kept scores and merged reward report (for the ``reward``
    stage), the counts and every dropped uid with its reason (for the trace).
    """
    from rljax.reward import groups_to_keep

    fg = s.cfg.algorithm.filter_groups
    want = s.cfg.data.train_batch_size
    step, prompts, uids = b["step"], list(b["prompts"]), list(b["uids"])
    parts, kept_prompts, kept_uids, kept_scores, reports = [], [], [], [], []
    dropped: dict[str, str] = {}
    kept = zero_var = excess = batches = 0
    while True:
        batches += 1
        traj = rollout_fn(s, dict(b, prompts=prompts, uids=uids))["trajectories"]
        task, report = score_fn(s, traj, prompts)
        shaped = shape_fn(s, traj, task)
        reports.append(report)
        real = ~np.asarray(traj.is_padding)
        values = task if fg.metric == "acc" else shaped
        keep, std = groups_to_keep(values, traj.group_id, traj.num_groups, real=real)
        take = _take(keep, values, traj, real, uids, room=want - kept, want=want, metric=fg.metric, dropped=dropped)
        zero_var += int((~np.asarray(keep, bool)).sum())
        excess += int(np.asarray(keep, bool).sum()) - len(take)
        if take:
            part = take_groups(traj, take)
            parts.append(part)
            kept_prompts += [prompts[g] for g in take]
            kept_uids += [uids[g] for g in take]
            rows = np.concatenate([np.flatnonzero(np.asarray(traj.group_id) == g) for g in take])
            kept_scores.append(np.asarray(shaped, np.float32)[rows])
            kept += len(take)
        if kept >= want:
            break
        if fg.max_num_gen_batches and batches >= fg.max_num_gen_batches:
            raise RuntimeError(f"step {step}: {kept} of data.train_batch_size={want} prompt groups kept after "
                               f"{batches} prompt batches (algorithm.filter_groups.max_num_gen_batches="
                               f"{fg.max_num_gen_batches}; {zero_var} groups had zero {fg.metric} variance): the data "
                               "are too easy or too hard for the filter; raise max_num_gen_batches (0: no limit)")
        prompts = list(next(s.rollout.prompts))
        uids = [f"{step}-{batches * want + i}" for i in range(len(prompts))]
        # the next draw's weights: the learner's in the synchronous step; in trainer.mode=async with
        # partial_rollout the producer may have installed a push during the last draw
        b = dict(b, weight_version=int(s.rollout.sampler.version))
    return {"trajectories": concat(parts), "prompts": kept_prompts, "uids": kept_uids,
            "dynamic_sampling": {"scores": np.concatenate(kept_scores), "reward_report": merge_reports(reports),
                                 "num_gen_batches": batches, "kept_groups": kept, "dropped_groups": zero_var,
                                 "excess_groups": excess, "dropped": dropped}}


def metrics(facts: dict) -> dict:
    """``train/num_gen_batches`` (verl's name), ``train/kept_groups``, ``train/dropped_groups`` (zero
    variance), ``train/excess_groups`` (kept, but past the full batch)."""
    return {f"train/{k}": int(facts[k]) for k in ("num_gen_batches", "kept_groups", "dropped_groups", "excess_groups")}
