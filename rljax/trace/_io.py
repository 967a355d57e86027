"""Writing a run's record files so a failure (a full disk, a read-only directory, a kill)
never leaves a cut line or an empty file behind.

* :func:`append_lines`: JSONL records are appended with one ``O_APPEND`` write per batch of
  lines; when the write fails or is short, the file is cut back to where it was, so every
  line in the file is whole.
* :func:`write_atomic`: whole files (``trace_summary.json``) are written to a temporary file
  and renamed over the old one: a failed write keeps the previous version, never 0 bytes.
"""

from __future__ import annotations

import json
import os

#: ``json.dumps(x, separators=(",", ":"))`` with one encoder (``json.dumps`` builds an encoder per call
#: when given separators): the trace's compact JSON (records, rollout lines, the running summary).
compact_json = json.JSONEncoder(separators=(",", ":")).encode


def append_lines(path: str, text: str) -> None:
    """Appends ``text`` (whole lines, each ending in a newline) to ``path``, or nothing.

    Raises:
      OSError: the write failed (the file is as it was before the call).
    """
    data = text.encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view):]
        except OSError as e:
            try:
                os.ftruncate(fd, start)  # no cut line: the records of this call are all absent
            except OSError:
                pass
            raise OSError(e.errno, e.strerror, path) from None  # names the file
    finally:
        os.close(fd)


def write_atomic(path: str, text: str) -> None:
    """Replaces ``path`` with ``text`` in one rename; on failure ``path`` is unchanged."""
    tmp = f"{path}.tmp"
    data = text.encode("utf-8")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # no text layer: one encode, raw writes
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
