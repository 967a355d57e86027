"""``python -m rljax.trace summary|check|samples RUN_DIR``

summary: topology, non-default config fields with sources, shape and memory ledgers,
stage-time split and tracing overhead, as tables.
check: one PASS/WARN/FAIL/N/A line per check of the run's files. Exit status: 0 when no check
failed (warnings are printed as WARN and counted), 1 when a check failed (with ``--strict``:
also when one warned), 2 on a usage error (unknown command, missing run directory).
"""

from __future__ import annotations

import argparse
import os
import sys

from rljax.trace.check import STATUSES, exit_code, run_checks
from rljax.trace.samples import main as samples
from rljax.trace.summary import summarize_run


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["samples"]:  # python -m rljax.trace samples RUN_DIR [--step K]

        return samples(argv[1:])
    p = _Parser(prog="python -m rljax.trace", description="Explain a run from its directory.")
    p.add_argument("command", choices=("summary", "check"))
    p.add_argument("run_dir")
    p.add_argument("--strict", action="store_true", help="check: warnings fail too (exit 1)")
    args = p.parse_args(argv)
    if not os.path.isdir(args.run_dir):
        print(f"python -m rljax.trace: error: run directory {args.run_dir} does not exist", file=sys.stderr)
        return 2
    if args.command == "summary":
        print(summarize_run(args.run_dir))
        return 0

    results = run_checks(args.run_dir)
    for status, name, detail in results:
        print(f"{status:<4}  {name}: {detail}")
    counts = {s: sum(1 for r in results if r[0] == s) for s in STATUSES}
    rc = exit_code(results, strict=args.strict)
    verdict = "FAILED" if rc else "OK"
    print(f"result: {verdict}, {counts['PASS']} passed, {counts['WARN']} warned, {counts['FAIL']} failed, "
          f"{counts['N/A']} not applicable (of {len(results)} checks)" + (" [--strict: warnings fail]" if args.strict
                                                                          else ""))
    return rc


def _piped_main() -> int:
    """:func:`main`, quiet when its reader goes away (``... samples RUN | head``): Python's advice
    for a closed pipe, stdout pointed at devnull so the interpreter's final flush cannot raise."""
    try:
        rc = main()
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a C tool killed by it


if __name__ == "__main__":
    sys.exit(_piped_main())
