"""Shape and memory ledgers of a run, written once after the first step.

``shape_ledger.json`` / ``.md``: one row per tensor of the step (prompt, response, full
sequence, attention / response / loss masks, rollout / old / ref / new log-prob, entropy,
rewards, advantages, returns, loss matrix, hidden states, KV cache) with ``stage, tensor,
logical shape, local shard shape, mask / broadcast, owner devices, lifetime (produced at /
consumed at / freed after), common bug``, and a ``note`` where a per-trajectory device
array is not split over ``dp`` (every device holds all rows). Shapes come from the run's own arrays; tensors
that live only inside a jitted function (new log-prob, loss matrix, hidden states) and the
sampler's KV cache come from ``jax.eval_shape`` of the same functions with the run's
configuration, and their local shard shapes from the run's sharding rules.

``memory_ledger.json`` / ``.md``: parameters, gradients, optimizer state, activations, KV
cache and buffers, each with the estimate of ``rl-data-flow`` (section 7.2) beside what
was measured (the arrays' bytes, ``compiled.memory_analysis()`` of the train step, the
log-prob function and the sampler's decode chunk, ``device.memory_stats()`` where the
backend reports it), and the peak stage.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping, Optional

import numpy as np

from rljax.sharding import batch_spec, logical_sharding

SHAPE_COLUMNS = ("stage", "tensor", "logical_shape", "local_shape", "mask_broadcast", "owner_devices", "produced_at",
                 "consumed_at", "freed_after", "common_bug")


@dataclasses.dataclass
class LedgerInput:
    """What the ledgers are written from: the step's fields as the stages produced them, who
    produced and consumed each (observed by the runner), and the sources the trainer names
    explicitly for compiling and measuring (``None``: shape ledger only)."""

    run_dir: str
    step: int
    mesh: Any
    traj: Any
    fields: Mapping[str, Any]
    producers: Mapping[str, str]
    consumers: Mapping[str, list]
    sources: Optional[Mapping[str, Any]] = None


def _mib(b: Optional[float]) -> Optional[float]:
    return None if b is None else round(b / 2**20, 3)


def _tree_bytes(tree, device=None) -> int:
    """Global bytes of a pytree of arrays, or the bytes held on ``device``."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(tree):
        if device is None:
            total += int(np.prod(leaf.shape)) * leaf.dtype.itemsize
        else:
            total += sum(s.data.nbytes for s in getattr(leaf, "addressable_shards", []) if s.device == device)
    return total


def _local(shape, sharding) -> list:
    return [int(d) for d in sharding.shard_shape(tuple(shape))]


def _owners(sharding) -> str:
    spec = getattr(sharding, "spec", None)
    n = len(sharding.device_set)
    return f"{n} devices, spec {tuple(spec) if spec is not None else 'replicated'}"


def _row(stage, tensor, shape, local, mask, owners, produced, consumed, freed, bug) -> dict:
    return dict(zip(SHAPE_COLUMNS, (stage, tensor, [int(d) for d in shape], local, mask, owners, produced, consumed,
                                    freed, bug)))


