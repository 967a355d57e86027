"""Per-device memory of one forward+backward on dp / tp / sp meshes, side by side.

Compiles (never runs) the gradient of a next-token cross-entropy for a mid-size
Llama-style model on 8 simulated CPU devices and prints the per-device argument,
temporary and output bytes from ``compiled.memory_analysis()``, with ratios to ``dp8``.
Expected: argument (parameter) bytes fall ~1/tp; temporary (activation) bytes fall as
the batch or sequence is split (dp, sp), and with tp too: the residual stream between
the tensor-parallel regions is split over tp along the sequence (Megatron-SP, logical
axis ``residual_length``). Each mesh with tp > 1 also gets a ``-SP`` row with that
stream replicated over tp (the layout before Megatron-SP), for comparison.

    python bench/sharding_memory.py                      # 12 layers, hidden 768, seq 4096
    python bench/sharding_memory.py --loss xent          # through full [B,T,V] logits
    python bench/sharding_memory.py --seq 1024 --layers 4 --meshes "dp8;tp8"
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import time  # noqa: E402

import contextlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from rljax import models  # noqa: E402
from rljax import sharding as sh  # noqa: E402
from rljax.sharding import rules as sh_rules  # noqa: E402


@contextlib.contextmanager
def residual_replicated_over_tp():
    """The rule table before Megatron-SP (``residual_length`` on sp only), for the -SP rows.
    The model reads the default table at trace time; a benchmark may swap it, library code never does."""
    saved = sh_rules.LOGICAL_AXIS_RULES
    sh_rules.LOGICAL_AXIS_RULES = tuple((k, "sp" if k == "residual_length" else v) for k, v in saved)
    try:
        yield
    finally:
        sh_rules.LOGICAL_AXIS_RULES = saved


def measure(config, spec, batch, seq, loss_kind):
    mesh = sh.make_mesh(spec)
    graphdef, shapes = models.abstract_params(config)
    shardings = models.param_shardings(config, mesh)
    params = jax.tree.map(lambda s, sd: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sd), shapes, shardings)
    tok_sharding = NamedSharding(mesh, sh.batch_spec((batch, seq), mesh))
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=tok_sharding)

    def loss(params, tokens):
        hidden = models.forward(graphdef, params, tokens, mesh=mesh)
        if loss_kind == "hidden":
            # the transformer body alone: no [B,T,V] logits (the fused log-prob's job)
            return jnp.mean(jnp.square(hidden.astype(jnp.float32)))
        logits = models.compute_logits(params, hidden[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

    step = jax.jit(jax.value_and_grad(loss), out_shardings=(NamedSharding(mesh, jax.sharding.PartitionSpec()), shardings))
    t0 = time.perf_counter()
    compiled = step.lower(params, tokens).compile()
    m = compiled.memory_analysis()
    return dict(arg=m.argument_size_in_bytes, temp=m.temp_size_in_bytes, out=m.output_size_in_bytes, compile_s=time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--mlp", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument(
        "--loss", choices=("hidden", "xent"), default="hidden",
        help="hidden: mean square of the final hidden states (the sharded transformer alone); "
        "xent: next-token cross-entropy through full [B,T,V] logits",
    )
    ap.add_argument("--no-remat", action="store_true", help="keep every layer's activations (default: remat per layer)")
    ap.add_argument("--no-compare", action="store_true", help="skip the -SP rows (residual replicated over tp)")
    ap.add_argument("--meshes", default="dp8;tp8;sp8;dp2,tp2,sp2;dp2,tp4;tp4,sp2;tp2,sp4", help="';'-separated mesh specs; the first is the baseline")
    args = ap.parse_args()

    config = models.ModelConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.mlp, num_layers=args.layers,
        num_heads=args.heads, num_kv_heads=args.kv_heads,
        remat=not args.no_remat,
    )
    meshes = [m.strip() for m in args.meshes.split(";") if m.strip()]
    print(
        f"model: {config.num_layers} layers, hidden {config.hidden_size}, {config.num_heads} heads x {config.head_dim}, "
        f"{config.num_kv_heads} kv heads, mlp {config.intermediate_size}, vocab {config.vocab_size}, "
        f"{config.num_params() / 1e6:.1f}M params (float32), remat={config.remat}, attn_block_size={config.attn_block_size}; "
        f"batch {args.batch} x seq {args.seq}; loss={args.loss}; "
        f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices"
    )
    rows = {}
    for spec in meshes:
        rows[spec] = measure(config, spec, args.batch, args.seq, args.loss)
        if sh.parse_mesh(spec)["tp"] > 1 and not args.no_compare:
            with residual_replicated_over_tp():
                rows[spec + " -SP"] = measure(config, spec, args.batch, args.seq, args.loss)
    base = rows[meshes[0]]
    gib = lambda b: f"{b / 2**30:8.3f}"
    print(f"\n{'mesh':<14}{'args GiB':>10}{'temp GiB':>10}{'out GiB':>10}{'args/' + meshes[0]:>12}{'temp/' + meshes[0]:>12}{'out/' + meshes[0]:>12}{'compile s':>11}")
    for spec, r in rows.items():
        print(
            f"{spec:<14}{gib(r['arg']):>10}{gib(r['temp']):>10}{gib(r['out']):>10}"
            f"{r['arg'] / base['arg']:>12.3f}{r['temp'] / base['temp']:>12.3f}{r['out'] / base['out']:>12.3f}{r['compile_s']:>11.1f}"
        )


if __name__ == "__main__":
    main()
