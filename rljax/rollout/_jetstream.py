"""Imports JetStream's Engine API without letting TensorFlow touch an accelerator.

``jetstream.engine`` imports seqio, which imports TensorFlow. TensorFlow would otherwise
log at import time and, on a GPU host, reserve GPU memory that JAX needs. This module is
the one place that imports it: it quiets TensorFlow's C++ logging (only if the caller has
not chosen a level), hides every GPU from TensorFlow (when a CUDA driver exists), then
imports the JetStream modules rljax uses. Nothing in JAX is patched.
"""

from __future__ import annotations

import functools
import os
import types


def _gpu_driver_present() -> bool:
    """Whether a CUDA driver could be loaded (without loading it): otherwise there is no
    GPU to hide, and asking TensorFlow to hide GPUs would only make it log a cuInit error."""
    import ctypes.util  # pylint: disable=import-outside-toplevel
    import glob  # pylint: disable=import-outside-toplevel

    return ctypes.util.find_library("cuda") is not None or bool(glob.glob("/dev/nvidia[0-9]*"))


@functools.lru_cache(maxsize=None)
def jetstream_api() -> types.SimpleNamespace:
    """``engine_api``, ``tokenizer_api``, ``tokenizer_pb2`` and ``token_utils`` from ``jetstream.engine``."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
    except ImportError:  # JetStream may one day stop needing it.
        tf = None
    if tf is not None and _gpu_driver_present():
        try:
            tf.config.set_visible_devices([], "GPU")
        except (RuntimeError, ValueError):
            # RuntimeError: TensorFlow already initialised its devices (someone imported it
            # earlier and used it); nothing more can be done from here.
            pass
        tf.get_logger().setLevel("ERROR")
    # pylint: disable-next=import-outside-toplevel
    from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2

    return types.SimpleNamespace(
        engine_api=engine_api, tokenizer_api=tokenizer_api, tokenizer_pb2=tokenizer_pb2, token_utils=token_utils
    )
