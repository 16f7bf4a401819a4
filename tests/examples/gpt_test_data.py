"""The small corpora the GPT example's tests train on (prepared once per pytest session)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "gpt"))

import data  # noqa: E402


def prepared_corpus(tmp_path_factory, name: str, max_mb: float, vocab_size: int) -> Path:
    """``name`` under pytest's base temporary directory, prepared unless it already is."""
    out = tmp_path_factory.getbasetemp() / name
    if not data.is_prepared(out):
        data.prepare(data.CorpusConfig(max_mb=max_mb, vocab_size=vocab_size), out, quiet=True)
    return out
