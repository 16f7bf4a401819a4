"""bench/profile_gpt.py's pure parts: the kernel classes and the per-iteration report
(the profiling itself needs a GPU)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import profile_gpt  # noqa: E402


def test_kernel_classes():
    cls = profile_gpt.kernel_class
    assert cls("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN") == "gemm"
    assert cls("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16") == "attention"
    assert cls("void mpzero::multi_tensor_kernel<5, mpzero::AdamOp<float, float> >") == \
        "optimizer"
    assert cls("triton_poi_fused_gelu_view_2") == "inductor fused"
    assert cls("ncclDevKernel_AllGather_RING_LL") == "collective"
    assert cls("void at::native::vectorized_elementwise_kernel<4, FillFunctor>") == "other"


def test_report_busy_time_is_the_union_of_intervals():
    # Two overlapping kernels (0-10 and 5-15 ms) and one after a gap (20-30): busy 25 ms
    # of a 40 ms wall over 1 iteration; the class sums count every kernel in full.
    kernels = [("nvjet_a", 0.0, 1e4), ("triton_b", 5e3, 1e4), ("nvjet_a", 2e4, 1e4)]
    text = profile_gpt.report(kernels, wall_us=4e4, iters=1, top=2)
    first = text.splitlines()[0]
    assert "device busy    25.00 ms/iter (62.5%)" in first, first
    assert "kernel sum 30.00 ms" in first
    assert "gemm" in text and "inductor fused" in text
    assert "x  2.0  [gemm] nvjet_a" in text
