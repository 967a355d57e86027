"""``actor.shared_prefix`` from the command line to the learner's packing plan, its usage errors,
and a launched run whose trace, metrics and ledgers record the layout and the tokens it saved."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.config import ConfigError, resolve
from rljax.sharding import make_mesh
from rljax.trainer import packing as P, prefix as X
from rljax.trainer.build import build

GROUPS, N = 4, 4


def _group_batch(s: int, t: int, vocab: int, seed: int = 0) -> dict:
    """``GROUPS`` left-padded prompts of 3..s tokens, each repeated for its ``N`` responses of 1..t tokens."""
    rng = np.random.default_rng(seed)
    b = GROUPS * N
    plen = np.repeat(rng.integers(3, s + 1, GROUPS), N)
    rlen = rng.integers(1, t + 1, b)
    mask = np.concatenate([np.arange(s)[None] >= (s - plen)[:, None], np.arange(t)[None] < rlen[:, None]], 1)
    tokens = np.concatenate([np.repeat(rng.integers(3, vocab, (GROUPS, s)), N, 0), rng.integers(3, vocab, (b, t))], 1)
    return {"input_ids": jnp.asarray(np.where(mask, tokens, 0).astype(np.int32)), "attention_mask": jnp.asarray(mask),
            "positions": jnp.asarray(np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32))}


def _passes(tmp_path, mode: str, *extra):
    """The run's own actor passes (``build``) under ``actor.shared_prefix=mode`` on one grouped batch:
    ``(old log-probs, their pass's layout, the update's layout)``; the update is planned, not run."""
    cfg, _ = resolve("default", [f"actor.shared_prefix={mode}", f"rollout.n={N}", "data.max_response_length=4",
                                 f"data.train_batch_size={GROUPS}", f"actor.ppo_mini_batch_size={GROUPS}", *extra])
    services, state, _ = build(cfg, make_mesh("dp1", jax.devices()[:1]), run_dir=str(tmp_path / mode),
                               echo=lambda *a: None)
    learner = services.learner
    batch = _group_batch(learner.prompt_len, learner.response_len, services.model.config.vocab_size)
    logp, _ = learner.actor.forward(state.actor.params, batch)
    update = learner.actor.update
    chosen = update.choose(batch) if isinstance(update, P.AutoPacking) else update
    if hasattr(chosen, "_packed"):  # a packed update: its plan (a padded one has none)
        chosen._packed(batch, jax.random.key(0))
    return np.asarray(logp) * np.asarray(batch["attention_mask"][:, learner.prompt_len:]), \
        X.learner_layout(learner.actor.forward), X.learner_layout(update)


def test_the_key_reaches_the_packing_plan(tmp_path):
    """on lays each prompt once in both actor passes, off lays every trajectory's, with equal
    log-probs; auto (the default) shares this batch (it saves over 20%); on packs under
    use_remove_padding=auto (its default), where this short task would stay padded."""
    on_logp, on_fwd, on_upd = _passes(tmp_path, "on")
    off_logp, off_fwd, off_upd = _passes(tmp_path, "off", "actor.use_remove_padding=true")
    assert (on_fwd["layout"], on_upd["layout"], off_fwd["layout"], off_upd["layout"]) == \
        ("shared_prefix", "shared_prefix", "packed", "packed")
    assert on_fwd["real_tokens"] == off_fwd["laid_tokens"] > on_fwd["laid_tokens"]
    assert on_fwd["shared_saved_tokens"] == off_fwd["laid_tokens"] - on_fwd["laid_tokens"] > 0
    assert on_fwd["shared_saved_frac"] >= X.AUTO_MIN_SAVED and off_fwd["shared_saved_frac"] == 0
    np.testing.assert_allclose(on_logp, off_logp, rtol=1e-5, atol=1e-5)
    _, auto_fwd, _ = _passes(tmp_path, "auto", "actor.use_remove_padding=true")
    assert auto_fwd == on_fwd


def test_auto_does_not_share_with_the_sequence_split():
    """Over sp a shared row's attention reads every key block: auto keeps the unshared layout there, on shares."""
    b, s, t = GROUPS * N, 8, 4
    batch = {k: np.asarray(v) for k, v in _group_batch(s, t, 64).items()}
    first, count = P.row_spans(batch["attention_mask"])
    keys = X.prompt_hash(np, batch["input_ids"], batch["attention_mask"], s)
    cfg = P.PackConfig(row_len=s + t, sp=2, micro_batch_size=b)
    plan = lambda mode: X.plan_layout(first, count, s + t, t, [np.arange(b)], mini_batch_size=b, cfg=cfg,  # noqa: E731
                                      shared_prefix=mode, prompt_keys=keys)[1]["shared_prefix"]
    assert (plan("auto"), plan(True)) == (False, True)
    assert X.plan_layout(first, count, s + t, t, [np.arange(b)], mini_batch_size=b, shared_prefix="auto",
                         cfg=P.PackConfig(row_len=s + t, micro_batch_size=b), prompt_keys=keys)[1]["shared_prefix"]


