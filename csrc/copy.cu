// Multi-tensor copy: casts among fp32/fp16/bf16 (round to nearest even) and raw byte
// copies for identical dtypes of any kind; and multi-tensor accumulation (dst += src). A nonzero noop flag makes every block return
// before writing.
#include "mpzero.h"
#include "multi_tensor_apply.cuh"

namespace mpzero {
namespace {

__device__ __forceinline__ bool noop_set(const float* noop) {
  return noop != nullptr && *noop != 0.0f;
}

// d = s cast to D (kAdd false), or d += s in fp32 rounded once to D (kAdd true: the same
// values as ATen's d.add_(s) where every S value is a D value, the gradient accumulation
// of the optimizer's buckets).
template <typename S, typename D, bool kAdd>
struct CastOp {
  const float* noop;
  __device__ __forceinline__ bool init() { return noop_set(noop); }
  __device__ __forceinline__ void finish() {}
  __device__ __forceinline__ void apply(const TensorListMeta<2>& meta, int t, int64_t begin,
                                        int64_t end) {
    const S* s = static_cast<const S*>(meta.ptr[0][t]);
    D* d = static_cast<D*>(meta.ptr[1][t]);
    for_chunk(
        aligned16(s) && aligned16(d), begin, end,
        [&](int64_t i) {
          float r[kVec];
          load8(s + i, r);
          if constexpr (kAdd) {
            float b[kVec];
            load8(d + i, b);
#pragma unroll
            for (int j = 0; j < kVec; ++j) r[j] = __fadd_rn(b[j], r[j]);
          }
          store8(d + i, r);
        },
        [&](int64_t base, int64_t e) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            const int64_t i = scalar_index(base, j);
            if (i >= e) continue;
            const float x = to_float(s[i]);
            d[i] = from_float<D>(kAdd ? __fadd_rn(to_float(d[i]), x) : x);
          }
        });
  }
};

// Raw copy of identical dtypes: indices are bytes; 16 bytes per thread per step (one uint4)
// when both pointers are 16-byte aligned, bytes otherwise.
constexpr int kRawVec = 16;

struct RawOp {
  const float* noop;
  __device__ __forceinline__ bool init() { return noop_set(noop); }
  __device__ __forceinline__ void finish() {}
  __device__ __forceinline__ void apply(const TensorListMeta<2>& meta, int t, int64_t begin,
                                        int64_t end) {
    const uint8_t* s = static_cast<const uint8_t*>(meta.ptr[0][t]);
    uint8_t* d = static_cast<uint8_t*>(meta.ptr[1][t]);
    for_chunk<kRawVec>(
        aligned16(s) && aligned16(d), begin, end,
        [&](int64_t i) {
          *reinterpret_cast<uint4*>(d + i) = *reinterpret_cast<const uint4*>(s + i);
        },
        [&](int64_t base, int64_t e) {
#pragma unroll
          for (int j = 0; j < kRawVec; ++j) {
            const int64_t i = scalar_index(base, j);
            if (i < e) d[i] = s[i];
          }
        });
  }
};

// f(float{}), f(__half{}) or f(__nv_bfloat16{}) for a cast's dtype.
template <typename F>
void dispatch_cast(at::ScalarType t, F&& f) {
  dispatch_float(t, f, "mpzero.multi_copy: unsupported cast dtype ", c10::toString(t));
}

}  // namespace

