"""The generative judge (``reward.judge``, issue 26 item 4): template and parser checks, verdict
scoring with errors and unparseable verdicts counted, misuse as one line (exit 2), and a tiny
fitted judge (:mod:`judge_helper`) that answers a known verdict through the rollout engine."""

import dataclasses

import numpy as np
import pytest

from rljax.config import ConfigError, resolve
from rljax.reward import RewardError, check, check_judge_template, first_number, load_judge_parse, parse_verdicts


def _cfg(*overrides):
    return resolve("default", list(overrides))[0]


@pytest.mark.parametrize("text, value", [("7", 7.0), ("Score: 7/10", 7.0), ("-2.5 points", -2.5), ("1e3", 1000.0),
                                         ("no digits", None), ("", None)])
def test_first_number_is_the_default_parser(text, value):
    assert first_number(text) == value


def test_templates_must_read_the_response():
    check_judge_template("{prompt}{response}?")
    check_judge_template("Q: {prompt}\nA: {response}\nTruth: {answer}\nVerdict:")
    with pytest.raises(ConfigError, match=r"has no \{response\} placeholder") as e:
        check_judge_template("{prompt} judge this")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"names \{solution\}; accepted fields"):
        check_judge_template("{solution}{response}")
    with pytest.raises(ConfigError, match="not a valid format string"):
        check_judge_template("{response")


def test_verdicts_parse_and_failures_are_counted():
    def parse(text):
        if text == "boom":
            raise ValueError("bad verdict")
        return None if text == "?" else float(text)

    texts = ["1", "0.5", "?", "boom", "", "2"]
    keys = [f"u{i}_0_0" for i in range(6)]
    pad = [False, False, False, False, True, False]
    scores, status, report = parse_verdicts(parse, texts, keys, max_error_fraction=0.5, is_padding=pad,
                                            truncated=[False, True, False, False, True, False], prompt_truncated=1)
    np.testing.assert_array_equal(scores, np.float32([1, 0.5, 0, 0, 0, 2]))
    assert status == ["ok", "ok", "unparseable", "error", "", "ok"]
    assert (report.num_scored, report.errors, report.unparseable, report.truncated) == (5, 1, 1, 1)
    assert report.first_error == "u2_0_0: unparseable verdict '?'"
    m = report.metrics()
    assert m["reward/judge/errors"] == 1 and m["reward/judge/unparseable"] == 1
    assert m["reward/judge/error_fraction"] == pytest.approx(0.4) and m["reward/judge/prompt_truncated"] == 1
    with pytest.raises(RewardError, match=r"failed to parse for 2/5 rows \(1 error\(s\), 1 unparseable\)") as e:
        parse_verdicts(parse, texts, keys, max_error_fraction=0.2, is_padding=pad)
    assert "\n" not in str(e.value)
    # a non-finite or non-number verdict score is an error, not a reward
    _, status, report = parse_verdicts(lambda t: float("nan") if t == "n" else "x", ["n", "s"], ["a", "b"],
                                       max_error_fraction=1.0)
    assert status == ["error", "error"] and report.errors == 2


def test_parse_functions_are_checked(tmp_path):
    assert load_judge_parse(None) is first_number
    f = tmp_path / "parse.py"
    f.write_text("fn = 3\ndef two(a, b):\n    return 1.0\ndef good(text):\n    return float(text)\n")
    with pytest.raises(ConfigError, match="'fn' is not callable"):
        load_judge_parse(f"{f}:fn")
    with pytest.raises(ConfigError, match=r"must take the judge's text as its one argument"):
        load_judge_parse(f"{f}:two")
    assert load_judge_parse(f"{f}:good")("3") == 3.0


