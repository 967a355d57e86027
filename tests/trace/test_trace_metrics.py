"""metrics.jsonl / TensorBoard writer and the report plot."""

import json
import math
import os

from rljax.trace import MetricsWriter, plot_report, read_metrics


def test_metrics_jsonl_and_tensorboard(tmp_path):
    w = MetricsWriter(str(tmp_path))
    w.write(1, {"critic/score/mean": 0.25, "actor/ppo_kl": float("nan"), "actor/entropy": 2.0,
                "response_length/mean": 3})
    w.write(2, {"critic/score/mean": 0.5, "val/score/mean": 0.4, "actor/entropy": 1.5})
    w.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert first["step"] == 1 and first["critic/score/mean"] == 0.25
    assert first["actor/ppo_kl"] is None  # non-finite becomes null: the file stays valid JSON
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tensorboard"))
    recs = read_metrics(str(tmp_path))
    assert [r["step"] for r in recs] == [1, 2] and math.isclose(recs[1]["val/score/mean"], 0.4)
    png = plot_report(str(tmp_path))
    assert os.path.getsize(png) > 1000


def test_resumed_run_overwrites_repeated_steps(tmp_path):
    w = MetricsWriter(str(tmp_path), tensorboard=False)
    w.write(1, {"a": 1.0})
    w.write(2, {"a": 2.0})
    w.write(2, {"a": 3.0})  # the step was re-run after a resume
    assert [r["a"] for r in read_metrics(str(tmp_path))] == [1.0, 3.0]
