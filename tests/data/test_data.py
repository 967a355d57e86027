"""rljax.data: embedded task, TFDS builders (offline, tmp data_dir), prompt policy, resumable iteration."""

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rljax import data as D
from rljax.config import ConfigError, EmbeddedTaskConfig, resolve
from rljax.data import _prng
from rljax.reward import embedded_reward


def _chars(s):
    return [ord(c) for c in s]


# ----------------------------------------------------------------------------- PRNG


def test_splitmix64_matches_the_reference_sequence():
    # Vigna's splitmix64 from state 0 (published test vector): the data order must not
    # change with Python or NumPy releases, so it is pinned to the algorithm's definition.
    golden = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert [_prng.splitmix64((i * 0x9E3779B97F4A7C15) % 2**64) for i in range(3)] == golden


def test_scalar_and_vector_splitmix_agree():
    xs = [0, 1, 2**63, 2**64 - 1, 12345678901234567]
    with np.errstate(over="ignore"):
        vec = _prng.splitmix64_np(np.array(xs, dtype=np.uint64))
    assert [int(v) for v in vec] == [_prng.splitmix64(x) for x in xs]


def test_permutation_is_a_permutation_keyed_by_its_arguments():
    p = _prng.permutation(1000, 3, 0)
    assert sorted(p.tolist()) == list(range(1000))
    assert np.array_equal(p, _prng.permutation(1000, 3, 0))
    assert not np.array_equal(p, _prng.permutation(1000, 3, 1))
    assert not np.array_equal(p, _prng.permutation(1000, 4, 0))


# ----------------------------------------------------------------------------- embedded task


def test_embedded_add_examples_are_correct_and_deterministic():
    task = EmbeddedTaskConfig(task="add", max_operand=9, num_train=300, num_test=50, seed=1)
    train = list(D.embedded_examples(task, "train"))
    assert len(train) == 300 and [e["index"] for e in train] == list(range(300))
    for e in train:
        a, b = e["prompt"].rstrip("=").split("+")
        assert 0 <= int(a) <= 9 and 0 <= int(b) <= 9 and e["answer"] == str(int(a) + int(b))
    assert len({e["prompt"] for e in train}) > 90  # covers (almost) all 100 pairs
    assert train == list(D.embedded_examples(task, "train"))
    assert train[:50] != list(D.embedded_examples(task, "test"))
    other_seed = dataclasses.replace(task, seed=2)
    assert train != list(D.embedded_examples(other_seed, "train"))


def test_embedded_reverse_examples():
    task = EmbeddedTaskConfig(task="reverse", length=4, num_train=20, num_test=5)
    for e in D.embedded_examples(task, "train"):
        assert e["prompt"].startswith("rev ") and e["prompt"].endswith("=")
        s = e["prompt"][4:-1]
        assert len(s) == 4 and s.islower() and e["answer"] == s[::-1]
        assert embedded_reward(e["answer"], e["answer"]) == 1.0


def test_embedded_task_fits_the_char_tokenizer_and_default_lengths():
    tok_mod = pytest.importorskip("rljax.models.tokenizer")
    tok = tok_mod.CharTokenizer()
    cfg, _ = resolve("default")
    for e in D.embedded_examples(cfg.data.embedded, "train"):
        ids = tok.encode(e["prompt"], add_bos=True)
        assert tok.unk_id not in ids and len(ids) <= cfg.data.max_prompt_length
        assert len(tok.encode(e["answer"], add_eos=True)) <= cfg.data.max_response_length
        assert tok.decode(ids) == e["prompt"]


# ----------------------------------------------------------------------------- TFDS builders


@pytest.fixture(scope="module")
def embedded_cfg():
    cfg, _ = resolve(None, ["data.embedded.num_train=96", "data.embedded.num_test=12", "data.embedded.seed=5"])
    return cfg


@pytest.fixture(scope="module")
def embedded_dir(tmp_path_factory, embedded_cfg):
    d = tmp_path_factory.mktemp("tfds")
    D.prepare(embedded_cfg.data, data_dir=d)
    return d


def test_embedded_builder_matches_the_generator(embedded_cfg, embedded_dir):
    for split, n in (("train", 96), ("test", 12)):
        src = D.load_split(embedded_cfg.data, split, data_dir=embedded_dir)
        assert len(src) == n and src.split == split
        got = sorted((src[i]["index"], src[i]["prompt"], src[i]["answer"]) for i in range(n))
        want = [(e["index"], e["prompt"], e["answer"]) for e in D.embedded_examples(embedded_cfg.data.embedded, split)]
        assert got == want
        assert src[0]["position"] == 0 and src[-1]["position"] == n - 1
    files = list(Path(embedded_dir).rglob("*array_record*"))
    assert {f.name.split(".")[0] for f in files} == {"rljax_embedded-train", "rljax_embedded-test"}


