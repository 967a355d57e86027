"""bench/peer_trl.py's pieces that run in seconds: the BPE cases' tokenizer (every id of the
embedding decodes; rljax's loader and transformers' fast tokenizer give the same ids), the
~190-token GSM8K-format prompts, and the memory guard that kills a worker past its RSS limit.
(The cases themselves run in minutes to hours: ``python bench/peer_trl.py --cases bpe-smoke``.)"""

import importlib.util
import json
import sys

from repo_paths import REPO


def _load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bpe_tokenizer_fills_the_embedding_and_both_sides_agree(tmp_path):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from rljax.tokenizer import load_tokenizer

    bpe = _load("_peer_bpe")
    bpe.TRAINED_MERGES = 500  # 756 learned tokens: the pair merges fill the rest, as at 151,936
    path = bpe.build_tokenizer(str(tmp_path / "tok"), 1024)
    raw = Tokenizer.from_file(f"{path}/tokenizer.json")
    assert raw.get_vocab_size(with_added_tokens=True) == 1024
    assert all(raw.id_to_token(i) is not None for i in range(1024))  # a sampled id always decodes
    ours = load_tokenizer(path)
    assert ours.eos_id == ours.pad_id == raw.token_to_id("<|endoftext|>") == 1021 and ours.bos_id is None
    longest = bpe.write_gsm8k(str(tmp_path / "data"), f"{path}/tokenizer.json", 190, rows=4)
    theirs = PreTrainedTokenizerFast(tokenizer_file=f"{path}/tokenizer.json", eos_token="<|endoftext|>",
                                     pad_token="<|endoftext|>")
    rows = [json.loads(line) for line in (tmp_path / "data" / "train.jsonl").read_text().splitlines()]
    lengths = []
    for row in rows:
        ids = ours.encode(row["question"], add_bos=True)
        assert theirs(row["question"])["input_ids"] == ids
        assert ours.decode(ids) == row["question"]
        assert row["answer"].rsplit("#### ", 1)[1].isdigit()
        lengths.append(len(ids))
    assert 190 <= min(lengths) and max(lengths) == longest <= 230


def test_reward_grades_a_wrong_answer_by_its_digits():
    bpe = _load("_peer_bpe")
    assert bpe.reward("so #### 12", "12") == 1.0
    assert bpe.reward("ab 1 2", "7") == 0.25 * 2 / 4
    assert bpe.reward("no digits", "7") == 0.0


def test_guard_kills_a_worker_past_its_rss_limit(tmp_path):
    peer = _load("peer_trl")
    grow = "import time; x = bytearray(400 << 20); x[::4096] = b'1' * len(x[::4096]); print('up', flush=True); time.sleep(60)"
    code, out, _, high, killed = peer.guarded_run([sys.executable, "-c", grow], {}, str(tmp_path), "big",
                                                  timeout=20, rss_limit_mb=200, poll_s=0.05)
    assert killed and killed.startswith("killed at RSS") and high > 200 and code == -9
    code, out, _, high, killed = peer.guarded_run([sys.executable, "-c", "print('RESULT {}')"], {}, str(tmp_path),
                                                  "small", timeout=60, rss_limit_mb=200, poll_s=0.05)
    assert (code, out.strip(), killed) == (0, "RESULT {}", None)
