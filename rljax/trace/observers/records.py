"""``trace.jsonl``: for each traced prompt group (:func:`rljax.trace.groups.choose_groups`), one
record per stage in the order the stages ran, plus ``config_resolve`` (first) and ``cleanup``
(last). Each record: ``stage``, ``step``, ``uid``, ``group``, ``keys`` (``{uid}_{session}_{index}``),
``t_start`` / ``t_end`` (Unix seconds), ``reads`` / ``writes`` (field names), ``fields`` (see
:func:`rljax.trace.fields.summarize`; how each field is read comes from the one table of batch
fields, :mod:`rljax.trace.batch_fields`), a shape ``signature`` and the stage's own facts (its
``facts(event, view)``, carried in the stage event: :mod:`rljax.trace.facts`). The ``cleanup``
record lists the ``stages`` the runner ran that step, which ``trace check`` compares each
group's records with."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Callable, Mapping, Optional

import numpy as np

from rljax.config import load_resolved, to_flat_dict
from rljax.trace._io import append_lines, compact_json
from rljax.trace.batch_fields import TRAJECTORY_ARRAYS
from rljax.trace.facts import GroupView
from rljax.trace.fields import (MASK_FIELDS, PROMPT_FIELDS, RESPONSE_FIELDS, SEQUENCE_FIELDS, VALUE_FIELDS,
                                host_rows, read, summary_of)
from rljax.trace.groups import choose_groups

#: Config keys whose value and source every config_resolve record carries (the seed's list, rljax names).
KEY_CONFIG = ("data.train_batch_size", "data.max_prompt_length", "data.max_response_length",
              "data.filter_overlong_prompts", "data.truncation", "algorithm.adv_estimator",
              "algorithm.use_kl_in_reward", "algorithm.norm_adv_by_std_in_grpo", "algorithm.bypass_mode",
              "actor.ppo_mini_batch_size", "actor.ppo_micro_batch_size", "actor.ppo_epochs", "actor.use_kl_loss",
              "rollout.n", "rollout.tp", "reward.function", "trainer.mesh", "trace.groups", "trainer.mode",
              "rollout.placement", "async_training.max_staleness", "async_training.partial_rollout",
              "algorithm.filter_groups.enable")
TRACE_FILE = "trace.jsonl"


class Records:
    """The traced groups' records of each step, written at the step's cleanup."""

    def __init__(self, cfg, run_dir: str, *, enabled: bool, wall: Callable, writer=None):
        self.cfg, self.run_dir, self.enabled, self.wall = cfg, run_dir, enabled, wall
        self.writer = writer  # rljax.trace.writer.Writer: the records are encoded and appended off the step
        self.path = os.path.join(run_dir, TRACE_FILE)
        self.k = int(cfg.trace.groups)
        self.pending: list[dict] = []  # the step's records, written at its cleanup
        self.count = 0
        self.uids: list[str] = []
        self.last_step: Optional[int] = None  # the newest step whose records are written
        self.config: Optional[dict] = None  # read at the first record: the launcher writes config.resolved.yaml
        # only once the run is built (a refused resume leaves the run's record as it was)
        self.config_written = False

    def step(self, view, row_tokens, metrics: Mapping) -> dict:
        """The traced groups' records of the step (kept for its cleanup); returns their shape
        signatures, ``{uid: {stage: signature}}``. Other processes of a multi-host run write nothing."""
        traj = view.traj
        records, sigs = [], {}
        groups = choose_groups(self.cfg.trainer.seed, view.step, int(traj.num_groups), self.k)
        for g in groups if self.enabled else ():
            recs = self._group(g, view, row_tokens)
            sigs[recs[0]["uid"]] = {r["stage"]: r["signature"] for r in recs}
            records.extend(recs)
        self.pending = records
        return sigs

    def _group(self, g: int, view, row_tokens) -> list[dict]:
        group = _Group(g, view)
        base = {"step": view.step, "uid": group.uid, "group": int(g), "keys": group.keys}
        recs = [self._rec(base, "config_resolve", [], None, None, group.keys, config=self._config_once())]
        facts_view = GroupView(step=view.step, group=int(g), rows=group.rows, key_of=group.key_of, traj=view.traj,
                               fields=view.fields, is_padding=group.g_pad, response_length=group.g_resp,
                               row_tokens=row_tokens, wall=self.wall)
        for ev in view.events:
            facts = ev.facts(ev, facts_view) if ev.facts is not None else {}
            recs.append(self._rec(base, ev.stage, group.fields_of(ev, view.consumers), ev.t_start, ev.t_end,
                                  group.keys, reads=list(ev.reads), writes=list(ev.writes), **facts))
        return recs

    def _rec(self, base, stage, fields, t0, t1, keys, **extra) -> dict:
        r = dict(base, stage=stage, t_start=self.wall(t0), t_end=self.wall(t1), fields=fields, **extra)
        r["signature"] = signature(keys, fields)
        return r

    def cleanup(self, report) -> None:
        """The runner's cleanup report becomes each group's last record; the step's records are written."""
        records, self.pending = self.pending, []
        for uid in dict.fromkeys(r["uid"] for r in records):
            first = next(r for r in records if r["uid"] == uid)
            rec = dict(step=first["step"], uid=uid, group=first["group"], keys=first["keys"], stage="cleanup",
                       t_start=self.wall(report.t_start), t_end=self.wall(report.t_end), reads=[], writes=[],
                       fields=[], stages=list(report.stages), batch_keys=report.batch_keys, tracked_objects=report.tracked,
                       remaining_keys=list(report.leaked), released=not report.leaked)
            rec["signature"] = {"keys": list(first["keys"]), "rows": len(first["keys"]), "batch": None,
                                "resp_len": None, "mask_sum": None}
            records.append(rec)
        if self.enabled and records:  # the records are not changed after this: the writer encodes them
            path = self.path

            def job():
                memo: dict = {}
                for r in records:  # the field summaries are made here, off the step (Summary)
                    for f in r.get("fields") or ():
                        f.complete()
                append_lines(path, "".join(_line(r, memo) for r in records))
            job() if self.writer is None else self.writer.put(job)
        self.count += len(records)
        self.uids.extend(sorted({r["uid"] for r in records}))
        self.last_step = int(report.step)

    # ------------------------------------------------------------------ the config record

    def _config_once(self) -> dict:
        """The key fields' values and sources in the run's first record; the file and hash after."""
        if self.config is None:
            self.config = self._config_facts()
        if not self.config_written:
            self.config_written = True
            return self.config
        return {k: self.config.get(k) for k in ("file", "sha256")}

    def _config_facts(self) -> dict:
        path = os.path.join(self.run_dir, "config.resolved.yaml")
        flat = to_flat_dict(self.cfg)
        facts = {"file": "config.resolved.yaml" if os.path.exists(path) else None,
                 "sha256": hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:16]}
        sources = {}
        if facts["file"]:
            try:
                _, prov = load_resolved(path)
                sources = {k: prov.get(k) for k in KEY_CONFIG}
                # every writer of each key field, in order (default, preset file(s), cli), as the file keeps them
                facts["writers"] = {k: [[src, list(v) if isinstance(v, tuple) else v] for src, v in prov.chain(k)]
                                    for k in KEY_CONFIG}
                facts["fields_not_from_default"] = sum(1 for v in prov.values() if v != "default")
            except Exception as e:  # provenance unreadable: the checker reports it
                facts["error"] = f"{type(e).__name__}: {e}"
        facts["values"] = {k: flat.get(k) for k in KEY_CONFIG}
        facts["sources"] = sources
        return facts


