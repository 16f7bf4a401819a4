"""``_C.AdamPlan``: a fused Adam launch planned once, called with the per-step tensors only.

Checked bit for bit against :func:`mpzero.kernels.adam` / ``adam_remainders`` on the same
lists (the slices filled in by hand), for aligned and misaligned offsets; its argument
checks; and DistributedFusedAdam's steps with plans against the same steps without them.
"""

from __future__ import annotations

import pytest
import torch

from mpzero.testing import requires_cuda, run_on_world

pytestmark = requires_cuda

HP = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, adam_w_mode=True,
          bias_correction=True)


def _cuda_kernels():
    from mpzero import kernels

    if not kernels.extension_available():
        pytest.skip("mpzero._C not built")
    from mpzero.kernels import cuda as kc

    return kernels, kc


def _bits(t):
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _same(a, b):
    return a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


SIZES = [4096, 37, 9000, 0, 8]
# 3 and 5: misaligned slices; disjoint output ranges (an earlier 13140 overlapped the
# third entry's last element: two entries wrote it, a race the split kernels exposed)
OFFSETS = [0, 4096 + 3, 4096 + 3 + 37 + 5, 13144, 13144]


def _plain_case(gen, with_out=True):
    n = sum(SIZES) + 64
    dev = "cuda"
    masters = [torch.randn(k, device=dev, generator=gen) for k in SIZES]
    ms = [torch.randn(k, device=dev, generator=gen) * 0.1 for k in SIZES]
    vs = [torch.rand(k, device=dev, generator=gen) * 0.1 for k in SIZES]
    grad = torch.randn(n, device=dev, generator=gen).bfloat16()
    out = torch.full((n,), float("nan"), device=dev, dtype=torch.bfloat16)
    return masters, ms, vs, grad, out


def test_plain_plan_matches_the_list_call():
    kernels, kc = _cuda_kernels()
    gen = torch.Generator(device="cuda").manual_seed(0)
    masters, ms, vs, grad, out = _plain_case(gen)
    ref = [[t.clone() for t in lst] for lst in (masters, ms, vs)]
    ref_out = out.clone()
    lists = [masters, [None] * 5, ms, vs, [None] * 5]
    slots = ([(1, e, 0, o) for e, o in enumerate(OFFSETS)]
             + [(4, e, 1, o) for e, o in enumerate(OFFSETS)])
    plan = kc.AdamPlan(False, lists, slots, [grad, out])
    assert plan.entries == 5
    for step in (1, 2, 3):
        plan([grad, out], step=step, **HP)
        kernels.adam(ref[0], [grad[o:o + k] for o, k in zip(OFFSETS, SIZES)], ref[1], ref[2],
                     [ref_out[o:o + k] for o, k in zip(OFFSETS, SIZES)], step=step, **HP)
    torch.cuda.synchronize()
    for a, b in zip(masters + ms + vs, ref[0] + ref[1] + ref[2]):
        assert _same(a, b)
    assert torch.equal(out.isnan(), ref_out.isnan())  # nothing outside the slices written
    assert _same(out.nan_to_num(), ref_out.nan_to_num())


def test_remainder_plan_matches_the_list_call():
    kernels, kc = _cuda_kernels()
    from mpzero.kernels.precision import split_remainder

    gen = torch.Generator(device="cuda").manual_seed(1)
    masters, ms, vs, grad, _ = _plain_case(gen)
    his, rems = zip(*(split_remainder(m) for m in masters))
    his, rems = list(his), list(rems)
    ref = [[t.clone() for t in lst] for lst in (his, rems, ms, vs)]
    plan = kc.AdamPlan(True, [his, rems, [None] * 5, ms, vs, None],
                       [(2, e, 0, o) for e, o in enumerate(OFFSETS)], [grad])
    g_views = [grad[o:o + k] for o, k in zip(OFFSETS, SIZES)]
    for step in (1, 2):
        plan([grad], step=step, **HP)
        kernels.adam_remainders(ref[0], ref[1], g_views, ref[2], ref[3], None, step=step, **HP)
    torch.cuda.synchronize()
    for a, b in zip(his + rems + ms + vs, ref[0] + ref[1] + ref[2] + ref[3]):
        assert _same(a, b)


