"""Imports JetStream's Engine API without letting TensorFlow touch an accelerator.

``jetstream.engine.token_utils`` imports seqio, which imports TensorFlow. The Engine API
needs it only for SentencePiece tokenizers, so it is loaded lazily (first attribute read):
a run with the built-in or a ``tokenizer.json`` tokenizer never imports TensorFlow. When it
is loaded, this module is the one place that does it: it quiets TensorFlow's C++ logging
(only if the caller has not chosen a level) and its start-up banners, and hides every GPU
from TensorFlow (when a CUDA driver exists; see :mod:`rljax._tensorflow`). Nothing in JAX
is patched.
"""

from __future__ import annotations

import functools
import os
import sys
import types

from rljax._tensorflow import hide_tf_gpus, quiet_native_stderr


def _load_tensorflow_quietly():
    """Imports TensorFlow (when installed) with its logging quieted and GPUs hidden from it."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    with quiet_native_stderr():
        try:
            import tensorflow as tf  # pylint: disable=import-outside-toplevel
        except ImportError:  # JetStream may one day stop needing it.
            tf = None
    hide_tf_gpus()  # before JetStream's imports can touch a device
    if tf is not None:
        tf.get_logger().setLevel("ERROR")


class _LazyTokenUtils(types.ModuleType):
    """Stands in for ``jetstream.engine.token_utils`` until an attribute is read.

    ``engine_api`` imports ``token_utils`` at module level, and ``token_utils`` imports
    seqio, hence TensorFlow (~0.8 GB resident, tens of seconds on a loaded CPU), though the
    Engine API only uses it in the SentencePiece ``build_tokenizer`` default. The real module
    is loaded (TensorFlow quieted and kept off GPUs) on the first attribute read.
    """

    def __getattr__(self, name):
        # Dunder reads are Python's machinery asking what kind of module this is, not a use of
        # token_utils: inspect.getmodule (torch registering its custom ops, traceback
        # formatting) reads ``__file__`` of every module in sys.modules, and loading
        # TensorFlow there would cost every process that imports torch after JetStream.
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        real = _real_token_utils()
        return getattr(real, name)


def _real_token_utils():
    import importlib  # pylint: disable=import-outside-toplevel

    name = "jetstream.engine.token_utils"
    if isinstance(sys.modules.get(name), _LazyTokenUtils):
        del sys.modules[name]
    _load_tensorflow_quietly()
    with quiet_native_stderr():
        real = importlib.import_module(name)
    setattr(sys.modules["jetstream.engine"], "token_utils", real)
    return real


@functools.lru_cache(maxsize=None)
def jetstream_api() -> types.SimpleNamespace:
    """``engine_api``, ``tokenizer_api``, ``tokenizer_pb2`` and ``token_utils`` from ``jetstream.engine``.

    ``token_utils`` (and with it seqio and TensorFlow) loads only when first used.
    """
    name = "jetstream.engine.token_utils"
    if name not in sys.modules:
        import jetstream.engine  # pylint: disable=import-outside-toplevel

        lazy = _LazyTokenUtils(name)
        sys.modules[name] = lazy
        setattr(jetstream.engine, "token_utils", lazy)
    # pylint: disable-next=import-outside-toplevel
    from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2

    return types.SimpleNamespace(
        engine_api=engine_api, tokenizer_api=tokenizer_api, tokenizer_pb2=tokenizer_pb2, token_utils=token_utils
    )
