"""examples/gpt/logging_utils.py and config.py's flag checks (no training)."""

import json
from pathlib import Path

import pytest

from examples.gpt import config, logging_utils

GPT_DIR = Path(__file__).resolve().parents[2] / "examples" / "gpt"


INTERVAL = dict(loss=5.5, lr=1e-3, grad_norm=0.75, interval_s=2.0, interval_iters=10,
                global_batch_size=32, seq_length=64, flops_per_token=1e6, world_size=2,
                peak_tflops=None, memory_gib=0.5, memory_kind="cpu_peak_rss")


def test_plain_lines_jsonl_and_tensorboard(tmp_path, capsys):
    log = logging_utils.TrainLogger(enabled=True, train_iters=100, start_iteration=0,
                                    log_file=str(tmp_path / "log.jsonl"),
                                    tensorboard_dir=str(tmp_path / "tb"), progress=False)
    log.setup({"iteration": 0, "world_size": 2})
    rec = log.train(iteration=10, **INTERVAL)
    log.eval(10, 5.25)
    log.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("iter  10/100 | samples 320 | tokens 20,480 | loss 5.5000 |")
    for part in ("lr 1.000e-03", "grad norm 0.750", "200.0 ms/iter", "10,240 tok/s",
                 "MFU -", "peak mem 0.50 GiB"):
        assert part in out[0]
    assert "loss scale" not in out[0]
    assert out[1] == "iter  10/100 | validation loss 5.2500"
    assert "\r" not in "".join(out)  # no progress bar in a non-terminal
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["setup", "train", "eval"]
    assert records[1] == rec and rec["tokens_per_s"] == pytest.approx(32 * 64 / 0.2)
    assert rec["tflops_per_device"] == pytest.approx(1e6 * rec["tokens_per_s"] / 2 / 1e12)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "throughput/tokens_per_s",
            "throughput/tflops_per_device", "memory/peak_gib", "eval/val_loss"} <= tags
    assert acc.Scalars("train/loss")[0].value == pytest.approx(5.5)


def test_loss_scale_and_mfu_shown_when_present(capsys):
    log = logging_utils.TrainLogger(enabled=True, train_iters=20, start_iteration=0,
                                    progress=False)
    log.train(iteration=20, **{**INTERVAL, "peak_tflops": 1e-5}, loss_scale=65536.0)
    line = capsys.readouterr().out
    assert "loss scale 65536" in line and "MFU " in line and "MFU -" not in line


def test_other_ranks_write_nothing(tmp_path, capsys):
    log = logging_utils.TrainLogger(enabled=False, train_iters=5, start_iteration=0,
                                    log_file=str(tmp_path / "x.jsonl"), progress=True)
    log.train(iteration=5, **INTERVAL)
    log.message("hello")
    log.close()
    assert capsys.readouterr().out == "" and not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize("argv,flag", [
    (["--min-lr", "1e-2", "--lr", "1e-3"], "--min-lr"),
    (["--train-iters", "0"], "--train-iters"),
    (["--micro-batch-size", "3", "--global-batch-size", "8"], "--global-batch-size"),
])
def test_contradictory_flags_fail_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit):
        config.parse_args(argv)
    assert flag in capsys.readouterr().err


def test_warmup_longer_than_training_warns(capsys):
    config.parse_args(["--train-iters", "10", "--lr-warmup-iters", "20"])
    assert "--lr-warmup-iters (20) > --train-iters (10)" in capsys.readouterr().err


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        config.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "(default: 4)" in out and "(default: 0.0006)" in out


def test_architecture_checked_before_anything_is_loaded(tmp_path):
    from examples.gpt import checkpointing, resume

    ckpt = checkpointing.iteration_dir(tmp_path, 10)
    ckpt.mkdir(parents=True)
    saved = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "ffn_hidden_size": 256, "seq_length": 32, "padded_vocab_size": 512}
    manifest = {"format": checkpointing.FORMAT, "args": saved, "files": {}}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    cfg = config.Config().updated(load=str(tmp_path), **saved)
    resume.check_architecture(cfg, ckpt, manifest)  # same shape: fine (no model file)
    with pytest.raises(checkpointing.CheckpointError, match="--hidden-size=128"):
        resume.check_architecture(cfg.updated(hidden_size=128), ckpt, manifest)
