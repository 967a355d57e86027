"""The embedded task with LoRA: held-out reward per 50 steps, LoRA beside full fine-tuning.

A LoRA run cannot learn the embedded default from the randomly initialised ``tiny`` preset:
the frozen random unembedding (std 0.02 over hidden 64) caps any logit gap at about
``|h| * |w_v| ~ 8 * 0.16 ~ 1.3`` nats, so sampling stays near uniform whatever the adapters
do. A real LoRA user starts from a pretrained LM that has already produced every token it
will need, so this script first pretrains one, the way such a base is made:

1. **Pretraining.** Supervised next-token loss (rljax's own model, optax AdamW, one CPU
   device) on arithmetic strings in the task's exact format (``BOS "a-b=c" EOS``): correct
   subtraction ``a-b`` (``0 <= b <= a <= 9``, answers 0..9) and correct addition ``a+b``
   with at least one operand in 5..9 (answers 5..18). It knows the format, ``+``, every digit
   as an answer and EOS, but has never seen the task's 25 prompts (both operands in 0..4).
   Exported with ``save_hf_checkpoint``, loaded with ``model.path``.
2. **RL** on the default preset (GRPO, addition of 0..4, 300 steps, held-out reward every 50)
   from that base: LoRA (rank / alpha / lr below) and full fine-tuning (the preset's lr),
   plus, from the random base for contrast, full fine-tuning and LoRA alone and with
   ``modules_to_save=[lm_head]`` (PEFT's option: the unembedding trains in full beside the
   adapters). One training at a time, ``--mesh=dp8``.

Prints a Markdown table (the README's)::

    python bench/lora_embedded.py --out /tmp/lora_embedded
    python bench/lora_embedded.py --runs pretrained-lora-r16   # one row (the base is reused)
"""

import argparse
import json
import os
import random
import subprocess
import sys
import time

#: (name, label, uses the pretrained base, overrides)
RUNS = [
    ("random-lora-r16", "random base, LoRA rank 16, alpha 32, lr 3e-3", False,
     ["actor.lora.rank=16", "actor.lora.alpha=32", "actor.optim.lr=3e-3"]),
    ("random-lora-r16-lm_head", "random base, LoRA rank 16, alpha 32, lr 3e-3, modules_to_save=[lm_head]", False,
     ["actor.lora.rank=16", "actor.lora.alpha=32", "actor.optim.lr=3e-3", "actor.lora.modules_to_save=[lm_head]"]),
    ("random-full", "random base, full fine-tuning, lr 3e-4 (the preset)", False, []),
    ("pretrained-lora-r16", "pretrained base, LoRA rank 16, alpha 32, lr 3e-3", True,
     ["actor.lora.rank=16", "actor.lora.alpha=32", "actor.optim.lr=3e-3"]),
    ("pretrained-lora-r8", "pretrained base, LoRA rank 8, alpha 16, lr 1e-3", True,
     ["actor.lora.rank=8", "actor.lora.alpha=16", "actor.optim.lr=1e-3"]),
    ("pretrained-lora-r16-lr3e-4", "pretrained base, LoRA rank 16, alpha 32, lr 3e-4 (the full run's lr)", True,
     ["actor.lora.rank=16", "actor.lora.alpha=32", "actor.optim.lr=3e-4"]),
    ("pretrained-full", "pretrained base, full fine-tuning, lr 3e-4 (the preset)", True, []),
]


def corpus_string(rng: random.Random) -> str:
    """One pretraining string: correct subtraction, or correct addition off the task's 0..4 square."""
    while True:
        a, b = rng.randrange(10), rng.randrange(10)
        if rng.random() < 0.5:
            a, b = max(a, b), min(a, b)
            return f"{a}-{b}={a - b}"
        if max(a, b) >= 5:
            return f"{a}+{b}={a + b}"


def pretrain(out: str, *, steps: int = 500, batch: int = 256, lr: float = 1e-3, seed: int = 0) -> dict:
    """Pretrains the ``tiny`` preset on :func:`corpus_string` and writes a HF checkpoint to ``out``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from rljax import models as M

    tok = M.CharTokenizer()
    cfg = M.get_config("tiny").replace(vocab_size=tok.vocab_size, pad_token_id=tok.pad_id,
                                       bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    graphdef, params = M.init_params(cfg, seed=seed)
    opt = optax.adamw(lr, weight_decay=0.0)
    length = 8  # BOS a op b = c c EOS

    def loss_fn(p, tokens):
        mask = tokens != tok.pad_id
        logits = M.compute_logits(p, M.forward(graphdef, p, tokens, mask=mask))[:, :-1]
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]
        return jnp.sum(nll * mask[:, 1:]) / jnp.sum(mask[:, 1:])

    @jax.jit
    def step(p, s, tokens):
        loss, g = jax.value_and_grad(loss_fn)(p, tokens)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    rng, state, t0 = random.Random(seed), opt.init(params), time.perf_counter()
    for _ in range(steps):
        tokens = np.full((batch, length), tok.pad_id, np.int32)
        for i in range(batch):
            ids = tok.encode(corpus_string(rng), add_bos=True, add_eos=True)
            tokens[i, :len(ids)] = ids
        params, state, loss = step(params, state, jnp.asarray(tokens))
    M.save_hf_checkpoint(out, cfg, jax.tree.map(np.asarray, params))
    return {"steps": steps, "batch": batch, "lr": lr, "final_loss": round(float(loss), 3),
            "seconds": round(time.perf_counter() - t0, 1)}


def launch(run_dir, *overrides):
    cmd = [sys.executable, "-m", "rljax.launch", "--mesh=dp8", "--run-dir", run_dir, *overrides]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def curve(run_dir):
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    return [round(r["val/score/mean"], 3) for r in rows if "val/score/mean" in r]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/lora_embedded")
    ap.add_argument("--runs", default=",".join(r[0] for r in RUNS), help="comma-separated: " + ", ".join(r[0] for r in RUNS))
    args = ap.parse_args()
    chosen = args.runs.split(",")
    unknown = [r for r in chosen if r not in {x[0] for x in RUNS}]
    if unknown:
        ap.error(f"unknown run {unknown[0]!r}; accepted: {', '.join(r[0] for r in RUNS)}")
    base_hf = os.path.join(args.out, "base_hf")
    if not os.path.exists(os.path.join(base_hf, "config.json")):
        print("pretraining the base ...", flush=True)
        print("pretrained:", json.dumps(pretrain(base_hf)), flush=True)
    rows = []
    for name, label, pretrained, overrides in RUNS:
        if name not in chosen:
            continue
        run_dir = os.path.join(args.out, name)
        base = ["model.path=" + base_hf, "model.tokenizer=char"] if pretrained else []
        launch(run_dir, *base, *overrides)
        rows.append((label, curve(run_dir)))
    print("\n| run | held-out reward at steps 0, 50, ..., 300 |\n|---|---|")
    for label, c in rows:
        print(f"| {label} | {', '.join(f'{v:.3f}' for v in c)} |")


if __name__ == "__main__":
    main()
