// Fused multi-tensor Adam/AdamW, plain and with bf16 + int16 remainders.
//
// The math is the reference's (mpzero/kernels/reference.py), operation by operation, with
// round-to-nearest intrinsics so that no multiply-add gets contracted: the kernels and the
// reference compute the same bits. Templates cover (param dtype, grad dtype); the output
// dtype is a run-time switch (9 + 3 kernels in all, to keep the build short).
//
// Capturable: lr, step and found_inf may be device pointers; a one-thread kernel then
// resolves them (the bias corrections in fp64) into four floats that every block reads,
// and a nonzero found_inf makes every block return before touching memory.
#include "mpzero.h"
#include "multi_tensor_apply.cuh"

#include <ATen/ops/empty.h>

#include <algorithm>
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
  // nullable: {skip, lr, bc1_inv, bc2_inv} made once per launch from the device scalars
  // above by resolve_scalars_kernel (set whenever lr_ptr, step_ptr or found_inf is)
  const float* resolved;
  bool adam_w_mode, bias_correction;

  // The device scalars (a block's start): true when found_inf says "skip".
  __device__ __forceinline__ bool resolve() {
    if (resolved == nullptr) return false;
    if (resolved[0] != 0.0f) return true;
    lr = resolved[1];
    bc1_inv = resolved[2];
    bc2_inv = resolved[3];
    return false;
  }

  // The values resolve() reads, from lr_ptr, step_ptr and found_inf (one thread).
  __device__ void resolve_from_pointers(float* out) {
    out[0] = (found_inf != nullptr && *found_inf != 0.0f) ? 1.0f : 0.0f;
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
    out[1] = lr;
    out[2] = bc1_inv;
    out[3] = bc2_inv;
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

// The bias corrections of a device step are two FP64 pows: made here once per launch, not
// by every thread of every block (a measurable share of the step: docs/kernels.md).
__global__ void resolve_scalars_kernel(AdamScalars s, float* out) {
  s.resolve_from_pointers(out);
}

// How a kernel walks a chunk: aligned tensors in block steps with split access (load8x),
// the next step's loads in flight during this step's math (for_chunk_prefetch) unless the
// build sets MPZERO_NO_PREFETCH (kLoadsAhead, multi_tensor_apply_config.h); misaligned
// tensors and a tensor's last partial step take a scalar path.

// Lists: 0 p (P), 1 g (G), 2 m (P), 3 v (P), 4 p_out (runtime dtype, nullable).
template <typename P, typename G>
struct AdamOp {
  struct Row {  // one split step loaded ahead
    Split8<P> p;
    Split8<G> g;
    Split8<P> m, v;
  };

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
    // The update of one block step (two runs of 4 at i0 and i1) and its stores.
    auto update_store = [&](int64_t i0, int64_t i1, float (&rp)[kVec], const float (&rg)[kVec],
                            float (&rm)[kVec], float (&rv)[kVec]) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) s.update(rp[j], rg[j], rm[j], rv[j], gs);
      if constexpr (kLoadsAhead) {
        store8x_wide(p, i0, i1, rp);
        store8x_wide(m, i0, i1, rm);
        store8x_wide(v, i0, i1, rv);
        store8x_out_wide(ok, out, i0, i1, rp);
      } else {
        store8x(p, i0, i1, rp);
        store8x(m, i0, i1, rm);
        store8x(v, i0, i1, rv);
        store8x_out(ok, out, i0, i1, rp);
      }
    };
    auto scalar = [&](int64_t base, int64_t e) {
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
    };
    if constexpr (kLoadsAhead) {
      if (aligned) {
        for_chunk_prefetch(
            begin, end,
            [&](int64_t i0, int64_t i1) {
              return Row{load_split8(p, i0, i1), load_split8(g, i0, i1), load_split8(m, i0, i1),
                         load_split8(v, i0, i1)};
            },
            [&](const Row& x, int64_t i0, int64_t i1) {
              float rp[kVec], rg[kVec], rm[kVec], rv[kVec];
              split8_to_float(x.p, rp);
              split8_to_float(x.g, rg);
              split8_to_float(x.m, rm);
              split8_to_float(x.v, rv);
              update_store(i0, i1, rp, rg, rm, rv);
            },
            scalar);
        return;
      }
    }
    for_chunk_split(  // without the loads ahead; with them, misaligned tensors only
        aligned, begin, end,
        [&](int64_t i0, int64_t i1) {
          float rp[kVec], rg[kVec], rm[kVec], rv[kVec];
          load8x(p, i0, i1, rp);
          load8x(g, i0, i1, rg);
          load8x(m, i0, i1, rm);
          load8x(v, i0, i1, rv);
          update_store(i0, i1, rp, rg, rm, rv);
        },
        scalar);
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
  struct Row {  // one split step loaded ahead
    Split8<uint16_t> p, r;
    Split8<G> g;
    Split8<float> m, v;
  };

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
    // The update of one block step (two runs of 4 at i0 and i1) and its stores.
    auto update_store = [&](int64_t i0, int64_t i1, uint32_t (&hp)[kVec], uint32_t (&hr)[kVec],
                            const float (&rg)[kVec], float (&rm)[kVec], float (&rv)[kVec]) {
      float x[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        x[j] = merge_bits(hp[j], hr[j]);
        s.update(x[j], rg[j], rm[j], rv[j], gs);
        split_bits(x[j], hp[j], hr[j]);
      }
      if constexpr (kLoadsAhead) {
        store8x_u16_wide(p, i0, i1, hp);
        store8x_u16_wide(r, i0, i1, hr);
        store8x_wide(m, i0, i1, rm);
        store8x_wide(v, i0, i1, rv);
        if (ok == OutKind::kBFloat16) store8x_u16_wide(static_cast<uint16_t*>(out), i0, i1, hp);
        else store8x_out_wide(ok, out, i0, i1, x);
      } else {
        store8x_u16(p, i0, i1, hp);
        store8x_u16(r, i0, i1, hr);
        store8x(m, i0, i1, rm);
        store8x(v, i0, i1, rv);
        if (ok == OutKind::kBFloat16) store8x_u16(static_cast<uint16_t*>(out), i0, i1, hp);
        else store8x_out(ok, out, i0, i1, x);
      }
    };
    auto scalar = [&](int64_t base, int64_t e) {
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
    };
    if constexpr (kLoadsAhead) {
      if (aligned) {
        for_chunk_prefetch(
            begin, end,
            [&](int64_t i0, int64_t i1) {
              return Row{load_split8(p, i0, i1), load_split8(r, i0, i1), load_split8(g, i0, i1),
                         load_split8(m, i0, i1), load_split8(v, i0, i1)};
            },
            [&](const Row& x, int64_t i0, int64_t i1) {
              uint32_t hp[kVec], hr[kVec];
              float rg[kVec], rm[kVec], rv[kVec];
              split8_to_u32(x.p, hp);
              split8_to_u32(x.r, hr);
              split8_to_float(x.g, rg);
              split8_to_float(x.m, rm);
              split8_to_float(x.v, rv);
              update_store(i0, i1, hp, hr, rg, rm, rv);
            },
            scalar);
        return;
      }
    }
    for_chunk_split(  // without the loads ahead; with them, misaligned tensors only
        aligned, begin, end,
        [&](int64_t i0, int64_t i1) {
          uint32_t hp[kVec], hr[kVec];
          float rg[kVec], rm[kVec], rv[kVec];
          load8x_u16(p, i0, i1, hp);
          load8x_u16(r, i0, i1, hr);
          load8x(g, i0, i1, rg);
          load8x(m, i0, i1, rm);
          load8x(v, i0, i1, rv);
          update_store(i0, i1, hp, hr, rg, rm, rv);
        },
        scalar);
  }
};

