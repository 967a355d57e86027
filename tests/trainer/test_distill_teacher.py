"""The teacher stage (``distillation.*``, rljax/trainer/teacher.py) scores the sampled response
tokens at the policy's positions: hidden state ``S - 1 + t`` predicts response token ``t``.

A teacher saved as a Hugging Face directory (a random tiny model, another seed than the
policy's) is loaded by the run's build and its ``teacher_logp`` equals the log-softmax of its full
logits at those positions, computed here without rljax's fused log-prob; ``ref`` is the policy's
initial weights, so its log-probs equal the policy's own pass on the same batch."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rljax.config import resolve
from rljax.models import functional as F
from rljax.models.hf import save_hf_checkpoint
from rljax.sharding import make_mesh
from rljax.trainer.build import build
from rljax.trainer.stages.learning import teacher as teacher_stage
from rljax.trainer.teacher import teacher_service


def _batch(rng, b, s, t, vocab):
    """A learner batch: left-padded prompts of 2..s tokens, right-padded responses of 1..t tokens."""
    ids = np.zeros((b, s + t), np.int32)
    mask = np.zeros((b, s + t), bool)
    for i in range(b):
        p, r = rng.integers(2, s + 1), rng.integers(1, t + 1)
        ids[i, s - p: s + r] = rng.integers(3, vocab, p + r)
        mask[i, s - p: s + r] = True
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32)
    return {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask), "positions": jnp.asarray(positions)}


def _naive_logp(graphdef, params, batch, s, t):
    """log softmax of the full logits at hidden S-1+t, taken at token S+t (no fused log-prob)."""
    hidden = F.forward(graphdef, params, batch["input_ids"], positions=batch["positions"], mask=batch["attention_mask"])
    logits = jnp.einsum("bld,dv->blv", hidden.astype(jnp.float32), F.unembedding(params).astype(jnp.float32))
    logp = jax.nn.log_softmax(logits[:, s - 1: s - 1 + t], -1)
    return np.asarray(jnp.take_along_axis(logp, batch["input_ids"][:, s:, None], -1)[..., 0])


def test_teacher_log_probs_are_taken_at_the_policy_positions(tmp_path):
    cfg, _ = resolve("default", ["data.max_response_length=4", "distillation.enabled=true",
                                 "distillation.teacher_model.model_path=ref", "actor.use_remove_padding=false"])
    services, state, stages = build(cfg, make_mesh("dp1", jax.devices()[:1]), run_dir=str(tmp_path / "run"),
                                    echo=lambda *a: None)
    assert "teacher" in [st.name for st in stages]
    mcfg = services.model.config
    s, t = services.learner.prompt_len, services.learner.response_len
    batch = _batch(np.random.default_rng(0), 4, s, t, mcfg.vocab_size)
    real = np.asarray(batch["attention_mask"][:, s:])
    policy_logp = np.asarray(services.learner.actor.forward(state.actor.params, batch)[0])

    # ref: the policy's initial weights, scored as the policy's own pass scores them
    np.testing.assert_allclose(np.asarray(teacher_stage(services, state, batch)["teacher_logp"])[real],
                               policy_logp[real], rtol=1e-5, atol=1e-5)

    # a Hugging Face directory: another random model of the policy's vocabulary
    graphdef, params = F.init_params(mcfg, seed=7)
    save_hf_checkpoint(str(tmp_path / "teacher"), mcfg, params)
    hf_cfg, _ = resolve("default", ["data.max_response_length=4", "distillation.enabled=true",
                                    f"distillation.teacher_model.model_path={tmp_path / 'teacher'}",
                                    "actor.use_remove_padding=false"])
    hf = dataclasses.replace(services, cfg=hf_cfg, teacher=teacher_service(dataclasses.replace(services, cfg=hf_cfg)))
    got = np.asarray(teacher_stage(hf, state, batch)["teacher_logp"])
    np.testing.assert_allclose(got[real], _naive_logp(graphdef, params, batch, s, t)[real], rtol=2e-4, atol=2e-4)
    assert np.abs(policy_logp[real] - got[real]).max() > 0.1  # its own weights, not the policy's
