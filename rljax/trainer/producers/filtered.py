"""Streaming admission with DAPO dynamic sampling (``algorithm.filter_groups``, one process).

A batch is filled with kept groups: as each prompt group's sessions all finish it is scored
(the step's task reward and overlong shaping, :mod:`rljax.trainer.stages.rewarding`) and its
metric's variance checked (:func:`rljax.trainer.dynamic_sampling.group_facts`: the synchronous
rule); the batch is queued once its first ``data.train_batch_size`` kept groups, in draw and
group order, are known and every session of its draws finished
(:func:`~rljax.trainer.dynamic_sampling.streamed_rollout`: the synchronous accounting, dropped
and excess uids with their reasons).

Draws. A batch's prompt batches come from the data iterator in order and stay contiguous: a
further prompt batch is drawn for it only when even keeping every undecided group would leave
it short (:func:`~rljax.trainer.dynamic_sampling.fill_state`) -- as soon as a group is dropped,
not after the whole draw -- and the next batch's first draw only once the batch is full. So
the draws, their uids (``{batch}-{draw * size + i}``) and the data position after a batch are
the synchronous filter's, and a resume restarts at the oldest untrained batch's first draw.
``max_num_gen_batches`` bounds the draws per batch with the synchronous error. A draw's
sessions take free slots while the previous draw's tail decodes; the next batch's prompts take
them while the full batch's excess groups finish, under the staleness gate.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

import numpy as np

from rljax.reward import filter_values
from rljax.trainer import dynamic_sampling as ds
from rljax.trainer.producers.streaming import Drawn, StreamSource
from rljax.trainer.stages import draw_prompts, overlong_shaping, response_digest, task_scores


@dataclasses.dataclass(eq=False)
class _Draw:
    """One prompt batch drawn for a batch being filled (``algorithm.filter_groups``), its groups
    scored as they complete."""

    batch: Any  # its StreamBatch
    prompts: list
    uids: list
    data_after: Any  # the data iterator's position after this draw
    groups: "_Groups"  # its prompt groups as they are scored
    shaped: np.ndarray  # per row: the score placed (task + overlong shaping)
    digests: np.ndarray  # per row: the digest of the tokens scored
    traj: Any = None  # the whole draw, once every session finished

    @property
    def complete(self) -> bool:
        return self.traj is not None and all(k is not None for k in self.groups.keep)


@dataclasses.dataclass(eq=False)
class _Groups:
    """A draw's prompt groups as they are scored (:meth:`Filtered._score`)."""

    keep: list  # per group: None (not yet complete), True, False
    first: np.ndarray  # per group: its first real row's metric value
    count: np.ndarray  # per group: real rows
    reports: dict = dataclasses.field(default_factory=dict)  # group -> its reward report

    @classmethod
    def unscored(cls, num_groups: int) -> "_Groups":
        return cls([None] * num_groups, np.zeros(num_groups, np.float64), np.zeros(num_groups, np.int32))

    def facts(self) -> dict:
        """The keep flags and facts :func:`~rljax.trainer.dynamic_sampling.streamed_rollout` reads."""
        return {"keep": np.asarray(self.keep, bool), "first": self.first, "count": self.count}


@dataclasses.dataclass(eq=False)
class _Filling:
    """A batch being filled with kept groups: its draws, contiguous in the data order."""

    index: int
    draws: list
    t_draw: float
    draw_s: float = 0.0
    marks: tuple = (0, 0)  # the driver's (live slot-steps, slot-steps) when its first draw was submitted


