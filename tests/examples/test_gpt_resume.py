"""Resuming the GPT example (``--load``, examples/gpt/resume.py): the checks run against
the checkpoint actually chosen; a changed architecture, optimizer, lr schedule or Adam
hyperparameter is refused unless a flag says which side wins; a missing ``--load`` is an
error unless the run asks to start from scratch; a checkpoint of another TP size in the
torch format stops the search instead of resuming from an older one; a crafted file is
skipped with the reason, never unpickled.

The first tests write checkpoints in one process (no training); those marked slow run
the example itself on 1-2 ranks (gloo)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.gpt import checkpoint_choice, checkpointing, config, optim, resume
from examples.gpt.model import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[2]
GPT_DIR = REPO / "examples" / "gpt"


import gpt_jobs  # noqa: E402
from gpt_test_data import prepared_corpus  # noqa: E402

pytestmark = pytest.mark.timeout(900)

MODEL = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
         "--seq-length", "8"]


def _args(*extra: str, load: Path | None = None):
    """The command line as train.main sees it before resuming (with the sizes it
    computes from the data)."""
    argv = [*MODEL, *extra] + (["--load", str(load)] if load is not None else [])
    cfg = config.parse_args(argv)
    return cfg.updated(padded_vocab_size=128, ffn_hidden_size=4 * cfg.model.hidden_size)


def _save(root: Path, iteration: int, *extra: str, ckpt_format: str = "torch",
          optimizer: str | None = None) -> Path:
    """A real checkpoint (one process) whose manifest records the command line
    (``optimizer``: the ``--optimizer`` the example had before it trained only with
    DistributedFusedAdam, as such a checkpoint records it)."""
    cfg = _args(*extra)
    o = cfg.optimizer
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, seq_length=8, num_layers=1, hidden_size=16,
                          num_attention_heads=cfg.model.num_attention_heads))
    opt = torch.optim.AdamW(model.param_groups(o.weight_decay), lr=o.lr,
                            betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
    saved = cfg.flat() if optimizer is None else {**cfg.flat(), "optimizer": optimizer}
    return checkpointing.save_checkpoint(root, iteration, model, opt, args=saved,
                                         data_state={}, ckpt_format=ckpt_format)


def test_architecture_is_checked_against_the_checkpoint_chosen(tmp_path):
    """``latest`` is garbage or points to an older checkpoint that fits: the newest one,
    which resuming picks, has 2 heads, and ``--num-attention-heads 4`` is refused."""
    _save(tmp_path, 10, "--num-attention-heads", "4")
    _save(tmp_path, 20)  # 2 heads (MODEL)
    for latest in (b"\xff\x00garbage", b"iter_0000010"):
        (tmp_path / "latest").write_bytes(latest)
        with pytest.raises(checkpointing.CheckpointMismatch,
                           match="iter_0000020 has num_attention_heads=2, this run has "
                                 "--num-attention-heads=4"):
            resume.prepare(_args("--num-attention-heads", "4", load=tmp_path))
    ckpt, manifest, *_ = resume.prepare(_args(load=tmp_path))
    assert ckpt.name == "iter_0000020" and manifest["iteration"] == 20


@pytest.mark.parametrize("flags,saved_value,message", [
    (["--adam-beta1", "0.8"], 0.9, "--adam-beta1 is 0.9 in the checkpoint, 0.8 here"),
    (["--weight-decay", "0.01"], 0.1, "--weight-decay is 0.1 in the checkpoint, 0.01 here"),
    (["--adam-eps", "1e-6"], 1e-8, "--adam-eps is 1e-08 in the checkpoint, 1e-06 here"),
    (["--lr", "1e-3"], 6e-4, "--lr is 0.0006 in the checkpoint, 0.001 here"),
    (["--min-lr", "1e-5"], 6e-5, "--min-lr is 6e-05 in the checkpoint, 1e-05 here"),
    (["--train-iters", "500"], 1000,
     "the lr decay length (--train-iters) is 1000 in the checkpoint, 500 here"),
])
def test_changed_optimizer_flags_need_a_side(tmp_path, capsys, flags, saved_value, message):
    _save(tmp_path, 5)  # the defaults
    with pytest.raises(checkpointing.CheckpointMismatch) as info:
        resume.prepare(_args(*flags, load=tmp_path))
    assert message in str(info.value)
    assert resume.USE_CHECKPOINT in str(info.value) and resume.OVERRIDE in str(info.value)
    key = flags[0][2:].replace("-", "_")
    # The command line wins: the configuration keeps its values, the line says so.
    args = _args(*flags, "--override-opt-param-scheduler", load=tmp_path)
    _, _, lines, cfg = resume.prepare(args)
    assert "from the command line" in lines[0] and flags[0] in lines[0]
    assert cfg is args and cfg.flat()[key] == float(flags[1])
    # The checkpoint wins: a new configuration with its values (so has the next save's
    # manifest); the one parsed is left as it was.
    args = _args(*flags, "--use-checkpoint-opt-param-scheduler", load=tmp_path)
    _, _, lines, cfg = resume.prepare(args)
    assert args.flat()[key] == float(flags[1])
    shown = f"{flags[0]}) {saved_value}" if flags[0] == "--train-iters" else \
        f"{flags[0]} {saved_value}"
    assert "from the checkpoint" in lines[0] and shown in lines[0], lines
    if flags[0] == "--train-iters":  # the run length is the command line's; the decay not
        assert cfg.training.train_iters == 500 and cfg.optimizer.lr_decay_iters == 1000
        default = _args()
        assert optim.lr_at(300, cfg.optimizer, 500) == \
            optim.lr_at(300, default.optimizer, default.training.train_iters)
    else:
        assert cfg.flat()[key] == saved_value
    # The same values: nothing to decide; Megatron's spelling of the flags is accepted.
    _, _, lines, _ = resume.prepare(_args("--override-opt_param-scheduler", load=tmp_path))
    assert "agree" in lines[0]


def test_the_decay_length_is_what_counts(tmp_path):
    """A longer run with the decay length given explicitly changes no lr: accepted."""
    _save(tmp_path, 5, "--lr-decay-iters", "1000")
    resume.prepare(_args("--train-iters", "2000", "--lr-decay-iters", "1000", load=tmp_path))


def test_both_sides_at_once_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        config.parse_args([*MODEL, "--override-opt-param-scheduler",
                           "--use-checkpoint-opt-param-scheduler"])
    assert info.value.code == 2
    assert "contradict each other" in capsys.readouterr().err


def test_no_load_optim_takes_optimizer_flags_from_the_command_line(tmp_path):
    _save(tmp_path, 5)
    _, _, lines, _ = resume.prepare(_args("--adam-beta1", "0.5", "--no-load-optim",
                                          load=tmp_path))
    assert any("--no-load-optim" in line for line in lines)
    with pytest.raises(checkpointing.CheckpointMismatch, match="--lr is"):  # the schedule
        resume.prepare(_args("--lr", "1e-2", "--no-load-optim", load=tmp_path))


def test_other_optimizer_is_refused_naming_the_flag(tmp_path):
    _save(tmp_path, 5, optimizer="dfa")
    resume.prepare(_args(load=tmp_path))
    _save(tmp_path, 6, optimizer="adamw")  # the former --optimizer adamw baseline's
    with pytest.raises(checkpointing.CheckpointMismatch,
                       match="holds the state of --optimizer adamw .*this example trains "
                             "with DistributedFusedAdam: add --no-load-optim"):
        resume.prepare(_args(load=tmp_path))
    resume.prepare(_args("--no-load-optim", load=tmp_path))


def _dfa_state_into_adamw(root: str, fmt: str):
    """Without the command line to go by (the library call): a DistributedFusedAdam
    checkpoint loaded into torch's AdamW is a clear error, nothing loaded."""
    from mpzero import parallel_state as ps
    from mpzero.optimizers import DistributedFusedAdam

    ps.initialize_model_parallel()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, seq_length=8, num_layers=1, hidden_size=16,
                    num_attention_heads=2)
    model = GPT(cfg)
    opt = DistributedFusedAdam(model.param_groups(0.1), lr=1e-3,
                               **ps.get_optimizer_process_groups())
    checkpointing.save_checkpoint(root, 1, model, opt, ckpt_format=fmt)
    other = GPT(cfg)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    adamw = torch.optim.AdamW(other.param_groups(0.1), lr=1e-3)
    try:
        checkpointing.load_checkpoint(checkpoint_choice.choose_checkpoint(root), other,
                                     adamw)
    except checkpointing.CheckpointError as e:
        assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
        return str(e)
    return None


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_dfa_state_into_another_optimizer_is_a_clear_error(world, tmp_path, fmt):
    (msg,) = world(1, _dfa_state_into_adamw, str(tmp_path / fmt), fmt)
    assert msg is not None and "DistributedFusedAdam" in msg and "AdamW" in msg, msg


