"""DistributedFusedAdam parity with ``torch.optim.AdamW`` on a full replica (gradients
all-reduced to their mean over the process group), through the public API only.

Each test targets one defect or API gap (see the section comments); a rank function
runs on a cached gloo world of 1, 2 or 4 ranks, or a 2x2 distributed x redundant grid.
Tolerances: fp32 paths ``RTOL, ATOL = 1.3e-6, 1e-5`` (as dfa_common), bf16 ones say theirs.
"""

import copy
import random
import warnings

import pytest
import torch
import torch.distributed as dist

from mpzero.optimizers import DistributedFusedAdam

from dfa_common import ATOL, RTOL, batches, groups_for, loss_fn, make_model

TINY = 1e-5  # MiB: 2-3 fp32 elements, rounded up to one alignment unit: params fragment
LARGE = 100.0
GRIDS = [(1, "flat"), (2, "flat"), (4, "flat"), (4, "2x2")]


def _setup(grid):
    torch.set_num_threads(1)
    return groups_for(grid)


def _ref_grads(ref, data_step, world, subsets=None):
    """Mean over ranks of the summed micro-batch gradients (``subsets[r][m]``: names of
    the parameters that get a gradient from micro-batch m on rank r; None: all)."""
    named = dict(ref.named_parameters())
    for r in range(world):
        for m, (x, y) in enumerate(data_step[r]):
            loss = loss_fn(ref, x, y) / world
            if subsets is None:
                loss.backward()
            else:
                loss.backward(inputs=[named[n] for n in subsets[r][m]])


def _assert_params_close(model, ref, rtol=RTOL, atol=ATOL):
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().float(), q.detach().float(), rtol=rtol, atol=atol,
                                   msg=lambda m, n=n: f"{n}: {m}")


def _names(model):
    return [n for n, _ in model.named_parameters()]


# ------------------------------------------------ 1. accumulation, late first gradient
def _missing_subsets(case, rank, micro, names):
    """Names that get a gradient on ``rank`` in each micro-batch (the last: all)."""
    head = [n for n in names if n.startswith("head")]
    fc1 = [n for n in names if n.startswith("fc1")]
    missing = {
        "head_first": {0: head},
        "fc1_first": {0: fc1},
        "rank_dependent": {0: fc1 if rank % 2 == 0 else head},
        "middle_only": {0: head + fc1, 2: head},  # head gets a gradient only in mb 1
    }[case]
    out = []
    for m in range(micro):
        miss = set(missing.get(m, []))
        if case == "middle_only" and m == micro - 1:
            miss = set(head)
        out.append([n for n in names if n not in miss])
    return out


def _accumulate_late_grads(grid, case, use_no_sync, cap, order):
    kw = _setup(grid)
    world, rank = dist.get_world_size(), dist.get_rank()
    micro, steps = 3, 2
    model = make_model()
    ref = copy.deepcopy(model)
    params = list(model.parameters())
    if order == "reversed":
        params = params[::-1]
    elif order == "shuffled":
        random.Random(7).shuffle(params)
    opt = DistributedFusedAdam(params, lr=1e-2, bucket_cap_mb=cap, overlap_grad_sync=True, **kw)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    data = batches(world, steps, micro)
    names = _names(model)
    named = dict(model.named_parameters())
    subsets = [_missing_subsets(case, r, micro, names) for r in range(world)]
    for s in range(steps):
        opt.zero_grad()
        for m, (x, y) in enumerate(data[s][rank]):
            loss = loss_fn(model, x, y)
            inputs = [named[n] for n in subsets[rank][m]]
            if use_no_sync and m < micro - 1:
                with opt.no_sync():
                    loss.backward(inputs=inputs)
            else:
                loss.backward(inputs=inputs)
        opt.step()
        ropt.zero_grad()
        _ref_grads(ref, data[s], world, subsets)
        ropt.step()
    _assert_params_close(model, ref)
    return True


