"""``docs/concepts/stage-flow.md``, generated from the stage declarations.

``python -m rljax.trainer.stages.page > docs/concepts/stage-flow.md`` writes it; a test fails
when the committed page and the declarations disagree. The prose around the tables is here;
the tables come from :data:`rljax.trainer.stages.STEP`.
"""

from __future__ import annotations

from rljax.config.reference import write_page
from rljax.trainer.async_loop import dequeue
from rljax.trainer.producers import enqueue
from rljax.trainer.stages import specs, validating

PAGE = "docs/concepts/stage-flow.md"
COMMAND = f"python -m rljax.trainer.stages.page > {PAGE}"

_HEAD = """# The stages of a step

<!-- Generated from the stage declarations in rljax/trainer/stages/ by
     `{command}`: edit the declarations (or the prose in rljax/trainer/stages/page.py), not this page. -->

A training step is a list of named **stages** run over one batch dict. Each stage is a small
function that reads some batch fields and writes others, declared once beside its function
(`@stage(...)` in `rljax/trainer/stages/`); a runner (`rljax/trainer/runner.py`) runs the list,
times each stage (`timing_s/<key>` in `metrics.jsonl`) and hands what each stage read and wrote
to the observers: the [trace](../guides/trace.md), the shape and memory ledgers, the metrics.

```
config resolve (with provenance) ─► mesh + topology
  └► dataset row ─► prompt group (uid) ─► rollout: n sessions per uid, versioned weights
     ─► trajectory batch (tokens, masks, rollout_logp, versions)
  └► reward ─► old_logp / entropy (fused log-prob) ─► ref_logp (optional)
  └► advantages / returns (group advantage or GAE) ─► mini-batches ─► clipped policy loss
     (+ KL, entropy, rollout-correction weights) ─► optax update ─► version += 1
  └► weight sync to the sampler ─► metrics + trace records ─► checkpoint (orbax)
```

## The synchronous step

After the step's stages come the asynchronous schedule's own (`enqueue` ends the producer's
stages, `dequeue` starts the learner's) and validation's, which the trainer runs with a runner
of their own over each held-out batch. Stages that do not apply to a configuration are not in its list (no `values` without a
critic, no `reference` without KL), so `timing_s/values` is absent rather than zero. Two
functions may declare one stage (the rollout of unfiltered and of filtered batches): their
conditions exclude each other.

"""

_MIDDLE = """
A stage declares the fields it may read and write, the configuration keys it reads (a section
covers its keys) and how it relates to the run state (`reads`: it takes the state; `changes`:
it returns a new one every step). The runner stops the step with one line naming the stage and
the field or key when a stage touches anything else, or declares a state change it does not
make. The trace's `cleanup` record lists the stages the step actually ran, in order (the async
producer's first), and `python -m rljax.trace check` requires a record of each of them for
every traced group.

## What each stage declares

"""

_TAIL = """
**Skipping the old-log-prob pass.** When the update is exactly on-policy (one epoch over one
mini-batch, and nothing reads `old_logp` before the update: no rollout correction, no KL in
the reward, not bypass mode, no LoRA dropout) and `actor.skip_old_log_prob` is `auto` (the
default) or `true`, the update takes its own log-probs, detached, as `old_logp`, as verl's
and TRL's actors do. The trace then shows `old_logp` produced by `actor_minibatch`.

## Other schedules of the same stages

```
async (disaggregated, rollout devices ≠ learner devices):
  producer thread:  dataset_item → rollout_sessions → reward ──► bounded queue ──┐
  consumer:         dequeue (staleness gate) ◄──────────────────────────────────┘
                    → old/ref logp → advantages → update → push weights
multi-turn:         rollout_sessions = episodes: decode → tool/env → append
                    observation to the slot's KV cache (mask 0) → decode … → reward
```

The [asynchronous schedule](../guides/async.md) runs the producer stages on a rollout thread
and the learner stages on batches from the queue; neither owns the other. A
[multi-turn](../guides/multi-turn.md) run changes only what the run's rollout client does
(chosen once when the run is built); every stage is the same.

How to add a stage, a reward kind or a batch producer: [development](../development.md).
"""


def _code(names) -> str:
    return ", ".join(f"`{n}`" for n in names) if names else "–"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The page, from :data:`rljax.trainer.stages.STEP`'s declarations and the asynchronous
    schedule's own two stages."""
    rows = ["| stage | `timing_s/` | run state | in the step | reads → writes |", "|---|---|---|---|---|"]
    details = ["| stage | function | reads | writes | config | trace facts |", "|---|---|---|---|---|---|"]
    for spec in [*specs(), enqueue.stage, dequeue.stage, *specs(validating.STAGES)]:
        state = {"none": "–", "reads": "reads", "changes": "changes"}[spec.state]
        rows.append(f"| `{spec.name}` | `{spec.timing or spec.name}` | {state} | {_cell(spec.only or 'always')} | "
                    f"{_cell(spec.summary)} |")
        module = spec.fn.__module__.removeprefix("rljax.trainer.").removeprefix("stages.")
        facts = f"`{spec.facts.__name__}`" if spec.facts is not None else "–"
        details.append(f"| `{spec.name}` | `{module}.{spec.fn.__name__}` | {_code(spec.reads)} | "
                       f"{_code(spec.writes)} | {_code(spec.config)} | {facts} |")
    return (_HEAD.format(command=COMMAND) + "\n".join(rows) + "\n" + _MIDDLE + "\n".join(details) + "\n" + _TAIL)


def main(argv: list[str] | None = None) -> int:
    return write_page(render, COMMAND, argv)


if __name__ == "__main__":
    raise SystemExit(main())
