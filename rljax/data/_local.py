"""Local GSM8K-format files: ``question`` / ``answer`` records in JSONL, JSON or Parquet.

Files for a split are found under the ``manual_dir`` (recursively) by name: any
``.jsonl``, ``.json`` or ``.parquet`` file whose name starts with the split name
(``train.jsonl``, ``test.parquet``, the Hugging Face layout
``main/train-00000-of-00001.parquet``). The ``answer`` field follows the GSM8K convention
``"<reasoning> #### 42"``; the reference answer is what follows the last ``####``
(:func:`rljax.reward.gsm8k_ground_truth`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from rljax.reward import gsm8k_ground_truth

EXTENSIONS = (".jsonl", ".json", ".parquet")
SPLITS = ("train", "test")


def split_files(manual_dir: str | Path) -> dict[str, list[Path]]:
    """``{split: [files]}`` for the splits present under ``manual_dir`` (sorted paths)."""
    root = Path(manual_dir).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"data.path={str(manual_dir)!r} is not a directory")
    out: dict[str, list[Path]] = {}
    for f in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in EXTENSIONS):
        for split in SPLITS:
            if f.name.startswith(split):
                out.setdefault(split, []).append(f)
    if "train" not in out:
        raise FileNotFoundError(
            f"data.path={str(manual_dir)!r} has no train file: expected train*.jsonl, train*.json or train*.parquet"
        )
    return out


def check_not_empty(files: dict[str, list[Path]], manual_dir: str | Path) -> None:
    """Raises :class:`~rljax.config.ConfigError` naming a split whose files hold no record (TFDS
    would fail on it with an internal assertion)."""
    from rljax.config import ConfigError

    for split, paths in files.items():
        if not any(True for p in paths for _ in read_records(p)):
            names = ", ".join(p.name for p in paths)
            raise ConfigError(f"data.path={str(manual_dir)!r}: the {split} split is empty ({names} hold no records)")


def fingerprint(manual_dir: str | Path, *keys: str) -> str:
    """A short hash of the split files (relative path, size, mtime) and ``keys``: a changed file rebuilds."""
    h = hashlib.sha1()
    root = Path(manual_dir).expanduser()
    for split, files in sorted(split_files(root).items()):
        for f in files:
            st = f.stat()
            h.update(f"{split}|{f.relative_to(root)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    for k in keys:
        h.update(f"key|{k}\n".encode())
    return h.hexdigest()[:12]


def read_records(path: Path) -> Iterator[dict]:
    """Records of one JSONL / JSON (a list of objects) / Parquet file."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:  # pragma: no cover - pyarrow comes with tensorflow-datasets
            raise ImportError("reading Parquet needs pyarrow: pip install pyarrow") from e
        table = pq.read_table(path)
        yield from table.to_pylist()
    elif path.suffix == ".jsonl":
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{lineno} is not valid JSON: {e.msg}") from None
    else:
        with path.open() as f:
            data = json.load(f)
        if not isinstance(data, list):
            raise ValueError(f"{path} must hold a JSON list of objects")
        yield from data


def local_examples(files: list[Path], *, prompt_key: str = "question", answer_key: str = "answer") -> Iterator[tuple[int, dict]]:
    """``(key, {"prompt", "answer", "solution", "index"})`` for every record of ``files`` in order."""
    index = 0
    for path in files:
        for i, rec in enumerate(read_records(path)):
            if not isinstance(rec, dict) or prompt_key not in rec or answer_key not in rec:
                have = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
                raise ValueError(
                    f"{path} record {i} lacks {prompt_key!r}/{answer_key!r} (data.prompt_key/data.answer_key); has {have}"
                )
            # A null field is empty text (not "None"); rows with an empty answer are counted and
            # skipped by prepare_prompts.
            solution = "" if rec[answer_key] is None else str(rec[answer_key])
            yield index, {
                "prompt": "" if rec[prompt_key] is None else str(rec[prompt_key]),
                "answer": gsm8k_ground_truth(solution),
                "solution": solution,
                "index": index,
            }
            index += 1
