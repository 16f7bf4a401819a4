"""A short demo of mpzero.parallel_state on a gloo world (torchrun --nproc-per-node 2)."""

import torch
import torch.distributed as dist

from mpzero import parallel_state as ps


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(distributed_optimizer_size=1)
    rank = dist.get_rank()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    print(
        f"rank {rank}: dp {ps.get_data_parallel_rank()}/{ps.get_data_parallel_world_size()}, "
        f"distributed {ps.get_distributed_optimizer_world_size()} x redundant "
        f"{ps.get_redundant_optimizer_world_size()}, dp all-reduce = {t.item():g}",
        flush=True,
    )
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