@pytest.mark.parametrize("overrides, wrong", [
    (["actor.shared_prefix=on", "actor.use_remove_padding=false"], "actor.use_remove_padding=false"),
    (["actor.shared_prefix=on", "actor.lora.rank=4", "actor.lora.dropout=0.1"], "actor.lora.dropout=0.1"),
])
def test_on_needs_the_packed_layout(overrides, wrong):
    with pytest.raises(ConfigError) as e:
        resolve(None, overrides)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("actor.shared_prefix=on") and wrong in msg
    assert "accepted: actor.use_remove_padding=true or auto" in msg
    for ok in (["actor.shared_prefix=off", "actor.use_remove_padding=false"],
               ["actor.shared_prefix=auto", "actor.use_remove_padding=false"]):
        resolve(None, ok)


def test_values_and_yaml_booleans(tmp_path):
    assert resolve(None)[0].actor.shared_prefix == "auto"
    with pytest.raises(ConfigError, match=r"^actor.shared_prefix='yes' is not accepted; accepted: auto, on, off$"):
        resolve(None, ["actor.shared_prefix=yes"])
    preset = tmp_path / "p.yaml"
    for text, value in (("on", "on"), ("off", "off")):  # YAML 1.1 reads a bare on / off as a boolean
        preset.write_text(f"actor:\n  shared_prefix: {text}\n  use_remove_padding: true\n")
        assert resolve(str(preset))[0].actor.shared_prefix == value


@pytest.mark.slow
def test_a_launched_run_records_the_layout_and_the_saved_tokens(tmp_path):
    """``python -m rljax.launch actor.shared_prefix=on`` on the default task (rollout.n=4, one step): the step's
    metrics, the update's trace record and both ledgers name the shared layout and the tokens it saved
    (laid + saved = the unshared layout's tokens), and ``trace check`` passes."""
    from launching import launch, train_rows
    from rljax.trace.check import exit_code, run_checks
    from test_launch import SMALL

    run = tmp_path / "run"
    out = launch("--mesh=dp1", "--run-dir", str(run), *SMALL, "trainer.total_steps=1", "actor.shared_prefix=on")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = train_rows(run)
    assert [r["perf/learner_shared_prefix"] for r in rows] == [1.0]
    assert all(X.AUTO_MIN_SAVED < r["perf/shared_prefix_saved_frac"] < 1 for r in rows)
    records = [json.loads(line) for line in (run / "trace.jsonl").read_text().splitlines()]
    layouts = [r["minibatch"]["learner_layout"] for r in records if r["stage"] == "actor_minibatch"]
    assert {lay["layout"] for lay in layouts} == {"shared_prefix"} and len(layouts) >= 1
    first = layouts[0]  # step 1's update: the metric and the record say the same
    assert first["shared_saved_frac"] == rows[0]["perf/shared_prefix_saved_frac"]
    assert first["laid_tokens"] + first["shared_saved_tokens"] == first["real_tokens"]
    ledger = {r["stage"]: r for r in json.loads((run / "shape_ledger.json").read_text())
              if r["tensor"] == "packed rows (shared_prefix)"}
    assert set(ledger) == {"actor_minibatch", "old_log_prob"}
    assert ledger["actor_minibatch"]["shared_saved_tokens"] == first["shared_saved_tokens"]
    assert f"{first['shared_saved_tokens']} saved" in ledger["actor_minibatch"]["note"]
    memory = json.loads((run / "memory_ledger.json").read_text())["learner_layout"]
    assert memory["actor_minibatch"] == first and memory["old_log_prob"]["shared_saved_tokens"] > 0
    assert "| actor_minibatch | shared_prefix |" in (run / "memory_ledger.md").read_text()
    results = run_checks(str(run))
    assert exit_code(results) == 0, [r for r in results if r[0] != "PASS"]
