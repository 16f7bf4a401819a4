"""Gradient buckets filled without zeroing: first gradient copied, the rest added, and
every element nothing wrote (alignment padding, parameters without a gradient) zeroed
before the buffer is read.

The fresh buffers are poisoned with NaN here (``grad_bucket._fresh_buffer`` patched), and
at world 1 the reused shard with the previous step's gradients, so any element the
fill fails to define reaches the step or the gradient norm and breaks the comparison
with ``torch.optim.AdamW`` (tolerances: ``dfa_common.RTOL``/``ATOL``).
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

from mpzero.optimizers import DistributedFusedAdam, grad_bucket

from dfa_common import ATOL, RTOL, batches, make_model

TINY = 24 * 4 / 2**20  # several buckets, parameters split across them
LR, WD = 1e-2, 0.01


@contextlib.contextmanager
def poisoned_buffers():
    """Fresh bucket buffers full of NaN instead of whatever memory held."""
    original = grad_bucket._fresh_buffer

    def poisoned(size, dtype, device):
        return torch.full((size,), float("nan"), dtype=dtype, device=device)

    grad_bucket._fresh_buffer = poisoned
    try:
        yield
    finally:
        grad_bucket._fresh_buffer = original


def _skip(step: int, micro: int) -> set[str]:
    """Module names left out of micro-batch ``micro`` of ``step`` (no gradient there)."""
    return {0: {"fc2"}, 1: set(), 2: {"fc2"} if micro == 0 else set()}[step % 3]


def _loss(model, x, y, skip):
    h = model.norm(torch.tanh(model.fc1(x)))
    if "fc2" not in skip:
        h = torch.nn.functional.gelu(model.fc2(h)) + h
    return torch.nn.functional.mse_loss(model.head(h), y, reduction="sum")


def _reference(world, data, steps, micro):
    """AdamW over the mean over ranks of the summed micro-batch losses; a parameter no
    micro-batch reached is stepped with a zero gradient (as DistributedFusedAdam does)."""
    ref = make_model(unused=True)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    norms = []
    for s in range(steps):
        opt.zero_grad()
        loss = sum(_loss(ref, *data[s][r][m], _skip(s, m))
                   for r in range(world) for m in range(micro))
        (loss / world).backward()
        for p in ref.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
        opt.step()
    return ref, norms


def _filled(micro: int, greedy: bool, capturable: bool = False):
    world, rank = dist.get_world_size(), dist.get_rank()
    steps = 4
    data = batches(world, steps, micro)
    model = make_model(unused=True)  # `unused` never gets a gradient
    opt = DistributedFusedAdam(model.parameters(), lr=LR, weight_decay=WD, bucket_cap_mb=TINY,
                               capturable=capturable)
    norms = []
    with poisoned_buffers():
        for s in range(steps):
            opt.zero_grad()
            if s and world == 1:  # a kept shard (capturable) is the next round's buffer
                for bucket in opt.ensure_layout().grads.buckets:
                    if bucket._shard is not None:
                        bucket._shard.fill_(float("nan"))
            for m in range(micro):
                last = m == micro - 1
                ctx = contextlib.nullcontext() if last else opt.no_sync(greedy_grad_copy=greedy)
                with ctx:
                    _loss(model, *data[s][rank][m], _skip(s, m)).backward()
            norms.append(opt.clip_grad_norm(1e9))
            opt.step()
    ref, ref_norms = _reference(world, data, steps, micro)
    for n, ours in zip(ref_norms, norms):
        torch.testing.assert_close(ours, n, rtol=RTOL, atol=ATOL)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.isfinite(p).all(), name
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    return True


@pytest.mark.parametrize("size", [1, 2])
def test_fresh_buffers_are_defined_everywhere(world, size):
    """One micro-batch per step; some steps leave parameters out."""
    assert all(world(size, _filled, 1, False, timeout=120))


def test_kept_shard_is_refilled(world):
    """capturable at world 1: the reduced shard keeps its address across steps and is
    the next round's bucket buffer; after zero_grad nothing of it may survive."""
    assert all(world(1, _filled, 2, True, True, timeout=120))


@pytest.mark.parametrize("greedy", [False, True], ids=["grads-held", "greedy-copy"])
@pytest.mark.parametrize("size", [1, 2])
def test_accumulation_copies_first_then_adds(world, size, greedy):
    """Two micro-batches under ``no_sync()``: with ``greedy_grad_copy`` the first
    micro-batch's gradients are copied into the buckets and the second's added; a
    parameter reached only by the second micro-batch is copied then."""
    assert all(world(size, _filled, 2, greedy, timeout=120))


def _staged_released():
    """The staged first copies are made, and the gradients let go, as each bucket
    completes in the backward pass (no_sync keeps nothing staged either)."""
    model = make_model()
    opt = DistributedFusedAdam(model.parameters(), lr=LR, bucket_cap_mb=TINY)
    x, y = batches(dist.get_world_size(), 1, 1)[0][dist.get_rank()][0]
    for _ in range(2):
        opt.zero_grad()
        with opt.no_sync(greedy_grad_copy=True):
            _loss(model, x, y, set()).backward()
        assert all(not b._staged for b in opt.ensure_layout().grads.buckets)
        _loss(model, x, y, set()).backward()
        assert len(opt.ensure_layout().grads.buckets) > 2
        assert all(not b._staged and not b._adds for b in opt.ensure_layout().grads.buckets)
        opt.step()
    return True


