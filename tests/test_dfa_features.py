"""DistributedFusedAdam features on gloo worlds: ordering robustness, precisions, AMP,
param-sync overlap, layout control, errors."""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

from mpzero.optimizers import DistributedFusedAdam, OptionError

from dfa_common import ATOL, RTOL, batches, loss_fn, make_model

TINY = 24 * 4 / 2**20  # 24 fp32 elements of bucket capacity


def _reference(world, data, steps, lr=1e-2, wd=0.0, skip=None, dtype=torch.float32):
    ref = make_model(dtype=dtype)
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=wd)
    for s in range(steps):
        if skip is not None and s in skip:
            continue
        opt.zero_grad()
        sum(loss_fn(ref, *data[s][r][0]) for r in range(world)).div(world).backward()
        opt.step()
    return ref


# ---------------------------------------------------------------- ordering / unused
def _forward_head_bias_last(model, x):
    """The model's forward, with the head's bias used through a node made first: the
    engine runs later nodes first, so head.bias's gradient arrives last (it arrives
    first in the plain forward)."""
    bias = model.head.bias * 1.0
    h = torch.tanh(model.fc1(x))
    h = model.norm(h)
    h = torch.nn.functional.gelu(model.fc2(h)) + h
    return torch.nn.functional.linear(h, model.head.weight) + bias


