"""step() honours torch's optimizer step hooks and profiler range, though it skips
torch's per-call wrapper when neither is in use."""

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from mpzero.optimizers import DistributedFusedAdam


def _model_and_opt(lr=0.1):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = DistributedFusedAdam(model.parameters(), lr=lr)
    return model, opt


def _backward(model):
    model(torch.ones(2, 4)).square().sum().backward()


def _hooks_fire_in_order():
    model, opt = _model_and_opt()
    calls = []
    pre = opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o is opt)))
    post = opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o is opt)))
    gpre = register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("gpre", o is opt)))
    gpost = register_optimizer_step_post_hook(lambda o, a, k: calls.append(("gpost", o is opt)))
    try:
        _backward(model)
        before = model.weight.detach().clone()
        opt.step()
        assert calls == [("gpre", True), ("pre", True), ("post", True), ("gpost", True)], calls
        assert not torch.equal(model.weight, before)  # the step itself ran
    finally:
        for h in (pre, post, gpre, gpost):
            h.remove()
    calls.clear()
    _backward(model)
    opt.step()
    assert calls == []  # removed hooks are not called (and the unwrapped step runs)
    assert type(opt).step.hooked  # torch left our step unwrapped
    return True


def _pre_hook_can_replace_arguments():
    model, opt = _model_and_opt()
    seen = []

    def closure():
        seen.append("closure")
        return torch.tensor(7.0)

    opt.register_step_pre_hook(lambda o, a, k: ((o,), {"closure": closure}))
    _backward(model)
    loss = opt.step()
    assert seen == ["closure"] and float(loss) == 7.0
    return True


def _profiler_sees_the_step():
    model, opt = _model_and_opt()
    _backward(model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    names = {e.name for e in prof.events()}
    assert "Optimizer.step#DistributedFusedAdam.step" in names, sorted(names)[:20]
    return True


def _same_result_with_and_without_hooks():
    results = []
    for hooked in (False, True):
        model, opt = _model_and_opt()
        if hooked:
            opt.register_step_pre_hook(lambda o, a, k: None)
        for _ in range(3):
            opt.zero_grad()
            _backward(model)
            opt.step()
        results.append(model.weight.detach().clone())
    assert torch.equal(*results)
    return True


def test_step_hooks(world):
    assert world(1, _hooks_fire_in_order)
    assert world(1, _pre_hook_can_replace_arguments)
    assert world(1, _profiler_sees_the_step)
    assert world(1, _same_result_with_and_without_hooks)