def test_prepared_dataset_is_reused_and_a_changed_task_rebuilt_elsewhere(embedded_cfg, embedded_dir):
    files = sorted(Path(embedded_dir).rglob("*.array_record*"))
    mtimes = [f.stat().st_mtime_ns for f in files]
    D.load_split(embedded_cfg.data, "train", data_dir=embedded_dir)
    assert [f.stat().st_mtime_ns for f in files] == mtimes
    other = dataclasses.replace(embedded_cfg.data, embedded=dataclasses.replace(embedded_cfg.data.embedded, seed=6))
    src = D.load_split(other, "test", data_dir=embedded_dir)
    assert len(sorted(Path(embedded_dir).rglob("*test.array_record*"))) == 2
    assert sorted(src[i]["prompt"] for i in range(len(src))) == sorted(
        e["prompt"] for e in D.embedded_examples(other.embedded, "test")
    )


def test_prompt_template_is_applied_at_read_time(embedded_cfg, embedded_dir):
    data = dataclasses.replace(embedded_cfg.data, prompt_template="Q:{prompt}")
    src = D.load_split(data, "train", data_dir=embedded_dir)
    item = src[3]
    assert item["prompt"] == "Q:" + item["raw_prompt"]


def test_missing_split_is_named(embedded_cfg, embedded_dir):
    with pytest.raises(ValueError, match="no 'validation' split; available: test, train"):
        D.load_split(embedded_cfg.data, "validation", data_dir=embedded_dir)


GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
    {"question": "A car costs $1,200 and a bike $300. Total?", "answer": "1200+300=1500\n#### 1,500"},
    {"question": "Half of 9?", "answer": "9/2=4.5\n#### 4.5"},
]
GSM8K_TEST = [{"question": "What is 2 times 21?", "answer": "2*21=42\n#### 42", "extra_field": 1}]


def _gsm8k_cfg(path, *extra):
    cfg, _ = resolve(None, ["data.dataset=gsm8k", f"data.path={path}", *extra])
    return cfg.data


def test_gsm8k_builder_reads_local_jsonl_and_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    manual = tmp_path / "gsm8k"
    manual.mkdir()
    (manual / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS) + "\n")
    pq.write_table(pa.Table.from_pylist(GSM8K_TEST), manual / "test.parquet")
    data = _gsm8k_cfg(manual)
    train = D.load_split(data, "train", data_dir=tmp_path / "tfds")
    rows = sorted((train[i] for i in range(len(train))), key=lambda r: r["index"])
    assert [r["raw_prompt"] for r in rows] == [r["question"] for r in GSM8K_ROWS]
    assert [r["answer"] for r in rows] == ["7", "1500", "4.5"]
    assert rows[0]["prompt"] == D.DEFAULT_TEMPLATES["gsm8k"].format(prompt=GSM8K_ROWS[0]["question"])
    test = D.load_split(data, "test", data_dir=tmp_path / "tfds")
    assert len(test) == 1 and test[0]["answer"] == "42" and test[0]["raw_prompt"] == GSM8K_TEST[0]["question"]


def test_gsm8k_builder_hf_parquet_layout_custom_keys_and_rebuild_on_change(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    manual = tmp_path / "hf"
    (manual / "main").mkdir(parents=True)
    rows = [{"q": r["question"], "sol": r["answer"]} for r in GSM8K_ROWS]
    pq.write_table(pa.Table.from_pylist(rows), manual / "main" / "train-00000-of-00001.parquet")
    data = _gsm8k_cfg(manual, "data.prompt_key=q", "data.answer_key=sol", "data.prompt_template={prompt}")
    train = D.load_split(data, "train", data_dir=tmp_path / "tfds")
    assert sorted(train[i]["answer"] for i in range(3)) == sorted(["7", "1500", "4.5"])
    with pytest.raises(ValueError, match="no 'test' split"):
        D.load_split(data, "test", data_dir=tmp_path / "tfds")
    pq.write_table(pa.Table.from_pylist(rows[:2]), manual / "main" / "train-00000-of-00001.parquet")
    assert len(D.load_split(data, "train", data_dir=tmp_path / "tfds")) == 2


def test_gsm8k_bad_inputs(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no train file"):
        D.load_split(_gsm8k_cfg(empty), "train", data_dir=tmp_path / "tfds")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "train.jsonl").write_text(json.dumps({"prompt": "x", "answer": "#### 1"}) + "\n")
    with pytest.raises(ValueError, match="lacks 'question'/'answer'"):
        D.load_split(_gsm8k_cfg(bad), "train", data_dir=tmp_path / "tfds2")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "train.jsonl").write_text('{"question": "x", "answer": "#### 1"}\n{oops\n')
    with pytest.raises(ValueError, match="train.jsonl:2 is not valid JSON"):
        D.load_split(_gsm8k_cfg(broken), "train", data_dir=tmp_path / "tfds3")


