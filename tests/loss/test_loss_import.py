"""`import rljax.loss` must not pull in flax, TensorFlow, TFDS or JetStream."""

import json
import subprocess
import sys

HEAVY = ("flax", "tensorflow", "tensorflow_datasets", "jetstream", "torch", "orbax")


def test_import_rljax_loss_is_light():
    code = (
        "import json, sys, time; t = time.perf_counter(); import rljax.loss; "
        "dt = time.perf_counter() - t; "
        f"print(json.dumps({{'heavy': [m for m in {HEAVY!r} if m in sys.modules], 'seconds': dt}}))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["heavy"] == [], f"import rljax.loss imported {report['heavy']}"
