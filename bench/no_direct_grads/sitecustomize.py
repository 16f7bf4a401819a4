"""Benchmark-only: turns DistributedFusedAdam's direct gradients off in every Python
process started with this folder on ``PYTHONPATH`` (the GPT peers benchmark's workers
included), to measure what that world-size-1 path is worth:

    PYTHONPATH=bench/no_direct_grads python bench/bench_gpt_peers.py --setups dfa ...
"""

from mpzero.optimizers import grad_bucket

grad_bucket.GradStorage.may_go_direct = property(lambda self: False)
