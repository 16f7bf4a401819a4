// mpzero._cpu: the multi-threaded CPU Adam/AdamW step (mpzero/kernels/cpu_adam.py).
//
// A plain CPython extension with no torch headers: the Python wrapper validates the tensors
// and passes their addresses in a table, so this file compiles in seconds and does not
// depend on torch's C++ ABI. One pass over memory: each thread takes work items of kItem
// elements (dynamic, so a descheduled thread on a shared host holds nobody up) and runs
// one loop over each, specialised for its gradient and output dtypes and master kind, so
// 16-bit values are widened, merged, split and narrowed in registers. (Staging them
// through L1 buffers instead cost 12% at one thread: a core's share of the bandwidth
// shrinks with every extra instruction between its loads.)
//
// Numerics: the reference's (mpzero/kernels/reference.py) operation by operation, each
// rounded (the build passes -ffp-contract=off so no multiply-add is fused, and no
// fast-math: division and square root are IEEE), so the result is bit for bit the
// reference's. Two shortcuts are exact: without a grad scale the gradient is multiplied by
// 1.0f, without bias correction the moments by 1.0f (x * 1 == x for every value these
// see; a signalling NaN would come out quiet, as any later operation makes it anyway).
//
// Threads: our own small pool (not torch's intra-op pool, which training ranks set to one
// thread, nor OpenMP, whose runtime would be a second copy beside torch's). The caller
// runs part of the work; a fork child starts a fresh pool.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

// x86-64 Linux: one copy of each kernel function per instruction set, picked once at load
// time (ifunc), so a distributed build needs no -march and still gets AVX2/AVX-512.
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define MPZERO_CLONES __attribute__((target_clones("default", "avx2", "avx512f")))
#else
#define MPZERO_CLONES
#endif

