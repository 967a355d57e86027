"""Runs a step as a fixed sequence of named stages over one batch dict, and tells observers.

A :class:`Stage` is a name, a timing key (verl's ``timing_s/<key>``) and a function
``fn(batch) -> dict`` that reads fields of the batch and returns the fields it produced, or,
for a stage that reads or changes the run's state (:class:`rljax.trainer.state.RunState`),
``fn(state, batch) -> (state, dict)``: the runner threads the state through the stages
and returns the last one (:meth:`StepRunner.run_state`); no stage keeps it.
:class:`StepRunner` runs the stages in order and, for every stage, hands a
:class:`StageEvent` to each observer: the fields the stage *actually read* (recorded as it
read them, not declared), the fields it wrote, and who produced each field it read. A
field written by a stage as the very object another field already holds (for example
``algorithm.bypass_mode``'s behaviour log-prob, which *is* the sampler's
``rollout_logp``) keeps its original producer, so the trace cannot credit a stage with
work it did not do.

After the last stage the runner drops the batch and checks its live-batch registry: every
device array and host array the batch held is looked up again (weak references), and
what is still alive is reported to the observers as leaked (:class:`Cleanup`). The
trainer, the sampler and the observers must not keep step data beyond the step; a stage
that does is caught here, whatever it is.

Stages compute; the runner sequences and times (``jax.block_until_ready`` on each
stage's device outputs, so a stage's time is its own work, not the next stage's wait);
observers only read. The asynchronous and multi-turn schedules reuse the same stages with
another runner loop.

**Stages describe themselves.** A stage declares the batch fields it may read (``reads``)
and write (``writes``); the runner raises :class:`StageContractError` (one line naming the
stage and the field) when a stage reads or writes a field it did not declare, so a stage's
declaration is what it does, not a comment. A stage may also carry ``facts``: what a reader
of the trace needs beyond the field summaries (versions, sizes, statuses), computed from its
own outputs. The signature, for any stage (the asynchronous producer's and admission's
included)::

    facts(event: StageEvent, view: rljax.trace.facts.GroupView) -> dict  # JSON-able

``event`` is the stage's :class:`StageEvent` (``reads``, ``writes``, ``producers``,
``t_start`` / ``t_end``); ``view`` is one traced prompt group as the tracer sees it at the
end of the step (its rows and keys in the trajectories, the step's fields, the learner
batch's padding and per-row loss tokens, a clock converter). Run constants a stage's facts
need (the estimator's name, ``rollout.n``) are bound when the stage list is built
(``functools.partial``); the trace package holds no table of stage names, and the function
travels in the event (the trace does not import the trainer). The facts are computed only
for traced groups, after the step, and must only read.

Each step, the runner records the names of the stages it ran, in order (a ``prior``'s
replayed producer stages first) in :attr:`Cleanup.stages`; the tracer writes that list in
the cleanup record, and ``trace check`` compares every traced group's records with it.
"""

from __future__ import annotations

import dataclasses
import gc
import time
import weakref
from typing import Any, Callable, Iterator, Mapping, MutableMapping, Optional, Protocol, Sequence

import jax
import numpy as np


class StageContractError(RuntimeError):
    """A stage read or wrote a batch field it does not declare (a bug in the stage or its
    declaration, not a user's mistake)."""


@dataclasses.dataclass(frozen=True)
class Stage:
    """A named step of the pipeline.

    Args:
      name: the stage's name in the trace (``rollout_sessions``, ``old_log_prob``, ...).
      fn: ``fn(batch) -> dict`` of the fields it produced; ``batch`` is read-only. With
        ``updates_state``: ``fn(state, batch) -> (state, dict)``.
      timing: the ``timing_s/<timing>`` metric key (verl's names where they exist).
      updates_state: the stage takes the run's state and returns it (changed or not).
      reads: the batch fields the stage may read (optional ones included).
      writes: the batch fields it may write (a subset each step).
      facts: ``facts(event, view) -> dict`` for the trace (see the module docstring), or None.
      comm: the stage is one communication the run issues (the rollout gather): the trace
        counts its whole time as ``comm_s/<name>``.
    """

    name: str
    fn: Callable[..., Any]
    timing: Optional[str] = None
    updates_state: bool = False
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    facts: Optional[Callable[..., dict]] = None
    comm: bool = False

    def __post_init__(self):
        for what in ("reads", "writes"):
            value = getattr(self, what)
            if isinstance(value, str):
                raise TypeError(f"stage {self.name!r}: {what}={value!r} must be a tuple of field names, not a string")
            object.__setattr__(self, what, tuple(value))

    @property
    def timing_key(self) -> str:
        return self.timing or self.name


