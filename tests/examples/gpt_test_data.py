"""The small corpora the GPT example's tests train on (prepared once per pytest session)."""

from __future__ import annotations

from pathlib import Path

from examples.gpt import data


def prepared_corpus(tmp_path_factory, name: str, max_mb: float, vocab_size: int) -> Path:
    """``name`` under pytest's base temporary directory, prepared unless it already is."""
    out = tmp_path_factory.getbasetemp() / name
    if not data.is_prepared(out):
        data.prepare(data.CorpusConfig(max_mb=max_mb, vocab_size=vocab_size), out, quiet=True)
    return out
