"""Compiled programs that survive the process: JAX's persistent compilation cache for rljax runs.

``trainer.compilation_cache_dir`` names the directory: ``auto`` (the default) is
``$JAX_COMPILATION_CACHE_DIR`` when that is set, else ``$XDG_CACHE_HOME/rljax/jax``, else
``~/.cache/rljax/jax``; ``null`` turns the cache off. A second launch of the same
configuration (another seed, a resume, the same run again) loads the programs the first one
compiled instead of compiling them: :func:`setup` points JAX at the directory before
anything compiles and prints where it is; at exit the process reports how many programs it
loaded from the cache and how many it compiled.

What JAX 0.10 does with the directory, and what :func:`setup` adds:

* JAX writes an entry ``<module>-<key>-cache`` with a plain ``Path.write_bytes`` (no
  temporary file and rename) and takes its file lock (``.lockfile``, ``filelock``) around
  reads and writes only when ``jax_compilation_cache_max_size`` is set. So a size bound is
  set (:data:`MAX_BYTES`, least recently used entries evicted first), which turns the lock
  on: processes of a multi-process run, several runs and pytest-xdist workers sharing the
  directory never read half an entry nor write one twice at once. Only process 0 of a
  multi-process run writes (JAX's rule); every process reads.
* The cache key covers the program, the compile options, the devices, ``XLA_FLAGS`` and the
  jax / jaxlib versions, so a different backend, device count or version never loads a
  wrong program; it misses.
* Every program is cached: JAX's defaults skip programs that compile in under a second, and
  on CPU the many small programs of a run are most of its start-up.
* A damaged entry (cut short by a kill during a write, changed bytes) does not break a run:
  JAX fails to decompress or deserialize it, warns, and compiles the program. JAX never
  rewrites an existing key, though, so :func:`setup` checks the entries written since its
  last check (the compressed format's checksum), deletes damaged ones, and gives entries
  that another JAX wrote without one the access-time record that eviction needs.

The cache is trusted as code: whoever can write to the directory can make a run execute
what they wrote there (JAX's warning), so keep it private to the user.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import threading
import time
import zlib
from typing import Callable, Optional

#: Bound of the cache directory in bytes (least recently used entries are evicted first). A
#: bound also makes JAX lock the directory around every read and write (see the module doc).
MAX_BYTES = 8 << 30
ENV = "JAX_COMPILATION_CACHE_DIR"
_SUFFIX = "-cache"
_ATIME_SUFFIX = "-atime"
_CHECKED = ".rljax-checked"  # its mtime: entries older than this were checked intact
_LOCK = ".lockfile"  # JAX's own lock file in the directory (jax._src.lru_cache)
_LOCK_TIMEOUT_S = 60.0

_HIT = "/jax/compilation_cache/cache_hits"
_WRITE = "/jax/compilation_cache/cache_misses"  # JAX records it when it writes an entry
_COMPILE = "/jax/core/compile/backend_compile_duration"  # compiled or loaded


def default_dir() -> str:
    """``$XDG_CACHE_HOME/rljax/jax``, else ``~/.cache/rljax/jax``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rljax", "jax")


def resolve_dir(value: Optional[str]) -> Optional[str]:
    """The directory ``trainer.compilation_cache_dir`` names (absolute), or None when off."""
    if value is None:
        return None
    if value == "auto":
        return os.path.abspath(os.environ.get(ENV) or default_dir())
    return os.path.abspath(os.path.expanduser(os.path.expandvars(value)))


# ---------------------------------------------------------------------------- counting


@dataclasses.dataclass
class Counts:
    """Programs this process needed that were not in its in-memory caches (``built``), how many
    of them it loaded from the persistent cache, and how many entries it wrote there."""

    built: int = 0
    loaded: int = 0
    written: int = 0

    @property
    def compiled(self) -> int:
        """Programs XLA compiled (built, not loaded)."""
        return self.built - self.loaded


_totals = Counts()
_counters: list[Counts] = [_totals]
_listening = False
_listen_lock = threading.Lock()


def _on_event(event: str, **_):
    if event == _HIT:
        for c in list(_counters):
            c.loaded += 1
    elif event == _WRITE:
        for c in list(_counters):
            c.written += 1


def _on_duration(event: str, _secs: float, **_):
    if event == _COMPILE:  # JAX times compile-or-load as one event: every program built
        for c in list(_counters):
            c.built += 1


def _listen() -> None:
    global _listening
    with _listen_lock:
        if not _listening:
            import jax

            jax.monitoring.register_event_listener(_on_event)
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _listening = True


class counting:
    """``with counting() as c: ...``: the programs built inside the block (``c.built``:
    compiled by XLA or loaded from the persistent cache; ``c.loaded`` of them loaded)."""

    def __enter__(self) -> Counts:
        _listen()
        self.counts = Counts()
        _counters.append(self.counts)
        return self.counts

    def __exit__(self, *exc):
        _counters.remove(self.counts)
        return False


def totals() -> Counts:
    """This process's counts since :func:`setup` (or since the first :class:`counting`)."""
    return dataclasses.replace(_totals)


