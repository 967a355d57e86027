"""TensorFlow arrives with JetStream (through seqio) and TFDS; JAX owns the accelerators.

The one place that decides how TensorFlow is kept out of the way: it never gets a GPU, and
its native start-up banners (written straight to file descriptor 2 by C++ before any
logging setting applies) are filtered out. This module never imports TensorFlow itself.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

#: Lines TensorFlow's native libraries print while loading on any machine; nothing to act on.
STARTUP_NOISE = (
    "All log messages before absl::InitializeLog() is called",
    "oneDNN custom operations are on",
    "Could not find cuda drivers on your machine",
    "failed call to cuInit",
    "Unable to register cuDNN factory",
    "Unable to register cuFFT factory",
    "Unable to register cuBLAS factory",
    "computation placer already registered",
    "TF-TRT Warning",
)


def gpu_driver_present() -> bool:
    """Whether a CUDA driver could be loaded (without loading it). Without one there is no GPU
    to hide, and asking TensorFlow to hide GPUs would only make it log a cuInit error."""
    import ctypes.util
    import glob

    return ctypes.util.find_library("cuda") is not None or bool(glob.glob("/dev/nvidia[0-9]*"))


def hide_tf_gpus() -> None:
    """If TensorFlow is loaded and a GPU could exist, make TensorFlow see none (JAX owns them)."""
    tf = sys.modules.get("tensorflow")
    if tf is None or not gpu_driver_present():
        return
    with contextlib.suppress(RuntimeError, ValueError, AttributeError):  # RuntimeError: devices already initialised
        tf.config.set_visible_devices([], "GPU")


@contextlib.contextmanager
def quiet_native_stderr(noise=STARTUP_NOISE):
    """Capture file descriptor 2 for the block and replay every line that is not known noise.

    Real errors (anything not matching ``noise``) still reach stderr, in order, when the
    block ends or raises.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            kept = [line for line in text.splitlines(keepends=True) if not any(n in line for n in noise)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
