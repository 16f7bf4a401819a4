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

// A fused Adam launch planned once: the tensors that stay the same every step (state
// slices, parameter views) are given at construction, with None where a per-step tensor
// goes; `slots` (flattened 4-tuples: list position, entry, dynamic base, element offset)
// say which slice of which per-step base fills each None. `run` takes the per-step bases
// (same dtype, device and at least the size of `dynamic_like`'s) and launches without
// any per-entry Python or tensor creation. Lists as adam() (5) or adam_remainders() (6);
// the last (p_out) may be empty. See adam.cu.
class AdamPlan {
 public:
  AdamPlan(bool remainders, const std::vector<std::vector<std::optional<at::Tensor>>>& lists,
           const std::vector<int64_t>& slots, const std::vector<at::Tensor>& dynamic_like);
  void run(const std::vector<at::Tensor>& dynamic, double lr, std::optional<at::Tensor> lr_t,
           double beta1, double beta2, double eps, double weight_decay, int64_t step,
           std::optional<at::Tensor> step_t, bool adam_w_mode, bool bias_correction,
           std::optional<at::Tensor> grad_scale, std::optional<at::Tensor> found_inf) const;
  int64_t entries() const { return static_cast<int64_t>(numel_.size()); }
  int64_t launch_groups() const { return static_cast<int64_t>(groups_.size()); }

  struct Ref {          // where one pointer of an entry comes from
    int base = -1;      // index into fixed_ (dynamic == false) or the run's bases; -1: null
    bool dynamic = false;
    int64_t byte_offset = 0;
  };
  struct Group {        // entries launched together: one (p, g, p_out) dtype combination
    at::ScalarType p, g;
    int out_kind;       // OutKind
    std::vector<int> entries;
  };

 private:
  bool remainders_;
  int depth_;
  at::Device device_;
  std::vector<at::Tensor> fixed_;
  std::vector<std::vector<Ref>> refs_;  // [entry][list position]
  std::vector<int64_t> numel_;
  std::vector<at::ScalarType> dynamic_dtype_;
  std::vector<int64_t> dynamic_numel_;  // elements each per-step base must have at least
  std::vector<Group> groups_;
};

// sqrt(sum of squares) of all tensors, 0-dim fp32; noop_flag set to 1 when not finite.
at::Tensor l2norm(const std::vector<at::Tensor>& tensors, std::optional<at::Tensor> noop_flag);

// dst.copy_(src) for each pair (casts among fp32/fp16/bf16, raw copy for equal dtypes).
void multi_copy(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts,
                std::optional<at::Tensor> noop_flag);

// dst += src for each pair (fp32 math, one rounding; src fp32/fp16/bf16 into fp32, or
// bf16/fp16 into the same dtype), every pair with the first pair's dtypes.
void multi_add(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts,
               std::optional<at::Tensor> noop_flag);

// Cross entropy over logits [N, V] (rows with last stride 1); see cross_entropy.cu.
// stats [N, 4] fp32 per row: max, sum exp(x - max), target logit (0 for target -1), sum x.
void cross_entropy_stats(const at::Tensor& logits, const at::Tensor& target, at::Tensor stats);
// grad = (exp(x - lse) - off_target - on_target * [col == target]) * grad_loss[row];
// grad may be logits itself.
void cross_entropy_backward(const at::Tensor& logits, const at::Tensor& target,
                            const at::Tensor& lse, const at::Tensor& grad_loss,
                            double on_target, double off_target, at::Tensor grad);

// Backward of gelu(x + bias) over x, dy [R, C] (see bias_gelu.cu): dx = gelu'(x + bias) * dy,
// dbias = column sums of dx; tanh_approx: GELU's tanh approximation, else the exact erf.
void bias_gelu_backward(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& dy,
                        at::Tensor dx, at::Tensor dbias, bool tanh_approx);

// LayerNorm of [R, H] rows after an optional residual add (see layer_norm.cu):
// s = x + y (into s_out; y and s_out together), out = LN(s) * w + b, mean/rstd fp32 [R];
// without mean, RMSNorm (no bias): out = s * rstd * w.
void layer_norm_forward(const at::Tensor& x, std::optional<at::Tensor> y, const at::Tensor& w,
                        std::optional<at::Tensor> b, std::optional<at::Tensor> s_out,
                        at::Tensor out, std::optional<at::Tensor> mean, at::Tensor rstd,
                        double eps);
// Its backward: ds = LN'(g_out) + g_s, dw, db (fp32 column sums in a fixed order); without
// mean, RMSNorm's (no db).
void layer_norm_backward(const at::Tensor& g_out, std::optional<at::Tensor> g_s,
                         const at::Tensor& s, const std::optional<at::Tensor>& mean,
                         const at::Tensor& rstd, const at::Tensor& w, at::Tensor ds,
                         at::Tensor dw, std::optional<at::Tensor> db);

// The gradient of a fused projection split into heads (see heads_grad.cu): grads are n
// [B, H, T, D] tensors; dy [B*T, H*n*D] gets dy[b*T + t, (h*n + j)*D + d] = grads[j][b, h, t, d]
// and dbias, where given, dy's column sums.
void heads_grad(const std::vector<at::Tensor>& grads, at::Tensor dy,
                std::optional<at::Tensor> dbias);

// GELU (tanh approximation) in cuBLASLt's GEMM epilogue (see gemm_gelu.cpp), row-major:
// x [M, K], weight [N, K], bias [N] -> (y = gelu(z), z = x weight^T + bias), both [M, N].
std::tuple<at::Tensor, at::Tensor> gemm_bias_gelu(const at::Tensor& x, const at::Tensor& weight,
                                                  const std::optional<at::Tensor>& bias);
// grad_out [M, H], weight [H, F], z [M, F] -> dz = (grad_out weight) * gelu'(z), [M, F].
at::Tensor gemm_dgelu(const at::Tensor& grad_out, const at::Tensor& weight, const at::Tensor& z);
}  // namespace mpzero
