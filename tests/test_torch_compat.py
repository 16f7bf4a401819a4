"""mpzero.torch_compat: the standalone checks for scripts ported from
DDP + torch.optim.AdamW (param-group keys, collective entry, DDP, clipping, stacklevel)."""

import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from mpzero import collective_check as cc
from mpzero import torch_compat as tc
from mpzero.optimizers import OptionError
from mpzero.warn import user_stacklevel

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------- param groups
def _group(**kw):
    return {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 1e-3, **kw}


def test_known_keys_accepted():
    tc.check_param_group_options(
        _group(betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, bias_correction=True,
               initial_lr=1e-3, max_lr=1e-2, min_lr=1e-5, max_momentum=0.95,
               base_momentum=0.85, swa_lr=0.05, param_names=["w"], name="decay"), 0)


@pytest.mark.parametrize("key,value", [("maximize", False), ("amsgrad", False),
                                       ("foreach", None), ("foreach", False),
                                       ("fused", None), ("fused", False),
                                       ("differentiable", False), ("capturable", False)])
def test_torch_keys_at_harmless_defaults_accepted(key, value):
    tc.check_param_group_options(_group(**{key: value}), 3)


@pytest.mark.parametrize("key,value,advice", [
    ("maximize", True, "negate the loss"), ("amsgrad", True, "AMSGrad"),
    ("foreach", True, "drop foreach"), ("fused", True, "drop fused"),
    ("differentiable", True, "not differentiable"),
    ("capturable", True, "DistributedFusedAdam(capturable=True)"),
    ("maximize", 1, "negate the loss")])
def test_torch_keys_rejected(key, value, advice):
    with pytest.raises(OptionError, match=f"param group 2: {key}={value!r}") as e:
        tc.check_param_group_options(_group(**{key: value}), 2)
    assert advice in str(e.value)
    assert isinstance(e.value, ValueError)


def test_unknown_key_rejected_with_advice():
    with pytest.raises(ValueError, match="param group 1: unknown key 'weight_dacay'") as e:
        tc.check_param_group_options(_group(weight_dacay=0.1), 1)
    assert "register_param_group_key('weight_dacay')" in str(e.value)
    with pytest.raises(OptionError, match="'momentum'"):
        tc.check_param_group_options(_group(momentum=0.9), 0)


def test_extra_and_registered_keys():
    tc.check_param_group_options(_group(lr_mult=2.0), 0, extra_keys=("lr_mult",))
    tc.check_param_group_options(_group(lr_mult=2.0), 0, extra_keys=iter(["lr_mult"]))
    with pytest.raises(OptionError):
        tc.check_param_group_options(_group(wd_mult_test_only=2.0), 0)
    tc.register_param_group_key("wd_mult_test_only")
    try:
        tc.check_param_group_options(_group(wd_mult_test_only=2.0), 0)
    finally:
        tc._EXTRA_KEYS.discard("wd_mult_test_only")
    with pytest.raises(TypeError):
        tc.register_param_group_key(3)


def test_decoupled_weight_decay():
    tc.check_param_group_options(_group(decoupled_weight_decay=True), 0, adam_w_mode=True)
    tc.check_param_group_options(_group(decoupled_weight_decay=False), 0, adam_w_mode=False)
    tc.check_param_group_options(_group(decoupled_weight_decay=False), 0)
    with pytest.raises(OptionError, match="adam_w_mode=False") as e:
        tc.check_param_group_options(_group(decoupled_weight_decay=True), 4,
                                     adam_w_mode=False)
    assert "DistributedFusedAdam(adam_w_mode=True)" in str(e.value)
    with pytest.raises(OptionError, match="must be a bool"):
        tc.check_param_group_options(_group(decoupled_weight_decay="yes"), 0)


def test_not_a_dict():
    with pytest.raises(TypeError, match="param group 0"):
        tc.check_param_group_options([1, 2], 0)


# torch's own switches and defaults in its param groups (a kernel choice, not math).
_TORCH_KEYS = ("foreach", "fused", "differentiable", "capturable", "amsgrad", "maximize",
               "decoupled_weight_decay")


