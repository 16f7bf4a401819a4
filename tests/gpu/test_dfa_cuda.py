"""The DistributedFusedAdam suite on CUDA tensors with NCCL at world 1 (the GPU machine).

Each check is a CPU/gloo test's rank function, run with CUDA as the default device
inside a one-rank NCCL world, so the side-stream and event code paths are real.
"""

import pytest
import torch

from mpzero.testing import requires_cuda, run_on_world

pytestmark = requires_cuda


def _on_cuda(fn_name, module, *args):
    import importlib

    torch.set_default_device("cuda")
    try:
        fn = getattr(importlib.import_module(module), fn_name)
        return fn(*args)
    finally:
        torch.set_default_device("cpu")


CHECKS = [
    ("_many_configs", "test_dfa_numerics", ("flat",)),
    ("_bias_correction_off", "test_dfa_numerics", ()),
    ("_different_grad_order_and_unused", "test_dfa_features", ()),
    ("_frozen_params_untouched", "test_dfa_features", ()),
    ("_low_precision", "test_dfa_features", ("grad_bf16",)),
    ("_low_precision", "test_dfa_features", ("param_fp16",)),
    ("_low_precision", "test_dfa_features", ("state_bf16",)),
    ("_model_dtypes", "test_dfa_features", ("bfloat16",)),
    ("_grad_scaler_skips_inf", "test_dfa_features", ()),
    ("_unscale_then_clip", "test_dfa_features", ()),
    ("_grad_norm_api", "test_dfa_features", ()),
    ("_overlap_param_sync", "test_dfa_features", (True,)),
    ("_init_params_order", "test_dfa_features", ()),
]


@pytest.mark.parametrize("fn,module,args", CHECKS, ids=[f"{c[0]}{c[2]}" for c in CHECKS])
def test_dfa_on_cuda_nccl(fn, module, args):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for the rank fns
    out = run_on_world(1, _on_cuda, fn, module, *args, backend="nccl", timeout=300)
    assert out[0] is not False
