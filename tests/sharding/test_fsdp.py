"""The ``fsdp`` mesh axis end to end: the training state split over it, the same numbers as ``dp``.

* in process (slow): the compiled update's state bytes per device fall as 1/fsdp (abstract
  shapes: nothing runs), and the update step on ``fsdp4,tp2`` equals the one-device update
  (the default run checks the shards eagerly: tests/sharding/test_sharding.py);
* through the launcher (slow): 3-4 steps of the default task on ``fsdp8``, ``dp2,fsdp4`` and
  ``fsdp4,tp2`` (also with LoRA and with GAE's critic) give the ``dp8`` run's numbers, and a
  checkpoint moves between ``dp8`` and ``fsdp8`` both ways with the uninterrupted run's numbers.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import sharding as sh
from rljax.models import functional as F
from rljax.models.config import get_config

CFG = get_config("tiny").replace(dtype="float32", param_dtype="float32")


def _batch(B, S, T, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, CFG.vocab_size, (B, S + T)).astype(np.int32)
    mask = np.ones((B, S + T), bool)
    mask[0, :3] = False  # a left-padded prompt
    return {"input_ids": ids, "attention_mask": mask,
            "positions": np.broadcast_to(np.arange(S + T), (B, S + T)).astype(np.int32),
            "loss_mask": (rng.random((B, T)) > 0.2).astype(np.float32),
            "advantages": rng.normal(size=(B, T)).astype(np.float32),
            "old_logp": -rng.random((B, T)).astype(np.float32) - 1.0}


def _update(params, batch, mesh):
    import optax

    from rljax.trainer import StepConfig, init_state, make_train_step

    opt = optax.sgd(1e-2)  # Adam's normalisation would turn float noise in a near-zero gradient into a full step
    graphdef, _ = F.abstract_params(CFG)
    step = make_train_step(graphdef, opt, StepConfig(ppo_mini_batch_size=8, ppo_micro_batch_size=4), mesh=mesh)
    if mesh is not None:
        params = jax.device_put(params, F.param_shardings(CFG, mesh))
        batch = sh.place_batch(batch, mesh)
    state, metrics = step(init_state(jax.tree.map(jnp.copy, params), opt), batch, jax.random.key(0))  # donated
    return state, metrics


@pytest.mark.slow  # ~13 s of compiles; the launch tests below compare whole runs
def test_fsdp_update_equals_one_device(devices):
    """The update on fsdp4,tp2 (the parameters split 4 x 2 ways, gathered per layer) moves the
    parameters as on one device; the parameters it returns stay split."""
    _, params = F.init_params(CFG, seed=0)
    batch = _batch(8, 6, 10)
    ref, mref = _update(params, batch, None)
    mesh = sh.make_mesh("fsdp4,tp2")
    out, mout = _update(params, batch, mesh)
    for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(out.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(mout["loss"]), np.asarray(mref["loss"]), rtol=1e-4, atol=1e-6)
    q = out.params["layers"]["attn"]["q_proj"]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tp")
    assert q.addressable_shards[0].data.size * 8 == q.size


@pytest.mark.slow  # compiles of the whole update (~10 s each); the default run checks the shards eagerly
@pytest.mark.parametrize("specs", [("dp8", "fsdp8"), ("dp8", "dp4,fsdp2", "dp2,fsdp4")])
def test_state_bytes_per_device_fall_as_one_over_fsdp(devices, specs):
    """Compiled memory analysis of the real update (abstract shapes, compile only): the state the
    update takes (its arguments less the batch) on fsdp2 / fsdp4 / fsdp8 is 1/2, 1/4, 1/8 of dp8's."""
    from rljax import plan as P
    from rljax.config import derive, resolve
    from rljax.trainer.build import optimizer_for

    cfg, _ = resolve("default", ["actor.use_kl_loss=false", "rollout.correction=none"])
    mc = get_config("tiny").replace(hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=8, head_dim=32,
                                    vocab_size=512, num_layers=1)
    sizes = derive(cfg)
    opt = optimizer_for(cfg.actor.optim, cfg.actor.grad_clip, 10)
    state = {}
    for spec in specs:
        mesh = sh.make_mesh(spec)
        learner = P.abstract_learner(cfg, mc, mesh, opt)
        m = P.compiled_update(cfg, mc, mesh, sizes, learner, opt)
        batch = P._local(P.update_batch(cfg, mesh, sizes))
        state[spec] = (m["argument"] - batch, learner.params + learner.opt)
    for spec in specs[1:]:
        fsdp = sh.parse_mesh(spec, devices=8)["fsdp"]
        measured, exact = state[spec]
        ratio = measured / state["dp8"][0]
        assert 0.95 / fsdp < ratio < 1.1 / fsdp, (spec, ratio)
        assert abs(measured - exact) <= 0.01 * exact + 64, (spec, measured, exact)  # XLA counts the shards we do


