"""The step's learner arrays are copied to the host in a background thread while the later stages
run (:mod:`rljax.trace.prefetch`): the copy stays on the array, and once the tracer has waited no
reference to the step's arrays is left in the thread (the runner's leak check follows)."""

import gc
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from rljax.trace.prefetch import Prefetch

from test_trace_alerts import _records, _step


def _sharded(x):
    """``x`` split by rows over the 8 simulated devices, as the learner's batch arrays are (a
    one-device array is its own host copy on CPU: nothing to keep)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from rljax.sharding import make_mesh

    return jax.device_put(x, NamedSharding(make_mesh("dp8"), PartitionSpec("dp")))


def test_the_copy_is_made_off_the_callers_thread_and_kept_on_the_array():
    p, seen = Prefetch(), []
    x = _sharded(jnp.arange(64.0).reshape(8, 8))
    import rljax.trace.prefetch as P

    orig = P.host_copy

    def spy(a):  # the thread's copy: which thread made it
        seen.append(threading.current_thread().name)
        return orig(a)

    P.host_copy = spy
    try:
        p.put([x])
        p.wait()
    finally:
        P.host_copy = orig
    assert seen == ["rljax-trace-prefetch"]
    assert x._npy_value is not None and (x._npy_value == np.arange(64.0).reshape(8, 8)).all()
    p.close()


def _mesh_array(x, axes, spec):
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.device_put(x, NamedSharding(jax.make_mesh(axes, ("a", "b")), PartitionSpec(*spec)))


def test_host_copy_is_np_asarray_and_stays_on_the_array():
    """Every shape of sharding the learner's arrays take (rows, rows and columns, rows with the
    columns' devices holding copies, replicated, one device, host): the same values, dtype and
    shape as ``np.asarray``, read-only, and kept on the array as its host value."""
    from rljax.trace.prefetch import host_copy

    x = np.arange(8 * 6, dtype=np.int32).reshape(8, 6) * 7 - 100
    flags, thirds = x % 3 == 0, x.astype(np.float32) / np.float32(3)
    cases = {"rows": (_sharded(jnp.asarray(x)), x),
             "rows and columns": (_mesh_array(jnp.asarray(x), (4, 2), ("a", "b")), x),
             "rows, columns replicated": (_mesh_array(jnp.asarray(x), (2, 4), ("a", None)), x),
             "columns": (_mesh_array(jnp.asarray(x), (4, 2), (None, "b")), x),
             "replicated": (_mesh_array(jnp.asarray(x), (4, 2), ()), x),
             "bool rows": (_sharded(jnp.asarray(flags)), flags),
             "float rows": (_sharded(jnp.asarray(thirds)), thirds),
             "one device": (jnp.asarray(x), x),
             "host": (x, x)}
    for name, (a, want) in cases.items():
        sharded = isinstance(a, jax.Array) and not a.is_fully_replicated
        assert not sharded or a._npy_value is None, name  # nothing copied it before
        got = host_copy(a)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)
        if sharded:
            assert a._npy_value is got and not got.flags.writeable, name
            assert np.asarray(a) is got, name  # a later host read takes the copy


def test_no_reference_to_an_array_outlives_the_wait():
    """The last array of the last job too (a thread's loop variable would hold it until the next job)."""
    p = Prefetch()
    xs = [_sharded(jnp.ones((8, 4)) * i) for i in range(3)]
    refs = [weakref.ref(x) for x in xs]
    p.put(xs[:2])
    p.put(xs[2:])
    p.wait()
    del xs
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    p.close()


def test_a_deleted_array_is_skipped_and_the_thread_goes_on():
    p = Prefetch()
    gone, kept = _sharded(jnp.ones((8, 2))), _sharded(jnp.zeros((8, 2)))
    gone.delete()
    p.put([gone, kept])
    p.wait()
    assert kept._npy_value is not None
    p.put([jnp.ones(3)])  # the thread still runs
    p.wait()
    p.close()


def test_a_traced_step_prefetches_and_leaves_nothing_alive(tmp_path, monkeypatch):
    """The tracer hands the stages' arrays to the thread (CPU devices, one process) and the step's
    cleanup finds the batch released, the copies being slow (the step's end waits for them)."""
    import time

    import rljax.trace.prefetch as P

    calls, last = [], {}
    put = P.Prefetch.put

    def put_last(self, arrays):  # the step's last batch of arrays: its copies will be slow
        if arrays:
            last["ids"] = {id(a) for a in arrays}
        put(self, arrays)

    def slow(a, *k, **kw):  # the last stage's first copy outlasts the step: the step's end finds it queued
        calls.append(1)
        if last.get("armed") and id(a) in last.get("ids", ()) and not last.get("slept"):
            last["slept"] = time.sleep(0.5) or True
        return np.asarray(a, *k, **kw)

    from rljax.trace.tracer import Tracer

    cleanup = Tracer.cleanup

    def armed(self, report):  # the second step (no ledgers to build at its end) has the slow copy
        last["armed"] = True
        return cleanup(self, report)

    monkeypatch.setattr(Tracer, "cleanup", armed)
    monkeypatch.setattr(P.Prefetch, "put", put_last)
    monkeypatch.setattr(P, "np", type("np", (), {"asarray": staticmethod(slow)}))
    tracer, out = _step(tmp_path, steps=2)
    assert last.get("slept") and calls and tracer.prefetch is not None and jax.default_backend() == "cpu"
    recs = _records(tmp_path)
    assert recs[-1]["released"] and not any(k.startswith("alerts/") for k in out), out
    assert out["invariants/rows"] > 0 and out["invariants/violating_rows"] == 0
    tracer.close()
    assert tracer.prefetch._thread is None


def test_a_field_summary_made_later_is_summarize_and_holds_no_array():
    """records.Summary: the step reads the traced rows; the summary, made in the writer's job after the
    array is gone, is the one summarize() makes from the array itself."""
    from rljax.trace.fields import read, summarize, summary_of
    from rljax.trace.observers.records import Summary

    x = _sharded(jnp.arange(32.0).reshape(8, 4) / 7)
    rows, mask = np.array([2, 3]), np.array([[1, 1, 0, 0], [1, 1, 1, 0]])
    valid, pad = np.arange(8), np.zeros(8, bool)
    want = summarize("advantages", x, producer="advantages", consumers=["actor_minibatch"], rows=rows,
                     valid_length=valid, mask_rows=mask, is_padding=pad, values=True)
    got = read(x, rows, values=True)
    s = Summary({"name": "advantages", "shape": [8, 4]},
                lambda: summary_of("advantages", got, producer="advantages", consumers=["actor_minibatch"], rows=rows,
                                   valid_length=valid[rows], mask_rows=mask, is_padding=pad[rows]))
    ref = weakref.ref(x)
    del x
    gc.collect()
    assert ref() is None and dict(s) == {"name": "advantages", "shape": [8, 4]}
    assert s.complete() == want and want["row_mean"] and want["sharding"]["owner_devices"] == [2, 3]


def test_the_copies_cpu_is_counted_once():
    """The thread's CPU seconds in copies (``trace/background_s``), taken once."""
    import rljax.trace.prefetch as P

    orig = P.host_copy

    def slow(a):  # a copy that burns 50 ms of CPU
        import time

        t = time.thread_time()
        while time.thread_time() - t < 0.05:
            pass
        return orig(a)

    p = Prefetch()
    P.host_copy = slow
    try:
        p.put([_sharded(jnp.arange(8.0))])
        p.wait()
    finally:
        P.host_copy = orig
    spent = p.take_cpu()
    assert 0.045 <= spent < 0.15, spent
    assert p.take_cpu() == 0.0
    p.close()
