"""The field-level stage trace of a run (``trace.jsonl``), DFX metrics and alerts.

The trainer owns one :class:`Tracer` and calls it at stage boundaries; the tracer only
reads. At each boundary it keeps references and host-side metadata (cheap); at the end
of the step, once the loop has synchronised on the actor update, it summarises the
traced prompt groups' fields (reading only the shards that hold their rows), writes one
JSON record per stage per traced group, adds the DFX metrics and alerts to the step's
metrics, writes the shape and memory ledgers after the first step, and drops every
reference it held. Time spent inside the tracer is measured and reported
(``trace/overhead_s``, ``trace/overhead_frac`` of the step time).

Stages (:data:`STAGES`): config_resolve -> dataset_item -> uid_assignment -> prompt_submit
-> rollout_sessions -> trajectory_fields -> reward -> old_log_prob -> reference (when a
reference policy is used) -> advantages -> actor_minibatch -> weight_sync -> metrics ->
cleanup. Each record: ``stage``, ``step``, ``uid``, ``group``, ``keys``
(``{uid}_{session}_{index}``), ``t_start`` / ``t_end`` (Unix seconds), ``fields`` (see
:func:`rljax.trace.fields.summarize`), a shape ``signature`` and stage-specific facts.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from typing import Any, Mapping, Optional

import numpy as np

from rljax.trace import alerts as A
from rljax.trace.fields import summarize

log = logging.getLogger("rljax.trace")

STAGES = ("config_resolve", "dataset_item", "uid_assignment", "prompt_submit", "rollout_sessions",
          "trajectory_fields", "reward", "old_log_prob", "reference", "advantages", "actor_minibatch",
          "weight_sync", "metrics", "cleanup")
#: ``[B, T]`` fields (response positions): their trailing dim is the response length.
RESPONSE_FIELDS = ("response_ids", "response_mask", "loss_mask", "rollout_logp", "old_logp", "entropy", "ref_logp",
                   "advantages", "rollout_is_weights", "values", "returns")
#: Config keys whose value and source every config_resolve record carries (the seed's list, rljax names).
KEY_CONFIG = ("data.train_batch_size", "data.max_prompt_length", "data.max_response_length",
              "data.filter_overlong_prompts", "data.truncation", "algorithm.adv_estimator",
              "algorithm.use_kl_in_reward", "algorithm.norm_adv_by_std_in_grpo", "actor.ppo_mini_batch_size",
              "actor.ppo_micro_batch_size", "actor.ppo_epochs", "actor.use_kl_loss", "rollout.n", "rollout.tp",
              "rollout.calculate_log_probs", "reward.function", "trainer.mesh", "trace.groups")
#: Stages the loop does not time itself: the tracer writes ``timing_s/<stage>`` for them. The
#: others are the loop's ``timing_s/gen`` (rollout_sessions), ``reward``, ``old_log_prob``,
#: ``ref`` (reference), ``adv`` (advantages), ``update_actor`` (actor_minibatch) and
#: ``update_weights`` (weight_sync); config_resolve, uid_assignment and trajectory_fields do
#: no work of their own in the loop (zero-length windows in their records).
UNTIMED_STAGES = ("dataset_item", "prompt_submit", "metrics", "cleanup")
TRACE_FILE = "trace.jsonl"
SUMMARY_FILE = "trace_summary.json"


def _timed(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self._spent += time.perf_counter() - t

    return wrapper


def choose_groups(seed: int, step: int, num_groups: int, k: int) -> list[int]:
    """The ``k`` traced groups of a step: consecutive from a start drawn from ``(seed, step)``."""
    if k <= 0 or num_groups <= 0:
        return []
    h = int.from_bytes(hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest(), "little")
    start = h % num_groups
    return sorted({(start + i) % num_groups for i in range(min(k, num_groups))})


def _percentiles(x: np.ndarray, prefix: str) -> dict:
    if x.size == 0:
        return {}
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {f"{prefix}/mean": float(x.mean()), f"{prefix}/min": float(x.min()), f"{prefix}/max": float(x.max()),
            f"{prefix}/p50": float(p50), f"{prefix}/p90": float(p90), f"{prefix}/p99": float(p99)}


class Tracer:
    """Stage hooks of the step loop (see the module docstring).

    Args:
      cfg: the resolved configuration (``trace.*`` for the groups and alert thresholds).
      mesh: the learner mesh.
      run_dir: where ``trace.jsonl``, the ledgers and ``trace_summary.json`` go.
      enabled: write files (the main process); hooks still run cheaply elsewhere.
      owner: the trainer, read once after the first step for the ledgers (its model
        config, graphdef, parameters, jitted train step and sampler).
    """

    def __init__(self, cfg, mesh, run_dir: str, *, enabled: bool = True, owner: Any = None):
        self.cfg, self.mesh, self.run_dir, self.owner = cfg, mesh, run_dir, owner
        self.enabled = enabled
        self.k = int(cfg.trace.groups)
        self.dp = int(dict(mesh.shape).get("dp", 1))
        self.path = os.path.join(run_dir, TRACE_FILE)
        self.spikes = A.SpikeDetector(factor=cfg.trace.alert_spike_factor, window=cfg.trace.alert_spike_window)
        self.memory_stats = lambda: [d.memory_stats() for d in _local_devices()]
        self._offset = time.time() - time.perf_counter()
        self._spent = 0.0
        self._spent_total = 0.0
        self._step_total = 0.0
        self._ledger_s = 0.0
        self._ledger_total = 0.0
        self._records = 0
        self._fracs: list[float] = []
        self._steps = 0
        self._uids: list[str] = []
        self._alert_counts: dict[str, int] = {}
        self._stage_total: dict[str, float] = {}
        self._ledgers_done = not cfg.trace.ledgers
        self._compiled_peak: Optional[int] = None
        self._config = self._config_facts()
        self._config_written = False
        self._s: dict = {}

    # ------------------------------------------------------------------ boundaries

    def _wall(self, t_perf: float) -> float:
        return round(t_perf + self._offset, 6)

    def _mark(self, stage: str) -> None:
        now = time.perf_counter()
        self._s["times"][stage] = (self._s["last"], now)
        self._s["last"] = now

    @_timed
    def submit(self, step: int, prompts, uids, *, version: int, decode, t_step: Optional[float] = None) -> None:
        """Before the rollout: the step's prompts (dataset rows), their uids and the weight version."""
        now = time.perf_counter()
        t0 = now if t_step is None else t_step
        self._s = {"step": int(step), "last": t0, "times": {}, "prompts": prompts, "uids": list(uids),
                   "groups": choose_groups(self.cfg.trainer.seed, step, len(prompts), self.k),
                   "version": int(version), "decode": decode, "arrays": {}}
        self._s["times"]["config_resolve"] = (t0, t0)
        self._mark("dataset_item")
        self._s["times"]["uid_assignment"] = (now, now)
        self._mark("prompt_submit")

    @_timed
    def rollout(self, traj) -> None:
        """After the rollout: the :class:`Trajectories` (host arrays)."""
        self._mark("rollout_sessions")
        self._s["times"]["trajectory_fields"] = self._s["times"]["rollout_sessions"][1:] * 2
        self._s["traj"] = traj

    @_timed
    def reward(self, scores, batch: Mapping, groups: Mapping) -> None:
        """After the reward: per-trajectory scores and the learner batch placed on the mesh."""
        self._mark("reward")
        self._s["scores"], self._s["placed_scores"] = scores, groups.get("scores")
        self._s["placed"] = dict(batch)  # what the log-prob function is called with
        self._s["batch"] = self._s["placed"]

    @_timed
    def logprob(self, stage: str, **arrays) -> None:
        """After ``old_log_prob`` (``old_logp``, ``entropy``) or ``reference`` (``ref_logp``)."""
        self._mark(stage)
        self._s["arrays"].update(arrays)

    @_timed
    def observe(self, **arrays) -> None:
        """Arrays of the step that are not batch fields (the critic's ``values`` and ``returns``)."""
        self._s["arrays"].update(arrays)

    @_timed
    def advantages(self, batch: Mapping) -> None:
        self._mark("advantages")
        self._s["batch"] = dict(batch)

    @_timed
    def actor_update(self, actor: Mapping, *, optimizer_steps: int) -> None:
        self._mark("actor_minibatch")
        self._s["actor"], self._s["optimizer_steps"] = actor, int(optimizer_steps)

    @_timed
    def weight_sync(self, version: int, sampler) -> None:
        self._mark("weight_sync")
        self._s["sync"] = {"learner_version": int(version), "sampler_version": int(sampler.version),
                           "sync_s": round(float(getattr(sampler, "last_weight_sync_s", 0.0)), 6)}

    # ------------------------------------------------------------------ end of step

    def end_step(self, metrics: Mapping, *, host: Mapping) -> dict:
        """Summaries, records, DFX metrics and alerts of the step; returns metrics to add."""
        entered = time.perf_counter()
        s = self._s
        out: dict[str, Any] = {}
        traj = s.get("traj")
        if traj is None:
            return out
        self._mark("metrics")
        out.update(self._dfx(traj, host))
        sigs: dict[str, dict] = {}
        records = []
        for g in s["groups"] if self.enabled else ():  # other processes of a multi-host run write nothing
            recs = self._group_records(g, traj, host, metrics)
            sigs[recs[0]["uid"]] = {r["stage"]: r["signature"] for r in recs}
            records.extend(recs)
        found = A.checksum_alerts(sigs)
        if not self._ledgers_done:
            t = time.perf_counter()
            self._ledgers_done = True
            try:
                from rljax.trace.ledger import write_ledgers

                self._compiled_peak = write_ledgers(self, host) if self.enabled else None
            except Exception as e:  # a ledger must never stop training
                log.warning("rljax.trace: ledgers not written: %s: %s", type(e).__name__, e)
            self._ledger_s = time.perf_counter() - t
            self._ledger_total += self._ledger_s
        stats = self.memory_stats()
        if stats and stats[0]:
            out.update({f"memory/{k}": stats[0].get(k) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")})
        found += [a for a in (A.memory_alert(stats, self.cfg.trace.alert_memory_frac, compiled_peak=self._compiled_peak),
                              A.dp_imbalance_alert(out["perf/dp_tokens"], self.cfg.trace.alert_dp_imbalance)) if a]
        found += self.spikes.update(metrics)
        for name, msg in found:
            out[f"alerts/{name}"] = 1
            self._alert_counts[name] = self._alert_counts.get(name, 0) + 1
            log.warning("rljax alert %s (step %d): %s", name, s["step"], msg)
        # cleanup: release every reference to the step's arrays, then record what is left.
        keys_held = [k for r in records if r["stage"] == "rollout_sessions" for k in r["keys"]]
        batch_keys = sorted(s.get("batch", {}))
        self._s = {"step": s["step"], "last": s["last"], "times": s["times"]}
        remaining = [k for k in keys_held if k in self._held_keys()]
        self._mark("cleanup")
        for r in records:
            if r["stage"] == "cleanup":
                r.update(batch_keys=batch_keys, remaining_keys=remaining, released=True)
        for r in records:
            t0, t1 = s["times"].get(r["stage"], (None, None))
            r["t_start"], r["t_end"] = (self._wall(t0), self._wall(t1)) if t0 is not None else (None, None)
        for stage, (t0, t1) in s["times"].items():
            dt = t1 - t0
            if stage == "metrics":  # its window also holds this step's validation / checkpoint, timed by the loop
                dt -= sum(metrics.get(f"timing_s/{k}") or 0.0 for k in ("testing", "save_checkpoint"))
            if stage in UNTIMED_STAGES:
                out[f"timing_s/{stage}"] = max(dt, 0.0)
            self._stage_total[stage] = self._stage_total.get(stage, 0.0) + max(dt, 0.0)
        if self.enabled and records:
            with open(self.path, "a") as fh:
                fh.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
        self._records += len(records)
        self._uids.extend(sorted({r["uid"] for r in records}))
        self._steps += 1
        step_s = time.perf_counter() - s["times"]["config_resolve"][0]
        spent = self._spent + (time.perf_counter() - entered) - self._ledger_s
        self._spent_total += spent
        self._step_total += step_s
        self._fracs.append(spent / step_s if step_s > 0 else 0.0)
        tokens, step_wall = metrics.get("perf/total_num_tokens"), metrics.get("timing_s/step")
        if tokens is not None and step_wall:
            out["perf/e2e_tokens_per_s"] = float(tokens) / float(step_wall)
        out.update({"trace/overhead_s": spent, "trace/overhead_frac": spent / step_s if step_s > 0 else 0.0})
        if self._ledger_s:
            out["trace/ledger_s"] = self._ledger_s
        self._spent, self._ledger_s = 0.0, 0.0
        return out

    def close(self) -> dict:
        """Writes ``trace_summary.json`` (records, traced uids, stage time, overhead, alerts); returns it."""
        frac = self._spent_total / self._step_total if self._step_total > 0 else 0.0
        summary = {"steps": self._steps, "records": self._records, "groups_per_step": self.k,
                   "stages": list(STAGES), "traced_uids": self._uids, "stage_s": self._stage_total,
                   "overhead_s": self._spent_total, "step_s": self._step_total, "overhead_frac": frac,
                   "overhead_frac_median": float(np.median(self._fracs)) if self._fracs else 0.0,
                   "overhead_frac_max": float(max(self._fracs, default=0.0)),
                   "ledger_s": self._ledger_total, "alerts": self._alert_counts,
                   "files": [f for f in (TRACE_FILE, "shape_ledger.json", "memory_ledger.json")
                             if os.path.exists(os.path.join(self.run_dir, f))]}
        if self.enabled:
            with open(os.path.join(self.run_dir, SUMMARY_FILE), "w") as fh:
                json.dump(summary, fh, indent=1)
        return summary

    @staticmethod
    def describe_overhead(summary: Mapping) -> str:
        """One line for the run summary table."""
        return (f"{100 * summary['overhead_frac_median']:.1f}% of step time (median; max "
                f"{100 * summary['overhead_frac_max']:.1f}%, {summary['overhead_s']:.2f} s in "
                f"{summary['steps']} steps) + ledgers {summary['ledger_s']:.2f} s once")

    def _held_keys(self) -> set:
        traj = self._s.get("traj")
        return set(traj.trajectory_keys) if traj is not None else set()

    # ------------------------------------------------------------------ DFX metrics

    def _dfx(self, traj, host: Mapping) -> dict:
        real = ~np.asarray(traj.is_padding)
        att = np.asarray(host["attention_mask"])
        counts = A.dp_token_counts(att * real[:, None], self.dp)
        out = {"perf/dp_tokens": [int(c) for c in counts], "perf/dp_token_imbalance": A.imbalance(counts),
               "perf/padding_rows": int((~real).sum())}
        out.update(_percentiles(np.asarray(traj.prompt_length)[real], "prompt_length"))
        out.update({k: v for k, v in _percentiles(np.asarray(traj.response_length)[real], "response_length").items()
                    if k.rsplit("/", 1)[1].startswith("p")})
        return out

    # ------------------------------------------------------------------ records

    def _config_facts(self) -> dict:
        from rljax.config import to_flat_dict

        path = os.path.join(self.run_dir, "config.resolved.yaml")
        flat = to_flat_dict(self.cfg)
        facts = {"file": "config.resolved.yaml" if os.path.exists(path) else None,
                 "sha256": hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:16]}
        sources = {}
        if facts["file"]:
            try:
                from rljax.config import load_resolved

                _, prov = load_resolved(path)
                sources = {k: prov.get(k) for k in KEY_CONFIG}
                facts["fields_not_from_default"] = sum(1 for v in prov.values() if v != "default")
            except Exception as e:  # provenance unreadable: the checker reports it
                facts["error"] = f"{type(e).__name__}: {e}"
        facts["values"] = {k: flat.get(k) for k in KEY_CONFIG}
        facts["sources"] = sources
        return facts

    def _config_once(self) -> dict:
        """The key fields' values and sources in the run's first record; the file and hash after."""
        if not self._config_written:
            self._config_written = True
            return self._config
        return {k: self._config.get(k) for k in ("file", "sha256")}

    def _group_records(self, g: int, traj, host: Mapping, metrics: Mapping) -> list[dict]:
        s = self._s
        cfg = self.cfg
        uid = s["uids"][g]
        rows = np.nonzero(np.asarray(traj.group_id) == g)[0]
        rows = rows[~np.asarray(traj.is_padding)[rows]]
        # {uid}_{session}_{index} of the traced rows only (Trajectories.trajectory_keys builds all B).
        key_of = {int(i): f"{traj.uid[i]}_{traj.session[i]}_{traj.index[i]}" for i in rows}
        keys = list(key_of.values())
        B, T = traj.response_ids.shape
        pad = np.asarray(traj.is_padding)
        loss_mask = np.asarray(traj.loss_mask)
        resp_len = np.asarray(traj.response_length)
        batch = s.get("batch", {})
        arrays = s.get("arrays", {})
        kw = dict(rows=rows, is_padding=pad)
        base = {"step": s["step"], "uid": uid, "group": int(g), "keys": keys}

        def rec(stage, fields=(), **extra):
            r = dict(base, stage=stage, fields=list(fields), **extra)
            r["signature"] = _signature(keys, fields, loss_mask, rows)
            return r

        p = s["prompts"][g]
        d = s["decode"]
        t_submit = self._wall(s["times"]["prompt_submit"][1])
        out = [
            rec("config_resolve", config=self._config_once()),
            rec("dataset_item", [{"name": "prompt.ids", "producer": "dataset_item:rljax.data.PromptIterator",
                                  "consumer": "prompt_submit", "shape": [len(p.ids)], "dtype": "int32",
                                  "sharding": {"placement": "host"}, "valid_length": [len(p.ids)]}],
                row_index=int(p.index), position=int(p.position), prompt_tokens=len(p.ids),
                truncated=bool(p.truncated), message_count=1),
            rec("uid_assignment", uid_rule="uid = '{step}-{index in batch}'", num_groups=len(s["uids"]),
                prompt_key=uid),
            rec("prompt_submit", t_submit=t_submit, n=int(cfg.rollout.n), weight_version=s["version"],
                decode={"temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p,
                        "max_new_tokens": d.max_new_tokens, "seed": d.seed}),
        ]
        t_sample = self._wall(s["times"]["rollout_sessions"][1])
        trajs = []
        for i in rows:
            insert = t_submit + float(traj.queue_s[i])
            trajs.append({"key": key_of[int(i)], "session": int(traj.session[i]), "index": int(traj.index[i]),
                          "min_version": int(traj.min_version[i]), "max_version": int(traj.max_version[i]),
                          "status": "truncated" if traj.truncated[i] else "eos",
                          "t_insert": round(insert, 6), "t_finish": round(insert + float(traj.decode_s[i]), 6)})
        out.append(rec("rollout_sessions", sessions=sorted({t["session"] for t in trajs}), n=int(cfg.rollout.n),
                       trajectories=trajs, t_submit=t_submit, t_sample=t_sample,
                       min_version=min((t["min_version"] for t in trajs), default=None),
                       max_version=max((t["max_version"] for t in trajs), default=None)))
        mask_sum = np.asarray(traj.response_mask)[rows].sum(axis=1)
        host_fields = [
            summarize("prompt_ids", traj.prompt_ids, producer="rollout_sessions:Sampler.generate",
                      consumer="trajectory_fields:Trainer._host_batch", valid_length=traj.prompt_length,
                      mask=traj.prompt_mask, **kw),
            summarize("prompt_mask", traj.prompt_mask, producer="rollout_sessions:Sampler.generate",
                      consumer="trajectory_fields:Trainer._host_batch", mask=traj.prompt_mask, **kw),
            summarize("response_ids", traj.response_ids, producer="rollout_sessions:Sampler.generate",
                      consumer="trajectory_fields:Trainer._host_batch", valid_length=resp_len,
                      mask=traj.response_mask, **kw),
            summarize("response_mask", traj.response_mask, producer="rollout_sessions:Sampler.generate",
                      consumer="trajectory_fields:Trainer._host_batch", valid_length=resp_len,
                      mask=traj.response_mask, **kw),
            summarize("loss_mask", traj.loss_mask, producer="rollout_sessions:Sampler.generate",
                      consumer="actor_minibatch:train_step", valid_length=resp_len, mask=loss_mask, **kw),
            summarize("rollout_logp", traj.rollout_logp, producer="rollout_sessions:Sampler.generate",
                      consumer="actor_minibatch:train_step (rollout correction)", valid_length=resp_len,
                      mask=loss_mask, **kw),
        ]
        seq_len = np.asarray(traj.prompt_length) + resp_len
        placed = [summarize(k, batch[k], producer="trajectory_fields:Trainer._host_batch+place",
                            consumer=("old_log_prob:logprob_fn" if k != "loss_mask" else "actor_minibatch:train_step"),
                            valid_length=seq_len if k != "loss_mask" and k != "rollout_logp" else resp_len,
                            mask=host[k] if k in host else None, **kw)
                  for k in ("input_ids", "attention_mask", "positions", "loss_mask", "rollout_logp") if k in batch]
        per_traj = [{"key": key_of[int(i)], "prompt_len": int(traj.prompt_length[i]),
                     "response_len": int(resp_len[i]), "seq_len": int(seq_len[i]),
                     "response_mask_sum": int(m), "observation_tokens": int(resp_len[i] - m), "num_turns": 1}
                    for i, m in zip(rows, mask_sum)]
        out.append(rec("trajectory_fields", host_fields + placed, trajectories=per_traj, layout=
                       "prompts left-padded to data.max_prompt_length, responses right-padded to "
                       "data.max_response_length; input_ids = [prompt | response]"))
        scores = np.asarray(s["scores"])
        reward_fields = [summarize("scores", scores, producer="reward:rljax.reward.score_batch",
                                   consumer="advantages:Trainer._advantages", values=True, **kw)]
        if s.get("placed_scores") is not None:
            reward_fields[0]["sharding"] = summarize("scores", s["placed_scores"], producer="", consumer="",
                                                     rows=rows)["sharding"]
        out.append(rec("reward", reward_fields, placement="outcome reward: one scalar per trajectory, "
                       "broadcast over loss_mask by the advantage", padding_rows=int(pad.sum()),
                       padding_reward_abs_sum=float(np.abs(scores[pad]).sum()) if pad.any() else 0.0))
        lp = [summarize(k, arrays[k], producer="old_log_prob:Trainer.logprob_fn(state.params)",
                        consumer=("actor_minibatch:train_step (ratio)" if k == "old_logp" else "metrics:actor/entropy"),
                        valid_length=resp_len, mask=loss_mask, values=True, **kw)
              for k in ("old_logp", "entropy") if k in arrays]
        out.append(rec("old_log_prob", lp, bypass=False))
        if "ref_logp" in arrays:
            consumer = "actor_minibatch:train_step (kl_loss)" if cfg.actor.use_kl_loss else "reward:kl_in_reward"
            out.append(rec("reference", [summarize("ref_logp", arrays["ref_logp"],
                                                   producer="reference:Trainer.logprob_fn(ref_params)",
                                                   consumer=consumer, valid_length=resp_len, mask=loss_mask,
                                                   values=True, **kw)]))
        adv = batch.get("advantages")
        adv_fields = []
        if adv is not None:
            adv_fields.append(summarize("advantages", adv, producer="advantages:Trainer._advantages",
                                        consumer="actor_minibatch:train_step", valid_length=resp_len,
                                        mask=loss_mask, values=True, **kw))
        if "rollout_is_weights" in batch:
            adv_fields.append(summarize("rollout_is_weights", batch["rollout_is_weights"],
                                        producer="advantages:rollout_correction_weights",
                                        consumer="actor_minibatch:train_step", mask=loss_mask, **kw))
        for k in ("values", "returns"):
            if k in arrays:
                adv_fields.append(summarize(k, arrays[k], producer=("values:Trainer.values_fn" if k == "values" else
                                                                    "advantages:rljax.loss.gae_advantages"),
                                            consumer="update_critic:critic_step", valid_length=resp_len,
                                            mask=loss_mask, values=True, **kw))
        returns = ("materialised (critic targets)" if "returns" in arrays
                   else "not materialised: outcome estimators use advantages as returns")
        out.append(rec("advantages", adv_fields, estimator=cfg.algorithm.adv_estimator, returns=returns))
        a = cfg.actor
        mini = a.ppo_mini_batch_size * cfg.rollout.n
        micro = a.ppo_micro_batch_size or mini
        actor = {k: _num(v) for k, v in (s.get("actor") or {}).items()}
        minibatch = {"global_batch_size": int(B), "ppo_mini_batch_size": int(mini), "ppo_micro_batch_size": int(micro),
                     "ppo_epochs": int(a.ppo_epochs), "mini_batches_per_epoch": int(B // mini),
                     "micro_batches_per_mini_batch": int(mini // micro),
                     "optimizer_steps_after": s.get("optimizer_steps"),
                     "loss_tokens": int(loss_mask.sum()), "loss_rows": int(loss_mask.any(axis=1).sum()),
                     "loss_tokens_on_padding_rows": int(loss_mask[pad].sum()),
                     "advantages_on_padding_rows_abs_sum": _padding_abs_sum(batch.get("advantages"), pad),
                     "dp_shard_rows": int(B // self.dp) if B % self.dp == 0 else None, "actor_dp": self.dp}
        consumed = [summarize(k, batch[k], producer=_producer(k), consumer="actor_minibatch:train_step",
                              valid_length=resp_len, mask=loss_mask, **kw)
                    for k in ("loss_mask", "old_logp", "advantages", "ref_logp", "rollout_is_weights") if k in batch]
        out.append(rec("actor_minibatch", consumed, minibatch=minibatch, actor_metrics=actor))
        out.append(rec("weight_sync", **(s.get("sync") or {}), next_rollout_version=(s.get("sync") or {}).get(
            "learner_version")))
        real = ~pad
        out.append(rec("metrics", rows_counted=int(real.sum()), padding_rows=int(pad.sum()),
                       response_length_mean_real=float(resp_len[real].mean()) if real.any() else None,
                       score_mean_real=float(scores[real].mean()) if real.any() else None,
                       logged={k: _num(metrics.get(k)) for k in ("critic/score/mean", "response_length/mean",
                                                                   "actor/entropy", "actor/pg_loss")}))
        out.append(rec("cleanup"))
        return out


def _padding_abs_sum(x, pad: np.ndarray) -> Optional[float]:
    """Sum of |x| over the padding rows (0.0 without padding rows; reads only their shards)."""
    if x is None or not pad.any():
        return 0.0
    from rljax.trace.fields import host_rows

    v = host_rows(x, np.nonzero(pad)[0])
    return None if v is None else float(np.abs(v).sum())


def _producer(k: str) -> str:
    return {"loss_mask": "trajectory_fields:Trainer._host_batch", "old_logp": "old_log_prob:Trainer.logprob_fn",
            "advantages": "advantages:Trainer._advantages", "ref_logp": "reference:Trainer.logprob_fn",
            "rollout_is_weights": "advantages:rollout_correction_weights"}.get(k, "?")


def _num(v):
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if np.isfinite(f) else None


def _signature(keys, fields, loss_mask, rows) -> dict:
    """What must agree between stages for one group: keys, rows, batch size, response length, mask sum."""
    batch = sorted({f["shape"][0] for f in fields if f["name"] != "prompt.ids" and f["shape"]})
    resp = sorted({f["shape"][1] for f in fields if f["name"] in RESPONSE_FIELDS and len(f["shape"]) == 2})
    sums = [sum(f["mask_sum"]) for f in fields if f["name"] in RESPONSE_FIELDS and "mask_sum" in f]
    return {"keys": list(keys), "rows": len(rows), "batch": batch or None, "resp_len": resp or None,
            "mask_sum": sorted(set(sums)) or None}


def _local_devices():
    import jax

    return jax.local_devices()