AdamScalars make_scalars(double lr, const std::optional<at::Tensor>& lr_t, double beta1,
                         double beta2, double eps, double wd, int64_t step,
                         const std::optional<at::Tensor>& step_t, bool adam_w_mode,
                         bool bias_correction, const std::optional<at::Tensor>& grad_scale,
                         const std::optional<at::Tensor>& found_inf, const at::Device& dev,
                         at::Tensor& resolved) {
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
    TORCH_CHECK(st.is_cuda() && st.device() == dev, "mpzero: 'step' must be on ", dev.str());
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
    TORCH_CHECK(step >= 1, "mpzero: step must be >= 1 with bias correction, got ", num(step));
    s.bc1_inv = (float)(1.0 / (1.0 - std::pow(beta1, (double)step)));
    s.bc2_inv = (float)(1.0 / (1.0 - std::pow(beta2, (double)step)));
  }
  s.resolved = nullptr;
  if (s.lr_ptr != nullptr || s.step_ptr != nullptr || s.found_inf != nullptr) {
    // Stream-ordered: freed after the caller's launches, reused only after them.
    resolved = at::empty({4}, at::TensorOptions().dtype(at::kFloat).device(dev));
    resolve_scalars_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(
        s, resolved.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    s.resolved = resolved.data_ptr<float>();
  }
  return s;
}

