"""Data the run cannot use is refused in one line before training (issue 11, defect 6)."""

import json
import logging

import pytest

from rljax.config import ConfigError, resolve
from rljax.data import build_prompts

ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "#### 7"},
    {"question": "No answer here", "answer": None},
    {"question": "Empty answer", "answer": "   "},
    {"question": "Half of 9?", "answer": "#### 4.5"},
]


def _cfg(path):
    cfg, _ = resolve(None, ["data.dataset=gsm8k", f"data.path={path}", "data.max_prompt_length=512"])
    return cfg


def _write(d, name, rows):
    d.mkdir(exist_ok=True)
    (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def _tok(text):
    return [ord(c) % 64 for c in text]


def test_null_and_empty_answers_are_skipped_counted_and_named(tmp_path, caplog):
    _write(tmp_path / "d", "train.jsonl", ROWS)
    with caplog.at_level(logging.WARNING, logger="rljax.data"):
        prompts = build_prompts(_cfg(tmp_path / "d"), "train", _tok, data_dir=tmp_path / "tfds")
    s = prompts.stats
    assert (s.total, s.kept, s.no_answer) == (4, 2, 2)
    assert s.first_no_answer in (1, 2)
    assert sorted(p.answer for p in prompts) == ["4.5", "7"]  # never the string "None"
    assert s.metrics()["data/prompts_no_answer"] == 2.0
    assert "2 of 4 train rows have an empty or null answer" in caplog.text


def test_a_split_with_no_answer_at_all_is_one_line(tmp_path):
    _write(tmp_path / "d", "train.jsonl", ROWS[1:3])
    with pytest.raises(ConfigError) as e:
        build_prompts(_cfg(tmp_path / "d"), "train", _tok, data_dir=tmp_path / "tfds")
    assert "no usable prompt" in str(e.value) and "2 with an empty or null answer" in str(e.value)


@pytest.mark.parametrize("split", ["train", "test"])
def test_empty_split_file_is_one_line_naming_it(tmp_path, split):
    d = tmp_path / "d"
    _write(d, "train.jsonl", ROWS[:1])
    _write(d, "test.jsonl", ROWS[:1])
    (d / f"{split}.jsonl").write_text("\n")
    with pytest.raises(ConfigError) as e:
        build_prompts(_cfg(d), "train", _tok, data_dir=tmp_path / "tfds")
    msg = str(e.value)
    assert "\n" not in msg and f"the {split} split is empty ({split}.jsonl hold" in msg


def test_missing_test_split_and_missing_files_are_config_errors(tmp_path):
    _write(tmp_path / "d", "train.jsonl", ROWS[:1])
    with pytest.raises(ConfigError, match="no 'test' split; available: train"):
        build_prompts(_cfg(tmp_path / "d"), "test", _tok, data_dir=tmp_path / "tfds")
    (tmp_path / "none").mkdir()
    with pytest.raises(ConfigError, match="no train file"):
        build_prompts(_cfg(tmp_path / "none"), "train", _tok, data_dir=tmp_path / "tfds")


NO_PROMPT = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "#### 7"},
    {"question": None, "answer": "#### 2"},  # issue 39: trained as a one-token prompt, never counted
    {"question": "  ", "answer": "#### 3"},
    {"question": "Half of 9?", "answer": "#### 4.5"},
]


def test_null_and_empty_prompts_are_skipped_and_counted_where_prompts_may_be_cut(tmp_path, caplog):
    _write(tmp_path / "d", "train.jsonl", NO_PROMPT)
    cfg, _ = resolve(None, ["data.dataset=gsm8k", f"data.path={tmp_path / 'd'}", "data.max_prompt_length=512",
                            "data.truncation=left"])
    with caplog.at_level(logging.WARNING, logger="rljax.data"):
        prompts = build_prompts(cfg, "train", _tok, data_dir=tmp_path / "tfds")
    s = prompts.stats
    assert (s.total, s.kept, s.no_prompt, s.first_no_prompt, s.no_answer) == (4, 2, 2, 1, 0)
    assert sorted(p.answer for p in prompts) == ["4.5", "7"]
    assert s.metrics()["data/prompts_no_prompt"] == 2.0  # the step-0 record of metrics.jsonl
    assert "2 of 4 train rows have an empty or null prompt and were skipped (first: row 1)" in caplog.text


def test_null_prompts_are_refused_in_one_line_under_truncation_error(tmp_path):
    from rljax.data import check

    _write(tmp_path / "d", "train.jsonl", NO_PROMPT)
    _write(tmp_path / "d", "test.jsonl", NO_PROMPT[:1])
    cfg, _ = resolve(None, ["data.dataset=gsm8k", f"data.path={tmp_path / 'd'}", "data.max_prompt_length=256",
                            "reward.function=gsm8k"])
    with pytest.raises(ConfigError) as e:  # the pre-flight, before anything is written
        check(cfg, tokenizer=_CharTok())
    msg = str(e.value)
    assert "\n" not in msg and "train split: 2 of 4 rows have an empty or null prompt (first: row 1)" in msg, msg
    assert "data.truncation=left|right" in msg


def test_chat_prompts_without_content_are_empty():
    from rljax.data import prepare_prompts

    items = [{"prompt": "x", "raw_prompt": [{"role": "user", "content": ""}], "answer": "1"},
             {"prompt": "y", "raw_prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}]
    s = prepare_prompts(items, _tok, max_length=16, truncation="right").stats
    assert (s.kept, s.no_prompt) == (1, 1)


class _CharTok:
    chat_template = None

    def encode(self, text, add_bos=True):
        return _tok(text)


def test_a_byte_that_is_not_utf8_names_the_file_and_line(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "train.jsonl").write_bytes(b'{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+\xff2?", "answer": "#### 4"}\n')
    (d / "train.json").write_bytes(b'[{"question": "1+1?",\n "answer": "#### \xff"}]')
    from rljax.data import read_records

    with pytest.raises(ValueError) as e:
        list(read_records(d / "train.jsonl"))
    assert str(e.value).startswith(f"{d / 'train.jsonl'}:2: byte 0xFF at column 17 is not UTF-8 text"), e.value
    with pytest.raises(ValueError) as e:
        list(read_records(d / "train.json"))
    assert str(e.value).startswith(f"{d / 'train.json'}:2: byte 0xFF"), e.value
