"""Local files: JSONL, JSON, Parquet, and Hugging Face ``datasets`` directories.

Files for a split are found under the ``manual_dir`` (recursively) by name: any
``.jsonl``, ``.json`` or ``.parquet`` file whose name starts with the split name
(``train.jsonl``, ``test.parquet``, the Hugging Face layout
``main/train-00000-of-00001.parquet``). A directory written by ``datasets``'
``DatasetDict.save_to_disk`` (``dataset_dict.json``, one directory of ``.arrow`` files per
split) is read as it is. Every reader streams: a Parquet file by record batches, JSONL by
line, Arrow files memory-mapped, so a split larger than memory is never held whole (a
``.json`` file holding one JSON list is the exception: it is parsed whole).

``data.dataset=gsm8k``: the ``answer`` field follows the GSM8K convention
``"<reasoning> #### 42"``; the reference answer is what follows the last ``####``
(:func:`rljax.reward.gsm8k_ground_truth`). ``data.dataset=local``: :func:`local_rows` maps
any layout (verl's included) to prompt, answer, data source and extra info.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from rljax.errors import ConfigError
from rljax.reward import gsm8k_ground_truth

EXTENSIONS = (".jsonl", ".json", ".parquet")
SPLITS = ("train", "test")
#: Split names of a saved ``DatasetDict`` (or file-name prefixes) read as the test split.
TEST_NAMES = ("test", "validation", "val")


def _hf_split_files(split_dir: Path) -> list[Path]:
    """The ``.arrow`` files of one ``Dataset.save_to_disk`` directory, in ``state.json``'s order."""
    state = json.loads((split_dir / "state.json").read_text())
    return [split_dir / f["filename"] for f in state.get("_data_files", [])]


def hf_dataset_splits(root: Path) -> dict[str, list[Path]] | None:
    """``{split: [.arrow files]}`` of a ``datasets`` directory (``DatasetDict.save_to_disk``:
    ``dataset_dict.json``; a lone ``Dataset.save_to_disk``: ``state.json``, its train split),
    or None when ``root`` is not one. ``validation`` / ``val`` are read as the test split."""
    if (root / "dataset_dict.json").is_file():
        names = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
        out: dict[str, list[Path]] = {}
        for name in names:
            split = "test" if name in TEST_NAMES else name
            if split in SPLITS and split not in out:
                out[split] = _hf_split_files(root / name)
        return out
    if (root / "state.json").is_file():
        return {"train": _hf_split_files(root)}
    return None


def split_files(manual_dir: str | Path, *, test_names: tuple = ("test",)) -> dict[str, list[Path]]:
    """``{split: [files]}`` for the splits present under ``manual_dir`` (sorted paths), or the
    ``.arrow`` files of a ``datasets`` directory (:func:`hf_dataset_splits`). A file whose
    name starts with one of ``test_names`` belongs to the test split."""
    root = Path(manual_dir).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"data.path={str(manual_dir)!r} is not a directory")
    hf = hf_dataset_splits(root)
    if hf is not None:
        if "train" not in hf:
            raise FileNotFoundError(f"data.path={str(manual_dir)!r} is a datasets directory without a train split")
        return hf
    out: dict[str, list[Path]] = {}
    prefixes = [("train", "train")] + [(name, "test") for name in test_names]
    for f in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in EXTENSIONS):
        for prefix, split in prefixes:
            if f.name.startswith(prefix):
                out.setdefault(split, []).append(f)
                break
    if "train" not in out:
        raise FileNotFoundError(
            f"data.path={str(manual_dir)!r} has no train file: expected train*.jsonl, train*.json or train*.parquet"
        )
    return out


def _listed(spec: str) -> list[str]:
    """``a.parquet`` or verl's list form ``[a.parquet, b.parquet]`` -> the paths."""
    text = spec.strip()
    if text.startswith("[") and text.endswith("]"):
        return [p.strip().strip("'\"") for p in text[1:-1].split(",") if p.strip()]
    return [text]


def listed_files(spec: str, key: str) -> list[Path]:
    """The files of ``data.train_files`` / ``data.val_files`` (verl's keys): each entry a
    ``.jsonl`` / ``.json`` / ``.parquet`` file or a ``Dataset.save_to_disk`` directory."""
    out: list[Path] = []
    for entry in _listed(spec):
        path = Path(entry).expanduser()
        if path.is_file() and path.suffix in EXTENSIONS:
            out.append(path)
        elif path.is_dir() and (path / "state.json").is_file():
            out.extend(_hf_split_files(path))
        elif path.is_dir() and (path / "dataset_dict.json").is_file():
            raise FileNotFoundError(f"{key}: {entry!r} is a DatasetDict directory; name one of its split directories "
                                    f"({entry}/train) or pass it as data.path")
        else:
            raise FileNotFoundError(f"{key}: {entry!r} is not a .jsonl, .json or .parquet file nor a "
                                    "datasets.save_to_disk directory")
    return out


