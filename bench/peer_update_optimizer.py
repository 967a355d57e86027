"""What the update spends after the gradients, at 31.6M: AdamW, clipping, the non-finite checks.

    THREADS=1 taskset -c 1 python bench/peer_update_optimizer.py     # one core, 20 rounds

Times, interleaved in one process, compiled as the update is (``cpu_compiler_options``),
on the 31.6M parameters of ``bench/peer_trl.py`` with random gradients:

* ``step``: :func:`rljax.trainer.step.apply_gradients`, what the update runs after the
  backward pass (global norm, non-finite check and per-group flags, clip + AdamW, the
  skip-select of parameters and moments);
* ``adamw``: the optimizer alone (clip + AdamW + apply), the floor;
* ``no-checks``: the step without the skip-select and the non-finite flags.

Prints CPU-time medians and their share of a whole update (``UPDATE_S``, seconds of CPU of the
update on one core; default 7.1, ``bench/peer_update_torch.py`` THREADS=1).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from _peer_update import model_31m, time_interleaved
from rljax.models import functional as F
from rljax.trainer import step as S

R = int(os.environ.get("R", 20))
UPDATE_S = float(os.environ.get("UPDATE_S", 7.1))


def main():
    _, params = F.init_params(model_31m(), seed=0)
    opt = S.make_optimizer(lr=3e-4, betas=(0.9, 0.99))
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 1e-3, x.shape), x.dtype), params)
    loss = jnp.float32(0.5)
    state = S.init_state(params, opt)

    def full(state, grads, loss):
        return S.apply_gradients(state, grads, loss, opt)

    def adamw(state, grads, loss):
        updates, new_opt = opt.update(grads, state.opt_state, state.params)
        return optax.apply_updates(state.params, updates), new_opt

    def no_checks(state, grads, loss):
        updates, new_opt = opt.update(grads, state.opt_state, state.params)
        return optax.apply_updates(state.params, updates), new_opt, optax.tree.norm(grads)

    opts = S.cpu_compiler_options()
    compiled = {k: jax.jit(f).lower(state, grads, loss).compile(compiler_options=opts)
                for k, f in (("step", full), ("adamw", adamw), ("no-checks", no_checks))}
    n = sum(x.size for x in jax.tree.leaves(params))
    print(f"{n / 1e6:.1f}M parameters; {R} rounds; update on one core ~{UPDATE_S} s CPU (UPDATE_S)")
    times = time_interleaved(compiled, (state, grads, loss), R, base="step")
    if times:
        for k, (w, c) in times.items():
            print(f"{k:<10} {c / UPDATE_S:.1%} of the update's CPU")


if __name__ == "__main__":
    main()
