"""``python -m rljax.launch ... --plan [--device-memory SIZE]``: the memory plan before launch.

Usage errors answer in one line with exit 2 before JAX compiles anything; a plan writes
nothing and exits 0 when the run fits, 1 (naming a change that fits) when not; the 7B GSM8K
config fits one 80 GB 8-chip host on fsdp8 and not on dp8, where the plan names fsdp8.
"""

import os

import pytest

from launching import launch, launch_env
from rljax.plan import parse_bytes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("text, n", [("80GiB", 80 * 2**30), ("16GB", 16 * 10**9), ("16g", 16 * 10**9),
                                     ("1.5TiB", int(1.5 * 2**40)), ("512 MiB", 512 * 2**20), ("4096", 4096)])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


def test_xla_cpu_caveat_for_bfloat16(devices):
    """A plan measured by XLA:CPU says its float32 copies of bfloat16 arrays make it pessimistic
    for a bfloat16 accelerator (docs/benchmarks/memory.md#fsdp-on-16-gb-chips); not for float32."""
    from rljax import sharding as sh
    from rljax.models.config import get_config
    from rljax.plan import cpu_bf16_note

    mesh, tiny = sh.make_mesh("fsdp8"), get_config("tiny")
    assert cpu_bf16_note(tiny.replace(dtype="float32", param_dtype="float32"), mesh) == ""
    for dtype, param_dtype in (("bfloat16", "float32"), ("float32", "bfloat16")):
        note = cpu_bf16_note(tiny.replace(dtype=dtype, param_dtype=param_dtype), mesh)
        assert note.startswith("; XLA:CPU keeps float32 copies of bfloat16 arrays"), note


def test_formula_plan_counts_the_fsdp_gathers(devices):
    """The formula path (the suggestions' and an uncompilable plan's) counts what fsdp gathers at
    once: two whole layers and the whole unembedding (a split over tp would stay); dp8 gathers
    nothing. The 7B GSM8K config's formulas were 1.7-1.9x below XLA without it
    (docs/benchmarks/memory.md#fsdp-on-16-gb-chips)."""
    import math

    import jax
    import numpy as np

    from rljax import plan as P, sharding as sh
    from rljax.config import resolve
    from rljax.models import functional as F

    cfg, _ = resolve("default", [])
    mc = P.model_config_for(cfg)
    _, shapes = F.abstract_params(mc)
    width = max(np.dtype(mc.jnp_dtype).itemsize, np.dtype(mc.jnp_param_dtype).itemsize)
    layer = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes["layers"])) // mc.num_layers
    unembed = math.prod(shapes["embed" if mc.tie_embeddings else "lm_head"].shape)
    rows = {}
    for spec in ("fsdp8", "dp8"):
        plan = P.plan(cfg, sh.make_mesh(spec), device_bytes=2**30, compile=False)
        rows[spec] = {r.item: r.bytes for r in plan.rows}
        assert plan.total == sum(rows[spec].values()) and plan.source.startswith("formulas"), plan.source
    assert rows["fsdp8"]["gathered weights"] == (2 * layer + unembed) * width
    assert "gathered weights" not in rows["dp8"]


def test_kv_cache_that_rollout_tp_cannot_split_is_named(devices):
    """The tiny model has 2 KV heads: ``rollout.tp=4`` cannot split them, so every tp device holds
    its replica's whole cache (the plan's row counts it and says so, with the rollout.tp values
    that split it; the launch echoes the same line at build); ``rollout.tp=2`` splits it in two
    and says nothing."""
    from rljax import plan as P
    from rljax.config import resolve
    from rljax.rollout.mesh import kv_heads_note

    assert kv_heads_note(2, 1) is None and kv_heads_note(4, 2) is None and kv_heads_note(8, 8) is None
    assert kv_heads_note(4, 8) == ("rollout: rollout.tp=8 does not divide the model's 4 KV heads: each tp device "
                                   "holds its replica's whole KV cache (8 copies); rollout.tp in [1, 2, 4] splits it")
    rows = {}
    for tp in (2, 4):
        cfg, _ = resolve("default", [f"rollout.tp={tp}"])
        mc = P.model_config_for(cfg)
        assert mc.num_kv_heads == 2
        rows[tp] = {r.item: r for r in P.sampler_rows(cfg, mc, devices)}["sampler KV cache"]
    # tp=4 (dp2): twice tp=2's slots a device (dp4), and both heads instead of one
    assert rows[4].bytes == 4 * rows[2].bytes, (rows[2], rows[4])
    assert "does not divide" not in rows[2].how and "kv heads] 128 x 1" in rows[2].how, rows[2].how
    assert "kv heads] 256 x 2" in rows[4].how and rows[4].how.endswith("rollout.tp=4 does not divide the model's 2 KV heads: each tp device holds its "
                                    "replica's whole KV cache (4 copies); rollout.tp in [1, 2] splits it"), rows[4].how


@pytest.mark.parametrize("text", ["80Gx", "GiB", "-1GiB", "0GB", "eighty", ""])
def test_parse_bytes_refuses_in_one_line(text):
    with pytest.raises(ValueError) as e:
        parse_bytes(text)
    assert "\n" not in str(e.value) and "--device-memory" in str(e.value) and "GiB" in str(e.value)


