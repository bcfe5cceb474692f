"""The last good checkpoint: a resume whose newest checkpoint is damaged (truncated, 64 bytes overwritten, metadata
missing, emptied) restores the one before it with one line naming the damaged one, and trains the losses of a run
resumed there from an intact copy, bit for bit. `refuse`, and a workdir with no checkpoint that passes, exit 2
naming them and leave the workdir as it was; a checkpoint saved before manifests restores with a notice; the
inference loader picks, or refuses, the same way."""

import json
import shutil

import pytest
from test_resume import records, run, tree_digest

from moejax.inference.load import load_model
from moejax.inference.saved_model import ModelPathError, find_saved_model
from moejax.training.checkpoint_integrity import MANIFEST, verify

STEPS = 4
SHORT = [f"--config.train.steps={STEPS}", "--config.checkpoint.every_steps=2"]  # checkpoints 2 and 4


def losses_of(rows):
    return [(r["step"], r["loss"]) for r in rows]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("trained") / "run"
    proc = run(workdir, *SHORT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for step in (2, 4):
        assert verify(workdir / "checkpoints" / str(step)).verified
    return workdir


@pytest.fixture(scope="module")
def resumed_at_2(trained, tmp_path_factory):
    """(step, loss) of steps 3 and 4 of a run resumed at step 2 from an intact copy."""
    workdir = tmp_path_factory.mktemp("intact") / "run"
    shutil.copytree(trained, workdir)
    shutil.rmtree(workdir / "checkpoints" / "4")
    proc = run(workdir, *SHORT)
    assert proc.returncode == 0 and "resumed at step 2" in proc.stdout, proc.stderr[-3000:]
    return losses_of(records(workdir)[-2:])


def largest_array_file(step_dir):
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
               key=lambda p: p.stat().st_size)


def truncate(step_dir):
    path = largest_array_file(step_dir)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def overwrite(step_dir):
    """64 bytes in the middle of the largest array file replaced by their complement (sure to differ)."""
    path = largest_array_file(step_dir)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(255 - b for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))


def remove_metadata(step_dir):
    (step_dir / "state" / "_METADATA").unlink()


def empty(step_dir):
    for child in step_dir.iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()


def copy_of(trained, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(trained, workdir)
    return workdir


@pytest.mark.parametrize("damage", [truncate, overwrite, remove_metadata, empty], ids=lambda f: f.__name__)
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(trained, resumed_at_2, tmp_path, damage):
    workdir = copy_of(trained, tmp_path)
    damage(workdir / "checkpoints" / "4")
    proc = run(workdir, *SHORT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    named = [line for line in proc.stderr.splitlines() if "checkpoints/4" in line]
    assert len(named) == 1 and "is incomplete or corrupt" in named[0] and "resuming from step 2" in named[0], named
    assert "resumed at step 2" in proc.stdout
    assert losses_of(records(workdir)[-2:]) == resumed_at_2  # bitwise: the same floats
    assert (workdir / "bad_checkpoints" / "4").is_dir()  # kept for a person to look at
    assert verify(workdir / "checkpoints" / "4").verified  # saved again, with its manifest


def test_refuse_exits_2_naming_the_damaged_checkpoint(trained, tmp_path):
    workdir = copy_of(trained, tmp_path)
    overwrite(workdir / "checkpoints" / "4")
    before = tree_digest(workdir)
    proc = run(workdir, *SHORT, "--config.checkpoint.on_bad_checkpoint=refuse")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "checkpoints/4 is incomplete or corrupt" in lines[0] and "CRC32" in lines[0], lines[0]
    assert "resume from step 2" in lines[0], lines[0]
    assert tree_digest(workdir) == before


def test_no_checkpoint_that_passes_exits_2_naming_them(trained, tmp_path):
    workdir = copy_of(trained, tmp_path)
    overwrite(workdir / "checkpoints" / "4")
    truncate(workdir / "checkpoints" / "2")
    before = tree_digest(workdir)
    proc = run(workdir, *SHORT)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "no checkpoint in" in lines[0] and "4 (" in lines[0] and "2 (" in lines[0], lines[0]
    assert tree_digest(workdir) == before


def test_a_checkpoint_saved_before_manifests_restores_with_a_notice(trained, tmp_path):
    workdir = copy_of(trained, tmp_path)
    (workdir / "checkpoints" / "4" / MANIFEST).unlink()
    proc = run(workdir, *SHORT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    named = [line for line in proc.stderr.splitlines() if "checkpoints/4" in line]
    assert len(named) == 1 and "no integrity manifest" in named[0], named
    assert "resumed at step 4" in proc.stdout


def test_the_inference_loader_takes_the_newest_checkpoint_that_passes(trained, tmp_path, capsys):
    workdir = copy_of(trained, tmp_path)
    overwrite(workdir / "checkpoints" / "4")
    with pytest.raises(ModelPathError, match="checkpoints/4 is incomplete or corrupt .*CRC32"):
        find_saved_model(workdir / "checkpoints" / "4")
    loaded = load_model(workdir)
    assert loaded.step == 2
    named = [line for line in capsys.readouterr().err.splitlines() if "checkpoints/4" in line]
    assert len(named) == 1 and "loading step 2" in named[0], named
    saved = json.loads((workdir / "checkpoints" / "2" / MANIFEST).read_text())
    assert saved["algorithm"] == "crc32" and any(name.startswith("state/ocdbt.process_0/") for name in saved["files"])