def test_groups_that_lr_schedulers_make_pass():
    """Every key torch's schedulers add to a real optimizer's groups is known."""
    def fresh():
        p = torch.nn.Parameter(torch.zeros(3))
        return torch.optim.AdamW([{"params": [p]}], lr=1e-3)

    scheds = [
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=10),
        lambda o: torch.optim.lr_scheduler.CyclicLR(o, 1e-4, 1e-2, cycle_momentum=True),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, 5),
        lambda o: torch.optim.swa_utils.SWALR(o, swa_lr=0.05),
        lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o),
    ]
    for make in scheds:
        opt = fresh()
        make(opt)
        for gi, g in enumerate(opt.param_groups):
            g = {k: v for k, v in g.items() if k not in _TORCH_KEYS}
            tc.check_param_group_options(g, gi, adam_w_mode=True)


# ---------------------------------------------------------------------- timeout parsing
def test_collective_check_timeout_parsing(monkeypatch):
    monkeypatch.delenv(cc.COLLECTIVE_CHECK_ENV, raising=False)
    assert cc.collective_check_timeout() == cc.DEFAULT_COLLECTIVE_CHECK_TIMEOUT
    assert cc.collective_check_timeout(2.5) == 2.5
    monkeypatch.setenv(cc.COLLECTIVE_CHECK_ENV, "7")
    assert cc.collective_check_timeout() == 7.0
    assert cc.collective_check_timeout(1) == 1.0
    monkeypatch.setenv(cc.COLLECTIVE_CHECK_ENV, "off")
    assert cc.collective_check_timeout() == 0.0
    monkeypatch.setenv(cc.COLLECTIVE_CHECK_ENV, "soon")
    with pytest.raises(ValueError, match=cc.COLLECTIVE_CHECK_ENV):
        cc.collective_check_timeout()
    with pytest.raises(ValueError):
        cc.collective_check_timeout(-1)


def test_collective_check_without_distributed():
    assert not dist.is_initialized()
    cc.check_collective_entry("state_dict()")  # a no-op, returns at once


# ---------------------------------------------------------------------- collectives
def _collective_cases():
    rank = dist.get_rank()
    out = {}
    # 1. all ranks, many calls (keys of old calls are deleted as it goes).
    t = time.perf_counter()
    for _ in range(20):
        cc.check_collective_entry("test_all()", timeout=10)
    out["all_s"] = (time.perf_counter() - t) / 20
    # 2. a subgroup entered by its members only: the others do not take part.
    sub = dist.new_group([0, 1])
    other = dist.new_group([1, 2])
    if rank in (0, 1):
        cc.check_collective_entry("test_sub()", sub, timeout=10)
        cc.check_collective_entry("test_sub()", sub, timeout=10)
    # 3. a subgroup call made on one member only fails within the timeout, naming it.
    t = time.perf_counter()
    try:
        if rank == 1:
            cc.check_collective_entry("state_dict()_test_lonely", other, timeout=1.0)
        out["lonely"] = None
    except cc.CollectiveMismatchError as e:
        out["lonely"] = str(e)
    out["lonely_s"] = time.perf_counter() - t
    dist.barrier()
    # 4. the world: rank 0 only, the env-var timeout.
    os.environ[cc.COLLECTIVE_CHECK_ENV] = "1.5"
    try:
        t = time.perf_counter()
        if rank == 0:
            cc.check_collective_entry("state_dict()_test_rank0", timeout=None)
        out["rank0"] = None
    except cc.CollectiveMismatchError as e:
        out["rank0"] = str(e)
    finally:
        del os.environ[cc.COLLECTIVE_CHECK_ENV]
    out["rank0_s"] = time.perf_counter() - t
    dist.barrier()
    # ... and rank 0 withdrew: the same call made on every rank now pairs up.
    cc.check_collective_entry("state_dict()_test_rank0", timeout=10)
    cc.check_collective_entry("state_dict()_test_rank0", timeout=10)
    # 5. the group of one rank and comm.SELF: no store traffic, no wait.
    from mpzero import comm

    cc.check_collective_entry("test_self()", comm.SELF, timeout=1)
    cc.check_collective_entry("test_one()", dist.new_group([2]), timeout=1)
    # 6. old keys are gone: only the last call's keys of test_all() remain.
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    base = f"{cc._KEY_PREFIX}/test_all()/0,1,2"
    out["old_key_gone"] = not store.check([f"{base}/1/count"])
    out["last_key_kept"] = store.check([f"{base}/20/done"])
    dist.barrier()
    return out


