"""The JetStream Engine contract of ``RljaxEngine``, driven request by request."""

import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from rljax.rollout import DecodeParams, JetStreamTokenizer, Prefix, RljaxEngine, RljaxResultTokens, Sampler
from rljax.rollout._jetstream import jetstream_api
from test_sampler import CFG, MAX_DECODE, MAX_PREFILL, PROMPTS, UIDS, engine, params, reference

engine_api = jetstream_api().engine_api


def test_engine_implements_the_jetstream_api():
    eng = engine(2)
    assert isinstance(eng, engine_api.Engine)
    assert eng.max_concurrent_decodes == 2 and eng.samples_per_slot == 1
    assert eng.max_prefill_length == MAX_PREFILL and eng.mesh is None and eng.colocated_cpus is None
    tok = eng.build_tokenizer(eng.get_tokenizer())
    assert isinstance(tok, JetStreamTokenizer) and isinstance(tok, jetstream_api().tokenizer_api.Tokenizer)
    ids, n = tok.encode("Hi there: 3+4=7", add_bos=True)
    assert n == 16 and ids[0] == tok.bos_id and tok.decode(ids) == "Hi there: 3+4=7"
    assert (ids < CFG.vocab_size).all() and (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)


def test_build_tokenizer_from_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<pad>": 0, "<eos>": 1, "hello": 2, "world": 3, "[UNK]": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    eng = RljaxEngine(CFG.replace(eos_token_id=1, pad_token_id=0), num_slots=1, max_prefill_length=8, max_decode_length=8,
                      tokenizer_path=str(tmp_path))
    jt = eng.build_tokenizer(eng.get_tokenizer())
    ids, n = jt.encode("hello world")
    assert ids.tolist() == [2, 3] and n == 2 and jt.eos_id == 1 and jt.pad_id == 0
    assert jt.decode([2, 3]) == "hello world"


def test_prefill_insert_generate_loop_matches_greedy_reference():
    """The JetStream request path: prefill one prompt, insert it into a slot, step generate."""
    eng, steps = engine(2), 8
    p = eng.load_params(params())
    state = eng.init_decode_state(DecodeParams(temperature=0.0, max_new_tokens=steps, eos_ids=()))
    prompts = PROMPTS[1:3]
    for slot, prompt in enumerate(prompts):
        padded = np.zeros(MAX_PREFILL, np.int32)
        padded[: len(prompt)] = prompt
        prefix = eng.prefill(params=p, padded_tokens=padded, true_length=len(prompt))
        assert isinstance(prefix, Prefix) and prefix.batch_size == 1
        state = eng.insert(prefix, state, slot)
    # The first response token is sampled at insert; generate reports the ones after it.
    out = [[int(t)] for t in np.asarray(state.out_tokens[:, 0])]
    logps = []
    for i in range(steps):
        state, result = eng.generate(p, state)
        assert isinstance(result, RljaxResultTokens)
        result = result.convert_to_numpy()
        assert result.log_probs.shape == (2, 1)
        for slot in range(2):
            got = result.get_result_at_slot(slot)
            assert got.valid[0, 0] == (i < steps - 1)  # the last call finds every slot done
            if got.valid[0, 0]:
                out[slot].append(int(got.tokens[0, 0]))
                assert got.lengths[0] == i + 2
        logps.append(result.log_probs[:, 0])
    assert out == [list(r[:steps]) for r in reference()[1:3]]
    # log-probs reported by generate are the ones the sampler records
    greedy = DecodeParams(temperature=0.0, max_new_tokens=steps, eos_ids=())
    traj = Sampler(eng, params()).generate(prompts, uids=UIDS[1:3], decode=greedy)
    np.testing.assert_allclose(np.stack(logps[:-1], 1), traj.rollout_logp[:, 1:], atol=1e-6)


