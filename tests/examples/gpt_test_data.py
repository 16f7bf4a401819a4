"""The small corpora the GPT example's tests train on (prepared once per pytest session),
and what the tests read back from the checkpoints it writes."""

from __future__ import annotations

from pathlib import Path

import torch

from examples.gpt import checkpoint_tool, checkpointing, data


def prepared_corpus(tmp_path_factory, name: str, max_mb: float, vocab_size: int) -> Path:
    """``name`` under pytest's base temporary directory, prepared unless it already is."""
    out = tmp_path_factory.getbasetemp() / name
    if not data.is_prepared(out):
        data.prepare(data.CorpusConfig(max_mb=max_mb, vocab_size=vocab_size), out, quiet=True)
    return out


def verify_all(ckpt: str | Path) -> list[str]:
    """Problems of one of the example's checkpoints: no (valid) manifest, i.e. a save that
    did not finish, or a file of the manifest missing or not matching its checksum (as
    ``python -m examples.gpt.checkpoint_tool inspect`` checks them); [] when sound."""
    try:
        checkpointing.read_manifest(ckpt)  # the tool also takes a bare DCP folder
    except checkpointing.CheckpointError as e:
        return [str(e)]
    return [f"{name}: {status}" for name, _, status in checkpoint_tool.check(Path(ckpt))
            if status != "ok"]


def merged_model(ckpt: str | Path) -> dict[str, torch.Tensor]:
    """The full (TP=1) model state dict of a checkpoint, every file verified first (the
    tool's ``consolidate``)."""
    return checkpoint_tool.load(Path(ckpt))["model"]
