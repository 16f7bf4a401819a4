// Fused multi-tensor Adam/AdamW, plain and with bf16 + int16 remainders.
//
// The math is the reference's (mpzero/kernels/reference.py), operation by operation, with
// round-to-nearest intrinsics so that no multiply-add gets contracted: the kernels and the
// reference compute the same bits. Templates cover (param dtype, grad dtype); the output
// dtype is a run-time switch (9 + 3 kernels in all, to keep the build short).
//
// Capturable: lr, step and found_inf may be device pointers; the bias corrections are then
// computed on the device in fp64, and a nonzero found_inf makes every block return before
// touching memory.
#include "mpzero.h"
#include "multi_tensor_apply.cuh"

#include <cmath>

namespace mpzero {
namespace {

struct AdamScalars {
  float lr, beta1, beta2, omb1, omb2, eps, wd, bc1_inv, bc2_inv;
  double beta1_d, beta2_d;
  const float* lr_ptr;      // nullable: device lr
  const void* step_ptr;     // nullable: device step
  int step_kind;            // 0 int64, 1 int32, 2 float32, 3 float64
  const float* grad_scale;  // nullable
  const float* found_inf;   // nullable
  bool adam_w_mode, bias_correction;

  // Resolve device scalars; true when found_inf says "skip".
  __device__ __forceinline__ bool resolve() {
    if (found_inf != nullptr && *found_inf != 0.0f) return true;
    if (lr_ptr != nullptr) lr = *lr_ptr;
    if (step_ptr != nullptr && bias_correction) {
      double t;
      switch (step_kind) {
        case 0: t = (double)*static_cast<const int64_t*>(step_ptr); break;
        case 1: t = (double)*static_cast<const int32_t*>(step_ptr); break;
        case 2: t = (double)*static_cast<const float*>(step_ptr); break;
        default: t = *static_cast<const double*>(step_ptr); break;
      }
      bc1_inv = (float)(1.0 / (1.0 - pow(beta1_d, t)));
      bc2_inv = (float)(1.0 / (1.0 - pow(beta2_d, t)));
    }
    return false;
  }

  // One element; p, m, v in/out, g in (already fp32).
  __device__ __forceinline__ void update(float& p, float g, float& m, float& v, float gs) const {
    if (grad_scale != nullptr) g = __fmul_rn(g, gs);
    if (!adam_w_mode) g = __fadd_rn(g, __fmul_rn(wd, p));
    m = __fadd_rn(__fmul_rn(beta1, m), __fmul_rn(omb1, g));
    v = __fadd_rn(__fmul_rn(beta2, v), __fmul_rn(omb2, __fmul_rn(g, g)));
    float mh = m, vh = v;
    if (bias_correction) {
      mh = __fmul_rn(m, bc1_inv);
      vh = __fmul_rn(v, bc2_inv);
    }
    float u = __fdiv_rn(mh, __fadd_rn(__fsqrt_rn(vh), eps));
    if (adam_w_mode) u = __fadd_rn(u, __fmul_rn(wd, p));
    p = __fsub_rn(p, __fmul_rn(lr, u));
  }
};

// Lists: 0 p (P), 1 g (G), 2 m (P), 3 v (P), 4 p_out (runtime dtype, nullable).
template <typename P, typename G>
struct AdamOp {
  AdamScalars s;
  OutKind out_kind;
  float gs;

  __device__ __forceinline__ bool init() {
    if (s.resolve()) return true;
    gs = s.grad_scale != nullptr ? *s.grad_scale : 1.0f;
    return false;
  }
  __device__ __forceinline__ void finish() {}

  __device__ __forceinline__ void apply(const TensorListMeta<5>& meta, int t, int64_t begin,
                                        int64_t end) {
    P* p = static_cast<P*>(meta.ptr[0][t]);
    const G* g = static_cast<const G*>(meta.ptr[1][t]);
    P* m = static_cast<P*>(meta.ptr[2][t]);
    P* v = static_cast<P*>(meta.ptr[3][t]);
    void* out = meta.ptr[4][t];
    const OutKind ok = out == nullptr ? OutKind::kNone : out_kind;
    const bool aligned = aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v) &&
                         (out == nullptr || aligned16(out));
    for_chunk(
        aligned, begin, end,
        [&](int64_t i) {
          float rp[kVec], rg[kVec], rm[kVec], rv[kVec];
          load8(p + i, rp);
          load8(g + i, rg);
          load8(m + i, rm);
          load8(v + i, rv);
#pragma unroll
          for (int j = 0; j < kVec; ++j) s.update(rp[j], rg[j], rm[j], rv[j], gs);
          store8(p + i, rp);
          store8(m + i, rm);
          store8(v + i, rv);
          store8_out(ok, out, i, rp);
        },
        [&](int64_t base, int64_t e) {
          float rp[kVec], rg[kVec], rm[kVec], rv[kVec];
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            const int64_t i = scalar_index(base, j);
            if (i < e) {
              rp[j] = to_float(p[i]);
              rg[j] = to_float(g[i]);
              rm[j] = to_float(m[i]);
              rv[j] = to_float(v[i]);
            }
          }
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            const int64_t i = scalar_index(base, j);
            if (i < e) {
              s.update(rp[j], rg[j], rm[j], rv[j], gs);
              p[i] = from_float<P>(rp[j]);
              m[i] = from_float<P>(rm[j]);
              v[i] = from_float<P>(rv[j]);
              store1_out(ok, out, i, rp[j]);
            }
          }
        });
  }
};