def _one_line_exit_2(out, fragment, tmp_path):
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], out.stderr
    assert "memory plan" not in out.stdout
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("args, fragment", [
    (["--plan", "--device-memory", "80Gx"], "--device-memory '80Gx' is not a memory size"),
    (["--plan", "--mesh=fsdp3"], "divisible by the mesh's dp*fsdp=1*3=3"),
    pytest.param(["--device-memory", "80GiB"], "--device-memory is read by --plan only", marks=pytest.mark.slow),
    pytest.param(["--plan", "--mesh=fsdp8,xp2"], "unknown axis 'xp'", marks=pytest.mark.slow),
    # the plan reads a checkpoint's shapes from its config.json (was a FileNotFoundError traceback)
    pytest.param(["--plan", "model.path=/nonexistent/ckpt"], "model.path='/nonexistent/ckpt': cannot read "
                 "/nonexistent/ckpt/config.json", marks=pytest.mark.slow),
])
def test_plan_usage_errors(tmp_path, args, fragment):
    out = launch(*args, "--run-dir", str(tmp_path / "run"), timeout=120)
    _one_line_exit_2(out, fragment, tmp_path)


@pytest.mark.slow  # JAX starts (~10 s): the refusal itself is Placement.compute's, tested in tests/launch
def test_plan_mesh_that_does_not_fit_the_devices(tmp_path):
    """4 devices already configured (XLA_FLAGS), a mesh of 8: one line, exit 2."""
    import subprocess
    import sys

    env = launch_env()
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    out = subprocess.run([sys.executable, "-m", "rljax.launch", "--plan", "--mesh=fsdp8", "--run-dir",
                          str(tmp_path / "run")], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    _one_line_exit_2(out, "mesh fsdp8 needs 8 devices, found 4 (cpu)", tmp_path)


@pytest.mark.slow
def test_plan_of_the_default_task(tmp_path):
    """The default task on fsdp8 fits 1 GiB (exit 0, XLA's analysis); on dp8 in 1 MiB nothing fits
    (exit 1, says so); the run directory is never created."""
    fits = launch("--mesh=fsdp8", "--plan", "--device-memory", "1GiB", "--run-dir", str(tmp_path / "run"), timeout=600)
    assert fits.returncode == 0, fits.stdout[-3000:] + fits.stderr[-3000:]
    assert "memory plan per device, mesh fsdp8 (XLA" in fits.stdout and "fits:" in fits.stdout
    no = launch("--mesh=dp8", "--plan", "--device-memory", "1MiB", "--run-dir", str(tmp_path / "run"), timeout=600)
    assert no.returncode == 1 and "does NOT fit" in no.stdout and "no single change tried fits" in no.stdout, no.stdout
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_7b_fits_one_80gb_host_on_fsdp8_not_on_dp8(tmp_path):
    fits = launch("--config", "qwen2_5_7b_gsm8k", "--mesh=fsdp8", "--plan", "--device-memory", "80GiB",
                  "--run-dir", str(tmp_path / "run"), timeout=900)
    assert fits.returncode == 0, fits.stdout[-3000:] + fits.stderr[-3000:]
    assert "fits:" in fits.stdout and "XLA" in fits.stdout and "sampler KV cache" in fits.stdout
    no = launch("--config", "qwen2_5_7b_gsm8k", "--mesh=dp8", "--plan", "--device-memory", "80GiB",
                "--run-dir", str(tmp_path / "run"), timeout=900)
    assert no.returncode == 1, no.stdout[-3000:] + no.stderr[-3000:]
    assert "does NOT fit" in no.stdout
    assert "smallest change that fits: --mesh=fsdp8" in no.stdout, no.stdout
    assert not os.listdir(tmp_path)


def test_suggestion_is_checked_by_xla_when_the_plan_was(devices):
    """A plan measured by XLA names a change only once XLA says it fits too: the tiny default on
    fsdp8 without remat (6.6 MB) in 3.9 MB, between the formulas' 3.80 MB and XLA's 4.04 MB for
    micro-batch 128, which the formulas alone would name (remat=true: 3.98 MB by the formulas,
    not compiled), is not told micro-batch 128: it is reported as accepted by the formulas and refused
    by XLA. One compile (~4 s; the next candidate, micro-batch 64, XLA 2.60 MB, would be named
    with a second)."""
    from rljax import plan as P, sharding as sh
    from rljax.config import resolve

    def reconfigure(extra):
        return resolve("default", ["trainer.mesh=fsdp8", "model.remat=false"] + extra)[0]

    cfg, mesh, bound = reconfigure([]), sh.make_mesh("fsdp8"), 3_900_000
    by_formulas, _ = P.suggest(cfg, mesh, bound, reconfigure, devices, compile=False)
    assert by_formulas[0] == "actor.ppo_micro_batch_size=128", by_formulas[0]
    found, rejected = P.suggest(cfg, mesh, bound, reconfigure, devices, compile=True, max_compiles=1)
    assert found is None, found[0]
    assert [(text, f.fits, x.fits, x.source[:4]) for text, f, x in rejected] == [
        ("actor.ppo_micro_batch_size=128", True, False, "XLA:")], rejected
    # the budget bounds the compiles: with none left, nothing is named
    assert P.suggest(cfg, mesh, bound, reconfigure, devices, compile=True, max_compiles=0) == (None, [])
