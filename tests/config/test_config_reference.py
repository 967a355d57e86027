"""The configuration reference (docs/reference/config.md) is generated from the schema and
must match it: a key added, removed or re-documented without regenerating the page fails here."""

import difflib
import subprocess
import sys

from rljax.config import field_specs
from rljax.config import reference

from repo_paths import REPO as ROOT


def test_committed_reference_matches_the_schema():
    page = ROOT / reference.PAGE
    want = reference.render()
    have = page.read_text() if page.exists() else ""
    if have != want:
        diff = "".join(list(difflib.unified_diff(have.splitlines(True), want.splitlines(True), str(page),
                                                 "generated", n=0))[:40])
        raise AssertionError(f"{reference.PAGE} is out of date with rljax/config/_schema.py; regenerate it "
                             f"with:\n    {reference.COMMAND}\n{diff}")


def test_every_schema_key_has_a_row():
    text = reference.render()
    missing = [k for k in field_specs() if f"| `{k}` |" not in text]
    assert not missing, f"keys without a row in the reference: {missing}"


def test_verl_names_name_real_keys():
    stale = sorted(set(reference.VERL_NAMES) - set(field_specs()))
    assert not stale, f"rljax.config.reference.VERL_NAMES names keys the schema does not have: {stale}"


def test_generator_command_is_pure_python_and_rejects_arguments():
    code = ("import sys, runpy; sys.argv = ['x']; "
            "import rljax.config.reference as r; r.render(); assert 'jax' not in sys.modules, 'imports jax'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    bad = subprocess.run([sys.executable, "-m", "rljax.config.reference", "extra"], capture_output=True,
                         text=True, cwd=ROOT)
    assert bad.returncode == 2 and "usage: python -m rljax.config.reference" in bad.stderr and not bad.stdout