// The remainder rule of mpzero/optimizers/precision.py, on raw bits.
__device__ __forceinline__ float merge_bits(uint32_t hi_bits, uint32_t rem_bits) {
  const uint32_t hi = (hi_bits - (rem_bits >> 15)) & 0xFFFFu;  // rem < 0 <=> bit 15 set
  return __uint_as_float((hi << 16) | (rem_bits & 0xFFFFu));
}
__device__ __forceinline__ void split_bits(float x, uint32_t& hi_bits, uint32_t& rem_bits) {
  const uint32_t b = __float_as_uint(x);
  const uint32_t lo = b & 0xFFFFu;
  hi_bits = ((b >> 16) + (lo >> 15)) & 0xFFFFu;  // +1 on the magnitude when lo >= 0x8000
  rem_bits = lo;
}

// Lists: 0 p (bf16 bits), 1 rem (int16), 2 g (G), 3 m (fp32), 4 v (fp32), 5 p_out (nullable).
template <typename G>
struct AdamRemOp {
  AdamScalars s;
  OutKind out_kind;
  float gs;

  __device__ __forceinline__ bool init() {
    if (s.resolve()) return true;
    gs = s.grad_scale != nullptr ? *s.grad_scale : 1.0f;
    return false;
  }
  __device__ __forceinline__ void finish() {}

  __device__ __forceinline__ void store_out1(OutKind ok, void* out, int64_t i, float x,
                                             uint32_t hi) const {
    if (ok == OutKind::kBFloat16) static_cast<uint16_t*>(out)[i] = (uint16_t)hi;
    else store1_out(ok, out, i, x);
  }

  __device__ __forceinline__ void apply(const TensorListMeta<6>& meta, int t, int64_t begin,
                                        int64_t end) {
    uint16_t* p = static_cast<uint16_t*>(meta.ptr[0][t]);
    uint16_t* r = static_cast<uint16_t*>(meta.ptr[1][t]);
    const G* g = static_cast<const G*>(meta.ptr[2][t]);
    float* m = static_cast<float*>(meta.ptr[3][t]);
    float* v = static_cast<float*>(meta.ptr[4][t]);
    void* out = meta.ptr[5][t];
    const OutKind ok = out == nullptr ? OutKind::kNone : out_kind;
    const bool aligned = aligned16(p) && aligned16(r) && aligned16(g) && aligned16(m) &&
                         aligned16(v) && (out == nullptr || aligned16(out));
    for_chunk(
        aligned, begin, end,
        [&](int64_t i) {
          uint32_t hp[kVec], hr[kVec];
          float x[kVec], rg[kVec], rm[kVec], rv[kVec];
          load8_u16(p + i, hp);
          load8_u16(r + i, hr);
          load8(g + i, rg);
          load8(m + i, rm);
          load8(v + i, rv);
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            x[j] = merge_bits(hp[j], hr[j]);
            s.update(x[j], rg[j], rm[j], rv[j], gs);
            split_bits(x[j], hp[j], hr[j]);
          }
          store8_u16(p + i, hp);
          store8_u16(r + i, hr);
          store8(m + i, rm);
          store8(v + i, rv);
          if (ok == OutKind::kBFloat16) store8_u16(static_cast<uint16_t*>(out) + i, hp);
          else store8_out(ok, out, i, x);
        },
        [&](int64_t base, int64_t e) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            const int64_t i = scalar_index(base, j);
            if (i < e) {
              float x = merge_bits(p[i], r[i]);
              float mm = m[i], vv = v[i];
              s.update(x, to_float(g[i]), mm, vv, gs);
              uint32_t hi, lo;
              split_bits(x, hi, lo);
              p[i] = (uint16_t)hi;
              r[i] = (uint16_t)lo;
              m[i] = mm;
              v[i] = vv;
              store_out1(ok, out, i, x, hi);
            }
          }
        });
  }
};