def local_splits(data_cfg) -> dict[str, list[Path]]:
    """``{split: [files]}`` of ``data.dataset=local``: ``data.train_files`` / ``data.val_files``
    when set (verl's keys), else the split files under ``data.path`` (:func:`split_files`)."""
    if data_cfg.train_files:
        out = {"train": listed_files(data_cfg.train_files, "data.train_files")}
        if data_cfg.val_files:
            out["test"] = listed_files(data_cfg.val_files, "data.val_files")
        return out
    return split_files(data_cfg.path, test_names=TEST_NAMES)


def check_not_empty(files: dict[str, list[Path]], manual_dir: str | Path) -> None:
    """Raises :class:`~rljax.config.ConfigError` naming a split whose files hold no record (TFDS
    would fail on it with an internal assertion)."""
    for split, paths in files.items():
        if not any(True for p in paths for _ in read_records(p)):
            names = ", ".join(p.name for p in paths)
            raise ConfigError(f"data.path={str(manual_dir)!r}: the {split} split is empty ({names} hold no records)")


def fingerprint(manual_dir: str | Path, *keys, test_names: tuple = ("test",)) -> str:
    """A short hash of the split files (relative path, size, mtime) and ``keys``: a changed file rebuilds."""
    root = Path(manual_dir).expanduser()
    return files_fingerprint(split_files(root, test_names=test_names), *keys, root=root)


def files_fingerprint(files: dict[str, list[Path]], *keys, root: Path | None = None) -> str:
    """A short hash of ``{split: [files]}`` (path, size, mtime) and ``keys``: a changed file rebuilds."""
    h = hashlib.sha1()
    for split, paths in sorted(files.items()):
        for f in paths:
            st = f.stat()
            name = f.relative_to(root) if root is not None else f.resolve()
            h.update(f"{split}|{name}|{st.st_size}|{st.st_mtime_ns}\n".encode())
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
        with pq.ParquetFile(path) as f:
            for batch in f.iter_batches(batch_size=1024):
                yield from batch.to_pylist()
    elif path.suffix == ".arrow":  # datasets' save_to_disk: an Arrow IPC stream, memory-mapped
        import pyarrow as pa

        with pa.memory_map(str(path)) as src:
            for batch in pa.ipc.open_stream(src):
                yield from batch.to_pylist()
    elif path.suffix == ".jsonl":
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                line = _utf8(raw, path, lineno)
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{lineno} is not valid JSON: {e.msg}") from None
    else:
        raw = path.read_bytes()
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            lineno = raw.count(b"\n", 0, e.start) + 1
            _utf8(raw.split(b"\n")[lineno - 1], path, lineno)
            raise  # not reached: the line holds the byte
        if not isinstance(data, list):
            raise ValueError(f"{path} must hold a JSON list of objects")
        yield from data