class _Group:
    """One traced group's rows: in this process's trajectories (the sampler's host arrays) and in
    the learner batch (several processes: every process's rows; this process's start at an offset
    that gather_rollout's row facts say)."""

    def __init__(self, g: int, view):
        traj = self.traj = view.traj
        self.B = int(traj.batch_size)
        self.pad = np.asarray(traj.is_padding)
        rows = np.nonzero(np.asarray(traj.group_id) == g)[0]
        self.rows = rows = rows[~self.pad[rows]]
        self.uid = str(traj.uid[rows[0]]) if len(rows) else f"group-{g}"
        self.key_of = {i: f"{traj.uid[i]}_{traj.session[i]}_{traj.index[i]}" for i in rows.tolist()}
        self.keys = list(self.key_of.values())
        self.resp_len, self.prompt_len = np.asarray(traj.response_length), np.asarray(traj.prompt_length)
        self.sampler_mask = np.asarray(traj.response_mask)[rows]
        self.g_rows, self.g_B, self.g_pad, self.g_resp, self.g_prompt = (rows, self.B, self.pad, self.resp_len,
                                                                          self.prompt_len)
        if view.rows_view is not None:
            import jax

            v = view.rows_view
            mine = np.nonzero(np.asarray(v.process) == jax.process_index())[0]
            self.g_rows, self.g_B = rows + (int(mine[0]) if len(mine) else 0), int(v.batch_size)
            self.g_pad, self.g_resp, self.g_prompt = (np.asarray(v.is_padding), np.asarray(v.response_length),
                                                      np.asarray(v.prompt_length))
        # The learner's loss mask as the update consumed it (traced rows only).
        loss_mask = self.loss_mask = view.loss_mask
        self.learner_mask = host_rows(loss_mask, self.g_rows) if loss_mask is not None else None
        # A field read by several stages is summarised once: the same array, producer and consumers give
        # the same summary (the memo holds the array, so its id is not reused while the group lives).
        self._summaries: dict = {}
        self._traj_fields: dict = {}  # (id of trajectories, producer, consumers) -> (it, its arrays' summaries)
        self._sides: dict = {}  # sampler or learner layout -> the traced rows' facts every field of it shares

    def fields_of(self, ev, consumers: Mapping) -> list[dict]:
        """The summaries of the fields a stage read and wrote (the sampler's arrays the table names
        inside ``trajectories``, and every per-row array of the batch)."""
        out = []
        batch = (self.B, self.g_B)
        for name, x in {**ev.reads, **ev.writes}.items():
            if type(x) in _PLAIN:  # a step-level value (no array can be one)
                continue
            producer = ev.producers.get(name, "?")
            if name == "trajectories":
                out.extend(self._trajectory_fields(x, producer, consumers.get("trajectories", [])))
            elif _is_array(x) and x.ndim and x.shape[0] in batch:
                out.append(self.field(name, x, producer, consumers.get(name, [])))
        return out

    def _trajectory_fields(self, traj, producer: str, consumers) -> list:
        """The summaries of the sampler's arrays the table names in ``traj`` (``traj.arrays()`` once:
        several stages read it)."""
        key = (id(traj), producer, tuple(consumers))
        hit = self._traj_fields.get(key)
        if hit is None:
            arrays = traj.arrays() if hasattr(traj, "arrays") else {}
            hit = self._traj_fields[key] = (traj, [self.field(TRAJECTORY_ARRAYS[k], v, producer, consumers)
                                                   for k, v in arrays.items() if k in TRAJECTORY_ARRAYS])
        return hit[1]

    def field(self, name: str, x, producer: str, consumers) -> dict:
        """One field's summary over the group's rows, as the batch-field table says to read it (the
        records share it: read-only)."""
        key = (name, id(x), producer, tuple(consumers))
        hit = self._summaries.get(key)
        if hit is None:
            hit = self._summaries[key] = (x, self._field(name, x, producer, consumers))
        return hit[1]

    def _side(self, sampler: bool) -> dict:
        """The traced rows' facts of one layout (the sampler's host arrays or the learner batch), made
        once and shared by its fields' summaries (read-only): rows, valid lengths, padding flags, and
        the mask sums of the response fields' governing mask."""
        side = self._sides.get(sampler)
        if side is None:
            r, p_len, r_len, is_pad = ((self.rows, self.prompt_len, self.resp_len, self.pad) if sampler else
                                       (self.g_rows, self.g_prompt, self.g_resp, self.g_pad))
            rows = np.asarray(r)
            p, rl = np.asarray(p_len)[rows], np.asarray(r_len)[rows]
            mask = self.sampler_mask if sampler else self.learner_mask
            side = self._sides[sampler] = {
                "r": r, "rows": rows, "pad": None if is_pad is None else np.asarray(is_pad)[rows],
                "valid": {"sequence": p + rl, "response": rl, "prompt": p},
                "mask": None if mask is None else np.asarray(mask),
                "mask_sum": None if mask is None else _mask_sum(np.asarray(mask), len(rows)),
                "memo": {}}  # the writer's: what the fields' summaries derive from the shared facts, made once
        return side

    def _field(self, name: str, x, producer: str, consumers) -> dict:
        sampler = isinstance(x, np.ndarray) and x.shape[0] == self.B  # the learner's fields are device arrays
        side = self._side(sampler)
        rows = side["rows"]
        mask_sum = None
        if name in _MASK:
            if name == "response_mask" and x is self.traj.response_mask:
                mask_rows = self.sampler_mask
            elif not sampler and x is self.loss_mask:  # the consumed loss mask: its rows are read already
                mask_rows = self.learner_mask
            else:
                mask_rows = host_rows(x, side["r"])
            if mask_rows is not None:
                mask_rows = np.asarray(mask_rows)  # host rows (a copy): no reference to the batch kept
                mask_sum = _mask_sum(mask_rows, len(rows))
        elif name in _RESPONSE:
            mask_rows, mask_sum = side["mask"], side["mask_sum"]
        else:
            mask_rows = None
        valid = _VALID.get(name)
        vl = None if valid is None else side["valid"][valid]
        # Read now (the step's arrays are dropped after it); summarised in the writer's job (Summary).
        got = read(x, rows, values=name in _VALUES)
        kind = "sampler" if sampler else "learner"  # whose response width it must have
        light = {"name": name, "shape": list(got.shape), "layout": kind}
        if mask_sum is not None:  # the signature's mask sums (trace check compares them between stages)
            light["mask_sum"] = list(mask_sum)
        # (a partial, not a closure: one object the collector follows, not a function and its nine cells)
        return Summary(light, functools.partial(_finish, name, got, producer, consumers, rows, vl, mask_rows,
                                                side["pad"], kind, side["memo"]))


