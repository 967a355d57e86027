"""Compare two runs' ``metrics.jsonl`` number by number, leaving out timings, throughput and memory.

    python bench/compare_metrics.py BEFORE/metrics.jsonl AFTER/metrics.jsonl [--ignore PREFIX ...]

A behaviour-preserving change (a refactor) must give the same numbers to the last bit at a
fixed seed: every key of every row of either file is compared as written (its JSON text),
except wall-clock-dependent ones (:func:`rljax.trace.metrics.is_wall_clock`: ``timing_s/*``,
``comm_s/*``, ``*_s``, ``*per_s``, ``memory/*``, per-process step times, ...) and any ``--ignore`` prefix. Prints each difference
(step, key, before, after) and a one-line verdict; exits 1 when anything differs.
"""

from __future__ import annotations

import argparse
import json
import sys

from rljax.trace.metrics import is_wall_clock


def is_timing(key: str, extra: tuple = ()) -> bool:
    """Keys whose values depend on the wall clock or the machine's memory, not on the computation
    (:func:`rljax.trace.metrics.is_wall_clock`), and the ``--ignore`` prefixes."""
    return is_wall_clock(key) or key.startswith(tuple(extra))


def read_rows(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _same(a, b) -> bool:
    """Equal as written: the same JSON text (so 1 vs 1.0 differs, NaN equals NaN)."""
    return json.dumps(a) == json.dumps(b)


def compare(before: list[dict], after: list[dict], ignore: tuple = ()) -> tuple[list[str], int]:
    """``(differences as lines, number of values compared)``."""
    diffs, compared = [], 0
    if len(before) != len(after):
        diffs.append(f"rows: {len(before)} before, {len(after)} after")
    for i, (a, b) in enumerate(zip(before, after)):
        step = a.get("step", i)
        for key in sorted(set(a) | set(b)):
            if is_timing(key, ignore):
                continue
            if key not in a or key not in b:
                diffs.append(f"step {step}: {key} only {'after' if key in b else 'before'}")
                continue
            compared += 1
            if not _same(a[key], b[key]):
                diffs.append(f"step {step}: {key} before {a[key]!r} after {b[key]!r}")
    return diffs, compared


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--ignore", action="append", default=[], help="another key prefix to leave out")
    args = p.parse_args(argv)
    before, after = read_rows(args.before), read_rows(args.after)
    diffs, compared = compare(before, after, tuple(args.ignore))
    for line in diffs:
        print(line)
    verdict = "IDENTICAL" if not diffs else f"{len(diffs)} DIFFERENCES"
    print(f"{verdict}: {compared} values in {min(len(before), len(after))} rows compared "
          f"({args.before} vs {args.after}; timings, throughput and memory left out)")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