def test_capturable_scalars_and_found_inf():
    """Device lr/step/grad scale, and a nonzero found_inf changes nothing."""
    kernels, kc = _cuda_kernels()
    gen = torch.Generator(device="cuda").manual_seed(2)
    masters, ms, vs, grad, out = _plain_case(gen)
    lists = [masters, [None] * 5, ms, vs, [None] * 5]
    slots = ([(1, e, 0, o) for e, o in enumerate(OFFSETS)]
             + [(4, e, 1, o) for e, o in enumerate(OFFSETS)])
    plan = kc.AdamPlan(False, lists, slots, [grad, out])
    before = [t.clone() for t in masters]
    hp = dict(HP, lr=torch.tensor(1e-2, device="cuda"))
    plan([grad, out], step=torch.tensor(1.0, device="cuda"),
         grad_scale=torch.tensor(0.5, device="cuda"),
         found_inf=torch.tensor(1.0, device="cuda"), **hp)
    torch.cuda.synchronize()
    assert all(_same(a, b) for a, b in zip(masters, before))
    ref = [t.clone() for t in masters]
    ref_m, ref_v = [t.clone() for t in ms], [t.clone() for t in vs]
    plan([grad, out], step=torch.tensor(1.0, device="cuda"),
         grad_scale=torch.tensor(0.5, device="cuda"),
         found_inf=torch.tensor(0.0, device="cuda"), **hp)
    kernels.adam(ref, [grad[o:o + k] for o, k in zip(OFFSETS, SIZES)], ref_m, ref_v, None,
                 step=torch.tensor(1.0, device="cuda"),
                 grad_scale=torch.tensor(0.5, device="cuda"), **hp)
    torch.cuda.synchronize()
    assert all(_same(a, b) for a, b in zip(masters, ref))


def test_plan_argument_errors():
    _, kc = _cuda_kernels()
    gen = torch.Generator(device="cuda").manual_seed(3)
    masters, ms, vs, grad, out = _plain_case(gen)
    lists = [masters, [None] * 5, ms, vs, []]
    slots = [(1, e, 0, o) for e, o in enumerate(OFFSETS)]
    with pytest.raises(RuntimeError, match="no slot fills it"):
        kc.AdamPlan(False, lists, slots[:-1], [grad])
    with pytest.raises(RuntimeError, match="given twice"):
        kc.AdamPlan(False, lists, slots + slots[:1], [grad])
    with pytest.raises(RuntimeError, match="exceed per-step tensor"):
        kc.AdamPlan(False, lists, slots, [grad[:1000]])
    with pytest.raises(RuntimeError, match="exp_avg"):
        kc.AdamPlan(False, [masters, [None] * 5, [m.half() for m in ms], vs, []], slots,
                    [grad])
    plan = kc.AdamPlan(False, lists, slots, [grad])
    with pytest.raises(RuntimeError, match="expected 1 per-step tensors"):
        plan([grad, grad], step=1, **HP)
    with pytest.raises(RuntimeError, match="per-step tensor 0 must be a contiguous"):
        plan([grad.float()], step=1, **HP)
    with pytest.raises(RuntimeError, match="at least"):
        plan([grad[:100]], step=1, **HP)


# ------------------------------------------------------------- DistributedFusedAdam


def _dfa_with_and_without_plans(mode, device="cuda"):
    from mpzero import kernels
    from mpzero.optimizers import DistributedFusedAdam

    torch.set_default_device(device)
    try:
        opts = dict(
            default=dict(grad_sync_dtype=torch.bfloat16, param_sync_dtype=torch.bfloat16),
            remainders=dict(grad_sync_dtype=torch.bfloat16, param_sync_dtype=torch.bfloat16,
                            store_params=False, store_param_remainders=True),
            contiguous=dict(grad_sync_dtype=torch.bfloat16, param_sync_dtype=torch.bfloat16,
                            contiguous_param_buffer=True, contiguous_grad_buffer=True),
            capturable=dict(capturable=True, grad_sync_dtype=torch.bfloat16),
        )[mode]
        results, natives = [], []
        for native in (True, False):
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Linear(64, 48, dtype=torch.bfloat16),
                                          torch.nn.Linear(48, 31, dtype=torch.bfloat16)])
            opt = DistributedFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1,
                                       bucket_cap_mb=0.004, **opts)
            saved = kernels.adam_plan
            if not native:
                kernels.adam_plan = lambda *a, **k: None
            try:
                x = torch.randn(16, 64, dtype=torch.bfloat16)
                for _ in range(4):
                    opt.zero_grad()
                    model(x).float().square().mean().backward()
                    opt.clip_grad_norm(1.0)
                    opt.step()
            finally:
                kernels.adam_plan = saved
            natives.append(sum(launch.native is not None
                               for plan in opt.ensure_layout().stepper.plans.values()
                               for launch in plan.launches))
            results.append([p.detach().clone() for p in model.parameters()])
        if device == "cuda":
            torch.cuda.synchronize()
        return natives, all(torch.equal(a, b) for a, b in zip(*results))
    finally:
        torch.set_default_device("cpu")


@pytest.mark.parametrize("mode", ["default", "remainders", "contiguous", "capturable"])
def test_dfa_steps_with_plans_equal_steps_without(mode):
    _cuda_kernels()
    (natives, same), = run_on_world(1, _dfa_with_and_without_plans, mode, backend="nccl",
                                    timeout=300)
    assert natives[0] > 0 and natives[1] == 0, natives  # plans were used, then not
    assert same
