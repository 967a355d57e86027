"""The configuration reference, generated from the schema (``docs/reference/config.md``).

Every key of :class:`rljax.config.Config` with its type, default, bounds, help text and,
where verl spells it differently, verl's key. Regenerate after changing the schema::

    python -m rljax.config.reference > docs/reference/config.md

``tests/config/test_config_reference.py`` fails when the committed page differs from what this
module prints. Pure Python: importing it does not import JAX.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing

from rljax.config._resolve import field_specs
from rljax.config._verl import VERL_NAMES
from rljax.config._schema import Config

#: The command that regenerates the committed page (quoted by the test's failure message).
COMMAND = "python -m rljax.config.reference > docs/reference/config.md"
PAGE = "docs/reference/config.md"

def _type_text(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_text(a) for a in inner) + " or `null`"
    if origin is tuple:
        args = typing.get_args(tp)
        if args and args[-1] is Ellipsis:
            return f"list of ({_type_text(args[0])})"
        return "list of " + ", ".join(_type_text(a) for a in args)
    return {int: "int", float: "float", bool: "bool", str: "str"}.get(tp, getattr(tp, "__name__", str(tp)))


def _value_text(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, tuple):
        return "[" + ", ".join(_value_text(x) for x in v) + "]"
    if isinstance(v, str):
        return repr(v) if v == "" or v.strip() != v else v
    return repr(v)


def _bounds_text(bounds) -> str:
    gt, ge, lt, le = bounds
    parts = [f"{op} {_value_text(b)}" for op, b in (("> ", gt), ("≥ ", ge), ("< ", lt), ("≤ ", le)) if b is not None]
    return ", ".join(p.replace("  ", " ") for p in parts)


def _cell(text: str) -> str:
    """Plain text made safe inside a Markdown table cell (no HTML, no emphasis, no cell breaks)."""
    for a, b in (("\\", "\\\\"), ("|", "\\|"), ("<", "&lt;"), (">", "&gt;"), ("*", "\\*"), ("_", "\\_"),
                 ("`", "\\`"), ("[", "\\["), ("]", "\\]")):
        text = text.replace(a, b)
    return " ".join(text.split())


def _off_text(default) -> str:
    """How the default of a section's switch reads in the sentence 'Off while ... is ...'."""
    return "null" if default is None else "false" if default is False else _value_text(default)


def _code(text: str) -> str:
    return "`" + text.replace("|", "\\|") + "`"


def _sections() -> list[tuple[str, str, tuple | None, str | None]]:
    """(dotted section, its doc, its switch ``(full key, what[, value])`` or None, the section
    whose switch it is: itself or, for a section nested in a switched one, that one) in schema
    order, nested sections after their parent's leaves."""
    out = []

    def walk(cls, prefix, inherited):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                switch, owner = inherited
                if "switch" in f.metadata:
                    key, *rest = f.metadata["switch"]
                    switch, owner = (key if "." in key else f"{prefix}{f.name}.{key}", *rest), prefix + f.name
                out.append((prefix + f.name, f.metadata.get("doc", ""), switch, owner))
                walk(tp, prefix + f.name + ".", (switch, owner))

    walk(Config, "", (None, None))
    return out


def render() -> str:
    """The whole Markdown page."""
    specs = field_specs()
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from rljax/config/_schema.py; do not edit by hand. Regenerate with:",
        f"     {COMMAND} -->",
        "",
        "Every key the launcher accepts, in schema order: `key=value` on the command line,",
        "or nested YAML in a preset (`--config NAME|FILE`). Defaults are the code's; a preset",
        "(`configs/default.yaml` for the default run) overrides some of them, and",
        "`python -m rljax.launch --print-config [--config NAME] [key=value ...]` shows every",
        "resolved value with its source. *verl* gives verl's key where it is spelled",
        "differently (rljax drops verl's `actor_rollout_ref.` prefix); an empty cell means the",
        "same name, or a key verl does not have. A verl name without a note is accepted as an",
        "alias (`actor_rollout_ref.rollout.n=5`, in a preset too; Hydra's `+key=value` as well), and",
        "`--print-config` shows it as the value's source; verl settings rljax has no key for (`rollout.name`,",
        "`fsdp_config.param_offload=False`, ...) are accepted where rljax does what they ask",
        "(`rljax/config/_verl.py` lists them), and refused in one line where it cannot.",
        "",
        "Batch units: `data.train_batch_size` and `actor.ppo_mini_batch_size` count prompts (as",
        "in verl); `actor.ppo_micro_batch_size` counts trajectories over all devices.",
        "",
    ]
    for section, doc, switch, owner in _sections():
        keys = [s for k, s in specs.items() if k.rsplit(".", 1)[0] == section]
        if not keys:
            continue
        lines += [f"## `{section}`", "", _cell(doc[:1].upper() + doc[1:]) + ".", ""]
        if switch is not None:
            key, what, *on = switch
            when = (f"Off unless `{key}` is {_code(_value_text(on[0]))}; while off," if on
                    else f"Off while `{key}` is {_off_text(specs[key].default)}: then")
            which = ("any other key of this section" if owner == section
                     else f"any key of this section (part of `{owner}`)")
            use = f"`{key}={_value_text(on[0])}`" if on else f"`{key}`"
            lines += [f"{when} setting {which} is a usage error (nothing would read it; set "
                      f"{use} to use {what}).", ""]
        lines += ["| key | type | default | bounds | verl | description |", "|---|---|---|---|---|---|"]
        for s in keys:
            verl = VERL_NAMES.get(s.key, "")
            if verl:
                name, _, note = verl.partition(" ")
                verl = _code(name) + (" " + _cell(note) if note else "")
            lines.append(f"| {_code(s.key)} | {_type_text(s.type)} | {_code(_value_text(s.default))} | "
                         f"{_bounds_text(s.bounds)} | {verl} | {_cell(s.doc)} |")
        lines.append("")
    return "\n".join(lines)


def write_page(render, command: str, argv: list[str] | None = None) -> int:
    """A generated page's command line: ``render()`` to stdout; arguments are a usage error
    (exit 2). Used by this page and the stage-flow page (:mod:`rljax.trainer.stages.page`)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        print(f"usage: {command}  (takes no arguments; got {' '.join(argv)})", file=sys.stderr)
        return 2
    sys.stdout.write(render())
    return 0


def main(argv: list[str] | None = None) -> int:
    return write_page(render, COMMAND, argv)


if __name__ == "__main__":
    raise SystemExit(main())