@pytest.mark.parametrize("overrides, match", [
    (["reward.judge.path=/nonexistent/judge"], "neither ref nor a Hugging Face checkpoint directory"),
    (["reward.judge.path=ref", "reward.judge.prompt_template=no placeholder"], r"no \{response\} placeholder"),
    (["reward.judge.path=ref", "trainer.mode=async"], "reward.judge.path with trainer.mode=async is not supported"),
    (["reward.judge.path=ref", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score"],
     "reward.judge.path with algorithm.filter_groups.metric=score is not supported"),
])
def test_judge_misuse_is_one_config_error_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        check(_cfg(*overrides))
    assert "\n" not in str(e.value)


def test_the_judge_with_the_filter_keeping_by_the_rule_is_accepted():
    check(_cfg("reward.judge.path=ref", "algorithm.filter_groups.enable=true"))  # metric=acc, the default


def test_a_parse_function_that_is_not_callable_exits_2_before_writing(tmp_path):
    from launching import launch

    f = tmp_path / "parse.py"
    f.write_text("verdict = 'not a function'\n")
    with pytest.raises(ConfigError, match="'verdict' is not callable"):  # probed in a child process
        check(_cfg("reward.judge.path=ref", f"reward.judge.parse={f}:verdict"))
    out = launch("--run-dir", str(tmp_path / "run"), "reward.judge.path=ref", f"reward.judge.parse={f}:verdict",
                 timeout=120)
    assert out.returncode == 2 and "is not callable" in out.stderr and out.stderr.count("\n") == 1, out.stderr[-2000:]
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------- a fitted judge


@pytest.fixture(scope="module")
def fitted_judge(tmp_path_factory):
    """The tiny judge of :mod:`judge_helper`, saved as a Qwen2ForCausalLM checkpoint."""
    from judge_helper import fit_judge

    from rljax.models.hf import save_hf_checkpoint

    config, params, loss = fit_judge()
    path = tmp_path_factory.mktemp("judge")
    save_hf_checkpoint(str(path), config, params)
    return str(path), loss


@dataclasses.dataclass
class _Prompt:
    prompt: str
    answer: str
    ids: tuple = ()


@pytest.mark.slow  # fitting the judge takes ~10 s on an idle 2-core machine, 30 s under load
def test_a_fitted_judge_answers_its_known_verdict_on_the_engine(fitted_judge, tmp_path):
    """The judge repeats the response's last character: verdicts follow what each row wrote, an
    unparseable one (a letter) and a parser error are counted, padding rows are not judged."""
    import jax

    from judge_helper import TEMPLATE
    from rljax.rollout import Trajectories
    from rljax.tokenizer import CharTokenizer
    from rljax.trainer.judge import Judge

    path, loss = fitted_judge
    assert loss < 0.05, f"the judge did not fit (loss {loss})"
    parse = tmp_path / "parse.py"
    parse.write_text("def digit(text):\n    if text == '9':\n        raise ValueError('nine is not a verdict')\n"
                     "    return float(text) if text.isdigit() else None\n")
    cfg = _cfg(f"reward.judge.path={path}", f"reward.judge.prompt_template={TEMPLATE}",
               f"reward.judge.parse={parse}:digit", "reward.judge.response_length=4", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
               "rollout.n=2", "reward.max_error_fraction=0.5")
    check(cfg)
    tok = CharTokenizer()
    judge = Judge.from_config(cfg, policy_config=None, policy_tokenizer=tok, devices=jax.devices()[:1],
                              initial_params=lambda: pytest.fail("path is a checkpoint, not ref"))
    prompts = [_Prompt("1+2=", "3"), _Prompt("4+4=", "8"), _Prompt("5+0=", "5"), _Prompt("2+2=", "4")]
    responses = ["3", "17", "x", "5", "9", "ab4", "2", ""]
    pad = np.array([False] * 7 + [True])
    t = 4
    ids = np.full((8, t), tok.pad_id, np.int32)
    lengths = np.zeros(8, np.int32)
    for i, r in enumerate(responses):
        enc = tok.encode(r, add_eos=not pad[i])
        ids[i, :len(enc)], lengths[i] = enc, len(enc)
    traj = Trajectories(
        prompt_ids=np.zeros((8, 1), np.int32), prompt_mask=np.ones((8, 1), bool), response_ids=ids,
        response_mask=np.arange(t)[None] < lengths[:, None], loss_mask=np.arange(t)[None] < lengths[:, None],
        rollout_logp=np.zeros((8, t), np.float32), prompt_length=np.ones(8, np.int32), response_length=lengths,
        truncated=np.zeros(8, bool), group_id=np.arange(8, dtype=np.int32) // 2, min_version=np.zeros(8, np.int32),
        max_version=np.zeros(8, np.int32), is_padding=pad, queue_s=np.zeros(8, np.float32),
        prefill_s=np.zeros(8, np.float32), decode_s=np.zeros(8, np.float32),
        uid=tuple(f"0-{i // 2}" for i in range(8)), session=tuple(i % 2 for i in range(8)), index=(0,) * 8,
        decode=judge.decode, stats=None, num_groups=4, pad_id=tok.pad_id)
    assert judge.inputs(traj, prompts, policy_tokenizer=tok)[1] == "1+2=17?"
    out = judge(traj, prompts, policy_tokenizer=tok, max_error_fraction=0.5)
    assert out["judge_texts"] == ("3", "7", "x", "5", "9", "4", "2", "")
    assert out["judge_status"] == ("ok", "ok", "unparseable", "ok", "error", "ok", "ok", "")
    np.testing.assert_array_equal(out["judge_scores"], np.float32([3, 7, 0, 5, 0, 4, 2, 0]))
    r = out["judge_report"]
    assert (r.num_scored, r.errors, r.unparseable, r.truncated) == (7, 1, 1, 0)


PARSE_DIGIT = "def digit(text):\n    return float(text) if text.isdigit() else None\n"


@pytest.mark.slow
def test_grpo_with_only_the_judges_reward_runs_and_its_verdicts_are_traced(fitted_judge, tmp_path):
    import json

    from judge_helper import CHARS, TEMPLATE
    from launching import launch, train_rows

    from rljax.trace.check import run_checks

    path, _ = fitted_judge
    parse = tmp_path / "parse.py"
    parse.write_text(PARSE_DIGIT)
    run = tmp_path / "run"
    out = launch("--run-dir", str(run), "--mesh=dp2", "data.train_batch_size=4", "rollout.n=4",
                 "actor.ppo_mini_batch_size=4", "trainer.total_steps=2", "trainer.val_before_train=false",
                 "trainer.test_freq=0", f"reward.judge.path={path}", f"reward.judge.prompt_template={TEMPLATE}",
                 f"reward.judge.parse={parse}:digit", "reward.judge.response_length=4",
                 "reward.combine.function_weight=0", "reward.max_error_fraction=1.0", "trace.log_train_generations=16",
                 "trace.groups=4", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = train_rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # the step's reward is the judge's parsed verdict alone (function_weight=0, no penalty)
        assert r["critic/score/mean"] == pytest.approx(r["reward/judge/mean"], abs=1e-6)
        assert r["reward/judge/errors"] == 0 and 0 <= r["reward/judge/unparseable"] <= 16
        assert "timing_s/reward_judge" in r and "reward/function/mean" in r  # the rule, logged beside
    gens = [g for g in map(json.loads, open(run / "generations.jsonl")) if g["split"] == "train"]  # val: 4 by default
    assert len(gens) == 32
    judged = 0
    for g in gens:  # the fitted judge repeats the last character it read: the response's, or the prompt's '='
        last = (g["prompt"] + g["response"])[-1]
        if last in CHARS:
            judged += 1
            assert g["judge"] == last, g
            assert g["judge_score"] == (float(last) if last.isdigit() else 0.0) == g["reward"], g
    assert judged >= 4, gens  # the random policy writes any character; 6 of the 32 end in one the judge was fit on
    recs = [json.loads(line) for line in open(run / "trace.jsonl")]
    verdicts = [v for r in recs if r.get("stage") == "reward_judge" for v in r["verdicts"]]
    assert len(verdicts) == 2 * 4 * 4  # every traced group's rows, both steps
    for v in verdicts:
        assert v["status"] in ("ok", "unparseable") and v["key"].count("_") == 2
        assert v["score"] == (float(v["text"]) if v["status"] == "ok" else 0.0)
    checks = {name: (status, detail) for status, name, detail in run_checks(str(run))}
    assert all(s != "FAIL" for s, _ in checks.values()), {k: v for k, v in checks.items() if v[0] == "FAIL"}


@pytest.mark.slow
def test_the_judge_with_dynamic_sampling_judges_the_kept_rows_and_combines(fitted_judge, tmp_path):
    """algorithm.filter_groups (metric=acc: the rule's score decides which groups are kept) with the
    judge: the judge reads the trained (kept) rows and the step's reward is rule + 0.5 x verdict
    every step; groups were dropped, every batch is full and the trace check (no dropped uid
    trained, the reward tie on the combined score) passes."""
    from judge_helper import TEMPLATE
    from launching import launch, train_rows

    from rljax.trace.check import run_checks

    path, _ = fitted_judge
    parse = tmp_path / "parse.py"
    parse.write_text(PARSE_DIGIT)
    run = tmp_path / "run"
    out = launch("--run-dir", str(run), "--mesh=dp2", "data.train_batch_size=4", "rollout.n=4",
                 "actor.ppo_mini_batch_size=4", "trainer.total_steps=2", "trainer.val_before_train=false",
                 "trainer.test_freq=0", f"reward.judge.path={path}", f"reward.judge.prompt_template={TEMPLATE}",
                 f"reward.judge.parse={parse}:digit", "reward.judge.response_length=4", "reward.combine.judge_weight=0.5",
                 "reward.max_error_fraction=1.0", "algorithm.filter_groups.enable=true",
                 "algorithm.filter_groups.max_num_gen_batches=0", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = train_rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train/kept_groups"] == 4
        assert r["critic/score/mean"] == pytest.approx(r["reward/function/mean"] + 0.5 * r["reward/judge/mean"], abs=1e-6)
    assert sum(r["train/dropped_groups"] for r in rows) > 0, "no group dropped: the filter is untested here"
    checks = {name: (status, detail) for status, name, detail in run_checks(str(run))}
    assert checks["no dropped group trained (dynamic sampling)"][0] == "PASS"
    assert all(s != "FAIL" for s, _ in checks.values()), {k: v for k, v in checks.items() if v[0] == "FAIL"}


@pytest.mark.parametrize("lora", [False, True])
def test_ref_is_the_policys_initial_weights(lora):
    """``reward.judge.path=ref`` with no reference copy kept rebuilds the policy's initial weights
    (a LoRA run's base): exactly the trainer's."""
    import jax

    from rljax.models.lora import disable
    from rljax.sharding import make_mesh
    from rljax.tokenizer import CharTokenizer
    from rljax.trainer.judge import initial_policy_params
    from rljax.trainer.build import policy_params

    cfg = _cfg("reward.judge.path=ref", *(["actor.lora.rank=4"] if lora else []))
    mesh = make_mesh({"dp": 2}, jax.devices()[:2])
    config, _, params, _ = policy_params(cfg, mesh, CharTokenizer())
    rebuilt = initial_policy_params(cfg, config, mesh)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(disable(params)), jax.device_get(rebuilt))


#: The lookup tool task judged by the fitted judge alone (function_weight=0), one step of 4 prompts x
#: 4 sessions on dp4, every group traced, the first 10 rows logged (process 0's 8 and 2 of process 1's).
def _episode_args(path, parse):
    from judge_helper import TEMPLATE

    return ["--config", "tool_lookup", "--mesh=dp4", "data.train_batch_size=4", "rollout.n=4",
            "actor.ppo_mini_batch_size=4", "trainer.total_steps=1", "trainer.val_before_train=false",
            "trainer.test_freq=0", f"reward.judge.path={path}", f"reward.judge.prompt_template={TEMPLATE}",
            f"reward.judge.parse={parse}:digit", "reward.judge.response_length=4", "reward.combine.function_weight=0",
            "reward.max_error_fraction=1.0", "trace.groups=4", "trace.log_train_generations=10",
            "trace.rollout_dump=true"]


def _judge_records(run):
    import json

    return {r["uid"]: r for r in map(json.loads, open(run / "trace.jsonl")) if r.get("stage") == "reward_judge"}


@pytest.mark.slow
def test_the_judge_reads_whole_episodes_and_splits_over_processes_like_one(fitted_judge, tmp_path):
    """env.function (the lookup tool task): the judge reads prompt + the whole episode (tool calls
    and observations included) and its parsed verdict is the step's reward (function_weight=0):
    every row judged, each score its verdict's, the trace check passes (the reward tie on the
    combined score included). On 2 processes x 2 devices each process runs and judges its share of
    the episodes; the verdict reports are merged (every reward/judge/* metric, the trace's batch
    report), the training generations log holds every process's rows, all as the one-process run's."""
    import json
    import math
    import os
    import subprocess

    from launching import REPO, launch, launch_env, train_rows
    from test_launch import _NOT_COMPARED

    from rljax.trace.check import run_checks

    path, _ = fitted_judge
    parse = tmp_path / "parse.py"
    parse.write_text(PARSE_DIGIT)
    one, two = tmp_path / "one", tmp_path / "two"
    out = launch("--run-dir", str(one), *_episode_args(path, parse), timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = train_rows(one)
    assert row["critic/score/mean"] == pytest.approx(row["reward/judge/mean"], abs=1e-6)
    assert "env/num_turns/mean" in row and row["reward/judge/errors"] == 0
    verdicts = [v for r in _judge_records(one).values() for v in r["verdicts"]]
    assert len(verdicts) == 16
    for v in verdicts:
        assert v["status"] in ("ok", "unparseable")
        assert v["score"] == (float(v["text"]) if v["status"] == "ok" else 0.0)
    checks = {name: (status, detail) for status, name, detail in run_checks(str(one))}
    assert all(s != "FAIL" for s, _ in checks.values()), {k: v for k, v in checks.items() if v[0] == "FAIL"}
    inv = json.loads((one / "trace_summary.json").read_text())["invariants"]
    assert inv["scores_tied"] and inv["violating_rows"] == 0, inv

    res = subprocess.run(["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "2", "--run-dir", str(two),
                          *_episode_args(path, parse)], cwd=REPO, env=launch_env(), capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    topo = json.loads((two / "topology.json").read_text())
    assert topo["rollout_share"]["prompts_by_process"] == {"0": [0, 2], "1": [2, 4]}, topo["rollout_share"]
    for p in (0, 1):  # each process ran (and judged) its own episodes only
        uids = set(np.load(two / "rollouts" / f"process{p}" / "step1.npz")["uid"].tolist())
        assert uids == {f"1-{i}" for i in range(2 * p, 2 * p + 2)}, (p, uids)
    (row2,) = train_rows(two)
    compared = 0
    for key, va in row.items():
        if key.startswith(_NOT_COMPARED) or not isinstance(va, (int, float)):
            continue
        assert key in row2, key
        assert math.isclose(va, row2[key], rel_tol=1e-5, abs_tol=1e-6), (key, va, row2[key])
        compared += key.startswith("reward/judge/")
    assert compared == 8, compared  # mean, max, min, errors, unparseable, error_fraction, truncated, prompt_truncated
    assert row["reward/judge/unparseable"] > 0 or row["reward/judge/min"] < row["reward/judge/max"], row
    # process 0 traces its own groups: their verdicts as one process's, and the batch report is the merged one
    rec_one, rec_two = _judge_records(one), _judge_records(two)
    assert sorted(rec_two) == ["1-0", "1-1"] and set(rec_two) <= set(rec_one)
    for uid, r in rec_two.items():
        assert r["verdicts"] == rec_one[uid]["verdicts"] and r["batch"] == rec_one[uid]["batch"], uid
    # the training generations log: process 0 wrote the batch's first 10 rows, process 1's included
    gens = [[json.loads(x) for x in open(run / "generations.jsonl")] for run in (one, two)]
    assert len(gens[0]) == 10 and [g["uid"] for g in gens[0]].count("1-2") == 2
    assert gens[1] == gens[0]
    checks = {name: (status, detail) for status, name, detail in run_checks(str(two))}
    assert all(s != "FAIL" for s, _ in checks.values()), {k: v for k, v in checks.items() if v[0] == "FAIL"}
