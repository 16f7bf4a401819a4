"""Megatron's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``, "MMIDIDX" v1).

:func:`write_indexed_dataset` writes a pair from token arrays and
:func:`prepare_indexed` tokenizes a corpus into one; :class:`IndexedDataset`
memory-maps a pair (also one made by Megatron's ``tools/preprocess_data.py``)
and :func:`load_indexed_splits` splits it into training and validation token
streams by documents, as Megatron's ``--split`` does.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from .checkpointing import atomic_write_bytes
from .corpus import CorpusConfig, iter_documents
from .tokenizing import BPETokenizer, ByteTokenizer, tokenizer_from_file

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
    atomic_write_bytes(idx_path, header + sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes())


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
