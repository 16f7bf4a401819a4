"""The GPT example's checkpoints in one process: round trip, atomic pointer, checksums."""

from __future__ import annotations

import json

import pytest
import torch

from examples.gpt import checkpoint_choice, checkpointing
from examples.gpt.model import GPT, GPTConfig

from gpt_test_data import merged_model  # noqa: E402

CFG = dict(vocab_size=128, seq_length=8, num_layers=1, hidden_size=16, num_attention_heads=2)


def _trained(seed: int):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**CFG))
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-2)
    ids = torch.randint(128, (2, 8))
    for _ in range(3):
        opt.zero_grad()
        model(ids, ids).backward()
        opt.step()
    return model, opt


def _load_newest(save_dir, model, opt) -> dict:
    """Load the newest checkpoint of ``save_dir`` that verifies, as resuming does."""
    return checkpointing.load_checkpoint(checkpoint_choice.choose_checkpoint(save_dir),
                                         model, opt)


def test_round_trip_restores_model_optimizer_and_rng(tmp_path):
    model, opt = _trained(0)
    torch.manual_seed(99)
    out = checkpointing.save_checkpoint(tmp_path, 7, model, opt, data_state={"epoch": 1},
                                        args={"lr": 1e-2})
    expected_rng = torch.rand(3)
    assert out == tmp_path / "iter_0000007"
    assert (tmp_path / "latest").read_text() == "iter_0000007"
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model_tp00.pt", "rng_rank00000.pt"}
    assert manifest["iteration"] == 7 and manifest["data"] == {"epoch": 1}

    fresh, fresh_opt = _trained(1)
    loaded = _load_newest(tmp_path, fresh, fresh_opt)
    assert loaded["iteration"] == 7
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    sa, sb = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"])
    assert torch.equal(torch.rand(3), expected_rng)  # RNG continues where the save was

    merged = merged_model(out)
    assert merged.keys() == model.state_dict().keys()


def test_latest_moves_only_after_a_complete_save(tmp_path):
    model, opt = _trained(0)
    checkpointing.save_checkpoint(tmp_path, 1, model, opt)
    # A save that died before its manifest: latest still points to the previous one.
    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "iter_0000002" / "model_tp00.pt").write_bytes(b"partial")
    assert checkpointing.read_latest(tmp_path).name == "iter_0000001"
    assert _load_newest(tmp_path, model, opt)["iteration"] == 1
    with pytest.raises(checkpointing.CheckpointError, match="no manifest"):
        checkpoint_choice.choose_checkpoint(tmp_path, 2)
    assert checkpoint_choice.choose_checkpoint(tmp_path / "nothing") is None
    assert not list(tmp_path.glob("**/.*tmp*"))  # no temporary files left behind


def test_corrupted_file_is_refused(tmp_path):
    model, opt = _trained(0)
    out = checkpointing.save_checkpoint(tmp_path, 3, model, opt)
    path = out / "model_tp00.pt"
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    path.write_bytes(bytes(blob))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(checkpointing.CheckpointError, match="checksum mismatch"):
        _load_newest(tmp_path, model, opt)
    for k, v in model.state_dict().items():  # nothing was half-loaded
        assert torch.equal(v, before[k])


def test_tp_size_mismatch_is_an_error(tmp_path):
    model, opt = _trained(0)
    out = checkpointing.save_checkpoint(tmp_path, 1, model, opt)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["tensor_model_parallel_size"] = 2
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(checkpointing.CheckpointError, match="tensor_model_parallel_size=2"):
        _load_newest(tmp_path, model, opt)


def test_verify_all_helper_tells_sound_from_unfinished(tmp_path):
    """The tests' ``verify_all`` (over the checkpoint tool): [] for a complete save; a
    problem for a corrupted file and for a save without its manifest, even one whose
    directory holds nothing but a DCP folder (which the tool alone would take as sound)."""
    from gpt_test_data import verify_all

    model, opt = _trained(0)
    out = checkpointing.save_checkpoint(tmp_path, 1, model, opt)
    assert verify_all(out) == []
    (out / "rng_rank00000.pt").write_bytes(b"changed")
    assert any("rng_rank00000.pt" in p for p in verify_all(out))
    bare = tmp_path / "iter_0000002" / "dcp"
    bare.mkdir(parents=True)
    (bare / ".metadata").write_bytes(b"written before the manifest")
    assert "no manifest.json" in verify_all(bare.parent)[0]
