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

import rljax
from rljax.errors import ConfigError
from rljax.reward._judge import check_judge_template, load_judge_parse
from rljax.reward._plugin import BUILTIN_REWARDS, CALLABLE, DATA_SOURCES, load_reward_plugin

_OK = "rljax-reward-plugin-ok"


def probe_plugin(spec: str, *, data_source: str | None, timeout_s: float, key: str = "reward.function") -> None:
    """Imports the plugin ``spec`` in a child process and checks its signature there (a reward
    function's, or with ``key="reward.judge.parse"`` a judge parser's: one argument).

    Raises:
      ConfigError: the import failed (the child's one-line reason), exited the child, or took
        longer than ``timeout_s``.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(rljax.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        # -W: runpy's warning that rljax.reward imported _check before running it is not the plugin's output
        out = subprocess.run([sys.executable, "-W", "ignore::RuntimeWarning:runpy", "-m", "rljax.reward._check", spec,
                              data_source or "", key],
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
    """The reward section's inputs: ``reward.timeout_s`` only with workers, a plugin that imports
    (in a child process) and has a reward signature, the overlong buffer within the length
    limit, the reward model's checkpoint and the generative judge's inputs, each in the
    schedules that run it.

    Raises:
      ConfigError: one line naming the key and what is accepted.
    """
    r = cfg.reward
    check_reward_shaping(cfg)
    check_reward_model(cfg)
    if r.num_workers == 0 and r.timeout_s is not None:
        raise ConfigError(f"reward.timeout_s={r.timeout_s:g} needs reward workers: reward.num_workers=0 runs the reward "
                          "in the trainer's process, where a hung call cannot be stopped; set reward.num_workers>=1 "
                          "or reward.timeout_s=null")
    for spec, key in ((f, "reward.functions") for f in r.functions) if r.functions else ((r.function, "reward.function"),):
        if spec.startswith(CALLABLE):  # a callable of this process (rljax.train): loaded here, no file to probe
            load_reward_plugin(spec, key=key)
            if r.num_workers:
                raise ConfigError(f"reward.num_workers={r.num_workers}: a Python callable given to rljax.train runs in "
                                  "the trainer's process; use reward.num_workers=0")
        elif spec != "auto" and spec not in BUILTIN_REWARDS:
            probe_plugin(spec, data_source=DATA_SOURCES.get(cfg.data.dataset), timeout_s=r.import_timeout_s, key=key)
    check_judge(cfg)


def check_reward_model(config) -> None:
    """``reward.model.path``: a checkpoint directory; with the filter only on ``metric=acc`` (sync and
    async, single- and multi-turn runs take it)."""
    path = config.reward.model.path
    if path is None:
        return
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"reward.model.path={path} is not a Hugging Face checkpoint directory (no config.json); "
                          "accepted: a local LlamaForSequenceClassification / Qwen2ForSequenceClassification directory")
    fg = config.algorithm.filter_groups
    if fg.enable and fg.metric != "acc":
        raise ConfigError(f"reward.model.path with algorithm.filter_groups.metric={fg.metric} is not supported yet (the "
                          "filter keeps groups before the learner batch, which the model scores, exists); accepted: "
                          "algorithm.filter_groups.metric=acc (reward.function's score decides)")


def check_reward_shaping(config) -> None:
    """``reward.reward_kwargs``: the overlong buffer fits in the length limit."""
    kw = config.reward.reward_kwargs
    ob = kw.overlong_buffer_cfg
    limit = kw.max_resp_len or config.data.max_response_length
    if ob.enable and not 1 <= ob.len <= limit:
        raise ConfigError(f"reward.reward_kwargs.overlong_buffer_cfg.len={ob.len} must be in [1, {limit}] (the "
                          "max_resp_len, default data.max_response_length) with overlong_buffer_cfg.enable=true")


def check_judge(cfg) -> None:
    """``reward.judge``: a checkpoint (``ref`` or a directory with ``config.json``), a template
    that reads the response, a parser that imports and takes one argument, a schedule that runs it.

    Raises:
      ConfigError: one line naming the key and what is accepted.
    """
    j = cfg.reward.judge
    if j.path is None:
        return
    if j.path != "ref" and not os.path.isfile(os.path.join(j.path, "config.json")):
        raise ConfigError(f"reward.judge.path={j.path} is neither ref nor a Hugging Face checkpoint directory (no "
                          "config.json); accepted: ref (the policy's initial weights) or a local LlamaForCausalLM / "
                          "Qwen2ForCausalLM directory")
    check_judge_template(j.prompt_template)
    fg = cfg.algorithm.filter_groups
    for key, value, why in (("trainer.mode", cfg.trainer.mode != "sync", "not yet in the async producer"),
                            ("algorithm.filter_groups.metric", fg.enable and fg.metric != "acc",
                             "the filter keeps groups before the judge reads them; accepted: "
                             "algorithm.filter_groups.metric=acc, reward.function's score decides")):
        if value:
            raise ConfigError(f"reward.judge.path with {key}={_value(cfg, key)} is not supported yet ({why})")
    if j.parse is not None:
        probe_plugin(j.parse, data_source=None, timeout_s=cfg.reward.import_timeout_s, key="reward.judge.parse")


def _value(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return str(cfg).lower() if isinstance(cfg, bool) else cfg


def _main(argv: list[str]) -> int:
    spec, data_source, key = argv[0], argv[1] or None, argv[2] if len(argv) > 2 else "reward.function"
    try:
        if key == "reward.judge.parse":
            load_judge_parse(spec, key=key)
        else:
            load_reward_plugin(spec, key=key, data_source=data_source)
    except ConfigError as e:
        print(" ".join(str(e).split()), flush=True)
        return 2
    print(_OK, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
