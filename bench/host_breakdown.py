"""Host time of the pieces of one ``step()`` (world 1): where the time before the kernel
launch goes. Diagnostic; prints microseconds per call (median of 50).

    python bench/host_breakdown.py [--only 2]    (setup indices of bench/bench_step.py)
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step  # noqa: E402


def timed(fn, n=50, before=None):
    ts = []
    for _ in range(n):
        if before:
            before()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def breakdown(args, cuda, name, dtype, mk, graph) -> None:
    params, opt, backward, step = bench_step.prepare(args, dtype, mk, graph)

    def bwd():
        backward()
        if cuda:
            torch.cuda.synchronize()
    print(f"=== {name}")
    print(f"step()              {timed(step, before=bwd):8.1f} us")
    print(f"grad_sync()         {timed(opt.grad_sync, before=bwd):8.1f} us")
    print(f"param_sync()        {timed(opt.param_sync):8.1f} us")
    bwd()
    opt.grad_sync()
    plan = next(iter(opt.ensure_layout().stepper.plans.values()))
    stepper = opt.ensure_layout().stepper
    direct = stepper.direct.grads(stepper.phases(False)[0]) or {}
    grads = {b: direct[b] if b in plan.direct else opt.ensure_layout().grads.buckets[b].shard
             for b in plan.cutters}
    print(f"plan.pieces         {timed(lambda: plan.pieces(grads, {})):8.1f} us")
    pieces = plan.pieces(grads, {})
    for launch in plan.launches:
        lists = launch.fill(pieces)
        kw = opt.step_state.hyper(launch.group, None)
        n = len(lists[0])
        print(f"launch.fill ({n:3d})   {timed(lambda: launch.fill(pieces)):8.1f} us")  # noqa: B023
        hyper = timed(lambda: opt.step_state.hyper(launch.group, None))  # noqa: B023
        print(f"hyper              {hyper:8.1f} us")
        print(f"kernel call         {timed(lambda: launch.kernel(*lists, **kw)):8.1f} us")  # noqa: B023
        if cuda:
            from mpzero import _C
            args_c = [list(x) for x in lists] + [1e-4, None, 0.9, 0.999, 1e-8, 0.1, 5, None,
                                                 True, True, None, None]
            print(f"_C.adam direct      {timed(lambda: _C.adam(*args_c)):8.1f} us")  # noqa: B023
    print(f"no_grad ctx         {timed(lambda: torch.no_grad().__enter__()):8.1f} us")


def main() -> None:
    ap = bench_step.setup_args(__doc__.splitlines()[0])
    ap.set_defaults(only="2")
    args = ap.parse_args()
    bench_step.init_world(args, 29536)
    cuda = args.device.type == "cuda"
    for setup in bench_step.setups(args):
        breakdown(args, cuda, *setup)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
