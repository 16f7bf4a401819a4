"""bench/bench_gpt_peers.py --cpu: the tiny shape on gloo (Llama flavour, full recompute),
four setups in their own processes (DDP, DFA, DFA with bf16 moments and offload, bf16
AdamW), the table and the JSON rows (a smoke test: no timing is checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "bench_gpt_peers.py"


@pytest.mark.slow  # real processes or a big world: `make test` only
@pytest.mark.timeout(600)
def test_cpu_smoke_four_setups(tmp_path):
    out = tmp_path / "peers.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(BENCH), "--cpu", "--iters", "2", "--warmup",
                           "1", "--setups", "ddp,dfa,dfa-offload,torch-bf16", "--llama",
                           "--recompute-granularity", "full", "--json", str(out)],
                          capture_output=True, text=True, timeout=540, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "| setup | compile | iter ms | tokens/s |" in proc.stdout
    report = json.loads(out.read_text())
    assert report["shape"]["num_layers"] == 2 and report["nproc"] == 1
    rows = {r["setup"]: r for r in report["rows"]}
    assert set(rows) == {"ddp", "dfa", "dfa-offload", "torch-bf16"}
    for name, r in rows.items():
        assert "error" not in r, (name, r)
        assert len(r["iter_ms_all"]) == 2 and r["iter_ms"] > 0 and r["tokens_per_s"] > 0
        assert 0 < r["step_share"] < 1 and r["peak_gib"] > 0 and r["mfu"] is None
        assert r["parameters"] > 0 and r["world"] == 1
    # Same seed, same data, same model: the first losses agree (fp32+autocast on CPU
    # vs bf16 parameters: within bf16 rounding).
    for name in ("dfa", "dfa-offload", "torch-bf16"):
        assert rows["ddp"]["loss_first"] == pytest.approx(rows[name]["loss_first"], rel=1e-2)


def test_unknown_setup_is_refused(capsys):
    sys.path.insert(0, str(REPO / "bench"))
    import bench_gpt_peers

    with pytest.raises(SystemExit):
        bench_gpt_peers.parse_args(["--cpu", "--setups", "ddp,nope"])
    assert "nope" in capsys.readouterr().err
    a = bench_gpt_peers.parse_args(["--small", "--num-layers", "3", "--nproc", "2"])
    assert (a.num_layers, a.hidden_size, a.setups[0]) == (3, 768, "ddp")  # torch: 1 rank


def test_fusion_flags_force_the_ops_paths():
    """The bench-only --X-fusion flags set ``tp.fused_paths`` in the workers: unset, the
    ops decide (as in the example); given, forced on or off (the fused MLP still only
    where its dtypes allow: the autocast setups (torch, DDP, ZeRO-1) stay unfused)."""
    import argparse

    sys.path.insert(0, str(REPO / "bench"))
    import bench_gpt_peers
    import gpt_peers_worker as worker

    p = argparse.ArgumentParser()
    worker.add_shape_args(p)
    a = p.parse_args([])
    assert worker.fused_path_modes(a) == dict.fromkeys(worker.FUSION_FLAGS.values(), "auto")
    a = p.parse_args(["--openai-gelu", "--gelu-gemm-fusion", "--no-layernorm-fusion"])
    modes = worker.fused_path_modes(a)
    assert (modes["gelu_gemm"], modes["layer_norm"], modes["heads_grad"]) == \
        ("on", "off", "auto")
    argv = bench_gpt_peers.worker_argv(bench_gpt_peers.parse_args(
        ["--cpu", "--gelu-gemm-fusion", "--no-layernorm-fusion"]), "dfa", Path("r.json"))
    assert "--gelu-gemm-fusion" in argv and "--no-layernorm-fusion" in argv
    assert "--heads-grad-fusion" not in argv and "--no-heads-grad-fusion" not in argv


def _row(setup, mfu, **kw):
    return dict(setup=setup, parameters=1.3e9, device="NVIDIA H200", world=1, compile="block",
                openai_gelu=True, grad_acc=4, iter_ms=1000.0, step_share=0.017, peak_gib=45.0,
                tokens_per_s=65000.0, mfu=mfu, **kw)


@pytest.mark.parametrize("mfu", [0.6, None], ids=["gpu", "cpu"])
def test_plot_gpt_peers(tmp_path, mfu):
    """bench/plot_gpt_peers.py draws the rows without an error (MFU, or tokens/s where a
    CPU run has none); a JSON of errors only is refused with a message."""
    sys.path.insert(0, str(REPO / "bench"))
    import plot_gpt_peers

    shape = dict(num_layers=24, hidden_size=2048, seq_length=2048, micro_batch_size=8)
    report = {"shape": shape, "grad_acc": 4,
              "rows": [_row("dfa", mfu), _row("fsdp2", mfu), {"setup": "ddp", "error": "x"}]}
    png = tmp_path / "peers.png"
    plot_gpt_peers.plot(report, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    with pytest.raises(SystemExit, match="no row without an error"):
        plot_gpt_peers.plot({"shape": shape, "rows": report["rows"][2:]}, str(png))


@pytest.mark.slow  # imports the benchmark's worker: `make test` only
def test_a_setup_out_of_memory_is_a_row(monkeypatch):
    """The fp32-master setups that do not fit (the 7B comparison) are rows saying so."""
    import argparse

    sys.path.insert(0, str(REPO / "bench"))
    import gpt_peers_worker as worker

    def no_room(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 25.00 GiB")

    monkeypatch.setattr(worker, "_train", no_room)
    monkeypatch.setattr(worker.dist, "get_rank", lambda: 0)
    p = argparse.ArgumentParser()
    worker.add_shape_args(p)
    a = p.parse_args(["--cpu", "--num-layers", "1", "--hidden-size", "32",
                      "--num-attention-heads", "2", "--seq-length", "8", "--llama"])
    row = worker.run("torch", a)
    assert row["oom"] is True and row["error"] == "out of memory"
    assert "25.00 GiB" in row["detail"]
