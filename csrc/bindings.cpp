// pybind11 entry point of mpzero._C. Each kernel family registers itself here.
#include <torch/extension.h>

#include "mpzero.h"
#include "nccl_allocator.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "mpzero CUDA kernels";
  m.def("fill_scalar", &mpzero::fill_scalar, "Fill a CUDA tensor with a value (build-path smoke test)");
  m.def("adam", &mpzero::adam, "Fused multi-tensor Adam over [p, g, m, v, p_out]", py::arg("p"),
        py::arg("g"), py::arg("m"), py::arg("v"), py::arg("p_out"), py::arg("lr"), py::arg("lr_t"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("step"), py::arg("step_t"), py::arg("adam_w_mode"), py::arg("bias_correction"),
        py::arg("grad_scale"), py::arg("found_inf"));
  m.def("adam_remainders", &mpzero::adam_remainders,
        "Fused multi-tensor Adam over [p_bf16, rem_int16, g, m, v, p_out]", py::arg("p"),
        py::arg("rem"), py::arg("g"), py::arg("m"), py::arg("v"), py::arg("p_out"), py::arg("lr"),
        py::arg("lr_t"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("step"), py::arg("step_t"), py::arg("adam_w_mode"),
        py::arg("bias_correction"), py::arg("grad_scale"), py::arg("found_inf"));
  py::class_<mpzero::AdamPlan>(m, "AdamPlan",
                               "A fused Adam launch planned once (see mpzero.h)")
      .def(py::init<bool, const std::vector<std::vector<std::optional<at::Tensor>>>&,
                    const std::vector<int64_t>&, const std::vector<at::Tensor>&>(),
           py::arg("remainders"), py::arg("lists"), py::arg("slots"), py::arg("dynamic_like"))
      .def("run", &mpzero::AdamPlan::run, py::arg("dynamic"), py::arg("lr"), py::arg("lr_t"),
           py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
           py::arg("step"), py::arg("step_t"), py::arg("adam_w_mode"),
           py::arg("bias_correction"), py::arg("grad_scale"), py::arg("found_inf"))
      .def_property_readonly("entries", &mpzero::AdamPlan::entries)
      .def_property_readonly("launch_groups", &mpzero::AdamPlan::launch_groups);
  m.def("l2norm", &mpzero::l2norm, "Multi-tensor L2 norm (fp32 accumulation)", py::arg("tensors"),
        py::arg("noop_flag"));
  m.def("multi_copy", &mpzero::multi_copy, "Multi-tensor cast/copy", py::arg("srcs"),
        py::arg("dsts"), py::arg("noop_flag"));
  m.def("multi_add", &mpzero::multi_add, "Multi-tensor dst += src (fp32 math)", py::arg("srcs"),
        py::arg("dsts"), py::arg("noop_flag"));
  m.def("cross_entropy_stats", &mpzero::cross_entropy_stats,
        "Per row of logits [N, V]: max, sum exp(x - max), target logit, sum (fp32 [N, 4])",
        py::arg("logits"), py::arg("target"), py::arg("stats"));
  m.def("cross_entropy_backward", &mpzero::cross_entropy_backward,
        "grad = (exp(x - lse) - off_target - on_target * onehot(target)) * grad_loss",
        py::arg("logits"), py::arg("target"), py::arg("lse"), py::arg("grad_loss"),
        py::arg("on_target"), py::arg("off_target"), py::arg("grad"));
  m.def("bias_gelu_backward", &mpzero::bias_gelu_backward,
        "dx = gelu'(x + bias) * dy and dbias = column sums of dx, in one read of x and dy",
        py::arg("x"), py::arg("bias"), py::arg("dy"), py::arg("dx"), py::arg("dbias"),
        py::arg("tanh_approx"));
  m.def("heads_grad", &mpzero::heads_grad,
        "dy [B*T, H*n*D] from n head gradients [B, H, T, D], and dy's column sums into dbias",
        py::arg("grads"), py::arg("dy"), py::arg("dbias"));
  m.def("layer_norm_forward", &mpzero::layer_norm_forward,
        "s = x + y (optional), out = LayerNorm(s) * w + b; fp32 mean and rstd per row "
        "(mean None: RMSNorm, no bias)",
        py::arg("x"), py::arg("y"), py::arg("weight"), py::arg("bias"), py::arg("s_out"),
        py::arg("out"), py::arg("mean"), py::arg("rstd"), py::arg("eps"));
  m.def("layer_norm_backward", &mpzero::layer_norm_backward,
        "ds = LayerNorm backward of g_out (+ g_s), dw and db as fp32 column sums (mean "
        "None: RMSNorm's, no db)",
        py::arg("g_out"), py::arg("g_s"), py::arg("s"), py::arg("mean"), py::arg("rstd"),
        py::arg("weight"), py::arg("ds"), py::arg("dw"), py::arg("db"));
  m.def("gemm_bias_gelu", &mpzero::gemm_bias_gelu,
        "cuBLASLt GEMM with bias + GELU (tanh) epilogue: (gelu(x w^T + b), x w^T + b)",
        py::arg("x"), py::arg("weight"), py::arg("bias"));
  m.def("gemm_dgelu", &mpzero::gemm_dgelu,
        "cuBLASLt GEMM with GELU-gradient (tanh) epilogue: (grad_out weight) * gelu'(z)",
        py::arg("grad_out"), py::arg("weight"), py::arg("z"));
  m.def(
      "nccl_allocator_info",
      [] {
        const mpzero::NcclAllocatorInfo info = mpzero::nccl_allocator_info();
        py::dict d;
        d["library_path"] = info.library_path;
        d["alloc"] = MPZERO_NCCL_ALLOC_NAME;
        d["free"] = MPZERO_NCCL_FREE_NAME;
        d["found"] = info.found;
        d["nccl_library"] = info.nccl_library;
        d["lookup"] = info.lookup;
        d["nccl_version"] = info.nccl_version;
        d["error"] = info.error;
        d["live_allocations"] = info.live_allocations;
        d["live_bytes"] = info.live_bytes;
        return d;
      },
      "NCCL user-buffer allocator: this .so's path, the entry point names, and whether "
      "ncclMemAlloc/ncclMemFree resolved (and from where)");
  m.def("nccl_allocator_last_error", &mpzero::nccl_allocator_last_error,
        "The last ncclMemAlloc/ncclMemFree failure ('' when none)", py::arg("clear") = true);
}