AdamScalars make_scalars(double lr, const std::optional<at::Tensor>& lr_t, double beta1,
                         double beta2, double eps, double wd, int64_t step,
                         const std::optional<at::Tensor>& step_t, bool adam_w_mode,
                         bool bias_correction, const std::optional<at::Tensor>& grad_scale,
                         const std::optional<at::Tensor>& found_inf, const at::Device& dev) {
  AdamScalars s{};
  s.lr = (float)lr;
  s.beta1 = (float)beta1;
  s.beta2 = (float)beta2;
  s.omb1 = (float)(1.0 - beta1);
  s.omb2 = (float)(1.0 - beta2);
  s.eps = (float)eps;
  s.wd = (float)wd;
  s.beta1_d = beta1;
  s.beta2_d = beta2;
  s.adam_w_mode = adam_w_mode;
  s.bias_correction = bias_correction;
  s.lr_ptr = scalar_ptr(lr_t, "lr", dev);
  s.grad_scale = scalar_ptr(grad_scale, "grad_scale", dev);
  s.found_inf = scalar_ptr(found_inf, "found_inf", dev);
  s.step_ptr = nullptr;
  s.step_kind = 0;
  if (step_t.has_value() && step_t->defined()) {
    const at::Tensor& st = *step_t;
    TORCH_CHECK(st.is_cuda() && st.device() == dev, "mpzero: 'step' must be on ", dev);
    TORCH_CHECK(st.numel() == 1, "mpzero: 'step' must have one element");
    switch (st.scalar_type()) {
      case at::kLong: s.step_kind = 0; break;
      case at::kInt: s.step_kind = 1; break;
      case at::kFloat: s.step_kind = 2; break;
      case at::kDouble: s.step_kind = 3; break;
      default: TORCH_CHECK(false, "mpzero: 'step' must be int64/int32/float32/float64");
    }
    s.step_ptr = st.data_ptr();
  } else if (bias_correction) {
    TORCH_CHECK(step >= 1, "mpzero: step must be >= 1 with bias correction, got ", step);
    s.bc1_inv = (float)(1.0 / (1.0 - std::pow(beta1, (double)step)));
    s.bc2_inv = (float)(1.0 / (1.0 - std::pow(beta2, (double)step)));
  }
  return s;
}

template <typename F>
void dispatch_float(at::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(__half{}); break;
    case at::kBFloat16: f(__nv_bfloat16{}); break;
    default: TORCH_CHECK(false, "mpzero: unsupported dtype ", t, " for '", what, "'");
  }
}

}  // namespace

void adam(const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& g,
          const std::vector<at::Tensor>& m, const std::vector<at::Tensor>& v,
          const std::vector<at::Tensor>& p_out, double lr, std::optional<at::Tensor> lr_t,
          double beta1, double beta2, double eps, double weight_decay, int64_t step,
          std::optional<at::Tensor> step_t, bool adam_w_mode, bool bias_correction,
          std::optional<at::Tensor> grad_scale, std::optional<at::Tensor> found_inf) {
  const size_t n = p.size();
  if (n == 0) return;
  const at::Device dev = p[0].device();
  check_list(p, "params", n, dev);
  check_list(g, "grads", n, dev);
  check_list(m, "exp_avgs", n, dev);
  check_list(v, "exp_avg_sqs", n, dev);
  const bool has_out = !p_out.empty();
  if (has_out) check_list(p_out, "params_out", n, dev);
  const at::cuda::CUDAGuard guard(dev);
  const AdamScalars s = make_scalars(lr, lr_t, beta1, beta2, eps, weight_decay, step, step_t,
                                     adam_w_mode, bias_correction, grad_scale, found_inf, dev);
  // Group tensors by (p dtype, g dtype, out dtype): one launch series per group.
  std::vector<bool> done(n, false);
  for (size_t i0 = 0; i0 < n; ++i0) {
    if (done[i0]) continue;
    const auto pt = p[i0].scalar_type(), gt = g[i0].scalar_type();
    const auto ot = has_out ? p_out[i0].scalar_type() : at::kFloat;
    std::vector<std::array<void*, 5>> ptrs;
    std::vector<int64_t> numel;
    for (size_t i = i0; i < n; ++i) {
      if (done[i] || p[i].scalar_type() != pt || g[i].scalar_type() != gt ||
          (has_out && p_out[i].scalar_type() != ot))
        continue;
      done[i] = true;
      const int64_t k = p[i].numel();
      TORCH_CHECK(g[i].numel() == k && m[i].numel() == k && v[i].numel() == k &&
                      (!has_out || p_out[i].numel() == k),
                  "mpzero.adam: tensor ", i, " has mismatched element counts");
      TORCH_CHECK(m[i].scalar_type() == pt && v[i].scalar_type() == pt,
                  "mpzero.adam: exp_avg/exp_avg_sq must have the params' dtype");
      if (k == 0) continue;
      ptrs.push_back({p[i].data_ptr(), g[i].data_ptr(), m[i].data_ptr(), v[i].data_ptr(),
                      has_out ? p_out[i].data_ptr() : nullptr});
      numel.push_back(k);
    }
    if (numel.empty()) continue;
    const OutKind ok = has_out ? out_kind_of(ot) : OutKind::kNone;
    dispatch_float(pt, "params", [&](auto p_tag) {
      dispatch_float(gt, "grads", [&](auto g_tag) {
        using P = decltype(p_tag);
        using G = decltype(g_tag);
        AdamOp<P, G> op{s, ok, 1.0f};
        launch_multi_tensor<5>(ptrs, numel, chunk_elems(), op);
      });
    });
  }
}

