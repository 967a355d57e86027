"""Shape and memory ledgers of a run, written once after the first step.

``shape_ledger.json`` / ``.md``: one row per tensor of the step (prompt, response, full
sequence, attention / response / loss masks, rollout / old / ref / new log-prob, entropy,
rewards, advantages, returns, loss matrix, hidden states, KV cache) with ``stage, tensor,
logical shape, local shard shape, mask / broadcast, owner devices, lifetime (produced at /
consumed at / freed after), common bug``, and a ``note`` where a per-trajectory device
array is not split over ``dp`` (every device holds all rows). Shapes come from the run's own arrays; tensors
that live only inside a jitted function (new log-prob, loss matrix, hidden states) and the
sampler's KV cache come from ``jax.eval_shape`` of the same functions with the run's
configuration, and their local shard shapes from the run's sharding rules. A packed actor pass
(``actor.use_remove_padding``) adds a ``packed rows (<layout>)`` row with the tokens it laid and,
in the shared-prefix layout (``actor.shared_prefix``), the tokens laying each prompt once saved.

``memory_ledger.json`` / ``.md``: parameters, gradients, optimizer state, activations, KV
cache and buffers, each with the estimate of ``rl-data-flow`` (section 7.2) beside what
was measured (the arrays' bytes, ``compiled.memory_analysis()`` of the train step, the
log-prob function and the sampler's decode chunk, ``device.memory_stats()`` where the
backend reports it), the peak stage, and the packed actor passes' tokens (``learner_layout``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping, Optional

import numpy as np

from rljax.sharding import batch_spec, data_shards, logical_sharding
from rljax.trace.batch_fields import BATCH_FIELDS

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
    """Rows from the step the tracer just observed: the batch fields of the one table
    (:data:`rljax.trace.batch_fields.BATCH_FIELDS`, produced / consumed as the runner saw them),
    then the tensors that live only inside the update and the sampler (with ``sources``)."""
    rows = [row for f in BATCH_FIELDS if f.ledger is not None for row in _field_rows(inp, f)]
    if inp.sources is not None and "input_ids" in inp.fields:
        rows += _update_rows(inp) + _layout_rows(inp) + [_kv_cache_row(inp.sources)]
    return rows


_HOST = "host (NumPy)"


def _field_rows(inp: LedgerInput, f) -> list[dict]:
    """``f``'s row: the sampler's host array, or the batch's (absent from the batch: none). Without a
    critic, ``returns`` are the advantages themselves (one row saying so)."""
    led, batch = f.ledger, inp.fields
    label = led.label or f.name
    if led.sampler:
        x = getattr(inp.traj, f.trajectory)
        return [_row(led.stage, label, x.shape, _HOST, led.mask, "host", led.produced, led.consumed, led.freed, led.bug)]
    if led.critic and "values" not in batch:
        if f.name != "returns" or "advantages" not in batch:
            return []
        a = batch["advantages"]
        return [_row("advantages", "returns", a.shape, _local(a.shape, a.sharding), "loss_mask", _owners(a.sharding),
                     "advantages (= advantages, not materialised)", "-", "-",
                     "value targets taken from unnormalised returns (only with a critic)")]
    x = batch.get(f.name)
    if x is None:
        return []
    stage = inp.producers.get(f.name, led.stage) if led.stage_from_producer else led.stage
    produced = inp.producers.get(f.name, led.produced)  # observed producer / consumers override the descriptions
    consumed = ", ".join(inp.consumers.get(f.name, [])) or led.consumed
    return [_device_row(inp, stage, label, x, led.mask, produced, consumed, led.freed, led.bug)]


def _device_row(inp: LedgerInput, stage, label, x, mask, produced, consumed, freed, bug) -> dict:
    """A batch array's row: its local shard shape and owners (a host array's: the host), and a note
    when a per-trajectory device array is not split over ``dp``."""
    import jax

    if not isinstance(x, jax.Array):
        return _row(stage, label, x.shape, _HOST, mask, "host", produced, consumed, freed, bug)
    row = _row(stage, label, x.shape, _local(x.shape, x.sharding), mask, _owners(x.sharding), produced, consumed,
               freed, bug)
    dp = data_shards(inp.mesh)  # the batch's shards: dp x fsdp
    if dp > 1 and x.ndim and x.shape[0] == inp.traj.response_ids.shape[0] and row["local_shape"][0] == x.shape[0]:
        row["note"] = f"rows not split over dp: every device holds all {x.shape[0]} rows ({dp}x the memory)"
    return row


def _update_rows(inp: LedgerInput) -> list[dict]:
    """Tensors that live inside the jitted update: real shapes from ``jax.eval_shape`` of the same
    model on one micro-batch, local shapes from the run's sharding rules."""
    import jax
    from jax.sharding import NamedSharding

    from rljax.models import functional as F  # flax: the trace package (and its check CLI) loads no model code

    mesh, src, batch = inp.mesh, inp.sources, inp.fields
    micro = src["step_config"].ppo_micro_batch_size
    ids = batch["input_ids"]
    T = batch["loss_mask"].shape[1]  # the learner's response length (rounded up to a multiple of sp)
    micro_ids = jax.ShapeDtypeStruct((micro, ids.shape[1]), ids.dtype)
    hidden = jax.eval_shape(lambda p, t: F.forward(src["graphdef"], p, t, mesh=None), src["params"], micro_ids)
    hs = logical_sharding(("batch", "length", "embed"), mesh, shape=hidden.shape)
    layers = src["model_config"].num_layers
    new = (micro, T)
    ns = NamedSharding(mesh, batch_spec(new, mesh))
    return [
        _row("actor_minibatch", f"hidden_states (per layer, x{layers} saved)", hidden.shape, _local(hidden.shape, hs),
             "attention_mask", _owners(hs), "actor_minibatch (forward)", "actor_minibatch (backward)",
             "actor_minibatch (each micro-batch)", "remat off: all layers' activations live at once (see memory ledger)"),
        _row("actor_minibatch", "new_logp", new, _local(new, ns), "loss_mask", _owners(ns),
             "actor_minibatch (micro-batch forward)", "actor_minibatch (loss)", "actor_minibatch",
             "rows not permuted with old_logp / advantages when the mini-batch is shuffled"),
        _row("actor_minibatch", "loss_matrix", new, _local(new, ns), "loss_mask (token-mean over the "
             "mini-batch's tokens)", _owners(ns), "actor_minibatch", "actor_minibatch (aggregate)",
             "actor_minibatch", "normalised per micro-batch instead of per mini-batch"),
    ]


