"""Runs a step as a fixed sequence of named stages over one batch dict, and tells observers.

A :class:`Stage` is a name, a timing key (verl's ``timing_s/<key>``) and a function
``fn(batch) -> dict`` that reads fields of the batch and returns the fields it produced;
a stage that reads the run's state (:class:`rljax.trainer.state.RunState`) is
``fn(state, batch) -> dict``, one that changes it ``fn(state, batch) -> (state, dict)``
(:data:`STATE_MODES`): the runner threads the state through the stages and returns the last
one (:meth:`StepRunner.run_state`); no stage keeps it. A stage is declared once, beside its
function, with :func:`stage` (a :class:`StageSpec`); :meth:`StageSpec.bind` makes the run's
:class:`Stage` from it (:mod:`rljax.trainer.stages`).
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
and write (``writes``), the configuration keys it reads (``config``: the stage sees the
configuration through a :class:`ConfigView` of those keys) and how it relates to the run
state (``state``); the runner raises :class:`StageContractError` (one line naming the stage
and the field or key) when a stage reads or writes a field, or reads a key, it did not
declare, or declares a state change it does not make, so a stage's declaration is what it
does, not a comment. A stage may also carry ``facts``: what a reader
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
import functools
import gc
import time
import weakref
from typing import Any, Callable, Iterator, Mapping, MutableMapping, Optional, Protocol, Sequence

import jax
import numpy as np


class StageContractError(RuntimeError):
    """A stage read or wrote a batch field it does not declare (a bug in the stage or its
    declaration, not a user's mistake)."""


#: How a stage relates to the run's state: ``"none"`` (``fn(batch) -> dict``), ``"reads"``
#: (``fn(state, batch) -> dict``: it reads the state, cannot change it) and ``"changes"``
#: (``fn(state, batch) -> (state, dict)``: it returns a new state, every step).
STATE_MODES = ("none", "reads", "changes")


@dataclasses.dataclass(frozen=True)
class Stage:
    """A named step of the pipeline, bound to its run (what :meth:`StageSpec.bind` makes).

    Args:
      name: the stage's name in the trace (``rollout_sessions``, ``old_log_prob``, ...).
      fn: by ``state`` (:data:`STATE_MODES`): ``fn(batch) -> dict`` of the fields it produced,
        ``fn(state, batch) -> dict``, or ``fn(state, batch) -> (state, dict)``; ``batch`` is read-only.
      timing: the ``timing_s/<timing>`` metric key (verl's names where they exist).
      state: ``"none"``, ``"reads"`` or ``"changes"`` (:data:`STATE_MODES`).
      reads: the batch fields the stage may read (optional ones included).
      writes: the batch fields it may write (a subset each step).
      facts: ``facts(event, view) -> dict`` for the trace (see the module docstring), or None.
      comm: the stage is one communication the run issues (the rollout gather): the trace
        counts its whole time as ``comm_s/<name>``.
      config: the configuration keys (dotted, a section covers its keys) the stage reads.
    """

    name: str
    fn: Callable[..., Any]
    timing: Optional[str] = None
    state: str = "none"
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    facts: Optional[Callable[..., dict]] = None
    comm: bool = False
    config: tuple[str, ...] = ()

    def __post_init__(self):
        for what in ("reads", "writes", "config"):
            value = getattr(self, what)
            if isinstance(value, str):
                kind = "keys" if what == "config" else "field names"
                raise TypeError(f"stage {self.name!r}: {what}={value!r} must be a tuple of {kind}, not a string")
            object.__setattr__(self, what, tuple(value))
        if self.state not in STATE_MODES:
            raise ValueError(f"stage {self.name!r}: state={self.state!r}; accepted: {', '.join(STATE_MODES)}")

    @property
    def timing_key(self) -> str:
        return self.timing or self.name

    @property
    def updates_state(self) -> bool:
        """The stage takes the run's state (reads or changes it)."""
        return self.state != "none"


class ConfigView:
    """The run's configuration as one stage may read it: the keys its declaration names
    (``StageSpec.config``; a section name covers every key under it). Reading any other key
    raises :class:`StageContractError` naming the stage and the key, so a stage's ``config``
    is the list of what it reads, not a comment."""

    __slots__ = ("_cfg", "_path", "_allowed", "_stage")

    def __init__(self, cfg, allowed: Sequence[str], stage: str, path: str = ""):
        object.__setattr__(self, "_cfg", cfg)
        object.__setattr__(self, "_allowed", tuple(allowed))
        object.__setattr__(self, "_stage", stage)
        object.__setattr__(self, "_path", path)

    def __getattr__(self, name: str):
        value = getattr(self._cfg, name)
        path = f"{self._path}.{name}" if self._path else name
        if any(path == a or path.startswith(a + ".") for a in self._allowed):
            return value
        if dataclasses.is_dataclass(value) and any(a.startswith(path + ".") for a in self._allowed):
            return ConfigView(value, self._allowed, self._stage, path)
        raise StageContractError(f"stage {self._stage!r} read config {path!r}, which it does not declare "
                                 f"(config={list(self._allowed)})")

    def __setattr__(self, name, value):
        raise AttributeError("the configuration is read-only")


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """A stage's declaration, written once beside its function with :func:`stage`.

    ``fn(services, [state,] batch, **options)``; ``services`` is a dataclass with a ``cfg``
    field (:class:`rljax.trainer.services.Services`). :meth:`bind` makes the run's
    :class:`Stage`: the function over the services, whose ``cfg`` is a :class:`ConfigView`
    of the declared ``config`` keys. ``when(services)`` (through the same view) says whether
    the stage is in this configuration's list (``only``: the same in words, for the page);
    ``facts_args(services)`` the run constants its facts take. Several functions may
    declare one name (variants of a stage, such as the rollout of single-turn, multi-turn
    or filtered batches): their ``when`` must exclude each other.
    """

    name: str
    fn: Callable[..., Any]
    timing: Optional[str] = None
    state: str = "none"
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    config: tuple[str, ...] = ()
    facts: Optional[Callable[..., dict]] = None
    facts_args: Optional[Callable[[Any], dict]] = None
    when: Optional[Callable[[Any], bool]] = None
    only: str = ""
    comm: bool = False
    options: tuple[str, ...] = ()  # keyword arguments bind() passes on (a scheduler's hooks)
    summary: str = ""  # reads -> writes in words, for docs/concepts/stage-flow.md

    def __post_init__(self):
        for what in ("reads", "writes", "config", "options"):
            object.__setattr__(self, what, tuple(getattr(self, what)))
        if self.state not in STATE_MODES:
            raise ValueError(f"stage {self.name!r}: state={self.state!r}; accepted: {', '.join(STATE_MODES)}")

    def view(self, services):
        """``services`` with its ``cfg`` narrowed to this stage's declared keys."""
        return dataclasses.replace(services, cfg=ConfigView(services.cfg, self.config, self.name))

    def applies(self, services) -> bool:
        return self.when is None or bool(self.when(self.view(services)))

    def bind(self, services, **options) -> Stage:
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise TypeError(f"stage {self.name!r} takes no option {unknown[0]!r} (options={list(self.options)})")
        s = self.view(services)
        facts = self.facts
        if facts is not None and self.facts_args is not None:
            facts = functools.partial(facts, **self.facts_args(s))
        return Stage(self.name, functools.partial(self.fn, s, **options), self.timing, state=self.state,
                     reads=self.reads, writes=self.writes, facts=facts, comm=self.comm, config=self.config)


def stage(name: str, *, timing: Optional[str] = None, state: str = "none", reads: Sequence[str] = (),
          writes: Sequence[str] = (), config: Sequence[str] = (), facts: Optional[Callable] = None,
          facts_args: Optional[Callable] = None, when: Optional[Callable] = None, only: str = "",
          comm: bool = False, options: Sequence[str] = (), summary: str = "") -> Callable:
    """Declares the function below as the stage ``name`` (:class:`StageSpec`, in ``fn.stage``)."""

    def declare(fn):
        fn.stage = StageSpec(name, fn, timing, state=state, reads=tuple(reads), writes=tuple(writes),
                             config=tuple(config), facts=facts, facts_args=facts_args, when=when, only=only,
                             comm=comm, options=tuple(options), summary=summary)
        return fn

    return declare


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


@dataclasses.dataclass(frozen=True)
class Done:
    """A stage's outputs computed elsewhere, over ``[t_start, t_end]`` (``time.perf_counter``): a
    streaming source draws and generates a batch over many rounds, interleaved with other
    batches', and hands the result to :meth:`StepRunner.produce`, which records it as the
    stage's (its declared writes checked, its facts and its time in the trace) without calling
    the stage's function."""

    outputs: Mapping[str, Any]
    t_start: float
    t_end: float


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
                ran: list, done: Mapping[str, "Done"]) -> Any:
        for stage in self.stages:
            view = _Reads(batch, stage)
            t_start = time.perf_counter()
            did = done.get(stage.name)
            if did is not None:  # its work was done elsewhere (a streaming source's rounds)
                out, t_start = did.outputs, did.t_start
            elif stage.state == "none":
                out = stage.fn(view)
            elif state is None:
                raise ValueError(f"stage {stage.name!r} takes the run's state: run it with run_state()")
            elif stage.state == "reads":
                out = stage.fn(state, view)
            else:
                new, out = stage.fn(state, view)
                if new is state:
                    raise StageContractError(f"stage {stage.name!r} declares state='changes' but returned the run "
                                             "state it took: declare state='reads'")
                state = self.live_state = new
            out = dict(out or {})
            undeclared = [k for k in out if k not in stage.writes]
            if undeclared:
                raise StageContractError(f"stage {stage.name!r} wrote field {undeclared[0]!r}, which it does not "
                                         f"declare (writes={list(stage.writes)})")
            ran.append(stage.name)
            jax.block_until_ready(_device_leaves(out))
            t_end = time.perf_counter() if did is None else did.t_end
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

    def produce(self, step: int, seed: Optional[Mapping[str, Any]] = None, *, state: Any = None,
                done: Optional[Mapping[str, "Done"]] = None) -> "Produced":
        """Runs the stages ahead of a step (the asynchronous producer side), telling no observer:
        the fields, producers, events and timings are handed to a later :meth:`run_state`
        (``prior``), which tells the observers as if the stages had run in that step. ``state``:
        what a stage that reads the state sees (the producer's view: the learner owns the run
        state); a stage may not change it here. ``done``: stages whose outputs were computed
        elsewhere, by name (:class:`Done`)."""
        batch: dict[str, Any] = dict(seed or {})
        producers = {k: "step_start" for k in batch}
        events: list[StageEvent] = []
        timings: dict[str, float] = {}
        ran: list[str] = []
        changing = [st.name for st in self.stages if st.state == "changes" and st.name not in (done or {})]
        if changing:
            raise ValueError(f"stage {changing[0]!r} changes the run state: it runs on the learner, not ahead of a step")
        self._stages(step, batch, producers, timings, events.append, state, ran, done or {})
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

        state = self._stages(step, batch, producers, timings, emit, state, ran, {})
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
