"""Data for the GPT example: tokenize a corpus once, then sample sequences from a memmap.

Preparation (once; a second run with the same configuration is a no-op)::

    python examples/gpt/data.py --output DIR                       # the default corpus
    python examples/gpt/data.py --input a.txt docs/ b.jsonl --output DIR

The default corpus is real text every machine has without a download: the
``.py`` sources of the Python standard library (sysconfig's ``stdlib`` path,
tests and site-packages left out), read in sorted order up to ``--max-mb``.
Inputs may be text files, directories (searched for .txt/.md/.py/.jsonl) or
JSONL files with a ``"text"`` field per line; each file or JSONL record is one
document, and documents are separated by an end-of-text token. A
deterministic, seeded ``--val-fraction`` of the documents is held out.

``DIR`` then holds ``train.bin`` / ``val.bin`` (the token ids, uint16 when the
vocabulary fits, else uint32; read as ``np.memmap``), ``tokenizer.json`` (a
byte-level BPE trained with the ``tokenizers`` library, or none with
``--tokenizer bytes``: ids are the UTF-8 bytes) and ``meta.json``, written last,
with the configuration, its hash (the cache key), token counts, document
offsets files and the files' checksums.

Sampling: :class:`GlobalBatchSampler` draws the *global* batch from one seeded
stream (per epoch: a random offset and a permutation of the non-overlapping
``seq_length + 1``-token windows), identically on every rank; data-parallel rank
``r`` takes the ``r``-th slice. So the sequences of an iteration do not depend on
the parallel layout, and the sampler position (epoch, index) is all a
checkpoint needs to resume the stream.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

FORMAT_VERSION = 1
EOT = "<|endoftext|>"
TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl", ".rst")
DEFAULT_CACHE = Path(os.environ.get("MPZERO_DATA_CACHE",
                                    Path.home() / ".cache" / "mpzero" / "gpt-data"))


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


# ----------------------------------------------------------------------------- corpus


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


# ----------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes; 256 is end-of-text."""

    vocab_size = 257
    eot_id = 256

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class BPETokenizer:
    """A byte-level BPE from the ``tokenizers`` library (every byte sequence encodes)."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.eot_id = tok.token_to_id(EOT)

    @classmethod
    def train(cls, texts: list[str], vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(texts, trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def save(self, path: str | Path) -> None:
        self.tok.save(str(path))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def load_tokenizer(data_dir: str | Path):
    meta = read_meta(data_dir)
    if meta["tokenizer"] == "bytes":
        return ByteTokenizer()
    return BPETokenizer.load(Path(data_dir) / "tokenizer.json")


# ----------------------------------------------------------------------------- prepare


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
        _atomic_write(out / f"{name}.bin", tokens.tobytes())
        np.save(out / f"{name}_doc_offsets.npy", starts)
        meta["splits"][name] = {"file": f"{name}.bin", "tokens": int(tokens.size),
                                "documents": len(texts),
                                "doc_offsets": f"{name}_doc_offsets.npy",
                                "sha256": _sha256(out / f"{name}.bin")}
    _atomic_write(out / "meta.json", json.dumps(meta, indent=1).encode())
    if not quiet:
        s = meta["splits"]
        print(f"data: wrote {out}: {kind} vocab {tokenizer.vocab_size}, train "
              f"{s['train']['tokens']:,} tokens ({s['train']['documents']} docs), val "
              f"{s['val']['tokens']:,} tokens ({s['val']['documents']} docs)")
    return meta


def default_data_dir(cfg: CorpusConfig) -> Path:
    """Where the default corpus of ``cfg`` is cached (``$MPZERO_DATA_CACHE`` overrides)."""
    return DEFAULT_CACHE / f"{'stdlib' if not cfg.inputs else 'custom'}-{config_hash(cfg)}"


# ----------------------------------------------------------------------------- sampling


def load_tokens(data_dir: str | Path, split: str) -> np.ndarray:
    """The token ids of ``split`` ("train" or "val") as a read-only memmap."""
    meta = read_meta(data_dir)
    info = meta["splits"][split]
    return np.memmap(Path(data_dir) / info["file"], dtype=np.dtype(meta["dtype"]), mode="r",
                     shape=(info["tokens"],))


class GlobalBatchSampler:
    """Window indices of each global batch, from one seeded stream (same on every rank).

    An epoch covers the non-overlapping windows of ``seq_length + 1`` tokens that
    start at a random offset in ``[0, seq_length)``, in a random order; both come
    from ``np.random.default_rng([seed, epoch])``. A global batch is the next
    ``global_batch_size`` windows, continuing into the next epoch when needed. The
    state (epoch, index into the epoch) is what a checkpoint stores.
    """

    def __init__(self, num_tokens: int, seq_length: int, global_batch_size: int,
                 seed: int) -> None:
        if num_tokens < 2 * (seq_length + 1):
            raise ValueError(f"{num_tokens} tokens are too few for sequences of {seq_length}")
        self.num_tokens, self.seq_length = num_tokens, seq_length
        self.global_batch_size, self.seed = global_batch_size, seed
        self.epoch, self.index = 0, 0
        self._cache: tuple[int, np.ndarray] | None = None

    def _epoch_starts(self, epoch: int) -> np.ndarray:
        if self._cache is None or self._cache[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            offset = int(rng.integers(self.seq_length))
            n = (self.num_tokens - offset) // (self.seq_length + 1)
            starts = offset + (self.seq_length + 1) * rng.permutation(n)
            self._cache = (epoch, starts)
        return self._cache[1]

    def next_batch(self) -> np.ndarray:
        """Start offsets (tokens) of the next global batch's sequences, ``[G]`` int64."""
        out = []
        need = self.global_batch_size
        while need:
            starts = self._epoch_starts(self.epoch)
            take = starts[self.index:self.index + need]
            out.append(take)
            need -= len(take)
            self.index += len(take)
            if self.index >= len(starts):
                self.epoch, self.index = self.epoch + 1, 0
        return np.concatenate(out).astype(np.int64)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "seq_length": self.seq_length, "global_batch_size": self.global_batch_size,
                "num_tokens": self.num_tokens}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "seq_length", "num_tokens"):
            if state[key] != getattr(self, key):
                raise ValueError(f"data sampler state was saved with {key}={state[key]}, "
                                 f"this run has {getattr(self, key)}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def eval_starts(num_tokens: int, seq_length: int, count: int) -> np.ndarray:
    """The first ``count`` windows of a split (wrapping around): a fixed evaluation set."""
    n = (num_tokens - 1) // (seq_length + 1)
    return (seq_length + 1) * (np.arange(count) % n)


def get_batch(tokens: np.ndarray, starts: np.ndarray, seq_length: int,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` int64 ``[len(starts), seq_length]``; targets shifted by one."""
    rows = np.stack([np.asarray(tokens[s:s + seq_length + 1], dtype=np.int64) for s in starts])
    batch = torch.from_numpy(rows)
    if torch.device(device).type == "cuda":
        batch = batch.pin_memory().to(device, non_blocking=True)
    return batch[:, :-1], batch[:, 1:]


def dp_slice(starts: np.ndarray, dp_rank: int, dp_size: int) -> np.ndarray:
    """Data-parallel rank ``dp_rank``'s contiguous share of a global batch."""
    per = len(starts) // dp_size
    return starts[dp_rank * per:(dp_rank + 1) * per]


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="*", default=[],
                   help="text files, directories or JSONL files (default: Python stdlib)")
    p.add_argument("--output", default=None,
                   help=f"output directory (default: under {DEFAULT_CACHE})")
    p.add_argument("--max-mb", type=float, default=CorpusConfig.max_mb)
    p.add_argument("--tokenizer", choices=["bpe", "bytes"], default="bpe")
    p.add_argument("--vocab-size", type=int, default=CorpusConfig.vocab_size)
    p.add_argument("--val-fraction", type=float, default=CorpusConfig.val_fraction)
    p.add_argument("--seed", type=int, default=CorpusConfig.seed)
    p.add_argument("--json-key", default="text")
    p.add_argument("--force", action="store_true", help="prepare even when cached")
    a = p.parse_args(argv)
    cfg = CorpusConfig(inputs=list(a.input), max_mb=a.max_mb, tokenizer=a.tokenizer,
                       vocab_size=a.vocab_size, val_fraction=a.val_fraction, seed=a.seed,
                       json_key=a.json_key)
    prepare(cfg, a.output or default_data_dir(cfg), force=a.force)


if __name__ == "__main__":
    main()
