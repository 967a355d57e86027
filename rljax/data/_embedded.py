"""The embedded synthetic task: tiny, local, deterministic, learnable by a tiny model on CPU.

Two variants (``data.embedded.task``), both in the character vocabulary of
:class:`rljax.models.tokenizer.CharTokenizer`:

* ``add`` (default): prompt ``"a+b="`` with ``a, b`` uniform in ``[0, max_operand]``,
  answer the decimal sum (``"7+8="`` -> ``"15"``). With ``max_operand=9`` there are 100
  distinct prompts and answers of one or two digits.
* ``lookup`` (the multi-turn tool task, ``env.function=lookup``): prompt ``"key xy="``
  with two random letters, answer a random digit in ``[0, min(max_operand, 9)]`` drawn
  independently of the prompt; only
  the environment's ``lookup`` tool reveals it, so without the tool the answer is chance.
* ``reverse``: prompt ``"rev abc="`` with a random lowercase string of ``length``
  letters, answer the reversed string (``"cba"``).

Example ``i`` of a split is a pure function of ``(seed, split, i)``, so the dataset is
identical on every machine and every build. Train and test are sampled independently
from the same distribution (the test split measures learned accuracy, not generalisation
to unseen operand pairs). The reward is :func:`rljax.reward.embedded_reward`: 1.0 for the
exact answer, partial credit (< 0.5) for a well-formed answer and for matching digits.
"""

from __future__ import annotations

import string
from collections.abc import Iterator

from rljax.data._prng import uniform_int

SPLITS = {"train": 1, "test": 2}


def embedded_example(task, split: str, index: int) -> dict:
    """Example ``index`` of ``split`` for an :class:`~rljax.config.EmbeddedTaskConfig`-like ``task``."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; accepted: {', '.join(SPLITS)}")
    key = (task.seed, SPLITS[split], index)
    if task.task == "add":
        a = uniform_int(task.max_operand + 1, *key, 0)
        b = uniform_int(task.max_operand + 1, *key, 1)
        return {"prompt": f"{a}+{b}=", "answer": str(a + b), "index": index}
    if task.task == "reverse":
        letters = "".join(string.ascii_lowercase[uniform_int(26, *key, j)] for j in range(task.length))
        return {"prompt": f"rev {letters}=", "answer": letters[::-1], "index": index}
    if task.task == "lookup":
        if task.max_operand > 9:
            raise ValueError(f"lookup answers are one digit: data.embedded.max_operand={task.max_operand}; accepted: 1..9")
        letters = "".join(string.ascii_lowercase[uniform_int(26, *key, j)] for j in range(2))
        return {"prompt": f"key {letters}=", "answer": str(uniform_int(task.max_operand + 1, *key, 2)), "index": index}
    raise ValueError(f"unknown embedded task {task.task!r}; accepted: add, reverse, lookup")


def embedded_examples(task, split: str) -> Iterator[dict]:
    n = task.num_train if split == "train" else task.num_test
    for i in range(n):
        yield embedded_example(task, split, i)


def embedded_config_name(task) -> str:
    """A TFDS config name that changes whenever the generated content would."""
    if task.task == "add":
        shape = f"add-m{task.max_operand}"
    elif task.task == "lookup":
        shape = f"lookup-m{task.max_operand}"
    else:
        shape = f"reverse-l{task.length}"
    return f"{shape}-n{task.num_train}-t{task.num_test}-s{task.seed}"
