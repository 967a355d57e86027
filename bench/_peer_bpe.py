"""Inputs of ``bench/peer_trl.py``'s BPE cases (``0.5b``, ``bpe-smoke``), built here with no download:

* :func:`build_tokenizer`: a byte-level BPE ``tokenizer.json`` whose ids index the whole
  embedding (151,936 rows for Qwen2.5-0.5B): merges trained with ``tokenizers`` on GSM8K-style
  text, then further merges of pairs of the most frequent tokens until every id has a token
  (Qwen2.5's own vocabulary has 151,643 merged tokens; the ids a random model samples must all
  decode); ``<|endoftext|>`` (EOS and padding, no BOS, as Qwen2) and the ChatML markers take
  the last three ids;
* :func:`write_gsm8k`: GSM8K-format ``train.jsonl`` / ``test.jsonl`` (``question``, ``answer``
  ending in ``#### <number>``) whose questions are about ``prompt_tokens`` tokens long;
* :func:`reward`: the reward both sides score with (``reward.function=bench/_peer_bpe.py:reward``
  for rljax, a TRL reward function for TRL).
"""

from __future__ import annotations

import json
import os
import random

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NAMES = ["Tom", "Maria", "James", "Aisha", "Chen", "Olga", "Pedro", "Fatima", "Liam", "Noor", "Sven", "Keiko"]
ITEMS = ["apples", "pencils", "marbles", "stickers", "cookies", "books", "tickets", "shells", "cards", "eggs",
         "bottles", "flowers", "coins", "boxes", "candles", "lemons"]
PLACES = ["market", "school", "library", "bakery", "garden", "store", "park", "museum", "farm", "station"]
TRAINED_MERGES = 8000  # merges learned from text; the rest of the vocabulary is pair merges


def _sentence(rng: random.Random, who: str, item: str, total: int) -> tuple[str, int]:
    """One sentence of a word problem about ``who``'s ``item`` and the new total."""
    k = rng.randint(2, 60)
    other, place, price = rng.choice(NAMES), rng.choice(PLACES), rng.randint(2, 19)
    kind = rng.randrange(4)
    if kind == 0:
        return f"At the {place}, {who} buys {k} more {item} for {price} dollars each.", total + k
    if kind == 1 and total > k:
        return f"Then {who} gives {k} of the {item} to {other}, who keeps them in a box.", total - k
    if kind == 2:
        return f"On the way home from the {place}, {other} hands {who} another {k} {item}.", total + k
    return f"Each of the {k} {item} that {other} saw at the {place} cost {price} dollars.", total


def question(rng: random.Random, sentences: int) -> tuple[str, str]:
    """A GSM8K-style question of ``sentences`` + 2 sentences and its ``#### <number>`` answer."""
    who, item = rng.choice(NAMES), rng.choice(ITEMS)
    total = rng.randint(5, 90)
    parts = [f"{who} has {total} {item} at home."]
    for _ in range(sentences):
        text, total = _sentence(rng, who, item, total)
        parts.append(text)
    parts.append(f"How many {item} does {who} have now?")
    return " ".join(parts), f"{who} ends with {total} {item}. #### {total}"


def build_tokenizer(path: str, vocab_size: int) -> str:
    """Writes ``path/tokenizer.json`` + ``tokenizer_config.json`` (``vocab_size`` ids in all) and returns ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    corpus = [" ".join(question(rng, 8)) for _ in range(2000)]
    regular = vocab_size - len(SPECIAL)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=min(regular, 256 + TRAINED_MERGES), special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    base = sorted(vocab, key=vocab.get)[:600]  # pairs of these fill the rest
    for a in base:
        for b in base:
            if len(vocab) >= regular:
                break
            if a + b not in vocab:
                vocab[a + b] = len(vocab)
                merges.append((a, b))
    if len(vocab) < regular:
        raise ValueError(f"vocab_size {vocab_size} is more than this builder fills ({len(vocab) + len(SPECIAL)})")
    full = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    full.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    full.decoder = decoders.ByteLevel()
    full.add_special_tokens(SPECIAL)
    if full.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise AssertionError(f"built {full.get_vocab_size(with_added_tokens=True)} ids, wanted {vocab_size}")
    os.makedirs(path, exist_ok=True)
    full.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": SPECIAL[0], "pad_token": SPECIAL[0],
                   "bos_token": None, "padding_side": "left", "model_max_length": 32768}, f)
    return path


def write_gsm8k(path: str, tokenizer_json: str, prompt_tokens: int, rows: int) -> int:
    """``path/train.jsonl`` (``rows`` questions of ``prompt_tokens`` tokens or a few more, each grown
    sentence by sentence) and a small ``test.jsonl``; returns the longest question's token count."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    rng = random.Random(1)
    longest = 0
    os.makedirs(path, exist_ok=True)
    for split, n in (("train", rows), ("test", 4)):
        with open(os.path.join(path, f"{split}.jsonl"), "w") as f:
            for _ in range(n):
                state = rng.getstate()
                sentences = 1
                while True:
                    rng.setstate(state)
                    q, a = question(rng, sentences)
                    length = len(tok.encode(q).ids)
                    if length >= prompt_tokens:
                        break
                    sentences += 1
                longest = max(longest, length)
                f.write(json.dumps({"question": q, "answer": a}) + "\n")
    return longest


def reward(response: str, answer: str, **extra) -> float:
    """1.0 for the right GSM8K answer, else a quarter of the share of digits among the response's
    visible characters (so that a random model's samples differ and GRPO's advantages are not zero)."""
    from rljax.reward._rules import gsm8k_reward

    if gsm8k_reward(response, answer) == 1.0:
        return 1.0
    visible = [c for c in response if not c.isspace()]
    return 0.25 * sum(c.isdigit() for c in visible) / max(len(visible), 1)
