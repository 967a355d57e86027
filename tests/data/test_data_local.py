"""data.dataset=local: verl's parquet layout, jsonl / json / datasets directories, field
mapping, the tokenizer's chat template, resumable iteration, and the data pre-flight
(issue 25, friction 3)."""

import json

import pytest

from rljax.config import ConfigError, resolve
from rljax.data import PromptIterator, build_prompts, check, train_iterator
from rljax.tokenizer import CharTokenizer, load_tokenizer

from hf_tiny import CHATML, tokenizer_dir
from repo_paths import REPO

QUESTIONS = [f"Tom has {i} apples and buys {i + 1}. How many?" for i in range(12)]


def _verl_rows(n=12, split="train", source="openai/gsm8k"):
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    return [{
        "data_source": source,
        "prompt": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)},
        "extra_info": {"split": split, "index": i, "question": QUESTIONS[i % len(QUESTIONS)]},
    } for i in range(n)]


def _parquet(d, name, rows, row_group_size=None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), d / name, row_group_size=row_group_size)


def _cfg(path, *overrides):
    cfg, _ = resolve(None, ["data.dataset=local", f"data.path={path}", "data.max_prompt_length=64",
                            "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", *overrides])
    return cfg


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(str(tok_dir))


def _encode(tok):
    return lambda text: tok.encode(text, add_bos=True)


def test_verl_parquet_layout_as_is(tmp_path, tok, tok_dir):
    import transformers

    d = tmp_path / "gsm8k"
    _parquet(d, "train.parquet", _verl_rows(), row_group_size=5)  # several row groups, streamed
    _parquet(d, "test.parquet", _verl_rows(3, "test"))
    prompts = build_prompts(_cfg(d), "train", _encode(tok), data_dir=tmp_path / "tfds",
                            chat_template=tok.apply_chat_template)
    assert len(prompts) == 12
    p = prompts[3]
    want = transformers.AutoTokenizer.from_pretrained(str(tok_dir)).apply_chat_template(
        [{"role": "user", "content": QUESTIONS[3]}], tokenize=False, add_generation_prompt=True)
    assert p.prompt == want and list(p.ids) == tok.encode(want)
    assert (p.answer, p.data_source) == ("7", "openai/gsm8k")
    assert p.extra_info == {"split": "train", "index": 3, "question": QUESTIONS[3]}
    assert p.reward_extra() == {**p.extra_info, "data_source": "openai/gsm8k"}


VERL_REWARD = '''
seen = []

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    seen.append((data_source, ground_truth, extra_info))
    return float(solution_str.strip() == ground_truth)
'''


def test_verl_compute_score_gets_data_source_ground_truth_and_extra_info(tmp_path, tok):
    from rljax.reward import get_reward_fn, score_batch

    d = tmp_path / "data"
    _parquet(d, "train.parquet", _verl_rows(4, source="my/source"))
    (tmp_path / "r.py").write_text(VERL_REWARD)
    prompts = build_prompts(_cfg(d), "train", _encode(tok), data_dir=tmp_path / "tfds",
                            chat_template=tok.apply_chat_template)
    fn = get_reward_fn(f"{tmp_path / 'r.py'}:compute_score", dataset="local")
    p = prompts[1]
    scores, _ = score_batch(fn, ["3", "0"], [p.answer, p.answer], ["u0", "u1"], max_error_fraction=0.0,
                            extras=[p.reward_extra(), p.reward_extra()])
    assert scores.tolist() == [1.0, 0.0]
    assert fn.__wrapped__.__globals__["seen"][0] == ("my/source", "3", {"split": "train", "index": 1,
                                                                       "question": QUESTIONS[1]})


def test_auto_reward_dispatches_on_data_source():
    from rljax.reward import get_reward_fn

    fn = get_reward_fn("auto", dataset="local")
    assert fn("so #### 7", "7", data_source="openai/gsm8k") == 1.0
    with pytest.raises(ValueError, match="no built-in reward for data_source='x'"):
        fn("7", "7", data_source="x")


def test_jsonl_with_field_mapping_and_text_prompts(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    rows = [{"q": f"what is {i}+1?", "sol": {"final": str(i + 1)}} for i in range(6)]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "validation.json").write_text(json.dumps(rows[:2]))  # validation* is the test split
    cfg = _cfg(d, "data.prompt_key=q", "data.answer_key=sol.final", "data.prompt_template=Q: {prompt}")
    tok = CharTokenizer()
    train = build_prompts(cfg, "train", _encode(tok), data_dir=tmp_path / "tfds")
    test = build_prompts(cfg, "test", _encode(tok), data_dir=tmp_path / "tfds")
    assert [p.prompt for p in train][:2] == ["Q: what is 0+1?", "Q: what is 1+1?"]
    assert [p.answer for p in train] == ["1", "2", "3", "4", "5", "6"] and len(test) == 2
    assert train[0].data_source == "" and train[0].reward_extra() == {}