def test_building_and_reading_does_not_import_tensorflow(tmp_path):
    code = textwrap.dedent(
        f"""
        import sys
        from rljax.config import resolve
        from rljax.data import load_split
        cfg, _ = resolve(None, ["data.embedded.num_train=8", "data.embedded.num_test=2"])
        src = load_split(cfg.data, "train", data_dir={str(tmp_path)!r})
        assert len(src) == 8 and src[0]["answer"]
        assert "tensorflow" not in sys.modules and "jax" not in sys.modules
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


# ----------------------------------------------------------------------------- prompt policy


def _items(lengths):
    return [{"prompt": "x" * n, "answer": str(n), "index": 100 + i} for i, n in enumerate(lengths)]


def test_filter_overlong_counts_and_keeps_the_rest_unchanged():
    items = _items([3, 9, 5, 6, 12, 1])
    out = D.prepare_prompts(items, _chars, max_length=5, filter_overlong=True, truncation="error")
    assert [p.index for p in out] == [100, 102, 105]
    assert [p.position for p in out] == [0, 2, 5]
    assert out.stats.total == 6 and out.stats.kept == 3 and out.stats.filtered == 3 and out.stats.truncated == 0
    assert out.stats.longest == 12
    assert all(list(p.ids) == _chars(items[p.position]["prompt"]) and not p.truncated for p in out)
    assert out.stats.metrics()["data/prompts_filtered"] == 3.0


@pytest.mark.parametrize("mode", ["left", "right"])
def test_truncation_left_and_right(mode):
    items = [{"prompt": "abcdefgh", "answer": "a"}, {"prompt": "abc", "answer": "b"}]
    out = D.prepare_prompts(items, _chars, max_length=5, truncation=mode)
    assert out.stats.truncated == 1 and out.stats.filtered == 0 and out.stats.kept == 2
    want = "defgh" if mode == "left" else "abcde"
    assert list(out[0].ids) == _chars(want) and out[0].truncated
    assert list(out[1].ids) == _chars("abc") and not out[1].truncated
    assert out[1].index == 1  # position when the source has no index
    assert D.truncate_ids(list(range(8)), 3, mode) == ([5, 6, 7] if mode == "left" else [0, 1, 2])


def test_truncation_error_names_first_row_and_count():
    with pytest.raises(ConfigError) as e:
        D.prepare_prompts(_items([3, 9, 5, 7]), _chars, max_length=5, truncation="error")
    msg = str(e.value)
    assert "2 of 4 prompts" in msg and "row 101, 9 tokens" in msg and "data.filter_overlong_prompts=true" in msg
    with pytest.raises(ConfigError, match="accepted: error, left, right"):
        D.prepare_prompts(_items([1]), _chars, max_length=5, truncation="middle")


def test_truncation_applies_only_when_not_filtering():
    out = D.prepare_prompts(_items([9]), _chars, max_length=5, filter_overlong=True, truncation="left")
    assert len(out) == 0 and out.stats.filtered == 1 and out.stats.truncated == 0


# ----------------------------------------------------------------------------- iterator


def test_each_epoch_visits_every_item_once_and_epochs_differ():
    it = D.PromptIterator(list(range(10)), 4, seed=0, shuffle=True, drop_last=False)
    epochs = [sum((next(it) for _ in range(3)), []) for _ in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(10))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert it.state()["epoch"] == 2 and it.state()["position"] == 10


def test_drop_last_gives_full_batches_and_no_shuffle_is_in_order():
    it = D.PromptIterator(list(range(10)), 4, seed=0, shuffle=False, drop_last=True)
    batches = [next(it) for _ in range(4)]
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7]]
    assert it.epoch == 1


def test_seed_changes_order():
    a = D.PromptIterator(list(range(50)), 10, seed=1)
    b = D.PromptIterator(list(range(50)), 10, seed=2)
    assert next(a) != next(b)


def test_num_epochs_stops():
    it = D.PromptIterator(list(range(5)), 2, seed=0, shuffle=False, drop_last=False, num_epochs=1)
    assert list(it) == [[0, 1], [2, 3], [4]]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    batch=st.integers(1, 12),
    stop=st.integers(0, 25),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(-(2**40), 2**40),
)
def test_resume_yields_exactly_the_same_subsequent_batches(n, batch, stop, drop_last, shuffle, seed):
    if drop_last and batch > n:
        return
    src = list(range(n))
    ref = D.PromptIterator(src, batch, seed=seed, shuffle=shuffle, drop_last=drop_last)
    full = [next(ref) for _ in range(stop + 8)]
    run = D.PromptIterator(src, batch, seed=seed, shuffle=shuffle, drop_last=drop_last)
    for _ in range(stop):
        next(run)
    saved = json.loads(json.dumps(run.state()))  # what a checkpoint stores
    resumed = D.PromptIterator(src, batch, seed=seed, shuffle=shuffle, drop_last=drop_last, state=saved)
    assert [next(resumed) for _ in range(8)] == full[stop:]


def test_resume_over_a_tfds_source(embedded_cfg, embedded_dir):
    src = D.load_split(embedded_cfg.data, "train", data_dir=embedded_dir)
    prompts = D.prepare_prompts(src, _chars, max_length=embedded_cfg.data.max_prompt_length)
    it = D.PromptIterator(prompts, 32, seed=11)
    for _ in range(4):  # crosses the first epoch boundary (96 prompts)
        next(it)
    state = it.state()
    after = [[p.index for p in next(it)] for _ in range(5)]
    again = D.PromptIterator(D.prepare_prompts(D.load_split(embedded_cfg.data, "train", data_dir=embedded_dir), _chars,
                                               max_length=embedded_cfg.data.max_prompt_length), 32, seed=11, state=state)
    assert [[p.index for p in next(again)] for _ in range(5)] == after


def test_iterator_state_errors():
    it = D.PromptIterator(list(range(10)), 2, seed=3)
    with pytest.raises(ValueError, match="seed=4"):
        D.PromptIterator(list(range(10)), 2, seed=3, state={"epoch": 0, "position": 0, "seed": 4})
    with pytest.raises(ValueError, match="saved for 12 examples"):
        it.restore({"epoch": 0, "position": 0, "seed": 3, "num_examples": 12})
    with pytest.raises(ValueError, match="lacks 'position'"):
        it.restore({"epoch": 1})
    with pytest.raises(ValueError, match="out of range"):
        it.restore({"epoch": 0, "position": 11})
    with pytest.raises(ValueError, match="larger than the dataset"):
        D.PromptIterator(list(range(3)), 4, seed=0)
    with pytest.raises(ValueError, match="empty dataset"):
        D.PromptIterator([], 1, seed=0)


def test_hide_tf_gpus_only_touches_an_already_imported_tensorflow(monkeypatch):
    import rljax._tensorflow as rtf

    calls = []

    class _Config:
        @staticmethod
        def set_visible_devices(devices, kind):
            calls.append((devices, kind))
            raise RuntimeError("Visible devices cannot be modified after being initialized")  # guarded

    fake_tf = type(sys)("tensorflow")
    fake_tf.config = _Config
    monkeypatch.setattr(rtf, "gpu_driver_present", lambda: True)
    monkeypatch.delitem(sys.modules, "tensorflow", raising=False)
    D.hide_tf_gpus()
    assert "tensorflow" not in sys.modules  # never imports TF itself
    monkeypatch.setitem(sys.modules, "tensorflow", fake_tf)
    D.hide_tf_gpus()
    assert calls == [([], "GPU")]
    monkeypatch.setattr(rtf, "gpu_driver_present", lambda: False)  # no GPU: nothing to hide, no cuInit noise
    D.hide_tf_gpus()
    assert calls == [([], "GPU")]


def test_quiet_native_stderr_drops_only_known_noise(capfd):
    import os

    from rljax._tensorflow import quiet_native_stderr

    with quiet_native_stderr():
        os.write(2, b"I0000 port.cc:153] oneDNN custom operations are on.\n")
        os.write(2, b"E0000 something real went wrong\n")
    err = capfd.readouterr().err
    assert "something real went wrong" in err and "oneDNN" not in err


def test_train_and_val_iterators_from_a_config(tmp_path):
    cfg, _ = resolve(None, ["data.embedded.num_train=40", "data.embedded.num_test=10", "data.embedded.max_operand=19",
                            "data.train_batch_size=8",
                            "actor.ppo_mini_batch_size=8", "data.val_batch_size=4", "trainer.seed=9",
                            "data.max_prompt_length=5", "data.filter_overlong_prompts=true"])
    it = D.train_iterator(cfg, _chars, data_dir=tmp_path)
    stats = it.source.stats
    two_digit = sum(len(e["prompt"]) > 5 for e in D.embedded_examples(cfg.data.embedded, "train"))
    assert 0 < two_digit < 32
    assert stats.filtered == two_digit and stats.kept == 40 - two_digit and stats.total == 40
    assert it.seed == 9 and all(len(p.ids) <= 5 for p in next(it))
    resumed = D.train_iterator(cfg, _chars, data_dir=tmp_path, state=it.state())
    assert [p.index for p in next(resumed)] == [p.index for p in next(it)]
    val = D.val_iterator(cfg, _chars, data_dir=tmp_path)
    sizes = [len(b) for b in val]
    kept_test = sum(len(e["prompt"]) <= 5 for e in D.embedded_examples(cfg.data.embedded, "test"))
    assert sum(sizes) == kept_test and all(s == 4 for s in sizes[:-1])