def _layouts(src: Mapping[str, Any]) -> dict:
    """``{stage: layout}`` of the actor's learner passes on the ledger's step
    (:func:`rljax.trainer.prefix.learner_layout`), passes that ran packed only."""
    fn = src.get("learner_layout")
    return {k: v for k, v in (fn() if fn else {}).items() if v.get("layout") in ("packed", "shared_prefix")}


def _layout_rows(inp: LedgerInput) -> list[dict]:
    """The packed learner rows of the update and the log-prob pass (``actor.use_remove_padding``):
    ``[mini-batches, micro-batches, rows, row length]``, rows on the batch axes and length on
    ``sp``, and the tokens laid beside the unshared layout's (``actor.shared_prefix``)."""
    sizes = {k: int(v) for k, v in dict(inp.mesh.shape).items()}
    dp, sp = data_shards(sizes), sizes.get("sp", 1)
    out = []
    for stage, lay in _layouts(inp.sources).items():
        m, u, r, el = lay["rows"]
        note = (f"{lay['layout']} layout: {lay['laid_tokens']} tokens laid of the unshared layout's "
                f"{lay['real_tokens']}, {lay['shared_saved_tokens']} saved ({lay['shared_saved_frac']:.1%}: each "
                "group's prompt laid once)" if lay["layout"] == "shared_prefix" else
                f"packed layout (actor.shared_prefix did not share): {lay['laid_tokens']} tokens laid, none saved")
        row = _row(stage, f"packed rows ({lay['layout']})", (m, u, r, el), [m, u, math.ceil(r / dp), math.ceil(el / sp)],
                   "segment_ids (group / branch: a response sees its prompt and itself)" if lay["layout"] ==
                   "shared_prefix" else "segment_ids", f"{dp * sp} devices, rows on dp, length on sp",
                   f"{stage} (packing plan on the host, tokens taken on the devices)", stage, stage,
                   "a response attending to another response of its group (segment id branches)")
        out.append(dict(row, note=note, laid_tokens=lay["laid_tokens"], real_tokens=lay["real_tokens"],
                        shared_saved_tokens=lay["shared_saved_tokens"]))
    return out


