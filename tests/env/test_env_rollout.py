"""Multi-turn episodes on the tiny model: the data contract (observations are context with
response_mask = loss_mask = 0 and zero rollout log-prob), sessions stay sessions, the
sampler's log-probs equal a recompute of the whole multi-turn context, the final reward
reaches the group advantage, and observations get no gradient but act as context."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.env import Environment, EpisodeTrajectories, Step, episode_scores, run_episodes
from rljax.loss import Role
from rljax.models import functional as F
from rljax.models.config import get_config
from rljax.tokenizer import CharTokenizer
from rljax.trainer.step import StepConfig, actor_loss

TOK = CharTokenizer()
CFG = get_config("tiny", vocab_size=TOK.vocab_size)


@functools.lru_cache(maxsize=None)
def _params():
    return F.init_params(CFG, seed=0)


# ----------------------------------------------------------------------- no gradient on observations


def _batch(obs1, obs2):
    """prompt | call (2) | obs1 (2) | answer (2) | obs2 (2, the last observation of a cut episode) | pad."""
    prompt = TOK.encode("key ab=", add_bos=True)  # 8 tokens
    resp = TOK.encode("x?") + TOK.encode(obs1) + TOK.encode("7e") + TOK.encode(obs2) + [0, 0]
    roles = [1, 1, 2, 2, 3, 3, 2, 2, 4, 4]
    ids = np.array([prompt + resp], np.int32)
    attn = np.array([[1] * 8 + [r != 4 for r in roles]], bool)
    loss_mask = np.array([[r in (1, 3) for r in roles]], np.float32)
    rng = np.random.default_rng(0)
    return dict(input_ids=ids, attention_mask=attn, positions=np.maximum(np.cumsum(attn, 1) - 1, 0).astype(np.int32),
                loss_mask=loss_mask, old_logp=rng.normal(-2, 0.3, (1, 10)).astype(np.float32),
                advantages=np.full((1, 10), 0.7, np.float32), ref_logp=rng.normal(-2, 0.3, (1, 10)).astype(np.float32))


@functools.lru_cache(maxsize=None)
def _grad_fn():
    graphdef = _params()[0]
    cfg = StepConfig(use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01, clip_ratio_high=0.28)

    @jax.jit
    def fn(params, batch):
        counts = (jnp.sum(batch["loss_mask"]), jnp.float32(1.0))
        return jax.grad(lambda p: actor_loss(p, graphdef, batch, counts, cfg, None)[0])(params)

    return fn


def _flat(tree):
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


@pytest.mark.slow
def test_observations_get_no_gradient_but_are_context():
    params = _params()[1]
    grad = _grad_fn()
    base = _flat(grad(params, _batch("56", "34")))
    # The last observation is only a target (nothing after it attends to it): any content, and
    # any old / ref log-prob or advantage on observation positions, leaves the gradient as is.
    other = _batch("56", "zq")
    obs = np.array([[r == 2 for r in [1, 1, 2, 2, 3, 3, 2, 2, 4, 4]]])
    for k in ("old_logp", "ref_logp", "advantages"):
        other[k] = np.where(obs, 1e3, other[k]).astype(np.float32)
    np.testing.assert_array_equal(_flat(grad(params, other)), base)
    # The first observation is context of the answer: changing it changes the gradient.
    assert not np.allclose(_flat(grad(params, _batch("90", "34"))), base)
    # The same change counts once observation tokens are (wrongly) in the loss mask.
    leaky_a, leaky_b = _batch("56", "34"), _batch("56", "zq")
    for b in (leaky_a, leaky_b):
        b["loss_mask"] = (b["attention_mask"][:, 8:]).astype(np.float32)
    assert not np.allclose(_flat(grad(params, leaky_a)), _flat(grad(params, leaky_b)))


# ----------------------------------------------------------------------- episodes on the sampler


@dataclasses.dataclass(frozen=True)
class P:
    ids: tuple
    prompt: str
    answer: str
    index: int = 0

    def reward_extra(self) -> dict:  # what rljax.data's prompts hand the reward (verl's extra fields): none here
        return {}


class Scripted(Environment):
    """Observations after turns 0 and 1 (whatever the model wrote), a reward at the end:
    every session has three turns and two observations of different lengths."""

    def step(self, turn):
        if turn.index == 0:
            return Step(observation="<" + self.example.answer + ">", tool="t")
        if turn.index == 1:
            return Step(observation="=" * (1 + self.example.session), tool="t")
        return Step(reward=float(self.example.session))


PROMPTS = [P(tuple(TOK.encode("key ab=", add_bos=True)), "key ab=", "7"), P(tuple(TOK.encode("q=", add_bos=True)), "q=", "31")]
T = 20


@pytest.fixture(scope="module")
def episodes():
    from rljax.rollout import DecodeParams, RljaxEngine, Sampler

    engine = RljaxEngine(CFG, num_slots=8, max_prefill_length=32, max_decode_length=T)
    sampler = Sampler(engine, _params()[1])
    decode = DecodeParams(max_new_tokens=3, temperature=1.0, eos_ids=(TOK.eos_id,), seed=3)
    traj = run_episodes(sampler, PROMPTS, uids=["a", "b"], n=3, decode=decode, env_cls=Scripted, tokenizer=TOK,
                        stop_id=TOK.encode("?")[0], max_turns=3, max_response_tokens=T, max_obs_tokens=3,
                        pad_to_multiple=4)
    return traj


@pytest.mark.slow
def test_episode_data_contract(episodes):
    tr = episodes
    assert isinstance(tr, EpisodeTrajectories) and tr.batch_size == 8 and tr.is_padding.tolist() == [False] * 6 + [True] * 2
    roles, mask = np.asarray(tr.roles), np.asarray(tr.response_mask)
    obs, act = roles == Role.TOOL_RESULT, (roles == Role.AGENT_CALL) | (roles == Role.AGENT_ANSWER)
    assert obs.any() and act.any()
    np.testing.assert_array_equal(mask, act)  # response_mask is the action mask (verl's convention)
    np.testing.assert_array_equal(tr.loss_mask, act & ~tr.is_padding[:, None])
    assert not tr.rollout_logp[obs].any() and (tr.rollout_logp[act] < 0).all()
    present = np.arange(T)[None] < tr.response_length[:, None]
    np.testing.assert_array_equal(tr.response_attention, present)
    np.testing.assert_array_equal(roles == Role.PADDING, ~present)
    for i in range(6):
        # observation text as the environment wrote it, cut to max_obs_tokens
        spans = tr.turn_spans[i]
        assert [s[2] for s in spans] == [Role.AGENT_CALL if TOK.decode(tr.response_ids[i, s[1] - 1:s[1]]) == "?"
                                         else Role.AGENT_ANSWER if s[2] != Role.TOOL_RESULT else Role.TOOL_RESULT
                                         for s in spans]
        texts = [TOK.decode(tr.response_ids[i, a:b]) for a, b, r in spans if r == Role.TOOL_RESULT]
        answer, session = PROMPTS[i // 3].answer, i % 3
        assert texts == [("<" + answer + ">")[:3], "=" * (1 + session)]
        assert tr.obs_tokens[i] == obs[i].sum() == 3 + 1 + session
        assert tr.num_turns[i] == 3 and tr.tool_calls[i] == 2
        assert tr.response_length[i] - mask[i].sum() == tr.obs_tokens[i]  # response_len vs response_mask.sum()


@pytest.mark.slow
def test_sessions_stay_sessions_and_final_reward_reaches_the_advantage(episodes):
    tr = episodes
    assert tr.trajectory_keys[:6] == ("a_0_0", "a_1_0", "a_2_0", "b_0_0", "b_1_0", "b_2_0")
    assert tr.group_id[:6].tolist() == [0, 0, 0, 1, 1, 1]
    scores, report = episode_scores(tr, lambda r, a: -1.0, PROMPTS, max_error_fraction=0.5)
    np.testing.assert_array_equal(scores[:6], [0, 1, 2, 0, 1, 2])  # the env's final reward, not reward_fn
    from rljax.trainer.prepare import PrepareConfig, prepare
    from rljax.trainer.stages import learner_layout

    host = learner_layout(tr, prompt_len=8, response_len=T)
    fields = dict(scores=jnp.asarray(scores), loss_mask=host["loss_mask"], group_id=host["group_id"],
                  row_mask=host["row_mask"])
    out = prepare(fields, jnp.float32(0), cfg=PrepareConfig(estimator="grpo", num_groups=2))
    adv = np.asarray(out["advantages"])
    rewards = np.asarray(out["token_level_rewards"])
    for i in range(6):  # one value per session on its action tokens, from its final reward; 0 on observations
        on = tr.loss_mask[i]
        assert np.allclose(adv[i][on], adv[i][on][0]) and not adv[i][~on].any()
        last_action = np.nonzero(on)[0][-1]  # the outcome reward sits on the last policy token
        assert rewards[i, last_action] == scores[i] and rewards[i].sum() == scores[i]
    assert adv[0][tr.loss_mask[0]][0] < 0 < adv[2][tr.loss_mask[2]][0]


@pytest.mark.slow
def test_rollout_logp_equals_recompute_of_the_whole_context(episodes):
    """Each turn was decoded from a re-prefilled context; the learner recomputes every turn in one
    forward over [prompt | turns and observations]: the action tokens' log-probs agree."""
    from rljax.trainer.stages import learner_layout
    from rljax.trainer.step import make_logprob_fn

    tr = episodes
    host = learner_layout(tr, prompt_len=8, response_len=T)
    logp, _ = make_logprob_fn(_params()[0], response_len=T, temperature=1.0)(_params()[1], host)
    act = np.asarray(tr.loss_mask)
    np.testing.assert_allclose(np.asarray(logp)[act], tr.rollout_logp[act], atol=2e-4)
    assert host["attention_mask"][:6, 8:].sum() == tr.response_length[:6].sum()  # observations are attended to
