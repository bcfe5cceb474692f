"""A small safetensors reader/writer on numpy memory maps (no torch, no pickle: a checkpoint is data only).

Reading maps each shard file and returns views of the bytes, so only the tensors actually read are paged in;
bf16 and fp8 come back as ml_dtypes arrays. DeepSeek's released FP8 weights carry a
`<name>_scale_inv` tensor of 128x128 block scales: `read` dequantises those to f32.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from moejax.errors import InputError

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
FP8_BLOCK = 128


class CheckpointFormatError(InputError, ValueError):
    """A checkpoint file or directory that cannot be read as described; the message names the problem."""


def _read_header(path: Path) -> tuple[dict, int]:
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointFormatError(f"{path}: not a safetensors file (shorter than its header)")
            (n,) = struct.unpack("<Q", raw)
            size = path.stat().st_size
            if n > min(size - 8, 100_000_000):
                raise CheckpointFormatError(f"{path}: header length {n} does not fit in the file")
            header = json.loads(f.read(n))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(f"{path}: cannot read the safetensors header ({e})") from None
    header.pop("__metadata__", None)
    data_bytes = size - 8 - n
    for name, info in header.items():
        start, end = info["data_offsets"]
        if info["dtype"] not in DTYPES:
            raise CheckpointFormatError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        want = int(np.prod(info["shape"], dtype=np.int64)) * np.dtype(DTYPES[info["dtype"]]).itemsize
        if end > data_bytes or end - start != want:
            raise CheckpointFormatError(f"{path}: tensor {name} lies outside the file or has the wrong size "
                                        "(truncated download?)")
    return header, 8 + n


class SafetensorsDir:
    """All tensors of a checkpoint directory (one file or shards), by name, read lazily."""

    def __init__(self, directory):
        self.directory = Path(directory)
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise CheckpointFormatError(f"{self.directory}: no *.safetensors files")
        self._where: dict[str, tuple[Path, dict, int]] = {}
        for path in files:
            header, offset = _read_header(path)
            for name, info in header.items():
                if name in self._where:
                    raise CheckpointFormatError(f"tensor {name} appears in both {self._where[name][0].name} and {path.name}")
                self._where[name] = (path, info, offset)
        self._maps: dict[Path, np.memmap] = {}

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name][1]["shape"])

    def _raw(self, name: str) -> np.ndarray:
        path, info, offset = self._where[name]
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        start, end = info["data_offsets"]
        buf = self._maps[path][offset + start: offset + end]
        return buf.view(DTYPES[info["dtype"]]).reshape(info["shape"])

    def read(self, name: str, row: int | None = None) -> np.ndarray:
        """The tensor (or its row `row` for packed expert tensors) as float32, FP8 blocks dequantised."""
        x = self._raw(name)
        x = x[row] if row is not None else x
        scale_name = name.replace(".weight", ".weight_scale_inv") if name.endswith(".weight") else None
        if scale_name in self._where:
            scale = self._raw(scale_name).astype(np.float32)
            scale = np.repeat(np.repeat(scale, FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)[: x.shape[0], : x.shape[1]]
            return x.astype(np.float32) * scale
        return np.asarray(x, dtype=np.float32)


class ShardedWriter:
    """Writes tensors in order into shard files of at most `max_shard_bytes`, plus the HF index file."""

    def __init__(self, directory, *, max_shard_bytes: int = 5 * 2**30, dtype=np.float32):
        self.directory = Path(directory)
        self.max_shard_bytes = max_shard_bytes
        self.dtype = np.dtype(dtype)
        self._pending: list[tuple[str, np.ndarray]] = []
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._total = 0

    def add(self, name: str, array: np.ndarray, dtype=None):
        """Queue a tensor, cast to the writer's dtype (or `dtype`: an FP8 weight and its f32 block scales)."""
        array = np.ascontiguousarray(np.asarray(array).astype(self.dtype if dtype is None else np.dtype(dtype)))
        if self._pending and self._pending_bytes + array.nbytes > self.max_shard_bytes:
            self._flush()
        self._pending.append((name, array))
        self._pending_bytes += array.nbytes
        self._total += array.nbytes

    def _flush(self):
        index = len(self._shards)
        path = self.directory / f"model-{index:05d}.safetensors.partial"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, a in self._pending:
            header[name] = {"dtype": NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
            offset += a.nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the format asks for 8-byte aligned data
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for _, a in self._pending:
                f.write(a.tobytes())
        self._shards.append([name for name, _ in self._pending])
        self._pending, self._pending_bytes = [], 0

    def close(self) -> list[Path]:
        """Names the shards model-0000i-of-0000n.safetensors and writes model.safetensors.index.json."""
        if self._pending:
            self._flush()
        n = len(self._shards)
        weight_map, paths = {}, []
        for i, names in enumerate(self._shards):
            final = self.directory / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.directory / f"model-{i:05d}.safetensors.partial").rename(final)
            paths.append(final)
            weight_map.update({name: final.name for name in names})
        index = {"metadata": {"total_size": self._total}, "weight_map": weight_map}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return paths
