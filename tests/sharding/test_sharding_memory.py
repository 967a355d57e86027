"""Per-device memory falls as tp and sp grow (compiled.memory_analysis(), compile only)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rljax import models
from rljax import sharding as sh

# Five compiles of a small model: a few seconds each, so outside the default run; the
# full-size table is bench/sharding_memory.py.
pytestmark = pytest.mark.slow

CONFIG = models.ModelConfig(
    vocab_size=512, hidden_size=128, intermediate_size=512, num_layers=2, num_heads=8, num_kv_heads=8,
    remat=True, attn_block_size=128,
)
BATCH, SEQ = 8, 1024


def _memory(spec):
    mesh = sh.make_mesh(spec)
    graphdef, shapes = models.abstract_params(CONFIG)
    shardings = models.param_shardings(CONFIG, mesh)
    params = jax.tree.map(lambda s, sd: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sd), shapes, shardings)
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32, sharding=NamedSharding(mesh, sh.batch_spec((BATCH, SEQ), mesh)))

    def loss(params, tokens):
        hidden = models.forward(graphdef, params, tokens, mesh=mesh)
        return jnp.mean(jnp.square(hidden))

    step = jax.jit(jax.grad(loss), out_shardings=shardings)
    m = step.lower(params, tokens).compile().memory_analysis()
    return m.argument_size_in_bytes, m.temp_size_in_bytes


@pytest.fixture(scope="module")
def memory(devices):
    return {spec: _memory(spec) for spec in ["dp8", "tp8", "dp2,tp4", "dp2,tp2,sp2", "tp2,sp4"]}


def test_parameter_bytes_fall_with_tp(memory):
    base = memory["dp8"][0]
    for spec, tp in [("tp8", 8), ("dp2,tp4", 4), ("dp2,tp2,sp2", 2), ("tp2,sp4", 2)]:
        ratio = memory[spec][0] / base
        assert 0.9 / tp < ratio < 1.25 / tp, (spec, ratio)


def test_tp_does_not_raise_activation_bytes(memory):
    # Megatron-SP: the residual stream between blocks is split over tp along the sequence
    # (replicated over tp, tp8 needed 1.65x dp8's temporaries on this config; now 1.04x)
    temp = {spec: m[1] for spec, m in memory.items()}
    assert temp["tp8"] < 1.1 * temp["dp8"], temp


def test_activation_bytes_split_over_every_mesh_axis(memory):
    # Activations are split over dp x tp x sp (Megatron-SP shards the residual stream over tp
    # as well as sp), so on 8 devices every layout holds about dp8's temporaries. Without the
    # sp split tp2,sp4 would hold ~4x, without Megatron-SP tp8 ~1.65x (measured before it).
    temp = {spec: m[1] for spec, m in memory.items()}
    for spec, t in temp.items():
        assert 0.9 < t / temp["dp8"] < 1.15, (spec, temp)