@dataclasses.dataclass
class StageEvent:
    """What one stage did: the fields it read (with their producers) and wrote, and when."""

    step: int
    stage: str
    reads: dict[str, Any]
    writes: dict[str, Any]
    producers: dict[str, str]  # producer stage of every field read or written
    aliases: dict[str, str]  # written field -> the existing field it is the same object as
    t_start: float  # time.perf_counter()
    t_end: float
    facts: Optional[Callable[..., dict]] = None  # the stage's facts(event, view) for the trace
    comm: bool = False  # the stage is one communication (Stage.comm)


@dataclasses.dataclass
class Cleanup:
    """The end of a step: the batch's fields, and those still alive after it was dropped."""

    step: int
    batch_keys: list[str]
    tracked: int  # objects the live-batch registry followed
    leaked: list[str]  # fields whose value is still referenced somewhere
    t_start: float
    t_end: float
    stages: list[str] = dataclasses.field(default_factory=list)  # the stages the step ran, in order


class Observer(Protocol):
    def step_start(self, step: int, t: float) -> None: ...

    def stage(self, event: StageEvent) -> None: ...

    def step_end(self, step: int, metrics: MutableMapping[str, Any]) -> None: ...

    def cleanup(self, report: Cleanup) -> None: ...


class _Reads(Mapping):
    """A read-only view of the batch that records which fields a stage reads, and refuses a read
    the stage did not declare."""

    def __init__(self, data: Mapping[str, Any], stage: Stage):
        self._data = data
        self._stage = stage
        self.read: list[str] = []

    def __getitem__(self, key):
        if key not in self._stage.reads:
            raise StageContractError(f"stage {self._stage.name!r} read field {key!r}, which it does not declare "
                                     f"(reads={list(self._stage.reads)})")
        value = self._data[key]
        if key not in self.read:
            self.read.append(key)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key) -> bool:
        return key in self._data


def _device_leaves(tree) -> list:
    return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


def _weak(value) -> list:
    """Weak references to the arrays a field holds: device arrays and NumPy arrays of one
    dimension or more, through dicts, lists, tuples and pytree dataclasses (the rollout's
    ``Trajectories``). Host scalars (metric values) may outlive the step."""
    refs = []
    for leaf in jax.tree.leaves(value):
        if isinstance(leaf, jax.Array) or (isinstance(leaf, np.ndarray) and leaf.ndim >= 1):
            refs.append(weakref.ref(leaf))
    return refs


@dataclasses.dataclass
class Produced:
    """What :meth:`StepRunner.produce` ran ahead of a step: fields, their producers, the stage
    events and timings. :meth:`StepRunner.run` takes it over (``prior``) and releases it."""

    batch: dict
    producers: dict
    events: list
    timings: dict
    stages: list = dataclasses.field(default_factory=list)  # the names of the stages run, in order

    def release(self) -> None:
        self.batch, self.events = {}, []


