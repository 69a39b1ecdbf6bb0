"""Read back what the trackers wrote: TensorBoard event files through the tensorboard package's own reader, and W&B
offline run files (``run-<id>.wandb``: a LevelDB-style log of protobuf records) through W&B's own record type."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768  # the log's block size; a record's 7-byte header never straddles a block's end
HEADER = 7  # checksum (4), length (2), type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} in the order TensorBoard shows them (every event file of the directory)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _records(data: bytes):
    """The payloads of a W&B log file (after its 7-byte file header), fragments joined."""
    at, pending = HEADER, b""
    while at + HEADER <= len(data):
        room = BLOCK - at % BLOCK
        if room < HEADER:  # the block's tail is padding
            at += room
            continue
        _, length, kind = struct.unpack("<IHB", data[at:at + HEADER])
        body = data[at + HEADER:at + HEADER + length]
        at += HEADER + length
        if kind == 0 and length == 0:
            break  # zero fill: the end of what was written
        if kind == FULL:
            yield body
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        elif kind == LAST:
            yield pending + body


def wandb_runs(run_dir: Path) -> list[dict]:
    """Every offline W&B run directory under RUN/wandb/, oldest first: its run id and its history rows
    ({"_step": step, key: value})."""
    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for folder in sorted((Path(run_dir) / "wandb").glob("offline-run-*")):
        (file,) = folder.glob("run-*.wandb")
        run_id, rows = None, []
        for payload in _records(file.read_bytes()):
            record = pb.Record()
            record.ParseFromString(payload)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
            elif kind == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                rows.append(row)
        out.append({"id": run_id, "history": rows})
    return out
