"""Imports JetStream's Engine API without letting TensorFlow touch an accelerator.

``jetstream.engine`` imports seqio, which imports TensorFlow. TensorFlow would otherwise
log at import time and, on a GPU host, reserve GPU memory that JAX needs. This module is
the one place that imports it: it quiets TensorFlow's C++ logging (only if the caller has
not chosen a level) and its start-up banners, imports the JetStream modules rljax uses, then
hides every GPU from TensorFlow (when a CUDA driver exists; see :mod:`rljax._tensorflow`).
Nothing in JAX is patched.
"""

from __future__ import annotations

import functools
import os
import types

from rljax._tensorflow import hide_tf_gpus, quiet_native_stderr


@functools.lru_cache(maxsize=None)
def jetstream_api() -> types.SimpleNamespace:
    """``engine_api``, ``tokenizer_api``, ``tokenizer_pb2`` and ``token_utils`` from ``jetstream.engine``."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    with quiet_native_stderr():
        try:
            import tensorflow as tf  # pylint: disable=import-outside-toplevel
        except ImportError:  # JetStream may one day stop needing it.
            tf = None
    hide_tf_gpus()  # before JetStream's imports can touch a device
    if tf is not None:
        tf.get_logger().setLevel("ERROR")
    with quiet_native_stderr():
        # pylint: disable-next=import-outside-toplevel
        from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2

    return types.SimpleNamespace(
        engine_api=engine_api, tokenizer_api=tokenizer_api, tokenizer_pb2=tokenizer_pb2, token_utils=token_utils
    )
