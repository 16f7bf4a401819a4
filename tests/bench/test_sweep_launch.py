"""bench/sweep_launch.py without a GPU: the variants it builds, their defines and names,
and that the defines it passes are the ones csrc/multi_tensor_apply_config.h reads (the
builds and timings themselves need nvcc and a GPU)."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _sweep():
    if "sweep_launch" not in sys.modules:  # its dataclass needs the module registered
        path = REPO / "bench" / "sweep_launch.py"
        spec = importlib.util.spec_from_file_location("sweep_launch", path)
        sys.modules["sweep_launch"] = mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return sys.modules["sweep_launch"]


def _args(**kw):
    base = dict(threads="256,512", chunks="8192,16384", prefetch="0,1", variants=None)
    return argparse.Namespace(**dict(base, **kw))


def test_the_default_build_comes_first_and_once():
    sw = _sweep()
    vs = sw.parse_variants(_args())
    assert len(vs) == 8 and vs[0].is_default and sum(v.is_default for v in vs) == 1
    assert vs[0].defines() == [] and vs[0].name == "mpzero_sweep_default"
    assert len({v.name for v in vs}) == len(vs)


def test_variant_defines_and_names():
    sw = _sweep()
    (_, v) = sw.parse_variants(_args(variants="512:16384:0"))
    assert v.defines() == ["-DMPZERO_LAUNCH_THREADS=512", "-DMPZERO_CHUNK_ELEMS=16384",
                           "-DMPZERO_NO_PREFETCH"]
    assert v.name == "mpzero_sweep_t512_c16384_noahead"
    (_, v) = sw.parse_variants(_args(variants="256:8192:1"))
    assert v.defines() == ["-DMPZERO_LAUNCH_THREADS=256", "-DMPZERO_CHUNK_ELEMS=8192"]


@pytest.mark.parametrize("bad", ["512:8192", "512:8192:2", "100:8192:1", "1024:8192:1",
                                 "512:0:1"])
def test_bad_variants_are_refused(bad):
    with pytest.raises(SystemExit):
        _sweep().parse_variants(_args(variants=bad))


def test_defaults_match_the_config_header():
    """The sweep's idea of the default build is the header's, and every define it passes
    is one the header reads."""
    header = (REPO / "csrc" / "multi_tensor_apply_config.h").read_text()
    defaults = dict(re.findall(r"#define (MPZERO_\w+) (\d+)", header))
    sw = _sweep()
    assert (int(defaults["MPZERO_LAUNCH_THREADS"]), int(defaults["MPZERO_CHUNK_ELEMS"]),
            True) == sw.DEFAULT
    assert "#ifdef MPZERO_NO_PREFETCH" in header
    (_, v) = sw.parse_variants(_args(variants="256:4096:0"))
    for flag in v.defines():
        assert re.search(rf"\b{flag[2:].split('=')[0]}\b", header), flag


def test_step_sizes_are_bench_step_model():
    sizes = _sweep().step_sizes()
    assert len(sizes) == 48 and sum(sizes) == 24 * (4096 * 4096 + 4096)
