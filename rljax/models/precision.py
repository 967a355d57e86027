"""``model.matmul_precision``: the precision of float32 matrix multiplies in the learner and
sampler programs, made explicit instead of left to the backend.

JAX traces a ``dot_general`` / ``einsum`` without an explicit ``precision`` at the
``jax_default_matmul_precision`` in effect, and the backend then chooses:

* ``default``: the backend's fastest float32 path. CPU: full float32. NVIDIA GPUs from Ampere
  on: TF32 (10-bit mantissa inputs, float32 accumulation). TPU: one bfloat16 pass.
* ``high``: GPU: TF32 as well (XLA:GPU treats HIGH like DEFAULT for float32); TPU: three
  bfloat16 passes (~bfloat16x3, close to float32). CPU: full float32.
* ``highest``: full float32 everywhere (GPU: IEEE float32 FMA, no tensor-core TF32; TPU: six
  bfloat16 passes). The slowest; what tests that compare numbers across meshes want.

bfloat16 operands are exact in every mode (the products fit float32); only float32 operands
(``model.dtype=float32``, or float32 parts of a bfloat16 model such as the loss) change.
The Pallas kernels of :mod:`rljax.pallas` pin their own precision and are not affected.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import jax

MATMUL_PRECISIONS = ("default", "high", "highest")


def check_matmul_precision(value) -> str:
    if value not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul_precision={value!r}; accepted: {', '.join(MATMUL_PRECISIONS)}")
    return value


def traced_at(fn: Callable, precision: Optional[str]) -> Callable:
    """``fn`` whose matmuls trace at ``precision`` (one of :data:`MATMUL_PRECISIONS`; None: the
    ``jax_default_matmul_precision`` in effect). Wrap the function before ``jax.jit``: the
    setting then lives in the program, whichever thread calls it."""
    if precision is None:
        return fn
    check_matmul_precision(precision)

    @functools.wraps(fn)
    def at_precision(*args, **kwargs):
        with jax.default_matmul_precision(precision):
            return fn(*args, **kwargs)

    return at_precision