def shape_ledger(inp: LedgerInput) -> list[dict]:
    """Rows from the step the tracer just observed; produced / consumed as the runner saw them."""
    import jax
    from jax.sharding import NamedSharding

    mesh, src, traj, batch = inp.mesh, inp.sources, inp.traj, inp.fields
    host_l = "host (NumPy)"

    def seen(name, produced, consumed):  # observed producer / consumers override the descriptions
        return inp.producers.get(name, produced), ", ".join(inp.consumers.get(name, [])) or consumed
    rows = []

    dp = int(dict(mesh.shape).get("dp", 1))

    def dev(stage, name, x, mask, produced, consumed, freed, bug):
        produced, consumed = seen(name.split(" ")[0] if name != "full_sequence (input_ids)" else "input_ids",
                                  produced, consumed)
        if not isinstance(x, jax.Array):
            rows.append(_row(stage, name, x.shape, host_l, mask, "host", produced, consumed, freed, bug))
            return
        row = _row(stage, name, x.shape, _local(x.shape, x.sharding), mask, _owners(x.sharding), produced,
                   consumed, freed, bug)
        if dp > 1 and x.ndim and x.shape[0] == traj.response_ids.shape[0] and row["local_shape"][0] == x.shape[0]:
            row["note"] = f"rows not split over dp: every device holds all {x.shape[0]} rows ({dp}x the memory)"
        rows.append(row)

    rows.append(_row("rollout_sessions", "prompt_ids", traj.prompt_ids.shape, host_l, "prompt_mask (left-padded)",
                     "host", "rollout_sessions", "trajectory_fields", "cleanup",
                     "left vs right padding mixed up: the prompt must end at column S so hidden S-1+t predicts token t"))
    rows.append(_row("rollout_sessions", "response_ids", traj.response_ids.shape, host_l,
                     "response_mask (right-padded)", "host", "rollout_sessions", "reward, trajectory_fields", "cleanup",
                     "response_len counts tool observations too: policy tokens are response_mask.sum()"))
    rows.append(_row("rollout_sessions", "response_mask", traj.response_mask.shape, host_l, "itself",
                     "host", "rollout_sessions", "trajectory_fields", "cleanup",
                     "observation tokens left at 1 train the policy on text it did not generate"))
    if "input_ids" in batch:
        dev("trajectory_fields", "full_sequence (input_ids)", batch["input_ids"], "attention_mask",
            "trajectory_fields", "old_log_prob, reference, actor_minibatch", "cleanup",
            "batch split (dp) confused with sequence split (sp): local shard shape must be [B/dp, (S+T)/sp]")
        dev("trajectory_fields", "attention_mask", batch["attention_mask"], "prompt_mask | response_mask",
            "trajectory_fields", "old_log_prob, actor_minibatch", "cleanup",
            "positions not recomputed from the mask: left padding shifts the rotary positions")
        dev("trajectory_fields", "positions", batch["positions"], "cumsum(attention_mask) - 1",
            "trajectory_fields", "old_log_prob, actor_minibatch", "cleanup", "positions counted from the padded start")
    for name, stage, produced, consumed, mask, bug in (
        ("loss_mask", "trajectory_fields", "trajectory_fields", "actor_minibatch, metrics", "itself",
         "padding rows left at 1 enter the token mean"),
        ("rollout_logp", "trajectory_fields", "rollout_sessions", "advantages (correction), actor_minibatch",
         "loss_mask", "sampler temperature not applied the same way as the learner's"),
        ("old_logp", "old_log_prob", "old_log_prob", "actor_minibatch (ratio)", "loss_mask",
         "recomputed after the update (ratio stuck at 1) or misaligned by one position"),
        ("entropy", "old_log_prob", "old_log_prob", "metrics", "loss_mask", "averaged over padding"),
        ("ref_logp", "reference", "reference", "actor_minibatch (kl_loss) / reward (kl_in_reward)", "loss_mask",
         "reference weights updated with the actor"),
        ("advantages", "advantages", "advantages", "actor_minibatch", "loss_mask (per-sequence value broadcast over T)",
         "group statistics over padding rows or across uids"),
    ):
        x = batch.get(name)
        if name == "old_logp":  # actor.skip_old_log_prob: produced inside the update (actor_minibatch)
            stage = inp.producers.get(name, stage)
        if x is not None:
            dev(stage, name, x, mask, produced, consumed, "cleanup" if name != "entropy" else "metrics", bug)
    sc = batch.get("scores")
    if sc is not None:
        dev("reward", "scores (rewards)", sc, "sequence-level [B]; broadcast to tokens by the advantage",
            "reward", "advantages", "advantages", "outcome reward placed on every token (counted T times)")
    if "values" in batch:
        for name, stage, bug in (("values", "values", "value of the token after the last one not zeroed"),
                                 ("returns", "advantages", "returns computed from whitened advantages")):
            dev(stage, name, batch[name], "loss_mask", stage, "update_critic", "update_critic", bug)
    elif "advantages" in batch:
        a = batch["advantages"]
        rows.append(_row("advantages", "returns", a.shape, _local(a.shape, a.sharding), "loss_mask",
                         _owners(a.sharding), "advantages (= advantages, not materialised)", "-", "-",
                         "value targets taken from unnormalised returns (only with a critic)"))

    # Tensors that live inside jitted functions: real shapes from eval_shape of the same model.
    if src is not None and "input_ids" in batch:
        from rljax.models import functional as F  # flax: the trace package (and its check CLI) loads no model code

        sc_cfg = src["step_config"]
        micro = sc_cfg.ppo_micro_batch_size
        ids = batch["input_ids"]
        T = batch["loss_mask"].shape[1]  # the learner's response length (rounded up to a multiple of sp)
        micro_ids = jax.ShapeDtypeStruct((micro, ids.shape[1]), ids.dtype)
        hidden = jax.eval_shape(lambda p, t: F.forward(src["graphdef"], p, t, mesh=None), src["params"], micro_ids)
        hs = logical_sharding(("batch", "length", "embed"), mesh, shape=hidden.shape)
        layers = src["model_config"].num_layers
        rows.append(_row("actor_minibatch", f"hidden_states (per layer, x{layers} saved)", hidden.shape,
                         _local(hidden.shape, hs), "attention_mask", _owners(hs), "actor_minibatch (forward)",
                         "actor_minibatch (backward)", "actor_minibatch (each micro-batch)",
                         "remat off: all layers' activations live at once (see memory ledger)"))
        new = (micro, T)
        ns = NamedSharding(mesh, batch_spec(new, mesh))
        rows.append(_row("actor_minibatch", "new_logp", new, _local(new, ns), "loss_mask", _owners(ns),
                         "actor_minibatch (micro-batch forward)", "actor_minibatch (loss)", "actor_minibatch",
                         "rows not permuted with old_logp / advantages when the mini-batch is shuffled"))
        rows.append(_row("actor_minibatch", "loss_matrix", new, _local(new, ns), "loss_mask (token-mean over the "
                         "mini-batch's tokens)", _owners(ns), "actor_minibatch", "actor_minibatch (aggregate)",
                         "actor_minibatch", "normalised per micro-batch instead of per mini-batch"))
        eng = src["sampler_engine"]
        k0 = eng.abstract_decode_state(src["decode"]).cache.k[0]  # the engine's own layout, per layer
        if eng.mesh is not None:
            local, owners = _local(k0.shape, k0.sharding), _owners(k0.sharding) + " (sampler mesh)"
        else:
            local, owners = list(k0.shape), "1 device"
        rows.append(_row("rollout_sessions", "kv_cache (k and v each, per layer)", k0.shape,
                         local, "per-slot cache index (prompt + generated)", owners, "rollout_sessions (prefill)",
                         "rollout_sessions (decode)", "rollout_sessions",
                         "slots on dp / kv heads on tp: a tp larger than kv_heads replicates the cache"))
    return rows