def test_messages_key_conversation_and_system_prompt(tmp_path, tok):
    d = tmp_path / "data"
    d.mkdir()
    conv = [{"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": str(i)}]}
            for i in range(4)]
    for split in ("train", "test"):
        (d / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in conv))
    cfg = _cfg(d, "data.messages_key=messages", "data.system_prompt=Be brief.")
    prompts = build_prompts(cfg, "train", _encode(tok), data_dir=tmp_path / "tfds",
                            chat_template=tok.apply_chat_template)
    assert prompts[2].answer == "2"
    assert prompts[2].prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nsay 2<|im_end|>\n"
                                 "<|im_start|>assistant\n")


def test_datasets_save_to_disk_directory(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    d = tmp_path / "hf"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(_verl_rows(8)),
                          "validation": datasets.Dataset.from_list(_verl_rows(2, "test"))}).save_to_disk(str(d))
    cfg = _cfg(d)
    check(cfg, tok)
    train = build_prompts(cfg, "train", _encode(tok), data_dir=tmp_path / "tfds", chat_template=tok.apply_chat_template)
    test = build_prompts(cfg, "test", _encode(tok), data_dir=tmp_path / "tfds", chat_template=tok.apply_chat_template)
    assert [p.answer for p in train] == [str(2 * i + 1) for i in range(8)] and len(test) == 2


def test_local_iteration_resumes_exactly(tmp_path, tok):
    d = tmp_path / "data"
    _parquet(d, "train.parquet", _verl_rows(12), row_group_size=4)
    _parquet(d, "test.parquet", _verl_rows(2, "test"))
    cfg = _cfg(d)
    kw = dict(data_dir=tmp_path / "tfds", chat_template=tok.apply_chat_template)
    it = train_iterator(cfg, _encode(tok), **kw)
    for _ in range(4):  # past an epoch boundary
        next(it)
    state = it.state()
    want = [[p.index for p in next(it)] for _ in range(3)]
    again = train_iterator(cfg, _encode(tok), state=state, **kw)
    assert [[p.index for p in next(again)] for _ in range(3)] == want
    assert isinstance(it, PromptIterator) and it.source._positions.dtype.itemsize == 8  # no Prompt objects held


# ---------------------------------------------------------------------------- pre-flight


def test_preflight_chat_prompts_without_a_chat_template(tmp_path):
    d = tmp_path / "data"
    _parquet(d, "train.parquet", _verl_rows(4))
    _parquet(d, "test.parquet", _verl_rows(1))
    no_template = load_tokenizer(str(tokenizer_dir(tmp_path / "tok", chat_template=None)))
    with pytest.raises(ConfigError, match="the prompts are chat messages, but the tokenizer has no chat template"):
        check(_cfg(d), no_template)
    check(_cfg(d, "data.apply_chat_template=false", "data.max_prompt_length=256"), no_template)


def test_preflight_missing_fields_name_what_is_there(tmp_path, tok):
    d = tmp_path / "data"
    d.mkdir()
    for split in ("train", "test"):
        (d / f"{split}.jsonl").write_text(json.dumps({"text": "hi", "label": "1"}) + "\n")
    with pytest.raises(ConfigError) as e:
        check(_cfg(d), tok)
    assert "no prompt field" in str(e.value) and "fields: label, text" in str(e.value)
    with pytest.raises(ConfigError, match="no answer field .*'gt'"):
        check(_cfg(d, "data.prompt_key=text", "data.answer_key=gt"), tok)


def test_preflight_unknown_data_source_with_auto_reward(tmp_path, tok):
    d = tmp_path / "data"
    _parquet(d, "train.parquet", _verl_rows(4, source="lighteval/MATH"))
    _parquet(d, "test.parquet", _verl_rows(1))
    with pytest.raises(ConfigError, match="no built-in reward for data_source='lighteval/MATH'"):
        check(_cfg(d), tok)