def test_missing_load_directory(tmp_path):
    missing = tmp_path / "typo"
    with pytest.raises(checkpointing.CheckpointError, match=f"--load {missing} does not exist"):
        resume.prepare(_args(load=missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(checkpointing.CheckpointError, match="holds no checkpoint"):
        resume.prepare(_args(load=tmp_path / "empty"))
    # Starting from scratch on purpose: --load is also --save, or --allow-missing-load.
    for extra in (["--save", str(missing)], ["--allow-missing-load"]):
        ckpt, _, lines, _ = resume.prepare(_args(*extra, load=missing))
        assert ckpt is None and "starting from scratch" in lines[0]


def test_torch_format_at_another_tp_size_stops_the_search(tmp_path):
    """The newest checkpoint (torch format) was saved at TP 2: the run stops and says so
    rather than resuming from the older TP-1 one."""
    _save(tmp_path, 10)
    newest = _save(tmp_path, 20)
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["tensor_model_parallel_size"] = 2  # as a TP-2 save writes it
    (newest / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(checkpointing.CheckpointMismatch) as info:
        resume.prepare(_args(load=tmp_path))
    msg = str(info.value)
    assert "iter_0000020 was saved with --ckpt-format torch at tensor_model_parallel_size=2" \
        in msg and "this run has 1" in msg and "not reaching past it" in msg, msg


class Payload:
    """Unpickling this creates ``marker``: the stand-in for an attacker's code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _replace(ckpt: Path, name: str, blob: bytes) -> None:
    """Replace a file and its checksum in the (unsigned) manifest, as an attacker would."""
    (ckpt / name).write_bytes(blob)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][name] = checkpointing.sha256_file(ckpt / name)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def test_a_crafted_torch_file_is_skipped_not_unpickled(tmp_path, capsys):
    _save(tmp_path, 10)
    newest = _save(tmp_path, 20)
    marker = tmp_path / "marker"
    buf = __import__("io").BytesIO()
    torch.save({"model": Payload(str(marker))}, buf)
    _replace(newest, "model_tp00.pt", buf.getvalue())
    ckpt, manifest, *_ = resume.prepare(_args(load=tmp_path))
    assert ckpt.name == "iter_0000010"  # fell back like for any other bad file
    out = capsys.readouterr().out
    assert "skipping checkpoint" in out and "refused by torch.load(weights_only=True)" in out
    assert "weights_only` set to `False`" not in out
    shutil.rmtree(tmp_path / "iter_0000010")
    with pytest.raises(checkpointing.CheckpointError, match="refused by torch.load"):
        resume.prepare(_args(load=tmp_path))
    assert not marker.exists()


# ------------------------------------------------------------ torch_dist on gloo worlds
def _dcp_crafted(root: str, marker: str):
    """Saves iterations 1 and 2 (torch_dist, DistributedFusedAdam); iteration 2's DCP
    metadata is replaced by a payload; the load falls back to iteration 1."""
    from mpzero import parallel_state as ps
    from mpzero.optimizers import DistributedFusedAdam

    ps.initialize_model_parallel()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, seq_length=8, num_layers=1, hidden_size=16,
                          num_attention_heads=2))
    opt = DistributedFusedAdam(model.param_groups(0.1), lr=1e-3,
                               **ps.get_optimizer_process_groups())
    for it in (1, 2):
        checkpointing.save_checkpoint(root, it, model, opt, args={})
    import torch.distributed as dist

    if dist.get_rank() == 0:
        md = Path(root) / "iter_0000002" / "dcp"
        _replace(md.parent, "dcp/.metadata", pickle.dumps(Payload(marker)))
    dist.barrier()
    chosen = checkpoint_choice.choose_checkpoint(root)
    manifest = checkpointing.load_checkpoint(chosen, model, opt)
    dist.barrier()  # every rank has read iteration 1 (its RNG file too) before it goes
    if dist.get_rank() == 0:
        shutil.rmtree(Path(root) / "iter_0000001")
    dist.barrier()
    try:
        checkpointing.load_checkpoint(checkpoint_choice.choose_checkpoint(root), model, opt)
    except checkpointing.CheckpointError as e:
        return manifest["iteration"], str(e)
    return manifest["iteration"], None


def test_a_crafted_dcp_metadata_is_skipped_not_unpickled(world, tmp_path):
    marker = tmp_path / "marker"
    for iteration, error in world(2, _dcp_crafted, str(tmp_path / "ckpt"), str(marker)):
        assert iteration == 1
        assert error is not None and "refused to unpickle" in error, error
    assert not marker.exists()


# ---------------------------------------------------------- the example, end to end (slow)
TINY = gpt_jobs.TINY


_port = gpt_jobs.free_port


def run(n: int, args: list[str], timeout: float = 400) -> tuple[list[int], list[str]]:
    """``n`` ranks of train.py (torchrun's environment): exit codes and logs."""
    port = str(_port())
    procs = []
    for r in range(n):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), RANK=str(r),
                   WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, "-m", "examples.gpt.train",
                                       *TINY, *args], env=env, cwd=REPO, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    codes, logs = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        codes.append(p.returncode)
        logs.append(out)
    return codes, logs


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return prepared_corpus(tmp_path_factory, "gpt-faults-data", 0.5, 512)


@pytest.fixture(scope="module")
def tp1(data_dir, tmp_path_factory):
    """One rank, TP 1, iterations 2 and 4 saved in the default format (torch_dist)."""
    out = tmp_path_factory.mktemp("resume-tp1") / "ckpt"
    codes, logs = run(1, ["--data-dir", str(data_dir), "--train-iters", "4",
                          "--save-interval", "2", "--save", str(out)])
    assert codes == [0], logs
    return out


@pytest.mark.slow
def test_tp1_checkpoint_resumes_at_tp2(tp1, data_dir, tmp_path):
    """The model and the optimizer state saved at TP 1 continue at TP 2 (torch_dist)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tp1, ckpt)
    codes, logs = run(2, ["--data-dir", str(data_dir), "--train-iters", "6",
                          "--lr-decay-iters", "4", "--tensor-model-parallel-size", "2",
                          "--load", str(ckpt), "--save", str(ckpt)])
    assert codes == [0, 0], logs
    assert "loaded checkpoint iter 4 from" in logs[0] and "resumed from" in logs[0]
    assert "iter 6/6 |" in logs[0], logs[0][-2000:]
    # "--lr-decay-iters 4" equals the saved decay length (--train-iters 4): no difference.
    assert "the checkpoint's and the command line's agree" in logs[0]


@pytest.mark.slow
def test_resume_refusals_end_to_end(tp1, data_dir, tmp_path):
    """Each refusal stops every rank with exit status 1 and the message naming the flag;
    nothing is trained."""
    base = ["--data-dir", str(data_dir), "--train-iters", "4", "--load", str(tp1)]
    cases = [
        (["--num-attention-heads", "4"], "has num_attention_heads=2, this run has "
                                         "--num-attention-heads=4"),
        (["--adam-beta1", "0.8"], "--adam-beta1 is 0.9 in the checkpoint, 0.8 here"),
    ]
    for extra, message in cases:
        codes, logs = run(1, [*base, *extra])
        assert codes == [1] and message in logs[0], (extra, logs[0][-3000:])
        assert "iter   1/" not in logs[0]
    codes, logs = run(1, ["--data-dir", str(data_dir), "--train-iters", "1",
                          "--load", str(tmp_path / "typo")])
    assert codes == [1] and f"--load {tmp_path / 'typo'} does not exist" in logs[0]


@pytest.mark.slow
def test_override_and_checkpoint_sides_reach_the_optimizer(tp1, data_dir, tmp_path):
    """``--adam-beta1 0.8`` with each flag: the next save's optimizer param groups (and
    manifest) hold the winning side's value."""
    for flag, beta1 in (("--override-opt-param-scheduler", 0.8),
                        ("--use-checkpoint-opt-param-scheduler", 0.9)):
        ckpt = tmp_path / flag.strip("-")
        shutil.copytree(tp1, ckpt)
        codes, logs = run(1, ["--data-dir", str(data_dir), "--train-iters", "5",
                              "--lr-decay-iters", "4", "--adam-beta1", "0.8", flag,
                              "--load", str(ckpt), "--save", str(ckpt)])
        assert codes == [0], logs[0][-3000:]
        assert "--adam-beta1" in logs[0] and flag in logs[0]
        meta = json.loads((ckpt / "iter_0000005" / "dcp" / "mpzero.json").read_text())
        assert {tuple(g["betas"])[0] for g in meta["optim"]["param_groups"]} == {beta1}
        manifest = json.loads((ckpt / "iter_0000005" / "manifest.json").read_text())
        assert manifest["args"]["adam_beta1"] == beta1


@pytest.mark.slow
def test_torch_format_tp2_checkpoint_is_not_passed_over(data_dir, tmp_path):
    """Iteration 2 saved at TP 1 and iteration 4 at TP 2 (--ckpt-format torch, which
    cannot reshard): a TP-1 relaunch stops at iteration 4 with the reason instead of
    resuming from iteration 2."""
    ckpt = str(tmp_path / "ckpt")
    common = ["--data-dir", str(data_dir), "--ckpt-format", "torch", "--save", ckpt,
              "--lr-decay-iters", "4"]
    assert run(1, [*common, "--train-iters", "2"])[0] == [0]
    assert run(2, [*common, "--train-iters", "4", "--tensor-model-parallel-size", "2"])[0] \
        == [0, 0]
    codes, logs = run(1, [*common, "--train-iters", "6", "--load", ckpt])
    assert codes == [1], logs[0][-3000:]
    assert "iter_0000004 was saved with --ckpt-format torch at tensor_model_parallel_size=2" \
        ", this run has 1" in logs[0] and "not reaching past it" in logs[0], logs[0][-3000:]
    assert "loaded checkpoint" not in logs[0]