def _finish(name, got, producer, consumers, rows, valid_length, mask_rows, is_padding, kind, memo) -> dict:
    """A field's whole summary from what the step read (the writer's job; ``memo``: its layout's,
    shared by the group's fields of that layout)."""
    out = summary_of(name, got, producer=producer, consumers=consumers, rows=rows, valid_length=valid_length,
                     mask_rows=mask_rows, is_padding=is_padding, memo=memo)
    out["layout"] = kind
    return out


#: Each field's valid length (the batch-field table's ``valid``), and the columns as sets.
_VALID = {**{n: "sequence" for n in SEQUENCE_FIELDS}, **{n: "response" for n in RESPONSE_FIELDS if n not in
                                                          SEQUENCE_FIELDS},
          **{n: "prompt" for n in PROMPT_FIELDS if n not in SEQUENCE_FIELDS and n not in RESPONSE_FIELDS}}
_MASK, _RESPONSE, _VALUES = frozenset(MASK_FIELDS), frozenset(RESPONSE_FIELDS), frozenset(VALUE_FIELDS)
#: Exact types whose values have no ``shape`` (no instance attributes): the records skip them unasked.
_PLAIN = frozenset({int, float, bool, str, bytes, dict, list, tuple, type(None)})


def _mask_sum(mask_rows: np.ndarray, n: int) -> list[int]:
    """Per traced row, the mask's nonzero entries."""
    m = mask_rows.reshape(n, -1)
    return (m if m.dtype == bool else m != 0).sum(axis=1).tolist()  # a bool sum counts in int64 already