def _late_grad_cases():
    """32 cases x 6 bucket layouts and orders. The quick tier keeps the 2-rank grid for
    every case and the 2 x 2 grid for the rank-dependent one (together they hold what the
    others do: sharding, redundancy, rank-dependent gaps); the rest run in `make test`."""
    cases = []
    for use_no_sync in (False, True):
        for case in ("head_first", "fc1_first", "rank_dependent", "middle_only"):
            for world_size, grid in ((1, "flat"), (2, "flat"), (4, "flat"), (4, "2x2")):
                quick = (grid == "flat" and world_size == 2 and not use_no_sync) or (
                    grid == "2x2" and case == "rank_dependent")
                cases.append(pytest.param(world_size, grid, case, use_no_sync,
                                          marks=() if quick else pytest.mark.slow))
    return cases


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size,grid,case,use_no_sync", _late_grad_cases())
def test_accumulation_param_without_grad_in_first_microbatch(world, world_size, grid, case,
                                                             use_no_sync):
    for cap in (TINY, LARGE):
        for order in ("forward", "reversed", "shuffled"):
            assert all(world(world_size, _accumulate_late_grads, grid, case, use_no_sync, cap,
                             order, timeout=90))


# ------------------------------------------------ 2. grad_norm / clip with a generator
def _norm_with_generator(grid):
    kw = _setup(grid)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY, **kw)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    data = batches(world, 1, 1)
    loss_fn(model, *data[0][rank][0]).backward()
    _ref_grads(ref, data[0], world)
    expected = torch.linalg.vector_norm(torch.stack([q.grad.norm() for q in ref.parameters()]))
    as_list = opt.grad_norm(parameters=list(model.parameters()))
    as_gen = opt.grad_norm(parameters=model.parameters())
    torch.testing.assert_close(as_list, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(as_gen, as_list, rtol=1e-6, atol=0.0)
    clipped = opt.clip_grad_norm(0.5, parameters=(p for p in model.parameters()))
    torch.testing.assert_close(clipped, expected, rtol=1e-5, atol=1e-7)
    opt.step()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    ropt.step()
    _assert_params_close(model, ref)
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,grid", GRIDS)
def test_grad_norm_accepts_generator(world, world_size, grid):
    assert all(world(world_size, _norm_with_generator, grid))


# ------------------------------------------------ 3. cached norm makes no collective
def _cached_norm_no_collective(use_params):
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY)
    data = batches(world, 1, 1)
    loss_fn(model, *data[0][rank][0]).backward()
    sub = list(model.parameters())[:3] if use_params else None
    first = opt.grad_norm(sub).clone()
    if rank == 0:  # the others do not call it: a collective here would hang
        again = opt.grad_norm(list(sub) if use_params else None)
        assert torch.equal(again, first), (again, first)
    return first.item()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("use_params", [False, True])
def test_second_grad_norm_is_cached_without_collective(world, use_params):
    norms = world(2, _cached_norm_no_collective, use_params, timeout=30)
    assert norms[0] == norms[1]


# ------------------------------------------------ 4. initial parameter broadcast
def _broadcast_initial_params(grid):
    kw = _setup(grid)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model(seed=1000 + rank)  # every rank starts from different weights
    ref = make_model(seed=1000)  # rank 0's: the first rank of process_group (the world)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY, **kw)
    opt.state_dict()  # makes the layout: parameters are broadcast from the first rank
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach())
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    data = batches(world, 2, 1)
    for s in range(2):
        opt.zero_grad()
        loss_fn(model, *data[s][rank][0]).backward()
        opt.step()
        ropt.zero_grad()
        _ref_grads(ref, data[s], world)
        ropt.step()
    _assert_params_close(model, ref)
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,grid", [(2, "flat"), (4, "flat"), (4, "2x2")])
def test_initial_params_broadcast_from_first_rank(world, world_size, grid):
    assert all(world(world_size, _broadcast_initial_params, grid))


