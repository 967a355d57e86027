"""Checks of each step's layout and versions: the configuration's provenance, the actor's
mini-batches and data-parallel degree, the weight version after each sync and every token's version."""

from __future__ import annotations

import os
from collections import defaultdict

from rljax.config import load_resolved
from rljax.trace.checks.base import FAIL, NA, PASS, Result, Run


def check_config(run: Run) -> Result:
    path = os.path.join(run.dir, "config.resolved.yaml")
    if not os.path.exists(path):
        return FAIL, "config provenance recorded", "config.resolved.yaml missing"
    try:
        _, prov = load_resolved(path)
    except Exception as e:
        return FAIL, "config provenance recorded", f"config.resolved.yaml unreadable: {e}"
    with open(path) as fh:
        tagged = sum(1 for line in fh if "# from: " in line)
    if tagged == 0:
        return FAIL, "config provenance recorded", "no '# from: <source>' tags in config.resolved.yaml"
    rec = run.config_record
    if not rec.get("sha256") or not rec.get("sources"):
        return FAIL, "config provenance recorded", "trace has no config_resolve record with sources"
    writers = rec.get("writers") or {}
    if not writers:
        return FAIL, "config provenance recorded", "the trace's config record has no writers (chain per key field)"
    for k, chain in writers.items():  # the trace keeps every writer, ending with the one the file names
        if not chain or chain[-1][0] != prov.get(k) or len(chain) != len(prov.chain(k)):
            return FAIL, "config provenance recorded", (f"{k}: the trace's writers {chain} disagree with "
                                                        f"config.resolved.yaml ({prov.get(k)}, {len(prov.chain(k))} "
                                                        "writer(s))")
    sources = sorted({v for v in prov.values()})
    hashes = {r["config"].get("sha256") for r in run.by_stage("config_resolve") if r.get("config")}
    multi = sum(1 for c in writers.values() if len(c) > 2)
    return PASS, "config provenance recorded", (f"{tagged} fields tagged; sources: {', '.join(sources)}; "
                                                f"{len(hashes)} resolved config(s) in the trace; {len(writers)} key "
                                                f"fields with every writer ({multi} set by more than one)")


def check_minibatch(run: Run) -> Result:
    name = "actor mini-batch metadata present"
    recs = run.by_stage("actor_minibatch")
    if not recs:
        return FAIL, name, "no actor_minibatch records"
    need = ("global_batch_size", "ppo_mini_batch_size", "ppo_micro_batch_size", "ppo_epochs", "mini_batches_per_epoch",
            "loss_tokens")
    for r in recs:
        n = run.at(r["step"]).config_values.get("rollout.n")  # the settings the step ran with
        mini_prompts = run.at(r["step"]).config_values.get("actor.ppo_mini_batch_size")
        mb = r.get("minibatch") or {}
        missing = [k for k in need if mb.get(k) is None]
        if missing:
            return FAIL, name, f"step {r['step']}: missing {', '.join(missing)}"
        if mb["global_batch_size"] % mb["ppo_mini_batch_size"] or mb["ppo_mini_batch_size"] % mb["ppo_micro_batch_size"]:
            return FAIL, name, f"step {r['step']}: batch {mb['global_batch_size']} / mini {mb['ppo_mini_batch_size']} / " \
                                f"micro {mb['ppo_micro_batch_size']} do not divide"
        if n and mini_prompts and mb["ppo_mini_batch_size"] != n * mini_prompts:
            return FAIL, name, f"step {r['step']}: mini-batch {mb['ppo_mini_batch_size']} trajectories != " \
                                f"actor.ppo_mini_batch_size x rollout.n = {mini_prompts * n}"
    mb = recs[-1]["minibatch"]
    return PASS, name, (f"{len(recs)} record(s); batch {mb['global_batch_size']} = {mb['mini_batches_per_epoch']} "
                        f"mini-batches of {mb['ppo_mini_batch_size']} x {mb['ppo_epochs']} epoch(s), micro "
                        f"{mb['ppo_micro_batch_size']}")


def check_actor_dp(run: Run) -> Result:
    name = "actor_dp explained by the topology, not by rollout TP"
    t = run.topology
    if not t:
        return FAIL, name, "topology.json missing"
    try:
        world, mesh, dp = t["world_size"], t["mesh"], t["actor_dp"]
        expect = world // (mesh.get("tp", 1) * mesh.get("sp", 1))
    except (KeyError, TypeError) as e:
        return FAIL, name, f"topology.json lacks {e}"
    if dp != expect or "actor_dp_derivation" not in t or "rollout_tp" not in t:
        return FAIL, name, f"actor_dp={dp}, world/(tp*sp)={expect}, derivation/rollout_tp recorded: " \
                            f"{'actor_dp_derivation' in t}/{'rollout_tp' in t}"
    if "rollout" in t["actor_dp_derivation"]:
        return FAIL, name, f"actor_dp derivation mentions the rollout layout: {t['actor_dp_derivation']}"
    if mesh.get("dp", dp) * mesh.get("fsdp", 1) != dp:  # the batch splits over dp x fsdp
        return FAIL, name, f"actor_dp={dp} but the mesh's dp x fsdp axes are {mesh.get('dp')} x {mesh.get('fsdp', 1)}"
    for r in run.by_stage("actor_minibatch"):
        if r.get("minibatch", {}).get("actor_dp") not in (None, dp):
            return FAIL, name, (f"step {r['step']}: batch dispatched over dp={r['minibatch']['actor_dp']}, "
                                 f"topology says {dp}")
    rtp = t["rollout_tp"]
    return PASS, name, (f"actor_dp = {t['actor_dp_derivation']}; rollout tp={rtp}, replicas={t.get('rollout_replicas')} "
                        "(recorded separately)")


