"""tests/conftest.py's start orders name real test files: a renamed or moved file would
silently fall to the end of its pass and leave one worker running it alone."""

import os

import conftest

HERE = os.path.dirname(os.path.abspath(__file__))


def _test_files():
    names = set()
    for root, _, files in os.walk(HERE):
        names.update(f for f in files if f.startswith("test_") and f.endswith(".py"))
    return names


def test_start_orders_name_existing_test_files():
    files = _test_files()
    for order in (conftest.HEAVY_FIRST, conftest.SLOW_HEAVY_FIRST):
        assert len(set(order)) == len(order), order
        assert set(order) <= files, sorted(set(order) - files)