def _utf8(raw: bytes, path: Path, lineno: int) -> str:
    """Line ``lineno`` of ``path`` as text; a byte that is not UTF-8 (a raw 0xFF) is a ValueError naming
    the file, the line and the byte (``json`` reads UTF-8 only)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{lineno}: byte 0x{raw[e.start]:02X} at column {e.start + 1} is not UTF-8 text "
                         "(JSON files are UTF-8); re-encode the file or drop the row") from None


def gsm8k_keys(data_cfg) -> tuple[str, str]:
    """``(prompt_key, answer_key)`` of ``data.dataset=gsm8k`` (null keys: ``question``, ``answer``)."""
    return data_cfg.prompt_key or "question", data_cfg.answer_key or "answer"


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


# ---------------------------------------------------------------------------- data.dataset=local

#: Where ``data.dataset=local`` looks for the prompt and the answer when ``data.prompt_key`` /
#: ``data.answer_key`` are null: verl's layout first, then common names.
PROMPT_KEYS = ("prompt", "question", "problem", "query", "instruction")
ANSWER_KEYS = ("reward_model.ground_truth", "ground_truth", "answer", "solution", "target")


def field(rec: dict, key: str):
    """``rec[key]``, where a dotted key reaches into nested dicts (``reward_model.ground_truth``);
    raises KeyError when absent."""
    if key in rec:
        return rec[key]
    value = rec
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(key)
        value = value[part]
    return value


def has_field(rec: dict, key: str) -> bool:
    try:
        field(rec, key)
    except KeyError:
        return False
    return True


def is_messages(value) -> bool:
    """A chat message list: ``[{"role": ..., "content": ...}, ...]``."""
    return (isinstance(value, (list, tuple)) and len(value) > 0
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in value))


def resolve_keys(rec: dict, *, prompt_key: str | None, answer_key: str | None,
                 messages_key: str | None) -> tuple[str | None, str | None]:
    """``(prompt_key, answer_key)`` for a layout, the null ones found from ``rec`` (the first
    record); None when nothing matches (the caller names what it looked for)."""
    if messages_key is None and prompt_key is None:
        prompt_key = next((k for k in PROMPT_KEYS if has_field(rec, k)), None)
    if answer_key is None:
        answer_key = next((k for k in ANSWER_KEYS if has_field(rec, k)), None)
    return prompt_key, answer_key


def _answer_text(value) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def local_rows(files: list[Path], *, prompt_key: str | None = None, answer_key: str | None = None,
               messages_key: str | None = None) -> Iterator[dict]:
    """One dict per record of ``files``, in order: ``prompt`` (text, or a chat message list),
    ``answer`` (the reference answer given to the reward), ``data_source`` (verl's dataset
    name, ``""`` when absent), ``extra_info`` (a dict, ``{}`` when absent) and ``index``.

    * ``messages_key``: the field holds a conversation; the prompt is its messages before the
      last assistant message, whose content is the answer unless ``answer_key`` names one.
    * otherwise ``prompt_key`` (null: the first of :data:`PROMPT_KEYS` in the first record)
      holds text or a message list (verl's ``prompt``).
    * ``answer_key`` (null: the first of :data:`ANSWER_KEYS`): a dotted key reaches into nested
      fields (verl's ``reward_model.ground_truth``).

    Raises ValueError naming the file, the record, the keys looked for and the fields it has.
    """
    index, keys = 0, None
    for path in files:
        for i, rec in enumerate(read_records(path)):
            if not isinstance(rec, dict):
                raise ValueError(f"{path} record {i} is a {type(rec).__name__}, not an object with fields")
            if keys is None:
                keys = resolve_keys(rec, prompt_key=prompt_key, answer_key=answer_key, messages_key=messages_key)
            yield {**_row(rec, path, i, keys, messages_key, answer_key), "index": index}
            index += 1


def _row(rec: dict, path: Path, i: int, keys, messages_key, answer_key_cfg) -> dict:
    pkey, akey = keys
    have = ", ".join(sorted(rec))
    answer = None
    if messages_key is not None:
        if messages_key not in rec or not is_messages(rec[messages_key]):
            raise ValueError(f"{path} record {i}: data.messages_key={messages_key!r} is not a list of "
                             f"{{role, content}} messages; fields: {have}")
        conv = list(rec[messages_key])
        last = max((j for j, m in enumerate(conv) if m["role"] == "assistant"), default=None)
        prompt = conv if last is None else conv[:last]
        if last is not None and answer_key_cfg is None:
            answer = conv[last]["content"]
        if not prompt:
            raise ValueError(f"{path} record {i}: data.messages_key={messages_key!r} has no message before the "
                             "last assistant message")
    else:
        if pkey is None or not has_field(rec, pkey):
            looked = repr(pkey) if pkey else "any of " + ", ".join(PROMPT_KEYS)
            raise ValueError(f"{path} record {i} has no prompt field ({looked}); fields: {have}; "
                             "set data.prompt_key (or data.messages_key for a conversation)")
        prompt = field(rec, pkey)
        if prompt is not None and not isinstance(prompt, str) and not is_messages(prompt):
            raise ValueError(f"{path} record {i}: data.prompt_key={pkey!r} holds a {type(prompt).__name__}; "
                             "accepted: text, or a list of {role, content} messages")
        prompt = [dict(m) for m in prompt] if is_messages(prompt) else ("" if prompt is None else prompt)
    if answer is None:
        if akey is None or not has_field(rec, akey):
            looked = repr(akey) if akey else "any of " + ", ".join(ANSWER_KEYS)
            raise ValueError(f"{path} record {i} has no answer field ({looked}); fields: {have}; "
                             "set data.answer_key (a dotted key reaches into nested fields)")
        answer = field(rec, akey)
    extra = rec.get("extra_info")
    return {
        "prompt": prompt,
        "answer": _answer_text(answer),
        "data_source": "" if rec.get("data_source") is None else str(rec["data_source"]),
        "extra_info": dict(extra) if isinstance(extra, dict) else {},
    }
