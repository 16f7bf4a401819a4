"""The multi-process harness itself: results, tracebacks, hangs, reuse."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from mpzero.testing import RankError, World


def _rank_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item(), os.getpid()


def _fail_on_rank1():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 blocks here: the harness must not wait forever
    return True


def _hang_rank0():
    if dist.get_rank() == 0:
        time.sleep(60)
    return True


def test_results_in_rank_order_and_world_reused(world):
    first = world(2, _rank_and_sum)
    assert [r[:2] for r in first] == [(0, 3.0), (1, 3.0)]
    second = world(2, _rank_and_sum)
    assert [r[2] for r in first] == [r[2] for r in second]  # same processes: world reused


@pytest.mark.slow  # two worlds started in a row: `make test` only
def test_failing_rank_traceback_then_fresh_world(world):
    with pytest.raises(RankError, match=r"(?s)rank\(s\) \[1\].*ValueError: boom on rank one"):
        world(2, _fail_on_rank1)
    # The next call gets a working (fresh) world.
    assert [r[1] for r in world(2, _rank_and_sum)] == [3.0, 3.0]


@pytest.mark.slow  # real processes or a big world: `make test` only
def test_hang_becomes_timeout():
    with World(2) as w:
        t0 = time.time()
        with pytest.raises(TimeoutError, match=r"(?s)rank\(s\) \[0\].*_hang_rank0"):
            w.run(_hang_rank0, timeout=3)
        assert time.time() - t0 < 20
        assert not w.alive
        assert not os.path.exists(w._stack_dir)  # its temporary directory is gone too


def test_closed_world_removes_its_temporary_directory():
    with World(1) as w:
        stack_dir = w._stack_dir
        assert os.path.isdir(stack_dir)
    assert not os.path.exists(stack_dir)


def test_importable_without_pytest():
    import subprocess
    import sys

    code = ("import sys; sys.modules['pytest'] = None\n"
            "import mpzero.testing as t; assert t.World and t.run_on_world\n"
            "try:\n    t.requires_cuda\nexcept ImportError:\n    pass\n"
            "else:\n    raise SystemExit('requires_cuda imported pytest')\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