def _adds_batched():
    """Accumulation: each later micro-batch's gradients go into a bucket with one
    multi-tensor add covering all its fragments (made as the bucket's last gradient of
    that pass arrives), and the accumulated gradient is the exact fp32 sum."""
    from mpzero import kernels

    torch.manual_seed(0)
    model = make_model().to(torch.bfloat16)
    opt = DistributedFusedAdam(model.parameters(), lr=LR, bucket_cap_mb=4 * TINY,
                               grad_sync_dtype=torch.float32, overlap_grad_sync=True)
    calls = []
    original = kernels.multi_add

    def counting(srcs, dsts):
        calls.append(len(srcs))
        original(srcs, dsts)

    kernels.multi_add = counting
    try:
        data = batches(dist.get_world_size(), 1, 3)[0][dist.get_rank()]
        opt.zero_grad()
        grads = []
        for m, (x, y) in enumerate(data):
            ctx = opt.no_sync(greedy_grad_copy=True) if m < 2 else contextlib.nullcontext()
            with ctx:
                loss = _loss(model, x.bfloat16(), y.bfloat16(), set())
                grads.append(torch.autograd.grad(loss, list(model.parameters()),
                                                 retain_graph=True))
                loss.backward()
            if m == 0:
                assert calls == []  # the first micro-batch is copied
            else:  # nothing held back once a pass is in (no gradient kept alive)
                assert all(not b._staged and not b._adds
                           for b in opt.ensure_layout().grads.buckets), m
        buckets = opt.ensure_layout().grads.buckets
        n_frag = [len(b.layout.fragments) for b in buckets]
        assert len(buckets) > 1 and max(n_frag) > 1, n_frag
        assert sorted(calls) == sorted(n_frag * 2), (calls, n_frag)  # one add per bucket
        # What the step reads: the fp32 sum of the three bf16 gradients, averaged over
        # ranks (its norm; a lost or doubled addition changes it far beyond rounding).
        total = [sum(g[i].float() for g in grads) for i in range(len(grads[0]))]
        for t in total:
            dist.all_reduce(t)
            t /= dist.get_world_size()
        want = torch.linalg.vector_norm(torch.cat([t.flatten() for t in total]))
        torch.testing.assert_close(opt.grad_norm(), want, rtol=1e-6, atol=0)
    finally:
        kernels.multi_add = original
    return True


@pytest.mark.parametrize("size", [1, 2])
def test_accumulation_adds_one_launch_per_bucket(world, size):
    assert all(world(size, _adds_batched, timeout=120))


def test_staged_copies_released_per_bucket(world):
    assert all(world(2, _staged_released, timeout=120))


def test_bucket_add_matches_zero_then_add():
    """One bucket, bitwise: copying the first gradient and adding the rest equals the
    zero-filled buffer plus the sum of each gradient cast to the sync dtype, for a
    narrower gradient (bf16 into fp32: added without a cast copy) and a wider one
    (fp32 into bf16: rounded before the add)."""
    from mpzero.optimizers.layout import layout_buckets

    layouts = layout_buckets([(0, 7, "k"), (1, 13, "k")], distributed_size=1,
                             capacity={"k": 64}, alignment={"k": 8})
    (layout,) = layouts
    for grad_dtype, sync_dtype in [(torch.bfloat16, torch.float32),
                                   (torch.float32, torch.bfloat16)]:
        torch.manual_seed(0)
        grads = [[torch.randn(n).to(grad_dtype) for n in (7, 13)] for _ in range(3)]
        bucket = grad_bucket.GradBucket(layout, sync_dtype, torch.device("cpu"), 0)
        with poisoned_buffers():
            bucket.start_fill()
            for round_ in grads:
                for f in layout.fragments:
                    bucket.add(f, round_[f.param])
            bucket._define()
        expected = torch.zeros(layout.size, dtype=sync_dtype)
        for round_ in grads:
            for f in layout.fragments:
                expected[f.bucket_start:f.bucket_end] += \
                    round_[f.param][f.param_start:f.param_end].to(sync_dtype)
        assert torch.equal(bucket.buffer, expected), (grad_dtype, sync_dtype)


def test_exact_cast():
    assert grad_bucket._exact_cast(torch.bfloat16, torch.float32)
    assert grad_bucket._exact_cast(torch.float16, torch.float32)
    assert grad_bucket._exact_cast(torch.float32, torch.float32)
    assert not grad_bucket._exact_cast(torch.float32, torch.bfloat16)
    assert not grad_bucket._exact_cast(torch.float16, torch.bfloat16)  # fp16 has more mantissa
    assert not grad_bucket._exact_cast(torch.bfloat16, torch.float16)  # and bf16 more exponent