# ------------------------------------------------ helpers for bf16 / remainders
def _round_ties_away(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, nearest with ties away from zero (the documented remainder rule)."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    hi = ((bits >> 16) + ((bits >> 15) & 1)) & 0xFFFF
    hi = torch.where(hi >= 0x8000, hi - 0x10000, hi).to(torch.int16)
    return hi.view(torch.bfloat16)


class _MixedNet(torch.nn.Module):
    """A bf16 net with one fp32 output scale."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4321)
        self.net = make_model(dtype=torch.bfloat16)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 5))

    def forward(self, x):
        return self.net(x.to(torch.bfloat16)).float() * self.scale


# ------------------------------------------------ 5. remainders + an fp32 bucket
def _remainders_with_fp32_bucket(grid, how):
    kw = _setup(grid)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _MixedNet()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-3, bucket_cap_mb=TINY,
                               store_params=False, store_param_remainders=True,
                               param_sync_dtype=torch.bfloat16, **kw)
    if how == "bucket":
        opt.init_params_bucket([model.scale], param_sync_dtype=torch.float32)
    else:
        opt.init_params([model.scale], param_sync_dtype=torch.float32)
    # Reference: fp32 masters with AdamW; the bf16 model sees them rounded (ties away).
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    ropt = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.0)
    ref = _MixedNet()
    data = batches(world, 3, 1)
    for s in range(3):
        opt.zero_grad()
        loss_fn(model, *data[s][rank][0]).backward()
        opt.step()
        with torch.no_grad():
            for q, mst in zip(ref.parameters(), masters):
                q.copy_(mst if q.dtype == torch.float32 else _round_ties_away(mst.detach()))
        ref.zero_grad()
        _ref_grads(ref, data[s], world)
        for q, mst in zip(ref.parameters(), masters):
            mst.grad = q.grad.float()
        ropt.step()
    sd = opt.state_dict()
    # Module.parameters() yields a module's own parameters before its children's.
    i_scale = next(i for i, p in enumerate(model.parameters()) if p is model.scale)
    # The fp32 parameter's bucket keeps an fp32 master: the parameter is exactly it.
    assert torch.equal(sd["state"][i_scale]["param"], model.scale.detach())
    for i, (p, mst) in enumerate(zip(model.parameters(), masters)):
        master = sd["state"][i]["param"]
        if p.dtype == torch.bfloat16:
            assert torch.equal(p.detach(), _round_ties_away(master)), i
        torch.testing.assert_close(master, mst.detach(), rtol=2e-3, atol=2e-4)
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["bucket", "params"])
@pytest.mark.parametrize("world_size,grid", [(1, "flat"), (2, "flat"), (4, "2x2")])
def test_remainders_with_fp32_param_bucket(world, world_size, grid, how):
    assert all(world(world_size, _remainders_with_fp32_bucket, grid, how))


# ------------------------------------------------ 6. plain model-parallel (pipeline) group
class _Stage(torch.nn.Module):
    def __init__(self, stage):
        super().__init__()
        torch.manual_seed(50 + stage)
        d = 6 + 3 * stage  # the stages hold different parameters
        self.lin = torch.nn.Linear(d, 4)
        self.extra = torch.nn.Parameter(torch.randn(d + 1))

    def forward(self, x):
        return self.lin(x).sum() + (self.extra ** 2).sum() * 0.1


def _pipeline_group_norm():
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    selves = [dist.new_group([r]) for r in range(world)]
    stages = [_Stage(s) for s in range(world)]
    xs = [torch.randn(3, 6 + 3 * s, generator=torch.Generator().manual_seed(s))
          for s in range(world)]
    # Every rank knows every stage's gradient: the expected norm over all stages.
    sq = 0.0
    for s in range(world):
        ref = copy.deepcopy(stages[s])
        ref(xs[s]).backward()
        sq += sum(float(q.grad.double().pow(2).sum()) for q in ref.parameters())
    expected = sq ** 0.5
    model = stages[rank]
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, process_group=selves[rank],
                               model_parallel_group=dist.group.WORLD)
    model(xs[rank]).backward()
    norm = opt.grad_norm()
    assert abs(norm.item() - expected) <= 1e-5 * expected, (norm.item(), expected)
    clipped = opt.clip_grad_norm(1e9)
    assert abs(clipped.item() - expected) <= 1e-5 * expected
    return norm.item()


@pytest.mark.timeout(90)
def test_model_parallel_plain_group_counts_every_stage(world):
    norms = world(2, _pipeline_group_norm)
    assert norms[0] == pytest.approx(norms[1], rel=1e-6)


# ------------------------------------------------ 7. contiguous grad buffer writes
def _grad_buffer_writes(grid):
    kw = _setup(grid)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY,
                               contiguous_grad_buffer=True, **kw)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    for s in range(2):
        opt.zero_grad(set_to_none=False)
        ropt.zero_grad()
        for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters())):
            gens = [torch.Generator().manual_seed(100 * s + 10 * i + r) for r in range(world)]
            grads = [torch.randn(p.shape, generator=g) for g in gens]
            view = opt.grad_buffer_view(p)
            assert view.shape == p.shape
            view.copy_(grads[rank])
            q.grad = sum(grads) / world
        opt.step()
        ropt.step()
    _assert_params_close(model, ref)
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,grid", GRIDS)
def test_grad_buffer_view_writes_are_stepped(world, world_size, grid):
    assert all(world(world_size, _grad_buffer_writes, grid))


def _grad_buffer_after_backward():
    """With overlap_grad_sync=False nothing is reduced in backward: the buffer view holds
    the local gradient, which is what the next step reduces."""
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    local = copy.deepcopy(model)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY,
                               contiguous_grad_buffer=True, overlap_grad_sync=False)
    x, y = batches(world, 1, 1)[0][rank][0]
    loss_fn(model, x, y).backward()
    loss_fn(local, x, y).backward()
    for p, q in zip(model.parameters(), local.parameters()):
        torch.testing.assert_close(opt.grad_buffer_view(p), q.grad, rtol=RTOL, atol=ATOL)
    return True


@pytest.mark.timeout(90)
def test_grad_buffer_view_holds_local_grad_after_backward(world):
    assert all(world(2, _grad_buffer_after_backward))


# ------------------------------------------------ 8. overlap_param_sync + state dicts
def _overlap_param_sync_state(grid):
    kw = _setup(grid)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY,
                               overlap_param_sync=True, module=model, **kw)
    data = batches(world, 2, 1)
    for s in range(2):
        opt.zero_grad()
        loss_fn(model, *data[s][rank][0]).backward()
        opt.step()
    opt.param_sync()
    msd = {k: v.clone() for k, v in model.state_dict().items()}
    sd = opt.state_dict()
    for i, name in enumerate(_names(model)):
        assert torch.equal(msd[name], sd["state"][i]["param"]), name
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,grid", [(1, "flat"), (2, "flat"), (4, "2x2")])
def test_overlap_param_sync_then_model_state_dict(world, world_size, grid):
    assert all(world(world_size, _overlap_param_sync_state, grid))


# ------------------------------------------------ 9. torch's scaler.unscale_
def _torch_unscale():
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    rscaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    data = batches(world, 2, 1)
    for s in range(2):
        opt.zero_grad()
        scaler.scale(loss_fn(model, *data[s][rank][0])).backward()
        # A clear refusal (naming unscale_grads) at unscale_ or at the step right after it
        # is allowed; an unrelated error (AttributeError) or a silent no-op is not.
        try:
            scaler.unscale_(opt)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                scaler.step(opt)
        except AttributeError:
            raise
        except Exception as e:  # noqa: BLE001 - a clear refusal is allowed
            assert "unscale_grads" in str(e), str(e)
            return "refused"
        scaler.update()
        ropt.zero_grad()
        rscaler.scale(sum(loss_fn(ref, *data[s][r][0]) for r in range(world)) / world).backward()
        rscaler.unscale_(ropt)
        rscaler.step(ropt)
        rscaler.update()
    _assert_params_close(model, ref)
    assert scaler.get_scale() == rscaler.get_scale()
    return "works"


@pytest.mark.timeout(90)
def test_torch_scaler_unscale_works_or_refuses_clearly(world):
    if not torch.amp.GradScaler("cpu").is_enabled():
        pytest.skip("torch.amp.GradScaler('cpu') is disabled in this torch build")
    out = world(2, _torch_unscale)
    assert out[0] == out[1]


# ------------------------------------------------ 10. capturable + LR scheduler
def _capturable_scheduler():
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY, capturable=True)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    lam = [1.0, 0.1, 3.0, 0.5]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lam[min(s, 3)])
    rsched = torch.optim.lr_scheduler.LambdaLR(ropt, lambda s: lam[min(s, 3)])
    data = batches(world, 4, 1)
    for s in range(4):
        opt.zero_grad()
        loss_fn(model, *data[s][rank][0]).backward()
        opt.step()
        sched.step()
        ropt.zero_grad()
        _ref_grads(ref, data[s], world)
        ropt.step()
        rsched.step()
        _assert_params_close(model, ref)
    return True


@pytest.mark.timeout(90)
def test_capturable_follows_lr_scheduler(world):
    assert all(world(2, _capturable_scheduler))


# ------------------------------------------------ 11. step leaves the synced grad alone
def _grad_unchanged_by_step(grid, clip):
    kw = _setup(grid)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY,
                               weight_decay=0.1, **kw)
    data = batches(world, 2, 1)
    for s in range(2):
        opt.zero_grad()
        loss_fn(model, *data[s][rank][0]).backward()
        before = opt.grad_norm().clone()
        if clip:
            opt.clip_grad_norm(before.item() / 4)
        opt.step()
        after = opt.grad_norm(force=True)
        torch.testing.assert_close(after, before, rtol=1e-6, atol=0.0)
    return True


@pytest.mark.timeout(90)
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("world_size,grid", [(1, "flat"), (2, "flat"), (4, "2x2")])
def test_step_leaves_synced_grad_unchanged(world, world_size, grid, clip):
    assert all(world(world_size, _grad_unchanged_by_step, grid, clip))


# ------------------------------------------------ 12. remainders: load from fp32 checkpoint
def _tie_values(n, seed):
    """fp32 values of moderate magnitude; every other one is an exact bf16 tie
    (low half 0x8000), half of those with an even high half (where RNE rounds down)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 0.5
    bits = x.view(torch.int32).clone()
    ties = torch.arange(n) % 2 == 0
    even = torch.arange(n) % 4 == 0
    hi = bits & ~0xFFFF
    hi = torch.where(even, hi & ~0x10000, hi | 0x10000)  # even / odd high half
    bits = torch.where(ties, hi | 0x8000, bits)
    return bits.view(torch.float32)


def _remainder_load(grid, load_grid_same):
    kw = _setup(grid)
    world, rank = dist.get_world_size(), dist.get_rank()
    okw = dict(lr=1e-3, bucket_cap_mb=TINY, store_params=False, store_param_remainders=True,
               param_sync_dtype=torch.bfloat16)
    model = make_model(dtype=torch.bfloat16)
    opt = DistributedFusedAdam(model.parameters(), **okw, **kw)
    data = batches(world, 1, 1, dtype=torch.bfloat16)
    loss_fn(model, *data[0][rank][0]).backward()
    opt.step()
    sd = opt.state_dict()
    # An fp32 checkpoint whose masters include exact ties.
    for i in range(len(_names(model))):
        st = sd["state"][i]
        st["param"] = _tie_values(st["param"].numel(), 10 + i).view(st["param"].shape)
    saved = {i: sd["state"][i]["param"].clone() for i in range(len(_names(model)))}
    model2 = make_model(seed=77, dtype=torch.bfloat16)
    opt2 = DistributedFusedAdam(model2.parameters(), **okw, **kw)
    # The user's model load: torch's round-to-nearest-even cast.
    model2.load_state_dict({n: saved[i].to(torch.bfloat16) for i, n in enumerate(_names(model2))})
    opt2.load_state_dict(sd)
    sd2 = opt2.state_dict()
    for i, (n, p) in enumerate(model2.named_parameters()):
        got = sd2["state"][i]["param"]
        assert torch.equal(got.view(torch.int32), saved[i].view(torch.int32)), n
        assert torch.equal(p.detach().view(torch.int16),
                           _round_ties_away(saved[i]).view(torch.int16)), n
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,grid", [(1, "flat"), (2, "flat"), (4, "2x2")])
def test_remainders_load_from_fp32_masters_with_ties(world, world_size, grid):
    assert all(world(world_size, _remainder_load, grid, True))


# ------------------------------------------------ 13. wide integer param sync
def _train(model, opt, world, rank, steps=3, dtype=torch.float32):
    data = batches(world, steps, 1, dtype=dtype)
    for s in range(steps):
        opt.zero_grad()
        loss_fn(model, *data[s][rank][0]).backward()
        opt.step()
    opt.param_sync()
    return data


def _wide_int_sync(grid, case):
    kw = _setup(grid)
    world, rank = dist.get_world_size(), dist.get_rank()
    if case == "fp32_int64":
        model = make_model()
        ref = copy.deepcopy(model)
        opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY,
                                   param_sync_dtype=torch.int64, **kw)
        data = _train(model, opt, world, rank)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
        for s in range(3):
            ropt.zero_grad()
            _ref_grads(ref, data[s], world)
            ropt.step()
        _assert_params_close(model, ref)
        return True
    if case == "fp32_int64_scaled":
        model = make_model()
        float_run = copy.deepcopy(model)
        opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY,
                                   dtype=torch.bfloat16, with_scaled_states=True,
                                   param_sync_dtype=torch.int64, **kw)
        data = _train(model, opt, world, rank)
        ref = float_run
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
        for s in range(3):
            ropt.zero_grad()
            _ref_grads(ref, data[s], world)
            ropt.step()
        _assert_params_close(model, ref, rtol=5e-2, atol=5e-2)  # bf16 states
        return True
    # bf16 params, int32 sync: lossless, so equal to the bf16-sync run bit for bit.
    scaled = case == "bf16_int32_scaled"
    extra = dict(dtype=torch.bfloat16, with_scaled_states=True) if scaled else {}
    runs = []
    for sync in (torch.int32, torch.bfloat16):
        model = make_model(dtype=torch.bfloat16)
        opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY,
                                   param_sync_dtype=sync, **extra, **kw)
        _train(model, opt, world, rank, dtype=torch.bfloat16)
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["fp32_int64", "bf16_int32", "bf16_int32_scaled",
                                  "fp32_int64_scaled"])
