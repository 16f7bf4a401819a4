"""The step plan's pure parts: cutting a shard into the slices the kernel lists need."""

import pytest
import torch

from mpzero.optimizers.step_plan import GRAD, Cutter, PlanBuilder, split_sizes


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
