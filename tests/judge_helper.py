"""A tiny generative judge for the judge tests: rljax's ``tiny`` causal LM fitted (a few seconds
of optax Adam on one CPU device) to answer ``"<c>" EOS`` after ``"...<c>?"``: it repeats the
character before the ``?`` (the last character of the response in the template
``{prompt}{response}?``), so its verdict depends on what the policy wrote. Greedy decoding of
the fitted model gives exactly that verdict on the test strings (asserted by the tests).
"""

from __future__ import annotations

import dataclasses
import random

#: what the judge reads: ``{prompt}{response}?``; it answers the response's last character.
TEMPLATE = "{prompt}{response}?"
CHARS = "0123456789+=abx"


def fit_judge(*, steps: int = 250, seed: int = 0, rows: int = 256):
    """``(model_config, params)`` of the fitted judge (vocabulary of :class:`CharTokenizer`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from rljax import models
    from rljax.tokenizer import CharTokenizer

    tok = CharTokenizer()
    rng = random.Random(seed)
    width = 16
    toks = np.full((rows, width), tok.pad_id, np.int32)
    weight = np.zeros((rows, width), np.float32)
    for i in range(rows):
        text = "".join(rng.choice(CHARS) for _ in range(rng.randrange(1, 10)))
        ids = tok.encode(text + "?", add_bos=True) + tok.encode(text[-1], add_eos=True)
        toks[i, :len(ids)] = ids
        weight[i, len(ids) - 3:len(ids) - 1] = 1.0  # predict the verdict (after '?') and EOS (after it)
    config = dataclasses.replace(models.get_config("tiny"), vocab_size=tok.vocab_size, num_layers=1, pad_token_id=tok.pad_id,
                                 bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    graphdef, params = models.init_params(config, seed=seed)
    opt = optax.adam(3e-3)
    opt_state = opt.init(params)
    mask = toks != tok.pad_id

    def loss_fn(p):
        logits = models.compute_logits(p, models.forward(graphdef, p, toks, mask=mask))
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
        nll = -jnp.take_along_axis(logp, toks[:, 1:, None], -1)[..., 0]
        return jnp.sum(nll * weight[:, :-1]) / jnp.sum(weight)

    @jax.jit
    def step(p, o):
        loss, g = jax.value_and_grad(loss_fn)(p)
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state)
    return config, params, float(loss)
