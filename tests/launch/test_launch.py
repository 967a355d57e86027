"""`python -m rljax.launch`: usage errors, end-to-end smoke runs, resume equivalence.

Every run is a real subprocess (a fresh JAX: the launcher sets the device count itself).
"""

import json
import math
import os
import subprocess
import sys

import pytest
from launching import REPO, assert_same_metrics, launch, launch_env, metrics, train_rows

# A small, fast configuration of the embedded default.
SMALL = ["data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4", "data.embedded.num_train=64",
         "data.embedded.num_test=16", "trainer.test_freq=-1", "trainer.val_before_train=false"]


# ----------------------------------------------------------------------------- usage errors
# Each mistake exits 2 with one line naming the key or file, before the run directory exists
# and before JAX or TensorFlow is imported (test_usage_errors_import_nothing_heavy).

def _gsm8k_dir(root, train, test=("1+1?",), answer="#### 2"):
    root.mkdir(parents=True, exist_ok=True)
    for split, prompts in (("train", train), ("test", test)):
        if prompts is not None:
            with open(root / f"{split}.jsonl", "w") as fh:
                for q in prompts:
                    fh.write(json.dumps({"question": q, "answer": answer}) + "\n")
    return root


def _checkpoint_dir(root, *, vocab_size=96, tokenizer=False):
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"vocab_size": vocab_size, "num_attention_heads": 4}))
    (root / "model.safetensors").write_bytes(b"")
    if tokenizer:
        (root / "tokenizer.json").write_text("{}")
    return root


