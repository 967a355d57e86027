"""Discriminative reward models: tiny random ``LlamaForSequenceClassification`` /
``Qwen2ForSequenceClassification`` built with transformers score the same as rljax's backbone
+ score head (left- and right-padded rows, on one device and on a mesh), and rljax's export
reloads in transformers as the same class with the same scores and back bit-identically."""

import jax
import numpy as np
import pytest

pytestmark = pytest.mark.hf
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_tiny import tiny_reward_model  # noqa: E402
from rljax import models  # noqa: E402
from rljax import sharding as sh  # noqa: E402

PAD = 0


def _randomise(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.ndim == 1 and p.shape[0] == model.config.hidden_size else 0.0))
    return model.eval()


def _make(arch, path, num_labels):
    if arch == "llama":
        cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=50000.0,
                                       max_position_embeddings=128, rms_norm_eps=1e-5, num_labels=num_labels,
                                       pad_token_id=PAD)
        model = transformers.LlamaForSequenceClassification(cfg)
    else:
        cfg = transformers.Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=1, rope_theta=1e6,
                                       max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                       num_labels=num_labels, pad_token_id=PAD)
        model = transformers.Qwen2ForSequenceClassification(cfg)
    model = _randomise(model, 3)
    model.save_pretrained(str(path), safe_serialization=True)
    return model, str(path)


