"""Reading an offline W&B run back: the records of its `run-ID.wandb` file, and the history rows they log.

wandb >= 0.30 has no Python reader of its own (its Go core writes the file, `wandb sync` uploads it; the old
`wandb.sdk.internal.datastore` is gone), so this follows the file's format: a 7-byte header (":W&B", magic 0xBEE1,
version) then LevelDB's log format (github.com/google/leveldb/blob/main/doc/log_format.md): 32 KiB blocks of
chunks, each a 7-byte header (CRC, length, type: full, first, middle or last) and its bytes, a block's last
< 7 bytes zero padding. A record is a `wandb_internal_pb2.Record` protobuf, W&B's own message.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
CHUNK_HEADER = struct.Struct("<IHB")  # crc32, length, type
FILE_HEADER = struct.Struct("<4sHB")  # ident, magic, version
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list:
    """Every Record of a .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, magic, _ = FILE_HEADER.unpack_from(data)
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is not a W&B run file"
    records, pieces, pos = [], [], FILE_HEADER.size
    while pos + CHUNK_HEADER.size <= len(data):
        if BLOCK - pos % BLOCK < CHUNK_HEADER.size:  # the block's trailer: padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = CHUNK_HEADER.unpack_from(data, pos)
        start = pos + CHUNK_HEADER.size
        pieces.append(data[start:start + length])
        pos = start + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            records.append(record)
            pieces = []
    return records


def history_rows(records) -> dict[int, dict]:
    """{step: {key: value}} of the history records (what `run.log` wrote), values decoded from JSON. W&B stores a
    logged dict (a media object's description) as one item per leaf, keyed by its path: nested again here."""
    rows = {}
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            *parents, leaf = [item.key] if item.key else item.nested_key
            node = row
            for name in parents:
                node = node.setdefault(name, {})
            node[leaf] = _value(item)
        rows[record.history.step.num] = row
    return rows


def _value(item):
    kind = item.WhichOneof("value")
    if kind is None:
        return json.loads(item.value_json)
    if kind == "none":
        return None
    return json.loads(getattr(item, kind)) if kind == "json" else getattr(item, kind)


def run_ids(records) -> set[str]:
    """The run ids of the run records (one per wandb.init) of the file."""
    return {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"}
