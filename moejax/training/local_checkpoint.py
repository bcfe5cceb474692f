"""The local checkpoint tier: frequent saves of each process's own shards to node-local storage, each with a copy
on another node, so that losing a node loses at most `checkpoint.local_every_steps` steps.

Layout: LOCAL_DIR/<workdir name>-<run id>/process_<p>/<step>/ holds (the run id is made by WORKDIR's first run and
kept in WORKDIR/local_tier_id: a WORKDIR deleted and started again does not resume from the old run's local steps)
- own.bin: the unique shards of the train state that process p's devices hold;
- peer.bin: the same for the process whose copy p keeps (sent over the devices' links: peer_exchange.py);
- index.json: where each leaf's shards sit in the two files, their sizes and CRC32s, the layout fingerprint;
- meta.json, config.json: the data iterator's state, guard counters and resolved config (as the persistent tier).
A step is written into <step>.tmp and renamed when complete, in a background thread; a reader never sees half
of one. Processes on one host share LOCAL_DIR's tree (one subdirectory each); on a cluster each node's
LOCAL_DIR is its own disk.

Which process keeps whose copy: process q's copy goes to process q + offset, where offset is the number of
processes on q's host (so that the copy leaves the node); with every process on one host, offset 1 (a lost
process, not a lost host, is what the tier then covers; a note says so).

Why not orbax's emergency/multi-tier checkpointing (orbax 0.12.8, orbax/checkpoint/experimental/emergency):
its local tier restores a lost slice from a *replica* (another slice holding the same data-parallel copy of the
state: `replica_axis_index`), and its P2P manager fetches a process's shard from the process at the same place in
another replica. moejax shards parameters and optimizer state over every data axis (fsdp, the distributed
optimizer): there is no replica to fetch from, so moejax keeps an explicit peer copy instead.

A restart restores the newest step that every process can get: from its own local copy, or, where that is gone,
from the copy its peer keeps (sent back over the devices' links). Which one is agreed through the job's
coordination service; the persistent tier (checkpoint.py) is used when it is newer or when the local tier cannot
serve (another layout, another process count, a step missing on a process and its peer).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from moejax.data.shards import crc32_file
from moejax.training.peer_exchange import exchange_leaf, own_shards, peer_process, return_leaf, shard_index

INDEX = "index.json"
TMP_SUFFIX = ".tmp"


@dataclass(frozen=True)
class LocalPoint:
    """The local step a restart restores: `step`; `returned`: (holder, owner) pairs of the processes whose own
    copy is gone and is sent back by the process that keeps it."""
    step: int
    returned: tuple[tuple[int, int], ...]
    meta: dict
    saved_config: dict


def layout_fingerprint(abstract_leaves_with_path, shardings) -> str:
    """A hash of what a local copy's bytes depend on: the processes' devices, each leaf's shape, dtype and sharding.
    A restart with another layout cannot use the local tier (the persistent one reshards)."""
    grid = [[d.id for d in sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)]
            for p in range(jax.process_count())]
    leaves = [(jax.tree_util.keystr(path), tuple(a.shape), str(a.dtype), repr(s.spec) if hasattr(s, "spec") else
               repr(s), dict(s.mesh.shape) if hasattr(s, "mesh") else None)
              for (path, a), s in zip(abstract_leaves_with_path, jax.tree.leaves(shardings))]
    return hashlib.sha256(json.dumps([grid, leaves], default=str).encode()).hexdigest()[:16]


def _kv_client():
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


_gathers = [0]  # calls so far: every process makes the same calls in the same order, so the count names each one


def _all_gather_json(key: str, mine, timeout_s: float = 600) -> list:
    """Every process's `mine`, in process order (through the coordination service's key-value store)."""
    if jax.process_count() == 1:
        return [mine]
    _gathers[0] += 1
    prefix = f"moejax/local_tier/{_gathers[0]}/{key}"
    client = _kv_client()
    client.key_value_set(f"{prefix}/{jax.process_index()}", json.dumps(mine))
    return [json.loads(client.blocking_key_value_get(f"{prefix}/{p}", int(timeout_s * 1000)))
            for p in range(jax.process_count())]


def run_id(workdir: Path) -> str:
    """WORKDIR's run id (created by its first run, kept in WORKDIR/local_tier_id), the same on every process: a
    WORKDIR deleted and started again is a new run, which must not resume from the old run's local steps."""
    mine = None
    if jax.process_index() == 0:
        path = workdir / "local_tier_id"
        if not path.is_file():
            path.write_text(uuid.uuid4().hex[:12] + "\n")
        mine = path.read_text().strip()
    return _all_gather_json("run_id", mine)[0]


