"""The tracer's parts (:class:`rljax.trace.tracer.Tracer` composes them), each a small observer of
the step runner's stage events with one job:

* :mod:`~rljax.trace.observers.step`: the step as every part sees it (:class:`StepView`), built
  once from the stage events at the end of the step;
* :mod:`~rljax.trace.observers.records`: ``trace.jsonl``, one record per stage per traced group;
* :mod:`~rljax.trace.observers.whole_batch`: the whole-batch invariants on every row;
* :mod:`~rljax.trace.observers.ledgers`: the shape and memory ledgers, once;
* :mod:`~rljax.trace.observers.alert_log`: the alerts fired, with their severity and first step;
* :mod:`~rljax.trace.observers.clock`: stage time and the tracer's own overhead;
* :mod:`~rljax.trace.observers.perf`: DFX metrics (tokens per dp shard, lengths, bytes per field,
  communication, memory, the slowest process);
* :mod:`~rljax.trace.observers.rollouts`: which process generated which prompts
  (``rollout_uids.jsonl``), the rollout dumps, and an asynchronous run's queue counts.
"""