def _different_grad_order_and_unused():
    """Odd ranks' autograd visits the params in another order; only rank 0 touches the
    unused layer. One backward pass per step on every rank (as with DDP)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model(unused=True)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY)
    order = []
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, n=n: order.append(n))
    data = batches(world, 3, 1)
    for s in range(3):
        opt.zero_grad()
        x, y = data[s][rank][0]
        if rank % 2 == 1:
            loss = torch.nn.functional.mse_loss(_forward_head_bias_last(model, x), y,
                                                reduction="sum")
        else:
            loss = loss_fn(model, x, y)
        if rank == 0:  # only rank 0 touches the unused layer (with zero effect on the loss)
            loss = loss + 0.0 * model.unused(torch.ones(1, 3)).sum()
        order.clear()
        loss.backward()
        used = [n for n in order if not n.startswith("unused")]
        assert used[0 if rank % 2 == 0 else -1] == "head.bias", order
        opt.step()
    ref = make_model(unused=True)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    for s in range(3):
        ropt.zero_grad()
        sum(loss_fn(ref, *data[s][r][0]) for r in range(world)).div(world).backward()
        ropt.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if n.startswith("unused"):
            continue
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    return True


def test_grad_order_and_unused_params_do_not_deadlock(world):
    assert all(world(2, _different_grad_order_and_unused, timeout=60))


def _frozen_params_untouched():
    model = make_model()
    model.fc1.weight.requires_grad_(False)
    before = model.fc1.weight.detach().clone()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-1, weight_decay=0.1, bucket_cap_mb=TINY)
    x, y = batches(dist.get_world_size(), 1, 1)[0][dist.get_rank()][0]
    loss_fn(model, x, y).backward()
    opt.step()
    assert torch.equal(model.fc1.weight, before)
    sd = opt.state_dict()
    assert 0 not in sd["state"] and 1 in sd["state"]
    return True


def test_frozen_params_untouched(world):
    assert all(world(2, _frozen_params_untouched))


# ---------------------------------------------------------------- precisions
def _low_precision(case):
    world, rank = dist.get_world_size(), dist.get_rank()
    kw, tol = {
        "grad_fp16": (dict(grad_sync_dtype=torch.float16), 5e-3),
        "grad_bf16": (dict(grad_sync_dtype=torch.bfloat16), 5e-2),
        "param_bf16": (dict(param_sync_dtype=torch.bfloat16), 5e-2),
        "param_fp16": (dict(param_sync_dtype=torch.float16), 5e-3),
        "state_fp16": (dict(dtype=torch.float16), 5e-3),
        "state_bf16": (dict(dtype=torch.bfloat16), 5e-2),
    }[case]
    # lr 1e-3: Adam moves every element by ~lr per step whatever the gradient's size, so
    # a near-zero gradient that rounds differently in 16 bits costs at most ~lr per step.
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-3, bucket_cap_mb=TINY, **kw)
    data = batches(world, 3, 1)
    for s in range(3):
        opt.zero_grad()
        loss_fn(model, *data[s][rank][0]).backward()
        opt.step()
    ref = _reference(world, data, 3, lr=1e-3)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol)
    return True


@pytest.mark.parametrize("case", ["grad_fp16", "grad_bf16", "param_bf16", "param_fp16",
                                  "state_fp16", "state_bf16"])
def test_low_precision(world, case):
    assert all(world(2, _low_precision, case))


def _model_dtypes(dtype_name):
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = getattr(torch, dtype_name)
    model = make_model(dtype=dtype)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY,
                               dtype=torch.float32, grad_sync_dtype=torch.float32,
                               param_sync_dtype=torch.float32)
    data = batches(world, 2, 1, dtype=dtype)
    for s in range(2):
        opt.zero_grad()
        loss_fn(model, *data[s][rank][0]).backward()
        opt.step()
    ref = _reference(world, data, 2, dtype=dtype)
    tol = {"float64": 1e-5, "float16": 5e-3, "bfloat16": 5e-2}[dtype_name]
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.dtype == dtype
        torch.testing.assert_close(p.float(), q.float(), rtol=tol, atol=tol)
    return True


@pytest.mark.parametrize("dtype_name", ["float64", "bfloat16"])
def test_model_param_dtypes_with_fp32_state(world, dtype_name):
    assert all(world(2, _model_dtypes, dtype_name))


# ---------------------------------------------------------------- AMP / inf
def _grad_scaler_skips_inf():
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY)
    scaler = torch.amp.GradScaler(torch.get_default_device().type, init_scale=2.0**10,
                                  growth_interval=1)
    data = batches(world, 3, 1)
    scales = []
    for s in range(3):
        opt.zero_grad()
        loss = loss_fn(model, *data[s][rank][0])
        if s == 1 and rank == world - 1:  # inf on one rank only: every rank must skip
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    ref = _reference(world, data, 3, skip={1})
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    assert opt.state_dict()["state"]["step"] == 2
    return scales


def test_grad_scaler_skips_inf_on_every_rank(world):
    scales = world(2, _grad_scaler_skips_inf)
    assert scales[0] == scales[1]
    assert scales[0][1] == scales[0][0] / 2  # backed off after the inf step


def _huge_finite_grads_are_not_inf():
    """Gradients whose squared norm overflows fp32 (two of 1.5e19: 4.5e38) but are all
    finite: the scaler must not skip the step (torch's GradScaler checks elements, not the
    norm). Each square stays finite (2.25e38): at |g| > 1.8e19 the kernels' ``g * g``
    overflows (the spec's order, ``(1 - beta2) * (g * g)``) where torch's ``addcmul``
    scales first, and the two would then differ by design, not by the scaler."""
    world, rank = dist.get_world_size(), dist.get_rank()
    weights = torch.tensor([1.5e19, 1.5e19, -2.0, 3.0])
    out = []
    for kind in ("dfa", "torch"):
        p = torch.nn.Parameter(torch.ones(4))
        opt = (DistributedFusedAdam([p], lr=1e-2) if kind == "dfa"
               else torch.optim.AdamW([p], lr=1e-2, weight_decay=0.0))
        scaler = torch.amp.GradScaler(torch.get_default_device().type, init_scale=1.0,
                                      growth_interval=1)
        loss = (p * weights).sum()
        # Same loss on every rank: the averaged gradient equals this rank's.
        scaler.scale(loss).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            scaler.step(opt)
        scaler.update()
        out.append((p.detach().clone(), scaler.get_scale()))
    (p_dfa, scale_dfa), (p_ref, scale_ref) = out
    torch.testing.assert_close(p_dfa, p_ref, rtol=RTOL, atol=ATOL)
    assert scale_dfa == scale_ref == 2.0  # step taken, scale grew
    assert world == 2 and rank in (0, 1)
    return True


def test_huge_finite_grads_are_not_inf(world):
    assert world(2, _huge_finite_grads_are_not_inf) == [True, True]


def _unscale_then_clip():
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    scaler = torch.amp.GradScaler(torch.get_default_device().type, init_scale=256.0)
    data = batches(world, 2, 1)
    for s in range(2):
        opt.zero_grad()
        scaler.scale(loss_fn(model, *data[s][rank][0])).backward()
        opt.unscale_grads(grad_scaler=scaler)
        norm = opt.clip_grad_norm(0.3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            scaler.step(opt)
        scaler.update()
        ropt.zero_grad()
        sum(loss_fn(ref, *data[s][r][0]) for r in range(world)).div(world).backward()
        rnorm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
        torch.testing.assert_close(norm, rnorm, rtol=1e-5, atol=1e-6)
        ropt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    return True


def test_unscale_grads_then_clip(world):
    assert all(world(2, _unscale_then_clip))


def _grad_norm_api():
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY)
    data = batches(world, 1, 1)
    loss_fn(model, *data[0][rank][0]).backward()
    sum(loss_fn(ref, *data[0][r][0]) for r in range(world)).div(world).backward()
    n = opt.grad_norm()
    assert n.dtype == torch.float32 and n.dim() == 0
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()]))
    torch.testing.assert_close(n, expected, rtol=1e-5, atol=1e-7)
    sub = [model.fc2.weight, model.head.bias]
    sub_ref = torch.linalg.vector_norm(torch.stack([ref.fc2.weight.grad.norm(),
                                                    ref.head.bias.grad.norm()]))
    torch.testing.assert_close(opt.grad_norm(sub), sub_ref, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="norm_type"):
        opt.grad_norm(norm_type=1.0)
    return True


def test_grad_norm(world):
    assert all(world(2, _grad_norm_api))


# ---------------------------------------------------------------- param sync overlap
def _overlap_param_sync(with_module):
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    kw = dict(module=model) if with_module else {}
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY,
                               overlap_param_sync=True, **kw)
    data = batches(world, 3, 1)
    caught = []
    for s in range(3):
        opt.zero_grad()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            loss_fn(model, *data[s][rank][0]).backward()
            opt.step()
        caught += [str(x.message) for x in w if "overlap_param_sync" in str(x.message)]
        if with_module and s == 0 and world > 1:
            # Gathers are deferred: some parameter is still stale until the next forward.
            # (At world 1 the step writes the params in place: nothing to gather.)
            assert opt.ensure_layout().gathers.pending()
    ref = _reference(world, data, 3)
    # The forward pass through the hooks gathers everything it uses.
    x = torch.randn(2, 7)
    torch.testing.assert_close(model(x), ref(x), rtol=RTOL, atol=ATOL)
    opt.param_sync()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    return len(caught)


@pytest.mark.parametrize("with_module", [True, False])
def test_overlap_param_sync(world, with_module):
    warned = world(2, _overlap_param_sync, with_module)
    assert warned == ([0, 0] if with_module else [1, 1])  # warns once without a module


def _gathers_in_flight_are_bounded(overlap, pipeline_size):
    """Full-size gather buffers never exceed ``pipeline_size`` buckets at once (the
    rest of the model waits as shards), in step()'s sync and in the forward hooks;
    training still equals AdamW."""
    from mpzero.optimizers.param_sync import ParamBucket

    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY,
                               overlap_param_sync=overlap, pipeline_size=pipeline_size,
                               module=model if overlap else None)
    most, start = [0], ParamBucket.start

    def counting_start(bucket, *args):
        start(bucket, *args)
        most[0] = max(most[0], sum(b.full is not None for b in opt.ensure_layout().gathers.buckets))

    ParamBucket.start = counting_start
    try:
        data = batches(world, 3, 1)
        for s in range(3):
            opt.zero_grad()
            loss_fn(model, *data[s][rank][0]).backward()
            opt.step()
        opt.param_sync()
    finally:
        ParamBucket.start = start
    n_buckets = len(opt.ensure_layout().gathers.buckets)
    ref = _reference(world, data, 3)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    return most[0], n_buckets


@pytest.mark.parametrize("overlap,pipeline_size", [(False, 1), (False, 2), (True, 2)])
def test_gathers_in_flight_are_bounded(world, overlap, pipeline_size):
    for most, n_buckets in world(2, _gathers_in_flight_are_bounded, overlap, pipeline_size):
        assert n_buckets > 2 * pipeline_size  # the bound is below the bucket count
        assert 1 <= most <= pipeline_size


# ---------------------------------------------------------------- layout control
def _init_params_order():
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY)
    opt.init_params([model.head.weight, model.fc1.bias])
    opt.init_params_bucket([model.norm.weight, model.norm.bias])
    opt.init_params(model.fc2.weight, grad_sync_dtype=torch.float32)
    data = batches(world, 2, 1)
    for s in range(2):
        opt.zero_grad()
        loss_fn(model, *data[s][rank][0]).backward()
        opt.step()
    lays = opt.shards.layouts
    first = lays[0].params
    assert first[0] == 6  # head.weight is parameter 6 and was laid out first
    norm_buckets = [b for b in lays if 2 in b.params or 3 in b.params]
    assert all(set(b.params) <= {2, 3} for b in norm_buckets)  # a bucket of their own
    ref = _reference(world, data, 2)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    return True


def test_init_params_and_bucket(world):
    assert all(world(2, _init_params_order))


def _own_buckets(sync):
    params = [torch.nn.Parameter(torch.randn(10)) for _ in range(3)]
    opt = DistributedFusedAdam(params, param_sync_dtype=sync)
    opt.init_params_bucket([params[0]])
    opt.init_params_bucket([params[1]])
    opt.init_params([params[2]])
    opt.ensure_layout()
    return [[f.param for f in lay.fragments] for lay in opt.shards.layouts]


@pytest.mark.parametrize("sync", [None, torch.int16, torch.int64], ids=str)
def test_init_params_bucket_any_sync_dtype(world, sync):
    """Fresh buckets also where byte-level sync keys buckets by the parameter's dtype."""
    assert world(1, _own_buckets, sync) == [[[0], [1], [2]]]


def _scheduler_and_groups():
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=1.0, bucket_cap_mb=TINY)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    lrs = []
    for _ in range(3):
        loss_fn(model, torch.randn(2, 7), torch.randn(2, 5)).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [0.5, 0.25, 0.125]
    assert opt.parameter(0, 0) is model.fc1.weight
    assert opt.parameters()[1] is model.fc1.bias
    return True


