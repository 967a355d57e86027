"""Reading an offline Weights & Biases run (``run-<id>.wandb``) without the network: the file is
a LevelDB-style log of ``wandb_internal_pb2.Record`` protobufs (wandb >= 0.19 has no Python
reader of its own)."""

import glob
import os
import struct

_BLOCK, _HEADER = 32768, 7


def records(path):
    """Every ``Record`` of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # block trailer padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0 and length == 0:
            continue
        pending += chunk
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(pending)
            pending = b""
            yield rec


def offline_run(run_dir):
    """``{"history": [{key: value}], "config": {key: value}, "tables": [file]}`` of the one offline run."""
    import json

    (run,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*"))
    (log,) = glob.glob(os.path.join(run, "run-*.wandb"))
    history, config = [], {}
    for rec in records(log):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append({it.key or "/".join(it.nested_key): json.loads(it.value_json) for it in rec.history.item})
        elif kind == "run":
            config.update({it.key: json.loads(it.value_json) for it in rec.run.config.update})
        elif kind == "config":
            config.update({it.key: json.loads(it.value_json) for it in rec.config.update})
    tables = sorted(glob.glob(os.path.join(run, "files", "media", "table", "**", "*.json"), recursive=True))
    return {"history": history, "config": config, "tables": tables}
