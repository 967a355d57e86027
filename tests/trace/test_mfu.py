"""Model FLOPs (6N + attention) and MFU against the peak table."""

import dataclasses

import jax
import pytest

from rljax.models import flops as F
from rljax.models.config import get_config
from rljax.trace import mfu as M

CFG = get_config("tiny")


def test_flops_formulas_by_hand():
    n = F.matmul_params(CFG)
    assert n == CFG.num_params() - CFG.vocab_size * CFG.hidden_size  # untied: embedding lookup excluded
    tied = CFG.replace(tie_embeddings=True)
    assert F.matmul_params(tied) == tied.num_params()
    lhq = CFG.num_layers * CFG.num_heads * CFG.head_dim
    assert F.train_flops(CFG, [3, 5]) == 6 * n * 8 + 12 * lhq * (9 + 25)
    assert F.forward_flops(CFG, [4]) == pytest.approx((6 * n * 4 + 12 * lhq * 16) / 3)
    # decode contexts 2, 3, 4 after a prompt of 2
    assert F.rollout_flops(CFG, [2], [3]) == 2 * n * 2 + 4 * lhq * 4 + 2 * n * 3 + 4 * lhq * (2 + 3 + 4)


@dataclasses.dataclass
class _Dev:
    device_kind: str
    platform: str = "gpu"


def test_peak_table_and_mfu():
    assert M.peak_flops("TPU v5 lite") == 197e12 and M.peak_flops("TPU v5p") == 459e12
    assert M.peak_flops("TPU v4") == 275e12 and M.peak_flops("TPU v6 lite") == 918e12
    assert M.peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and M.peak_flops("NVIDIA A100-SXM4-40GB") == 312e12
    assert M.peak_flops("NVIDIA H200") == 989e12 and M.peak_flops("cpu") is None
    assert M.mfu(989e12, 2.0, [_Dev("NVIDIA H200")] * 4) == pytest.approx(0.125)
    assert M.mfu(1e12, 1.0, jax.devices()) is None  # CPU: no peak, no metric
    out = M.mfu_metrics(CFG, update_lengths=[10, 20], update_s=1.0, prompt_lengths=[5], response_lengths=[7],
                        gen_s=1.0, devices=[_Dev("TPU v4")])
    assert out["perf/mfu/actor"] == pytest.approx(F.train_flops(CFG, [10, 20]) / 275e12)
    assert out["perf/mfu/rollout"] == pytest.approx(F.rollout_flops(CFG, [5], [7]) / 275e12)
    assert M.mfu_metrics(CFG, update_lengths=[10], update_s=1.0, devices=jax.devices()) == {}
