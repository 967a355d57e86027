"""Rollout across processes: which prompts each process generates, and how the learner batch
is assembled from the process-local parts.

With ``P`` processes (multi-host, ``jax.distributed``) each process generates and scores
``train_batch_size / P`` whole prompt groups (all ``rollout.n`` sessions of a prompt stay in
one process, so group advantages see whole groups) with the uids of the one-process run
(``{step}-{index in the batch}``) and so the same ``(seed, uid, session)`` random streams:
the union of what the processes generate is the one-process rollout, and no trajectory is
generated twice.

Which process takes which prompts follows the learner layout (:func:`rollout_share`): when
the learner devices of every process hold one contiguous, group-aligned, equal block of
batch rows (``dp`` across processes, the usual layout), process ``p`` generates exactly the
rows its devices hold and the global arrays are built from the local rows without moving a
token (:func:`assemble`, ``direct``). Otherwise (rows replicated or interleaved across
processes, e.g. ``tp`` spanning hosts) the shares are equal blocks in process order and the
token arrays of the batch are all-gathered before placement (``gathered``).

The learner side needs global facts of every row (lengths, padding, versions, uids) for
metrics and the trace; :func:`gather_rows` all-gathers those per-row scalars, never the
token arrays. The same all-gather carries each row's weight-version spread (``async/version_span_max``)
and a generative judge's verdict scores; :func:`merge_judge_reports` merges the judges' reports
as :func:`merge_reward_reports` merges the reward's, and :func:`gather_records` hands process 0
every process's sample rows (the generations log). On one process every function is the
identity of the one-process code path.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Mapping, Optional

import jax
import numpy as np

from rljax.reward import RewardReport, merge_extras
from rljax.sharding import batch_shardings


@dataclasses.dataclass(frozen=True)
class Share:
    """This process's prompts of a step's batch: ``[lo, hi)`` in batch order (each ``n`` rows).

    ``starts``: the first prompt of every process (by process index); ``direct``: the learner
    devices of each process hold exactly its rows (no token moves between processes).
    """

    process: int
    processes: int
    lo: int
    hi: int
    n: int
    num_prompts: int
    direct: bool
    starts: tuple

    @property
    def row_lo(self) -> int:
        return self.lo * self.n

    @property
    def num_rows(self) -> int:
        return (self.hi - self.lo) * self.n

    def local_bound(self, max_error_fraction: float) -> float:
        """The ``reward.max_error_fraction`` bound a process applies to its own rows: the bound
        itself on one process; with several, none (1.0): it applies to the whole batch, after the
        processes merge their reports (``gather_rollout``, validation), so every process stops
        together."""
        return float(max_error_fraction) if self.processes == 1 else 1.0

    def describe(self) -> dict:
        """``topology.json``'s ``rollout_share``: which prompts (and uids) every process generates."""
        per = self.num_prompts // self.processes
        return {"processes": self.processes, "prompts_per_step": self.num_prompts, "prompts_per_process": per,
                "trajectories_per_process": per * self.n,
                "prompts_by_process": {str(p): [s, s + per] for p, s in enumerate(self.starts)},
                "uid_rule": "uid = '{step}-{index in batch}', the one-process uids; process p generates indices "
                            "[lo, hi) of prompts_by_process[p], all rollout.n sessions of each",
                "assembly": "direct" if self.direct else "gathered",
                "assembly_note": ("each process's learner devices hold exactly the rows it generated: the global "
                                  "batch is built from process-local rows, no token moves" if self.direct else
                                  "the learner layout does not give each process one block of rows (rows replicated "
                                  "or interleaved across processes): the batch's token arrays are all-gathered "
                                  "before placement")}


def _row_sharding(mesh, rows: int):
    return batch_shardings({"row_mask": np.zeros((rows,), bool)}, mesh)["row_mask"]


