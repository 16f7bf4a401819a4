"""Tokenizers of the GPT example: UTF-8 bytes, or a byte-level BPE (``tokenizers``).

Both have ``vocab_size``, ``eot_id`` (the end-of-text id appended after each
document), ``encode_batch`` and ``decode``. :class:`BPETokenizer` is trained on
the corpus or loaded from a ``tokenizer.json``; :func:`tokenizer_from_file`
loads any ``tokenizers`` JSON file and finds its end-of-document token.
"""

from __future__ import annotations

from pathlib import Path

EOT = "<|endoftext|>"
# End-of-document tokens looked up in a --tokenizer-file (GPT-2, Llama 3, Llama 2 / T5).
EOT_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>")


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