// f(float{}), f(__half{}) or f(__nv_bfloat16{}) for a params or grads dtype.
template <typename F>
void dispatch_adam(at::ScalarType t, const char* what, F&& f) {
  dispatch_float(t, f, "mpzero: unsupported dtype ", c10::toString(t), " for '", what, "'");
}

// One launch series of the plain kernel over tensors of one (p, g) dtype combination.
void launch_adam(const AdamScalars& s, at::ScalarType pt, at::ScalarType gt, OutKind ok,
                 const std::vector<std::array<void*, 5>>& ptrs,
                 const std::vector<int64_t>& numel) {
  dispatch_adam(pt, "params", [&](auto p_tag) {
    dispatch_adam(gt, "grads", [&](auto g_tag) {
      using P = decltype(p_tag);
      using G = decltype(g_tag);
      launch_multi_tensor<5>(ptrs, numel, chunk_elems(), AdamOp<P, G>{s, ok, 1.0f});
    });
  });
}

// The same for the remainder kernel (params are bf16 bits, the dtype is fixed).
void launch_adam(const AdamScalars& s, at::ScalarType, at::ScalarType gt, OutKind ok,
                 const std::vector<std::array<void*, 6>>& ptrs,
                 const std::vector<int64_t>& numel) {
  dispatch_adam(gt, "grads", [&](auto g_tag) {
    using G = decltype(g_tag);
    launch_multi_tensor<6>(ptrs, numel, chunk_elems(), AdamRemOp<G>{s, ok, 1.0f});
  });
}

void check_plain_dtypes(at::ScalarType pt, at::ScalarType mt, at::ScalarType vt) {
  TORCH_CHECK(mt == pt && vt == pt, "mpzero.adam: exp_avg/exp_avg_sq must have the params' dtype");
}

void check_remainder_dtypes(at::ScalarType pt, at::ScalarType rt, at::ScalarType mt,
                            at::ScalarType vt) {
  TORCH_CHECK(pt == at::kBFloat16 && rt == at::kShort,
              "mpzero.adam_remainders: params must be bfloat16 and remainders int16");
  TORCH_CHECK(mt == at::kFloat && vt == at::kFloat,
              "mpzero.adam_remainders: exp_avg/exp_avg_sq must be float32");
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
  at::Tensor resolved;  // alive until the launches below are queued
  const AdamScalars s = make_scalars(lr, lr_t, beta1, beta2, eps, weight_decay, step, step_t,
                                     adam_w_mode, bias_correction, grad_scale, found_inf, dev,
                                     resolved);
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
                  "mpzero.adam: tensor ", num(i), " has mismatched element counts");
      check_plain_dtypes(pt, m[i].scalar_type(), v[i].scalar_type());
      if (k == 0) continue;
      ptrs.push_back({p[i].data_ptr(), g[i].data_ptr(), m[i].data_ptr(), v[i].data_ptr(),
                      has_out ? p_out[i].data_ptr() : nullptr});
      numel.push_back(k);
    }
    if (numel.empty()) continue;
    const OutKind ok = has_out ? out_kind_of(ot) : OutKind::kNone;
    launch_adam(s, pt, gt, ok, ptrs, numel);
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
  at::Tensor resolved;  // alive until the launches below are queued
  const AdamScalars s = make_scalars(lr, lr_t, beta1, beta2, eps, weight_decay, step, step_t,
                                     adam_w_mode, bias_correction, grad_scale, found_inf, dev,
                                     resolved);
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
      check_remainder_dtypes(p[i].scalar_type(), rem[i].scalar_type(), m[i].scalar_type(),
                             v[i].scalar_type());
      TORCH_CHECK(rem[i].numel() == k && g[i].numel() == k && m[i].numel() == k &&
                      v[i].numel() == k && (!has_out || p_out[i].numel() == k),
                  "mpzero.adam_remainders: tensor ", num(i), " has mismatched element counts");
      if (k == 0) continue;
      ptrs.push_back({p[i].data_ptr(), rem[i].data_ptr(), g[i].data_ptr(), m[i].data_ptr(),
                      v[i].data_ptr(), has_out ? p_out[i].data_ptr() : nullptr});
      numel.push_back(k);
    }
    if (numel.empty()) continue;
    const OutKind ok = has_out ? out_kind_of(ot) : OutKind::kNone;
    launch_adam(s, at::kBFloat16, gt, ok, ptrs, numel);
  }
}