def _mistakes(tmp):
    """(case id, arguments, fragment of the one-line message) for each user mistake."""
    (tmp / "wrong_sig.py").write_text("def reward(response):\n    return 1.0\n")
    (tmp / "not_an_env.py").write_text("from rljax.env import Environment\n\ndef Echo(turn):\n    return None\n")
    gsm = ["data.dataset=gsm8k", "reward.function=exact_match", "data.train_batch_size=4",
           "actor.ppo_mini_batch_size=4", "rollout.n=2", "data.max_prompt_length=128"]
    long_dir = _gsm8k_dir(tmp / "long", ["a question far longer than the prompt limit"] * 8)
    small_dir = _gsm8k_dir(tmp / "small", ["1+1?"] * 3)
    no_test = _gsm8k_dir(tmp / "no_test", ["1+1?"] * 8, test=None)
    no_key = tmp / "no_key"
    no_key.mkdir()
    (no_key / "train.jsonl").write_text(json.dumps({"prompt": "x", "answer": "1"}) + "\n")
    ckpt_no_tok = _checkpoint_dir(tmp / "ckpt_no_tok")
    ckpt_no_cfg = tmp / "ckpt_no_cfg"
    ckpt_no_cfg.mkdir()
    ckpt_odd_vocab = _checkpoint_dir(tmp / "ckpt_odd_vocab", vocab_size=100)
    return [
        ("actor.optim.lr=abc", ["actor.optim.lr=abc"], "actor.optim.lr"),
        ("nested leaf", ["actor.lr=1e-6"], "did you mean actor.optim.lr?"),
        ("rollout.n=0", ["rollout.n=0"], "rollout.n"),
        ("policy_loss", ["actor.policy_loss=ppo2"], "vanilla"),
        ("mini batch", ["data.train_batch_size=6", "actor.ppo_mini_batch_size=4"], "ppo_mini_batch_size"),
        ("forced on-policy shortcut", ["actor.skip_old_log_prob=true", "actor.ppo_epochs=2"],
         "actor.skip_old_log_prob=true needs an exactly on-policy update, but actor.ppo_epochs=2"),
        ("dp", ["--mesh=dp8", "data.train_batch_size=3", "rollout.n=2", "actor.ppo_mini_batch_size=1"], "dp=8"),
        ("mesh axis", ["--mesh=xp2"], "unknown axis 'xp'"),
        ("mesh size", ["--mesh=dp0"], "positive"),
        ("override", ["overridewithoutequals"], "key=value"),
        ("removed key", ["rollout.calculate_log_probs=true"], "was removed"),
        ("judge key without a judge", ["reward.judge.prompt_template=no placeholder"],
         "reward.judge.prompt_template='no placeholder' is set, but reward.judge.path=null turns the judge off"),
        ("plugin signature", [f"reward.function={tmp}/wrong_sig.py:reward"], "must accept (response, answer"),
        ("plugin relative path", ["reward.function=no/such/reward.py:score"], "file 'no/such/reward.py' not found"),
        ("prompts too long", [*gsm, f"data.path={long_dir}", "data.max_prompt_length=8"],
         "8 of 8 prompts are longer than data.max_prompt_length=8"),
        ("prompts all filtered", [*gsm, f"data.path={long_dir}", "data.max_prompt_length=8",
                                  "data.filter_overlong_prompts=true"], "all 8 prompts are longer"),
        ("dataset smaller than the batch", [*gsm, f"data.path={small_dir}"],
         "3 usable prompts (3 rows: 0 filtered as overlong, 0 with an empty or null answer, 0 with an empty or "
         "null prompt) are fewer than data.train_batch_size=4"),
        ("embedded smaller than the batch", ["data.embedded.num_train=16"], "fewer than data.train_batch_size=32"),
        ("data path missing", [*gsm, f"data.path={tmp}/nowhere"], "is not a directory"),
        ("no test file", [*gsm, f"data.path={no_test}"], "has no test file"),
        ("field missing", [*gsm, f"data.path={no_key}"], "lacks 'question'/'answer'"),
        ("model.path without tokenizer.json", [f"model.path={ckpt_no_tok}"], "has no tokenizer.json"),
        ("model.path without config.json", [f"model.path={ckpt_no_cfg}"], "has no config.json"),
        ("model.path missing", [f"model.path={tmp}/no_ckpt"], "is not a directory"),
        ("tp3 vs char vocabulary", ["--mesh=tp3"], "tp=3 must divide the vocabulary size 88"),
        ("tp16 vs char vocabulary", ["--mesh=tp16"], "tp=16 must divide the vocabulary size 88"),
        ("env file missing", ["env.function=no/such/env.py:Echo"], "file 'no/such/env.py' not found"),
        ("env not a class", [f"env.function={tmp}/not_an_env.py:Echo"], "is not a class with a step(turn) method"),
        ("env neither built-in nor file", ["env.function=lookups"], "is not a built-in environment (lookup, tools)"),
        ("disaggregated without a mesh on CPU", ["rollout.placement=disaggregated", "rollout.num_devices=2"],
         "rollout.placement=disaggregated on a CPU host needs --mesh"),
        ("resume from a checkpoint that is not there", ["--resume=7"], "no checkpoint 7 in"),
        ("tp vs config.json vocabulary", ["--mesh=tp8", f"model.path={ckpt_odd_vocab}", "model.tokenizer=char"],
         "tp=8 must divide the vocabulary size 100 (model.path's config.json"),
    ]


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mistakes")
    return tmp, {case: (args, message) for case, args, message in _mistakes(tmp)}


def _case_ids():
    import pathlib
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return [c for c, _, _ in _mistakes(pathlib.Path(d))]


@pytest.mark.parametrize("case", _case_ids())
def test_usage_errors_exit_2_in_one_line_and_write_nothing(mistakes, case, capsys):
    from rljax.launch import main

    tmp, table = mistakes
    args, message = table[case]
    run_dir = tmp / f"run-{case.replace(' ', '_')}"
    assert main(["--run-dir", str(run_dir), *args]) == 2
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and message in lines[0], err
    assert not run_dir.exists()


