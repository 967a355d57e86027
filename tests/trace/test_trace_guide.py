"""docs/guides/trace.md names every line ``python -m rljax.trace check`` prints, in the order it
prints them, and no line that no longer exists: its checks table against the checks the code
registers (``rljax.trace.check.CHECKS``), and its re-derivations table against
``rljax.trace.checks.recompute.NAMES``. No training: the names come from running each check."""

import re

from repo_paths import REPO

GUIDE = REPO / "docs" / "guides" / "trace.md"


def table_first_column(text: str, header: str) -> list[str]:
    """The first cells of the rows of the markdown table whose header row starts with ``header``."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(header)]
    assert len(starts) == 1, f"{GUIDE}: {len(starts)} table(s) with the header {header!r}, expected 1"
    rows = []
    for line in lines[starts[0] + 2:]:  # after the header and its |---| line
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1].strip())
    return rows


def printed_names(tmp_path) -> list[str]:
    """The name each registered check prints, in print order. Every check returns its one name
    whatever its verdict, so a run directory with no files gives each one's line (FAIL or N/A)
    without a run; a check is called directly, so one that raised here fails this test instead of
    turning into run_checks' stand-in name."""
    from rljax.trace.check import CHECKS
    from rljax.trace.checks.base import STATUSES, Run

    run = Run(str(tmp_path))
    names = []
    for check in CHECKS:
        status, name, _ = check(run)
        assert status in STATUSES, (check.__name__, status)
        names.append(name)
    return names


def test_the_guide_lists_every_check_line_in_print_order(tmp_path):
    names = printed_names(tmp_path)
    assert len(names) == len(set(names)), f"two checks print the same name: {names}"
    cells = table_first_column(GUIDE.read_text(), "| `check` line | compares or re-derives")
    bad = [c for c in cells if not re.fullmatch(r"`[^`]+`", c)]
    assert not bad, f"{GUIDE}: the checks table's first column must be a check line in backticks: {bad}"
    listed = [c.strip("`") for c in cells]
    missing = [n for n in names if n not in listed]
    unknown = [n for n in listed if n not in names]
    assert not missing, f"{GUIDE}: check line(s) the code prints but the checks table does not list: {missing}"
    assert not unknown, f"{GUIDE}: the checks table lists line(s) no check prints: {unknown}"
    assert listed == names, f"{GUIDE}: the checks table is not in the order `check` prints: {listed} != {names}"


def test_the_rederivations_table_lists_every_rederivation():
    from rljax.trace.checks.recompute import NAMES

    titles = [title for title, _ in NAMES.values()]
    listed = table_first_column(GUIDE.read_text(), "| `check` line | re-derives |")
    assert sorted(listed) == sorted(titles), f"{GUIDE}: re-derivations table {listed} != the re-derivations {titles}"
