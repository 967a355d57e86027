"""Built-in character tokenizer and tokenizer.json loading."""

import json

import pytest

from rljax import models


def test_char_tokenizer_roundtrip_and_specials():
    tok = models.CharTokenizer()
    assert tok.vocab_size % 8 == 0 and tok.vocab_size <= models.get_config("tiny").vocab_size
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    text = "What is 12*(3+4)? Answer: 84."
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and len(ids) == len(text) + 2
    assert len(set(ids[1:-1])) == len(set(text))
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=False) == "<bos>" + text + "<eos>"
    assert tok.encode("é") == [tok.unk_id]
    assert tok.batch_encode(["ab", "c"]) == [tok.encode("ab"), tok.encode("c")]


def test_char_tokenizer_errors():
    tok = models.CharTokenizer()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="unique"):
        models.CharTokenizer("aab")


@pytest.mark.hf
def test_load_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "!": 5}
    t = tokenizers.Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = Whitespace()
    t.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 5]}))
    tok = models.load_tokenizer(str(tmp_path))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)
    assert tok.vocab_size == 6
    assert tok.encode("hello world !", add_bos=True, add_eos=True) == [1, 3, 4, 5, 2]
    assert tok.decode([3, 4]) == "hello world"
    with pytest.raises(ValueError, match="no tokenizer.json"):
        models.load_tokenizer(str(tmp_path / "nowhere"))
