// Host AdamW in one pass over fp32 slabs, in place or into other buffers (a speculative update's copies).
//
// Why: torch's fused CPU kernel works in place, so an update into copies was a copy and then the kernel:
// about half the in-place rate (bench/results/2026-11-22-H200-host-adam-out-of-place.md). Here the new
// master and moments are computed from the old ones and stored once. Lines that are only written (the state
// into other buffers, the bf16 copy) take non-temporal stores where asked (`stores`): no read for
// ownership, so an update into copies moves the bytes of one in place, 16 read and 12 written per
// parameter, and the copy 2 more. Threads take pieces of the range one at a time (see adamw()). Where
// asked, each block prefetches the inputs some blocks ahead: the cores' own prefetchers stop at 4 KiB pages.
//
// The arithmetic is torch.optim.AdamW's (decoupled weight decay, bias correction, the gradient divided by
// grad_scale when given), one IEEE operation at a time: built with -ffp-contract=off, so a parameter gets
// the same bits whether a vector lane or the scalar tail computes it, in place or not.
// ATen's tensor and torch's pybind11 casters, not torch/extension.h: the build parses a fifth of the headers
// (about 20 s instead of 45 s on two cores, once per machine)
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 64;  // elements: four cache lines of each array
constexpr int64_t LINE = 64;   // bytes
constexpr int64_t PIECE = 1 << 16;  // elements a thread takes at a time: 256 KiB of each fp32 array
constexpr int64_t STREAM_STATE = 1, STREAM_COPY = 2;  // `stores`: which outputs take streamed stores
constexpr int64_t PREFETCH_SHIFT = 8;  // `stores` >> 8: software prefetch distance in blocks (0: none; optim.kernel.AHEAD)

inline uint16_t bf16(float f) {  // round to nearest even, as c10::BFloat16 (NaN: the quiet NaN)
  if (std::isnan(f)) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return uint16_t((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

struct Coef {
  float lr_wd, one_minus_b1, b2, one_minus_b2, step_size, bc2_sqrt, eps, scale;
  bool decay, scaled;
};

inline void compute(const float* p, const float* g, const float* m, const float* v, float* po, float* mo,
                    float* vo, uint16_t* w, int64_t n, const Coef& c) {
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    float gi = c.scaled ? g[i] / c.scale : g[i];
    float pi = c.decay ? p[i] - p[i] * c.lr_wd : p[i];
    float mi = m[i] + c.one_minus_b1 * (gi - m[i]);  // lerp(m, g, 1 - beta1): the weight is below 0.5
    float vi = v[i] * c.b2 + gi * gi * c.one_minus_b2;
    float denom = std::sqrt(vi) / c.bc2_sqrt + c.eps;
    float pn = pi - c.step_size * mi / denom;
    po[i] = pn;
    mo[i] = mi;
    vo[i] = vi;
    if (w) w[i] = bf16(pn);
  }
}

inline void stream_out(float* dst, const float* src) {  // BLOCK floats, dst LINE-aligned
#if defined(__AVX512F__)
  for (int64_t i = 0; i < BLOCK; i += 16) _mm512_stream_ps(dst + i, _mm512_load_ps(src + i));
#elif defined(__AVX__)
  for (int64_t i = 0; i < BLOCK; i += 8) _mm256_stream_ps(dst + i, _mm256_load_ps(src + i));
#else
  std::memcpy(dst, src, BLOCK * sizeof(float));
#endif
}

inline void stream_out(uint16_t* dst, const uint16_t* src) {  // BLOCK bf16, dst LINE-aligned
#if defined(__AVX512F__)
  for (int64_t i = 0; i < BLOCK; i += 32)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_load_si512(src + i));
#elif defined(__AVX__)
  for (int64_t i = 0; i < BLOCK; i += 16)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_load_si256(reinterpret_cast<const __m256i*>(src + i)));
#else
  std::memcpy(dst, src, BLOCK * sizeof(uint16_t));
#endif
}

// elements up to the first LINE-aligned one
template <typename T>
inline int64_t to_line(const T* x) {
  return int64_t((LINE - reinterpret_cast<uintptr_t>(x) % LINE) % LINE / sizeof(T));
}

