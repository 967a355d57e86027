"""Compiled programs that survive the process: JAX's persistent compilation cache for rljax runs.

``trainer.compilation_cache_dir`` names the directory: ``auto`` (the default) is
``$JAX_COMPILATION_CACHE_DIR`` when that is set, else ``$XDG_CACHE_HOME/rljax/jax``, else
``~/.cache/rljax/jax``; ``null`` turns the cache off. A second launch of the same
configuration (another seed, a resume, the same run again) loads the programs the first one
compiled instead of compiling them: :func:`setup` points JAX at the directory before
anything compiles and prints where it is; at exit the process reports how many programs it
loaded from the cache and how many it compiled.

What JAX 0.10 does with the directory, and what :func:`setup` adds:

* JAX writes an entry ``<module>-<key>-cache`` in place (``Path.write_bytes``, no temporary
  file and rename) after checking that the key is absent, and reads one whole with
  ``read_bytes``. It locks the directory (``filelock``) only when
  ``jax_compilation_cache_max_size`` is set, and then scans and stats every entry on every
  write to evict the least recently used: 0.1 s per write at 200 entries here, seconds at a
  test session's thousands. So no size bound is given to JAX, and :func:`setup` makes every
  write whole instead (:class:`_WholeEntries`): JAX writes the entry into a fresh directory
  beside the entries, which is then renamed over the key (``os.replace``, atomic on one
  file system). Processes sharing the directory (a multi-process run, where only process 0
  writes, several runs, pytest-xdist workers) see an entry absent or whole, never half
  written: before, a read racing a write failed to decompress, JAX warned ("Error reading
  persistent compilation cache entry") and compiled the program again. Two processes writing
  one key at once write the same program; the later rename wins, whole either way. Where the
  JAX release builds its cache otherwise (the hook is private to JAX), JAX's own in-place
  writes stay, and such a racing read costs a compile and a warning, never a wrong program.
* A damaged entry (cut short by a kill during a write, changed bytes) does not break a run
  either: JAX fails to decompress or deserialize it, warns, and compiles the program. JAX
  never rewrites an existing key, though, so :func:`setup` checks the entries written since
  its last check and deletes damaged ones (entries younger than a minute wait for the next
  check: they may still be being written), then keeps the directory under
  :data:`MAX_BYTES` by deleting the oldest entries.
* The cache key covers the program, the compile options, the devices, ``XLA_FLAGS`` and the
  jax / jaxlib versions, so a different backend, device count or version never loads a
  wrong program; it misses.
* Every program is cached: JAX's defaults skip programs that compile in under a second, and
  on CPU the many small programs of a run are most of its start-up.

The cache is trusted as code: whoever can write to the directory can make a run execute
what they wrote there (JAX's warning), so keep it private to the user.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import tempfile
import threading
import time
import zlib
from typing import Callable, Optional

#: Bound of the cache directory in bytes: at start-up :func:`setup` deletes the oldest entries
#: beyond it (JAX's own bound costs a scan of the directory per write; see the module doc).
MAX_BYTES = 8 << 30
#: Entries younger than this may still be being written by another process: not checked yet.
SETTLE_S = 60.0
ENV = "JAX_COMPILATION_CACHE_DIR"
_SUFFIX = "-cache"
_ATIME_SUFFIX = "-atime"  # JAX's access-time record of an entry (written only with a size bound)
_CHECKED = ".rljax-checked"  # its mtime: entries written before it were checked intact
_STAGING = ".rljax-writing-"  # prefix of the directory an entry is written in before its rename

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
    """What :func:`check_entries` found: entries stored and their size, the names of damaged
    entries it removed and of old ones it removed to stay under the bound."""

    path: str
    stored: int
    size_bytes: int
    removed: tuple[str, ...]
    evicted: tuple[str, ...] = ()


def _remove(entry: str) -> None:
    for p in (entry, entry[: -len(_SUFFIX)] + _ATIME_SUFFIX):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass


def _remove_staging(staging: str, settled: float) -> None:
    try:
        if os.stat(staging).st_mtime >= settled:
            return  # another process may be writing in it now
        for name in os.listdir(staging):
            os.remove(os.path.join(staging, name))
        os.rmdir(staging)
    except OSError:  # removed meanwhile, or not ours to remove: it is never read as an entry
        pass


def check_entries(path: str, *, max_bytes: int = MAX_BYTES) -> Directory:
    """Deletes the entries written since the last check (and settled) that do not decompress,
    then the oldest entries while the directory holds more than ``max_bytes``; counts the rest."""
    os.makedirs(path, exist_ok=True)
    stamp = os.path.join(path, _CHECKED)
    since = os.path.getmtime(stamp) - 1.0 if os.path.exists(stamp) else float("-inf")
    settled = time.time() - SETTLE_S
    removed, kept = [], []
    for name in os.listdir(path):
        if name.startswith(_STAGING):  # a write killed before its rename: never an entry
            _remove_staging(os.path.join(path, name), settled)
            continue
        if not name.endswith(_SUFFIX):
            continue
        entry = os.path.join(path, name)
        try:
            st = os.stat(entry)
            if since <= st.st_mtime < settled:
                with open(entry, "rb") as fh:
                    if not _intact(fh.read()):
                        _remove(entry)
                        removed.append(name)
                        continue
        except FileNotFoundError:  # another process removed it meanwhile
            continue
        kept.append((st.st_mtime, name, st.st_size))
    evicted = []
    size = sum(k[2] for k in kept)
    if size > max_bytes:  # the oldest first, down to 3/4 of the bound
        for mtime, name, n in sorted(kept):
            if size <= max_bytes * 3 // 4:
                break
            _remove(os.path.join(path, name))
            evicted.append(name)
            size -= n
    with open(stamp, "w") as fh:
        fh.write("rljax.compilation_cache: entries written before this file's mtime were checked intact\n")
    os.utime(stamp, (settled, settled))
    return Directory(path, len(kept) - len(evicted), size, tuple(sorted(removed)), tuple(evicted))


# ---------------------------------------------------------------------------- set-up


_reported = False


def _report(path: str, echo: Callable[[str], None]) -> None:
    c = _totals
    echo(f"rljax: compilation cache {path}: this process loaded {c.loaded} program(s) from it and compiled "
         f"{c.compiled} ({c.written} written to it)")


def _whole_entries_class(base: type) -> type:
    """A subclass of JAX's file cache ``base`` whose writes are whole (see the module doc)."""

    class _WholeEntries(base):
        """JAX's file cache, writing each entry in a fresh directory beside the entries and
        renaming it over the key, so no reader ever sees a half-written entry."""

        rljax_whole_entries = True  # marks the class installed, so setup installs it once

        def put(self, key, value):  # noqa: D102 -- CacheInterface.put
            local = "://" not in str(self.path) or str(self.path).startswith("file://")
            if getattr(self, "eviction_enabled", True) or not local:
                return super().put(key, value)  # JAX's locked path, or a remote file system
            staging = tempfile.mkdtemp(prefix=_STAGING, dir=str(self.path))
            try:
                base(staging, max_size=-1).put(key, value)  # JAX names and writes the entry
                for name in os.listdir(staging):
                    final = os.path.join(str(self.path), name)
                    if os.path.exists(final):  # written meanwhile by another process: keep theirs
                        os.remove(os.path.join(staging, name))
                    else:
                        os.replace(os.path.join(staging, name), final)
            finally:
                shutil.rmtree(staging, ignore_errors=True)

    return _WholeEntries