def test_lr_scheduler_and_accessors(world):
    assert all(world(1, _scheduler_and_groups))


# ---------------------------------------------------------------- errors
def _mismatched_models():
    model = make_model(unused=dist.get_rank() == 1)
    with pytest.raises(RuntimeError, match="different parameters"):
        # The check runs before the first collective: the initial broadcast at construction.
        DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY)
    return True


def test_mismatched_models_fail_loudly(world):
    assert all(world(2, _mismatched_models, timeout=60))


def _mismatched_added_group(count: bool):
    """A param group added after construction differs across ranks (in shape, or only
    rank 1 adds one): the layout's check catches it before any collective of the layout."""
    rank = dist.get_rank()
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY)
    if count:
        extra = torch.nn.Linear(3, 2) if rank == 1 else None
    else:
        extra = torch.nn.Linear(3, 2 if rank == 0 else 4)
    if extra is not None:
        opt.add_param_group({"params": list(extra.parameters())})
    with pytest.raises(RuntimeError, match="different parameters"):
        x, y = batches(dist.get_world_size(), 1, 1)[0][rank][0]
        loss_fn(model, x, y).backward()
        opt.step()
    return True


@pytest.mark.parametrize("count", [False, True], ids=["shape", "count"])
def test_mismatched_added_group_fails_loudly(world, count):
    assert all(world(2, _mismatched_added_group, count, timeout=60))


