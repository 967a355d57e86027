"""``python -m rljax.export RUN_DIR [--step K] --to hf|peft|merged OUT``: a run's checkpoint as
a Hugging Face model directory or a PEFT adapter.

* ``--to hf``: a transformers directory (``config.json``, safetensors weights, the run's
  tokenizer files and ``generation_config.json`` when its checkpoint had one): the trained
  policy; for a LoRA run, its adapters merged into the base (``W + scale * A @ B``).
* ``--to merged``: the same directory for a LoRA run (verl's ``model_merger`` output);
  a full run has no adapters to merge.
* ``--to peft``: a LoRA run's adapters as a PEFT adapter directory whose
  ``base_model_name_or_path`` is the run's ``model.path`` made absolute (a preset's base, rebuilt
  from its seed, is exported beside the adapter to ``OUT/base`` and named instead).

The checkpoint (default the newest complete one) is verified as a resume verifies it (one
without a digest is refused unless ``--unverified``, as ``--resume-unverified`` for a resume), then
only the policy's parameters are read (not the optimizer state). A LoRA checkpoint holds
adapters only: the base it names is rebuilt (``model.path``, or the preset and seed) and
checked to be the same base before the adapters go on it. Every mistake (no run directory,
no checkpoint, a damaged one, a LoRA run's base missing or changed, a full run to ``peft``,
an output directory that is not empty) exits 2 with one line before anything is written.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from rljax.config import ConfigError, resolve
from rljax.tokenizer import tokenizer_for

PROG = "python -m rljax.export"
TARGETS = ("hf", "peft", "merged")
#: Files of a Hugging Face tokenizer copied next to the exported weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "chat_template.jinja", "tokenizer.model", "added_tokens.json")


class ExportError(Exception):
    """A usage error of the export command: one line, nothing written."""


def _run_config(meta: dict, step: int):
    """The :class:`~rljax.config.Config` checkpoint ``step`` was written with (its ``meta``)."""
    import yaml

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
        yaml.safe_dump(meta["config"], fh)
    try:
        return resolve(fh.name, validate=False)[0]
    except ConfigError as e:
        raise ExportError(f"checkpoint {step}'s configuration does not resolve in this rljax: {e}") from None
    finally:
        os.unlink(fh.name)


def _tokenizer_dir(model_cfg) -> str | None:
    spec = model_cfg.tokenizer
    if spec == "char" or (spec is None and not model_cfg.path):
        return None
    target = os.path.expanduser(spec or model_cfg.path)
    return target if os.path.isdir(target) else os.path.dirname(target)


def _restore_params(checkpointer, step: int, like):
    """Only ``state/actor/params`` of checkpoint ``step``, in ``like``'s structure, on one device."""
    import jax
    import orbax.checkpoint as ocp

    from rljax.trainer.checkpoint import nonfinite_leaves  # orbax: loaded with the checkpoint it restores

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {"actor": {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                                                 like)}}
    args = jax.tree.map(lambda _: ocp.ArrayRestoreArgs(sharding=sharding), abstract)
    try:
        out = ocp.PyTreeCheckpointer().restore(os.path.join(checkpointer.step_dir(step), "state"),
                                               args=ocp.args.PyTreeRestore(item=abstract, restore_args=args,
                                                                           partial_restore=True))
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for unreadable files
        raise ExportError(f"checkpoint {step} cannot be read as this run's policy "
                          f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    params = out["actor"]["params"]
    bad = nonfinite_leaves(params)
    if bad:
        raise ExportError(f"checkpoint {step} holds non-finite values in {', '.join(bad[:3])}")
    return params


def load_run_policy(run_dir: str, step: int | None = None, *, unverified: bool = False, echo=print):
    """``(config, model_config, params, step)`` of a run's checkpoint: ``params`` is the plain
    dict of a full run or :class:`~rljax.models.lora.LoRAParams` (the rebuilt base, the restored
    adapters) of a LoRA run. A checkpoint without a digest is refused unless ``unverified``.
    Raises :class:`ExportError` (one line) for every unusable input."""
    import jax

    # JAX, flax, orbax: loaded only to export, so a usage error answers without them
    from rljax.models.lora import LoRAParams, check_base
    from rljax.sharding import make_mesh
    from rljax.trainer.checkpoint import Checkpointer, CheckpointError
    from rljax.trainer.build import policy_params

    if not os.path.isdir(run_dir):
        raise ExportError(f"run directory {run_dir} does not exist")
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(ckpt_dir):
        raise ExportError(f"{run_dir} has no checkpoints/ directory (is it a run directory? a run saves at its end "
                          "and every trainer.save_freq steps)")
    checkpointer = Checkpointer(ckpt_dir, async_save=False, echo=echo, primary=False)
    try:
        try:
            chosen = checkpointer.select(step)
        except CheckpointError as e:
            raise ExportError(str(e).replace("trainer.resume_from", "--step")) from None
        if chosen is None:
            raise ExportError(f"{ckpt_dir} holds no complete checkpoint")
        status, reason = checkpointer.verify(chosen)
        if status == "damaged":
            raise ExportError(f"checkpoint {chosen} is damaged ({reason}); newest intact: "
                              f"{checkpointer.newest_intact(chosen)}; choose one with --step")
        if status == "unverified":
            if not unverified:
                raise ExportError(f"checkpoint {chosen} {reason}, so its bytes cannot be checked; newest verified: "
                                  f"{checkpointer.newest_intact(chosen)}; choose one with --step, or pass "
                                  "--unverified to export it anyway (its values still checked to be finite)")
            echo(f"checkpoint {chosen} {reason}; exporting it unverified (--unverified; its values are still "
                 "checked to be finite)")
        try:
            meta = checkpointer.read_meta(chosen)
        except Exception as e:  # noqa: BLE001
            raise ExportError(f"checkpoint {chosen} has no readable meta ({type(e).__name__})") from None
        cfg = _run_config(meta, chosen)
        saved_lora = meta.get("lora")
        if saved_lora is not None and cfg.model.path and not os.path.isdir(os.path.expanduser(cfg.model.path)):
            raise ExportError(f"checkpoint {chosen} holds LoRA adapters of base model.path={cfg.model.path!r}, "
                              "which does not exist here; put the base checkpoint back at that path")
        mesh = make_mesh("dp1", devices=jax.devices()[:1])
        try:
            mcfg, _, params, base_sig = policy_params(cfg, mesh, tokenizer_for(cfg.model))
        except (OSError, ValueError) as e:
            raise ExportError(f"rebuilding the run's model failed: {' '.join(str(e).split())[:300]}") from None
        if saved_lora is None:
            like = params.base if isinstance(params, LoRAParams) else params
            return cfg, mcfg, _restore_params(checkpointer, chosen, like), chosen
        try:
            check_base(saved_lora["base"], base_sig)
        except ValueError as e:
            raise ExportError(f"checkpoint {chosen}: {e}") from None
        adapters = _restore_params(checkpointer, chosen, params.adapters)
        return cfg, mcfg, params.replace(adapters=adapters), chosen
    finally:
        checkpointer.close()


def export(run_dir: str, out: str, *, to: str, step: int | None = None, unverified: bool = False,
           echo=print) -> int:
    """Writes checkpoint ``step`` (default the newest) of ``run_dir`` to ``out`` as ``to``
    (``hf`` | ``peft`` | ``merged``); returns the step exported."""
    # JAX, flax: loaded only to export, so a usage error answers without them
    from rljax.models.hf import save_hf_checkpoint
    from rljax.models.lora import LoRAParams, merge
    from rljax.models.peft import save_peft_adapter

    if to not in TARGETS:
        raise ExportError(f"--to {to} is not accepted; accepted: {', '.join(TARGETS)}")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ExportError(f"{out} exists and is not an empty directory; choose a new output directory")
    cfg, mcfg, params, chosen = load_run_policy(run_dir, step, unverified=unverified, echo=echo)
    lora = isinstance(params, LoRAParams)
    if to == "peft" and not lora:
        raise ExportError(f"checkpoint {chosen} holds every parameter (actor.lora.rank=0), not LoRA adapters; "
                          "use --to hf")
    if to == "merged" and not lora:
        raise ExportError(f"checkpoint {chosen} has no LoRA adapters to merge (actor.lora.rank=0); use --to hf")
    tmp = out.rstrip("/") + ".rljax-export-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        if to == "peft":
            save_peft_adapter(tmp, params, base_model_name_or_path=_peft_base(cfg, mcfg, params, tmp, out, echo))
        else:
            save_hf_checkpoint(tmp, mcfg, merge(params) if lora else params)
            _copy_tokenizer(cfg.model, tmp, echo)
        if os.path.isdir(out):
            os.rmdir(out)
        os.replace(tmp, out)  # the output appears complete or not at all
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    what = {"hf": "Hugging Face model", "merged": "Hugging Face model (LoRA merged)", "peft": "PEFT adapter"}[to]
    echo(f"exported checkpoint {chosen} of {run_dir} as a {what} to {out}")
    return chosen


def _peft_base(cfg, mcfg, params, tmp: str, out: str, echo) -> str:
    """``base_model_name_or_path`` of a PEFT export: ``model.path`` made absolute (a relative one is
    relative to where the run and this export start; written as typed, a load elsewhere went to the
    Hub); for a preset, the rebuilt base itself, exported to ``OUT/base`` (nothing else holds it)."""
    from rljax.models.hf import save_hf_checkpoint  # JAX: loaded only to export

    if cfg.model.path:
        return os.path.abspath(os.path.expanduser(cfg.model.path))
    save_hf_checkpoint(os.path.join(tmp, "base"), mcfg, params.base)
    _copy_tokenizer(cfg.model, os.path.join(tmp, "base"), echo)
    echo(f"base: the run's base is the preset model.name={cfg.model.name} (seed {cfg.trainer.seed}), exported to "
         f"{os.path.join(out, 'base')}, which the adapter names")
    return os.path.abspath(os.path.join(out, "base"))


def _copy_tokenizer(model_cfg, out: str, echo) -> None:
    src = _tokenizer_dir(model_cfg)
    if src is None:
        echo("tokenizer: the run used rljax's character tokenizer, which has no Hugging Face files; "
             "the directory holds the weights and config.json only")
        return
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(out, name))
    if model_cfg.path and os.path.isfile(os.path.join(os.path.expanduser(model_cfg.path), "generation_config.json")):
        shutil.copy2(os.path.join(os.path.expanduser(model_cfg.path), "generation_config.json"),
                     os.path.join(out, "generation_config.json"))


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv=None) -> int:
    p = _Parser(prog=PROG, description="Export a run's checkpoint as a Hugging Face model or a PEFT adapter.")
    p.add_argument("run_dir", help="the run directory (holds checkpoints/)")
    p.add_argument("out", help="the output directory (new or empty)")
    p.add_argument("--to", required=True, choices=TARGETS,
                   help="hf: transformers directory (LoRA merged); peft: a LoRA run's adapter; merged: LoRA merged")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest complete one)")
    p.add_argument("--unverified", action="store_true",
                   help="export a checkpoint without a digest (refused otherwise; as a resume's --resume-unverified)")
    args = p.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        export(args.run_dir, args.out, to=args.to, step=args.step, unverified=args.unverified)
    except ExportError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
