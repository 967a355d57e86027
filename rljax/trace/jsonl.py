"""Reading the run's JSON-lines files (``trace.jsonl``, ``metrics.jsonl``, ``rollout_uids.jsonl``)
when the run may have been killed while writing one: a cut last line is reported, not raised."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional


@dataclasses.dataclass
class JsonLines:
    """The parsed records of one file and what was wrong with it.

    ``truncated``: the last line is not a complete JSON record (a run stopped mid-write);
    the records before it are kept. ``corrupt``: a line *before* the last one does not parse
    (``(line number, message)``): the file was damaged, not cut.
    """

    path: str
    records: list
    truncated: Optional[str] = None
    corrupt: Optional[tuple[int, str]] = None

    @property
    def problem(self) -> Optional[str]:
        name = os.path.basename(self.path)
        if self.corrupt is not None:
            return f"{name} line {self.corrupt[0]} is not JSON: {self.corrupt[1]}"
        if self.truncated is not None:
            return f"{name} {self.truncated}"
        return None


def read_jsonl(path: str) -> JsonLines:
    """Every complete record of ``path`` (none when it does not exist)."""
    out = JsonLines(path, [])
    if not os.path.exists(path):
        return out
    with open(path, "rb") as fh:
        data = fh.read()
    lines = data.split(b"\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            out.records.append(json.loads(raw))
        except (ValueError, UnicodeDecodeError) as e:
            if i == last:
                out.truncated = f"line {i + 1} is truncated (the last line, cut after {len(raw)} bytes)"
            elif out.corrupt is None:
                out.corrupt = (i + 1, str(e))
    return out
