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


def _entries(path, prefix=""):
    return sorted(p for p in path.iterdir() if p.name.endswith("-cache") and p.name.startswith(prefix))


def _refusals(err: str) -> list:
    return [ln for ln in err.splitlines() if "refused" in ln or "Error reading persistent" in ln]


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_damaged_entries_are_refused_deleted_and_stored_again(own_cache, tmp_path, damage, capfd):
    """A changed byte (or a cut) in every entry: one line names the cache, every program is
    compiled and written again, and the next load takes them all without a word. (JAX alone
    warned once per entry, compiled, and never rewrote the entry: every launch again.)"""
    path = tmp_path / "c"
    cc.setup(str(path), echo=None, report_at_exit=False)
    x = jnp.ones(64)
    want = [float(f(x)) for f in _programs()[:4]]
    entries = _entries(path, "jit__lambda")
    assert len(entries) == 4
    for p in entries:
        data = p.read_bytes()
        if damage == "flip":
            mid = len(data) // 3
            data = data[:mid] + bytes([data[mid] ^ 0x01]) + data[mid + 1:]
        p.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"" if damage == "empty" else data)
    capfd.readouterr()
    jax.clear_caches()
    with warnings.catch_warnings(record=True) as caught, cc.counting() as c:
        warnings.simplefilter("always")
        assert [float(f(x)) for f in _programs()[:4]] == want
    lines = _refusals(capfd.readouterr().err) + [str(w.message) for w in caught if "cache" in str(w.message)]
    assert len(lines) == 1 and f"compilation cache {path}: refused" in lines[0], lines
    assert c.loaded == 0 and c.refused == len(entries) and c.written == c.built == len(entries)
    jax.clear_caches()
    with cc.counting() as again:  # healed: every entry loads
        assert [float(f(x)) for f in _programs()[:4]] == want
    assert again.loaded == again.built == len(entries) and again.refused == 0 and not _refusals(capfd.readouterr().err)


def test_a_swapped_pair_of_valid_entries_is_refused(own_cache, tmp_path, capfd):
    """Two entries of one module name and one signature swap files: each is a valid program,
    the other one. Each is refused as stored under another key, both are compiled and stored
    again, with one line; the next load takes both. (Unverified, each ran the other's program.)"""
    path = tmp_path / "c"
    cc.setup(str(path), echo=None, report_at_exit=False)
    x = jnp.arange(8.0)
    sin, cos = (lambda: jax.jit(lambda v: jnp.sin(v).sum())), (lambda: jax.jit(lambda v: jnp.cos(v).sum()))
    want = (float(sin()(x)), float(cos()(x)))
    a, b = _entries(path, "jit__lambda")
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db), b.write_bytes(da)
    capfd.readouterr()
    jax.clear_caches()
    with cc.counting() as c:
        assert (float(sin()(x)), float(cos()(x))) == want
    lines = _refusals(capfd.readouterr().err)
    assert len(lines) == 1 and "written under another key" in lines[0], lines
    assert (c.loaded, c.refused, c.written) == (0, 2, 2)
    jax.clear_caches()
    with cc.counting() as again:
        assert (float(sin()(x)), float(cos()(x))) == want
    assert (again.loaded, again.refused) == (2, 0) and not _refusals(capfd.readouterr().err)


def test_a_run_failing_after_loading_programs_retries_with_the_cache_bypassed(own_cache, tmp_path, capfd):
    """A wrong program the seal cannot catch (two entries swapped and sealed again under their new
    keys, as a cache-key clash would store them): the run fails after loading it, says so, runs
    once more compiling everything, and the entries written over the wrong ones load next time."""
    path = tmp_path / "c"
    cc.setup(str(path), echo=None, report_at_exit=False)
    x = jnp.arange(4.0)
    total, twice = (lambda: jax.jit(lambda v: jnp.sin(v).sum())), (lambda: jax.jit(lambda v: jnp.cos(v) * 2))

    def run():  # a launch checking what it computed
        t, w = np.asarray(total()(x)), np.asarray(twice()(x))
        if t.shape != () or w.shape != (4,) or not np.allclose(w, np.cos(np.arange(4.0)) * 2):
            raise ValueError(f"output shapes {t.shape}, {w.shape}: not the programs traced")
        return 0

    assert run() == 0
    a, b = _entries(path, "jit__lambda")
    ka, kb = a.name[: -len("-cache")], b.name[: -len("-cache")]
    va, vb = cc.unseal(ka, a.read_bytes())[0], cc.unseal(kb, b.read_bytes())[0]
    a.write_bytes(cc.seal(ka, vb)), b.write_bytes(cc.seal(kb, va))
    jax.clear_caches()
    capfd.readouterr()
    try:
        with cc.counting() as c:
            assert cc.retry_bypassed(run) == 0
        err = capfd.readouterr().err
        assert "the launch failed after loading 2 program(s) from the compilation cache" in err
        assert "ValueError: output shapes (4,), ()" in err and "retrying once with the cache bypassed" in err
        assert c.written == 2
        with pytest.raises(ValueError):  # a failure the bypass does not cure is raised on the second run
            cc.retry_bypassed(lambda: (_ for _ in ()).throw(ValueError("not the cache")))
    finally:
        cc.bypass(False)
    with cc.counting() as again:  # the fresh programs were written over the wrong ones
        assert run() == 0
    assert again.loaded == 2