def _analysis(compiled) -> Optional[dict]:
    try:
        m = compiled.memory_analysis()
    except Exception:  # some backends do not implement it
        return None
    if m is None:
        return None
    d = {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "alias", "temp")}
    d["peak"] = d["argument"] + d["output"] - d["alias"] + d["temp"]
    return d


def memory_ledger(inp: LedgerInput) -> dict:
    """Estimates (rl-data-flow 7.2) beside measurements, per device, and the peak stage."""
    import jax

    src, mesh, batch = inp.sources, inp.mesh, inp.fields
    mc, sc = src["model_config"], src["step_config"]
    sizes = {k: int(v) for k, v in dict(mesh.shape).items()}
    dp, tp, sp = sizes.get("dp", 1), sizes.get("tp", 1), sizes.get("sp", 1)
    dev0 = jax.local_devices()[0]
    params = src["params"]
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    pbytes = jax.tree.leaves(params)[0].dtype.itemsize
    # LoRA (rljax.models.lora.LoRAParams): a frozen base plus adapters; only the adapters train
    adapters = getattr(params, "adapters", None)
    lora = None
    if adapters is not None:
        base = params.base
        n_base = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(base))
        n_train = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(adapters))
        bbytes, tbytes = jax.tree.leaves(base)[0].dtype.itemsize, jax.tree.leaves(adapters)[0].dtype.itemsize
        lora = dict(n_base=n_base, n_train=n_train, bbytes=bbytes, tbytes=tbytes, rank=params.config.rank)
    cbytes = np.dtype(mc.jnp_dtype).itemsize
    p_global, p_local = _tree_bytes(params), _tree_bytes(params, dev0)
    o_global, o_local = _tree_bytes(src["opt_state"]), _tree_bytes(src["opt_state"], dev0)

    import time

    measured: dict[str, Optional[dict]] = {}
    eng = src["sampler_engine"]
    # The arguments exactly as the stages passed them (same pytree, shapes and layouts), so
    # the lowering hits the compilation cache instead of compiling again.
    lowerings = {
        "update_actor": lambda: src["lower_update"](batch),
        "old_log_prob": lambda: src["lower_logprob"](batch),
        "gen": lambda: eng.lower_chunk(src["sampler_params"], src["decode"]),
    }
    if not {"old_log_prob", "reference"} & set(inp.producers.values()):
        # no stage ran the log-prob pass (actor.skip_old_log_prob, no reference): nothing to measure,
        # and lowering it would compile a program the run never uses
        del lowerings["old_log_prob"]
    for stage, lower in lowerings.items():
        t = time.perf_counter()
        try:
            measured[stage] = _analysis(lower().compile())
        except Exception as e:  # reported in the ledger, never raised
            measured[stage] = {"error": f"{type(e).__name__}: {e}"}
        if measured[stage] is not None:
            measured[stage]["analysis_s"] = round(time.perf_counter() - t, 3)

    micro = sc.ppo_micro_batch_size
    seq = batch["input_ids"].shape[1] if "input_ids" in batch else 0
    T = inp.traj.response_ids.shape[1]
    from rljax.models import remat as R  # flax: the trace package (and its check CLI) loads no model code

    rows_local, q_local = math.ceil(micro / dp), math.ceil(seq / sp)
    blocked = R.attention_blocked(mc, seq)
    attn = (f"blockwise attention ({seq} keys > attn_block_size {mc.attn_block_size}): 2 f32 softmax stats "
            f"x rows x heads_local x Tq" if blocked else
            f"dense attention ({seq} keys): [rows, heads_local, Tq, Tk] scores f32 + probabilities x {cbytes} B")
    per_layer = (f"{rows_local} x {q_local} tokens x {mc.hidden_size} x {cbytes} B x ({R.ACTIVATION_FACTOR_BASE} + "
                 f"{R.ACTIVATION_FACTOR_MLP} x {mc.intermediate_size}/{mc.hidden_size}) + {attn}")
    if mc.remat:  # full: the layer inputs; minimal (model.remat_policy): + the projections' outputs
        act_est = R.remat_bytes(mc, rows_local, seq, sp=sp, tp=tp, policy=mc.remat_policy)
        act_formula = (f"remat {mc.remat_policy}: what each of {mc.num_layers} layers keeps "
                       f"({'its input' if mc.remat_policy == 'full' else 'input + projections'}) + one layer "
                       f"recomputed: {per_layer}")
    else:
        act_est = R.activation_bytes(mc, rows_local, seq, sp=sp, tp=tp)
        act_formula = f"{mc.num_layers} layers x ({per_layer})"
    slots_local = math.ceil(eng.num_slots / max(eng.mesh.shape.get("dp", 1) if eng.mesh is not None else 1, 1))
    kv_heads_local = math.ceil(mc.num_kv_heads / (eng.mesh.shape.get("tp", 1) if eng.mesh is not None else 1))
    kv_est = mc.num_layers * slots_local * eng.max_len * kv_heads_local * mc.head_dim * 2 * cbytes
    vocab_local = math.ceil(mc.vocab_size / tp)
    buf_est = math.ceil(micro / dp) * math.ceil(T / sp) * vocab_local * 4

    upd = measured.get("update_actor") or {}
    gen = measured.get("gen") or {}
    lp = measured.get("old_log_prob") or {}
    rows = [
        {"item": "parameters", "formula": "n_params x bytes(param_dtype), / tp when sharded",
         "estimate_bytes": n_params * pbytes // tp, "measured_bytes": p_local,
         "measured_from": f"the arrays' shards on device {dev0.id} (global {p_global} B, {n_params} params)"},
        {"item": "gradients", "formula": "= parameters (accumulated in param dtype)",
         "estimate_bytes": n_params * pbytes // tp, "measured_bytes": None,
         "measured_from": "inside the train step's temp (below); not separable"},
        {"item": "optimizer state", "formula": "2 x parameters (AdamW mu, nu) + counters",
         "estimate_bytes": 2 * n_params * pbytes // tp, "measured_bytes": o_local,
         "measured_from": f"the arrays' shards on device {dev0.id} (global {o_global} B)"},
    ]
    if lora is not None:  # what trains is the adapters; the full run's figures beside them
        nb, nt, bb, tb = lora["n_base"], lora["n_train"], lora["bbytes"], lora["tbytes"]
        rows[0]["formula"] = (f"LoRA rank {lora['rank']}: frozen base {nb} x {bb} B + adapters {nt} x {tb} B, / tp "
                              f"(full fine-tuning: {nb} x {bb} B)")
        rows[0]["estimate_bytes"] = (nb * bb + nt * tb) // tp
        rows[1]["formula"] = f"LoRA: adapters only, {nt} x {tb} B (full fine-tuning: {nb * bb // tp} B)"
        rows[1]["estimate_bytes"] = nt * tb // tp
        rows[2]["formula"] = f"LoRA: 2 x adapters (AdamW mu, nu) + counters (full fine-tuning: {2 * nb * bb // tp} B)"
        rows[2]["estimate_bytes"] = 2 * nt * tb // tp
    rows += [
        {"item": "activations", "formula": act_formula,
         "estimate_bytes": int(act_est), "measured_bytes": upd.get("temp"),
         "measured_from": "train step compiled.memory_analysis() temp (activations + gradients + temporaries)"},
        {"item": "kv cache", "formula": f"layers x slots_local x seq x kv_heads_local x head_dim x 2 x bytes = "
                                        f"{mc.num_layers} x {slots_local} x {eng.max_len} x {kv_heads_local} x "
                                        f"{mc.head_dim} x 2 x {cbytes}",
         "estimate_bytes": int(kv_est), "measured_bytes": (gen.get("argument") - _tree_bytes(src["sampler_params"], dev0)
                                                            if gen.get("argument") is not None else None),
         "measured_from": "sampler decode chunk memory_analysis() arguments minus parameters (cache + slot state)"},
        {"item": "buffers", "formula": "naive logits micro_local x T x vocab_local x 4 (fused log-prob avoids most)",
         "estimate_bytes": int(buf_est), "measured_bytes": lp.get("temp"),
         "measured_from": "log-prob function memory_analysis() temp" if "old_log_prob" in measured
                          else "no log-prob pass in this run (old_logp from the update, no reference)"},
    ]
    stages = {k: v["peak"] for k, v in measured.items() if v and "peak" in v}
    peak_stage = max(stages, key=stages.get) if stages else None
    stats = None
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:
        stats = None
    estimate_total = sum(r["estimate_bytes"] for r in rows)
    return {"per_device": True, "device": str(dev0), "mesh": sizes, "rows": rows, "stages": measured,
            "peak_stage": peak_stage, "peak_bytes": stages.get(peak_stage) if peak_stage else None,
            "estimate_peak_bytes": estimate_total,
            "device_memory_stats": stats if stats else f"not reported by the {dev0.platform} backend"}


