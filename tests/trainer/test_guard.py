"""rljax.trainer.guard and the trace check for skipped updates (issue 11, defects 3 and 6)."""

import json
import os
import signal

import pytest

from rljax.trace.check import Run, check_updates
from rljax.trainer.guard import (
    NONFINITE_ALERT,
    NonFiniteMonitor,
    NonFiniteUpdateError,
    StopSignals,
    cut_metrics,
    describe_nonfinite,
)

NAN = float("nan")


def test_describe_names_the_loss_and_the_gradient_groups():
    assert describe_nonfinite({"loss": NAN, "grad_norm": NAN, "nonfinite_grad/lm_head": 1.0,
                               "nonfinite_grad/layers.attn": 0.5, "nonfinite_grad/embed": 0.0}) == \
        "loss; gradients of layers.attn, lm_head"
    assert describe_nonfinite({"loss": 1.0, "grad_norm": float("inf")}) == "gradient norm"


def test_monitor_logs_each_skip_alerts_and_stops_after_consecutive_skips():
    lines = []
    mon = NonFiniteMonitor(3, echo=lines.append)
    bad = {"loss": 0.5, "grad_norm": NAN, "nonfinite_grad/layers.mlp": 1.0}
    assert mon.observe(1, {"actor": (0, {"loss": 0.1})}) == {}
    assert mon.observe(2, {"actor": (2, bad)}) == {NONFINITE_ALERT: 1.0}
    assert len(lines) == 1 and lines[0].startswith("step 2: update skipped") and "layers.mlp" in lines[0]
    assert "[1/3 consecutive]" in lines[0]
    mon.observe(3, {"actor": (0, {})})  # a good step resets the count
    mon.observe(4, {"actor": (1, bad)})
    mon.observe(5, {"actor": (1, bad), "critic": (0, {})})
    with pytest.raises(NonFiniteUpdateError) as e:
        mon.observe(6, {"actor": (1, bad)})
    assert "3 consecutive steps (through step 6)" in str(e.value) and "trainer.max_skipped_updates=3" in str(e.value)
    assert len(lines) == 4


def test_sigterm_becomes_a_request_while_active():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        assert stop.requested is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def _write_metrics(run_dir, rows):
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")


def test_cut_metrics_keeps_steps_up_to_the_restored_one(tmp_path):
    rows = [{"step": s, "x": s} for s in (0, 1, 2, 3, 4, 4)]
    _write_metrics(tmp_path, rows)
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 5, "x"')  # cut short by a kill
    assert cut_metrics(str(tmp_path), 2) == 4
    assert [json.loads(l)["step"] for l in open(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    assert cut_metrics(str(tmp_path), 2) == 0


def test_trace_check_fails_on_skipped_updates(tmp_path):
    good = [{"step": s, "actor/loss": 0.1, "actor/grad_norm": 1.0, "actor/skipped_updates": 0} for s in (1, 2, 3)]
    _write_metrics(tmp_path, [{"step": 0, "data/prompts_total": 8}, *good])
    status, name, detail = check_updates(Run(str(tmp_path)))
    assert status == "PASS" and name == "updates finite" and "3 step(s)" in detail
    bad = good[:1] + [{"step": 2, "actor/loss": None, "actor/grad_norm": None, "actor/skipped_updates": 1},
                      {"step": 3, "actor/loss": 0.1, "actor/grad_norm": 1.0, "actor/skipped_updates": 2}]
    _write_metrics(tmp_path, bad)
    status, _, detail = check_updates(Run(str(tmp_path)))
    assert status == "FAIL" and "2 of 3 step(s)" in detail and "step 2 (actor/loss, actor/grad_norm null)" in detail