class Summary(dict):
    """A field's summary in a record: at first what the step's own checks read (``name``, ``shape``,
    ``layout``, ``mask_sum``: the signatures and width alerts), made whole by :meth:`complete` in the
    writer's job, before the record is encoded (the rest, :func:`rljax.trace.fields.summary_of`, from
    host copies of the traced rows read during the step: no reference to the step's arrays)."""

    __slots__ = ("_finish",)

    def __init__(self, light: dict, finish: Callable[[], dict]):
        super().__init__(light)
        self._finish: Optional[Callable[[], dict]] = finish

    def complete(self) -> "Summary":
        """The whole summary, in :func:`rljax.trace.fields.summarize`'s key order (once)."""
        finish, self._finish = self._finish, None
        if finish is not None:
            whole = finish()
            self.clear()
            self.update(whole)
        return self


def _line(record: dict, memo: dict) -> str:
    """``record`` as one JSON line; a field summary several records share (a field read by several
    stages is summarised once) is encoded once (``memo``: id of the summary -> its JSON)."""
    fields = record.get("fields")
    if not fields:
        return compact_json(record) + "\n"
    parts = []
    for f in fields:
        text = memo.get(id(f))
        if text is None:
            text = memo[id(f)] = (f, compact_json(f))  # the memo holds f: its id stays its own
        parts.append(text[1])
    head = compact_json({k: v for k, v in record.items() if k != "fields"})
    return f'{head[:-1]},"fields":[{",".join(parts)}]}}\n'


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def signature(keys, fields) -> dict:
    """What must agree between stages for one group: keys, rows, batch size, response length, mask sums."""
    batch, resp, sums = set(), set(), set()
    for f in fields:
        shape = f["shape"]
        if shape:
            batch.add(shape[0])
        if f["name"] in _RESPONSE:
            if len(shape) == 2:
                resp.add(shape[1])
            if "mask_sum" in f:
                sums.add(sum(f["mask_sum"]))
    return {"keys": list(keys), "rows": len(keys), "batch": sorted(batch) or None, "resp_len": sorted(resp) or None,
            "mask_sum": sorted(sums) or None}