@pytest.mark.slow  # real processes or a big world: `make test` only
def test_collective_entry_world3(world):
    res = world(3, _collective_cases, timeout=60)
    for r, out in enumerate(res):
        assert out["all_s"] < 0.5, out
        assert out["old_key_gone"] and out["last_key_kept"], out
        if r == 1:
            msg = out["lonely"]
            assert msg and "state_dict()_test_lonely is collective" in msg, msg
            assert "global ranks [1, 2]" in msg and "only 1 of 2 ranks" in msg, msg
            assert "every rank" in msg and "save_sharded" in msg, msg
            assert 0.9 < out["lonely_s"] < 10, out
        else:
            assert out["lonely"] is None
        if r == 0:
            msg = out["rank0"]
            assert msg and "global ranks [0, 1, 2]" in msg and "within 1.5 s" in msg, msg
            assert cc.COLLECTIVE_CHECK_ENV in msg
            assert 1.4 < out["rank0_s"] < 10, out
        else:
            assert out["rank0"] is None


# ---------------------------------------------------------------------- DDP
def _ddp_cases():
    from torch.nn.parallel import DistributedDataParallel as DDP

    inner = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    ddp = DDP(inner)
    outer = torch.nn.ModuleDict({"body": ddp})
    out = {"bare": tc.find_ddp(inner) is None and not tc.warn_if_wrapped_in_ddp(inner),
           "find": tc.find_ddp(ddp) is ddp and tc.find_ddp(outer) is ddp,
           "not_module": tc.find_ddp([1]) is None}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert tc.warn_if_wrapped_in_ddp(ddp)  # line of this call: the warning's line
        line = _lineno() - 1
        assert tc.warn_if_wrapped_in_ddp(outer)  # same DDP: warned once only
    out["n_warnings"] = len(w)
    out["category"] = w[0].category is tc.MigrationWarning
    out["message"] = str(w[0].message)
    out["points_here"] = (w[0].filename == __file__ and w[0].lineno == line)
    return out


def _lineno():
    import inspect

    return inspect.currentframe().f_back.f_lineno


def test_ddp_detection(world):
    for out in world(2, _ddp_cases, timeout=60):
        assert out["bare"] and out["find"] and out["not_module"], out
        assert out["n_warnings"] == 1 and out["category"], out
        assert "DistributedDataParallel" in out["message"] and "module=model" in out["message"]
        assert "optimizer.no_sync()" in out["message"]
        assert out["points_here"], out


# ---------------------------------------------------------------------- stacklevel
def test_user_stacklevel_points_at_caller_outside_mpzero():
    import mpzero.torch_compat as mod

    # Called directly from a test (outside mpzero): level 1 is this frame.
    assert user_stacklevel() == 1

    # An mpzero-internal caller: compile helper functions under mpzero's file name so
    # their frames count as mpzero's.
    src = ("def inner():\n"
           "    import warnings\n"
           "    warnings.warn('hello', UserWarning, stacklevel=user_stacklevel())\n"
           "def outer():\n"
           "    inner()\n"
           "def level():\n"
           "    return user_stacklevel()\n"
           "def level2():\n"
           "    return level()\n")
    ns = {"user_stacklevel": user_stacklevel}
    exec(compile(src, mod.__file__, "exec"), ns)
    assert ns["level"]() == 2
    assert ns["level2"]() == 3
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ns["outer"]()
        line = _lineno() - 1
    assert w[0].filename == __file__ and w[0].lineno == line, (w[0].filename, w[0].lineno)