def _bad_grid():
    with pytest.raises(ValueError, match=r"process_group size \(2\).*\(2\).*\(2\)"):
        DistributedFusedAdam(make_model().parameters(), distributed_process_group=dist.group.WORLD,
                             redundant_process_group=dist.group.WORLD)
    return True


def test_grid_sizes_must_multiply(world):
    assert all(world(2, _bad_grid))


@pytest.mark.parametrize("kwargs,match", [
    (dict(amsgrad=True), "amsgrad"),
    (dict(dtype=torch.int32), "dtype"),
    (dict(grad_sync_dtype=torch.float64), "grad_sync_dtype"),
    (dict(store_param_remainders=True), "store_params"),
    (dict(store_param_remainders=True, store_params=False, param_sync_dtype=torch.float16),
     "param_sync_dtype"),
    (dict(with_scaled_states=True), "with_scaled_states"),
    (dict(with_scaled_states=True, store_params=False, dtype=torch.bfloat16,
          param_sync_dtype=torch.bfloat16), "store_params"),
    (dict(with_scaled_states=True, dtype=torch.bfloat16, param_sync_dtype=torch.float32),
     "param_sync_dtype"),
    (dict(capturable=True, store_param_remainders=True, store_params=False,
          param_sync_dtype=torch.bfloat16), "capturable"),
    (dict(capturable=True, with_scaled_states=True, dtype=torch.bfloat16,
          param_sync_dtype=torch.bfloat16), "capturable"),
    (dict(nccl_ub=True), "contiguous_grad_buffer"),
    (dict(nccl_ub=True, contiguous_grad_buffer=True, device="cpu"), "CUDA"),
    (dict(betas=(0.9, 1.5)), "betas"),
    (dict(lr=-1.0), "lr"),
    (dict(pipeline_size=0), "pipeline_size"),
    (dict(bucket_cap_mb=0), "bucket_cap_mb"),
])
def test_construction_errors(kwargs, match):
    with pytest.raises(OptionError, match=match):
        DistributedFusedAdam(make_model().parameters(), **kwargs)