def _write_whole_entries() -> bool:
    """Makes JAX build its file cache as :func:`_whole_entries_class` (``get_file_cache`` looks
    its ``LRUCache`` up at call time). False where this JAX release builds it otherwise."""
    try:
        from jax._src import compilation_cache as jax_cc  # private hook: checked below, never required
    except ImportError:
        return False
    base = getattr(jax_cc, "LRUCache", None)
    if not isinstance(base, type) or not callable(getattr(jax_cc, "get_file_cache", None)):
        return False
    if not getattr(base, "rljax_whole_entries", False):
        jax_cc.LRUCache = _whole_entries_class(base)
    return True


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
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_max_size", -1)  # no per-write scan (see the module doc)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _write_whole_entries()
    jcc.set_cache_dir(path)
    damaged = f"; removed {len(found.removed)} damaged entr{'y' if len(found.removed) == 1 else 'ies'}" \
        if found.removed else ""
    if found.evicted:
        damaged += f"; removed the {len(found.evicted)} oldest to stay under {MAX_BYTES >> 30} GiB"
    say(f"rljax: compilation cache {path}: {found.stored} program(s) stored ({found.size_bytes / 2**20:.0f} MiB)"
        f"{damaged}; a program compiled before is loaded, not compiled (trainer.compilation_cache_dir; null: off)")
    if report_at_exit and echo is not None and not _reported:
        _reported = True
        atexit.register(_report, path, echo)
    return found