@pytest.mark.parametrize("world_size,grid", [pytest.param(2, "flat", marks=pytest.mark.slow),
                                             (4, "2x2")])  # the 2-rank grid: `make test`
def test_wide_integer_param_sync_is_lossless(world, world_size, grid, case):
    assert all(world(world_size, _wide_int_sync, grid, case))


# ------------------------------------------------ 14. gradient of the wrong shape
def _wrong_grad_shape(how):
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY)
    x, y = batches(world, 1, 1)[0][rank][0]
    with opt.no_sync():  # gradients stay in param.grad
        loss_fn(model, x, y).backward()
    w = model.fc1.weight  # 13 x 7
    w.grad.data = w.grad.t().contiguous()  # same numel, other shape
    with pytest.raises((RuntimeError, ValueError), match="shape"):
        if how == "step":
            opt.step()
        else:
            opt.grad_sync()
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["step", "grad_sync"])
def test_grad_of_wrong_shape_is_a_clear_error(world, how):
    assert all(world(1, _wrong_grad_shape, how, timeout=30))


# ------------------------------------------------ API gaps
def _init_params_no_args():
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY)
    opt.init_params([model.head.weight])
    opt.init_params()  # every remaining parameter
    data = _train(model, opt, world, rank, steps=2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    for s in range(2):
        ropt.zero_grad()
        _ref_grads(ref, data[s], world)
        ropt.step()
    _assert_params_close(model, ref)
    return True


@pytest.mark.timeout(60)
def test_init_params_without_arguments(world):
    assert all(world(2, _init_params_no_args))


def _state_dict_keywords():
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY)
    _train(model, opt, world, rank, steps=1)
    plain = opt.state_dict()
    for kw in (dict(gather_on_root=True), dict(gather_on_root=False),
               dict(state_dict_format=2), dict(gather_on_root=False, state_dict_format=2)):
        sd = opt.state_dict(**kw)
        if rank == 0 or not kw.get("gather_on_root", False):
            for i in range(len(_names(model))):
                assert torch.equal(sd["state"][i]["exp_avg"], plain["state"][i]["exp_avg"])
    # A format-2 dict without the "format" key loads (read as format 2).
    nokey = {k: v for k, v in plain.items() if k != "format"}
    model2 = make_model()
    opt2 = DistributedFusedAdam(model2.parameters(), lr=1e-2, bucket_cap_mb=TINY * 7)
    opt2.load_state_dict(nokey)
    sd2 = opt2.state_dict()
    for i in range(len(_names(model))):
        for k in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sd2["state"][i][k], plain["state"][i][k]), (i, k)
    return True