def test_prefix_destination_sharding_on_a_tp_mesh():
    eng = engine(8, mesh_tp=2)
    dest = eng.get_prefix_destination_sharding()
    assert isinstance(dest, Prefix) and isinstance(dest.kv.k, NamedSharding)
    assert "tp" in str(dest.kv.k.spec)  # kv heads on tp
    prefix = eng.prefill(params=eng.load_params(params()), padded_tokens=np.arange(3, 9), true_length=6)
    moved = jax.device_put(prefix, dest)
    np.testing.assert_array_equal(moved.kv.k, prefix.kv.k)


def test_engine_rejects_bad_arguments():
    eng = engine(2)
    with pytest.raises(ValueError, match="existing_prefix"):
        eng.prefill(params=params(), existing_prefix=object(), padded_tokens=np.arange(4), true_length=4)
    with pytest.raises(ValueError, match="true_length"):
        eng.prefill(params=params(), padded_tokens=np.arange(4), true_length=5)
    with pytest.raises(ValueError, match="num_slots"):
        RljaxEngine(CFG, num_slots=0, max_prefill_length=8, max_decode_length=8)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        RljaxEngine(CFG, num_slots=2, max_prefill_length=CFG.max_position_embeddings, max_decode_length=8)
    with pytest.raises(ValueError, match="max_decode_length"):
        eng.init_decode_state(DecodeParams(max_new_tokens=MAX_DECODE + 1))
    with pytest.raises(ValueError, match="slot"):
        state = eng.init_decode_state(DecodeParams(max_new_tokens=4))
        eng.insert_many(eng.prefill_batch(params(), [[1, 2]]), state, rows=[0, 0], slots=[1, 1], keys=np.zeros((2, 2)))


def test_importing_rollout_data_types_does_not_import_tensorflow():
    code = "import sys, rljax.rollout as r; r.DecodeParams(); r.Trajectories; assert 'tensorflow' not in sys.modules, 'tf'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_reading_every_module_file_after_the_engine_api_does_not_import_tensorflow():
    """inspect.getmodule reads ``__file__`` of every module in sys.modules (torch does it when
    it registers its custom ops; so does traceback formatting): JetStream's lazy token_utils
    must not load TensorFlow for it."""
    code = ("import inspect, sys; from rljax.rollout._jetstream import jetstream_api; jetstream_api(); "
            "inspect.getmodule(inspect.currentframe()); "
            "[hasattr(m, '__file__') for m in list(sys.modules.values())]; "
            "assert 'tensorflow' not in sys.modules, 'tf'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow  # the engine path is in the default run (test_prefill_insert_generate_loop_...)
def test_live_length_decode_gives_todays_greedy_tokens():
    """Decode attention that stops at the longest live slot (blocks of 4 here, so most
    steps skip cache blocks) gives the same greedy tokens and log-probs as attending over
    the whole cache, with slots finishing (EOS) and refilled at different lengths."""
    cfg = CFG.replace(decode_block_size=4)
    greedy = DecodeParams(temperature=0.0, max_new_tokens=MAX_DECODE, eos_ids=(5, 9))
    out = {}
    for mode in ("dense", "live"):
        eng = RljaxEngine(cfg, num_slots=2, max_prefill_length=MAX_PREFILL, max_decode_length=MAX_DECODE,
                          decode_attention=mode)
        out[mode] = Sampler(eng, params()).generate(PROMPTS, uids=UIDS, decode=greedy)
    np.testing.assert_array_equal(out["live"].response_ids, out["dense"].response_ids)
    np.testing.assert_array_equal(out["live"].response_length, out["dense"].response_length)
    np.testing.assert_allclose(out["live"].rollout_logp, out["dense"].rollout_logp, atol=1e-5)
    assert len(set(out["live"].response_length.tolist())) > 1
    with pytest.raises(ValueError, match="decode_attention is 'paged'; accepted: 'live', 'dense'"):
        RljaxEngine(cfg, num_slots=1, max_prefill_length=8, max_decode_length=8, decode_attention="paged")