def _md_table(rows: list[dict], columns) -> str:
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    cell = lambda v: ("" if v is None else str(v)).replace("|", "\\|")  # noqa: E731
    body = "".join("| " + " | ".join(cell(r.get(c)) for c in columns) + " |\n" for r in rows)
    return head + body


def memory_md(led: dict) -> str:
    rows = [dict(r, estimate_MiB=_mib(r["estimate_bytes"]), measured_MiB=_mib(r["measured_bytes"])) for r in led["rows"]]
    out = "# Memory ledger (per device)\n\n" + _md_table(rows, ("item", "estimate_MiB", "measured_MiB", "formula",
                                                                "measured_from"))
    st = [{"stage": k, **({kk: _mib(vv) for kk, vv in v.items() if kk != "analysis_s"} if v and "error" not in v
                          else {"argument": f"not measured: {v}"})}
          for k, v in led["stages"].items()]
    out += "\n## compiled.memory_analysis() per stage (MiB)\n\n" + _md_table(
        st, ("stage", "argument", "output", "alias", "temp", "peak"))
    out += f"\npeak stage: {led['peak_stage']} ({_mib(led['peak_bytes'])} MiB); device memory stats: " \
           f"{led['device_memory_stats']}\n"
    return out


def write_ledgers(inp: LedgerInput) -> Optional[int]:
    """Writes both ledgers (JSON + Markdown) into the run directory; returns the peak bytes."""
    run_dir = inp.run_dir
    shapes = shape_ledger(inp)
    with open(os.path.join(run_dir, "shape_ledger.json"), "w") as fh:
        json.dump(shapes, fh, indent=1)
    with open(os.path.join(run_dir, "shape_ledger.md"), "w") as fh:
        fh.write("# Shape ledger (step %d)\n\n" % inp.step + _md_table(shapes, SHAPE_COLUMNS + ("note",)))
    if inp.sources is None:
        return None
    led = memory_ledger(inp)
    with open(os.path.join(run_dir, "memory_ledger.json"), "w") as fh:
        json.dump(led, fh, indent=1, default=str)
    with open(os.path.join(run_dir, "memory_ledger.md"), "w") as fh:
        fh.write(memory_md(led))
    return led.get("peak_bytes")
