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

Megatron's indexed format (``PREFIX.bin`` + ``PREFIX.idx``, "MMIDIDX") is read
and written too: ``--output-prefix PREFIX [--tokenizer-file tokenizer.json]``
writes the pair (all documents, in order; training splits them by ``--split``),
and pretrain_gpt.py trains from one with ``--data-path PREFIX``, also from pairs
made by Megatron's ``tools/preprocess_data.py``.

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
import struct
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

FORMAT_VERSION = 1
EOT = "<|endoftext|>"
# End-of-document tokens looked up in a --tokenizer-file (GPT-2, Llama 3, Llama 2 / T5).
EOT_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>")
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


# ----------------------------------------------------------------------------- indexed


# Megatron's indexed dataset: PREFIX.bin holds the token ids of every sequence back
# to back; PREFIX.idx is the index, little-endian:
#   b"MMIDIDX\x00\x00" | u64 version (1) | u8 dtype code | u64 sequence count S |
#   u64 document count D | int32 lengths[S] | int64 byte pointers[S] | int64 doc_idx[D]
# doc_idx[0] = 0 and doc_idx[d + 1] is the sequence that ends document d (D = docs + 1);
# here every document is one sequence.
INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
INDEX_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                6: np.float64, 7: np.float32, 8: np.uint16}
_INDEX_HEADER_BYTES = len(INDEX_MAGIC) + 8 + 1 + 8 + 8


def _dtype_code(dtype) -> int:
    for code, candidate in INDEX_DTYPES.items():
        if np.dtype(candidate) == np.dtype(dtype):
            return code
    raise ValueError(f"dtype {np.dtype(dtype)} has no MMIDIDX code "
                     f"(one of {[np.dtype(d).name for d in INDEX_DTYPES.values()]})")