void multi_copy(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts,
                std::optional<at::Tensor> noop_flag) {
  const size_t n = srcs.size();
  if (n == 0) return;
  const at::Device dev = srcs[0].device();
  check_list(srcs, "srcs", n, dev);
  check_list(dsts, "dsts", n, dev);
  const at::cuda::CUDAGuard guard(dev);
  const float* noop = scalar_ptr(noop_flag, "noop_flag", dev);
  // Raw copies (identical dtypes) first, as one byte-level launch series.
  std::vector<std::array<void*, 2>> raw_ptrs;
  std::vector<int64_t> raw_bytes;
  std::vector<bool> done(n, false);
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(srcs[i].numel() == dsts[i].numel(), "mpzero.multi_copy: pair ", num(i),
                " has numel ", num(srcs[i].numel()), " vs ", num(dsts[i].numel()));
    if (srcs[i].scalar_type() != dsts[i].scalar_type()) continue;
    done[i] = true;
    if (srcs[i].numel() == 0) continue;
    raw_ptrs.push_back({srcs[i].data_ptr(), dsts[i].data_ptr()});
    raw_bytes.push_back(srcs[i].numel() * (int64_t)srcs[i].element_size());
  }
  if (!raw_bytes.empty()) {
    launch_multi_tensor<2>(raw_ptrs, raw_bytes, chunk_elems(4, kRawVec), RawOp{noop});
  }
  for (size_t i0 = 0; i0 < n; ++i0) {
    if (done[i0]) continue;
    const auto st = srcs[i0].scalar_type(), dt = dsts[i0].scalar_type();
    std::vector<std::array<void*, 2>> ptrs;
    std::vector<int64_t> numel;
    for (size_t i = i0; i < n; ++i) {
      if (done[i] || srcs[i].scalar_type() != st || dsts[i].scalar_type() != dt) continue;
      done[i] = true;
      if (srcs[i].numel() == 0) continue;
      ptrs.push_back({srcs[i].data_ptr(), dsts[i].data_ptr()});
      numel.push_back(srcs[i].numel());
    }
    if (numel.empty()) continue;
    dispatch_cast(st, [&](auto s_tag) {
      dispatch_cast(dt, [&](auto d_tag) {
        using S = decltype(s_tag);
        using D = decltype(d_tag);
        launch_multi_tensor<2>(ptrs, numel, chunk_elems(), CastOp<S, D, false>{noop});
      });
    });
  }
}

void multi_add(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts,
               std::optional<at::Tensor> noop_flag) {
  const size_t n = srcs.size();
  if (n == 0) return;
  const at::Device dev = srcs[0].device();
  check_list(srcs, "srcs", n, dev);
  check_list(dsts, "dsts", n, dev);
  const at::cuda::CUDAGuard guard(dev);
  const float* noop = scalar_ptr(noop_flag, "noop_flag", dev);
  const auto st = srcs[0].scalar_type(), dt = dsts[0].scalar_type();
  std::vector<std::array<void*, 2>> ptrs;
  std::vector<int64_t> numel;
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(srcs[i].numel() == dsts[i].numel(), "mpzero.multi_add: pair ", num(i),
                " has numel ", num(srcs[i].numel()), " vs ", num(dsts[i].numel()));
    TORCH_CHECK(srcs[i].scalar_type() == st && dsts[i].scalar_type() == dt,
                "mpzero.multi_add: every pair must have the first pair's dtypes");
    if (srcs[i].numel() == 0) continue;
    ptrs.push_back({srcs[i].data_ptr(), dsts[i].data_ptr()});
    numel.push_back(srcs[i].numel());
  }
  if (numel.empty()) return;
  // The pairs where every source value is a destination value.
  auto launch = [&](auto s_tag, auto d_tag) {
    using S = decltype(s_tag);
    using D = decltype(d_tag);
    launch_multi_tensor<2>(ptrs, numel, chunk_elems(), CastOp<S, D, true>{noop});
  };
  if (dt == at::kFloat) {
    dispatch_cast(st, [&](auto s_tag) { launch(s_tag, float{}); });
  } else if (st == dt && dt == at::kBFloat16) {
    launch(__nv_bfloat16{}, __nv_bfloat16{});
  } else if (st == dt && dt == at::kHalf) {
    launch(__half{}, __half{});
  } else {
    TORCH_CHECK(false, "mpzero.multi_add: unsupported dtypes (", c10::toString(st), " into ",
                c10::toString(dt), ")");
  }
}

}  // namespace mpzero