def test_preflight_answers_without_the_gsm8k_marker(tmp_path):
    d = tmp_path / "g"
    d.mkdir()
    rows = [{"question": "1+1?", "answer": "two, since one and one make two"}] * 4
    for split in ("train", "test"):
        (d / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg, _ = resolve(None, ["data.dataset=gsm8k", f"data.path={d}", "data.max_prompt_length=256",
                            "data.train_batch_size=2", "actor.ppo_mini_batch_size=2"])
    with pytest.raises(ConfigError, match=r"no '####' in 100% of the first 4 answers .*set data.answer_key or "
                                          "reward.function"):
        check(cfg, CharTokenizer())
    ok, _ = resolve(None, ["data.dataset=gsm8k", f"data.path={d}", "data.max_prompt_length=256",
                           "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "reward.function=exact_match"])
    check(ok, CharTokenizer())


def test_preflight_through_the_launcher_exits_2_and_writes_nothing(tmp_path, capsys):
    from rljax.launch import main

    d = tmp_path / "data"
    _parquet(d, "train.parquet", _verl_rows(4, source="unknown/src"))
    _parquet(d, "test.parquet", _verl_rows(1))
    tokd = tokenizer_dir(tmp_path / "tok")
    run = tmp_path / "run"
    assert main(["--run-dir", str(run), "data.dataset=local", f"data.path={d}", f"model.tokenizer={tokd}",
                 "data.max_prompt_length=64"]) == 2
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(lines) == 1 and "data_source='unknown/src'" in lines[0] and not run.exists()


def test_gsm8k_preset_uses_the_tokenizers_chat_template(tmp_path):
    """The preset names no model-specific template: a Qwen2 tokenizer's own gives the prompt."""
    import yaml

    preset = REPO / "configs" / "qwen2_5_0_5b_gsm8k.yaml"
    raw = yaml.safe_load(preset.read_text())
    assert "<|im_start|>" not in json.dumps(raw) and raw["data"]["apply_chat_template"] in (True, "true")
    d = tmp_path / "g"
    d.mkdir()
    for split in ("train", "test"):
        (d / f"{split}.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    tokd = tokenizer_dir(tmp_path / "tok")
    tok = load_tokenizer(str(tokd))
    cfg, _ = resolve(preset, [f"data.path={d}",
                                                           f"model.tokenizer={tokd}"])
    (p,) = build_prompts(cfg, "train", _encode(tok), data_dir=tmp_path / "tfds", chat_template=tok.apply_chat_template)
    assert p.prompt == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n1+1? Let's think "
                        "step by step and output the final answer after \"####\".<|im_end|>\n<|im_start|>assistant\n")


def test_verl_train_files_and_val_files(tmp_path, tok):
    """verl's data.train_files / data.val_files (one path, or its list form) instead of data.path."""
    d = tmp_path / "data"
    _parquet(d, "a.parquet", _verl_rows(6))
    _parquet(d, "b.parquet", _verl_rows(4))
    _parquet(d, "held_out.parquet", _verl_rows(2, "test"))
    cfg, _ = resolve(None, ["data.dataset=local", f"data.train_files=[{d / 'a.parquet'}, {d / 'b.parquet'}]",
                            f"data.val_files={d / 'held_out.parquet'}", "data.max_prompt_length=64",
                            "data.train_batch_size=4", "actor.ppo_mini_batch_size=4"])
    check(cfg, tok)
    kw = dict(data_dir=tmp_path / "tfds", chat_template=tok.apply_chat_template)
    assert len(build_prompts(cfg, "train", _encode(tok), **kw)) == 10
    assert [p.extra_info["split"] for p in build_prompts(cfg, "test", _encode(tok), **kw)] == ["test", "test"]
    no_val, _ = resolve(None, ["data.dataset=local", f"data.train_files={d / 'a.parquet'}", "data.max_prompt_length=64",
                               "data.train_batch_size=4", "actor.ppo_mini_batch_size=4"])
    with pytest.raises(ConfigError, match="data.val_files is not"):
        check(no_val, tok)
    with pytest.raises(ConfigError, match="need data.dataset=local"):
        resolve(None, [f"data.train_files={d / 'a.parquet'}"])


def test_parquet_is_read_by_record_batch_not_whole(tmp_path, monkeypatch):
    """Streaming: a parquet split is never read as one table; the prepared prompts keep 9 bytes a row."""
    import pyarrow.parquet as pq

    from rljax.data import read_records

    d = tmp_path / "data"
    _parquet(d, "train.parquet", _verl_rows(12) * 50, row_group_size=200)

    def whole(*a, **k):
        raise AssertionError("read the whole file")

    monkeypatch.setattr(pq, "read_table", whole)
    monkeypatch.setattr(pq.ParquetFile, "read", whole)
    rows = read_records(d / "train.parquet")
    assert next(rows)["reward_model"]["ground_truth"] == "1" and sum(1 for _ in rows) == 599
    _parquet(d, "test.parquet", _verl_rows(2))
    prompts = build_prompts(_cfg(d, "data.apply_chat_template=false"), "train", _encode(CharTokenizer()),
                            data_dir=tmp_path / "tfds")
    assert len(prompts) == 600 and prompts[599].answer == "23"
    assert prompts._positions.nbytes + prompts._truncated.nbytes == 9 * len(prompts)
