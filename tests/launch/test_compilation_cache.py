"""The persistent compilation cache (rljax.compilation_cache): where it is, that a second
process loads what the first compiled, that processes sharing it write whole entries, and
that a damaged entry costs a compile, never the run."""

import json
import os
import subprocess
import sys
import textwrap
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from launching import REPO, launch, train_rows
from rljax import compilation_cache as cc
from rljax.trace.metrics import is_wall_clock


@pytest.fixture
def own_cache():
    """Points this process's JAX at a test's own cache directory, and back at the session's after."""
    yield
    cc.setup("auto", echo=None, report_at_exit=False)


def _fn(scale):
    # A program per scale (a constant in the HLO), so each test compiles its own.
    return jax.jit(lambda x: jnp.tanh(x @ x.T * scale).sum())


def test_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cc.resolve_dir("auto") == str(tmp_path / "xdg" / "rljax" / "jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cc.resolve_dir("auto") == str(tmp_path / "home" / ".cache" / "rljax" / "jax")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jaxenv"))
    assert cc.resolve_dir("auto") == str(tmp_path / "jaxenv")  # JAX's own variable wins
    monkeypatch.setenv("SOMEWHERE", str(tmp_path / "x"))
    assert cc.resolve_dir("$SOMEWHERE/c") == str(tmp_path / "x" / "c")
    assert cc.resolve_dir(None) is None


def test_setup_says_where_and_counts_loads(own_cache, tmp_path):
    lines = []
    found = cc.setup(str(tmp_path / "c"), echo=lines.append, report_at_exit=False)
    assert found.stored == 0 and f"compilation cache {tmp_path / 'c'}: 0 program(s) stored" in lines[0]
    x = jnp.ones((8, 8))
    with cc.counting() as first:
        want = float(_fn(0.5)(x))
    assert first.built >= 1 and first.loaded == 0 and first.written == first.built
    jax.clear_caches()  # as a new process would: nothing compiled in memory
    with cc.counting() as second:
        assert float(_fn(0.5)(x)) == want
    assert second.loaded == second.built == first.built and second.written == 0
    again = cc.setup(str(tmp_path / "c"), echo=lines.append, report_at_exit=False)
    assert again.stored == len(list((tmp_path / "c").glob("*-cache"))) >= first.written and not again.removed
    assert f"{again.stored} program(s) stored" in lines[-1]


def test_null_turns_it_off(own_cache, tmp_path):
    lines = []
    assert cc.setup(None, echo=lines.append) is None
    assert lines == ["rljax: compilation cache off (trainer.compilation_cache_dir=null)"]
    with cc.counting() as c:
        _fn(0.25)(jnp.ones((4, 4)))
    assert c.built >= 1 and c.loaded == 0 and c.written == 0


