"""bench/kernel_bits.py on CPU (the reference path) at small sizes: a run is reproducible,
and a single flipped bit is reported."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("kernel_bits", REPO / "bench" / "kernel_bits.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("kernel_bits", mod)
    spec.loader.exec_module(mod)
    return mod


def test_same_inputs_same_bits_and_a_flipped_bit_is_found(monkeypatch):
    kb = _module()
    monkeypatch.setattr(kb, "SIZES", [1, 7, 4097, 9])
    a, b = kb.run("cpu"), kb.run("cpu")
    assert len(a) == 28 and kb.compare(a, b) == []
    key = "adam_remainders torch.bfloat16 torch.bfloat16 +1"
    t = b[key][4]  # the first remainder tensor (int16; p comes first)
    t.view(torch.int16)[0] ^= 1
    assert kb.compare(a, b) == [key]
    del b["multi_add bf16 fp32 +0"]
    assert "multi_add bf16 fp32 +0" in kb.compare(a, b)
