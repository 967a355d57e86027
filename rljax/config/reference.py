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
from rljax.config._schema import Config

#: The command that regenerates the committed page (quoted by the test's failure message).
COMMAND = "python -m rljax.config.reference > docs/reference/config.md"
PAGE = "docs/reference/config.md"

#: verl's key for an rljax key whose name differs (rljax drops verl's ``actor_rollout_ref.``
#: prefix: ``actor.*``, ``rollout.*`` and ``model.*`` live under it in verl). Keys whose
#: verl spelling is the same (``data.*``, ``algorithm.*``, ``critic.*``, most of
#: ``trainer.*``) and rljax-only keys are not listed. A note after the name says where the
#: meaning differs.
VERL_NAMES: dict[str, str] = {
    "actor.ppo_mini_batch_size": "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor.ppo_micro_batch_size": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (per device there; global here)",
    "actor.ppo_epochs": "actor_rollout_ref.actor.ppo_epochs",
    "actor.shuffle": "actor_rollout_ref.actor.shuffle",
    "actor.use_kl_loss": "actor_rollout_ref.actor.use_kl_loss",
    "actor.kl_loss_coef": "actor_rollout_ref.actor.kl_loss_coef",
    "actor.kl_loss_type": "actor_rollout_ref.actor.kl_loss_type",
    "actor.clip_ratio_low": "actor_rollout_ref.actor.clip_ratio_low",
    "actor.clip_ratio_high": "actor_rollout_ref.actor.clip_ratio_high",
    "actor.clip_ratio_c": "actor_rollout_ref.actor.clip_ratio_c",
    "actor.loss_agg_mode": "actor_rollout_ref.actor.loss_agg_mode",
    "actor.policy_loss": "actor_rollout_ref.actor.policy_loss.loss_mode",
    "actor.entropy_coeff": "actor_rollout_ref.actor.entropy_coeff",
    "actor.grad_clip": "actor_rollout_ref.actor.grad_clip",
    "actor.use_remove_padding": "actor_rollout_ref.model.use_remove_padding",
    "actor.use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor.ppo_max_token_len_per_device": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "actor.log_prob_use_dynamic_bsz": "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
    "actor.log_prob_max_token_len_per_device": "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    "actor.optim.lr": "actor_rollout_ref.actor.optim.lr",
    "actor.optim.weight_decay": "actor_rollout_ref.actor.optim.weight_decay",
    "actor.optim.betas": "actor_rollout_ref.actor.optim.betas",
    "actor.optim.warmup_steps": "actor_rollout_ref.actor.optim.lr_warmup_steps",
    "actor.optim.lr_scheduler": "actor_rollout_ref.actor.optim.lr_scheduler_type",
    "actor.optim.min_lr_ratio": "actor_rollout_ref.actor.optim.min_lr_ratio",
    "actor.lora.rank": "actor_rollout_ref.model.lora_rank",
    "actor.lora.alpha": "actor_rollout_ref.model.lora_alpha",
    "actor.lora.target_modules": "actor_rollout_ref.model.target_modules",
    "critic.cliprange_value": "critic.cliprange_value",
    "rollout.n": "actor_rollout_ref.rollout.n",
    "rollout.temperature": "actor_rollout_ref.rollout.temperature",
    "rollout.top_p": "actor_rollout_ref.rollout.top_p",
    "rollout.top_k": "actor_rollout_ref.rollout.top_k",
    "rollout.tp": "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "rollout.max_slots": "actor_rollout_ref.rollout.max_num_seqs",
    "rollout.val_kwargs.n": "actor_rollout_ref.rollout.val_kwargs.n",
    "rollout.val_kwargs.temperature": "actor_rollout_ref.rollout.val_kwargs.temperature",
    "rollout.val_kwargs.top_p": "actor_rollout_ref.rollout.val_kwargs.top_p",
    "rollout.val_kwargs.top_k": "actor_rollout_ref.rollout.val_kwargs.top_k",
    "reward.function": "custom_reward_function.path + custom_reward_function.name (one 'path:name' here)",
    "reward.model.path": "reward.reward_model.model_path (with reward.reward_model.enable=true; older verl: "
                         "reward_model.model.path with reward_model.enable=true; here the path alone turns it on)",
    "env.max_turns": "actor_rollout_ref.rollout.multi_turn.max_assistant_turns",
    "model.path": "actor_rollout_ref.model.path",
    "model.remat": "actor_rollout_ref.model.enable_gradient_checkpointing",
    "trainer.total_steps": "trainer.total_training_steps",
    "trainer.max_checkpoints": "trainer.max_actor_ckpt_to_keep",
    "trainer.resume_from": "trainer.resume_from_path (a step number here, a path there)",
    "trainer.output_dir": "trainer.default_local_dir",
    "async_training.max_staleness": "async_training.staleness_threshold (a fraction of samples there, weight versions here)",
}


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
        "same name, or a key verl does not have.",
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        print(f"usage: {COMMAND}  (takes no arguments; got {' '.join(argv)})", file=sys.stderr)
        return 2
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
