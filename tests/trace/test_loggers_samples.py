"""Experiment loggers (trainer.logger) and sample completions (issue 25, frictions 1 and 5):
wandb offline and a local MLflow store get the metrics.jsonl names, the config and the sample
tables; generations.jsonl and 'python -m rljax.trace samples' show what the policy wrote."""

import json
import types

import numpy as np
import pytest

from rljax.config import resolve
from rljax.data import Prompt
from rljax.trace.samples import SampleLog, main as samples_main, read_samples, sample_rows

from wandb_offline import offline_run

METRICS = {1: {"actor/pg_loss": 0.5, "actor/ppo_kl": 0.01, "critic/score/mean": 0.25, "timing_s/gen": 1.5},
           2: {"actor/pg_loss": 0.4, "actor/ppo_kl": 0.02, "critic/score/mean": 0.5, "timing_s/gen": 1.25,
               "val/score/mean": 0.75}}


def _traj(n=4, pad_last=True):
    return types.SimpleNamespace(
        is_padding=np.array([False] * (n - 1) + [pad_last]), group_id=np.array([0, 0, 1, 1][:n]),
        uid=tuple(f"u{i // 2}" for i in range(n)), session=tuple(i % 2 for i in range(n)),
        response_ids=np.array([[5, 6, 7], [8, 9, 0], [1, 2, 3], [4, 4, 4]][:n]), response_length=np.array([3, 2, 1, 3][:n]))


PROMPTS = [Prompt(0, 0, "1+1=", (1,), "2", False, "openai/gsm8k", {}), Prompt(1, 1, "2+2=", (1,), "4", False)]


def _decode(ids):
    return "".join(chr(ord("a") + int(i)) for i in ids)


def test_sample_rows_skip_padding_and_carry_prompt_answer_reward():
    rows = sample_rows(_traj(), PROMPTS, [1.0, 0.0, 0.5, 9.0], decode=_decode, step=3, split="val", limit=10)
    assert [r["uid"] for r in rows] == ["u0", "u0", "u1"] and [r["session"] for r in rows] == [0, 1, 0]
    assert rows[0] == {"step": 3, "split": "val", "uid": "u0", "session": 0, "prompt": "1+1=", "response": "fgh",
                       "reward": 1.0, "ground_truth": "2", "data_source": "openai/gsm8k"}
    assert rows[2]["response"] == "b" and "data_source" not in rows[2]
    assert len(sample_rows(_traj(), PROMPTS, [0.0] * 4, decode=_decode, step=3, split="val", limit=2)) == 2