class StepRunner:
    """Runs ``stages`` over one batch per step and reports to ``observers``.

    ``run`` returns ``(metrics, timings)``: the ``metrics`` field the last stages produced
    (host values only; the batch itself never leaves the runner) and the seconds per
    timing key.
    """

    def __init__(self, stages: Sequence[Stage], observers: Sequence[Observer] = ()):
        names = [s.name for s in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique: {names}")
        self.stages = tuple(stages)
        self.observers = list(observers)
        #: The run state as the last stage that takes it returned it (during a step, what
        #: observers such as the ledgers may read: the state a stage took may be donated).
        self.live_state: Any = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)

    def _stages(self, step: int, batch: dict, producers: dict, timings: dict, emit: Callable, state: Any,
                ran: list) -> Any:
        for stage in self.stages:
            view = _Reads(batch, stage)
            t_start = time.perf_counter()
            if stage.updates_state:
                if state is None:
                    raise ValueError(f"stage {stage.name!r} takes the run's state: run it with run_state()")
                state, out = stage.fn(state, view)
                self.live_state = state
                out = dict(out or {})
            else:
                out = dict(stage.fn(view) or {})
            undeclared = [k for k in out if k not in stage.writes]
            if undeclared:
                raise StageContractError(f"stage {stage.name!r} wrote field {undeclared[0]!r}, which it does not "
                                         f"declare (writes={list(stage.writes)})")
            ran.append(stage.name)
            jax.block_until_ready(_device_leaves(out))
            t_end = time.perf_counter()
            timings[stage.timing_key] = timings.get(stage.timing_key, 0.0) + (t_end - t_start)
            aliases = {}
            for k, v in out.items():
                same = next((o for o, ov in batch.items() if ov is v and o != k), None) if _aliasable(v) else None
                if same is not None:
                    aliases[k] = same
                    producers[k] = producers[same]
                else:
                    producers[k] = stage.name
            batch.update(out)
            event = StageEvent(step=step, stage=stage.name, reads={k: batch[k] for k in view.read}, writes=out,
                               producers={k: producers[k] for k in (*view.read, *out)}, aliases=aliases,
                               t_start=t_start, t_end=t_end, facts=stage.facts, comm=stage.comm)
            emit(event)
            del event, view, out
        return state

    def produce(self, step: int, seed: Optional[Mapping[str, Any]] = None) -> "Produced":
        """Runs the stages ahead of a step (the asynchronous producer side), telling no observer:
        the fields, producers, events and timings are handed to a later :meth:`run_state`
        (``prior``), which tells the observers as if the stages had run in that step. The
        producer's stages do not take the run's state (the learner owns it)."""
        batch: dict[str, Any] = dict(seed or {})
        producers = {k: "step_start" for k in batch}
        events: list[StageEvent] = []
        timings: dict[str, float] = {}
        ran: list[str] = []
        self._stages(step, batch, producers, timings, events.append, None, ran)
        return Produced(batch=batch, producers=producers, events=events, timings=timings, stages=ran)

    def run(self, step: int, seed: Optional[Mapping[str, Any]] = None,
            prior: Optional["Produced"] = None) -> tuple[dict, dict[str, float]]:
        """:meth:`run_state` of stages that take no state: ``(metrics, timings)``."""
        _, metrics, timings = self.run_state(None, step, seed, prior)
        return metrics, timings

    def run_state(self, state: Any, step: int, seed: Optional[Mapping[str, Any]] = None,
                  prior: Optional["Produced"] = None) -> tuple[Any, dict, dict[str, float]]:
        """Runs the stages over one batch, threading ``state`` through those that take it;
        ``(state after the last stage, metrics, timings)``. ``prior`` (from :meth:`produce` of
        another runner) seeds the batch with the fields produced ahead of the step and replays
        its stage events to the observers first (the runner then owns and releases those fields)."""
        t0 = time.perf_counter()
        self.live_state = state
        for obs in self.observers:
            obs.step_start(step, t0)
        batch: dict[str, Any] = dict(seed or {})
        producers = {k: "step_start" for k in batch}
        timings: dict[str, float] = {}
        ran: list[str] = []
        if prior is not None:
            ran.extend(prior.stages)
            batch.update(prior.batch)
            producers.update(prior.producers)
            timings.update(prior.timings)
            for ev in prior.events:
                ev = dataclasses.replace(ev, step=step)
                for obs in self.observers:
                    obs.stage(ev)
                del ev
            prior.release()

        def emit(event):
            for obs in self.observers:
                obs.stage(event)

        state = self._stages(step, batch, producers, timings, emit, state, ran)
        metrics = dict(batch.get("metrics") or {})
        metrics.update({f"timing_s/{k}": v for k, v in timings.items()})
        metrics["timing_s/step"] = time.perf_counter() - t0
        for obs in self.observers:
            obs.step_end(step, metrics)
        # The live-batch registry: drop the batch, then look for what is still alive.
        t_clean = time.perf_counter()
        refs = {k: _weak(v) for k, v in batch.items()}
        keys = sorted(batch)
        batch.clear()
        del batch
        leaked = [k for k, rs in refs.items() if any(r() is not None for r in rs)]
        if leaked:  # a reference cycle is not a leak: collect, then look again
            gc.collect()
            leaked = [k for k in leaked if any(r() is not None for r in refs[k])]
        report = Cleanup(step=step, batch_keys=keys, tracked=sum(len(r) for r in refs.values()), leaked=leaked,
                         t_start=t_clean, t_end=time.perf_counter(), stages=ran)
        for obs in self.observers:
            obs.cleanup(report)
        return state, metrics, timings


def _aliasable(v) -> bool:
    """Only objects with identity worth following (arrays, containers), not small ints or strings."""
    return isinstance(v, jax.Array) or hasattr(v, "__array__") and not isinstance(v, (int, float, str, bool))