@pytest.mark.timeout(60)
def test_state_dict_keywords_and_missing_format_key(world):
    assert all(world(2, _state_dict_keywords))


class _ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.conv = torch.nn.Conv2d(3, 5, 3).to(memory_format=torch.channels_last)
        self.conv2 = torch.nn.Conv2d(5, 4, 2).to(memory_format=torch.channels_last)

    def forward(self, x):
        return self.conv2(torch.tanh(self.conv(x)))


def _channels_last():
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _ConvNet()
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    g = torch.Generator().manual_seed(5)
    xs = [[torch.randn(2, 3, 6, 6, generator=g).to(memory_format=torch.channels_last)
           for _ in range(world)] for _ in range(2)]
    for s in range(2):
        opt.zero_grad()
        model(xs[s][rank]).pow(2).sum().backward()
        opt.step()
        ropt.zero_grad()
        (sum(ref(xs[s][r]).pow(2).sum() for r in range(world)) / world).backward()
        ropt.step()
    _assert_params_close(model, ref)
    return True


@pytest.mark.timeout(60)
def test_channels_last_conv_weights(world):
    assert all(world(2, _channels_last))


def _step_in_state():
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY)
    _train(model, opt, world, rank, steps=3)
    sd = opt.state_dict()
    for i, p in enumerate(model.parameters()):
        assert "step" in opt.state[p], i
        assert int(opt.state[p]["step"]) == 3
        assert int(sd["state"][i]["step"]) == 3
    assert sd["state"]["step"] == 3
    return True


@pytest.mark.timeout(60)
def test_step_count_in_per_param_state(world):
    assert all(world(2, _step_in_state))


def test_low_utilization_warning_message():
    params = [torch.nn.Parameter(torch.randn(1)) for _ in range(64)]
    opt = DistributedFusedAdam(params, lr=1e-2, bucket_cap_mb=1e-4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sum(p.sum() for p in params).backward()
        opt.step()
    msgs = [str(w.message) for w in caught]
    assert any("Consider decreasing the bucket_cap_mb argument." in m for m in msgs), msgs