def test_usage_errors_import_nothing_heavy(tmp_path):
    """A real process: every mistake exits 2 before JAX, TensorFlow or TFDS is imported (so in
    about a second, whatever the model or dataset size), and before anything is written."""
    code = f"""
import json, pathlib, sys
sys.path[:0] = {[os.path.join(REPO, "tests"), os.path.dirname(os.path.abspath(__file__))]!r}  # helpers; this file
from test_launch import _mistakes
from rljax.launch import main
tmp = pathlib.Path(sys.argv[1])
codes = {{case: main(["--run-dir", str(tmp / "run"), *args]) for case, args, _ in _mistakes(tmp)}}
heavy = [m for m in ("jax", "tensorflow", "tensorflow_datasets", "flax") if m in sys.modules]
print(json.dumps({{"codes": codes, "heavy": heavy}}))
"""
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, env=launch_env(), capture_output=True,
                         text=True, timeout=300)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(report["codes"].values()) == {2}, report
    assert report["heavy"] == [], report
    assert not (tmp_path / "run").exists()


def test_existing_checkpoints_need_resume(tmp_path, capsys):
    from rljax.launch import main

    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    assert main(["--run-dir", str(tmp_path)]) == 2
    assert "--resume" in capsys.readouterr().err
    # trainer.resume_mode=auto is the same as --resume: the refusal goes (the next check fails instead).
    assert main(["--run-dir", str(tmp_path), "trainer.resume_mode=auto", "--mesh=tp3"]) == 2
    assert "tp=3" in capsys.readouterr().err


def test_print_config_prints_every_key_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from rljax.config import field_specs
    from rljax.launch import main

    monkeypatch.chdir(tmp_path)
    assert main(["--print-config", "rollout.n=4", "--run-dir", "elsewhere"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {l.split()[0]: l for l in out[1:]}
    assert set(rows) == set(field_specs())
    assert rows["rollout.n"].split()[1:3] == ["4", "cli"] and "configs/default.yaml 16" in rows["rollout.n"]
    assert rows["trainer.output_dir"].split()[1:3] == ["elsewhere", "cli"]
    assert list(tmp_path.iterdir()) == []
    assert main(["--print-config", "rollout.nn=4"]) == 2  # a mistake is still a usage error


def test_help_points_to_print_config():
    out = launch("--help", timeout=60)
    assert out.returncode == 0 and "--print-config" in out.stdout


def test_run_directory_from_project_and_experiment():
    from rljax.config import resolve
    from rljax.launch import run_directory

    cfg, _ = resolve("default")
    assert run_directory(cfg) == os.path.join("runs", "rljax", "embedded-add")
    cfg, _ = resolve("default", ["trainer.project_name=p", "trainer.experiment_name=e"])
    assert run_directory(cfg) == os.path.join("runs", "p", "e")
    cfg, _ = resolve("default", ["trainer.output_dir=/x/y"])
    assert run_directory(cfg) == "/x/y"


def _check_smoke(run_dir, out):
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]  # data counts at 0; one record per step
    assert "val/score/mean" in rows[2] and "val/score/mean" not in rows[1]  # the final validation in step 2's record
    assert "step 2: val/score/mean = " in out.stdout
    assert rows[0]["data/prompts_total"] == 64 and rows[0]["data/prompts_filtered"] == 0
    rows = rows[1:]
    for r in rows[:2]:
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl", "critic/score/mean",
                    "response_length/mean", "timing_s/gen", "timing_s/update_actor", "timing_s/step",
                    "perf/throughput"):
            assert r[key] is not None and math.isfinite(r[key]), key
    assert rows[1]["training/weight_version"] == 2
    topo = json.loads((run_dir / "topology.json").read_text())
    assert topo["world_size"] == 8 and topo["actor_dp"] == 8 // (topo["mesh"]["tp"] * topo["mesh"]["sp"])
    assert "rollout_tp" in topo and "actor_dp_derivation" in topo
    resolved = (run_dir / "config.resolved.yaml").read_text()
    assert "# from: cli" in resolved
    assert f"  output_dir: {run_dir}  # from: cli" in resolved  # --run-dir: the rerun hint targets this directory
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1", "2"]
    assert (run_dir / "report.png").stat().st_size > 1000
    assert "held-out reward after" in out.stdout
    return rows


