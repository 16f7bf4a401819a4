"""The corpus of the GPT example: which documents, read how, and which are held out.

:class:`CorpusConfig` is everything that determines the prepared data; its
:func:`config_hash` (over the configuration and the input files' sizes) is the
cache key. :func:`iter_documents` yields the documents (files, or JSONL records)
up to ``max_mb`` of text; :func:`is_validation` is the seeded held-out choice.
With no inputs the corpus is the Python standard library's ``.py`` sources.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT_VERSION = 1
TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl", ".rst")


@dataclass
class CorpusConfig:
    """Everything that determines the prepared data (its hash is the cache key)."""

    inputs: list[str] = field(default_factory=list)  # empty: the Python standard library
    max_mb: float = 4.0  # cap on the raw text read (MiB); 0 = no cap
    tokenizer: str = "bpe"  # "bpe" (trained here) or "bytes"
    vocab_size: int = 4096  # BPE vocabulary incl. the end-of-text token
    val_fraction: float = 0.05
    seed: int = 1234
    json_key: str = "text"


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted, without tests and site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = [p for p in root.rglob("*.py")
             if not skip.intersection(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def input_files(inputs: list[str]) -> list[Path]:
    if not inputs:
        return stdlib_files()
    files = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"input {item!r} is neither a file nor a directory")
    return files


def _fingerprint(cfg: CorpusConfig) -> list:
    # Sizes (not mtimes) for the stdlib, so every install of one Python version agrees.
    files = input_files(cfg.inputs)
    if cfg.inputs:
        return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    return [sys.version_info[:2], [[p.name, p.stat().st_size] for p in files]]


def config_hash(cfg: CorpusConfig) -> str:
    blob = json.dumps({"version": FORMAT_VERSION, "config": asdict(cfg),
                       "files": _fingerprint(cfg)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def iter_documents(cfg: CorpusConfig) -> Iterator[tuple[str, str]]:
    """``(name, text)`` per document, stopping once ``max_mb`` of text was read."""
    budget = cfg.max_mb * 2**20 if cfg.max_mb > 0 else float("inf")
    used = 0
    for path in input_files(cfg.inputs):
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                records = ((f"{path}:{i}", json.loads(line)[cfg.json_key])
                           for i, line in enumerate(f) if line.strip())
                for name, text in records:
                    if used >= budget:
                        return
                    used += len(text.encode("utf-8"))
                    yield name, text
        else:
            if used >= budget:
                return
            text = path.read_text(encoding="utf-8", errors="replace")
            used += len(text.encode("utf-8"))
            yield str(path), text


def is_validation(name: str, cfg: CorpusConfig) -> bool:
    """Deterministic, seeded held-out choice per document."""
    digest = hashlib.sha256(f"{cfg.seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < cfg.val_fraction
