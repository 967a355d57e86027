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
  write whole instead (:func:`_verified_entries_class`): JAX writes the entry into a fresh directory
  beside the entries, which is then renamed over the key (``os.replace``, atomic on one
  file system). Processes sharing the directory (a multi-process run, where only process 0
  writes, several runs, pytest-xdist workers) see an entry absent or whole, never half
  written: before, a read racing a write failed to decompress, JAX warned ("Error reading
  persistent compilation cache entry") and compiled the program again. Two processes writing
  one key at once write the same program; the later rename wins, whole either way. Where the
  JAX release builds its cache otherwise (the hook is private to JAX), JAX's own in-place
  writes stay, and such a racing read costs a compile and a warning, never a wrong program.
* Every entry rljax writes is sealed (:func:`seal`): a digest of its bytes and of the key it is
  stored under follow JAX's bytes, in a form older readers skip. Every read checks the seal
  (:func:`unseal`): an entry whose bytes changed (a flipped bit, a cut), one stored under
  another key (two entries swapped: both valid programs, each the wrong one), or one without a
  seal is refused: deleted, read as absent, so JAX compiles the program and writes it again.
  One line on stderr names the cache and the first refused entry; the exit line counts them
  all. Unchecked, JAX loaded a swapped entry (a wrong program: the launch died on JAX's layout
  check before step 0, or computed with it) and warned at every launch about a damaged one it
  never rewrote.
* A launch that fails after loading programs from the cache, before it trained a step, runs
  once more with the cache bypassed (:func:`retry_bypassed`: nothing loaded, every program
  compiled and written over its entry) and says so: a wrong program the seal cannot catch
  (a key that JAX computed alike for two programs) costs a compile, not the launch.
* At start-up :func:`setup` checks the entries written since its last check the same way, then
  keeps the directory under :data:`MAX_BYTES` by deleting the oldest entries.
  ``python -m rljax.compilation_cache --verify DIR`` checks every entry of a directory and
  deletes those refused (exit 1 when it removed any).
* The cache key covers the program, the compile options, the devices, ``XLA_FLAGS`` and the
  jax / jaxlib versions, so a different backend, device count or version never loads a
  wrong program; it misses.
* Every program is cached: JAX's defaults skip programs that compile in under a second, and
  on CPU the many small programs of a run are most of its start-up.

The cache is still trusted as code: the seal catches damage and misplaced entries, not an
entry someone wrote on purpose with a seal (it is a digest, not a signature), so whoever can
write to the directory can make a run execute what they wrote there (JAX's warning): keep it
private to the user.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import os
import shutil
import sys
import tempfile
import threading
import time
import zlib
from typing import Callable, Optional

from rljax.errors import ConfigError, RunError, UsageError

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
_WRITE = "/jax/compilation_cache/cache_misses"  # JAX records it before it asks the cache to write an entry
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
    of them it loaded from the persistent cache, how many entries it wrote there (an entry
    really added to the directory, not a write JAX asked for that found its key taken), and how
    many entries it refused (:func:`unseal`: damaged, moved, or without a digest) and deleted."""

    built: int = 0
    loaded: int = 0
    written: int = 0
    refused: int = 0

    @property
    def compiled(self) -> int:
        """Programs XLA compiled (built, not loaded)."""
        return self.built - self.loaded


_totals = Counts()
_counters: list[Counts] = [_totals]
_listening = False
_listen_lock = threading.Lock()
_hooked = False  # the file cache is :func:`_verified_entries_class`'s: it counts its own writes


def _count(field: str) -> None:
    for c in list(_counters):
        setattr(c, field, getattr(c, field) + 1)


def _on_event(event: str, **_):
    if event == _HIT:
        _count("loaded")
    elif event == _WRITE and not _hooked:  # JAX's own cache: counted when JAX asks for the write
        _count("written")


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


# ---------------------------------------------------------------------------- the seal

# Every entry rljax writes ends with a seal: a zstd skippable frame (magic 0x184D2A5E, its size,
# then the payload) holding a tag, the SHA-256 of the key the entry is stored under and the
# SHA-256 of JAX's bytes before it. zlib readers (JAX's own, an older rljax) ignore data after the
# compressed stream, and zstd's frame format defines the frame as skippable, so a reader that does
# not know the seal loads the entry as before (a zstd reader that refuses trailing data compiles
# the program instead: at worst a compile, never a wrong program).
_SEAL_MAGIC = (0x184D2A5E).to_bytes(4, "little")
_SEAL_TAG = b"rljax-cache-seal-v1\0"
_SEAL_PAYLOAD = len(_SEAL_TAG) + 64
_SEAL_HEAD = _SEAL_MAGIC + _SEAL_PAYLOAD.to_bytes(4, "little") + _SEAL_TAG
_SEAL_LEN = 8 + _SEAL_PAYLOAD

#: Why :func:`unseal` refuses an entry.
DAMAGED = "its bytes do not match the digest written with them (damaged)"
MOVED = "it was written under another key (moved, or swapped with another entry)"
UNSEALED = "it has no digest (cut short, or written by JAX alone or an older rljax): it cannot be verified"


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def seal(key: str, value: bytes) -> bytes:
    """``value`` (JAX's compressed entry) followed by its seal for ``key``."""
    return value + _SEAL_HEAD + _sha(key.encode()) + _sha(value)


def unseal(key: str, data: bytes) -> tuple[Optional[bytes], Optional[str]]:
    """``(JAX's bytes, None)`` when ``data`` carries a seal of itself under ``key``, else
    ``(None, why)``: :data:`DAMAGED`, :data:`MOVED` or :data:`UNSEALED`."""
    magic_at = len(data) - _SEAL_LEN
    if magic_at < 0 or data[magic_at:magic_at + 4] != _SEAL_MAGIC:
        return None, UNSEALED
    if data[magic_at:magic_at + len(_SEAL_HEAD)] != _SEAL_HEAD:
        return None, DAMAGED  # a seal with changed bytes
    value = data[:magic_at]
    key_sha, value_sha = data[-64:-32], data[-32:]
    if _sha(value) != value_sha:
        return None, DAMAGED
    if _sha(key.encode()) != key_sha:
        return None, MOVED
    return value, None


def verdict(path: str) -> Optional[str]:
    """Why the entry file ``path`` (``<key>-cache``) is refused (:func:`unseal`), else None:
    sealed for its own key, and whole (it decompresses)."""
    with open(path, "rb") as fh:
        data = fh.read()
    value, why = unseal(os.path.basename(path)[: -len(_SUFFIX)], data)
    if why is None and not _intact(value):
        why = DAMAGED  # sealed as written: JAX's own bytes were cut (never happens with rljax's writes)
    return why


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
    """What :func:`check_entries` found: entries stored and their size, the names of the entries
    it removed (refused by :func:`verdict`; ``why``: name -> reason) and of old ones it removed
    to stay under the bound."""

    path: str
    stored: int
    size_bytes: int
    removed: tuple[str, ...]
    evicted: tuple[str, ...] = ()
    why: tuple[tuple[str, str], ...] = ()


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


def _evict(path: str, kept: list, max_bytes: int) -> tuple[list, int]:
    """Removes the oldest of ``kept`` (``(mtime, name, size)``) down to 3/4 of ``max_bytes`` when the
    directory holds more; returns the names removed and the size left."""
    evicted, size = [], sum(k[2] for k in kept)
    if size > max_bytes:
        for _, name, n in sorted(kept):
            if size <= max_bytes * 3 // 4:
                break
            _remove(os.path.join(path, name))
            evicted.append(name)
            size -= n
    return evicted, size


def check_entries(path: str, *, max_bytes: int = MAX_BYTES, everything: bool = False) -> Directory:
    """Deletes the entries written since the last check (and settled) that :func:`verdict` refuses
    (every entry with ``everything``), then the oldest entries while the directory holds more than
    ``max_bytes``; counts the rest."""
    os.makedirs(path, exist_ok=True)
    stamp = os.path.join(path, _CHECKED)
    since = os.path.getmtime(stamp) - 1.0 if os.path.exists(stamp) and not everything else float("-inf")
    settled = time.time() - SETTLE_S
    why, kept = {}, []
    for name in os.listdir(path):
        if name.startswith(_STAGING):  # a write killed before its rename: never an entry
            _remove_staging(os.path.join(path, name), settled)
            continue
        if not name.endswith(_SUFFIX):
            continue
        entry = os.path.join(path, name)
        try:
            st = os.stat(entry)
            if since <= st.st_mtime and (everything or st.st_mtime < settled):
                why[name] = verdict(entry)
                if why[name] is not None:
                    _remove(entry)
                    continue
        except FileNotFoundError:  # another process removed it meanwhile
            continue
        kept.append((st.st_mtime, name, st.st_size))
    evicted, size = _evict(path, kept, max_bytes)
    with open(stamp, "w") as fh:
        fh.write("rljax.compilation_cache: entries written before this file's mtime were checked intact\n")
    os.utime(stamp, (settled, settled))
    refused = tuple(sorted((n, w) for n, w in why.items() if w is not None))
    return Directory(path, len(kept) - len(evicted), size, tuple(n for n, _ in refused), tuple(evicted), refused)


# ---------------------------------------------------------------------------- set-up


_reported = False
_bypassed = False  # after a launch failed while loading from the cache: compile everything, write it over
_warned = False  # the one line about a refused entry was printed


def _report(path: str, echo: Callable[[str], None]) -> None:
    c = _totals
    extra = f"; refused {c.refused} damaged or moved entr{'y' if c.refused == 1 else 'ies'}, deleted and compiled " \
        "again" if c.refused else ""
    extra += "; bypassed after the launch failed while loading from it" if _bypassed else ""
    echo(f"rljax: compilation cache {path}: this process loaded {c.loaded} program(s) from it and compiled "
         f"{c.compiled} ({c.written} written to it{extra})")


def _refuse(entry: str, data: bytes, why: str) -> None:
    """Deletes the refused ``entry`` (unless another process replaced it meanwhile), counts it, and
    says so in one line the first time in this process (the exit line counts the rest)."""
    global _warned
    try:
        with open(entry, "rb") as fh:
            if fh.read() == data:
                _remove(entry)
    except OSError:
        pass
    _count("refused")
    if not _warned:
        _warned = True
        sys.stderr.write(f"rljax: compilation cache {os.path.dirname(entry)}: refused {os.path.basename(entry)}: "
                         f"{why}; deleted it, the program is compiled and stored again (the exit line counts "
                         "every refused entry)\n")
        sys.stderr.flush()


def _verified_entries_class(base: type) -> type:
    """A subclass of JAX's file cache ``base`` that seals what it writes, verifies what it reads,
    and writes each entry whole (see the module doc)."""

    class _VerifiedEntries(base):
        """JAX's file cache, whose entries carry a seal (:func:`seal`) checked at every read (a
        refused entry is deleted and read as absent: JAX compiles the program and writes it
        again), written in a fresh directory beside the entries and renamed over the key."""

        rljax_verified_entries = True  # marks the class installed, so setup installs it once

        def get(self, key):  # noqa: D102 -- CacheInterface.get
            if _bypassed:
                return None
            data = super().get(key)
            if data is None:
                return None
            value, why = unseal(key, data)
            if why is not None:
                _refuse(os.path.join(str(self.path), key + _SUFFIX), data, why)
            return value

        def put(self, key, value):  # noqa: D102 -- CacheInterface.put
            final = os.path.join(str(self.path), key + _SUFFIX)
            local = "://" not in str(self.path) or str(self.path).startswith("file://")
            if getattr(self, "eviction_enabled", True) or not local:  # JAX's locked path, or a remote file system
                existed = os.path.exists(final) if local else False
                super().put(key, seal(key, value))
                if not existed:
                    _count("written")
                return
            if os.path.exists(final) and not _bypassed:  # JAX never rewrites a key; a bypassed launch does
                return
            staging = tempfile.mkdtemp(prefix=_STAGING, dir=str(self.path))
            try:
                base(staging, max_size=-1).put(key, seal(key, value))  # JAX names and writes the entry
                for name in os.listdir(staging):
                    if os.path.exists(final) and not _bypassed:  # written meanwhile by another process: keep theirs
                        continue
                    os.replace(os.path.join(staging, name), os.path.join(str(self.path), name))
                    _count("written")
            finally:
                shutil.rmtree(staging, ignore_errors=True)

    return _VerifiedEntries


def _verify_entries() -> bool:
    """Makes JAX build its file cache as :func:`_verified_entries_class` (``get_file_cache`` looks
    its ``LRUCache`` up at call time). False where this JAX release builds it otherwise: then
    entries are neither sealed nor verified, and written in place by JAX."""
    global _hooked
    try:
        from jax._src import compilation_cache as jax_cc  # private hook: checked below, never required
    except ImportError:
        return False
    base = getattr(jax_cc, "LRUCache", None)
    if not isinstance(base, type) or not callable(getattr(jax_cc, "get_file_cache", None)):
        return False
    if not getattr(base, "rljax_verified_entries", False):
        jax_cc.LRUCache = _verified_entries_class(base)
    _hooked = True
    return True


def _refused_text(found: Directory) -> list[str]:
    """``removed 2 damaged entries``, ...: what :func:`check_entries` removed, by reason."""
    labels = ((DAMAGED, "damaged entr{}"), (MOVED, "moved entr{} (stored under another key)"),
              (UNSEALED, "entr{} without a digest"))
    out = []
    for why, label in labels:
        n = sum(1 for _, w in found.why if w == why)
        if n:
            out.append(f"removed {n} " + label.format("y" if n == 1 else "ies"))
    return out


_in_use: Optional[str] = None  # the directory setup pointed JAX at (None: off)


def setup(value: Optional[str], *, echo: Optional[Callable[[str], None]] = print,
          report_at_exit: bool = True) -> Optional[Directory]:
    """Points JAX's persistent compilation cache at ``value`` (``trainer.compilation_cache_dir``)
    before anything compiles, and prints one line saying where it is and what it holds.

    ``None`` turns the cache off. A directory that cannot be created or written turns it off
    too, with one line saying why (a cache never stops a run). With ``report_at_exit`` the
    process prints at exit how many programs it loaded from the cache and how many it
    compiled. Returns what :func:`check_entries` found, or None when the cache is off.
    """
    global _reported, _in_use, _warned
    import jax
    from jax.experimental.compilation_cache import compilation_cache as jcc

    say = echo or (lambda _line: None)
    _listen()
    path = _in_use = resolve_dir(value)
    _warned = False  # one line about a refused entry per set-up
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
        _in_use = None
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_max_size", -1)  # no per-write scan (see the module doc)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _verify_entries()
    jcc.set_cache_dir(path)
    damaged = "".join(f"; {part}" for part in _refused_text(found))
    if found.evicted:
        damaged += f"; removed the {len(found.evicted)} oldest to stay under {MAX_BYTES >> 30} GiB"
    say(f"rljax: compilation cache {path}: {found.stored} program(s) stored ({found.size_bytes / 2**20:.0f} MiB)"
        f"{damaged}; a program compiled before is loaded, not compiled (trainer.compilation_cache_dir; null: off)")
    if report_at_exit and echo is not None and not _reported:
        _reported = True
        atexit.register(_report, path, echo)
    return found


# ---------------------------------------------------------------------------- a failed launch


def bypass(on: bool = True) -> None:
    """From now on this process loads nothing from the cache: every program is compiled and
    written over its entry (a launch that failed after loading programs runs again so).
    ``on=False`` reads the cache again (tests)."""
    global _bypassed
    import jax

    _bypassed = on
    if not _hooked:  # JAX's own cache cannot be bypassed alone: off
        jax.config.update("jax_enable_compilation_cache", not on)
    jax.clear_caches()  # the programs loaded so far are dropped from memory too


def retry_bypassed(run: Callable[[], int], *, eligible: Callable[[], bool] = lambda: True) -> int:
    """``run()``; when it raises after this process loaded programs from the cache and
    ``eligible()`` (the launcher: one process, no step recorded yet), says so in one line and
    runs it once more with the cache bypassed (:func:`bypass`). A failure that does not come
    from the cache fails the second time too, and is raised as it is."""
    before = _totals.loaded
    try:
        return run()
    except Exception as e:  # noqa: BLE001 -- any failure after loading programs may be the cache's
        loaded = _totals.loaded - before
        own = isinstance(e, (ConfigError, RunError, UsageError))  # rljax's own stops are no program's fault
        if _in_use is None or _bypassed or loaded == 0 or own or not eligible():
            raise
        first = (str(e).strip().splitlines() or [""])[0][:240]
        sys.stderr.write(f"rljax: the launch failed after loading {loaded} program(s) from the compilation cache "
                         f"{_in_use} ({type(e).__name__}: {first}); retrying once with the cache bypassed (every "
                         "program compiled again and written over its entry)\n")
        sys.stderr.flush()
        bypass()
        return run()


# ---------------------------------------------------------------------------- python -m rljax.compilation_cache


def main(argv: Optional[list] = None) -> int:
    """``python -m rljax.compilation_cache --verify DIR``: checks every entry of a cache directory
    (its seal, that it is stored under its own key, that it decompresses), deletes those that
    fail and the leftovers of killed writes; exit 0 when all were intact, 1 when some were
    removed, 2 on a usage error."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m rljax.compilation_cache", description=main.__doc__.split("\n\n")[0])
    p.add_argument("--verify", metavar="DIR", required=True, help="the cache directory to check and clean")
    args = p.parse_args(argv)
    path = os.path.abspath(os.path.expanduser(args.verify))
    if not os.path.isdir(path):
        p.error(f"--verify {args.verify}: not a directory (a compilation cache directory, e.g. {default_dir()})")
    found = check_entries(path, max_bytes=1 << 62, everything=True)
    for name, why in found.why:
        print(f"{path}: removed {name}: {why}")
    parts = _refused_text(found) or ["every entry intact"]
    print(f"{path}: {found.stored} entr{'y' if found.stored == 1 else 'ies'} verified "
          f"({found.size_bytes / 2**20:.0f} MiB); " + "; ".join(parts))
    return 1 if found.removed else 0


if __name__ == "__main__":
    sys.exit(main())