namespace {

constexpr int64_t kItem = 1 << 15;     // elements per work item a thread takes
constexpr int64_t kPerThread = 1 << 16;  // fewer elements than this per thread: fewer threads

struct Hyper {
  float lr, beta1, beta2, omb1, omb2, eps, wd, bc1, bc2, gs;
  int adam_w;
};

inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
// c ? a : b without a branch (GCC leaves nested ternaries of the fp16 conversions scalar).
inline uint32_t select(bool c, uint32_t a, uint32_t b) { return b ^ ((a ^ b) & (0u - c)); }

// ---- conversions, inlined into the loops below ----

#define MPZERO_INLINE __attribute__((always_inline)) inline

MPZERO_INLINE float bf16_to_f32(uint16_t x) { return float_of(uint32_t(x) << 16); }

// Exact: every fp16 value is an fp32 value.
MPZERO_INLINE float f16_to_f32(uint16_t x) {
  const uint32_t h = x;
  const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, f = h & 0x3FFu;
  const uint32_t normal = sign | ((e + 112u) << 23) | (f << 13);
  const uint32_t special = sign | 0x7F800000u | (f << 13);  // inf, NaN
  const uint32_t sub = sign | bits_of(float(f) * 5.9604644775390625e-8f);  // f * 2^-24
  return float_of(select(e == 0, sub, select(e == 31, special, normal)));
}

// Round to nearest even, NaN -> 0x7FC0: torch's float -> bfloat16 conversion.
MPZERO_INLINE uint16_t f32_to_bf16(float x) {
  const uint32_t u = bits_of(x);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return uint16_t(select((u & 0x7FFFFFFFu) > 0x7F800000u, 0x7FC0u, r));
}

// Round to nearest even, overflow to inf, NaN -> 0x7E00: torch's float -> half conversion.
MPZERO_INLINE uint16_t f32_to_f16(float x) {
  const uint32_t u = bits_of(x);
  const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
  const uint32_t t = a - 0x38000000u;  // exponent rebiased 127 -> 15 (used when normal)
  const uint32_t hn = std::min((t + 0xFFFu + ((t >> 13) & 1u)) >> 13, 0x7C00u);
  // |x| < 2^-14: adding 0.5 leaves an ulp of 2^-24, so the hardware rounds the fp16
  // subnormal's mantissa (up to 0x400, the smallest normal) into the low bits.
  const uint32_t hs = bits_of(float_of(a) + 0.5f) - 0x3F000000u;
  return uint16_t(sign | select(a > 0x7F800000u, 0x7E00u, select(a < 0x38800000u, hs, hn)));
}

// dtype codes, as mpzero/kernels/cpu_adam.py writes them
enum : int { kF32 = 0, kBF16 = 1, kF16 = 2, kNoOut = 3 };

template <int G>
MPZERO_INLINE float load_grad(const void* g, int64_t i) {
  if constexpr (G == kF32) return static_cast<const float*>(g)[i];
  else if constexpr (G == kBF16) return bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
  else return f16_to_f32(static_cast<const uint16_t*>(g)[i]);
}

// x: the new fp32 value; hi: its bf16 half when remainders made one (else unused).
template <int O>
MPZERO_INLINE void store_out(void* o, int64_t i, float x, uint16_t hi, bool rem) {
  if constexpr (O == kF32) static_cast<float*>(o)[i] = x;
  else if constexpr (O == kBF16) static_cast<uint16_t*>(o)[i] = rem ? hi : f32_to_bf16(x);
  else if constexpr (O == kF16) static_cast<uint16_t*>(o)[i] = f32_to_f16(x);
}

// ---- the update: one loop per (gradient dtype, output dtype, master kind, decay mode) ----

// p: fp32 master (REM false) or bf16 bits with r the int16 remainders (REM true, the
// rule of mpzero/kernels/precision.py on raw bits). W: AdamW's decoupled decay, else L2.
template <int G, int O, bool REM, bool W>
MPZERO_INLINE void update(void* __restrict p, uint16_t* __restrict r, const void* __restrict g,
                          float* __restrict m, float* __restrict v, void* __restrict o,
                          int64_t n, const Hyper& h) {
  const float lr = h.lr, b1 = h.beta1, b2 = h.beta2, omb1 = h.omb1, omb2 = h.omb2,
              eps = h.eps, wd = h.wd, bc1 = h.bc1, bc2 = h.bc2, gs = h.gs;
  float* pf = static_cast<float*>(p);
  uint16_t* ph = static_cast<uint16_t*>(p);
  for (int64_t i = 0; i < n; ++i) {
    float x;
    if constexpr (REM) {
      const uint32_t hi = (uint32_t(ph[i]) - (uint32_t(r[i]) >> 15)) & 0xFFFFu;
      x = float_of((hi << 16) | r[i]);
    } else {
      x = pf[i];
    }
    float gi = load_grad<G>(g, i) * gs;
    if constexpr (!W) gi = gi + wd * x;
    const float mi = b1 * m[i] + omb1 * gi;
    const float vi = b2 * v[i] + omb2 * (gi * gi);
    float u = (mi * bc1) / (__builtin_sqrtf(vi * bc2) + eps);
    if constexpr (W) u = u + wd * x;
    x = x - lr * u;
    m[i] = mi;
    v[i] = vi;
    uint16_t hi16 = 0;
    if constexpr (REM) {
      const uint32_t b = bits_of(x), lo = b & 0xFFFFu;
      hi16 = uint16_t(((b >> 16) + (lo >> 15)) & 0xFFFFu);  // +1 ulp of magnitude: ties away
      ph[i] = hi16;
      r[i] = uint16_t(lo);
    } else {
      pf[i] = x;
    }
    store_out<O>(o, i, x, hi16, REM);
  }
}

// ---- the step over a table of tensors ----

// One row per tensor, as the wrapper packs it (int64 each): addresses of p (fp32, or bf16
// with remainders), remainder (int16; 0 without), g, m, v, out (0: none), then the element
// count and the dtype codes of g and out.
struct Row {
  int64_t p, rem, g, m, v, out, numel, g_dtype, out_dtype;
};
static_assert(sizeof(Row) == 9 * sizeof(int64_t), "Row is the wrapper's 9 int64 columns");

// dst[0, bytes) = src[0, bytes) with streaming stores where x86-64 has them (SSE2, the
// baseline): the output is written only, so this spares reading its lines in first.
MPZERO_INLINE void stream_copy(void* dst, const void* src, int64_t bytes) {
#if defined(__x86_64__)
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const int64_t head =
      std::min<int64_t>(bytes, (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15);
  std::memcpy(d, s, head);
  int64_t i = head;
  for (; i + 16 <= bytes; i += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
  }
  std::memcpy(d + i, s + i, bytes - i);
#else
  std::memcpy(dst, src, bytes);
#endif
}

template <int G, int O, bool REM>
MPZERO_INLINE void run_range(const Row& r, int64_t b, int64_t n, const Hyper& h) {
  constexpr int64_t ps = REM ? 2 : 4, gs = G == kF32 ? 4 : 2, os = O == kF32 ? 4 : 2;
  char* p = reinterpret_cast<char*>(r.p) + b * ps;
  uint16_t* rem = REM ? reinterpret_cast<uint16_t*>(r.rem) + b : nullptr;
  const char* g = reinterpret_cast<const char*>(r.g) + b * gs;
  float* m = reinterpret_cast<float*>(r.m) + b;
  float* v = reinterpret_cast<float*>(r.v) + b;
  if constexpr (O == kNoOut) {
    if (h.adam_w) update<G, O, REM, true>(p, rem, g, m, v, nullptr, n, h);
    else update<G, O, REM, false>(p, rem, g, m, v, nullptr, n, h);
  } else {
    constexpr int64_t kSub = 1024;
    alignas(64) unsigned char buf[kSub * os];  // storage for the output's kSub values
    char* o = reinterpret_cast<char*>(r.out) + b * os;
    for (int64_t j = 0; j < n; j += kSub) {
      const int64_t k = std::min(kSub, n - j);
      uint16_t* rj = REM ? rem + j : nullptr;
      if (h.adam_w) update<G, O, REM, true>(p + j * ps, rj, g + j * gs, m + j, v + j, buf, k, h);
      else update<G, O, REM, false>(p + j * ps, rj, g + j * gs, m + j, v + j, buf, k, h);
      stream_copy(o + j * os, buf, k * os);
    }
  }
}

// Elements [b, b + n) of row r; one function per dtype combination, each cloned per
// instruction set (the loops are inlined into the clones and vectorized there).
using Kernel = void (*)(const Row&, int64_t, int64_t, const Hyper&);

#define DEFINE_KERNEL(NAME, G, O, REM)                                        \
  MPZERO_CLONES void NAME(const Row& r, int64_t b, int64_t n, const Hyper& h) { \
    run_range<G, O, REM>(r, b, n, h);                                         \
  }
#define DEFINE_OUTS(PREFIX, G, REM)              \
  DEFINE_KERNEL(PREFIX##_f32, G, kF32, REM)      \
  DEFINE_KERNEL(PREFIX##_bf16, G, kBF16, REM)    \
  DEFINE_KERNEL(PREFIX##_f16, G, kF16, REM)      \
  DEFINE_KERNEL(PREFIX##_none, G, kNoOut, REM)
DEFINE_OUTS(plain_g32, kF32, false)
DEFINE_OUTS(plain_gbf16, kBF16, false)
DEFINE_OUTS(plain_gf16, kF16, false)
DEFINE_OUTS(rem_g32, kF32, true)
DEFINE_OUTS(rem_gbf16, kBF16, true)
DEFINE_OUTS(rem_gf16, kF16, true)
#undef DEFINE_OUTS
#undef DEFINE_KERNEL

#define OUTS(PREFIX) {PREFIX##_f32, PREFIX##_bf16, PREFIX##_f16, PREFIX##_none}
// [remainders][gradient dtype][output dtype]
const Kernel kKernels[2][3][4] = {{OUTS(plain_g32), OUTS(plain_gbf16), OUTS(plain_gf16)},
                                  {OUTS(rem_g32), OUTS(rem_gbf16), OUTS(rem_gf16)}};
#undef OUTS

struct Item {
  int64_t row, begin, end;
};

struct Job {
  const Row* rows;
  std::vector<Item> items;
  std::atomic<int64_t> next{0};
  Hyper h;
  bool remainders;
};

// Work items of kItem elements over the rows' elements, and how many threads they are
// worth (at most `threads`; fewer than kPerThread elements a thread use fewer).
template <class R>
int plan_items(const R* rows, int64_t n_rows, std::vector<Item>& items, int threads) {
  int64_t total = 0;
  for (int64_t i = 0; i < n_rows; ++i) {
    const int64_t n = rows[i].numel;
    total += n;
    for (int64_t b = 0; b < n; b += kItem) items.push_back({i, b, std::min(n, b + kItem)});
  }
  const int64_t most = std::max<int64_t>(1, total / kPerThread);
  return static_cast<int>(std::min<int64_t>(std::max(threads, 1), most));
}

void run_item(const Job& job, const Item& it) {
  const Row& r = job.rows[it.row];
  kKernels[job.remainders][r.g_dtype][r.out_dtype](r, it.begin, it.end - it.begin, job.h);
}

void work(void* arg, int) {
  Job& job = *static_cast<Job*>(arg);
  const int64_t total = static_cast<int64_t>(job.items.size());
  for (;;) {
    const int64_t k = job.next.fetch_add(1, std::memory_order_relaxed);
    if (k >= total) break;
    run_item(job, job.items[k]);
  }
#if defined(__x86_64__)
  _mm_sfence();  // the streaming stores are weakly ordered: complete before we report done
#endif
}

// A fixed set of workers that sleep between runs; run(n, fn, arg) calls fn(arg, i) for i in
// [0, n), i = 0 on the caller's thread, and returns when all are done.
class Pool {
 public:
  void run(int n, void (*fn)(void*, int), void* arg) {
    std::lock_guard<std::mutex> one_run(run_mu_);  // callers on several Python threads
    if (n > 1) {
      std::unique_lock<std::mutex> lk(mu_);
      while (static_cast<int>(workers_) < n - 1) {
        const int id = static_cast<int>(++workers_);
        std::thread(&Pool::loop, this, id, gen_).detach();  // never joined: lives with us
      }
      fn_ = fn;
      arg_ = arg;
      active_ = n;
      remaining_ = n - 1;
      ++gen_;
      lk.unlock();
      start_.notify_all();
    }
    fn(arg, 0);
    if (n > 1) {
      std::unique_lock<std::mutex> lk(mu_);
      done_.wait(lk, [&] { return remaining_ == 0; });
    }
  }

 private:
  void loop(int id, uint64_t seen) {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      start_.wait(lk, [&] { return gen_ != seen; });
      seen = gen_;
      if (id >= active_) continue;
      auto fn = fn_;
      void* arg = arg_;
      lk.unlock();
      fn(arg, id);
      lk.lock();
      if (--remaining_ == 0) done_.notify_one();
    }
  }

  std::mutex run_mu_, mu_;
  std::condition_variable start_, done_;
  size_t workers_ = 0;
  uint64_t gen_ = 0;
  int active_ = 0, remaining_ = 0;
  void (*fn_)(void*, int) = nullptr;
  void* arg_ = nullptr;
};

// Never destroyed (detached workers may still wait on it at exit); a fork child, which has
// none of the parent's workers, gets a fresh one.
Pool* g_pool = nullptr;
std::once_flag g_pool_once;

Pool& pool() {
  std::call_once(g_pool_once, [] {
    g_pool = new Pool();
    pthread_atfork(nullptr, nullptr, [] { g_pool = new Pool(); });
  });
  return *g_pool;
}

// ---- remainders with bf16 moments, one fp32 scale per piece (with_scaled_states) ----
//
// The fp32 moments are bf16 * scale. A new scale needs the absmax of the piece's new
// moments, so two passes: the first computes the new moments and their absmax per piece
// (writing nothing), the second computes them again, bit for bit the same, and writes them
// over the new scale, and the master. The torch path it replaces (ScaledStates.unscaled,
// adam_remainders, ScaledStates.store) rounds every operation alike, so both give the
// same bits; it reads and writes ~3x the bytes.

// One row per piece (int64 each): addresses of the bf16 halves, int16 remainders, g, bf16
// m, bf16 v, the element count, g's dtype code, the piece's index in the scale arrays.
struct SRow {
  int64_t p, rem, g, m, v, numel, g_dtype, piece;
};
static_assert(sizeof(SRow) == 8 * sizeof(int64_t), "SRow is the wrapper's 8 int64 columns");

struct ScaledJob {
  const SRow* rows;
  std::vector<Item> items;
  std::atomic<int64_t> next{0};
  Hyper h;
  const float *ms, *vs;                 // the scales the moments are stored with
  const float *ms_new, *vs_new;         // pass 2: the scales to store them with
  std::atomic<uint32_t> *m_max, *v_max;  // pass 1: per piece, bits of the absmax
  int pass;
};

// The new master and moments of element i (the update of `update` above, from bf16 moments).
template <int G, bool W>
MPZERO_INLINE void scaled_element(const uint16_t* __restrict ph, const uint16_t* __restrict r,
                                  const void* __restrict g, const uint16_t* __restrict m,
                                  const uint16_t* __restrict v, int64_t i, float ms, float vs,
                                  const Hyper& h, float& x, float& mi, float& vi) {
  const uint32_t hi = (uint32_t(ph[i]) - (uint32_t(r[i]) >> 15)) & 0xFFFFu;
  x = float_of((hi << 16) | r[i]);
  float gi = load_grad<G>(g, i) * h.gs;
  if constexpr (!W) gi = gi + h.wd * x;
  mi = h.beta1 * (bf16_to_f32(m[i]) * ms) + h.omb1 * gi;
  vi = h.beta2 * (bf16_to_f32(v[i]) * vs) + h.omb2 * (gi * gi);
}

template <int G, bool W>
MPZERO_INLINE void scaled_range(const SRow& row, int64_t b, int64_t n, ScaledJob& job) {
  const Hyper& h = job.h;
  uint16_t* ph = reinterpret_cast<uint16_t*>(row.p) + b;
  uint16_t* r = reinterpret_cast<uint16_t*>(row.rem) + b;
  const char* g = reinterpret_cast<const char*>(row.g) + b * (G == kF32 ? 4 : 2);
  uint16_t* m = reinterpret_cast<uint16_t*>(row.m) + b;
  uint16_t* v = reinterpret_cast<uint16_t*>(row.v) + b;
  const float ms = job.ms[row.piece], vs = job.vs[row.piece];
  float x, mi, vi;
  if (job.pass == 1) {
    float mmax = 0.0f, vmax = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      scaled_element<G, W>(ph, r, g, m, v, i, ms, vs, h, x, mi, vi);
      // As bits: non-negative floats order as integers, and a NaN wins, as in torch.
      mmax = float_of(std::max(bits_of(mmax), bits_of(mi) & 0x7FFFFFFFu));
      vmax = float_of(std::max(bits_of(vmax), bits_of(vi) & 0x7FFFFFFFu));
    }
    std::atomic<uint32_t>& am = job.m_max[row.piece];
    std::atomic<uint32_t>& av = job.v_max[row.piece];
    uint32_t seen = am.load(std::memory_order_relaxed);
    while (bits_of(mmax) > seen && !am.compare_exchange_weak(seen, bits_of(mmax))) {
    }
    seen = av.load(std::memory_order_relaxed);
    while (bits_of(vmax) > seen && !av.compare_exchange_weak(seen, bits_of(vmax))) {
    }
    return;
  }
  const float msn = job.ms_new[row.piece], vsn = job.vs_new[row.piece];
  for (int64_t i = 0; i < n; ++i) {
    scaled_element<G, W>(ph, r, g, m, v, i, ms, vs, h, x, mi, vi);
    float u = (mi * h.bc1) / (__builtin_sqrtf(vi * h.bc2) + h.eps);
    if constexpr (W) u = u + h.wd * x;
    x = x - h.lr * u;
    const uint32_t bits = bits_of(x), lo = bits & 0xFFFFu;
    ph[i] = uint16_t(((bits >> 16) + (lo >> 15)) & 0xFFFFu);
    r[i] = uint16_t(lo);
    m[i] = f32_to_bf16(mi / msn);
    v[i] = f32_to_bf16(vi / vsn);
  }
}

using SKernel = void (*)(const SRow&, int64_t, int64_t, ScaledJob&);
#define DEFINE_SCALED(NAME, G, W)                                               \
  MPZERO_CLONES void NAME(const SRow& r, int64_t b, int64_t n, ScaledJob& job) { \
    scaled_range<G, W>(r, b, n, job);                                           \
  }
DEFINE_SCALED(scaled_g32_l2, kF32, false)
DEFINE_SCALED(scaled_g32_w, kF32, true)
DEFINE_SCALED(scaled_gbf16_l2, kBF16, false)
DEFINE_SCALED(scaled_gbf16_w, kBF16, true)
DEFINE_SCALED(scaled_gf16_l2, kF16, false)
DEFINE_SCALED(scaled_gf16_w, kF16, true)
#undef DEFINE_SCALED
// [gradient dtype][decoupled decay]
const SKernel kScaled[3][2] = {{scaled_g32_l2, scaled_g32_w},
                               {scaled_gbf16_l2, scaled_gbf16_w},
                               {scaled_gf16_l2, scaled_gf16_w}};

void scaled_work(void* arg, int) {
  ScaledJob& job = *static_cast<ScaledJob*>(arg);
  const int64_t total = static_cast<int64_t>(job.items.size());
  for (;;) {
    const int64_t k = job.next.fetch_add(1, std::memory_order_relaxed);
    if (k >= total) break;
    const Item& it = job.items[k];
    const SRow& r = job.rows[it.row];
    kScaled[r.g_dtype][job.h.adam_w != 0](r, it.begin, it.end - it.begin, job);
  }
}

// adam_scaled(table, m_scales, v_scales, half_max, lr, beta1, beta2, omb1, omb2, eps, wd,
//             bc1, bc2, grad_scale, adam_w_mode, threads): the scale buffers (fp32, one per
// piece of the whole shard) are read and then overwritten with the new scales of the
// table's pieces: absmax / half_max, at least fp32's smallest normal; 1 for an absmax
// that is 0 (or NaN).
PyObject* py_adam_scaled(PyObject*, PyObject* args) {
  Py_buffer table, mbuf, vbuf;
  int adam_w, threads;
  float half_max;
  Hyper h{};
  if (!PyArg_ParseTuple(args, "y*w*w*fffffffffffpi", &table, &mbuf, &vbuf, &half_max, &h.lr,
                        &h.beta1, &h.beta2, &h.omb1, &h.omb2, &h.eps, &h.wd, &h.bc1, &h.bc2,
                        &h.gs, &adam_w, &threads))
    return nullptr;
  h.adam_w = adam_w;
  const int64_t pieces = mbuf.len / static_cast<Py_ssize_t>(sizeof(float));
  const int64_t rows = table.len / static_cast<Py_ssize_t>(sizeof(SRow));
  const SRow* row = static_cast<const SRow*>(table.buf);
  bool ok = table.len % static_cast<Py_ssize_t>(sizeof(SRow)) == 0 && vbuf.len == mbuf.len;
  for (int64_t i = 0; ok && i < rows; ++i) ok = row[i].piece >= 0 && row[i].piece < pieces;
  if (!ok) {
    PyBuffer_Release(&table);
    PyBuffer_Release(&mbuf);
    PyBuffer_Release(&vbuf);
    PyErr_SetString(PyExc_ValueError,
                    "mpzero._cpu.adam_scaled: rows of 8 int64 with pieces inside the scales");
    return nullptr;
  }
  float* mscale = static_cast<float*>(mbuf.buf);
  float* vscale = static_cast<float*>(vbuf.buf);
  std::vector<float> ms(mscale, mscale + pieces), vs(vscale, vscale + pieces);
  std::vector<std::atomic<uint32_t>> m_max(pieces), v_max(pieces);
  for (int64_t j = 0; j < pieces; ++j) {
    m_max[j].store(0);
    v_max[j].store(0);
  }
  ScaledJob job;
  job.rows = row;
  job.h = h;
  job.ms = ms.data();
  job.vs = vs.data();
  job.m_max = m_max.data();
  job.v_max = v_max.data();
  const int n_threads = plan_items(row, rows, job.items, threads);
  Py_BEGIN_ALLOW_THREADS
  job.pass = 1;
  pool().run(n_threads, scaled_work, &job);
  for (int64_t i = 0; i < rows; ++i) {  // the new scales of the table's pieces
    const int64_t j = row[i].piece;
    for (int k = 0; k < 2; ++k) {
      const float a = float_of((k == 0 ? m_max : v_max)[j].load());
      const float q = a / half_max;
      (k == 0 ? mscale : vscale)[j] = a > 0.0f ? std::max(q, 1.17549435e-38f) : 1.0f;
    }
  }
  job.ms_new = mscale;
  job.vs_new = vscale;
  job.next.store(0);
  job.pass = 2;
  pool().run(n_threads, scaled_work, &job);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&table);
  PyBuffer_Release(&mbuf);
  PyBuffer_Release(&vbuf);
  Py_RETURN_NONE;
}

// adam(table, remainders, lr, beta1, beta2, omb1, omb2, eps, wd, bc1, bc2, grad_scale,
//      adam_w_mode, threads)
PyObject* py_adam(PyObject*, PyObject* args) {
  Py_buffer table;
  int remainders, adam_w, threads;
  Hyper h{};
  if (!PyArg_ParseTuple(args, "y*pffffffffffpi", &table, &remainders, &h.lr, &h.beta1,
                        &h.beta2, &h.omb1, &h.omb2, &h.eps, &h.wd, &h.bc1, &h.bc2, &h.gs,
                        &adam_w, &threads))
    return nullptr;
  h.adam_w = adam_w;
  if (table.len % static_cast<Py_ssize_t>(sizeof(Row)) != 0) {
    PyBuffer_Release(&table);
    PyErr_SetString(PyExc_ValueError, "mpzero._cpu.adam: the table must be rows of 9 int64");
    return nullptr;
  }
  Job job;
  job.rows = static_cast<const Row*>(table.buf);
  job.h = h;
  job.remainders = remainders != 0;
  const int64_t rows = table.len / static_cast<Py_ssize_t>(sizeof(Row));
  const int n_threads = plan_items(job.rows, rows, job.items, threads);
  Py_BEGIN_ALLOW_THREADS
  pool().run(n_threads, work, &job);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&table);
  Py_RETURN_NONE;
}

// copy(dst, src, nbytes, threads): memcpy on the pool, in items of 1 MiB. The bench's
// floor: the copy rate the host gives the same threads, scheduled as the step is.
struct CopyJob {
  char* dst;
  const char* src;
  int64_t bytes;
  std::atomic<int64_t> next{0};
};
constexpr int64_t kCopyItem = 1 << 20;

void copy_work(void* arg, int) {
  CopyJob& job = *static_cast<CopyJob*>(arg);
  for (;;) {
    const int64_t at = job.next.fetch_add(1, std::memory_order_relaxed) * kCopyItem;
    if (at >= job.bytes) return;
    std::memcpy(job.dst + at, job.src + at, std::min(kCopyItem, job.bytes - at));
  }
}

PyObject* py_copy(PyObject*, PyObject* args) {
  long long dst, src, bytes;
  int threads;
  if (!PyArg_ParseTuple(args, "LLLi", &dst, &src, &bytes, &threads)) return nullptr;
  CopyJob job;
  job.dst = reinterpret_cast<char*>(dst);
  job.src = reinterpret_cast<const char*>(src);
  job.bytes = bytes;
  const int64_t most = std::max<int64_t>(1, bytes / (4 * kCopyItem));
  const int n_threads = static_cast<int>(std::min<int64_t>(std::max(threads, 1), most));
  Py_BEGIN_ALLOW_THREADS
  pool().run(n_threads, copy_work, &job);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

// stream(p, g, m, v, n, threads): p += g, m += g, v += g over n fp32 elements on the pool,
// in the step's work items: the step's memory traffic (4 streams read, 3 written back in
// place) with next to no arithmetic. The bench's second floor.
struct StreamJob {
  float *p, *m, *v;
  const float* g;
  int64_t n;
  std::atomic<int64_t> next{0};
};

MPZERO_CLONES void stream_item(float* __restrict p, const float* __restrict g,
                               float* __restrict m, float* __restrict v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    p[i] += gi;
    m[i] += gi;
    v[i] += gi;
  }
}

void stream_work(void* arg, int) {
  StreamJob& job = *static_cast<StreamJob*>(arg);
  for (;;) {
    const int64_t at = job.next.fetch_add(1, std::memory_order_relaxed) * kItem;
    if (at >= job.n) return;
    const int64_t k = std::min(kItem, job.n - at);
    stream_item(job.p + at, job.g + at, job.m + at, job.v + at, k);
  }
}

PyObject* py_stream(PyObject*, PyObject* args) {
  long long p, g, m, v, n;
  int threads;
  if (!PyArg_ParseTuple(args, "LLLLLi", &p, &g, &m, &v, &n, &threads)) return nullptr;
  StreamJob job;
  job.p = reinterpret_cast<float*>(p);
  job.g = reinterpret_cast<const float*>(g);
  job.m = reinterpret_cast<float*>(m);
  job.v = reinterpret_cast<float*>(v);
  job.n = n;
  const int64_t most = std::max<int64_t>(1, n / kPerThread);
  const int n_threads = static_cast<int>(std::min<int64_t>(std::max(threads, 1), most));
  Py_BEGIN_ALLOW_THREADS
  pool().run(n_threads, stream_work, &job);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"stream", py_stream, METH_VARARGS,
     "stream(p, g, m, v, n, threads): p, m, v += g over fp32 addresses (the step's traffic)"},
    {"copy", py_copy, METH_VARARGS,
     "copy(dst_address, src_address, nbytes, threads): memcpy on the step's thread pool"},
    {"adam", py_adam, METH_VARARGS,
     "Adam/AdamW over a table of tensor addresses (see mpzero/kernels/cpu_adam.py)"},
    {"adam_scaled", py_adam_scaled, METH_VARARGS,
     "Adam/AdamW on remainders with bf16 moments scaled per piece (cpu_adam.py)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "mpzero._cpu",
                      "mpzero's multi-threaded CPU Adam step", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__cpu(void) { return PyModule_Create(&module); }