def _kv_cache_row(src: Mapping[str, Any]) -> dict:
    """The sampler's KV cache, from the engine's own abstract decode state (one layer's ``k``)."""
    eng = src["sampler_engine"]
    k0 = eng.abstract_decode_state(src["decode"]).cache.k[0]  # the engine's own layout, per layer
    if eng.mesh is not None:
        local, owners = _local(k0.shape, k0.sharding), _owners(k0.sharding) + " (sampler mesh)"
    else:
        local, owners = list(k0.shape), "1 device"
    return _row("rollout_sessions", "kv_cache (k and v each, per layer)", k0.shape,
                local, "per-slot cache index (prompt + generated)", owners, "rollout_sessions (prefill)",
                "rollout_sessions (decode)", "rollout_sessions",
                "slots on dp / kv heads on tp: a tp larger than kv_heads replicates the cache")


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

    src, mesh = inp.sources, inp.mesh
    sizes = {k: int(v) for k, v in dict(mesh.shape).items()}
    dev0 = jax.local_devices()[0]
    measured = _measured(inp)
    fsdp = sizes.get("fsdp", 1)  # the state splits over tp x fsdp
    rows = (_state_rows(src, dev0, sizes.get("tp", 1) * fsdp, by="tp" if fsdp == 1 else "(tp x fsdp)")
            + _work_rows(inp, sizes, measured, dev0))
    stages = {k: v["peak"] for k, v in measured.items() if v and "peak" in v}
    peak_stage = max(stages, key=stages.get) if stages else None
    stats = None
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:
        stats = None
    estimate_total = sum(r["estimate_bytes"] for r in rows)
    return {"per_device": True, "device": str(dev0), "mesh": sizes, "rows": rows, "stages": measured,
            "learner_layout": _layouts(src),
            "peak_stage": peak_stage, "peak_bytes": stages.get(peak_stage) if peak_stage else None,
            "estimate_peak_bytes": estimate_total,
            "device_memory_stats": stats if stats else f"not reported by the {dev0.platform} backend"}


def _measured(inp: LedgerInput) -> dict[str, Optional[dict]]:
    """``compiled.memory_analysis()`` of the update, the log-prob pass (when a stage ran it) and the
    sampler's decode chunk, lowered with the arguments exactly as the stages passed them (same
    pytree, shapes and layouts), so the lowering hits the compilation cache instead of compiling
    again; an error is reported in the ledger, never raised."""
    import time

    src, batch = inp.sources, inp.fields
    eng = src["sampler_engine"]
    lowerings = {
        "update_actor": lambda: src["lower_update"](batch),
        "old_log_prob": lambda: src["lower_logprob"](batch),
        "gen": lambda: eng.lower_chunk(src["sampler_params"], src["decode"]),
    }
    if not {"old_log_prob", "reference"} & set(inp.producers.values()):
        # no stage ran the log-prob pass (actor.skip_old_log_prob, no reference): nothing to measure,
        # and lowering it would compile a program the run never uses
        del lowerings["old_log_prob"]
    measured: dict[str, Optional[dict]] = {}
    for stage, lower in lowerings.items():
        t = time.perf_counter()
        try:
            measured[stage] = _analysis(lower().compile())
        except Exception as e:  # reported in the ledger, never raised
            measured[stage] = {"error": f"{type(e).__name__}: {e}"}
        if measured[stage] is not None:
            measured[stage]["analysis_s"] = round(time.perf_counter() - t, 3)
    return measured


def _count(tree) -> int:
    import jax

    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def _state_rows(src: Mapping[str, Any], dev0, tp: int, by: str = "tp") -> list[dict]:
    """Parameters, gradients and optimizer state: estimates from the parameter count (a LoRA
    actor's: its frozen base and trained adapters), measured from the arrays' shards. ``tp``: the
    state's shards (tp x fsdp), named ``by``."""
    import jax

    params = src["params"]
    n_params = _count(params)
    pbytes = jax.tree.leaves(params)[0].dtype.itemsize
    p_global, p_local = _tree_bytes(params), _tree_bytes(params, dev0)
    o_global, o_local = _tree_bytes(src["opt_state"]), _tree_bytes(src["opt_state"], dev0)
    rows = [
        {"item": "parameters", "formula": f"n_params x bytes(param_dtype), / {by} when sharded",
         "estimate_bytes": n_params * pbytes // tp, "measured_bytes": p_local,
         "measured_from": f"the arrays' shards on device {dev0.id} (global {p_global} B, {n_params} params)"},
        {"item": "gradients", "formula": "= parameters (accumulated in param dtype)",
         "estimate_bytes": n_params * pbytes // tp, "measured_bytes": None,
         "measured_from": "inside the train step's temp (below); not separable"},
        {"item": "optimizer state", "formula": "2 x parameters (AdamW mu, nu) + counters",
         "estimate_bytes": 2 * n_params * pbytes // tp, "measured_bytes": o_local,
         "measured_from": f"the arrays' shards on device {dev0.id} (global {o_global} B)"},
    ]
    adapters = getattr(params, "adapters", None)  # LoRA (rljax.models.lora.LoRAParams): only the adapters train
    if adapters is not None:  # what trains is the adapters; the full run's figures beside them
        nb, nt = _count(params.base), _count(adapters)
        bb, tb = jax.tree.leaves(params.base)[0].dtype.itemsize, jax.tree.leaves(adapters)[0].dtype.itemsize
        rows[0]["formula"] = (f"LoRA rank {params.config.rank}: frozen base {nb} x {bb} B + adapters {nt} x {tb} B, "
                              f"/ {by} (full fine-tuning: {nb} x {bb} B)")
        rows[0]["estimate_bytes"] = (nb * bb + nt * tb) // tp
        rows[1]["formula"] = f"LoRA: adapters only, {nt} x {tb} B (full fine-tuning: {nb * bb // tp} B)"
        rows[1]["estimate_bytes"] = nt * tb // tp
        rows[2]["formula"] = f"LoRA: 2 x adapters (AdamW mu, nu) + counters (full fine-tuning: {2 * nb * bb // tp} B)"
        rows[2]["estimate_bytes"] = 2 * nt * tb // tp
    return rows