def peer_offset() -> tuple[int, str]:
    """(offset to the process that keeps this one's copy, a note when the copy stays on the same host)."""
    n = jax.process_count()
    hosts = _all_gather_json("hosts", socket.gethostname())
    per_host = {hosts.count(h) for h in hosts}  # the same answer on every process: every one must permute alike
    if n == 1:
        return 0, "one process: the local tier has no peer copy"
    if per_host == {n}:
        return 1, ("every process runs on one host: each keeps the next process's copy (covers a lost process, "
                   "not a lost host)")
    if len(per_host) > 1:
        return 1, ("the hosts run different numbers of processes: each keeps the next process's copy, which may be on "
                   "the same host")
    return per_host.pop(), ""


class LocalTier:
    def __init__(self, local_dir: str | Path, workdir: Path, *, every_steps: int, keep: int):
        workdir = Path(workdir).absolute()
        self.base = Path(local_dir) / f"{workdir.name}-{run_id(workdir)}"
        self.root = self.base / f"process_{jax.process_index()}"
        self.every_steps, self.keep = int(every_steps), max(1, int(keep))
        self.offset, self.note = peer_offset()
        self._writer: threading.Thread | None = None
        self._write_error: BaseException | None = None

    def due(self, step: int) -> bool:
        return self.every_steps > 0 and step % self.every_steps == 0

    # --- saving ---------------------------------------------------------------------------------------------------

    def save(self, step: int, state, *, meta: dict, config_json: str, shardings) -> None:
        """Copies this process's shards and its peer's (a collective: every process calls it at the same step) to
        host memory, then writes them in the background."""
        start = time.perf_counter()
        self.wait()
        n, me = jax.process_count(), jax.process_index()
        perm = tuple((q, peer_process(q, self.offset, n)) for q in range(n)) if self.offset else ()
        leaves_with_path, _ = jax.tree.flatten_with_path(state)
        own, peer = [], []
        for path, leaf in leaves_with_path:
            if perm:
                mine, theirs = exchange_leaf(leaf, perm)
            else:
                mine, theirs = own_shards(leaf), {}
            own.append(mine)
            peer.append(theirs)
        index = {"step": step, "process": me, "process_count": n,
                 "peer_of": next((q for q, h in perm if h == me), None),
                 "layout": layout_fingerprint(leaves_with_path, shardings),
                 "leaves": [{"path": jax.tree_util.keystr(path), "shape": list(leaf.shape), "dtype": str(leaf.dtype)}
                            for path, leaf in leaves_with_path]}
        # seconds the training waited (peer exchange, copies to host); the write's own time is added by _write
        index["timings"] = {"blocking_s": round(time.perf_counter() - start, 4)}
        self._writer = threading.Thread(target=self._write, args=(step, index, own, peer, meta, config_json),
                                        name="moejax-local-checkpoint", daemon=True)
        self._writer.start()

    def _write(self, step, index, own, peer, meta, config_json):
        try:
            start = time.perf_counter()
            tmp = self.root / f"{step}{TMP_SUFFIX}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            index["files"] = {}
            for name, shards in (("own", own), ("peer", peer)):
                placed, crc, offset = [], 0, 0
                with open(tmp / f"{name}.bin", "wb") as f:
                    for leaf_shards in shards:
                        entries = []
                        for shard_index, data in leaf_shards.items():
                            raw = np.ascontiguousarray(data).tobytes()
                            f.write(raw)
                            crc = zlib.crc32(raw, crc)
                            entries.append([[list(pair) for pair in shard_index], offset, len(raw)])
                            offset += len(raw)
                        placed.append(entries)
                index["files"][f"{name}.bin"] = {"bytes": offset, "crc32": crc}
                for leaf, entries in zip(index["leaves"], placed):
                    leaf[name] = entries
            (tmp / "meta.json").write_text(json.dumps(meta))
            (tmp / "config.json").write_text(config_json)
            index["timings"]["background_write_s"] = round(time.perf_counter() - start, 4)
            (tmp / INDEX).write_text(json.dumps(index))
            final = self.root / str(step)
            shutil.rmtree(final, ignore_errors=True)  # the same step saved again after a restart from an older one
            os.replace(tmp, final)
            for old in sorted(self.steps(), reverse=True)[self.keep:]:
                shutil.rmtree(self.root / str(old), ignore_errors=True)
        except BaseException as e:  # noqa: BLE001 - raised in the training thread by wait()
            self._write_error = e

    def wait(self):
        """Waits for the write in flight; raises its error (a full or failing local disk stops the run loudly)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._write_error is not None:
            error, self._write_error = self._write_error, None
            raise OSError(f"the local checkpoint under {self.root} could not be written: {error}") from error

    def close(self):
        self.wait()

    # --- restoring ------------------------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(p.name) for p in self.root.iterdir() if p.name.isdigit() and (p / INDEX).is_file())

    def _verified(self, layout: str) -> dict[int, int | None]:
        """{step: whose copy it also keeps} of this process's local steps that pass their checks (sizes, CRC32,
        the same layout), newest first; one line per step that does not."""
        good = {}
        for step in sorted(self.steps(), reverse=True):
            problem = _problem(self.root / str(step), layout)
            if problem:
                print(f"warning: local checkpoint {self.root / str(step)} cannot be used ({problem})", flush=True)
                continue
            good[step] = json.loads((self.root / str(step) / INDEX).read_text())["peer_of"]
        return good

    def newest_restorable(self, layout: str) -> LocalPoint | None:
        """The newest step every process can restore from the local tier (a collective), or None."""
        inventories = _all_gather_json("inventory", {str(s): q for s, q in self._verified(layout).items()})
        n = jax.process_count()
        candidates = sorted({int(s) for inv in inventories for s in inv}, reverse=True)
        for step in candidates:
            has = [str(step) in inv for inv in inventories]
            returned = []
            for q in range(n):
                if has[q]:
                    continue
                holder = next((h for h in range(n) if has[h] and inventories[h][str(step)] == q), None)
                if holder is None:
                    break
                returned.append((holder, q))
            else:
                # every process reads meta and config from a copy it holds, or from its holder's (same content)
                source = self.root / str(step) if has[jax.process_index()] else None
                meta, saved = _read_small(source) if source else (None, None)
                meta, saved = _agree(step, meta, saved)
                return LocalPoint(step, tuple(returned), meta, saved)
        return None

    def restore(self, point: LocalPoint, abstract_state, shardings):
        """The train state of `point` on `shardings` (the layout it was saved with)."""
        me = jax.process_index()
        step_dir = self.root / str(point.step)
        index = json.loads((step_dir / INDEX).read_text()) if step_dir.is_dir() else None
        lost = me in {owner for _, owner in point.returned}
        holding = any(holder == me for holder, _ in point.returned)
        leaves_with_path, treedef = jax.tree.flatten_with_path(abstract_state)
        restored = []
        for i, ((path, abstract), sharding) in enumerate(zip(leaves_with_path, jax.tree.leaves(shardings))):
            mine = None if lost else _read_leaf(step_dir, index, i, "own")
            if point.returned:
                held = _read_leaf(step_dir, index, i, "peer") if holding else None
                received = return_leaf(abstract.shape, abstract.dtype, sharding, held, point.returned)
                if lost:
                    mine = received
            arrays = [jax.device_put(mine[shard_index(idx, tuple(abstract.shape))], d)
                      for d, idx in sharding.addressable_devices_indices_map(tuple(abstract.shape)).items()]
            restored.append(jax.make_array_from_single_device_arrays(tuple(abstract.shape), sharding, arrays))
        return jax.tree.unflatten(treedef, restored)


def _read_leaf(step_dir: Path, index: dict, i: int, name: str) -> dict:
    """{ShardIndex: array} of leaf i in own.bin or peer.bin (memory-mapped: read as the device copies it)."""
    leaf = index["leaves"][i]
    dtype = jnp.dtype(leaf["dtype"])
    data = (np.memmap(step_dir / f"{name}.bin", dtype=np.uint8, mode="r")
            if index["files"][f"{name}.bin"]["bytes"] else np.zeros(0, np.uint8))
    out = {}
    for where, offset, nbytes in leaf[name]:
        key = tuple(tuple(pair) for pair in where)
        # copied out of the read-only map: a CPU device_put may alias host memory, and the restored state is
        # donated to (written by) the first step
        out[key] = np.frombuffer(data[offset:offset + nbytes], dtype=dtype).reshape([b - a for a, b in key]).copy()
    return out


def _problem(step_dir: Path, layout: str) -> str:
    try:
        index = json.loads((step_dir / INDEX).read_text())
    except (OSError, ValueError) as e:
        return f"{INDEX} unreadable: {e}"
    if index.get("layout") != layout or index.get("process_count") != jax.process_count():
        return "saved with another mesh, process count or state layout"
    for name, want in index["files"].items():
        path = step_dir / name
        if not path.is_file() or path.stat().st_size != want["bytes"]:
            return f"{name} is missing or has another size than its index says"
        if crc32_file(path) != want["crc32"]:
            return f"{name}'s CRC32 differs from its index"
    for name in ("meta.json", "config.json"):
        if not (step_dir / name).is_file():
            return f"{name} is missing"
    return ""


def _read_small(step_dir: Path) -> tuple[dict, dict]:
    return json.loads((step_dir / "meta.json").read_text()), json.loads((step_dir / "config.json").read_text())


def _agree(step: int, meta, saved) -> tuple[dict, dict]:
    """A process that lost its copy learns meta and config from one that has it (they are the same on all)."""
    gathered = _all_gather_json(f"small/{step}", {"meta": meta, "config": saved})
    have = next(g for g in gathered if g["meta"] is not None)
    return have["meta"], have["config"]
