"""tests/conftest.py's start orders name real test files: a renamed or moved file would
silently fall to the end of its pass and leave one worker running it alone. And the layout
the test files' imports rely on: unique basenames (pytest's default ``prepend`` import mode
imports a test file by its basename) and every directory holding tests on ``pythonpath``
(pyproject.toml), so a test imports helpers and other test files' constants by bare name."""

import collections
import tomllib

import conftest
from repo_paths import REPO, TESTS


def _test_files() -> list[str]:
    """Every test file, as its path below ``tests/`` (``launch/test_launch.py``)."""
    return sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py"))


def test_start_orders_name_existing_test_files():
    files = set(_test_files())
    for order in (conftest.HEAVY_FIRST, conftest.SLOW_HEAVY_FIRST):
        assert len(set(order)) == len(order), order
        assert set(order) <= files, sorted(set(order) - files)


def test_test_files_have_unique_basenames():
    by_name = collections.defaultdict(list)
    for f in _test_files():
        by_name[f.rsplit("/", 1)[-1]].append(f)
    assert not {n: fs for n, fs in by_name.items() if len(fs) > 1}, "rename one of them"


def test_every_test_directory_is_on_pythonpath():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["pythonpath"])
    dirs = {("tests/" + f).rsplit("/", 1)[0] for f in _test_files()} | {"tests"}
    assert dirs <= listed, f"add to [tool.pytest.ini_options] pythonpath in pyproject.toml: {sorted(dirs - listed)}"