def test_param_errors():
    m = make_model()
    with pytest.raises(ValueError, match="twice"):
        DistributedFusedAdam([m.fc1.weight, m.fc1.weight])
    with pytest.raises(ValueError, match="twice"):
        DistributedFusedAdam([{"params": [m.fc1.weight]}, {"params": [m.fc1.weight]}])
    meta = torch.nn.Parameter(torch.zeros(3, device="meta"))
    with pytest.raises(ValueError, match="different devices"):
        DistributedFusedAdam([m.fc1.weight, meta])
    with pytest.raises(ValueError, match="empty"):
        DistributedFusedAdam([])


# ---------------------------------------------------------------- capturable
def _capturable():
    """Device-side step count and skip: same numerics as the plain path, inf skips."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY,
                               capturable=True)
    scaler = torch.amp.GradScaler(torch.get_default_device().type, init_scale=2.0**8)
    data = batches(world, 4, 1)
    for s in range(4):
        opt.zero_grad()
        loss = loss_fn(model, *data[s][rank][0])
        if s == 2 and rank == 0:
            loss = loss * float("nan")
        scaler.scale(loss).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            scaler.step(opt)
        scaler.update()
    step = opt.state_dict()["state"]["step"]
    assert isinstance(step, torch.Tensor) and step.item() == 3
    ref = _reference(world, data, 4, skip={2})
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    return True


def test_capturable_device_step_and_skip(world):
    assert all(world(2, _capturable))


@pytest.mark.parametrize("with_module", [False, True])
def test_dropped_optimizer_is_freed(with_module):
    """Hooks must not keep the optimizer alive (params hold them on the C++ side, out of
    the garbage collector's reach): a dropped optimizer frees its state."""
    import gc
    import weakref

    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY,
                               overlap_param_sync=with_module,
                               module=model if with_module else None)
    loss_fn(model, *batches(1, 1, 1)[0][0][0]).backward()
    opt.step()
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None
    # The hooks left on the parameters are inert: training with a new optimizer works.
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY)
    opt.zero_grad()
    loss_fn(model, *batches(1, 1, 1)[0][0][0]).backward()
    opt.step()


