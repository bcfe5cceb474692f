"""A checkpoint's integrity manifest: the size and CRC32 of every file it holds, written when the save is complete
and checked before a resume or an inference load restores it.

Why moejax writes its own: orbax (0.12.8) checksums none of the array bytes. Its zarr3 arrays carry a crc32c over
each shard's index only (orbax/checkpoint/_src/serialization/tensorstore_utils.py, `_build_zarr3_metadata`:
`index_codecs`), and the chunks themselves are stored as raw (or zstd) values in OCDBT data files, so 64 bytes
overwritten in the middle of an array file are restored without a word and trained on.

When: process 0 writes STEP/integrity.json from orbax's post-finalization callback. orbax calls it once every
process has written its files (its `async_write_complete` barrier) and process 0 has merged their OCDBT manifests,
and before the temporary directory is renamed to STEP, so every committed step directory holds its manifest (no
window in which a killed run leaves a committed step without one). It lists the files of the items (state/, meta/,
config/), those of every process (state/ocdbt.process_<i>/, state/array_metadatas/process_<i>) included: the
persistent checkpoint directory is shared by the job's processes, as orbax's merge already requires. The step's
own _CHECKPOINT_METADATA and commit_success.txt are written by orbax's commit after it; a restore does not read
them.

Checked: every listed file exists with its size (truncation is found without reading), then its CRC32 (zlib's,
as the token files: moejax.data.shards). A step directory without a manifest was saved before moejax wrote them:
it is usable, unverified, if it looks complete.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from moejax.data.shards import crc32_file
from moejax.interop.weights_dir import is_training_checkpoint

MANIFEST = "integrity.json"
# orbax's name for a step being written (orbax/checkpoint/_src/path/atomicity_types.py, TMP_DIR_SUFFIX)
ORBAX_TMP_SUFFIX = ".orbax-checkpoint-tmp"
# zlib.crc32 releases the GIL on large buffers: files are checksummed in parallel threads.
CRC_THREADS = min(8, os.cpu_count() or 1)


@dataclass(frozen=True)
class Verdict:
    problem: str = ""  # why the step must not be restored; "" when it may be
    verified: bool = False  # its manifest was checked; False: saved before moejax wrote manifests

    @property
    def ok(self) -> bool:
        return not self.problem


def step_being_saved(checkpoints_dir: Path, step: int) -> Path:
    """The directory orbax is finalising `step` in: its temporary name, or the step's own where orbax commits by
    writing commit_success.txt instead of renaming."""
    for candidate in (checkpoints_dir / f"{step}{ORBAX_TMP_SUFFIX}", *checkpoints_dir.glob(f"{step}{ORBAX_TMP_SUFFIX}*"),
                      checkpoints_dir / str(step)):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"orbax's directory for step {step} is not in {checkpoints_dir}")


def write_manifest(step_dir: Path, items) -> dict:
    """Writes step_dir/integrity.json over every file of the items; returns it."""
    step_dir = Path(step_dir)
    files = sorted(p for item in items for p in (step_dir / item).rglob("*") if p.is_file())
    with ThreadPoolExecutor(CRC_THREADS) as pool:
        crcs = list(pool.map(crc32_file, files))
    manifest = {"algorithm": "crc32",
                "files": {str(p.relative_to(step_dir)): {"bytes": p.stat().st_size, "crc32": crc}
                          for p, crc in zip(files, crcs)}}
    partial = step_dir / f"{MANIFEST}.partial"
    partial.write_text(json.dumps(manifest, indent=1) + "\n")
    partial.rename(step_dir / MANIFEST)
    return manifest


def verify(step_dir: Path) -> Verdict:
    """Whether step_dir may be restored: its manifest's files all there, of their sizes and CRC32s."""
    step_dir = Path(step_dir)
    if not (step_dir / MANIFEST).is_file():
        if not step_dir.is_dir() or not any(step_dir.iterdir()):
            return Verdict("the directory is empty")
        if not is_training_checkpoint(step_dir):
            return Verdict("state/ or config/metadata is missing")
        return Verdict()
    try:
        files = json.loads((step_dir / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError) as e:
        return Verdict(f"its {MANIFEST} is unreadable: {type(e).__name__}")
    for name, want in files.items():  # sizes first: a truncated or missing file is found without reading any
        path = step_dir / name
        if not path.is_file():
            return Verdict(f"{name} is missing")
        if path.stat().st_size != want["bytes"]:
            return Verdict(f"{name} has {path.stat().st_size} bytes, the manifest says {want['bytes']}")
    names = list(files)
    with ThreadPoolExecutor(CRC_THREADS) as pool:
        crcs = list(pool.map(lambda n: crc32_file(step_dir / n), names))
    for name, crc in zip(names, crcs):
        if crc != files[name]["crc32"]:
            return Verdict(f"{name}'s CRC32 is {crc:08x}, the manifest says {files[name]['crc32']:08x}")
    return Verdict(verified=True)
