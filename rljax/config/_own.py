"""Your own model or data starts from sensible settings (the launcher's resolution, :func:`resolve_run`).

With no ``--config``, the launcher starts from ``configs/default.yaml``: the embedded task's
preset, sized for a random 2-layer model learning sums (prompts of 8 tokens, responses of 3,
``lr=3e-4``). A command line that names ``model.path``, ``data.path`` or ``data.train_files``
starts from ``configs/own.yaml`` instead (verl-like lengths, batch and ``lr``), and settings
nobody gave are derived:

* ``data.dataset=local`` when a ``data.path`` / ``data.train_files`` is given and the dataset is
  the code default;
* prompt and response lengths that do not fit ``model.path``'s context (``max_position_embeddings``
  of its ``config.json``) are cut to it (the response to at most half, the prompt to the rest);
* the run directory is named after the model and the data
  (``runs/<project>/<model>-<data>``), and a preset's run with a reward function or an
  asynchronous schedule given on the command line gets it as a suffix (``embedded-add-async``,
  ``embedded-add-compute_score``), so the README's commands never share a directory.

Each derived value's source says so (``derived: ...``) in ``--print-config`` and
``config.resolved.yaml``; a key given on the command line is never changed. Pure Python.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

#: The presets the launcher starts from with no ``--config``.
DEFAULT_PRESET, OWN_PRESET = "default", "own"
#: Keys that make a run your own (model or data): the launcher then starts from :data:`OWN_PRESET`.
OWN_KEYS = ("model.path", "data.path", "data.train_files")


def launch_preset(config_name, given: set) -> str:
    """The preset a launch resolves: ``--config`` when given, else own.yaml for a run naming
    one of :data:`OWN_KEYS`, else default.yaml."""
    if config_name:
        return config_name
    return OWN_PRESET if given & set(OWN_KEYS) else DEFAULT_PRESET


def _name(text: str) -> str:
    """A run-directory component from a path or name: its last part, safe characters only."""
    base = Path(str(text).rstrip("/")).name or str(text)
    base = re.sub(r"\.(jsonl|json|parquet)$", "", base)
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", base).strip("-.") or "run"


def _context(model_path) -> int | None:
    try:
        cfg = json.loads((Path(model_path).expanduser() / "config.json").read_text())
        return int(cfg.get("max_position_embeddings", 4096))
    except (OSError, ValueError, TypeError, AttributeError):
        return None  # the preflight reports an unreadable checkpoint


class Derivations:
    """The derived defaults of one launch resolution, applied to ``values`` where the key's source
    is not the command line (``given``: the keys the command line set)."""

    def __init__(self, values: dict, sources: dict, given: set, preset: str):
        self.values, self.sources, self.given, self.preset = values, sources, given, preset
        self.changes: list[tuple[str, object, str]] = []

    def _set(self, key: str, value, why: str) -> None:
        if key not in self.given and self.values[key] != value:
            self.changes.append((key, value, f"derived: {why}"))
            self.values[key] = value

    def apply(self) -> list[tuple[str, object, str]]:
        """``[(key, value, source), ...]`` of the values it derived (also written into ``values``)."""
        v = self.values
        own = self.preset == OWN_PRESET
        if own and (v["data.path"] or v["data.train_files"]) and self.sources["data.dataset"] == "default":
            self._set("data.dataset", "local", "your own data (data.path / data.train_files)")
        if own and v["model.path"]:
            self._fit_context(v["model.path"])
        if self.sources["trainer.experiment_name"] == "default" or own:
            self._set("trainer.experiment_name", self._run_name(), "named after the model and the data")
        else:
            suffix = self._variant()
            if suffix:
                self._set("trainer.experiment_name", f"{v['trainer.experiment_name']}-{suffix}",
                          "this preset's run with another reward or schedule")
        return self.changes

    def _variant(self) -> str:
        """What a command line changed that makes another run of a preset: the reward, the schedule
        (``compute_score``, ``f_and_g`` for reward.functions, ``async``)."""
        v, parts = self.values, []
        if "reward.function" in self.given and v["reward.function"] != "auto":
            parts.append(_name(v["reward.function"].rsplit(":", 1)[-1]))
        if "reward.functions" in self.given and v["reward.functions"]:
            parts.append("_and_".join(_name(f.rsplit(":", 1)[-1]) for f in v["reward.functions"]))
        if "trainer.mode" in self.given and v["trainer.mode"] == "async":
            parts.append("async")
        return "-".join(parts)

    def _fit_context(self, model_path) -> None:
        ctx = _context(model_path)
        prompt, response = self.values["data.max_prompt_length"], self.values["data.max_response_length"]
        if ctx is None or prompt + response <= ctx:
            return
        why = f"model.path's max_position_embeddings={ctx}"
        if "data.max_response_length" not in self.given:
            response = min(response, max(1, ctx // 2) if "data.max_prompt_length" not in self.given else
                           max(1, ctx - prompt))
            self._set("data.max_response_length", response, why)
        if "data.max_prompt_length" not in self.given:
            self._set("data.max_prompt_length", max(1, ctx - response), why)

    def _run_name(self) -> str:
        v = self.values
        model = _name(v["model.path"]) if v["model.path"] else v["model.name"]
        if v["data.path"]:
            data = _name(v["data.path"])
        elif v["data.train_files"]:
            files = v["data.train_files"]  # a path, or a list written as [a.parquet,b.parquet]
            first = files[0] if isinstance(files, (list, tuple)) else str(files).strip("[] ").split(",")[0]
            data = _name(first.strip().strip("'\""))
        elif v["data.dataset"] == "embedded":
            data = f"embedded-{v['data.embedded.task']}"
        else:
            data = v["data.dataset"]
        return f"{model}-{data}" + ("-async" if v["trainer.mode"] == "async" else "")


def given_keys(parsed: Sequence[tuple]) -> set:
    """The rljax keys a command line's parsed overrides set."""
    return {key for key, *_ in parsed}
