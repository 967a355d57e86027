"""The memory ledger's update activation estimate against XLA's temporaries of the real update.

    python bench/ledger_estimate.py                  # tiny model, 8 rows x 128 tokens, + 31.6M cases
    python bench/ledger_estimate.py --only tiny

Compiles (never runs) the actor update (``make_train_step``: value_and_grad of the actor loss
and AdamW over one micro-batch) for abstract inputs and prints ``compiled.memory_analysis()``'s
temporaries beside :func:`rljax.models.remat.activation_bytes` (or ``remat_bytes`` with remat)
plus the gradients, and the ratio. Compiling the 31.6M update takes a minute or two per case on
this CPU; memory is not allocated.
"""

from __future__ import annotations

import argparse
import os


def measure(mc, rows: int, seq: int, prompt: int = 8) -> int:
    import jax
    import jax.numpy as jnp
    import optax

    from rljax.models import functional as F
    from rljax.trainer import StepConfig, init_state, make_train_step

    graphdef, params = F.init_params(mc, seed=0)
    opt = optax.adamw(1e-5)
    step = make_train_step(graphdef, opt, StepConfig(ppo_mini_batch_size=rows, ppo_micro_batch_size=rows))
    state = jax.eval_shape(lambda: init_state(params, opt))
    T, s = seq - prompt, jax.ShapeDtypeStruct
    batch = dict(input_ids=s((rows, seq), jnp.int32), attention_mask=s((rows, seq), jnp.bool_),
                 positions=s((rows, seq), jnp.int32), loss_mask=s((rows, T), jnp.float32),
                 advantages=s((rows, T), jnp.float32), old_logp=s((rows, T), jnp.float32))
    return step.lower(state, batch, jax.random.key(0)).compile().memory_analysis().temp_size_in_bytes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=("tiny", "31m"), default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from rljax.models.config import get_config
    from rljax.models import remat as R

    tiny = get_config("tiny")
    m31 = tiny.replace(vocab_size=256, hidden_size=512, intermediate_size=2048, num_layers=8, num_heads=8,
                       num_kv_heads=4, head_dim=64)
    cases = []
    if args.only in (None, "tiny"):
        cases += [("tiny", tiny, 8, 128), ("tiny remat full", tiny.replace(remat=True), 8, 128),
                  ("tiny remat minimal", tiny.replace(remat=True, remat_policy="minimal"), 8, 128),
                  ("tiny blockwise (block 32)", tiny.replace(attn_block_size=32), 8, 128)]
    if args.only in (None, "31m"):
        cases += [("31.6M", m31, 64, 40), ("31.6M", m31, 64, 264),
                  ("31.6M blockwise (block 64)", m31.replace(attn_block_size=64), 64, 264)]
    print(f"{'case':<28}{'rows x seq':>11}{'XLA temp MiB':>14}{'estimate MiB':>14}{'+ grads':>9}{'temp / est':>11}"
          f"{'scores MiB':>11}")
    for name, mc, rows, seq in cases:
        est = (R.remat_bytes(mc, rows, seq, policy=mc.remat_policy) if mc.remat
               else R.activation_bytes(mc, rows, seq))
        grads = mc.num_params() * 4
        scores = (1 if mc.remat else mc.num_layers) * R.score_bytes(mc, rows, seq, seq)
        temp = measure(mc, rows, seq)
        mib = 2**20
        print(f"{name:<28}{f'{rows} x {seq}':>11}{temp / mib:>14.1f}{est / mib:>14.1f}{grads / mib:>9.1f}"
              f"{temp / (est + grads):>11.2f}{scores / mib:>11.1f}", flush=True)


if __name__ == "__main__":
    main()
