// Declarations of the host entry points bound in bindings.cpp. Only ATen's tensor header
// here: the .cu files include this, and torch/extension.h would double their compile time.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

namespace mpzero {
void fill_scalar(at::Tensor t, double value);

// Fused Adam over [p, g, m, v, p_out] (p_out may be an empty list). See adam.cu.
void adam(const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& g,
          const std::vector<at::Tensor>& m, const std::vector<at::Tensor>& v,
          const std::vector<at::Tensor>& p_out, double lr, std::optional<at::Tensor> lr_t,
          double beta1, double beta2, double eps, double weight_decay, int64_t step,
          std::optional<at::Tensor> step_t, bool adam_w_mode, bool bias_correction,
          std::optional<at::Tensor> grad_scale, std::optional<at::Tensor> found_inf);

// Fused Adam over [p_bf16, rem_int16, g, m, v, p_out] (fp32 master = merge(p, rem)).
void adam_remainders(const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& rem,
                     const std::vector<at::Tensor>& g, const std::vector<at::Tensor>& m,
                     const std::vector<at::Tensor>& v, const std::vector<at::Tensor>& p_out,
                     double lr, std::optional<at::Tensor> lr_t, double beta1, double beta2,
                     double eps, double weight_decay, int64_t step,
                     std::optional<at::Tensor> step_t, bool adam_w_mode, bool bias_correction,
                     std::optional<at::Tensor> grad_scale, std::optional<at::Tensor> found_inf);

// sqrt(sum of squares) of all tensors, 0-dim fp32; noop_flag set to 1 when not finite.
at::Tensor l2norm(const std::vector<at::Tensor>& tensors, std::optional<at::Tensor> noop_flag);

// dst.copy_(src) for each pair (casts among fp32/fp16/bf16, raw copy for equal dtypes).
void multi_copy(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts,
                std::optional<at::Tensor> noop_flag);

// Launch tuning (benchmarks): 0 leaves a value unchanged.
void set_launch_config(int64_t threads, int64_t blocks_per_sm, int64_t chunk_elems);
std::tuple<int64_t, int64_t, int64_t> get_launch_config();
void set_chunk_balancing(bool on);
bool chunk_balancing();
}  // namespace mpzero