def _scanned_update_temp(layers: int) -> tuple[int, int]:
    """``(temporaries per device, one layer's parameter bytes)`` of a compiled (never run) update
    on ``fsdp8``: gradients of the scanned forward accumulated over 2 micro-batches (a loop around
    the layer scan, where XLA could hoist a loop-invariant gather), then an SGD step. Wide layers
    and 8 tokens a row, so one layer's weights outweigh its activations."""
    from jax.sharding import NamedSharding, PartitionSpec

    h = 1024
    mc = get_config("tiny").replace(hidden_size=h, intermediate_size=2 * h, num_heads=8, num_kv_heads=8,
                                    head_dim=h // 8, num_layers=layers, dtype="float32", param_dtype="float32",
                                    remat=True)
    mesh = sh.make_mesh("fsdp8")
    graphdef, shapes = F.abstract_params(mc)
    shard = F.param_shardings(mc, mesh)
    params = jax.tree.map(lambda s, d: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=d), shapes, shard)
    tokens = jax.ShapeDtypeStruct((2, 8, 8), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec(None, "fsdp")))

    def update(p, micro_batches):
        def micro(acc, t):
            g = jax.grad(lambda q: jnp.mean(F.forward(graphdef, q, t, mesh=mesh).astype(jnp.float32) ** 2))(p)
            return jax.tree.map(jnp.add, acc, g), None

        acc, _ = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, p), micro_batches)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, acc)

    compiled = jax.jit(update, out_shardings=shard, donate_argnums=0).lower(params, tokens).compile()
    layer = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes["layers"])) // layers
    return compiled.memory_analysis().temp_size_in_bytes, layer


def test_fsdp_gathers_one_layer_at_a_time(devices):
    """XLA gathers each layer's fsdp shards inside the layer scan, not the whole stacked
    ``[L, ...]`` weights before it: the update's temporaries per device grow with depth by about
    a layer's gradient shards (accumulator + micro-batch gradient, 2/8 of a layer: 10 of 40 MiB),
    not by a gathered layer (the stack gathered before the scan grows them by ~85 MiB a layer)."""
    t2, layer = _scanned_update_temp(2)
    t4, _ = _scanned_update_temp(4)
    per_layer = (t4 - t2) / 2
    assert per_layer < 0.5 * layer, (f"temporaries grow by {per_layer / 2**20:.1f} MiB per layer of "
                                     f"{layer / 2**20:.1f} MiB: the fsdp gather is not per layer")


# ------------------------------------------------------------------------------ through the launcher

SMALL = ["data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4", "data.embedded.num_train=64",
         "data.embedded.num_test=16", "trainer.test_freq=-1", "trainer.val_before_train=false"]
#: Wall clocks and per-process facts: not numbers of the run.
SKIP = ("timing_s/", "timing_per_token_ms/", "perf/", "time/", "trace/", "comm_s/")


def _run(tmp_path, name, mesh, *extra, steps=3):
    from launching import launch, metrics

    run = tmp_path / name
    out = launch(f"--mesh={mesh}", "--run-dir", str(run), *SMALL, f"trainer.total_steps={steps}", *extra)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return run, metrics(run)