def write_indexed_dataset(prefix: str | Path, documents, dtype=np.uint16) -> None:
    """Write ``PREFIX.bin`` and ``PREFIX.idx`` from an iterable of 1-D token arrays."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    code, dtype = _dtype_code(dtype), np.dtype(dtype)
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    tmp_bin = bin_path.with_name(f".{bin_path.name}.tmp{os.getpid()}")
    lengths = []
    with open(tmp_bin, "wb") as f:
        for doc in documents:
            arr = np.asarray(doc)
            if arr.size and dtype.kind in "iu" and (arr.min() < np.iinfo(dtype).min
                                                    or arr.max() > np.iinfo(dtype).max):
                raise ValueError(f"token ids {arr.min()}..{arr.max()} do not fit {dtype.name}")
            f.write(arr.astype(dtype, copy=False).tobytes())
            lengths.append(arr.size)
        f.flush()
        os.fsync(f.fileno())
    sizes = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        pointers[1:] = np.cumsum(sizes[:-1].astype(np.int64)) * dtype.itemsize
    doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
    header = (INDEX_MAGIC + struct.pack("<Q", INDEX_VERSION) + struct.pack("<B", code)
              + struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc_idx)))
    os.replace(tmp_bin, bin_path)
    _atomic_write(idx_path, header + sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes())


class IndexedDataset:
    """A Megatron ``PREFIX.bin`` / ``PREFIX.idx`` pair, memory-mapped.

    ``sequence_lengths``, ``sequence_pointers`` and ``document_indices`` are the
    index arrays; ``tokens`` is the whole ``.bin`` as one token stream (the
    sequences must be stored back to back, as Megatron's builder writes them);
    ``dataset[i]`` is sequence ``i``. Missing, truncated or malformed files raise
    ``FileNotFoundError`` / ``ValueError`` naming the file.
    """

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = str(prefix)
        self.bin_path, self.idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise FileNotFoundError(f"indexed dataset {prefix!r}: {path} is missing "
                                        "(--data-path takes the prefix, without .bin/.idx)")
        raw = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        if raw.size < _INDEX_HEADER_BYTES:
            raise ValueError(f"{self.idx_path}: truncated index ({raw.size} bytes, the header "
                             f"alone is {_INDEX_HEADER_BYTES})")
        head = bytes(raw[:_INDEX_HEADER_BYTES])
        if head[:len(INDEX_MAGIC)] != INDEX_MAGIC:
            raise ValueError(f"{self.idx_path}: not an MMIDIDX index (magic {head[:9]!r})")
        at = len(INDEX_MAGIC)
        version, = struct.unpack_from("<Q", head, at)
        code, = struct.unpack_from("<B", head, at + 8)
        count, docs = struct.unpack_from("<QQ", head, at + 9)
        if version != INDEX_VERSION:
            raise ValueError(f"{self.idx_path}: index version {version}, expected 1")
        if code not in INDEX_DTYPES:
            raise ValueError(f"{self.idx_path}: unknown dtype code {code}")
        self.dtype = np.dtype(INDEX_DTYPES[code])
        need = _INDEX_HEADER_BYTES + 4 * count + 8 * count + 8 * docs
        if raw.size < need:
            raise ValueError(f"{self.idx_path}: truncated index ({raw.size} bytes, "
                             f"{count} sequences and {docs} document entries need {need})")
        off = _INDEX_HEADER_BYTES
        self.sequence_lengths = np.frombuffer(raw, np.int32, count, off)
        self.sequence_pointers = np.frombuffer(raw, np.int64, count, off + 4 * count)
        self.document_indices = np.frombuffer(raw, np.int64, docs, off + 12 * count)
        bin_bytes = self.bin_path.stat().st_size
        end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * \
            self.dtype.itemsize if count else 0
        if bin_bytes < end:
            raise ValueError(f"{self.bin_path}: truncated data ({bin_bytes} bytes, the index "
                             f"points up to byte {end})")
        expected = np.zeros(count, dtype=np.int64)
        if count > 1:
            expected[1:] = np.cumsum(self.sequence_lengths[:-1], dtype=np.int64)
        if not np.array_equal(self.sequence_pointers, expected * self.dtype.itemsize):
            raise ValueError(f"{self.idx_path}: sequences are not stored back to back in "
                             f"{self.bin_path} (unsupported)")
        self.tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r",
                                shape=(end // self.dtype.itemsize,)) if end else \
            np.zeros(0, self.dtype)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return self.tokens[start:start + int(self.sequence_lengths[i])]

    @property
    def num_documents(self) -> int:
        return max(0, len(self.document_indices) - 1)

    def document_token_offset(self, doc: int) -> int:
        """Index into ``tokens`` where document ``doc`` starts (``num_documents``: the end)."""
        seq = int(self.document_indices[doc])
        if seq == len(self):
            return len(self.tokens)
        return int(self.sequence_pointers[seq]) // self.dtype.itemsize


def split_documents(num_documents: int, split: str) -> list[tuple[int, int]]:
    """Megatron's ``--split 969,30,1``: contiguous document ranges ``[start, end)``."""
    try:
        weights = [float(w) for w in split.replace("/", ",").split(",") if w.strip()]
    except ValueError:
        weights = []
    if not weights or any(w < 0 for w in weights) or sum(weights) == 0:
        raise ValueError(f"--split {split!r}: expected comma-separated non-negative weights")
    weights += [0.0] * (3 - len(weights))
    cumulative = np.cumsum([0.0, *weights]) / sum(weights)
    bounds = [int(round(c * num_documents)) for c in cumulative]  # monotonic, ends at n
    return [(bounds[i], bounds[i + 1]) for i in range(len(weights))]


def load_indexed_splits(prefix: str | Path, split: str = "969,30,1"
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Train and validation token streams of an indexed dataset, split by documents."""
    ds = IndexedDataset(prefix)
    (t0, t1), (v0, v1) = split_documents(ds.num_documents, split)[:2]
    if v1 <= v0:  # too few documents, or a zero validation weight: hold out the last one
        if ds.num_documents < 2:
            raise ValueError(f"indexed dataset {prefix!r} has {ds.num_documents} documents: "
                             "need at least 2 (training and validation)")
        t1, v0, v1 = min(t1, ds.num_documents - 1), ds.num_documents - 1, ds.num_documents
    return (ds.tokens[ds.document_token_offset(t0):ds.document_token_offset(t1)],
            ds.tokens[ds.document_token_offset(v0):ds.document_token_offset(v1)])


def check_vocabulary(tokens: np.ndarray, vocab_size: int, what: str) -> None:
    """``ValueError`` when a token id of ``tokens`` is not below ``vocab_size``."""
    if len(tokens) == 0:
        return
    top = int(np.max(tokens))
    low = int(np.min(tokens))
    if top >= vocab_size or low < 0:
        raise ValueError(f"{what}: token ids span {low}..{top}, which does not fit a "
                         f"vocabulary of {vocab_size} (wrong --tokenizer-file or data?)")


def tokenizer_from_file(path: str | Path) -> BPETokenizer:
    """Any ``tokenizers`` JSON file; its end-of-document token is the first of EOT_NAMES."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--tokenizer-file {path} does not exist")
    tok = BPETokenizer.load(path)
    if tok.eot_id is None:
        tok.eot_id = next((tok.tok.token_to_id(n) for n in EOT_NAMES
                           if tok.tok.token_to_id(n) is not None), None)
    return tok


def prepare_indexed(cfg: CorpusConfig, prefix: str | Path,
                    tokenizer_file: str | Path | None = None, quiet: bool = False) -> dict:
    """Tokenize the corpus (every document, in order, end-of-document appended when the
    tokenizer has one) into Megatron's ``PREFIX.bin``/``PREFIX.idx``. Without
    ``tokenizer_file`` a BPE is trained (or bytes) and saved as ``PREFIX.tokenizer.json``."""
    texts = [text for _, text in iter_documents(cfg)]
    if not texts:
        raise ValueError("corpus is empty")
    if tokenizer_file is not None:
        tokenizer = tokenizer_from_file(tokenizer_file)
    elif cfg.tokenizer == "bytes":
        tokenizer = ByteTokenizer()
    else:
        tokenizer = BPETokenizer.train(texts, cfg.vocab_size)
        tokenizer.save(f"{prefix}.tokenizer.json")
    eot = tokenizer.eot_id
    dtype = np.uint16 if tokenizer.vocab_size < 65500 else np.int32  # as Megatron chooses
    docs = (np.asarray(ids + ([] if eot is None else [eot]), dtype=np.int64)
            for ids in tokenizer.encode_batch(texts))
    write_indexed_dataset(prefix, docs, dtype)
    ds = IndexedDataset(prefix)
    info = {"prefix": str(prefix), "documents": ds.num_documents, "tokens": len(ds.tokens),
            "vocab_size": tokenizer.vocab_size, "dtype": ds.dtype.name, "eot_id": eot}
    if not quiet:
        print(f"data: wrote {prefix}.bin/.idx: {info}")
    return info


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
    p.add_argument("--output-prefix", default=None,
                   help="write Megatron's indexed pair PREFIX.bin/PREFIX.idx instead "
                        "(train with --data-path PREFIX)")
    p.add_argument("--tokenizer-file", default=None,
                   help="with --output-prefix: tokenize with this tokenizers JSON file")
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
