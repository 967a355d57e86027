"""A learned reward that teaches: a tiny reward model fitted to prefer the correct sum, then
GRPO on the embedded addition task with that model as the only reward.

1. **Fit** (one CPU device, a few seconds of optax Adam): rljax's ``tiny`` backbone plus a
   one-output score head regresses the embedded task's rule reward
   (:func:`rljax.reward.embedded_reward`) of 48 responses to each of the task's 25 prompts
   (``BOS "a+b="``, operands 0..4): every number 0..18 and random strings of digits and other
   characters, 1-2 characters followed by EOS, 3 characters without (a response cut at the
   preset's 3 tokens). Prints how often the correct sum gets the prompt's highest score among
   its candidates. Exported with ``rljax.models.save_hf_reward_model`` (a
   ``Qwen2ForSequenceClassification`` checkpoint transformers loads).
2. **RL**: two ``python -m rljax.launch`` runs of the embedded default (random ``tiny``
   policy, same seed), 8 prompts x 4 samples a step: the rule reward alone, and the reward
   model alone (``reward.combine.function_weight=0``); the table gives the held-out *rule*
   reward (greedy, 64 test prompts) every ``--every`` steps.

    python bench/reward_model_learning.py --steps 150 --every 25 --out /tmp/rm_learning
"""

import argparse
import dataclasses
import os
import random
import time

from _launch import launch_run  # bench/ is on sys.path when a bench runs as a script

#: responses scored per prompt in the fit
CANDIDATES = 48
BASE = ["--mesh=dp2", "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8",
        "trainer.val_before_train=true", "trace.ledgers=false", "data.val_batch_size=64", "data.embedded.num_test=64"]


def fit(out: str, *, steps: int, seed: int = 0) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from rljax import models
    from rljax.reward import embedded_reward
    from rljax.tokenizer import CharTokenizer

    tok = CharTokenizer()
    rng = random.Random(seed)
    rows, groups = [], []
    for a in range(5):
        for b in range(5):
            answer = str(a + b)
            # every number 0..18, then random strings: 1-2 characters end with EOS, 3 characters are
            # what a response cut at data.max_response_length=3 looks like (no EOS)
            cands = {str(n) for n in range(19)}
            while len(cands) < CANDIDATES:
                cands.add("".join(rng.choice("0123456789+=ab ") for _ in range(rng.randrange(1, 4))))
            group = []
            for c in sorted(cands):
                group.append(len(rows))
                rows.append((tok.encode(f"{a}+{b}=", add_bos=True), tok.encode(c, add_eos=len(c) < 3),
                             embedded_reward(c, answer), c == answer))
            groups.append(group)
    width = max(len(p) for p, *_ in rows) + max(len(r) for _, r, *_ in rows)
    toks = np.zeros((len(rows), width), np.int32)
    mask = np.zeros_like(toks, bool)
    for i, (p, r, _, _) in enumerate(rows):  # left-padded prompt, right-padded response: the learner layout
        s = max(len(q) for q, *_ in rows)  # the prompt columns
        toks[i, s - len(p):s], mask[i, s - len(p):s] = p, True
        toks[i, s:s + len(r)], mask[i, s:s + len(r)] = r, True
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32)
    target = np.array([t for *_, t, _ in rows], np.float32)
    config = dataclasses.replace(models.get_config("tiny"), vocab_size=max(models.get_config("tiny").vocab_size,
                                                                               tok.vocab_size), tie_embeddings=True)
    graphdef, params = models.init_params(config, seed=seed)
    state = {"params": params, "score": jnp.zeros((config.hidden_size, 1), jnp.float32)}
    opt = optax.adam(1e-3)
    opt_state = opt.init(state)

    def loss_fn(s):
        pred = models.reward_scores(graphdef, s["params"], s["score"], toks, mask=mask, positions=pos)[:, 0]
        return jnp.mean((pred - target) ** 2)

    @jax.jit
    def step(s, o):
        loss, g = jax.value_and_grad(loss_fn)(s)
        u, o = opt.update(g, o, s)
        return optax.apply_updates(s, u), o, loss

    t = time.perf_counter()
    for _ in range(steps):
        state, opt_state, loss = step(state, opt_state)
    fit_s = time.perf_counter() - t
    pred = np.asarray(models.reward_scores(graphdef, state["params"], state["score"], toks, mask=mask,
                                           positions=pos)[:, 0])
    correct_top = np.mean([rows[g[int(np.argmax(pred[g]))]][3] for g in groups])
    head = models.RewardHead("Qwen2ForSequenceClassification", 1, False)
    models.save_hf_reward_model(out, config, head, state["params"], state["score"])
    return {"loss": float(loss), "fit_s": fit_s, "correct_top": float(correct_top), "rows": len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/rm_learning")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--fit-steps", type=int, default=300)
    a = ap.parse_args()
    print(f"load: {os.getloadavg()[0]:.1f}", flush=True)
    rm = os.path.join(a.out, "reward_model")
    f = fit(rm, steps=a.fit_steps)
    print(f"fit: {f['rows']} responses, {a.fit_steps} Adam steps in {f['fit_s']:.1f} s, final MSE {f['loss']:.4f}; "
          f"the correct sum scores highest for {100 * f['correct_top']:.0f}% of the 25 prompts", flush=True)
    runs = [("rule reward", []), ("reward model only", [f"reward.model.path={rm}", "reward.combine.function_weight=0",
                                                         "reward.combine.model_weight=1"])]
    results = {}
    for name, extra in runs:
        run_dir = os.path.join(a.out, name.replace(" ", "_"))
        results[name], seconds = launch_run(run_dir, [*BASE, *extra, f"trainer.total_steps={a.steps}",
                                                      f"trainer.test_freq={a.every}"], name=name)
        print(f"{name}: {seconds:.0f} s", flush=True)
    steps = sorted({r["step"] for recs in results.values() for r in recs if "val/score/mean" in r})
    print("| step | " + " | ".join(f"{n}: held-out rule reward" for n, _ in runs) + " | reward model: train reward/model/mean |")
    print("|---" * (2 + len(runs)) + "|")
    for s in steps:
        cells = [f"{next((r['val/score/mean'] for r in results[n] if r['step'] == s and 'val/score/mean' in r), float('nan')):.3f}"
                 for n, _ in runs]
        rm_mean = next((r.get("reward/model/mean") for r in results["reward model only"] if r["step"] == s), None)
        print(f"| {s} | " + " | ".join(cells) + f" | {'-' if rm_mean is None else f'{rm_mean:.3f}'} |")


if __name__ == "__main__":
    main()