// state: stream the new master and moments (into other buffers); copy: stream the bf16 copy. Both need
// their first aligned elements to coincide (the caller checks).
void range(const float* p, const float* g, const float* m, const float* v, float* po, float* mo, float* vo,
           uint16_t* w, int64_t n, const Coef& c, bool state, bool copy, int64_t ahead) {
  if (!state && !copy && !ahead) return compute(p, g, m, v, po, mo, vo, w, n, c);
  // up to the first aligned line, then whole blocks streamed, then the tail
  int64_t head = std::min(copy ? to_line(w) : to_line(po), n);
  compute(p, g, m, v, po, mo, vo, w, head, c);
  int64_t i = head;
  alignas(LINE) float tp[BLOCK], tm[BLOCK], tv[BLOCK];
  alignas(LINE) uint16_t tw[BLOCK];
  for (; i + BLOCK <= n; i += BLOCK) {
#if defined(__AVX__)
    if (ahead && i + ahead < n)
      for (int64_t l = 0; l < BLOCK; l += LINE / 4)
        for (const float* x : {p, g, m, v}) _mm_prefetch(reinterpret_cast<const char*>(x + i + ahead + l), _MM_HINT_T0);
#endif
    compute(p + i, g + i, m + i, v + i, state ? tp : po + i, state ? tm : mo + i, state ? tv : vo + i,
            copy ? tw : w ? w + i : nullptr, BLOCK, c);
    if (state) {
      stream_out(po + i, tp);
      stream_out(mo + i, tm);
      stream_out(vo + i, tv);
    }
    if (copy) stream_out(w + i, tw);
  }
  compute(p + i, g + i, m + i, v + i, po + i, mo + i, vo + i, w ? w + i : nullptr, n - i, c);
#if defined(__AVX__)
  _mm_sfence();  // the streamed stores are visible before the update counts as done
#endif
}

void check(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              " must be a contiguous fp32 CPU tensor");
  TORCH_CHECK(t.numel() == like.numel(), name, " has ", t.numel(), " elements, the master ", like.numel());
}

}  // namespace

// master, grad, exp_avg, exp_avg_sq: the state read; *_out: where the new master and moments go (the
// same tensors for in place); w: the bf16 copy of the new master, rounded in the same pass (empty: none).
// step: the step number (bias correction); grad_scale 0: none; stores: STREAM_STATE | STREAM_COPY, which
// outputs are written with streamed (non-temporal) stores where their alignment allows, and above bit
// PREFETCH_SHIFT how many blocks ahead the inputs are prefetched.
void adamw(at::Tensor p, at::Tensor g, at::Tensor m, at::Tensor v, at::Tensor po, at::Tensor mo,
           at::Tensor vo, at::Tensor w, double lr, double beta1, double beta2, double weight_decay, double eps, double step,
           double grad_scale, int64_t stores) {
  for (auto [t, name] : {std::pair{g, "grad"}, {m, "exp_avg"}, {v, "exp_avg_sq"}, {po, "master out"},
                         {mo, "exp_avg out"}, {vo, "exp_avg_sq out"}, {p, "master"}})
    check(t, p, name);
  const bool copy = w.numel() > 0;
  TORCH_CHECK(!copy || (w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.is_contiguous() &&
                        w.numel() == p.numel()), "the copy must be a contiguous bf16 CPU tensor the master's size");
  // the scalars as torch's fused kernel makes them: in double, then rounded to float
  double bc1 = 1 - std::pow(beta1, step), bc2 = 1 - std::pow(beta2, step);
  Coef c{float(lr * weight_decay), float(1 - beta1), float(beta2), float(1 - beta2), float(lr / bc1),
         float(std::sqrt(bc2)), float(eps), float(grad_scale), weight_decay != 0, grad_scale != 0};
  const bool in_place = po.data_ptr() == p.data_ptr();
  TORCH_CHECK(in_place == (mo.data_ptr() == m.data_ptr()) && in_place == (vo.data_ptr() == v.data_ptr()),
              "the master and moments go all in place or all elsewhere");
  auto off = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % LINE; };
  // streamed stores where asked and possible: the state only into other buffers (in place, its lines
  // were just read), each at the same offset in its line, and the copy's first aligned element theirs
  bool state = (stores & STREAM_STATE) && !in_place && off(po) == off(mo) && off(po) == off(vo);
  bool stream_copy = (stores & STREAM_COPY) && copy;
  if (state && stream_copy && off(w) / 2 % (LINE / 4) != off(po) / 4) stream_copy = false;
  const float *pp = p.data_ptr<float>(), *gp = g.data_ptr<float>(), *mp = m.data_ptr<float>(),
              *vp = v.data_ptr<float>();
  float *pop = po.data_ptr<float>(), *mop = mo.data_ptr<float>(), *vop = vo.data_ptr<float>();
  uint16_t* wp = copy ? reinterpret_cast<uint16_t*>(w.data_ptr()) : nullptr;
  // pieces handed out one at a time rather than an even split: a thread the scheduler parks (the
  // main thread launching GPU work, a copy thread) delays one piece, not the whole call
  const int64_t ahead = (stores >> PREFETCH_SHIFT) * BLOCK;
  const int64_t n = p.numel(), pieces = (n + PIECE - 1) / PIECE;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), pieces), 1, [&](int64_t, int64_t) {
    for (int64_t k; (k = next.fetch_add(1, std::memory_order_relaxed)) < pieces;) {
      int64_t a = k * PIECE, len = std::min(PIECE, n - a);
      range(pp + a, gp + a, mp + a, vp + a, pop + a, mop + a, vop + a, wp ? wp + a : nullptr, len, c, state,
            stream_copy, ahead);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  // without the GIL: the optimizer's worker thread runs it while the main thread launches GPU work
  mod.def("adamw", &adamw, "AdamW over fp32 slabs, in place or into other buffers",
          py::call_guard<py::gil_scoped_release>());
}