def _add_param_group():
    """add_param_group before the first backward: the new group trains like AdamW's; after
    the layout is made it raises instead of silently ignoring the parameters."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model, ref = make_model(), make_model()
    first = [p for n, p in model.named_parameters() if not n.startswith("head")]
    rest = [p for n, p in model.named_parameters() if n.startswith("head")]
    opt = DistributedFusedAdam(first, lr=1e-2, bucket_cap_mb=TINY, overlap_param_sync=True,
                               module=model)
    opt.add_param_group({"params": rest, "lr": 5e-3})
    ref_first = [p for n, p in ref.named_parameters() if not n.startswith("head")]
    ref_rest = [p for n, p in ref.named_parameters() if n.startswith("head")]
    ropt = torch.optim.AdamW([{"params": ref_first}, {"params": ref_rest, "lr": 5e-3}],
                             lr=1e-2, weight_decay=0.0)
    data = batches(world, 3, 1)
    for s in range(3):
        opt.zero_grad()
        loss_fn(model, *data[s][rank][0]).backward()
        opt.step()
        ropt.zero_grad()
        sum(loss_fn(ref, *data[s][r][0]) for r in range(world)).div(world).backward()
        ropt.step()
    x = torch.randn(2, 7)
    torch.testing.assert_close(model(x), ref(x), rtol=RTOL, atol=ATOL)  # through the hooks
    opt.param_sync()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    with pytest.raises(RuntimeError, match="add_param_group"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})
    return True


def test_add_param_group(world):
    assert world(2, _add_param_group) == [True, True]


def test_remainders_with_scaled_moments_store_six_bytes_an_element():
    """``store_param_remainders`` + ``with_scaled_states``: no master, an int16 remainder
    and bf16 moments with one fp32 scale per piece; nothing else per element (the
    element -> piece map is made per call)."""
    model = make_model(dtype=torch.bfloat16)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-3, bucket_cap_mb=24 * 4 / 2**20,
                               store_params=False, store_param_remainders=True,
                               with_scaled_states=True, param_sync_dtype=torch.bfloat16)
    opt.ensure_layout()
    for st, lay in zip(opt.shards.shards, opt.shards.layouts):
        assert st.master is None and st.exp_avg is None and st.exp_avg_sq is None
        assert st.remainder.dtype == torch.int16 and st.remainder.numel() == lay.shard_size
        assert set(st.scaled.data) == {"exp_avg", "exp_avg_sq"}
        assert all(t.dtype == torch.bfloat16 and t.numel() == lay.shard_size
                   for t in st.scaled.data.values())
        per_element = [t for t in vars(st.scaled).values()
                       if isinstance(t, torch.Tensor) and t.numel() >= lay.shard_size]
        assert per_element == []
    # One rank holds every bucket: the step updates the parameters' bf16 halves in place
    # (no shard-sized output buffer per bucket), and the parameters move.
    before = [p.detach().clone() for p in model.parameters()]
    for group in opt.param_groups:
        group["lr"] = 0.1  # Adam's first step moves every element by ~lr: past a bf16 ulp
    (x, y), = batches(1, 1, 1, dtype=torch.bfloat16)[0][0]
    loss_fn(model, x, y).backward()
    opt.step()
    (phase,) = opt.ensure_layout().stepper.phases(False)
    assert phase.buffered == [] and phase.general == phase.buckets
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("magnitude", [1e-12, 1e-3, 1.0, 1e6])
def test_scaled_states_round_trip_small_and_large_values(dtype, magnitude):
    """Each piece keeps its values to half an ulp of the 16-bit dtype, relative to the
    piece's absmax (fp16: 2**-11, bf16: 2**-8), whatever its magnitude: a second moment
    of 1e-24 neither underflows the fp32 scale nor the stored value."""
    from mpzero.optimizers.scaled_state import ScaledStates

    g = torch.Generator().manual_seed(0)
    states = ScaledStates([(0, 10), (13, 40)], 48, dtype, torch.device("cpu"))
    values = torch.zeros(48)
    values[0:10] = torch.randn(10, generator=g) * magnitude
    values[13:40] = torch.rand(27, generator=g) * magnitude**2  # a second moment's scale
    states.store("exp_avg", values)
    back = states.unscaled("exp_avg")
    assert torch.isfinite(back).all()
    rel = 2.0**-11 if dtype == torch.float16 else 2.0**-8
    for lo, hi in ((0, 10), (13, 40)):
        big = values[lo:hi].abs().max().item()
        torch.testing.assert_close(back[lo:hi], values[lo:hi], rtol=rel, atol=rel * big)
    assert torch.equal(back[10:13], torch.zeros(3)) and torch.equal(back[40:], torch.zeros(8))
