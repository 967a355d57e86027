"""The update reports what it did (rljax.trainer.update_report.update_report, aux outputs of the jitted step):
rows and tokens per micro-batch and per row, its denominators, its aggregation mode (probed), and
digests of the parameters it started from and produced; rljax.trace.rederive.compare_update_report
holds them against the batch and the configuration."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax import loss as rl
from rljax.models import functional as F
from rljax.models.config import get_config
from rljax.trace import faults
from rljax._digest import hex_digest, param_digest
from rljax.trace.rederive import agg_probe_expected, compare_update_report
from rljax.trainer import StepConfig, init_state, make_train_step

S, T, B = 4, 6, 8
CFG = get_config("tiny")
MODES = tuple(rl.AGGREGATION_MODES)


@pytest.fixture(scope="module")
def model():
    return F.init_params(CFG, seed=0)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    rlen = rng.integers(1, T + 1, B)
    resp = np.arange(T)[None, :] < rlen[:, None]
    attn = np.concatenate([np.ones((B, S), bool), resp], axis=1)
    loss_mask = resp.astype(np.float32)
    loss_mask[5] = 0.0  # a row without loss tokens (a padding row)
    return {"input_ids": jnp.asarray(rng.integers(3, CFG.vocab_size, (B, S + T)), jnp.int32),
            "attention_mask": jnp.asarray(attn), "positions": F.default_positions(jnp.asarray(attn)),
            "loss_mask": jnp.asarray(loss_mask), "advantages": jnp.asarray(rng.normal(0, 1, (B, T)), jnp.float32),
            "old_logp": jnp.asarray(rng.normal(-3, 0.1, (B, T)), jnp.float32)}


def _step(graphdef, params, batch, **kw):
    cfg = StepConfig(**{"ppo_mini_batch_size": 4, "ppo_micro_batch_size": 2, "ppo_epochs": 2,
                        "logprob_impl": "naive", **kw})
    opt = optax.sgd(0.1)
    state, metrics = make_train_step(graphdef, opt, cfg)(init_state(jax.tree.map(jnp.copy, params), opt), batch,
                                                         jax.random.key(0))
    return state, jax.tree.map(np.asarray, metrics["update_report"]), cfg


def _compare(report, batch, mode, epochs=2):
    keys = tuple(f"1-{i // 4}_{i % 4}_{i}" for i in range(B))
    return compare_update_report(1, keys, np.ones(B, bool), report, np.asarray(batch["loss_mask"]).sum(1),
                                 epochs=epochs, mode=mode, modes=MODES, width=T)


def test_the_update_reports_rows_tokens_denominators_mode_and_digests(model):
    graphdef, params = model
    batch = _batch()
    tokens = np.asarray(batch["loss_mask"]).sum(1)
    state, r, cfg = _step(graphdef, params, batch, loss_agg_mode="seq-mean-token-mean")
    assert r["micro_rows"].shape == (4, 2) and r["denominators"].shape == (4, 2)  # 2 epochs x 2 mini-batches
    assert (r["row_tokens"] == 2 * tokens).all()
    assert r["micro_tokens"].sum() == 2 * tokens.sum() and r["micro_rows"].sum() == 2 * (tokens > 0).sum()
    assert r["denominators"][:, 0].sum() == 2 * tokens.sum() and r["denominators"][:, 1].sum() == 2 * 7
    assert MODES[int(r["agg_mode"])] == "seq-mean-token-mean"
    stats = dict(rows=r["micro_rows"].sum(-1), tokens=r["micro_tokens"].sum(-1),
                 inverse_lengths=r["micro_inverse_lengths"].sum(-1), num_tokens=r["denominators"][:, 0],
                 num_seqs=r["denominators"][:, 1], width=T)
    np.testing.assert_allclose(r["agg_probe"], agg_probe_expected("seq-mean-token-mean", **stats), rtol=1e-5)
    # the probe tells the modes apart on this batch (ragged lengths)
    assert not np.allclose(r["agg_probe"], agg_probe_expected("token-mean", **stats), rtol=1e-4)
    assert hex_digest(r["param_digest_before"]) == hex_digest(param_digest(params))
    assert hex_digest(r["param_digest_after"]) == hex_digest(param_digest(state.params)) != hex_digest(param_digest(params))
    assert _compare(r, batch, "seq-mean-token-mean") == []
    # the checker's own logic: the configuration's mode is not what ran
    v = _compare(r, batch, "token-mean")
    assert any("built with loss_agg_mode=seq-mean-token-mean, the configuration says token-mean" in x["detail"]
               for x in v), v
    assert any("the loss aggregated as seq-mean-token-mean" in x["detail"] for x in v), v


@pytest.mark.slow
@pytest.mark.parametrize("fault,detail", [
    ("drop_micro_row", "the loss consumed"),
    ("loss_agg_mode", "built with loss_agg_mode="),
])
def test_a_provoked_update_bug_is_named(model, fault, detail):
    graphdef, params = model
    batch = _batch()
    faults.enable(fault)
    try:
        _, r, _ = _step(graphdef, params, batch)
        assert faults.acts(fault), f"the fault {fault} never acted: {faults.report()}"
    finally:
        faults.disable(fault)
    v = _compare(r, batch, "token-mean")
    assert v and detail in v[0]["detail"], v
    if fault == "drop_micro_row":  # named by row: the first row of each mini-batch's first micro-batch
        assert all(x["tensor"] == "loss_mask" and x["stage"] == "actor_minibatch" and x["uid"].startswith("1-")
                   for x in v)
