"""The step plan's pure parts: cutting a shard into the slices the kernel lists need."""

import pytest
import torch

from mpzero.optimizers.step_plan import GRAD, OUT, Cutter, PlanBuilder, split_sizes


@pytest.mark.parametrize("ranges,total,sizes,index", [
    ([(0, 10)], 10, [10], [0]),
    ([(0, 4), (4, 10)], 10, [4, 6], [0, 1]),
    ([(2, 4), (6, 9)], 12, [2, 2, 2, 3, 3], [1, 3]),
    ([(0, 0), (0, 5)], 8, [0, 5, 3], [0, 1]),
])
def test_split_sizes(ranges, total, sizes, index):
    assert split_sizes(ranges, total) == (sizes, index)


def test_split_sizes_rejects_overlap():
    with pytest.raises(ValueError, match="overlap"):
        split_sizes([(0, 5), (3, 6)], 8)


def test_cutter_gives_views_of_the_ranges():
    t = torch.arange(20.0)
    ranges = [(1, 3), (3, 3), (5, 11), (15, 20)]
    pieces = Cutter(ranges, 20)(t)
    for (s, e), p in zip(ranges, pieces):
        assert torch.equal(p, t[s:e])
        if e > s:
            assert p.data_ptr() == t[s:e].data_ptr()  # a view, not a copy


def test_plan_fills_per_step_slots():
    static = torch.zeros(4)
    pb = PlanBuilder()
    pb.bucket(0, [(0, 2), (2, 4)], 4, out=False)
    pb.add(("k",), False, 0, (static[:2], (0, GRAD, 0)))
    pb.add(("k",), False, 0, (static[2:], (0, GRAD, 1)))
    plan = pb.finish()
    grad = torch.arange(4.0)
    (launch,) = plan.launches
    lists = launch.fill(plan.pieces({0: grad}, {}))
    assert [t.tolist() for t in lists[1]] == [[0.0, 1.0], [2.0, 3.0]]
    assert lists[0][0] is launch.lists[0][0]
    assert launch.lists[1] == [None, None]  # the plan itself keeps no per-step tensor


@pytest.mark.parametrize("direct", [False, True])
def test_native_slots_and_per_step_agree_with_fill(direct):
    """What a native plan is given (``native_slots`` + ``per_step``: base tensors and
    element offsets) names the same tensors, element for element, as the list ``fill``
    builds; with direct gradients each range's gradient is a tensor of its own. Two
    buckets, two launches (param groups) interleaving their ranges (and one launch with
    consecutive ranges of a bucket), and an output shard."""
    pb = PlanBuilder()
    state = torch.zeros(20)
    pb.bucket(0, [(0, 3), (4, 6), (8, 12), (12, 14)], 14, out=False, direct=direct)
    pb.bucket(1, [(0, 5), (5, 8)], 8, out=True)
    entries = [(0, 0, 0, (0, 3)), (1, 0, 1, (4, 6)), (0, 0, 2, (8, 12)), (0, 0, 3, (12, 14)),
               (0, 1, 0, (0, 5)), (1, 1, 1, (5, 8))]
    for group, b, j, (s, e) in entries:
        out = (b, OUT, j) if b == 1 else state[s:e]
        pb.add((group,), False, group, (state[s:e], (b, GRAD, j), out))
    plan = pb.finish()
    assert plan.direct == ({0} if direct else set())
    shard0 = torch.arange(100.0, 114.0)
    grads = {0: [shard0[0:3], shard0[4:6], shard0[8:12], shard0[12:14]] if direct else shard0,
             1: torch.arange(200.0, 208.0)}
    outs = {1: torch.arange(300.0, 308.0)}
    pieces = plan.pieces(grads, outs)
    for launch in plan.launches:
        lists = launch.fill(pieces)
        slots, launch.bases = plan.native_slots(launch)
        dynamic = launch.per_step(grads, outs)
        assert len(dynamic) == len(launch.bases)
        for pos, entry, base, offset in slots:
            want = lists[pos][entry]
            got = dynamic[base][offset:offset + want.numel()]
            assert torch.equal(got, want) and got.data_ptr() == want.data_ptr()
        again = launch.per_step(grads, outs)  # cached runs give the same list
        assert len(again) == len(dynamic) and all(a is b for a, b in zip(again, dynamic))
