"""The checks of ``python -m rljax.trace check``, one module per subject (:mod:`rljax.trace.check`
lists them in the order they run). :mod:`~rljax.trace.checks.base` holds what they share: the
run's files parsed once (:class:`~rljax.trace.checks.base.Run`) and the result statuses."""
