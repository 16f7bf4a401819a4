"""``attach(module, unit=True)``: one forward pre-hook per unit (e.g. a compiled block)
gathers all its parameters; no hook runs inside it."""

import torch

from mpzero.optimizers import DistributedFusedAdam


def _model():
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
              for _ in range(3)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(8, 2))


def _train(model, opt, steps=3, g=None):
    g = g or torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    opt.param_sync()
    return [p.detach().clone() for p in model.parameters()]


def _units_gather_like_no_overlap(units_first):
    ref_model = _model()
    ref = _train(ref_model, DistributedFusedAdam(ref_model.parameters(), lr=1e-2,
                                                 bucket_cap_mb=1e-4))
    model = _model()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=1e-4,
                               overlap_param_sync=True)
    blocks = list(model)[:3]
    if not units_first:
        opt.attach(model)
    for block in blocks:
        opt.attach(block, unit=True)
    if units_first:
        opt.attach(model)
    # one hook per block, one for the head; none on the blocks' inner Linear layers
    assert len(opt._modules.handles) == 4, len(opt._modules.handles)
    for block in blocks:
        assert len(block._forward_pre_hooks) == 1
        assert all(len(m._forward_pre_hooks) == 0 for m in block)
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    _train(model, opt, steps=1, g=g)  # makes the layout (and the gather pipeline)
    seen = []
    orig = opt.ensure_layout().gathers.ensure

    def ensure(owned, prefetch=1):
        seen.append(len(owned))
        return orig(owned, prefetch)

    opt.ensure_layout().gathers.ensure = ensure
    got = _train(model, opt, steps=2, g=g)
    assert 4 in seen  # a block's hook asked for all 4 of its parameters at once
    return all(torch.equal(a, b) for a, b in zip(ref, got))


def test_units_gather_like_no_overlap(world):
    assert all(world(2, _units_gather_like_no_overlap, True))
    assert all(world(2, _units_gather_like_no_overlap, False))


def _compiled_graphs(hooks):
    """Graphs dynamo makes for three identical compiled blocks, with the optimizer's
    hooks on the blocks ("unit"), on their inner Linear layers ("plain") or none."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _model()
    blocks = list(model)[:3]
    for block in blocks:
        block.forward = torch.compile(block.forward, backend="eager")
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, overlap_param_sync=True)
    if hooks == "unit":
        for block in blocks:
            opt.attach(block, unit=True)
    if hooks != "none":
        opt.attach(model)
    _train(model, opt, steps=2)
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return graphs


def test_compiled_blocks_trace_as_without_hooks(world):
    # Unit hooks run outside the compiled code: as many graphs as with no hooks (2: the
    # first block's input does not require grad); a hook per inner Linear, each with its
    # own parameter indices, makes dynamo trace every block anew.
    (none,) = world(1, _compiled_graphs, "none")
    assert world(1, _compiled_graphs, "unit") == [none]
    assert world(1, _compiled_graphs, "plain")[0] > none
