"""Megatron's indexed dataset (PREFIX.bin / PREFIX.idx, "MMIDIDX"), --tokenizer-file and
--data-path: the byte layout, round trips, clear errors for missing or truncated files
and for token ids the vocabulary does not cover, and a torchrun run with the new flags."""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from examples.gpt import data

REPO = Path(__file__).resolve().parents[2]
GPT_DIR = REPO / "examples" / "gpt"


import gpt_jobs  # noqa: E402


def _docs():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 300, size=n) for n in (5, 1, 17, 0, 9)]


def test_index_layout_is_megatrons(tmp_path):
    docs = _docs()
    data.write_indexed_dataset(tmp_path / "ds", docs, np.uint16)
    raw = (tmp_path / "ds.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, count, doc_count = struct.unpack_from("<QBQQ", raw, 9)
    assert (version, code, count, doc_count) == (1, 8, 5, 6)  # 8 = uint16
    sizes = np.frombuffer(raw, np.int32, 5, 34)
    pointers = np.frombuffer(raw, np.int64, 5, 34 + 20)
    doc_idx = np.frombuffer(raw, np.int64, 6, 34 + 60)
    assert len(raw) == 34 + 20 + 40 + 48
    assert sizes.tolist() == [5, 1, 17, 0, 9]
    assert pointers.tolist() == [0, 10, 12, 46, 46]  # bytes
    assert doc_idx.tolist() == [0, 1, 2, 3, 4, 5]
    assert (tmp_path / "ds.bin").stat().st_size == 2 * 32


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_round_trip(tmp_path, dtype):
    docs = [d % 250 for d in _docs()]
    data.write_indexed_dataset(tmp_path / "ds", docs, dtype)
    ds = data.IndexedDataset(tmp_path / "ds")
    assert ds.dtype == np.dtype(dtype) and len(ds) == 5 and ds.num_documents == 5
    for i, d in enumerate(docs):
        assert ds[i].tolist() == d.tolist()
    assert ds.tokens.tolist() == np.concatenate(docs).tolist()
    assert ds.document_token_offset(2) == 6 and ds.document_token_offset(5) == 32


def test_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.idx is missing"):
        data.IndexedDataset(tmp_path / "nope")
    data.write_indexed_dataset(tmp_path / "ds", _docs(), np.uint16)
    idx, bin_ = (tmp_path / "ds.idx").read_bytes(), (tmp_path / "ds.bin").read_bytes()
    (tmp_path / "ds.idx").write_bytes(idx[:-8])
    with pytest.raises(ValueError, match="truncated index"):
        data.IndexedDataset(tmp_path / "ds")
    (tmp_path / "ds.idx").write_bytes(idx[:20])
    with pytest.raises(ValueError, match="truncated index"):
        data.IndexedDataset(tmp_path / "ds")
    (tmp_path / "ds.idx").write_bytes(b"NOTANIDX\x00" + idx[9:])
    with pytest.raises(ValueError, match="not an MMIDIDX"):
        data.IndexedDataset(tmp_path / "ds")
    (tmp_path / "ds.idx").write_bytes(idx)
    (tmp_path / "ds.bin").write_bytes(bin_[:-2])
    with pytest.raises(ValueError, match=r"ds\.bin: truncated data"):
        data.IndexedDataset(tmp_path / "ds")
    (tmp_path / "ds.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"ds\.bin is missing"):
        data.IndexedDataset(tmp_path / "ds")
    with pytest.raises(ValueError, match="do not fit uint8"):
        data.write_indexed_dataset(tmp_path / "x", [np.array([1, 300])], np.uint8)


def test_split_and_vocabulary_check(tmp_path):
    assert data.split_documents(1000, "969,30,1") == [(0, 969), (969, 999), (999, 1000)]
    assert data.split_documents(10, "9,1") == [(0, 9), (9, 10), (10, 10)]
    with pytest.raises(ValueError, match="--split"):
        data.split_documents(10, "a,b")
    docs = [np.arange(10) + i for i in range(20)]
    data.write_indexed_dataset(tmp_path / "ds", docs, np.uint16)
    train, val = data.load_indexed_splits(tmp_path / "ds", "90,10,0")
    assert len(train) == 18 * 10 and val.tolist() == np.concatenate(docs[18:]).tolist()
    data.check_vocabulary(train, 27, "train")
    with pytest.raises(ValueError, match=r"token ids span 0\.\.26.*vocabulary of 26"):
        data.check_vocabulary(train, 26, "train")


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    """A small corpus as an indexed pair, tokenized with a trained tokenizer.json."""
    root = tmp_path_factory.mktemp("indexed")
    cfg = data.CorpusConfig(max_mb=0.5, vocab_size=512)
    texts = [t for _, t in data.iter_documents(cfg)]
    data.BPETokenizer.train(texts[:50], 512).save(root / "tokenizer.json")
    info = data.prepare_indexed(cfg, root / "corpus", root / "tokenizer.json", quiet=True)
    return root, info, texts


def test_tokenizer_file_writes_decodable_documents(indexed):
    root, info, texts = indexed
    ds = data.IndexedDataset(root / "corpus")
    tok = data.tokenizer_from_file(root / "tokenizer.json")
    assert info["vocab_size"] == 512 and ds.dtype == np.uint16
    assert ds.num_documents == len(texts)
    assert int(ds[0][-1]) == tok.eot_id  # end of document appended
    assert tok.decode(ds[0][:-1]) == texts[0]


def test_load_data_rejects_a_vocabulary_that_does_not_fit(indexed, tmp_path):
    from examples.gpt.config import DataConfig

    root, _, texts = indexed
    small = data.BPETokenizer.train(texts[:5], 300)
    small.save(tmp_path / "small.json")
    d = DataConfig(data_path=str(root / "corpus"), tokenizer_file=str(tmp_path / "small.json"))
    with pytest.raises(ValueError, match="does not fit a vocabulary of 300"):
        data.load_splits(d)
    d = DataConfig(data_path=str(root / "corpus"), tokenizer_file=str(root / "tokenizer.json"))
    train_tokens, val, vocab = data.load_splits(d)
    assert vocab == 512 and len(train_tokens) > 10 * len(val) > 0
    d = DataConfig(data_path=str(root / "corpus"), tokenizer_file=str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="missing.json"):
        data.load_splits(d)


def _torchrun(nproc, extra, log):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), "-m", "examples.gpt.train", "--num-layers", "2", "--hidden-size",
           "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "4",
           "--global-batch-size", "8", "--train-iters", "3", "--lr", "3e-3",
           "--lr-warmup-iters", "0", "--log-interval", "1", "--eval-interval", "0",
           "--eval-iters", "1", "--cpu", "--num-threads", "1", "--no-progress",
           "--log-file", str(log), *extra]
    proc = gpt_jobs.run(cmd, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads(line) for line in open(log) if '"train"' in line]


@pytest.mark.slow  # real processes or a big world: `make test` only
@pytest.mark.timeout(1200)
def test_pretrain_with_data_path_and_llama_flags_tp2_sp_equals_tp1(indexed, tmp_path):
    root, _, _ = indexed
    flags = ["--data-path", str(root / "corpus"), "--tokenizer-file",
             str(root / "tokenizer.json"), "--position-embedding-type", "rope",
             "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
             "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
             "--disable-bias-linear", "--recompute-granularity", "full",
             "--recompute-num-layers", "1"]
    tp1 = _torchrun(1, flags, tmp_path / "tp1.jsonl")
    tp2 = _torchrun(2, [*flags, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                        "--recompute-activations"], tmp_path / "tp2.jsonl")
    assert len(tp1) == len(tp2) == 3
    for a, b in zip(tp1, tp2):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * a["loss"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-3 * a["grad_norm"], (a, b)
    assert abs(tp1[0]["loss"] - np.log(512)) < 0.3