# ---------------------------------------------------------------------------- the directory


def _intact(data: bytes) -> bool:
    """Whether ``data`` is one whole compressed entry (zlib, or zstd where JAX uses it):
    both formats end with a checksum, so a cut or changed entry fails."""
    try:
        zlib.decompress(data)
        return True
    except zlib.error:
        pass
    for name in ("compression.zstd", "zstandard"):
        try:
            mod = __import__(name, fromlist=["_"])
        except ImportError:
            continue
        try:
            if name == "zstandard":
                mod.ZstdDecompressor().decompress(data)
            else:
                mod.decompress(data)
            return True
        except Exception:  # noqa: BLE001 -- any failure to decode is damage
            return False
    return False


@dataclasses.dataclass(frozen=True)
class Directory:
    """What :func:`check_entries` found: entries stored, damaged ones removed (their names)."""

    path: str
    stored: int
    removed: tuple[str, ...]
    size_bytes: int


def check_entries(path: str) -> Directory:
    """Under JAX's own lock: delete entries written since the last check that do not
    decompress (with their access-time files), give entries without an access-time file one,
    and count what is stored."""
    import filelock

    os.makedirs(path, exist_ok=True)
    stamp = os.path.join(path, _CHECKED)
    since = os.path.getmtime(stamp) - 1.0 if os.path.exists(stamp) else float("-inf")
    removed, stored, size = [], 0, 0
    with filelock.FileLock(os.path.join(path, _LOCK), timeout=_LOCK_TIMEOUT_S):
        started = time.time()
        for name in sorted(os.listdir(path)):
            if not name.endswith(_SUFFIX):
                continue
            entry = os.path.join(path, name)
            atime = entry[: -len(_SUFFIX)] + _ATIME_SUFFIX
            try:
                st = os.stat(entry)
                if st.st_mtime >= since:
                    with open(entry, "rb") as fh:
                        ok = _intact(fh.read())
                    if not ok:
                        os.remove(entry)
                        if os.path.exists(atime):
                            os.remove(atime)
                        removed.append(name)
                        continue
                if not os.path.exists(atime):
                    with open(atime, "wb") as fh:
                        fh.write(time.time_ns().to_bytes(8, "little"))
            except FileNotFoundError:  # evicted by a JAX that does not take the lock
                continue
            stored += 1
            size += st.st_size
        with open(stamp, "w") as fh:
            fh.write(f"entries written before this file's mtime were checked intact ({started:.0f})\n")
        os.utime(stamp, (started, started))
    return Directory(path, stored, tuple(removed), size)


# ---------------------------------------------------------------------------- set-up


_reported = False


def _report(path: str, echo: Callable[[str], None]) -> None:
    c = _totals
    echo(f"rljax: compilation cache {path}: this process loaded {c.loaded} program(s) from it and compiled "
         f"{c.compiled} ({c.written} written to it)")


def setup(value: Optional[str], *, echo: Optional[Callable[[str], None]] = print,
          report_at_exit: bool = True) -> Optional[Directory]:
    """Points JAX's persistent compilation cache at ``value`` (``trainer.compilation_cache_dir``)
    before anything compiles, and prints one line saying where it is and what it holds.

    ``None`` turns the cache off. A directory that cannot be created or written turns it off
    too, with one line saying why (a cache never stops a run). With ``report_at_exit`` the
    process prints at exit how many programs it loaded from the cache and how many it
    compiled. Returns what :func:`check_entries` found, or None when the cache is off.
    """
    global _reported
    import jax
    from jax.experimental.compilation_cache import compilation_cache as jcc

    say = echo or (lambda _line: None)
    _listen()
    path = resolve_dir(value)
    jcc.reset_cache()  # a process that set up another directory before (tests, notebooks) lets go of it
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        say("rljax: compilation cache off (trainer.compilation_cache_dir=null)")
        return None
    try:
        found = check_entries(path)
        if not os.access(path, os.W_OK):
            raise PermissionError(13, "not writable")
    except OSError as e:
        jax.config.update("jax_enable_compilation_cache", False)
        say(f"rljax: compilation cache off: {path}: {e.strerror or e} (trainer.compilation_cache_dir: a writable "
            "directory, auto, or null)")
        return None
    except Exception as e:  # noqa: BLE001 -- the lock timed out: run without the cache, say so
        jax.config.update("jax_enable_compilation_cache", False)
        say(f"rljax: compilation cache off: {path}: {type(e).__name__}: {e}")
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jcc.set_cache_dir(path)
    damaged = f"; removed {len(found.removed)} damaged entr{'y' if len(found.removed) == 1 else 'ies'}" \
        if found.removed else ""
    say(f"rljax: compilation cache {path}: {found.stored} program(s) stored ({found.size_bytes / 2**20:.0f} MiB)"
        f"{damaged}; a program compiled before is loaded, not compiled (trainer.compilation_cache_dir; null: off)")
    if report_at_exit and echo is not None and not _reported:
        _reported = True
        atexit.register(_report, path, echo)
    return found