def test_smoke_dp8(small_dp8_run):
    _check_smoke(*small_dp8_run)  # the run test_trace_run also reads


#: PPO with GAE's critic, KL in the reward and as a loss: the run of ``gae_kl_dp2_tp2_sp2_run`` (tests/conftest.py),
#: which the smoke checks on dp2,tp2,sp2, test_ppo_with_gae_and_kl and tests/trace/test_trace_run.py's check share.
GAE_KL = ["algorithm.adv_estimator=gae", "algorithm.lam=0.95", "actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true"]


@pytest.mark.slow
def test_smoke_dp2_tp2_sp2(gae_kl_dp2_tp2_sp2_run):
    """The smoke checks on a mesh with every axis (the shared run's algorithm is PPO with GAE and KL;
    the default GRPO's mesh invariance on dp2,tp2,sp2: tests/trainer/test_trainer_step.py)."""
    _check_smoke(*gae_kl_dp2_tp2_sp2_run)


@pytest.mark.slow
def test_resume_gives_the_uninterrupted_metrics(tmp_path):
    base = ["--mesh=dp2", *SMALL, "trainer.save_freq=2"]
    full = launch("--run-dir", str(tmp_path / "full"), *base, "trainer.total_steps=4")
    assert full.returncode == 0, full.stderr[-3000:]
    half = launch("--run-dir", str(tmp_path / "half"), *base, "trainer.total_steps=2")
    assert half.returncode == 0, half.stderr[-3000:]
    resumed = launch("--run-dir", str(tmp_path / "half"), "trainer.resume_mode=auto", *base, "trainer.total_steps=4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "restored step 2" in resumed.stdout
    from rljax.trace import read_metrics

    a = {r["step"]: r for r in read_metrics(str(tmp_path / "full"))}  # records of a step merged
    b = {r["step"]: r for r in read_metrics(str(tmp_path / "half"))}
    for step in (3, 4):
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean"):
            assert math.isclose(a[step][key], b[step][key], rel_tol=1e-5, abs_tol=1e-6), (step, key)
    from rljax.trace.check import run_checks

    # a finished run resumed with a raised trainer.total_steps trains on; its provenance (the recorded
    # file, then the command line) and its trace pass the check
    results = {name: (status, detail) for status, name, detail in run_checks(str(tmp_path / "half"))}
    assert not [r for r in results.items() if r[1][0] == "FAIL"], results
    assert results["config provenance recorded"][0] == "PASS"


def _rollouts(run_dir):
    """``{(step, uid, session): (prompt ids, response ids)}`` of every process's ``trace.rollout_dump``
    files, and how many times each key was generated."""
    import glob

    import numpy as np

    out, seen = {}, {}
    for path in sorted(glob.glob(os.path.join(str(run_dir), "rollouts", "process*", "step*.npz"))):
        step = int(os.path.basename(path)[4:-4])
        z = np.load(path)
        for i, (uid, session) in enumerate(zip(z["uid"], z["session"])):
            if z["is_padding"][i]:
                continue
            key = (step, str(uid), int(session))
            seen[key] = seen.get(key, 0) + 1
            out[key] = (z["prompt_ids"][i].tolist(), z["response_ids"][i][: z["response_length"][i]].tolist())
    return out, seen


#: Logged metrics compared between the runs: every metric of the batch (the rollout's, the
#: learner's, the reward report); not timings, throughput, memory or queue waits.
_NOT_COMPARED = ("timing_s/", "perf/throughput", "perf/e2e_tokens_per_s", "perf/rollout_tokens_per_s", "perf/mfu",
                 "trace/", "memory/", "async/learner_wait_s", "async/rollout_wait_s", "async/queue_depth",
                 "comm_s/", "perf/step_time_by_process", "perf/slowest_process", "perf/step_time_max_over_min",
                 "perf/batch_bytes", "invariants/",
                 "rollout/slot_occupancy")  # the process's own engine: its slots hold its share, from other lengths


#: verl's compute_score dict with extras (reward/extra/acc, reward/extra/chars; "pred" a string, not logged).
DICT_REWARD = '''
from rljax.reward import embedded_reward


def reward(response, answer, **extra):
    score = embedded_reward(response, answer)
    return {"score": score, "acc": float(score == 1.0), "chars": float(len(response)), "pred": response[:4]}
'''


@pytest.fixture(scope="module")
def dict_reward(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "dict_reward.py"
    path.write_text(DICT_REWARD)
    return f"reward.function={path}:reward"


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """The one-process synchronous run of a mesh (shared by the sync and async comparisons)."""
    runs = {}

    def get(mesh, args):
        if mesh not in runs:
            run_dir = tmp_path_factory.mktemp("one") / mesh.replace(",", "_")
            out = launch("--run-dir", str(run_dir), *args)
            assert out.returncode == 0, out.stderr[-3000:]
            runs[mesh] = run_dir
        return runs[mesh]

    return get


@pytest.mark.slow
# (sync, dp4, direct) is not a case of its own: async at max_staleness=0 over dp4 runs the same
# direct assembly against the same one-process run, and the tool task's two-process test
# (tests/trainer/test_two_process_rollouts.py) runs synchronous dp4 over two processes.
@pytest.mark.parametrize("mode, mesh, assembly", [("async", "dp4", "direct"), ("sync", "tp4", "gathered")])
def test_two_local_processes_match_one_process(tmp_path, one_process_run, dict_reward, mode, mesh, assembly):
    """launch/local_multiprocess.sh: 2 processes x 2 CPU devices, CPU collectives. Each
    process generates half of the prompt groups: the union of their trajectories is the one-process
    run's (uids, sessions, token ids), none is generated twice, and every batch metric matches the
    one-process run with 4 devices, synchronous (tp4) and async with max_staleness=0 (dp4, the
    deterministic schedule). With dp across the processes each builds the global batch from its own rows
    (``direct``); with dp1 (tp4: every device holds every row) the token arrays are gathered.
    The trace records which process generated which uids, and its check passes. The reward returns
    verl's dict: its extras (reward/extra/*, each process scoring its own rows) match too; before,
    2 processes logged none."""
    args = [f"--mesh={mesh}", *SMALL, "trainer.total_steps=2", "trace.rollout_dump=true", dict_reward]
    one = one_process_run(mesh, args)  # synchronous: async at max_staleness=0 must match it too
    if mode == "async":
        args += ["trainer.mode=async", "async_training.max_staleness=0"]
    two = subprocess.run(["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "2",
                          "--run-dir", str(tmp_path / "two"), *args],
                         cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=900)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    topo = json.loads((tmp_path / "two" / "topology.json").read_text())
    assert topo["process_count"] == 2 and topo["world_size"] == 4 and topo["devices_per_process"] == 2
    share = topo["rollout_share"]
    assert share["prompts_by_process"] == {"0": [0, 4], "1": [4, 8]} and share["assembly"] == assembly, share
    assert "rollout across 2 processes: 4 prompt groups each" in two.stdout

    # The union of the two processes' trajectories is the one-process rollout; none twice.
    ref, ref_seen = _rollouts(one)
    got, seen = _rollouts(tmp_path / "two")
    assert len(ref) == 2 * 8 * 4 and set(ref_seen.values()) == {1}
    assert set(seen.values()) == {1}, [k for k, c in seen.items() if c > 1][:4]
    assert got.keys() == ref.keys()
    assert all(got[k] == ref[k] for k in ref), [k for k in ref if got[k] != ref[k]][:4]
    per_process = {p: len(os.listdir(tmp_path / "two" / "rollouts" / f"process{p}")) for p in (0, 1)}
    assert per_process == {0: 2, 1: 2}
    for p in (0, 1):  # each process generated its own share only
        import numpy as np

        uids = set(np.load(tmp_path / "two" / "rollouts" / f"process{p}" / "step1.npz")["uid"].tolist())
        assert uids == {f"1-{i}" for i in range(4 * p, 4 * p + 4)}, (p, uids)

    summary = json.loads((tmp_path / "two" / "trace_summary.json").read_text())
    assert summary["rollout"]["uids_by_process"] == {"0": 8, "1": 8}
    lines = [json.loads(x) for x in (tmp_path / "two" / "rollout_uids.jsonl").read_text().splitlines()]
    assert lines[0]["by_process"] == {"0": ["1-0", "1-1", "1-2", "1-3"], "1": ["1-4", "1-5", "1-6", "1-7"]}
    from rljax.trace.check import run_checks

    results = run_checks(str(tmp_path / "two"))
    assert not [r for r in results if r[0] == "FAIL"], results
    assert ("PASS", "no uid generated twice") in [(r[0], r[1]) for r in results]

    a, b = metrics(one), metrics(tmp_path / "two")
    assert_same_metrics(a, b, skip=_NOT_COMPARED)
    # data.trim_prompt_padding: the processes agree on the one-process prompt width (here both
    # halves' longest prompts also bucket alike, so this holds even without the agreement:
    # tests/trainer/test_prompt_trim.py lays out halves of different widths)
    frac = [[r.get("perf/learner_padding_frac") for r in x] for x in (a, b)]
    assert frac[0] == frac[1] and any(f is not None for f in frac[0]), frac
    for key in ("critic/score/mean", "actor/pg_loss", "response_length/mean", "perf/total_num_tokens",
                "val/score/mean", "reward/extra/chars", "reward/extra/acc", "val-core/rljax/embedded/acc/mean@1"):
        assert any(key in r for r in b), key
    if mode == "async":
        assert b[-1]["async/staleness_hist"] == {"0": 32}  # every process's rows, not process 0's


PLUGIN = '''
def reward(response, answer, **extra):
    if answer == "4":
        raise RuntimeError("this reward function cannot score a 4")
    return float(response.strip() == answer)
'''


def _plugin(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(PLUGIN)
    return f"reward.function={path}:reward"


# Reward errors over the limit in one process (one line naming the step, "reward failed" and the first
# error; no traceback): tests/launch/test_reliability_e2e.py, test_an_error_during_a_save_keeps_that_checkpoint.


@pytest.mark.slow
def test_async_over_processes_without_dp_across_them_is_a_usage_error(tmp_path):
    """tp4 over 2 processes puts every row on every process: the batch would be gathered, and the
    asynchronous rollout threads must not communicate."""
    two = subprocess.run(["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "2", "--mesh=tp4",
                          "--run-dir", str(tmp_path / "run"), *SMALL, "trainer.mode=async"],
                         cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=300)
    assert two.returncode == 2, two.stdout[-2000:] + two.stderr[-2000:]
    assert "trainer.mode=async over 2 processes needs dp across the processes" in two.stderr
    assert not (tmp_path / "run" / "topology.json").exists()


@pytest.mark.slow
def test_reward_errors_over_the_limit_stop_every_process(tmp_path):
    """2 processes each score their own rows; the bound applies to the whole batch, so both stop
    at the same step with the same error (the first failure, whichever process scored it)."""
    two = subprocess.run(["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "2", "--mesh=dp4",
                          "--run-dir", str(tmp_path / "run"), *SMALL, _plugin(tmp_path),
                          "reward.max_error_fraction=0.0", "trainer.total_steps=2"],
                         cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert two.returncode == 1, two.stdout[-2000:] + two.stderr[-3000:]
    errors = [line for line in two.stderr.splitlines()
              if line.startswith("rljax.launch: error: step") and "reward failed" in line]
    assert len(errors) == 2, two.stderr[-3000:]  # one line per process, no traceback
    assert "Traceback" not in two.stderr, two.stderr[-3000:]
    assert all("over 2 processes" in e and "cannot score a 4" in e for e in errors), errors
    assert errors[0].split("first error:")[1] == errors[1].split("first error:")[1]


@pytest.fixture(scope="module")
def bypass_run_with_reward_errors(tmp_path_factory):
    """One dp2 run in ``algorithm.bypass_mode`` whose reward plugin fails on some rows, under the error
    limit: shared by the two tests below (the reward's errors and the learner's old log-probs are
    separate stages)."""
    tmp = tmp_path_factory.mktemp("bypass_errors")
    run_dir = tmp / "run"
    out = launch("--mesh=dp2", "--run-dir", str(run_dir), *SMALL, _plugin(tmp), "reward.max_error_fraction=1.0",
                 "algorithm.bypass_mode=true", "trainer.total_steps=2")
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir, out


@pytest.mark.slow
def test_reward_errors_under_the_limit_score_zero_and_are_counted(bypass_run_with_reward_errors):
    run_dir, out = bypass_run_with_reward_errors
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert sum(r["reward/errors"] for r in rows) > 0
    assert all(0 <= r["reward/error_fraction"] < 1 for r in rows)
    assert "cannot score a 4" in out.stderr  # the failing uid is logged


@pytest.mark.slow
def test_ppo_with_gae_and_kl(gae_kl_dp2_tp2_sp2_run):
    run_dir, _ = gae_kl_dp2_tp2_sp2_run  # sp2 (as before, when this test had a dp2,sp2 run of its own) and tp2
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("critic/vf_loss", "critic/values/mean", "critic/returns/mean", "actor/kl_loss", "critic/kl"):
            assert r[key] is not None and math.isfinite(r[key]), key


@pytest.mark.slow
def test_sigkill_during_training_resumes_from_the_last_complete_checkpoint(tmp_path):
    """Kill -9 the run while it saves every step; --resume restarts from a complete checkpoint."""
    import signal
    import time

    run_dir = tmp_path / "run"
    args = ["--mesh=dp2", "--run-dir", str(run_dir), *SMALL, "trainer.save_freq=1"]
    proc = subprocess.Popen([sys.executable, "-m", "rljax.launch", *args, "trainer.total_steps=200"], cwd=REPO,
                            env=launch_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = run_dir / "checkpoints"
    deadline = time.time() + 400
    while time.time() < deadline and not (ckpt.exists() and len([p for p in ckpt.iterdir() if p.name.isdigit()]) >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    complete = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    assert complete, "no checkpoint was written before the kill"
    total = f"trainer.total_steps={complete[-1] + 1}"
    # the newest checkpoint with a digest: the kill may land between the newest one's commit and
    # its digest (CI of 1 Dec took this branch in one slow pass of three); that one is set aside
    digested = [s for s in complete if (ckpt / str(s) / "rljax_digest.json").exists()]
    assert digested, f"no checkpoint of {complete} has a digest"
    resumed = launch("--resume", *args, total)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"restored step {digested[-1]}" in resumed.stdout
    assert ("have no digest" in resumed.stdout) == (digested[-1] != complete[-1])
    assert metrics(run_dir)[-1]["step"] == complete[-1] + 1


@pytest.mark.slow
def test_bypass_mode_trains_on_rollout_log_probs(bypass_run_with_reward_errors):
    run_dir, _ = bypass_run_with_reward_errors
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert "timing_s/old_log_prob" not in r  # no learner pass for old_logp
        assert math.isfinite(r["actor/ppo_kl"]) and math.isfinite(r["actor/pg_loss"])