class Filtered(StreamSource):
    """Streaming admission of batches filled with kept groups (see the module docstring)."""

    def __init__(self, services, queue, weights, *, first_index: int):
        super().__init__(services, queue, weights, first_index=first_index)
        cfg = services.cfg
        self.fg, self.want, self.n = cfg.algorithm.filter_groups, int(cfg.data.train_batch_size), int(cfg.rollout.n)
        self._fill: list[_Filling] = []  # batches being filled, oldest first

    def ahead(self, batch) -> int:
        return sum(1 for f in self._fill if f.index < batch.key[0])

    def make_stream(self):
        stream = super().make_stream()
        # the next batch is drawn only once a batch is full, so the queue empties at each batch's tail: a
        # compacted decode state would keep its smaller width for every later batch (the driver never grows)
        stream.driver.compact = False
        return stream

    def maybe_draw(self) -> None:
        if self.stream.driver.waiting:
            return
        f = self._fill[-1] if self._fill else None
        if f is not None:
            full, kept, undecided, zero = ds.fill_state([d.groups.keep for d in f.draws], self.want)
            if not full:
                if kept + undecided >= self.want:
                    return  # the groups in flight may fill it: no further draw yet, the next batch's neither
                if self.fg.max_num_gen_batches and len(f.draws) >= self.fg.max_num_gen_batches:
                    if undecided == 0:
                        raise ds.too_few_kept(f.index, kept, len(f.draws), zero, want=self.want, fg=self.fg)
                    return
                self._draw_for(f)
                return
        self._draw_for(None)

    def _draw_for(self, f: Optional[_Filling]) -> None:
        """A further prompt batch for ``f``, or the first of the next batch."""
        s = self.services
        t = time.perf_counter()
        if f is None:
            d = draw_prompts(s, {"step": self.next_index})
            prompts, uids = d["prompts"], d["uids"]
            f = _Filling(self.next_index, [], t, marks=(self.stream.driver.live_slot_steps, self.stream.driver.slot_steps))
            self._fill.append(f)
            self.next_index += 1
        else:
            prompts = list(next(s.rollout.prompts))
            uids = [f"{f.index}-{len(f.draws) * self.want + i}" for i in range(len(prompts))]
        data_after = s.rollout.prompts.state()
        f.draw_s += time.perf_counter() - t
        batch = self.stream.submit((f.index, len(f.draws)), s.rollout.client.submitted(prompts), uids)
        g, rows = len(prompts), len(prompts) * self.n
        f.draws.append(_Draw(batch, list(prompts), list(uids), data_after, _Groups.unscored(g), np.zeros(rows, np.float32),
                             np.zeros(rows, np.uint32)))

    def _score(self, d: _Draw, groups: list) -> None:
        """Scores whole groups of a draw (each on its own, so a draw's merged report is the synchronous one)."""
        s, n = self.services, self.n
        sub = ds.take_groups(d.traj, groups) if d.traj is not None else self.stream.take(d.batch, groups)
        for i, g in enumerate(groups):
            traj, prompts = ds.take_groups(sub, [i]), [d.prompts[g]]
            # the bound applies to the whole draw (decode_round)
            task, report = task_scores(s, traj, prompts, max_error_fraction=1.0)
            shaped = np.asarray(overlong_shaping(s, traj, task), np.float32)
            facts = ds.group_facts(traj, filter_values(self.fg.metric, task, shaped, report))  # acc: a dict's
            d.groups.keep[g], d.groups.first[g], d.groups.count[g] = (bool(facts["keep"][0]), facts["first"][0],
                                                                      facts["count"][0])
            d.shaped[g * n:(g + 1) * n], d.digests[g * n:(g + 1) * n] = shaped, response_digest(traj)
            d.groups.reports[g] = report

    def decode_round(self) -> list:
        draws = {d.batch.key: d for f in self._fill for d in f.draws}
        for batch, traj in self.stream.step():
            draws[batch.key].traj = traj
        for d in draws.values():
            new = [g for g in d.batch.groups_done if d.groups.keep[g] is None]
            if new:
                self._score(d, new)
                if d.complete:  # the reward bound over the whole draw, as the synchronous filter scores it
                    self._report(d).check(self.s_bound)
        items = []
        while self._fill and all(d.complete for d in self._fill[0].draws) and \
                ds.fill_state([d.groups.keep for d in self._fill[0].draws], self.want)[0]:
            items.append(self._complete_filled(self._fill.pop(0)))
        return items

    @property
    def s_bound(self) -> float:
        return float(self.services.cfg.reward.max_error_fraction)

    @staticmethod
    def _report(d: _Draw):
        return ds.merge_reports([d.groups.reports[g] for g in range(len(d.groups.keep))])

    def _complete_filled(self, f: _Filling):
        t_done = time.perf_counter()
        out = ds.streamed_rollout(
            [{"traj": d.traj, "facts": d.groups.facts(),
              "shaped": d.shaped, "digests": d.digests, "report": self._report(d), "prompts": d.prompts,
              "uids": d.uids} for d in f.draws], want=self.want, metric=self.fg.metric, share=self.services.rollout.share)
        drv = self.stream.driver
        steps = drv.slot_steps - f.marks[1]
        first = f.draws[0]
        # the batch's generation: from its first draw's submission to now, its draws overlapping other batches'
        traj = out["trajectories"]
        traj = traj.replace(stats=dataclasses.replace(
            traj.stats, wall_s=t_done - first.batch.t_submit,
            slot_occupancy=(drv.live_slot_steps - f.marks[0]) / steps if steps else float("nan")))
        ahead = sum(d.batch.admitted for g in self._fill for d in g.draws)
        return self.record(f.index, dict(out, trajectories=traj),
                           Drawn(first.prompts, first.uids, first.data_after, f.t_draw, f.draw_s), first.batch.t_submit,
                           t_done, admitted_ahead=ahead, data_after=f.draws[-1].data_after)