def test_samples_cli_prints_a_step_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    log = SampleLog(str(tmp_path))
    for step in (2, 4):
        log.write("val", step, sample_rows(_traj(), PROMPTS, [step / 4] * 4, decode=_decode, step=step, split="val",
                                           limit=2))
    assert len(read_samples(str(tmp_path))) == 4
    assert samples_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step 4 val uid u0 session 0: reward 1.000, ground truth '2'" in out and "step 2" not in out
    assert "--- prompt\n1+1=\n--- response\nfgh" in out
    assert samples_main([str(tmp_path), "--step", "2"]) == 0 and "reward 0.500" in capsys.readouterr().out
    assert samples_main([str(tmp_path), "--step", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["python -m rljax.trace samples: error: no samples at step 3; steps with samples: 2, 4"]
    assert samples_main([str(tmp_path / "nope")]) == 2
    assert samples_main([str(tmp_path), "--step", "x"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "python -m rljax.trace samples: error: argument --step: invalid int value: 'x'"


def test_trace_cli_dispatches_samples(tmp_path, capsys):
    from rljax.trace.__main__ import main

    assert main(["samples", str(tmp_path)]) == 2
    assert "holds no samples; run with trainer.log_val_generations=N" in capsys.readouterr().err


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """A run's logs written through open_run_logs with every logger on (wandb offline, MLflow in the run dir)."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from rljax.trace.loggers import open_run_logs

    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg, _ = resolve(None, ["trainer.logger=[console,tensorboard,wandb,mlflow]", "trainer.experiment_name=t1"])
    run = tmp_path_factory.mktemp("logged") / "run"
    run.mkdir()
    metrics, samples = open_run_logs(cfg, str(run))
    for step, m in METRICS.items():
        metrics.write(step, m)
    rows = sample_rows(_traj(), PROMPTS, [1.0, 0.0, 0.5, 0.0], decode=_decode, step=2, split="val", limit=3)
    samples.write("val", 2, rows)
    metrics.close()
    yield run, rows
    mp.undo()


@pytest.mark.slow  # wandb's service process and MLflow's store: ~30 s on this machine
def test_wandb_offline_gets_metrics_config_and_the_sample_table(logged_run):
    run, rows = logged_run
    names = {k for line in open(run / "metrics.jsonl") for k in json.loads(line) if k != "step"}
    got = offline_run(str(run))
    logged = {k for h in got["history"] for k in h if not k.startswith("_")}
    assert names <= logged and any(k.startswith("val/generations") for k in logged), (names - logged, logged)
    by_step = {h["_step"]: h for h in got["history"]}
    assert by_step[2]["actor/pg_loss"] == 0.4 and by_step[1]["timing_s/gen"] == 1.5
    assert got["config"]["trainer.experiment_name"] == "t1" and got["config"]["data.dataset"] == "embedded"
    (table,) = [t for t in got["tables"] if "/val/" in t]
    data = json.load(open(table))
    assert data["columns"][:6] == ["step", "split", "uid", "session", "prompt", "response"]
    assert [r[5] for r in data["data"]] == [r["response"] for r in rows]
    assert (run / "tensorboard").is_dir() and (run / "generations.jsonl").is_file()


@pytest.mark.slow
def test_mlflow_local_store_gets_metrics_config_and_the_sample_table(logged_run):
    from mlflow.tracking import MlflowClient

    run, rows = logged_run
    client = MlflowClient(tracking_uri=f"sqlite:///{run}/mlflow.db")
    (exp,) = [e for e in client.search_experiments() if e.name == "rljax"]
    (r,) = client.search_runs([exp.experiment_id])
    names = {k for line in open(run / "metrics.jsonl") for k in json.loads(line) if k != "step"}
    assert set(r.data.metrics) == names
    assert [m.value for m in client.get_metric_history(r.info.run_id, "actor/pg_loss")] == [0.5, 0.4]
    assert r.data.params["trainer.experiment_name"] == "t1" and r.info.run_name == "t1"
    path = client.download_artifacts(r.info.run_id, "generations/val_step2.json", str(run / "dl"))
    table = json.load(open(path))
    assert table["columns"][:3] == ["step", "split", "uid"] and len(table["data"]) == len(rows)


def test_a_logger_that_is_not_installed_is_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch):
    import importlib.util

    from rljax.launch import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    run = tmp_path / "run"
    assert main(["--run-dir", str(run), "trainer.logger=[console,wandb]"]) == 2
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(lines) == 1 and "pip install 'rljax[wandb]'" in lines[0] and not run.exists()


def test_tensorboard_gets_the_metrics_and_the_sample_table(tmp_path):
    """trainer.logger=[console,tensorboard]: what 'tensorboard --logdir' shows, read back with tensorboard itself."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rljax.trace.loggers import open_run_logs

    cfg, _ = resolve(None, ["trainer.logger=[console,tensorboard]"])
    metrics, samples = open_run_logs(cfg, str(tmp_path))
    for step, m in METRICS.items():
        metrics.write(step, m)
    samples.write("val", 2, sample_rows(_traj(), PROMPTS, [1.0, 0.0, 0.5, 0.0], decode=_decode, step=2, split="val",
                                        limit=3))
    metrics.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0}).Reload()
    assert set(acc.Tags()["scalars"]) == {k for m in METRICS.values() for k in m}
    (tag,) = [t for t in acc.Tags()["tensors"] if t.startswith("val/generations")]
    (event,) = acc.Tensors(tag)
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 2 and "| step | split | uid |" in text and "| fgh |" in text
    cfg, _ = resolve(None, ["trainer.logger=[console]"])
    off = tmp_path / "off"
    off.mkdir()
    metrics, samples = open_run_logs(cfg, str(off))
    metrics.write(1, METRICS[1])
    metrics.close()
    assert not (off / "tensorboard").exists() and (off / "metrics.jsonl").is_file()


@pytest.mark.slow  # two one-step runs
def test_progress_lines_only_with_the_console_logger(tmp_path, capsys):
    """trainer.logger without console printed the progress line anyway (verl prints per-step
    metrics only with its console logger)."""
    import jax

    from rljax.sharding import make_mesh
    from rljax.trainer.loop import Trainer

    tiny = ["data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2", "data.embedded.num_train=8",
            "data.embedded.num_test=2", "trainer.total_steps=1", "trace.ledgers=false", "trainer.save_freq=-1"]
    printed = {}
    for loggers in ("[console]", "[tensorboard]"):
        cfg, _ = resolve("default", [*tiny, f"trainer.logger={loggers}"])
        Trainer(cfg, make_mesh("dp1", jax.devices()[:1]), str(tmp_path / loggers[1:-1]), echo=lambda *a: None).run()
        printed[loggers] = capsys.readouterr().err
    assert "step 1/1 | reward" in printed["[console]"]
    assert "step 1/1" not in printed["[tensorboard]"] and (tmp_path / "tensorboard" / "metrics.jsonl").is_file()