void adam_remainders(const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& rem,
                     const std::vector<at::Tensor>& g, const std::vector<at::Tensor>& m,
                     const std::vector<at::Tensor>& v, const std::vector<at::Tensor>& p_out,
                     double lr, std::optional<at::Tensor> lr_t, double beta1, double beta2,
                     double eps, double weight_decay, int64_t step,
                     std::optional<at::Tensor> step_t, bool adam_w_mode, bool bias_correction,
                     std::optional<at::Tensor> grad_scale, std::optional<at::Tensor> found_inf) {
  const size_t n = p.size();
  if (n == 0) return;
  const at::Device dev = p[0].device();
  check_list(p, "params_bf16", n, dev);
  check_list(rem, "remainders", n, dev);
  check_list(g, "grads", n, dev);
  check_list(m, "exp_avgs", n, dev);
  check_list(v, "exp_avg_sqs", n, dev);
  const bool has_out = !p_out.empty();
  if (has_out) check_list(p_out, "params_out", n, dev);
  const at::cuda::CUDAGuard guard(dev);
  const AdamScalars s = make_scalars(lr, lr_t, beta1, beta2, eps, weight_decay, step, step_t,
                                     adam_w_mode, bias_correction, grad_scale, found_inf, dev);
  std::vector<bool> done(n, false);
  for (size_t i0 = 0; i0 < n; ++i0) {
    if (done[i0]) continue;
    const auto gt = g[i0].scalar_type();
    const auto ot = has_out ? p_out[i0].scalar_type() : at::kBFloat16;
    std::vector<std::array<void*, 6>> ptrs;
    std::vector<int64_t> numel;
    for (size_t i = i0; i < n; ++i) {
      if (done[i] || g[i].scalar_type() != gt || (has_out && p_out[i].scalar_type() != ot))
        continue;
      done[i] = true;
      const int64_t k = p[i].numel();
      TORCH_CHECK(p[i].scalar_type() == at::kBFloat16 && rem[i].scalar_type() == at::kShort,
                  "mpzero.adam_remainders: params must be bfloat16 and remainders int16");
      TORCH_CHECK(m[i].scalar_type() == at::kFloat && v[i].scalar_type() == at::kFloat,
                  "mpzero.adam_remainders: exp_avg/exp_avg_sq must be float32");
      TORCH_CHECK(rem[i].numel() == k && g[i].numel() == k && m[i].numel() == k &&
                      v[i].numel() == k && (!has_out || p_out[i].numel() == k),
                  "mpzero.adam_remainders: tensor ", i, " has mismatched element counts");
      if (k == 0) continue;
      ptrs.push_back({p[i].data_ptr(), rem[i].data_ptr(), g[i].data_ptr(), m[i].data_ptr(),
                      v[i].data_ptr(), has_out ? p_out[i].data_ptr() : nullptr});
      numel.push_back(k);
    }
    if (numel.empty()) continue;
    const OutKind ok = has_out ? out_kind_of(ot) : OutKind::kNone;
    dispatch_float(gt, "grads", [&](auto g_tag) {
      using G = decltype(g_tag);
      AdamRemOp<G> op{s, ok, 1.0f};
      launch_multi_tensor<6>(ptrs, numel, chunk_elems(), op);
    });
  }
}

}  // namespace mpzero
