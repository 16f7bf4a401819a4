"""examples/gpt/config.py: the configuration tree, its flags, the TOML file (no training)."""

import dataclasses

import pytest

from examples.gpt import config

pytestmark = pytest.mark.timeout(120)


def test_every_flag_has_a_help_text():
    from examples.gpt import data, plot_log

    flags = [a for a in config.build_parser()._actions if a.option_strings]
    assert len(flags) > 70  # the training script's whole command line
    for parser in (data.build_parser(), plot_log.build_parser()):  # the other commands
        flags += [a for a in parser._actions if a.option_strings or a.dest == "logs"]
    missing = [a.option_strings or a.dest for a in flags if not (a.help or "").strip()]
    assert missing == []


def test_every_field_is_documented_and_every_flag_is_a_field():
    fields = {}
    for name, cls in config.SECTIONS.items():
        assert (cls.__doc__ or "").strip(), name
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help", "").strip() or not f.metadata.get("cli", True), f.name
            fields[f.name] = name
    dests = {a.dest for a in config.build_parser()._actions if a.option_strings}
    assert dests - {"help", "config"} <= set(fields)
    assert set(fields) - dests == {"padded_vocab_size"}  # decided by the run, not a flag


def test_flags_fill_their_sections():
    cfg = config.parse_args(["--num-layers", "3", "--lr", "1e-3", "--no-overlap-grad-sync",
                             "--tensor-model-parallel-size", "2", "--save", "ckpt",
                             "--override-opt_param-scheduler"])
    assert cfg.model.num_layers == 3 and cfg.optimizer.lr == 1e-3
    assert cfg.optimizer.overlap_grad_sync is False
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.checkpoint.save == "ckpt"
    assert cfg.checkpoint.override_opt_param_scheduler  # Megatron's spelling too
    assert cfg.model.hidden_size == config.ModelConfig().hidden_size  # untouched: default


def test_the_tree_is_frozen_and_changes_make_new_trees():
    cfg = config.parse_args([])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optimizer.lr = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model = config.ModelConfig()
    new = cfg.updated(lr=1.0, num_layers=7)
    assert (new.optimizer.lr, new.model.num_layers) == (1.0, 7)
    assert (cfg.optimizer.lr, cfg.model.num_layers) == (6e-4, 4)
    assert new.data is cfg.data  # sections without a change are shared
    with pytest.raises(KeyError, match="no_such_flag"):
        cfg.updated(no_such_flag=1)


def test_resolve_decides_what_the_flags_leave_open():
    cfg = config.parse_args(["--micro-batch-size", "2", "--global-batch-size", "16",
                             "--tensor-model-parallel-size", "2", "--hidden-size", "64"])
    out = cfg.resolve(cpu=True, dp_size=2, vocab_size=1000)
    assert out.training.global_batch_size == 16 and out.grad_acc(2) == 4
    assert out.model.padded_vocab_size == 1024 and out.model.ffn_hidden_size == 256
    assert out.optimizer.gradient_accumulation_fusion is True  # several micro-batches
    assert out.runtime.cpu and not cfg.runtime.cpu and cfg.model.padded_vocab_size is None
    one = config.parse_args(["--micro-batch-size", "2"]).resolve(cpu=True, dp_size=2,
                                                                 vocab_size=1000)
    assert one.training.global_batch_size == 4 and not one.optimizer.gradient_accumulation_fusion
    with pytest.raises(ValueError, match="--global-batch-size"):
        config.parse_args(["--micro-batch-size", "2", "--global-batch-size", "6"]).resolve(
            cpu=True, dp_size=2, vocab_size=1000)
    assert out.gpt().vocab_size == 1024 and out.gpt().hidden_size == 64


def test_toml_file_under_the_command_line(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nnum_layers = 6\nhidden-size = 96\n'
                    '[optimizer]\nlr = 0.002\nmin_lr = 0.0001\n[logging]\nlog_file = "x.jsonl"\n')
    cfg = config.parse_args(["--config", str(path), "--num-layers", "2"])
    assert cfg.model.num_layers == 2  # the command line wins
    assert cfg.model.hidden_size == 96 and cfg.optimizer.lr == 0.002  # then the file
    assert cfg.logging.log_file == "x.jsonl"
    path.write_text("[optimizer]\nlr = 1\nmin_lr = 0\n")  # TOML ints for float fields
    assert config.parse_args(["--config", str(path)]).optimizer.lr == 1.0
    assert cfg.training.train_iters == config.TrainingConfig().train_iters  # then defaults
    # The file's values are checked like flags.
    path.write_text("[optimizer]\nlr = 0.001\nmin_lr = 0.01\n")
    with pytest.raises(SystemExit):
        config.parse_args(["--config", str(path)])


@pytest.mark.parametrize("text,message", [
    ("[modle]\nnum_layers = 2\n", "unknown section [modle]"),
    ("[model]\nnum_layer = 2\n", "[model] has no field 'num_layer'"),
    ("[model]\npadded_vocab_size = 2\n", "[model] has no field 'padded_vocab_size'"),
    ("[model]\nnum_layers = \"2\"\n", "num_layers = '2' is not of type int"),
    ("[model]\nswiglu = 1\n", "swiglu = 1 is not of type bool"),
    ("[model]\nnormalization = \"BatchNorm\"\n", "choose from"),
])
def test_toml_typos_are_errors(tmp_path, capsys, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(SystemExit) as info:
        config.parse_args(["--config", str(path)])
    assert info.value.code == 2 and message in capsys.readouterr().err