#: The full fine-tuning case's runs (dp8, fsdp8, fsdp4,tp2) take 4 steps with a checkpoint at step 2:
#: test_checkpoint_moves_between_dp8_and_fsdp8 resumes copies of the dp8 and fsdp8 ones from it.
FULL = ("trainer.save_freq=2",)


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory):
    """``get(mesh) -> (run directory, metrics)``: the full fine-tuning case's run on ``mesh``
    (:data:`FULL`, 4 steps), launched once for this module; read-only (copy before resuming)."""
    tmp, runs = tmp_path_factory.mktemp("full"), {}

    def get(mesh):
        if mesh not in runs:
            runs[mesh] = _run(tmp, mesh.replace(",", "_"), mesh, *FULL, steps=4)
        return runs[mesh]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("extra, meshes", [
    ((), ("fsdp8", "fsdp4,tp2")),  # dp2,fsdp4: the gae case's mesh (one launch less in the slow pass)
    (("actor.lora.rank=8",), ("fsdp4,tp2",)),
    (("algorithm.adv_estimator=gae",), ("dp2,fsdp4",)),
], ids=["grpo", "lora", "gae"])
def test_fsdp_meshes_give_the_dp8_numbers(tmp_path, full_runs, extra, meshes):
    """3 steps of the default task (4 in the full fine-tuning case, whose runs the checkpoint test
    shares): every number of the dp8 run, on meshes that split the state over fsdp (rel 1e-5 /
    abs 1e-6, as the other meshes are compared); topology.json and the memory ledger name the axis,
    and the ledger's parameters fall as 1/(tp x fsdp)."""
    from launching import assert_same_metrics

    run_on = full_runs if not extra else (lambda mesh: _run(tmp_path, mesh.replace(",", "_"), mesh, *extra))
    ref_dir, ref = run_on("dp8")
    ledger = json.loads((ref_dir / "memory_ledger.json").read_text())
    base = next(r for r in ledger["rows"] if r["item"] == "parameters")["measured_bytes"]
    for mesh in meshes:
        run, got = run_on(mesh)
        assert_same_metrics(ref, got, skip=SKIP)
        topo = json.loads((run / "topology.json").read_text())
        sizes = sh.parse_mesh(mesh, devices=8)
        assert topo["mesh"] == sizes and topo["state_shards"] == sizes["fsdp"] and "fsdp" in topo["mesh_axis_names"]
        assert topo["actor_dp"] == sizes["dp"] * sizes["fsdp"]
        rows = {r["item"]: r for r in json.loads((run / "memory_ledger.json").read_text())["rows"]}
        assert "fsdp" in rows["parameters"]["formula"]
        if not extra:  # full fine-tuning: every large parameter splits over tp x fsdp
            shards = sizes["tp"] * sizes["fsdp"]
            assert rows["parameters"]["measured_bytes"] < 1.3 * base / shards, (mesh, rows["parameters"], base)


@pytest.mark.slow
def test_checkpoint_moves_between_dp8_and_fsdp8(tmp_path, full_runs):
    """A dp8 checkpoint resumed on fsdp8, and an fsdp8 one on dp8, continue with the uninterrupted
    dp8 run's numbers; the resumed run's state is laid out on its own mesh (ledger). The checkpoints
    are step 2 of the full fine-tuning runs on dp8 and fsdp8 (4 steps): a copy of each run directory
    resumed with ``--resume=2`` cuts its records after step 2, sets checkpoint 4 aside and runs
    steps 3-4 again on the other mesh."""
    import shutil

    from launching import launch, metrics

    full_dir, full = full_runs("dp8")
    ref = {r["step"]: r for r in full if "actor/pg_loss" in r}
    for first, then in (("dp8", "fsdp8"), ("fsdp8", "dp8")):
        run = tmp_path / f"{first}_to_{then}"
        shutil.copytree(full_runs(first)[0], run)
        out = launch(f"--mesh={then}", "--resume=2", "--run-dir", str(run), *SMALL, *FULL, "trainer.total_steps=4")
        assert out.returncode == 0, out.stderr[-3000:]
        assert "resumed from checkpoint   2" in out.stdout
        rows = [r for r in metrics(run) if "actor/pg_loss" in r]
        assert [r["step"] for r in rows] == [1, 2, 3, 4], [r["step"] for r in rows]  # 3 and 4 cut, then run again
        got = {r["step"]: r for r in rows}
        compared = 0
        for step in (3, 4):
            for key, value in ref[step].items():
                if isinstance(value, (int, float)) and not key.startswith(SKIP):
                    assert math.isclose(value, got[step][key], rel_tol=1e-5, abs_tol=1e-6), (first, then, step, key)
                    compared += 1
        assert compared > 40
        # the copy's ledger was its first mesh's: the resumed run rewrote it for its own
        p = {r["item"]: r for r in json.loads((run / "memory_ledger.json").read_text())["rows"]}["parameters"]
        assert ("fsdp" in p["formula"]) == (then == "fsdp8") and p["measured_bytes"] < 1.3 * p["estimate_bytes"], p
