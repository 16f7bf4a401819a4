"""The GPT example's data: preparation, caching, tokenizers, and layout-independent sampling."""

from __future__ import annotations

import json

import numpy as np
import pytest

from examples.gpt import data


@pytest.fixture
def corpus(tmp_path):
    docs = [f"def function_{i}(x):\n    return x * {i} + {i * i}  # doc {i}\n" * 20
            for i in range(40)]
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": d}) for d in docs[:30]) + "\n")
    text_dir = tmp_path / "texts"
    text_dir.mkdir()
    for i, d in enumerate(docs[30:]):
        (text_dir / f"doc{i}.txt").write_text(d)
    return [str(jsonl), str(text_dir)], docs


def test_prepare_bpe_roundtrip_split_and_cache(tmp_path, corpus):
    inputs, docs = corpus
    cfg = data.CorpusConfig(inputs=inputs, vocab_size=300, val_fraction=0.2, max_mb=0)
    out = tmp_path / "prepared"
    meta = data.prepare(cfg, out, quiet=True)
    assert meta["tokenizer"] == "bpe" and meta["vocab_size"] <= 300
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 40
    assert 0 < meta["splits"]["val"]["documents"] < 40
    tok = data.load_tokenizer(out)
    texts = {}
    for split in ("train", "val"):
        tokens = data.load_tokens(out, split)
        assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
        offsets = np.load(out / meta["splits"][split]["doc_offsets"])
        assert tokens[offsets[1:] - 1].tolist() == [meta["eot_id"]] * (len(offsets) - 1)
        texts[split] = [tok.decode(tokens[a:b - 1]) for a, b in zip(offsets[:-1], offsets[1:])]
    # Every document comes back exactly, in exactly one split.
    assert sorted(texts["train"] + texts["val"]) == sorted(docs)
    assert set(texts["train"]).isdisjoint(texts["val"])
    # BPE compresses this repetitive text well below one token per byte.
    assert meta["splits"]["train"]["tokens"] < 0.5 * sum(len(d) for d in texts["train"])

    stamp = (out / "train.bin").stat().st_mtime_ns
    assert data.is_prepared(out, cfg)
    data.prepare(cfg, out, quiet=True)  # cached: nothing rewritten
    assert (out / "train.bin").stat().st_mtime_ns == stamp
    other = data.CorpusConfig(inputs=inputs, vocab_size=280, val_fraction=0.2, max_mb=0)
    assert data.config_hash(other) != data.config_hash(cfg)
    assert not data.is_prepared(out, other)


def test_byte_tokenizer_fallback(tmp_path, corpus):
    inputs, docs = corpus
    cfg = data.CorpusConfig(inputs=inputs, tokenizer="bytes", val_fraction=0.2, max_mb=0)
    meta = data.prepare(cfg, tmp_path / "bytes", quiet=True)
    assert meta["tokenizer"] == "bytes" and meta["vocab_size"] == 257 and meta["eot_id"] == 256
    n_bytes = sum(len(d.encode()) for d in docs)
    total = meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"]
    assert total == n_bytes + len(docs)  # one token per byte plus one end-of-text per doc


@pytest.mark.slow  # tokenizes the real default corpus (~10 s on 2 busy cores)
def test_default_corpus_is_the_stdlib_capped(tmp_path):
    files = data.stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    cfg = data.CorpusConfig(max_mb=0.25, vocab_size=512)
    read = sum(len(t.encode()) for _, t in data.iter_documents(cfg))
    assert 0.25 * 2**20 <= read < 0.25 * 2**20 + max(f.stat().st_size for f in files)
    meta = data.prepare(cfg, tmp_path / "stdlib", quiet=True)
    assert meta["vocab_size"] == 512 and meta["splits"]["val"]["tokens"] > 0
    assert data.default_data_dir(cfg).name.endswith(data.config_hash(cfg))


def test_sampler_is_deterministic_and_resumable():
    make = lambda: data.GlobalBatchSampler(10_000, 32, 24, seed=5)  # noqa: E731
    a = make()
    batches = [a.next_batch() for _ in range(40)]  # crosses several epochs (~303 windows)
    assert a.epoch >= 2
    for b in batches:
        assert b.shape == (24,) and b.min() >= 0 and b.max() + 33 <= 10_000
    # Inside one epoch, windows never overlap.
    epoch0 = np.concatenate(batches[:12])
    assert len(np.unique(epoch0)) == len(epoch0)
    assert np.all(np.diff(np.sort(epoch0)) >= 33)
    # Different epochs start at different offsets (different window alignment).
    b = make()
    assert not np.array_equal(b._epoch_starts(0) % 33, b._epoch_starts(1) % 33)
    # Resume from a saved position reproduces the rest of the stream.
    c = make()
    for _ in range(17):
        c.next_batch()
    state = json.loads(json.dumps(c.state_dict()))
    d = make()
    d.load_state_dict(state)
    for i in range(17, 40):
        assert np.array_equal(d.next_batch(), batches[i])
    with pytest.raises(ValueError, match="seed"):
        data.GlobalBatchSampler(10_000, 32, 24, seed=6).load_state_dict(state)


def test_dp_slices_partition_the_global_batch():
    tokens = np.arange(5000, dtype=np.uint16)
    starts = data.GlobalBatchSampler(len(tokens), 16, 8, seed=0).next_batch()
    for dp in (1, 2, 4, 8):
        parts = [data.dp_slice(starts, r, dp) for r in range(dp)]
        assert np.array_equal(np.concatenate(parts), starts)
    x, y = data.get_batch(tokens, starts[:3], 16)
    assert x.shape == y.shape == (3, 16)
    assert (y[:, :-1] == x[:, 1:]).all() and int(x[0, 0]) == int(starts[0])
    ev = data.eval_starts(5000, 16, 500)
    assert len(ev) == 500 and ev.max() + 17 <= 5000 and ev[0] == 0