def _activations(mc, micro: int, seq: int, sizes: Mapping[str, int]) -> tuple[int, str]:
    """The update's activations per device (:mod:`rljax.models.remat`'s estimate) and its formula."""
    from rljax.models import remat as R  # flax: the trace package (and its check CLI) loads no model code

    dp, tp, sp = data_shards(sizes), sizes.get("tp", 1), sizes.get("sp", 1)  # dp: the batch's shards, dp x fsdp
    cbytes = np.dtype(mc.jnp_dtype).itemsize
    rows_local, q_local = math.ceil(micro / dp), math.ceil(seq / sp)
    attn = (f"blockwise attention ({seq} keys > attn_block_size {mc.attn_block_size}): 2 f32 softmax stats "
            f"x rows x heads_local x Tq" if R.attention_blocked(mc, seq) else
            f"dense attention ({seq} keys): [rows, heads_local, Tq, Tk] scores f32 + probabilities x {cbytes} B")
    per_layer = (f"{rows_local} x {q_local} tokens x {mc.hidden_size} x {cbytes} B x ({R.ACTIVATION_FACTOR_BASE} + "
                 f"{R.ACTIVATION_FACTOR_MLP} x {mc.intermediate_size}/{mc.hidden_size}) + {attn}")
    if mc.remat:  # full: the layer inputs; minimal (model.remat_policy): + the projections' outputs
        return (int(R.remat_bytes(mc, rows_local, seq, sp=sp, tp=tp, policy=mc.remat_policy)),
                f"remat {mc.remat_policy}: what each of {mc.num_layers} layers keeps "
                f"({'its input' if mc.remat_policy == 'full' else 'input + projections'}) + one layer "
                f"recomputed: {per_layer}")
    return int(R.activation_bytes(mc, rows_local, seq, sp=sp, tp=tp)), f"{mc.num_layers} layers x ({per_layer})"


def _work_rows(inp: LedgerInput, sizes: Mapping[str, int], measured: Mapping, dev0) -> list[dict]:
    """Activations, the KV cache and buffers: estimates beside what the compiled programs report."""
    src, batch = inp.sources, inp.fields
    mc, eng = src["model_config"], src["sampler_engine"]
    dp, tp, sp = data_shards(sizes), sizes.get("tp", 1), sizes.get("sp", 1)  # dp: the batch's shards, dp x fsdp
    micro = src["step_config"].ppo_micro_batch_size
    seq = batch["input_ids"].shape[1] if "input_ids" in batch else 0
    T = inp.traj.response_ids.shape[1]
    cbytes = np.dtype(mc.jnp_dtype).itemsize
    act_est, act_formula = _activations(mc, micro, seq, sizes)
    slots_local = math.ceil(eng.num_slots / data_shards(eng.mesh))
    kv_heads_local = math.ceil(mc.num_kv_heads / (eng.mesh.shape.get("tp", 1) if eng.mesh is not None else 1))
    kv_est = mc.num_layers * slots_local * eng.max_len * kv_heads_local * mc.head_dim * 2 * cbytes
    buf_est = math.ceil(micro / dp) * math.ceil(T / sp) * math.ceil(mc.vocab_size / tp) * 4
    upd, gen, lp = (measured.get(k) or {} for k in ("update_actor", "gen", "old_log_prob"))
    return [
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
    lays = [dict(stage=k, **{c: v.get(c) for c in ("layout", "real_tokens", "laid_tokens", "shared_saved_tokens")},
                 saved_frac=round(v["shared_saved_frac"], 4)) for k, v in (led.get("learner_layout") or {}).items()]
    if lays:  # the packed passes' tokens: what actor.shared_prefix saved (their temp is in the table above)
        out += "\n## learner tokens per pass (packed layouts)\n\n" + _md_table(
            lays, ("stage", "layout", "real_tokens", "laid_tokens", "shared_saved_tokens", "saved_frac"))
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
