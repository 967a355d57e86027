"""Where the repository is, for tests that read or run its files (presets, docs, ``rljax/``
sources, ``python -m`` from the root). One definition here, at the root of ``tests/``, so a test
file's own location never matters: test files live in ``tests/<package>/`` and may move."""

from pathlib import Path

#: The repository root (the directory holding ``pyproject.toml``).
REPO = Path(__file__).resolve().parent.parent
#: ``tests/``: the root ``conftest.py`` and the helper modules live here; test files in subdirectories.
TESTS = REPO / "tests"