// ---------------------------------------------------------------------------------------
// AdamPlan

namespace {

template <int DEPTH>
void run_groups(const AdamScalars& s, const std::vector<AdamPlan::Group>& groups,
                const std::vector<std::vector<AdamPlan::Ref>>& refs,
                const std::vector<int64_t>& numel, const std::vector<at::Tensor>& fixed,
                const std::vector<char*>& dynamic) {
  std::vector<std::array<void*, DEPTH>> ptrs;
  std::vector<int64_t> counts;
  for (const AdamPlan::Group& grp : groups) {
    ptrs.clear();
    counts.clear();
    for (int e : grp.entries) {
      std::array<void*, DEPTH> row;
      for (int d = 0; d < DEPTH; ++d) {
        const AdamPlan::Ref& r = refs[e][d];
        row[d] = r.base < 0 ? nullptr
                 : r.dynamic ? static_cast<void*>(dynamic[r.base] + r.byte_offset)
                             : fixed[r.base].data_ptr();
      }
      ptrs.push_back(row);
      counts.push_back(numel[e]);
    }
    launch_adam(s, grp.p, grp.g, static_cast<OutKind>(grp.out_kind), ptrs, counts);
  }
}

}  // namespace

AdamPlan::AdamPlan(bool remainders,
                   const std::vector<std::vector<std::optional<at::Tensor>>>& lists,
                   const std::vector<int64_t>& slots, const std::vector<at::Tensor>& dynamic_like)
    : remainders_(remainders), depth_(remainders ? 6 : 5), device_(at::kCPU) {
  const char* what = "mpzero.AdamPlan";
  TORCH_CHECK(static_cast<int>(lists.size()) == depth_, what, ": expected ", num(depth_),
              " argument lists, got ", num(lists.size()));
  const size_t n = lists[0].size();
  const int out = depth_ - 1;
  const bool has_out = !lists[out].empty();
  for (int d = 0; d < depth_; ++d) {
    TORCH_CHECK(lists[d].size() == n || (d == out && !has_out), what, ": list ", num(d), " has ",
                num(lists[d].size()), " entries, expected ", num(n));
  }
  TORCH_CHECK(slots.size() % 4 == 0, what, ": slots must be 4-tuples, got ", num(slots.size()),
              " numbers");
  bool have_device = false;
  auto check_tensor = [&](const at::Tensor& t, const char* kind) {
    TORCH_CHECK(t.is_cuda(), what, ": ", kind, " tensors must be CUDA tensors");
    TORCH_CHECK(t.is_contiguous(), what, ": ", kind, " tensors must be contiguous");
    if (!have_device) {
      device_ = t.device();
      have_device = true;
    }
    TORCH_CHECK(t.device() == device_, what, ": every tensor must be on ", device_.str(), ", got ",
                t.device().str());
  };
  for (const at::Tensor& t : dynamic_like) {
    check_tensor(t, "per-step");
    dynamic_dtype_.push_back(t.scalar_type());
    dynamic_numel_.push_back(0);
  }
  // Entries' sizes come from exp_avg, which is always a fixed tensor.
  const int m_pos = remainders ? 3 : 2;
  numel_.resize(n);
  refs_.assign(n, std::vector<Ref>(depth_));
  std::vector<std::vector<at::ScalarType>> dtype(n, std::vector<at::ScalarType>(depth_, at::kFloat));
  std::vector<std::vector<bool>> filled(n, std::vector<bool>(depth_, false));
  for (size_t e = 0; e < n; ++e) {
    const auto& m = lists[m_pos][e];
    TORCH_CHECK(m.has_value() && m->defined(), what, ": entry ", num(e),
                " has no exp_avg tensor (it cannot be a per-step slot)");
    numel_[e] = m->numel();
    for (int d = 0; d < depth_; ++d) {
      if (d == out && !has_out) {
        filled[e][d] = true;  // Ref stays null: no output
        continue;
      }
      const auto& t = lists[d][e];
      if (!t.has_value() || !t->defined()) continue;
      check_tensor(*t, "fixed");
      TORCH_CHECK(t->numel() == numel_[e], what, ": entry ", num(e), ", list ", num(d), " has ",
                  num(t->numel()), " elements, expected ", num(numel_[e]));
      refs_[e][d] = Ref{static_cast<int>(fixed_.size()), false, 0};
      fixed_.push_back(*t);
      dtype[e][d] = t->scalar_type();
      filled[e][d] = true;
    }
  }
  for (size_t k = 0; k < slots.size(); k += 4) {
    const int64_t d = slots[k], e = slots[k + 1], b = slots[k + 2], off = slots[k + 3];
    TORCH_CHECK(d >= 0 && d < depth_ && e >= 0 && e < static_cast<int64_t>(n), what,
                ": slot (", num(d), ", ", num(e), ") out of range");
    TORCH_CHECK(!filled[e][d], what, ": slot (", num(d), ", ", num(e),
                ") is given twice or holds a fixed tensor");
    TORCH_CHECK(b >= 0 && b < static_cast<int64_t>(dynamic_like.size()), what,
                ": slot (", num(d), ", ", num(e), ") names per-step tensor ", num(b), " of ",
                num(dynamic_like.size()));
    TORCH_CHECK(off >= 0 && off + numel_[e] <= dynamic_like[b].numel(), what, ": slot (", num(d),
                ", ", num(e), ") elements [", num(off), ", ", num(off + numel_[e]),
                ") exceed per-step tensor ", num(b), " of ", num(dynamic_like[b].numel()));
    refs_[e][d] = Ref{static_cast<int>(b), true, off * dynamic_like[b].element_size()};
    dtype[e][d] = dynamic_dtype_[b];
    dynamic_numel_[b] = std::max(dynamic_numel_[b], off + numel_[e]);
    filled[e][d] = true;
  }
  for (size_t e = 0; e < n; ++e) {
    for (int d = 0; d < depth_; ++d) {
      TORCH_CHECK(filled[e][d], what, ": entry ", num(e), ", list ", num(d),
                  " is None but no slot fills it");
    }
  }
  // Check dtypes and group entries by (p, g, p_out) dtypes, as adam() does per call.
  const int g_pos = remainders ? 2 : 1;
  for (size_t e = 0; e < n; ++e) {
    const auto& dt = dtype[e];
    if (remainders) {
      check_remainder_dtypes(dt[0], dt[1], dt[3], dt[4]);
    } else {
      check_plain_dtypes(dt[0], dt[2], dt[3]);
    }
    const int ok = static_cast<int>(has_out ? out_kind_of(dt[out]) : OutKind::kNone);
    if (numel_[e] == 0) continue;
    Group* grp = nullptr;
    for (Group& gr : groups_) {
      if (gr.p == dt[0] && gr.g == dt[g_pos] && gr.out_kind == ok) grp = &gr;
    }
    if (grp == nullptr) {
      groups_.push_back(Group{dt[0], dt[g_pos], ok, {}});
      grp = &groups_.back();
    }
    grp->entries.push_back(static_cast<int>(e));
  }
}

