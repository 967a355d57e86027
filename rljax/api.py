"""``rljax.train(...)``: the launcher from Python, in the shape of TRL's ``GRPOTrainer``.

::

    import rljax

    def correct(completions, answer, **kwargs):          # TRL's signature (rljax's and verl's work too)
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    run_dir = rljax.train(
        model="/ckpt/my-model",                            # a checkpoint directory, or a preset name
        dataset=[{"prompt": "1+1=", "answer": "2"}, ...],  # rows, or a file / directory path
        reward_funcs=[correct, "my_reward.py:compute_score"],
        reward_weights=[1.0, 0.5],
        overrides={"trainer.total_steps": 50, "rollout.n": 8},
    )

It builds the same ``key=value`` overrides a command line would (``model.path``, ``data.path``
or ``data.train_files``, ``reward.function`` or ``reward.functions`` / ``reward.weights``, then
``overrides``), resolves them as the launcher does (:func:`rljax.config.resolve_run`: your own
model or data start from ``configs/own.yaml``), and runs :func:`rljax.launch.main` in this
process. Rows given as a list are written as JSON lines into the run directory
(``<run dir>/dataset/``). Python callables run in this process (``reward.num_workers=0``).
Returns the run directory; a usage error raises :class:`rljax.errors.UsageError` with the
launcher's one line, a failed run :class:`RunFailed` with its exit status.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

from rljax.config import resolve_run
from rljax.errors import ConfigError, UsageError
from rljax.launch import main, run_directory
from rljax.reward import register_callable

Reward = Union[str, Callable]


class RunFailed(RuntimeError):
    """The run started and stopped on an error (the launcher's exit status 1, 3, 130, 143)."""

    def __init__(self, status: int, run_dir: str):
        super().__init__(f"rljax run in {run_dir} ended with exit status {status} (see its last lines above)")
        self.status, self.run_dir = status, run_dir


def _value(v) -> str:
    """An override's value as the command line writes it (YAML: true, 1e-06, [a,b])."""
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    if isinstance(v, bool) or v is None:
        return {True: "true", False: "false", None: "null"}[v]
    return str(v)


def _override_list(overrides) -> list[str]:
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [f"{k}={_value(v)}" for k, v in overrides.items()]
    if isinstance(overrides, str):
        raise UsageError(f"overrides must be a dict or a list of key=value strings, got the string {overrides!r}")
    return list(overrides)


def _reward_overrides(reward_funcs, reward_weights) -> list[str]:
    if reward_funcs is None:
        if reward_weights is not None:
            raise UsageError("reward_weights needs reward_funcs")
        return []
    funcs = [reward_funcs] if isinstance(reward_funcs, str) or callable(reward_funcs) else list(reward_funcs)
    specs = [f if isinstance(f, str) else register_callable(f) for f in funcs]
    if len(specs) == 1 and reward_weights is None:
        return [f"reward.function={specs[0]}"]
    out = ["reward.functions=[" + ",".join(specs) + "]"]
    if reward_weights is not None:
        out.append("reward.weights=[" + ",".join(str(float(w)) for w in reward_weights) + "]")
    return out


def _data_overrides(key_dir: str, key_files: str, data, name: str) -> tuple[list[str], list | None]:
    """``(overrides, rows to write)`` for a dataset given as a path or as rows."""
    if data is None:
        return [], None
    if isinstance(data, (str, os.PathLike)):
        path = os.fspath(data)
        if key_dir and os.path.isdir(path):
            return [f"{key_dir}={path}"], None
        return [f"{key_files}=[{path}]"], None
    rows = list(data)
    if not rows or not all(isinstance(r, Mapping) for r in rows):
        raise UsageError(f"{name} must be a path or a non-empty list of dicts (one row each, e.g. "
                         "{'prompt': '1+1=', 'answer': '2'})")
    return [], rows


def train(model: str | None = None, dataset=None, *, reward_funcs: Reward | Sequence[Reward] | None = None,
          reward_weights: Sequence[float] | None = None, eval_dataset=None, config: str | None = None,
          overrides: Mapping[str, Any] | Sequence[str] | None = None, run_dir: str | None = None,
          mesh: str | None = None, resume: bool = False) -> str:
    """Trains as ``python -m rljax.launch`` would and returns the run directory (absolute).

    Args:
      model: a local Hugging Face checkpoint directory (``model.path``) or a preset name (``model.name``).
      dataset: the training rows: a list of dicts, a ``.jsonl`` / ``.json`` / ``.parquet`` file, or a
        directory with ``train*`` and ``test*`` files (``data.path``).
      reward_funcs: one reward or several: Python callables or ``"path/to/file.py:function"`` /
        built-in names; several are summed with ``reward_weights`` (default 1 each), each logged.
      eval_dataset: validation rows or file (``data.val_files``); with a list ``dataset`` and none,
        the training rows are validated on.
      config: a preset (``--config``); default ``configs/default.yaml``, or ``configs/own.yaml``
        with your own model or data.
      overrides: more keys, ``{"rollout.n": 8}`` or ``["rollout.n=8"]`` (verl's key paths too).
      run_dir: the run directory (``--run-dir``); default ``runs/<project>/<model>-<data>``.
      mesh: ``--mesh`` (default: dp over every device).
      resume: continue the run in ``run_dir`` (``--resume``).

    Raises:
      UsageError: a mistake in the arguments or the configuration (the launcher's one line).
      RunFailed: the run stopped on an error.
    """
    over = []
    if model is not None:
        over.append(f"model.path={model}" if os.path.isdir(os.path.expanduser(str(model))) else f"model.name={model}")
    train_over, rows = _data_overrides("data.path", "data.train_files", dataset, "dataset")
    eval_over, eval_rows = _data_overrides("", "data.val_files", eval_dataset, "eval_dataset")
    over += train_over + eval_over + _reward_overrides(reward_funcs, reward_weights)
    placeholder = ["data.train_files=[rows.jsonl]"] if rows is not None else []
    try:
        cfg, _ = resolve_run(config, over + placeholder + _override_list(overrides), validate=False)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    out = os.path.abspath(run_dir or run_directory(cfg))
    writes = {"train": rows} if rows is not None else {}
    if eval_rows is not None:
        writes["val"] = eval_rows
    elif rows is not None and eval_dataset is None:
        writes["val"] = rows  # validated on the training rows, as a list gives no test split
    for split, data in writes.items():  # written where the run keeps them, so a resume finds them
        path = os.path.join(out, "dataset", f"{split}.jsonl")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in data)
        over.append(f"data.{split}_files=[{path}]")
    argv = [*(["--config", config] if config else []), *(["--mesh", mesh] if mesh else []), "--run-dir", out,
            *(["--resume"] if resume else []), *over, *_override_list(overrides)]
    status = main(argv)
    if status == 2:
        raise UsageError(f"rljax.train: the launcher refused the run (its line is above); arguments: {argv}")
    if status != 0:
        raise RunFailed(status, out)
    return out
