"""A checkpoint is data, never code: a crafted DCP ``.metadata`` (a pickle) whose
unpickling would create a marker file is refused by ``load_sharded``, ``consolidate``
and the ``python -m mpzero.checkpoint`` tool, and the marker is never created; the
metadata of real checkpoints (fp32 and bf16) still reads."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mpzero.checkpoint import dcp as mdcp
from mpzero.checkpoint import safe_load
from mpzero.checkpoint.__main__ import main as cli
from mpzero.optimizers import DistributedFusedAdam

from dfa_common import make_model

pytestmark = pytest.mark.timeout(120)


class Payload:
    """Unpickling this creates ``marker`` (``open(marker, "w")``): the stand-in for any
    code an attacker would run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _save(path, dtype_name="float32"):
    model = make_model(dtype=getattr(torch, dtype_name))
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2)
    mdcp.save_sharded(path, model, opt)
    return True


def _load(path):
    model = make_model(seed=5)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2)
    before = model.fc1.weight.detach().clone()
    try:
        mdcp.load_sharded(path, model, opt)
    except safe_load.UnsafeCheckpointError as e:
        assert torch.equal(model.fc1.weight, before)  # nothing was loaded
        return str(e)
    return None


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from mpzero.testing import run_on_world

    path = tmp_path_factory.mktemp("safety") / "dcp"
    run_on_world(1, _save, str(path))
    return path


def _crafted(saved: Path, tmp_path: Path, how: str) -> tuple[Path, Path]:
    """A copy of ``saved`` whose ``.metadata`` carries the payload: replaced by it
    ("whole"), or the real metadata with the payload inside ("nested")."""
    bad = tmp_path / f"crafted-{how}"
    shutil.copytree(saved, bad)
    marker = tmp_path / f"marker-{how}"
    if how == "whole":
        blob = pickle.dumps(Payload(str(marker)))
    else:
        md = safe_load.read_dcp_metadata(saved / ".metadata")
        md.planner_data = {"model/fc1.weight": Payload(str(marker))}
        blob = pickle.dumps(md)
    (bad / ".metadata").write_bytes(blob)
    return bad, marker


@pytest.mark.parametrize("how", ["whole", "nested"])
def test_crafted_metadata_runs_no_code(world, saved, tmp_path, how):
    bad, marker = _crafted(saved, tmp_path, how)
    (reason,) = world(1, _load, str(bad))
    assert reason is not None and "refused to unpickle" in reason and "open" in reason, reason
    with pytest.raises(safe_load.UnsafeCheckpointError, match="refused to unpickle"):
        mdcp.consolidate(bad)
    for cmd in (["consolidate", str(bad), str(tmp_path / "out")],
                ["export", str(bad), str(tmp_path / "m.safetensors")]):
        with pytest.raises(SystemExit, match=f"cannot read checkpoint {bad}.*refused"):
            cli(cmd)
    assert not marker.exists()
    assert not (tmp_path / "out" / "model.pt").exists()
    assert not (tmp_path / "m.safetensors").exists()


def test_the_crafted_file_is_a_real_attack(saved, tmp_path):
    """What the tests above guard against: DCP's own reader (plain pickle) runs it."""
    bad, marker = _crafted(saved, tmp_path, "nested")
    dcp.FileSystemReader(str(bad)).read_metadata()
    assert marker.exists()


def test_bytes_entries_and_paths_outside_are_refused(saved, tmp_path):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = safe_load.read_dcp_metadata(saved / ".metadata")
    md.state_dict_metadata["extra"] = BytesStorageMetadata()
    (tmp_path / "bytes.metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(safe_load.UnsafeCheckpointError, match="'extra' is a Bytes"):
        safe_load.read_dcp_metadata(tmp_path / "bytes.metadata")
    md = safe_load.read_dcp_metadata(saved / ".metadata")
    info = next(iter(md.storage_data.values()))
    info.relative_path = "../elsewhere.distcp"
    (tmp_path / "path.metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(safe_load.UnsafeCheckpointError, match="outside the checkpoint"):
        safe_load.read_dcp_metadata(tmp_path / "path.metadata")


def test_real_metadata_reads_fp32_and_bf16(world, saved, tmp_path):
    world(1, _save, str(tmp_path / "bf16"), "bfloat16")
    for path in (saved, tmp_path / "bf16"):
        md = safe_load.read_dcp_metadata(path / ".metadata")
        assert set(md.state_dict_metadata) == set(
            dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    dtypes = {m.properties.dtype for m in safe_load.read_dcp_metadata(
        tmp_path / "bf16" / ".metadata").state_dict_metadata.values()}
    assert torch.bfloat16 in dtypes


def test_torch_load_refusal_is_said_clearly(tmp_path):
    marker = tmp_path / "marker"
    torch.save({"model": Payload(str(marker))}, tmp_path / "evil.pt")
    with pytest.raises(safe_load.UnsafeCheckpointError) as info:
        safe_load.torch_load(tmp_path / "evil.pt")
    msg = str(info.value)
    assert "refused by torch.load(weights_only=True)" in msg and "open" in msg
    assert "weights_only` set to `False`" not in msg and "will likely succeed" not in msg
    assert not marker.exists()
    assert os.path.getsize(tmp_path / "evil.pt") > 0