def test_an_unusable_directory_turns_it_off_with_one_line(own_cache, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    lines = []
    assert cc.setup(str(tmp_path / "file"), echo=lines.append) is None
    assert len(lines) == 1 and "compilation cache off" in lines[0] and "a writable directory, auto, or null" in lines[0]


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_a_damaged_entry_is_compiled_again_then_removed(own_cache, tmp_path, damage, monkeypatch):
    monkeypatch.setattr(cc, "SETTLE_S", 0.0)  # check entries however young (a run would wait a minute)
    path = tmp_path / "c"
    cc.setup(str(path), echo=None, report_at_exit=False)
    x = jnp.arange(16.0).reshape(4, 4)
    want = float(_fn(0.75)(x))
    entries = sorted(p for p in path.iterdir() if p.name.endswith("-cache"))
    assert entries
    for p in entries:  # damage every entry of the program
        data = p.read_bytes()
        if damage == "truncate":
            data = data[: len(data) // 2]
        elif damage == "flip":
            mid = len(data) // 2
            data = data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:]
        else:
            data = b""
        p.write_bytes(data)
    jax.clear_caches()
    with warnings.catch_warnings(record=True) as caught, cc.counting() as c:
        warnings.simplefilter("always")
        got = float(_fn(0.75)(x))
    assert got == want  # the run goes on: JAX compiled the program instead
    assert c.loaded == 0 and c.built >= 1
    assert any("Error reading persistent compilation cache entry" in str(w.message) for w in caught)
    lines = []
    found = cc.setup(str(path), echo=lines.append, report_at_exit=False)
    assert sorted(found.removed) == [p.name for p in entries] and "damaged" in lines[0]
    jax.clear_caches()
    with cc.counting() as c:  # compiled and written again, then loaded
        _fn(0.75)(x)
    jax.clear_caches()
    with cc.counting() as c2:
        _fn(0.75)(x)
    assert c.written >= 1 and c2.loaded == c2.built >= 1


_WORKER = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    from rljax import compilation_cache as cc
    cc.setup(sys.argv[1], echo=None, report_at_exit=False)
    x = jnp.ones(64)
    print(json.dumps([float(f(x)) for f in [jax.jit(lambda x, i=i: jnp.sin(x * (i + 1)).sum()) for i in range(12)]]))
""")


def _programs():
    return [jax.jit(lambda x, i=i: jnp.sin(x * (i + 1)).sum()) for i in range(12)]


def test_processes_sharing_the_cache_write_whole_entries(own_cache, tmp_path):
    """Two processes compile the same 12 programs at once into one directory; then every
    entry is intact and this process loads all 12."""
    path = str(tmp_path / "shared")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}  # same XLA_FLAGS
    cmd = [sys.executable, "-c", _WORKER, path]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        assert "Error reading persistent compilation cache" not in err and "Error writing" not in err, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    found = cc.check_entries(path)
    assert not found.removed and found.stored >= 12
    cc.setup(path, echo=None, report_at_exit=False)
    x = jnp.ones(64)
    jax.clear_caches()
    with cc.counting() as c:
        values = [float(f(x)) for f in _programs()]
    assert c.loaded == c.built == 12
    assert outs[0] == outs[1] == values


def test_an_entry_appears_whole_or_not_at_all(own_cache, tmp_path, monkeypatch):
    """The file cache JAX builds after :func:`cc.setup` writes an entry elsewhere and renames it
    over its key: at the moment JAX's own write runs, the key is absent from the directory."""
    jax_cc = pytest.importorskip("jax._src.compilation_cache")
    lru = pytest.importorskip("jax._src.lru_cache")
    if not callable(getattr(jax_cc, "get_file_cache", None)):
        pytest.skip("this JAX release builds its file cache without get_file_cache: JAX's own writes")
    path = tmp_path / "c"
    cc.setup(str(path), echo=None, report_at_exit=False)
    cache, _ = jax_cc.get_file_cache(str(path))  # the cache JAX builds at its first compile
    jax_put, seen = lru.LRUCache.put, []

    def spy(self, key, value):  # JAX's own write of the bytes
        jax_put(self, key, value)
        seen.append(sorted(n for n in os.listdir(path) if n.endswith("-cache")))
    monkeypatch.setattr(lru.LRUCache, "put", spy)
    value = zlib.compress(b"an executable" * 1000)
    cache.put("module-k1", value)
    cache.put("module-k1", zlib.compress(b"another"))  # a key written before stays as it is
    assert seen and seen[0] == []  # the entry was not in the directory while its bytes were written
    entries = sorted(n for n in os.listdir(path) if n.endswith("-cache"))
    assert len(entries) == 1 and (path / entries[0]).read_bytes() == value
    assert not [n for n in os.listdir(path) if n.startswith(".rljax-writing-")]  # nothing left behind


def test_a_write_killed_before_its_rename_leaves_nothing_read(tmp_path, monkeypatch):
    """A staging directory is never counted as an entry; a settled one is removed, a young one
    (another process may be writing in it) is left."""
    import time

    path = tmp_path / "c"
    old, young = path / ".rljax-writing-old", path / ".rljax-writing-young"
    for d in (old, young):
        d.mkdir(parents=True)
        (d / "jit_f-123-cache").write_bytes(b"cut sh")
    t = time.time() - 2 * cc.SETTLE_S
    os.utime(old, (t, t))
    found = cc.check_entries(str(path))
    assert found.stored == 0 and not found.removed
    assert not old.exists() and young.exists()


@pytest.mark.slow
def test_a_second_launch_loads_its_programs_and_matches(tmp_path):
    """Two launches of one small run into one cache: the second loads programs instead of
    compiling them and logs the same metrics; a damaged entry in between is removed, compiled
    again, and changes nothing."""
    from test_launch import SMALL

    cache = str(tmp_path / "cache")
    args = ("--mesh=dp2", *SMALL, "trainer.total_steps=2", f"trainer.compilation_cache_dir={cache}")
    first = launch("--run-dir", str(tmp_path / "a"), *args)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert f"compilation cache {cache}: 0 program(s) stored" in first.stdout
    entries = sorted(p for p in os.listdir(cache) if p.endswith("-cache"))
    assert len(entries) > 10
    victim = os.path.join(cache, entries[len(entries) // 2])
    with open(victim, "r+b") as fh:
        fh.truncate(os.path.getsize(victim) // 2)
    # as if damaged (changed on disk, or cut where a rename is not atomic) after its start-up check
    checked = os.path.getmtime(os.path.join(cache, ".rljax-checked"))
    os.utime(victim, (checked + 0.5, checked + 0.5))
    second = launch("--run-dir", str(tmp_path / "b"), *args)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "removed 1 damaged entry" in second.stdout
    report = [ln for ln in second.stdout.splitlines() if "this process loaded" in ln]
    loaded = int(report[0].split("loaded ")[1].split(" ")[0])
    assert loaded >= len(entries) - 1, report
    strip = lambda rows: [{k: v for k, v in r.items() if not is_wall_clock(k)} for r in rows]
    a, b = strip(train_rows(tmp_path / "a")), strip(train_rows(tmp_path / "b"))
    assert a == b and len(a) == 2
    np.testing.assert_equal(len(os.listdir(cache)) > 0, True)


def test_the_directory_stays_under_its_bound_oldest_first(tmp_path):
    import time
    import zlib

    for i in range(8):  # 8 intact entries of ~1 KiB, entry 0 the oldest
        p = tmp_path / f"jit_f-{i:02d}-cache"
        p.write_bytes(zlib.compress(os.urandom(1024), 0))
        os.utime(p, (time.time() - 1000 + i, time.time() - 1000 + i))
    size = sum(p.stat().st_size for p in tmp_path.glob("*-cache"))
    found = cc.check_entries(str(tmp_path), max_bytes=size // 2)
    assert found.evicted == tuple(f"jit_f-{i:02d}-cache" for i in range(len(found.evicted)))
    assert found.size_bytes <= size // 2 * 3 // 4 and found.stored == 8 - len(found.evicted) > 0
    assert sorted(p.name for p in tmp_path.glob("*-cache"))[0] == f"jit_f-{len(found.evicted):02d}-cache"