def _batch(seed=0):
    """Rows of 12 columns: left-padded prompts, right-padded responses (the learner layout)."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(1, 96, (4, 12)).astype(np.int32)
    mask = np.zeros_like(toks, bool)
    for i, (lo, hi) in enumerate([(0, 12), (3, 12), (2, 9), (5, 7)]):
        mask[i, lo:hi] = True
    toks[~mask] = PAD
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32)
    return toks, mask, pos


def _hf_scores(model, toks, mask, pos):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(toks, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                    position_ids=torch.tensor(pos, dtype=torch.long))
    return out.logits.float().numpy()


@pytest.mark.parametrize("arch,num_labels", [("llama", 1), ("qwen2", 1), ("llama", 3)])
def test_reward_model_scores_equal_transformers(arch, num_labels, tmp_path):
    hf_model, path = _make(arch, tmp_path / arch, num_labels)
    config, head, params, score = models.load_hf_reward_model(path)
    assert head.architecture == type(hf_model).__name__ and head.num_labels == num_labels
    assert score.shape == (config.hidden_size, num_labels)
    graphdef = models.abstract_params(config)[0]
    toks, mask, pos = _batch()
    ours = jax.jit(lambda p, s, t, m, q: models.reward_scores(graphdef, p, s, t, mask=m, positions=q))(
        params, score, toks, mask, pos)
    ref = _hf_scores(hf_model, toks, mask, pos)
    assert ours.shape == ref.shape == (4, num_labels)
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=0, atol=1e-4)

    # export: transformers loads the same class with the same scores; rljax reloads it bit-identically
    out = str(tmp_path / "export")
    models.save_hf_reward_model(out, config, head, params, score)
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    assert type(reloaded).__name__ == type(hf_model).__name__
    assert reloaded.config.num_labels == num_labels
    np.testing.assert_allclose(_hf_scores(reloaded, toks, mask, pos), ref, rtol=0, atol=1e-5)
    config2, head2, params2, score2 = models.load_hf_reward_model(out)
    assert config2 == config and head2.num_labels == head.num_labels
    jax.tree.map(np.testing.assert_array_equal, params2, params)
    np.testing.assert_array_equal(np.asarray(score2), np.asarray(score))


def test_reward_model_on_a_mesh_equals_transformers(tmp_path, devices):
    hf_model, path = _make("llama", tmp_path / "llama", 1)
    mesh = sh.make_mesh("dp2,tp2,sp2")
    config, _, params, score = models.load_hf_reward_model(path, mesh=mesh)
    graphdef = models.abstract_params(config)[0]
    toks, mask, pos = _batch(1)
    ours = jax.jit(lambda p, s, t, m, q: models.reward_scores(graphdef, p, s, t, mask=m, positions=q, mesh=mesh))(
        params, score, toks, mask, pos)
    np.testing.assert_allclose(np.asarray(ours), _hf_scores(hf_model, toks, mask, pos), rtol=0, atol=1e-4)


def test_reward_model_rejects_a_causal_lm(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "lm"), safe_serialization=True)
    with pytest.raises(ValueError, match="unsupported reward model architecture 'LlamaForCausalLM'"):
        models.load_hf_reward_model(str(tmp_path / "lm"))


@pytest.mark.slow
def test_run_with_a_reward_model_combines_its_scores(tmp_path):
    """One real step with ``reward.model.path``: a ``reward_model`` stage scores every row on the
    learner mesh, the step's scores are function_weight * rule + model_weight * model, each traced
    row records its model score, and the trace check passes."""
    import json

    from test_rollout_mismatch import _one_step

    from rljax.trace.check import run_checks

    path = tiny_reward_model(tmp_path / "rm_ckpt", scale=5.0)
    rm = [f"reward.model.path={path}", "reward.combine.function_weight=1.0", "reward.combine.model_weight=2.0"]
    trainer, m, run = _one_step(tmp_path, "rm", *rm)
    assert "reward_model" in trainer.runner.names and m["timing_s/reward_model"] > 0
    assert m["reward/model/max"] > m["reward/model/min"]  # the model tells the responses apart
    np.testing.assert_allclose(m["critic/score/mean"], m["reward/function/mean"] + 2.0 * m["reward/model/mean"],
                               rtol=1e-5, atol=1e-6)
    recs = [json.loads(line) for line in open(run / "trace.jsonl")]
    rec = next(r for r in recs if r["stage"] == "reward_model")
    assert any(f["name"] == "rm_scores" for f in rec["fields"]), rec["fields"]
    checks = {name: status for status, name, _ in run_checks(str(run))}
    for name in ("prompt group uid/sessions/keys consistent across every stage",
                 "reward / old,ref log-prob / advantage producers and consumers", "nothing left in the buffer after cleanup",
                 "padding rows excluded from reward, metrics and loss"):
        assert checks[name] == "PASS", (name, checks)
    # The reward tie covers the combined score: each row's score as the advantages read it is the one
    # the reward stage computed from that row's tokens (rule) and model score; a swap after scoring fails it.
    inv = json.loads((run / "trace_summary.json").read_text())["invariants"]
    assert inv["scores_tied"] and inv["violating_rows"] == 0 and inv["rows"] == 16, inv
    from rljax.trace import faults

    faults.enable("swap_rewards")
    try:
        _, _, bad = _one_step(tmp_path, "rm_swapped", *rm)
        assert faults.acts("swap_rewards"), f"the fault never acted: {faults.report()}"
    finally:
        faults.disable()
    inv = json.loads((bad / "trace_summary.json").read_text())["invariants"]
    assert inv["violating_rows"] == 2 and inv["violations"][0]["tensor"] == "scores", inv
    assert "read by the advantages" in inv["violations"][0]["detail"], inv


RM_RUN = ["--mesh=dp2", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4",
          "data.embedded.num_train=32", "data.embedded.num_test=8", "trainer.test_freq=-1",
          "trainer.val_before_train=false", "trace.ledgers=false", "trainer.total_steps=2",
          "reward.combine.function_weight=1.0", "reward.combine.model_weight=2.0"]


def _no_failed_check(run):
    import json

    from rljax.trace.check import run_checks

    checks = {name: (status, detail) for status, name, detail in run_checks(str(run))}
    assert all(s != "FAIL" for s, _ in checks.values()), {k: v for k, v in checks.items() if v[0] == "FAIL"}
    inv = json.loads((run / "trace_summary.json").read_text())["invariants"]
    assert inv["scores_tied"] and inv["violating_rows"] == 0, inv


@pytest.mark.slow
def test_reward_model_in_async_and_multi_turn_runs(tmp_path):
    """trainer.mode=async: the reward stage runs on the learner after the reward model (the
    producer generates only), so with max_staleness=0 (the synchronous schedule) every metric of
    2 steps equals the synchronous run's. Multi-turn (the lookup tool task): the model scores
    prompt + whole episode and its score combines with the episode reward. Both pass the trace
    check, the reward tie on the combined score included."""
    from launching import launch, train_rows
    from test_async_launch import _compare

    path = tiny_reward_model(tmp_path / "rm_ckpt", scale=5.0)
    rm = [*RM_RUN, f"reward.model.path={path}"]
    runs = {"sync": [], "async": ["trainer.mode=async", "async_training.max_staleness=0"],
            "tool": ["--config", "tool_lookup"]}
    for name, extra in runs.items():
        out = launch("--run-dir", str(tmp_path / name), *extra, *rm)
        assert out.returncode == 0, (name, out.stderr[-3000:])
        _no_failed_check(tmp_path / name)
    sync, asyn, tool = (train_rows(tmp_path / n) for n in runs)
    _compare(sync, asyn)
    for rows in (sync, asyn, tool):
        assert [r["step"] for r in rows] == [1, 2]
        for r in rows:
            assert r["reward/model/max"] > r["reward/model/min"]
            np.testing.assert_allclose(r["critic/score/mean"], r["reward/function/mean"] + 2.0 * r["reward/model/mean"],
                                       rtol=1e-5, atol=1e-6)
    assert all("env/num_turns/mean" in r for r in tool)


@pytest.mark.slow
def test_reward_model_on_two_processes_equals_one_process(tmp_path):
    """launch/local_multiprocess.sh, 2 processes x 2 CPU devices (dp4) against one process with 4:
    the reward model scores the global learner batch on the learner mesh and each process combines
    its own rows' rule scores with its rows of the model's scores, so every batch metric equals the
    one-process run's (``reward/model/*``, ``critic/score/mean`` and the combined sum included)
    and the trace check, the reward tie on each process's combined scores included, passes."""
    import os
    import subprocess

    from launching import REPO, assert_same_metrics, launch, launch_env
    from launching import metrics as read_metrics
    from test_launch import _NOT_COMPARED

    path = tiny_reward_model(tmp_path / "rm_ckpt", scale=5.0)
    # RM_RUN on dp4 with 8 prompts a step (later keys win): each process generates 4 groups
    args = [*RM_RUN, "--mesh=dp4", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", f"reward.model.path={path}"]
    out = launch("--run-dir", str(tmp_path / "one"), *args)
    assert out.returncode == 0, out.stderr[-3000:]
    two = subprocess.run(["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "2",
                          "--run-dir", str(tmp_path / "two"), *args],
                         cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    a, b = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert_same_metrics(a, b, skip=_NOT_COMPARED)
    rows = [r for r in b if "reward/model/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["reward/model/max"] > r["reward/model/min"]
        np.testing.assert_allclose(r["critic/score/mean"], r["reward/function/mean"] + 2.0 * r["reward/model/mean"],
                                   rtol=1e-5, atol=1e-6)
    _no_failed_check(tmp_path / "two")


@pytest.mark.slow
def test_reward_model_with_dynamic_sampling_keeps_by_the_rule_and_trains_the_combined_score(tmp_path):
    """algorithm.filter_groups (metric=acc: reward.function's score decides which groups are kept)
    with a reward model and the overlong penalty: the kept rows' reward is function_weight * rule +
    penalty + model_weight * model every step, and the rule's part is the rule's alone (step 1, before
    any update, keeps the same groups as a run without the model: its score is that rule + penalty);
    the trace check passes (no dropped uid trained, the reward tie on the combined score of the kept
    rows). (trainer.mode=async runs the same combining on the learner: the reward model's and the
    filter's async tests cover the two halves.)"""
    from launching import launch, train_rows

    path = tiny_reward_model(tmp_path / "rm_ckpt", scale=5.0)
    filt = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=0",
            "reward.reward_kwargs.overlong_buffer_cfg.enable=true", "reward.reward_kwargs.overlong_buffer_cfg.len=2",
            "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5"]
    rule_only = [a for a in RM_RUN if not a.startswith("reward.combine.")]
    runs = {"sync": [*RM_RUN, f"reward.model.path={path}"], "rule": rule_only}
    for name, extra in runs.items():
        out = launch("--run-dir", str(tmp_path / name), *extra, *filt)
        assert out.returncode == 0, (name, out.stderr[-3000:])
        _no_failed_check(tmp_path / name)
    sync, rule = (train_rows(tmp_path / n) for n in runs)
    assert [r["step"] for r in sync] == [1, 2]
    for r in sync:
        assert r["train/kept_groups"] == 4 and r["train/num_gen_batches"] >= 1
        np.testing.assert_allclose(r["critic/score/mean"], r["reward/function/mean"] + 2.0 * r["reward/model/mean"]
                                   + r["reward/overlong_penalty/mean"], rtol=1e-5, atol=1e-6)
    assert sum(r["train/dropped_groups"] for r in sync) > 0, "no group dropped: the filter is untested here"
    assert sync[0]["reward/overlong_penalty/mean"] < 0, "no response penalised: the penalty is untested here"
    np.testing.assert_allclose(sync[0]["reward/overlong_penalty/mean"], rule[0]["reward/overlong_penalty/mean"])
    np.testing.assert_allclose(sync[0]["reward/function/mean"] + sync[0]["reward/overlong_penalty/mean"],
                               rule[0]["critic/score/mean"], rtol=1e-5, atol=1e-6)