def rollout_share(mesh, num_prompts: int, n: int, *, process: Optional[int] = None,
                  processes: Optional[int] = None, process_of=None) -> Share:
    """The prompts this process generates of a batch of ``num_prompts`` prompts x ``n`` sessions.

    ``process``, ``processes``: this process and the process count (default: JAX's);
    ``process_of``: ``device -> process`` (default ``device.process_index``; tests lay out
    several processes' devices on one)."""
    process_of = process_of or (lambda d: d.process_index)
    P = jax.process_count() if processes is None else processes
    p = jax.process_index() if process is None else process
    if P == 1:
        return Share(0, 1, 0, num_prompts, n, num_prompts, True, (0,))
    if num_prompts % P:
        raise ValueError(f"data.train_batch_size={num_prompts} prompts do not split over {P} processes: each process "
                         "generates whole prompt groups; use a multiple of the process count")
    rows, per = num_prompts * n, num_prompts // P
    ranges: dict[int, set] = {}
    for d, idx in _row_sharding(mesh, rows).devices_indices_map((rows,)).items():
        s = idx[0]
        ranges.setdefault(process_of(d), set()).add((s.start or 0, rows if s.stop is None else s.stop))
    blocks = {}
    for q, rs in ranges.items():
        rs = sorted(rs)
        lo, hi = rs[0][0], rs[-1][1]
        contiguous = all(a[1] >= b[0] for a, b in zip(rs, rs[1:]))
        blocks[q] = (lo, hi) if contiguous else None
    spans = [blocks.get(q) for q in range(P)]
    direct = (all(b is not None and b[1] - b[0] == per * n and b[0] % n == 0 for b in spans)
              and len({b[0] for b in spans}) == P)
    starts = tuple(b[0] // n for b in spans) if direct else tuple(q * per for q in range(P))
    return Share(p, P, starts[p], starts[p] + per, n, num_prompts, direct, starts)


def check_async_share(share: Share, mesh_spec: str, *, filter_groups: bool = False) -> None:
    """``trainer.mode=async``: each process's rollout thread enqueues only its own rows and never
    communicates, so the learner batch must be assembled from process-local rows
    (``share.direct``), and dynamic sampling (``filter_groups``), whose processes agree on the
    kept groups with a collective, runs on one process; a one-line ``ValueError`` otherwise."""
    if filter_groups and share.processes > 1:
        raise ValueError(f"algorithm.filter_groups.enable=true with trainer.mode=async runs on one process, not "
                         f"{share.processes}: the processes agree on the kept groups with a collective, which the "
                         "producer threads must not run beside the learner's; use trainer.mode=sync")
    if not share.direct:
        raise ValueError(f"trainer.mode=async over {share.processes} processes needs dp across the processes (each "
                         f"process's learner devices holding one block of batch rows); mesh {mesh_spec} puts rows of "
                         "several processes on one process's devices")


def _process_order(share: Share, per: int) -> np.ndarray:
    """Row permutation from process-index order (what an all-gather of ``per`` rows a process
    returns) to batch order."""
    order = np.argsort(share.starts, kind="stable")
    return np.concatenate([np.arange(q * per, (q + 1) * per) for q in order])


def allgather(tree, share: Share):
    """``[R, ...]`` NumPy leaves of every process -> ``[P * R, ...]`` in batch order."""
    if share.processes == 1:
        return tree
    from jax.experimental import multihost_utils

    out = multihost_utils.process_allgather(tree, tiled=True)
    return jax.tree.map(lambda x: np.asarray(x)[_process_order(share, x.shape[0] // share.processes)], out)


def allgather_strings(strings, share: Share) -> list[str]:
    """Equal-length string lists of every process, concatenated in batch order."""
    return _gather_strings(strings, share, lambda buf: allgather(buf, share))


def assemble(local: Mapping[str, np.ndarray], mesh, share: Share) -> dict:
    """Global arrays of batch fields (``dp`` on rows, ``sp`` on the sequence) from this process's
    rows ``[row_lo, row_lo + R)``: each process fills in the shards it owns from its own rows
    (``direct``), or all-gathers the fields first when its devices hold rows of other processes."""
    if share.processes == 1:
        full = dict(local)
    elif not share.direct:
        full = allgather(dict(local), share)
    else:
        lo = share.row_lo
        shapes = {k: (v.shape[0] * share.processes,) + v.shape[1:] for k, v in local.items()}
        shardings = batch_shardings({k: np.empty(shapes[k], v.dtype) for k, v in local.items()}, mesh)

        def cb(idx, v, rows):
            r = idx[0]
            start, stop = (r.start or 0) - lo, (rows if r.stop is None else r.stop) - lo
            if start < 0 or stop > v.shape[0]:
                raise RuntimeError(f"rows {r} of the learner batch are not this process's (rows [{lo}, "
                                   f"{lo + v.shape[0]})): the rollout share does not match the learner layout")
            return v[(slice(start, stop),) + tuple(idx[1:])]

        return {k: jax.make_array_from_callback(shapes[k], shardings[k],
                                                lambda idx, v=v, rows=shapes[k][0]: cb(idx, v, rows))
                for k, v in local.items()}
    shardings = batch_shardings(full, mesh)
    return {k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx]) for k, v in full.items()}


@dataclasses.dataclass
class RolloutRows:
    """The per-row facts of the whole step's rollout (every process's rows, batch order):
    what metrics and the trace need of rows this process did not generate. No token arrays."""

    uid: tuple
    session: np.ndarray
    process: np.ndarray  # the process that generated the row
    is_padding: np.ndarray
    prompt_length: np.ndarray
    response_length: np.ndarray
    truncated: np.ndarray
    min_version: np.ndarray
    max_version: np.ndarray
    version_span: np.ndarray  # max - min weight version over the row's sampled tokens (0 without token_version)

    episodes: Optional["EpisodeRows"] = None  # multi-turn runs: every process's episodes
    judge_scores: Optional[np.ndarray] = None  # reward.judge: every row's parsed verdict score (0 on padding)

    @property
    def batch_size(self) -> int:
        return len(self.uid)

    def by_process(self) -> dict[str, list[str]]:
        """The prompt uids each process generated (real rows, each uid once per process that had it)."""
        out: dict[str, list[str]] = {}
        seen: set = set()
        for u, s, p, pad in zip(self.uid, self.session, self.process, self.is_padding):
            if pad or (p, u) in seen:
                continue
            seen.add((p, u))
            out.setdefault(str(int(p)), []).append(u)
        return out


@dataclasses.dataclass
class EpisodeRows:
    """The per-row episode facts of every process's multi-turn rows (batch order) and the step's
    summed tool counters: what :func:`rljax.env.episode_metrics` reads (no token arrays)."""

    is_padding: np.ndarray
    num_turns: np.ndarray
    obs_tokens: np.ndarray
    tool_calls: np.ndarray
    policy_tokens: np.ndarray  # response_mask's sum per row
    episode_stats: dict  # tool_calls, tool_errors, tool_timeouts summed; env_s: the slowest process's


#: ``episode_stats`` counters summed over processes (``env_s`` takes the maximum).
_EPISODE_COUNTS = ("tool_calls", "tool_errors", "tool_timeouts")


def gather_episodes(traj, share: Share) -> EpisodeRows:
    """:class:`EpisodeRows` of the step from this process's episodes (a small all-gather)."""
    local = {"is_padding": np.asarray(traj.is_padding, bool), "num_turns": np.asarray(traj.num_turns, np.int64),
             "obs_tokens": np.asarray(traj.obs_tokens, np.int64), "tool_calls": np.asarray(traj.tool_calls, np.int64),
             "policy_tokens": np.asarray(traj.response_mask).sum(axis=1).astype(np.int64)}
    ep = traj.episode_stats
    counts = np.array([float(ep.get(k, 0)) for k in _EPISODE_COUNTS] + [float(ep.get("env_s", 0.0))], np.float64)
    every = per_process(counts) if share.processes > 1 else counts[None]
    stats = {k: int(every[:, i].sum()) for i, k in enumerate(_EPISODE_COUNTS)}
    stats["env_s"] = float(every[:, -1].max())
    return EpisodeRows(**{k: np.asarray(v) for k, v in allgather(local, share).items()}, episode_stats=stats)


def version_spans(traj) -> np.ndarray:
    """``[B]`` int64: each row's spread of weight versions over its sampled tokens (max - min of
    ``token_version`` where it is set; 0 on padding rows, rows without sampled tokens, and
    trajectories without ``token_version``)."""
    tv = getattr(traj, "token_version", None)
    if tv is None:
        return np.zeros(traj.batch_size, np.int64)
    tv = np.asarray(tv, np.int64)
    real = (tv >= 0) & ~np.asarray(traj.is_padding, bool)[:, None]
    hi = np.where(real, tv, -1).max(axis=1, initial=-1)  # versions are >= 0
    lo = np.where(real, tv, hi[:, None]).min(axis=1, initial=np.iinfo(np.int64).max)
    return np.where(real.any(axis=1), hi - lo, 0)


def gather_rows(traj, share: Share, *, judge_scores=None, episodes=None) -> RolloutRows:
    """:class:`RolloutRows` of the step from this process's trajectories (a small all-gather; then
    ``episodes(traj, share)``, the multi-turn client's :func:`gather_episodes`, if given;
    ``judge_scores``: this process's rows' verdict scores, gathered beside)."""
    local = {"session": np.asarray(traj.session, np.int32),
             "process": np.full(traj.batch_size, share.process, np.int32),
             "is_padding": np.asarray(traj.is_padding, bool),
             "prompt_length": np.asarray(traj.prompt_length, np.int32),
             "response_length": np.asarray(traj.response_length, np.int32),
             "truncated": np.asarray(traj.truncated, bool),
             "min_version": np.asarray(traj.min_version, np.int64),
             "max_version": np.asarray(traj.max_version, np.int64),
             "version_span": version_spans(traj)}
    if judge_scores is not None:
        local["judge_scores"] = np.asarray(judge_scores, np.float32)
    glob = allgather(local, share)
    return RolloutRows(uid=tuple(allgather_strings(traj.uid, share)), **{k: np.asarray(v) for k, v in glob.items()},
                       episodes=episodes(traj, share) if episodes is not None else None)


def merge_reward_reports(report, share: Share):
    """The whole batch's :class:`~rljax.reward.RewardReport` from every process's: counts summed, the
    first error of the first process (in batch order) that had one, a dict's extras and each of
    ``reward.functions``' errors merged (:func:`rljax.reward.merge_extras`); ``error_uids`` and
    ``row_extras`` stay this process's (their number differs between processes)."""
    if share.processes == 1:
        return report

    counts = np.array([report.num_scored, report.num_padding, report.errors, report.timeouts,
                       report.worker_restarts], np.int64)
    total = per_process(counts).sum(axis=0)
    return RewardReport(int(total[0]), int(total[1]), int(total[2]), tuple(report.error_uids),
                        _first_of_processes(report.first_error, share), int(total[3]), int(total[4]),
                        row_extras=report.row_extras,
                        **merge_extras(gather_records([report.extras_record()], share)))


def merge_judge_reports(report, share: Share):
    """The whole batch's :class:`~rljax.reward.JudgeReport` from every process's (each judged its own
    rows): counts summed, the first error or unparseable verdict of the first process (in batch
    order) that had one."""
    if share.processes == 1:
        return report
    counts = np.array([report.num_scored, report.errors, report.unparseable, report.truncated,
                       report.prompt_truncated], np.int64)
    total = per_process(counts).sum(axis=0)
    return dataclasses.replace(report, num_scored=int(total[0]), errors=int(total[1]), unparseable=int(total[2]),
                               truncated=int(total[3]), prompt_truncated=int(total[4]),
                               first_error=_first_of_processes(report.first_error, share))


def _first_of_processes(text: Optional[str], share: Share) -> Optional[str]:
    """The first non-empty ``text`` of the processes in batch order (each process's cut to 512 bytes)."""
    firsts = [bytes(r).rstrip(b"\0").decode(errors="replace") for r in per_process(_encode([text or ""], 512))[:, 0]]
    return next((firsts[q] for q in np.argsort(share.starts, kind="stable") if firsts[q]), None)


def gather_records(records, share: Share) -> list:
    """JSON-able records of every process (any number each), concatenated in batch order (the
    processes ordered by their first prompt): e.g. each process's first sample rows of its share."""
    records = list(records)
    if share.processes == 1:
        return records
    counts = per_process(np.array([len(records)], np.int64))[:, 0]
    texts = allgather_texts([json.dumps(r, ensure_ascii=False) for r in records], share)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    return [json.loads(texts[i]) for q in np.argsort(share.starts, kind="stable")
            for i in range(bounds[q], bounds[q + 1])]


def block(num_prompts: int, share: Share) -> tuple[int, int]:
    """This process's prompts ``[lo, hi)`` of a list of ``num_prompts`` prompt groups whose size
    need not divide by the process count (validation batches, ``data.val_batch_size``; the last
    may be shorter): contiguous blocks in process-index order, sizes differing by at most one
    (a process may get none when there are fewer prompts than processes)."""
    p, n = share.process, share.processes
    return p * num_prompts // n, (p + 1) * num_prompts // n


def allgather_blocks(tree: Mapping[str, np.ndarray], share: Share) -> dict:
    """``{name: [R_p, ...]}`` NumPy leaves of every process (``R_p`` may differ, 0 included) ->
    ``[sum R_p, ...]`` concatenated in process-index order (the order of :func:`block`). Each
    process's rows are padded to the longest share for the all-gather, then cut back."""
    tree = {k: np.asarray(v) for k, v in tree.items()}
    if share.processes == 1:
        return tree
    counts = per_process(np.array([len(next(iter(tree.values())))], np.int64))[:, 0]
    width = int(counts.max())
    padded = {k: np.concatenate([v, np.zeros((width - len(v),) + v.shape[1:], v.dtype)]) for k, v in tree.items()}
    from jax.experimental import multihost_utils

    stacked = {k: np.asarray(v) for k, v in multihost_utils.process_allgather(padded, tiled=False).items()}
    return {k: np.concatenate([v[q, : counts[q]] for q in range(share.processes)]) for k, v in stacked.items()}


def allgather_texts(texts, share: Share) -> list[str]:
    """Lists of strings of every process (any lengths), concatenated in process-index order."""
    return _gather_strings(texts, share, lambda buf: allgather_blocks({"t": buf}, share)["t"])


def _gather_strings(strings, share: Share, gather) -> list[str]:
    """``strings`` of every process through ``gather`` (an all-gather of ``[R, width]`` uint8
    rows), each encoded as UTF-8 padded to the longest string of any process."""
    strings = [str(s) for s in strings]
    if share.processes == 1:
        return strings
    width = int(per_process(np.array([max((len(s.encode()) for s in strings), default=0)], np.int64)).max())
    return [bytes(row).rstrip(b"\0").decode() for row in gather(_encode(strings, width))]


def local_rows(x, share: Share) -> np.ndarray:
    """This process's rows ``[row_lo, row_lo + num_rows)`` of a global ``[B, ...]`` batch array, on
    the host (several processes: the array is all-gathered first; meant for a few values per row)."""
    if share.processes == 1:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))[share.row_lo:share.row_lo + share.num_rows]


def per_process(x: np.ndarray) -> np.ndarray:
    """``x`` of every process stacked on a new leading axis, in process-index order."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def _encode(strings, width: int) -> np.ndarray:
    buf = np.zeros((len(strings), max(width, 1)), np.uint8)
    for i, s in enumerate(strings):
        r = s.encode()[:width]
        buf[i, : len(r)] = np.frombuffer(r, np.uint8)
    return buf
