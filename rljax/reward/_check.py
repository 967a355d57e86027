"""The reward section's own launch-time checks (``check(cfg)``), run before anything is written.

A ``path/to/file.py:function`` plugin is first imported in a child process
(``python -m rljax.reward._check SPEC DATA_SOURCE``) with ``reward.import_timeout_s``: a
plugin that exits the process at import (``os._exit``, a crash) or hangs there is a one-line
:class:`~rljax.config.ConfigError` (exit 2), never the launcher's own end or hang.
"""

from __future__ import annotations

import os
import subprocess
import sys

from rljax.errors import ConfigError
from rljax.reward._plugin import BUILTIN_REWARDS, DATA_SOURCES, load_reward_plugin

_OK = "rljax-reward-plugin-ok"


def probe_plugin(spec: str, *, data_source: str | None, timeout_s: float, key: str = "reward.function") -> None:
    """Imports the plugin ``spec`` in a child process and checks its signature there.

    Raises:
      ConfigError: the import failed (the child's one-line reason), exited the child, or took
        longer than ``timeout_s``.
    """
    import rljax

    root = os.path.dirname(os.path.dirname(os.path.abspath(rljax.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        out = subprocess.run([sys.executable, "-m", "rljax.reward._check", spec, data_source or ""],
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s, env=env,
                             start_new_session=True)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{key}={spec!r}: importing the plugin did not finish within {timeout_s:g} s "
                          "(reward.import_timeout_s); a reward file must not block or wait at import") from None
    lines = [l for l in out.stdout.splitlines() if l.strip()]
    if out.returncode == 0 and lines and lines[-1] == _OK:
        return
    if out.returncode == 2 and lines:  # the child's ConfigError, one line
        raise ConfigError(lines[-1])
    how = (f"was killed by signal {-out.returncode}" if out.returncode < 0
           else f"ended the process with exit code {out.returncode}")
    last = (out.stderr.strip().splitlines() or [""])[-1][:200]
    raise ConfigError(f"{key}={spec!r}: importing the plugin {how} (os._exit, sys.exit or a crash at import)"
                      + (f": {last}" if last else ""))


def check(cfg) -> None:
    """The reward section's inputs: ``reward.timeout_s`` only with workers, and a plugin that
    imports (in a child process) and has a reward signature.

    Raises:
      ConfigError: one line naming the key and what is accepted.
    """
    r = cfg.reward
    if r.num_workers == 0 and r.timeout_s is not None:
        raise ConfigError(f"reward.timeout_s={r.timeout_s:g} needs reward workers: reward.num_workers=0 runs the reward "
                          "in the trainer's process, where a hung call cannot be stopped; set reward.num_workers>=1 "
                          "or reward.timeout_s=null")
    if r.function != "auto" and r.function not in BUILTIN_REWARDS:
        probe_plugin(r.function, data_source=DATA_SOURCES.get(cfg.data.dataset), timeout_s=r.import_timeout_s)


def _main(argv: list[str]) -> int:
    spec, data_source = argv[0], argv[1] or None
    try:
        load_reward_plugin(spec, data_source=data_source)
    except ConfigError as e:
        print(" ".join(str(e).split()), flush=True)
        return 2
    print(_OK, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