def test_verify_checks_and_cleans_a_directory(own_cache, tmp_path, capsys):
    """``python -m rljax.compilation_cache --verify DIR``: every entry checked, whatever its age;
    the damaged, moved and unsealed ones and a killed write's leftovers removed; exit 1 then 0."""
    path = tmp_path / "c"
    cc.setup(str(path), echo=None, report_at_exit=False)
    x = jnp.ones(64)
    [f(x) for f in _programs()[:4]]
    e = _entries(path, "jit__lambda")
    assert len(e) == 4
    e[0].write_bytes(e[0].read_bytes()[:-1] + b"\0")  # a changed byte (the seal's digest)
    d1, d2 = e[1].read_bytes(), e[2].read_bytes()
    e[1].write_bytes(d2), e[2].write_bytes(d1)
    (path / "jit_old-0123-cache").write_bytes(zlib.compress(b"written by an older rljax"))
    (path / ".rljax-writing-x").mkdir()
    old = os.path.getmtime(path) - 2 * cc.SETTLE_S
    os.utime(path / ".rljax-writing-x", (old, old))
    assert cc.main(["--verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"{path}: removed {e[0].name}: {cc.DAMAGED}" in out and f"removed {e[1].name}: {cc.MOVED}" in out
    assert "removed 1 damaged entry; removed 2 moved entries (stored under another key); removed 1 entry " \
           "without a digest" in out
    assert sorted(p.name for p in path.iterdir() if not p.name.startswith(".rljax-checked")) == \
        sorted(p.name for p in _entries(path)) and e[3].exists()
    assert cc.main(["--verify", str(path)]) == 0 and "every entry intact" in capsys.readouterr().out
    with pytest.raises(SystemExit) as usage:
        cc.main(["--verify", str(tmp_path / "nothing")])
    assert usage.value.code == 2


def test_an_older_reader_loads_a_sealed_entry(own_cache, tmp_path):
    """The seal is a zstd skippable frame after JAX's bytes: JAX's own reader (and an older rljax)
    decompresses a sealed entry to the same executable."""
    jax_cc = pytest.importorskip("jax._src.compilation_cache")
    path = tmp_path / "c"
    cc.setup(str(path), echo=None, report_at_exit=False)
    _fn(0.125)(jnp.ones((4, 4)))
    entry = _entries(path)[0]
    sealed = entry.read_bytes()
    value, why = cc.unseal(entry.name[: -len("-cache")], sealed)
    assert why is None and len(sealed) > len(value)
    assert jax_cc.decompress_executable(sealed) == jax_cc.decompress_executable(value)


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
    with cc.counting() as c:
        cache.put("module-k1", value)
        cache.put("module-k1", zlib.compress(b"another"))  # a key written before stays as it is
    assert c.written == 1  # what reached the directory (JAX's event counted both writes it asked for)
    assert seen and seen[0] == []  # the entry was not in the directory while its bytes were written
    entries = sorted(n for n in os.listdir(path) if n.endswith("-cache"))
    assert len(entries) == 1 and cc.unseal("module-k1", (path / entries[0]).read_bytes()) == (value, None)
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
    compiling them and logs the same metrics. In between, two same-named entries swap files and
    a byte changes in a third (after the start-up check, as the issue's campaign did): the
    second launch refuses the three with one line, compiles and stores them again, counts them
    at exit, and leaves every entry verified."""
    from test_launch import SMALL

    cache = str(tmp_path / "cache")
    args = ("--mesh=dp2", *SMALL, "trainer.total_steps=2", f"trainer.compilation_cache_dir={cache}")
    first = launch("--run-dir", str(tmp_path / "a"), *args)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert f"compilation cache {cache}: 0 program(s) stored" in first.stdout
    entries = sorted(p for p in os.listdir(cache) if p.endswith("-cache"))
    assert len(entries) > 10
    by_module = {}
    for name in entries:
        by_module.setdefault(name.rsplit("-", 2)[0], []).append(os.path.join(cache, name))
    pair = next(v for v in by_module.values() if len(v) >= 2)[:2]
    flipped = next(os.path.join(cache, n) for n in entries if os.path.join(cache, n) not in pair)
    one, two = (open(p, "rb").read() for p in pair)
    for p, data in zip(pair, (two, one)):
        open(p, "wb").write(data)
    data = open(flipped, "rb").read()
    open(flipped, "wb").write(data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 1]) + data[len(data) // 2 + 1:])
    checked = os.path.getmtime(os.path.join(cache, ".rljax-checked"))
    for p in (*pair, flipped):  # older than the start-up check: only the read sees them
        os.utime(p, (checked - 5, checked - 5))
    second = launch("--run-dir", str(tmp_path / "b"), *args)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    warned = [ln for ln in (second.stdout + second.stderr).splitlines()
              if "refused" in ln and "this process loaded" not in ln or "Error reading persistent" in ln]
    assert len(warned) == 1 and f"compilation cache {cache}: refused" in warned[0], warned
    report = [ln for ln in second.stdout.splitlines() if "this process loaded" in ln][0]
    assert f"loaded {len(entries) - 3} program(s) from it and compiled 3 (3 written to it; refused 3 damaged or " \
           "moved entries, deleted and compiled again)" in report, report
    strip = lambda rows: [{k: v for k, v in r.items() if not is_wall_clock(k)} for r in rows]
    a, b = strip(train_rows(tmp_path / "a")), strip(train_rows(tmp_path / "b"))
    assert a == b and len(a) == 2
    verify = subprocess.run([sys.executable, "-m", "rljax.compilation_cache", "--verify", cache], cwd=REPO,
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO})
    assert verify.returncode == 0 and f"{len(entries)} entries verified" in verify.stdout, verify.stdout + verify.stderr
    # A wrong program the seal cannot catch (a pair swapped and sealed again under the new keys, as
    # a key clash would store it): the launch fails on it (JAX's layout check, as in the issue),
    # says so, runs again with the cache bypassed, and writes the fresh programs over the wrong ones.
    # (a stage program's and the update's: their arguments differ, so running one for the other fails
    # whatever XLA flags compiled them; two stage programs may take the same arguments and run)
    stage = [sorted(n for n in os.listdir(cache) if n.startswith(f"jit_{name}-"))[0] for name in ("stage", "train_step")]
    keys = [n[: -len("-cache")] for n in stage]
    values = [cc.unseal(k, open(os.path.join(cache, n), "rb").read())[0] for k, n in zip(keys, stage)]
    for n, k, v in zip(stage, keys, values[::-1]):
        open(os.path.join(cache, n), "wb").write(cc.seal(k, v))
    third = launch("--run-dir", str(tmp_path / "c"), *args)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    retry = [ln for ln in third.stderr.splitlines() if "retrying once with the cache bypassed" in ln]
    assert len(retry) == 1 and "the launch failed after loading" in retry[0] and "Traceback" not in third.stderr
    assert strip(train_rows(tmp_path / "c")) == a
    for n, k, forged in zip(stage, keys, values[::-1]):  # written over
        assert cc.unseal(k, open(os.path.join(cache, n), "rb").read())[0] != forged, n


def test_the_directory_stays_under_its_bound_oldest_first(tmp_path):
    import time
    import zlib

    for i in range(8):  # 8 intact entries of ~1 KiB, entry 0 the oldest
        p = tmp_path / f"jit_f-{i:02d}-cache"
        p.write_bytes(cc.seal(f"jit_f-{i:02d}", zlib.compress(os.urandom(1024), 0)))
        os.utime(p, (time.time() - 1000 + i, time.time() - 1000 + i))
    size = sum(p.stat().st_size for p in tmp_path.glob("*-cache"))
    found = cc.check_entries(str(tmp_path), max_bytes=size // 2)
    assert found.evicted == tuple(f"jit_f-{i:02d}-cache" for i in range(len(found.evicted)))
    assert found.size_bytes <= size // 2 * 3 // 4 and found.stored == 8 - len(found.evicted) > 0
    assert sorted(p.name for p in tmp_path.glob("*-cache"))[0] == f"jit_f-{len(found.evicted):02d}-cache"
