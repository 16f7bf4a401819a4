"""Data for the GPT example: tokenize a corpus once, then sample sequences from a memmap.

``python -m examples.gpt.data --output DIR [--input a.txt docs/ b.jsonl]`` tokenizes the
default corpus (the Python standard library's sources: real text with no download) or
the inputs into ``DIR``: ``train.bin`` / ``val.bin`` (token ids, read as ``np.memmap``),
``tokenizer.json`` and ``meta.json`` (written last: configuration, its hash as the cache
key, counts, checksums); ``--output-prefix PREFIX`` writes Megatron's indexed pair
instead, which training reads with ``--data-path PREFIX`` (README "Data"). The other
modules: :mod:`corpus` (documents, configuration, cache key), :mod:`tokenizing`,
:mod:`sampling` (the global-batch sampler: the same sequences whatever the parallel
layout), :mod:`indexed_dataset`; this module re-exports what the example and its tests
use.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from mpzero.checkpoint.safe_load import sha256_file

from .checkpointing import atomic_write_bytes
from .corpus import (
    FORMAT_VERSION,
    TEXT_SUFFIXES,
    CorpusConfig,
    config_hash,
    input_files,
    is_validation,
    iter_documents,
    stdlib_files,
)
from .indexed_dataset import (
    INDEX_DTYPES,
    INDEX_MAGIC,
    INDEX_VERSION,
    IndexedDataset,
    load_indexed_splits,
    prepare_indexed,
    split_documents,
    write_indexed_dataset,
)
from .sampling import GlobalBatchSampler, dp_slice, eval_starts, get_batch
from .tokenizing import EOT, EOT_NAMES, BPETokenizer, ByteTokenizer, tokenizer_from_file

__all__ = [
    "DEFAULT_CACHE", "EOT", "EOT_NAMES", "FORMAT_VERSION", "INDEX_DTYPES", "INDEX_MAGIC",
    "INDEX_VERSION", "TEXT_SUFFIXES", "BPETokenizer", "ByteTokenizer", "CorpusConfig",
    "GlobalBatchSampler", "IndexedDataset", "check_vocabulary", "config_hash",
    "default_data_dir", "dp_slice", "eval_starts", "get_batch", "input_files", "is_prepared",
    "is_validation", "iter_documents", "load_indexed_splits", "load_tokenizer", "load_tokens",
    "main", "prepare", "prepare_indexed", "read_meta", "split_documents", "stdlib_files",
    "tokenizer_from_file", "write_indexed_dataset",
]

DEFAULT_CACHE = Path(os.environ.get("MPZERO_DATA_CACHE",
                                    Path.home() / ".cache" / "mpzero" / "gpt-data"))


# ----------------------------------------------------------------------------- prepare


def read_meta(data_dir: str | Path) -> dict:
    with open(Path(data_dir) / "meta.json") as f:
        return json.load(f)


def is_prepared(data_dir: str | Path, cfg: CorpusConfig | None = None) -> bool:
    """``meta.json`` exists (and, given ``cfg``, was made from that configuration)."""
    try:
        meta = read_meta(data_dir)
    except (OSError, ValueError):
        return False
    return cfg is None or meta.get("config_hash") == config_hash(cfg)


def prepare(cfg: CorpusConfig, output: str | Path, *, force: bool = False,
            quiet: bool = False) -> dict:
    """Tokenize the corpus into ``output`` unless it already holds this configuration."""
    out = Path(output)
    key = config_hash(cfg)
    if not force and is_prepared(out, cfg):
        if not quiet:
            print(f"data: {out} is up to date (config {key}), skipping preparation")
        return read_meta(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)  # not ready until rewritten, last
    split: dict[str, list[str]] = {"train": [], "val": []}
    for name, text in iter_documents(cfg):
        split["val" if is_validation(name, cfg) else "train"].append(text)
    if not split["val"] and len(split["train"]) > 1:
        split["val"].append(split["train"].pop())
    if not split["train"] or not split["val"]:
        raise ValueError(f"corpus too small: {len(split['train'])} training and "
                         f"{len(split['val'])} validation documents")
    if cfg.tokenizer == "bpe":
        try:
            tokenizer = BPETokenizer.train(split["train"], cfg.vocab_size)
        except ImportError:
            print("data: the tokenizers library is missing, falling back to bytes",
                  file=sys.stderr)
            tokenizer = ByteTokenizer()
    elif cfg.tokenizer == "bytes":
        tokenizer = ByteTokenizer()
    else:
        raise ValueError(f"tokenizer must be 'bpe' or 'bytes', got {cfg.tokenizer!r}")
    kind = "bpe" if isinstance(tokenizer, BPETokenizer) else "bytes"
    if kind == "bpe":
        tokenizer.save(out / ".tokenizer.json.tmp")
        os.replace(out / ".tokenizer.json.tmp", out / "tokenizer.json")
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    meta = {"format_version": FORMAT_VERSION, "config_hash": key, "config": asdict(cfg),
            "tokenizer": kind, "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id,
            "dtype": np.dtype(dtype).name, "splits": {}}
    for name, texts in split.items():
        ids = tokenizer.encode_batch(texts)
        lengths = np.array([len(x) + 1 for x in ids], dtype=np.int64)
        tokens = np.empty(int(lengths.sum()), dtype=dtype)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        for doc, start in zip(ids, starts[:-1]):
            tokens[start:start + len(doc)] = doc
            tokens[start + len(doc)] = tokenizer.eot_id
        atomic_write_bytes(out / f"{name}.bin", tokens.tobytes())
        np.save(out / f"{name}_doc_offsets.npy", starts)
        meta["splits"][name] = {"file": f"{name}.bin", "tokens": int(tokens.size),
                                "documents": len(texts),
                                "doc_offsets": f"{name}_doc_offsets.npy",
                                "sha256": sha256_file(out / f"{name}.bin")}
    atomic_write_bytes(out / "meta.json", json.dumps(meta, indent=1).encode())
    if not quiet:
        s = meta["splits"]
        print(f"data: wrote {out}: {kind} vocab {tokenizer.vocab_size}, train "
              f"{s['train']['tokens']:,} tokens ({s['train']['documents']} docs), val "
              f"{s['val']['tokens']:,} tokens ({s['val']['documents']} docs)")
    return meta


def default_data_dir(cfg: CorpusConfig) -> Path:
    """Where the default corpus of ``cfg`` is cached (``$MPZERO_DATA_CACHE`` overrides)."""
    return DEFAULT_CACHE / f"{'stdlib' if not cfg.inputs else 'custom'}-{config_hash(cfg)}"


# ----------------------------------------------------------------------------- reading


def load_tokens(data_dir: str | Path, split: str) -> np.ndarray:
    """The token ids of ``split`` ("train" or "val") as a read-only memmap."""
    meta = read_meta(data_dir)
    info = meta["splits"][split]
    return np.memmap(Path(data_dir) / info["file"], dtype=np.dtype(meta["dtype"]), mode="r",
                     shape=(info["tokens"],))


def load_tokenizer(data_dir: str | Path):
    meta = read_meta(data_dir)
    if meta["tokenizer"] == "bytes":
        return ByteTokenizer()
    return BPETokenizer.load(Path(data_dir) / "tokenizer.json")


def check_vocabulary(tokens: np.ndarray, vocab_size: int, what: str) -> None:
    """``ValueError`` when a token id of ``tokens`` is not below ``vocab_size``."""
    if len(tokens) == 0:
        return
    top = int(np.max(tokens))
    low = int(np.min(tokens))
    if top >= vocab_size or low < 0:
        raise ValueError(f"{what}: token ids span {low}..{top}, which does not fit a "
                         f"vocabulary of {vocab_size} (wrong --tokenizer-file or data?)")


def _prepared_dir(d, rank: int) -> Path:
    """The data directory, prepared (by global rank 0) from the default corpus if needed;
    every rank waits for it."""
    import torch.distributed as dist

    cfg = CorpusConfig(vocab_size=d.vocab_size, max_mb=d.data_max_mb)
    data_dir = Path(d.data_dir) if d.data_dir else default_data_dir(cfg)
    ready = is_prepared(data_dir) if d.data_dir else is_prepared(data_dir, cfg)
    if not ready and rank == 0:
        prepare(cfg, data_dir)
    dist.barrier()
    return data_dir


def load_splits(d, rank: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """Train and validation token streams and the vocabulary size of a run's data
    section (``config.DataConfig``).

    ``--data-path``: a Megatron indexed dataset split by ``--split``; else the
    prepared memmap directory. ``--tokenizer-file`` sets the vocabulary; token ids
    that do not fit it (or, without one, the prepared vocabulary) are an error.
    """
    if d.data_path:
        train, val = load_indexed_splits(d.data_path, d.split)
        vocab = None
    else:
        data_dir = _prepared_dir(d, rank)
        train, val = load_tokens(data_dir, "train"), load_tokens(data_dir, "val")
        vocab = read_meta(data_dir)["vocab_size"]
    if d.tokenizer_file:
        vocab = tokenizer_from_file(d.tokenizer_file).vocab_size
    if vocab is not None:
        for name, tokens in (("training", train), ("validation", val)):
            check_vocabulary(tokens, vocab, f"{name} data of "
                             f"{d.data_path or d.data_dir or 'the default corpus'}")
    else:  # an indexed dataset without a tokenizer: the ids it holds
        vocab = int(max(np.max(train), np.max(val))) + 1
    return train, val, vocab


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m examples.gpt.data``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input", nargs="*", default=[],
                   help="text files, directories or JSONL files (default: Python stdlib)")
    p.add_argument("--output", default=None,
                   help=f"output directory (default: under {DEFAULT_CACHE})")
    p.add_argument("--max-mb", type=float, default=CorpusConfig.max_mb,
                   help="MiB of input text to read at most")
    p.add_argument("--tokenizer", choices=["bpe", "bytes"], default="bpe",
                   help="byte-level BPE trained on the training documents, or raw bytes")
    p.add_argument("--vocab-size", type=int, default=CorpusConfig.vocab_size,
                   help="the BPE vocabulary")
    p.add_argument("--val-fraction", type=float, default=CorpusConfig.val_fraction,
                   help="share of the documents held out for validation")
    p.add_argument("--seed", type=int, default=CorpusConfig.seed,
                   help="seed of the held-out choice")
    p.add_argument("--json-key", default="text", help="the text field of JSONL records")
    p.add_argument("--force", action="store_true", help="prepare even when cached")
    p.add_argument("--output-prefix", default=None,
                   help="write Megatron's indexed pair PREFIX.bin/PREFIX.idx instead "
                        "(train with --data-path PREFIX)")
    p.add_argument("--tokenizer-file", default=None,
                   help="with --output-prefix: tokenize with this tokenizers JSON file")
    return p


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    a = p.parse_args(argv)
    cfg = CorpusConfig(inputs=list(a.input), max_mb=a.max_mb, tokenizer=a.tokenizer,
                       vocab_size=a.vocab_size, val_fraction=a.val_fraction, seed=a.seed,
                       json_key=a.json_key)
    if a.output_prefix:
        prepare_indexed(cfg, a.output_prefix, a.tokenizer_file)
        return
    if a.tokenizer_file:
        p.error("--tokenizer-file needs --output-prefix")
    prepare(cfg, a.output or default_data_dir(cfg), force=a.force)


if __name__ == "__main__":
    main()