def check_versions(run: Run) -> Result:
    """Each sync's version is the one the next step's rollout sampled with, as the sampler recorded it
    (the versions of every traced trajectory of step + 1); the last step has no next rollout. Async with
    ``max_staleness`` > 0 is N/A: its rollouts may lag by up to tau (the async checks cover them)."""
    name = "weight version after each sync == next rollout's version"
    if run.asynchronous() and run.config_values.get("async_training.max_staleness"):
        return NA, name, ("asynchronous run with max_staleness > 0: a rollout may use older weights "
                          "(see 'trained staleness within tau')")
    syncs = {r["step"]: r for r in run.by_stage("weight_sync")}
    rollouts = defaultdict(list)
    for r in run.by_stage("rollout_sessions"):
        rollouts[r["step"]].append(r)
    if not syncs:
        return FAIL, name, "no weight_sync records"
    traced = {step for step, _ in run.groups}
    pairs, unfollowed = 0, []
    for step, s in sorted(syncs.items()):
        v = s.get("learner_version")
        if v is None or s.get("sampler_version") != v:
            return FAIL, name, f"step {step}: learner version {v}, sampler {s.get('sampler_version')}"
        nxt = rollouts.get(step + 1, [])
        if not nxt:
            if step + 1 in traced:  # the next step was traced, but not its rollout
                return FAIL, name, f"step {step + 1}: traced, but no rollout_sessions record to compare with the sync " \
                                    f"after step {step} (version {v})"
            unfollowed.append(step)
            continue
        for r in nxt:  # what the sampler recorded for each trajectory it generated (the group's when none)
            for t in r.get("trajectories") or [r]:
                if t.get("min_version") != v or t.get("max_version") != v:
                    return FAIL, name, (f"step {step + 1} {t.get('key', r.get('uid'))}: rollout used versions "
                                        f"{t.get('min_version')}..{t.get('max_version')}, the sync after step {step} "
                                        f"installed {v}")
        pairs += 1
    for step, rs in rollouts.items():  # the version the rollout was asked for is the one it sampled with
        for r in rs:
            if r.get("weight_version") is not None and r.get("min_version") != r.get("weight_version"):
                return FAIL, name, f"step {step}: submitted at version {r.get('weight_version')}, sampled with " \
                                    f"{r.get('min_version')}"
    last = max(syncs)
    gaps = [st for st in unfollowed if st != last]
    note = (f"; the last (step {last}) has no next rollout" if last in unfollowed else "") + \
        (f"; step(s) {', '.join(map(str, gaps))} not followed by a traced step" if gaps else "")
    if not pairs:
        return NA, name, f"{len(syncs)} sync(s), none followed by a traced rollout{note}"
    return PASS, name, (f"{len(syncs)} sync(s): {pairs} followed by the next step's traced rollout, every trajectory "
                        f"sampled with the synced version{note}")


def check_token_versions(run: Run) -> Result:
    """Every traced trajectory's per-token weight versions (``token_versions``: spans ``[first token,
    version]`` of ``Trajectories.token_version``) tie to its row versions: they start at token 0, never
    go down along the row (a push applies from the next token on, under partial_rollout keep and
    recompute alike), their minimum is ``min_version`` (staleness is measured from it) and none is
    above ``max_version``."""
    name = "token versions tie to min_version"
    seen = 0
    for r in run.by_stage("rollout_sessions"):
        for t in r.get("trajectories", []):
            spans = t.get("token_versions")
            if spans is None:
                continue
            seen += 1
            where = f"step {r.get('step')} {t.get('key')}"
            if not spans:
                return FAIL, name, f"{where}: no sampled token has a version"
            starts, versions = [s[0] for s in spans], [s[1] for s in spans]
            if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
                return FAIL, name, f"{where}: spans {spans} do not start at token 0 in order"
            if any(b < a for a, b in zip(versions, versions[1:])):
                return FAIL, name, f"{where}: token versions go down along the row: {spans}"
            if min(versions) != t.get("min_version") or max(versions) > t.get("max_version", max(versions)):
                return FAIL, name, (f"{where}: token versions {min(versions)}..{max(versions)}, row versions "
                                    f"{t.get('min_version')}..{t.get('max_version')}")
    if not seen:
        return NA, name, "no traced trajectory records token_versions (a trace written before per-token versions)"
    return PASS, name, f"{seen} traced trajectories: token versions non-decreasing, their minimum min_version"
