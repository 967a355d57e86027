"""``python -m rljax.trace samples RUN | head`` ends quietly (issue 38: a BrokenPipeError traceback)."""

import json
import subprocess
import sys

from launching import launch_env


def test_samples_into_head_prints_no_traceback(tmp_path):
    rows = [{"step": 4, "split": "val", "uid": f"u{i}", "session": 0, "prompt": "p" * 2000, "response": "r" * 2000,
             "reward": 1.0, "ground_truth": "2"} for i in range(200)]  # far more than a pipe buffer holds
    (tmp_path / "generations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = f"{sys.executable} -m rljax.trace samples {tmp_path} | head -n 3"
    out = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd}"], capture_output=True, text=True, env=launch_env(),
                         timeout=120)
    assert len(out.stdout.splitlines()) == 3
    assert out.stderr == "", out.stderr[-2000:]
    assert out.returncode == 141  # pipefail: the reader left first, as with any C tool
