"""``rljax.trace._io.write_atomic`` (``trace_summary.json``'s rewrite after every step): the new text
in one rename, or, when the write fails part way (a file-size limit: the kernel's own ``EFBIG``,
as a full disk fails a write), the previous file whole and no temporary file left behind."""

import os
import subprocess
import sys

from rljax.trace._io import write_atomic

_LIMITED = r"""
import resource, signal, sys
from rljax.trace._io import write_atomic
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    write_atomic(sys.argv[1], "é" * 10000)  # 20000 bytes: written in part, then refused
except OSError as e:
    print("OSError", e.errno)
"""


def test_a_whole_rewrite_replaces_the_file(tmp_path):
    path = str(tmp_path / "s.json")
    write_atomic(path, '{"old": 1}')
    write_atomic(path, '{"new": "é"}')
    assert open(path, encoding="utf-8").read() == '{"new": "é"}'
    assert os.listdir(tmp_path) == ["s.json"]


def test_a_write_cut_short_keeps_the_previous_file_and_leaves_no_temporary(tmp_path):
    path = str(tmp_path / "s.json")
    write_atomic(path, '{"old": 1}')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _LIMITED, path], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.strip() == "OSError 27", (out.stdout, out.stderr)  # EFBIG
    assert open(path, encoding="utf-8").read() == '{"old": 1}'
    assert os.listdir(tmp_path) == ["s.json"]