void AdamPlan::run(const std::vector<at::Tensor>& dynamic, double lr,
                   std::optional<at::Tensor> lr_t, double beta1, double beta2, double eps,
                   double weight_decay, int64_t step, std::optional<at::Tensor> step_t,
                   bool adam_w_mode, bool bias_correction, std::optional<at::Tensor> grad_scale,
                   std::optional<at::Tensor> found_inf) const {
  TORCH_CHECK(dynamic.size() == dynamic_dtype_.size(), "mpzero.AdamPlan.run: expected ",
              num(dynamic_dtype_.size()), " per-step tensors, got ", num(dynamic.size()));
  std::vector<char*> bases(dynamic.size());
  for (size_t k = 0; k < dynamic.size(); ++k) {
    const at::Tensor& t = dynamic[k];
    TORCH_CHECK(t.defined() && t.device() == device_ && t.scalar_type() == dynamic_dtype_[k] &&
                    t.is_contiguous() && t.numel() >= dynamic_numel_[k],
                "mpzero.AdamPlan.run: per-step tensor ", num(k), " must be a contiguous ",
                dynamic_dtype_[k], " tensor on ", device_.str(), " of at least ",
                num(dynamic_numel_[k]), " elements");
    bases[k] = static_cast<char*>(t.data_ptr());
  }
  if (groups_.empty()) return;
  const at::cuda::CUDAGuard guard(device_);
  at::Tensor resolved;  // alive until the launches below are queued
  const AdamScalars s = make_scalars(lr, lr_t, beta1, beta2, eps, weight_decay, step, step_t,
                                     adam_w_mode, bias_correction, grad_scale, found_inf,
                                     device_, resolved);
  if (remainders_) {
    run_groups<6>(s, groups_, refs_, numel_, fixed_, bases);
  } else {
    run_groups<5>(s, groups_, refs_, numel_, fixed_, bases);
  }
}

}  // namespace mpzero
