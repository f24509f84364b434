// This project's CPU kernels (why by hand: eval/kernels.py), one source for three instruction sets (below:
// AVX2, AVX512-BF16, and AMX for the matmul on top of AVX512-BF16).
// The matmul: y[M, N] = x[M, K] @ W[N, K]^T (+ b) in bf16 with fp32 accumulation. W is packed once
// (`pack`) so that one 64-byte load holds 16 output rows x 2 consecutive k; on AVX512-BF16 `vdpbf16ps`
// against a broadcast pair of x accumulates 16 outputs at once, on AVX2 the pair is widened to fp32 and
// two FMAs do it. No horizontal sums, and W is streamed once whatever M is. The sum for each output runs
// over k in the same order for every M, so a row's result does not depend on how many other rows share
// the call (a verify forward rounds like a one-token step).
// Narrow headers, not <torch/extension.h>: parsing that took 48 s of a 66 s cold build (docs/reference/kernels.md).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <ATen/TensorOperators.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// One source, two instruction sets: eval/kernels.py builds it once per CPU path, with -mavx512bf16 for
// "avx512-bf16" and with -mavx2 -mfma for "avx2" (which also runs on AVX-512 machines, so both paths
// are built and tested on either kind of CPU). `vf` is 16 floats: one __m512, or two __m256 on AVX2.
// Everything below the matmuls is written against `vf`; on AVX-512 each helper is the one intrinsic the
// kernels used before, so that path's numbers are unchanged. Each path is row-invariant on its own; the
// two differ in their last bits (dot-product instruction against two FMAs, the reduction trees).
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define DS_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define DS_AVX512 0
#else
#error "small_gemm.cpp needs -mavx512f -mavx512bw -mavx512vl -mavx512bf16, or -mavx2 -mfma (eval/kernels.py)"
#endif
// The "amx-bf16" path adds -mamx-tile -mamx-bf16: the bf16 matmul then runs on AMX tiles (below).
#if DS_AVX512 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define DS_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define DS_AMX 0
#endif

static inline float bf2f(uint16_t v) {
  uint32_t u = (uint32_t)v << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t f2bf(float f) {  // round to nearest even, as c10::BFloat16 (NaN kept a NaN)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// Scratch memory reused across calls on the calling thread, instead of malloc: in a process whose heap
// is fragmented (the distill's, after generate and train), glibc's malloc made a 13-row verify 1.6x
// slower while a one-token step kept its speed (docs/reference/verify-cost.md, "In the distill's own
// process"). `grown` keeps a thread's buffer at the largest size asked for, up to SCRATCH_MAX_BYTES; a
// larger request (a prefill's) goes to `big`, the caller's, freed with it, so no thread keeps it for life.
#ifndef SCRATCH_MAX_BYTES
#define SCRATCH_MAX_BYTES (16 << 20)
#endif
template <class T>
static T* grown(std::vector<T>& v, size_t n, std::vector<T>* big = nullptr) {
  if (big && n * sizeof(T) > SCRATCH_MAX_BYTES) {
    big->resize(n);
    return big->data();
  }
  if (v.size() < n) v.resize(n);
  return v.data();
}

// A layer's intermediates: while a Scratch is open on this thread, `fresh` carves outputs out of one reused
// buffer (64-byte aligned pieces) instead of allocating; they must not outlive it. Outside one, `fresh` is
// at::empty. Forwards larger than SCRATCH_MAX_BYTES (prefills) allocate as before.
struct Arena {
  std::vector<char> buf;
  size_t used = 0, cap = 0;
  bool on = false;
};
static thread_local Arena arena;

struct Scratch {
  explicit Scratch(size_t bytes) {
    if (arena.on || bytes > SCRATCH_MAX_BYTES) return;  // nested or too large: malloc as before
    grown(arena.buf, bytes + 64);
    arena.used = 0, arena.cap = bytes, arena.on = owner = true;
  }
  void close() { if (owner) arena.on = false, owner = false; }
  ~Scratch() { close(); }
  bool owner = false;
};

static at::Tensor fresh(at::IntArrayRef sizes, const at::TensorOptions& o) {
  if (!arena.on) return at::empty(sizes, o);
  int64_t n = 1;
  for (auto d : sizes) n *= d;
  const size_t bytes = (n * o.dtype().itemsize() + 63) / 64 * 64;
  const size_t base = (64 - (size_t)arena.buf.data() % 64) % 64;
  if (arena.used + bytes > arena.cap) return at::empty(sizes, o);  // a size the caller did not plan for
  void* p = arena.buf.data() + base + arena.used;
  arena.used += bytes;
  return at::from_blob(p, sizes, o);
}

#if DS_AVX512
using vf = __m512;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vset(float a) { return _mm512_set1_ps(a); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vabs(vf a) { return _mm512_abs_ps(a); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
static inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vscale2(vf p, vf n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral
static inline __mmask16 first(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }
static inline vf vload_n(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first(n), p); }  // lanes >= n: 0
static inline void vstore_n(float* p, vf v, int64_t n) { _mm512_mask_storeu_ps(p, first(n), v); }
static inline vf vkeep_n(vf v, int64_t n) { return _mm512_maskz_mov_ps(first(n), v); }  // lanes >= n: 0
static inline vf vmul_where_neg(vf g, vf e) {  // g * e where g < 0, else g
  return _mm512_mask_mul_ps(g, _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), g, e);
}
static inline vf bf16x16_load(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline void bf16x16_store(uint16_t* p, vf v) {  // vcvtneps2bf16: round to nearest even
  _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v));
}
static inline vf bf16_round(vf v) {  // v rounded to bf16 (nearest even) and widened back
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
// [sum(a), sum(b), sum(c), sum(d)] over 16 lanes each, by one fixed tree whatever the inputs.
static inline __m128 sum4(vf a, vf b, vf c, vf d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 x = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));  // [a b c d] per 128-bit lane
  const __m256 y = _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}
#else
struct vf { __m256 lo, hi; };  // lanes 0-7, 8-15
static inline vf vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vf vset(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
static inline vf vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
#define DS_V2(name, op) \
  static inline vf name(vf a, vf b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
DS_V2(vadd, _mm256_add_ps)
DS_V2(vsub, _mm256_sub_ps)
DS_V2(vmul, _mm256_mul_ps)
DS_V2(vdiv, _mm256_div_ps)
DS_V2(vmax, _mm256_max_ps)
#undef DS_V2
static inline vf vabs(vf a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
static inline vf vfma(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
static inline vf vfnma(vf a, vf b, vf c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
static inline float hsum8(__m256 v) {  // one fixed tree: halves, then pairs, then the last two
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline float vsum(vf a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
static inline vf vround(vf a) {
  constexpr int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, R), _mm256_round_ps(a.hi, R)};
}
static inline __m256 pow2i(__m256 n) {  // 2^n for integral n in [-126, 127], built in the exponent field
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vf vscale2(vf p, vf n) { return {_mm256_mul_ps(p.lo, pow2i(n.lo)), _mm256_mul_ps(p.hi, pow2i(n.hi))}; }
static inline vf vload_n(const float* p, int64_t n) {  // lanes >= n: 0
  if (n >= 16) return vload(p);
  alignas(32) float t[16] = {0};
  std::memcpy(t, p, n * sizeof(float));
  return vload(t);
}
static inline void vstore_n(float* p, vf v, int64_t n) {
  if (n >= 16) return vstore(p, v);
  alignas(32) float t[16];
  vstore(t, v);
  std::memcpy(p, t, n * sizeof(float));
}
static inline vf vkeep_n(vf v, int64_t n) {  // lanes >= n: 0
  if (n >= 16) return v;
  const __m256i i = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), nn = _mm256_set1_epi32((int)n);
  const __m256 mlo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(nn, i));
  const __m256 mhi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(nn, _mm256_add_epi32(i, _mm256_set1_epi32(8))));
  return {_mm256_and_ps(v.lo, mlo), _mm256_and_ps(v.hi, mhi)};
}
static inline vf vmul_where_neg(vf g, vf e) {  // g * e where g < 0, else g
  const __m256 z = _mm256_setzero_ps();
  return {_mm256_blendv_ps(g.lo, _mm256_mul_ps(g.lo, e.lo), _mm256_cmp_ps(g.lo, z, _CMP_LT_OQ)),
          _mm256_blendv_ps(g.hi, _mm256_mul_ps(g.hi, e.hi), _mm256_cmp_ps(g.hi, z, _CMP_LT_OQ))};
}
static inline __m256 bf16x8_load(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
// 8 floats -> 8 bf16, round to nearest even with NaN kept a NaN: f2bf's integer rule on 8 lanes.
static inline __m128i bf16x8_pack(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i q = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(q, q), 0x08));  // lanes 0-3, 4-7
}
static inline vf bf16x16_load(const uint16_t* p) { return {bf16x8_load(p), bf16x8_load(p + 8)}; }
static inline void bf16x16_store(uint16_t* p, vf v) {
  _mm_storeu_si128((__m128i*)p, bf16x8_pack(v.lo));
  _mm_storeu_si128((__m128i*)(p + 8), bf16x8_pack(v.hi));
}
static inline void bf16x16_store_n(uint16_t* p, vf v, int64_t n) {  // the first n <= 16 of them
  alignas(16) uint16_t t[16];
  bf16x16_store(t, v);
  std::memcpy(p, t, n * sizeof(uint16_t));
}
static inline __m256 bf16x8_round(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16x8_pack(v)), 16));
}
static inline vf bf16_round(vf v) { return {bf16x8_round(v.lo), bf16x8_round(v.hi)}; }
static inline __m128 sum4(vf a, vf b, vf c, vf d) {  // [sum(a), sum(b), sum(c), sum(d)], one fixed tree
  const __m256 ab = _mm256_hadd_ps(_mm256_add_ps(a.lo, a.hi), _mm256_add_ps(b.lo, b.hi));
  const __m256 cd = _mm256_hadd_ps(_mm256_add_ps(c.lo, c.hi), _mm256_add_ps(d.lo, d.hi));
  const __m256 x = _mm256_hadd_ps(ab, cd);  // [a b c d] per 128-bit lane
  return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
}
#endif

// exp(x) for x <= 0 on 16 lanes: 2^n * p(r) with r = x - n ln2 (ln2 in two parts) and Cephes' expf
// polynomial, within ~2 ulp of expf. Hand-written because libm has no vector exp callable here.
static inline vf exp16(vf x) {
  x = vmax(x, vset(-87.0f));
  const vf n = vround(vmul(x, vset(1.44269504088896341f)));
  vf r = vfnma(n, vset(0.693359375f), x);
  r = vfnma(n, vset(-2.12194440e-4f), r);
  vf p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset(1.0f)));
  return vscale2(p, n);
}


// [16 Nb, K] -> [Nb, K/2, 16, 2]: 32 consecutive weights hold 16 outputs x 2 k (one 64-byte line in bf16).
static at::Tensor to_blocks(const at::Tensor& w) {
  return w.view({w.size(0) / 16, 16, w.size(1) / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// W [N, K] bf16 -> [ceil(N/16), K/2, 16, 2] bf16 (N zero-padded to a multiple of 16). K must be even.
at::Tensor pack(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack: a 2-d bf16 weight");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % 2 == 0, "pack: in_features must be even");
  auto wp = at::zeros({(N + 15) / 16 * 16, K}, w.options());
  wp.narrow(0, 0, N).copy_(w);
  return to_blocks(wp);
}

// Software prefetch distance for the packed weights, in 64-byte lines (one line = one kp step of a
// block). The hardware prefetcher alone left the weight stream short of bandwidth once a kp step
// carries several rows' FMAs. Measured over SmolLM2's 121 matmuls (ms, median of 6 interleaved runs,
// none vs 16 lines): 9 rows 11.1 vs 10.4, 12 rows 13.0 vs 11.2, 1 row 9.1 vs 9.0; 8 lines was slower.
// The one-row path (a plain decoding step, bandwidth-bound) is left as it was: no gain measured there.
#ifndef PREFETCH_LINES
#define PREFETCH_LINES 16
#endif
// AVX2: the row passes and panel tiles also prefetch, into L2, the weights they will read next (the next
// span, the next block) while they compute on the current ones, so the weight stream overlaps the FMAs of
// several rows instead of adding to them: over SmolLM2's 121 matmuls at 4 / 12 / 48 rows, 19.1 / 34.3 /
// 95.5 ms -> 14.5 / 31.3 / 87.1 ms, 1 row unchanged (docs/reference/kernels.md, "Prefetching the next span").
#ifndef FAR_HINT
#define FAR_HINT _MM_HINT_T1
#endif
#ifndef PREFETCH_MIN_ROWS
#define PREFETCH_MIN_ROWS 2
#endif

// Above this many rows a call runs as two passes of half the rows (run_blocks_split). Measured over 60
// of SmolLM2's weights from memory (ms, one pass vs two): 13 rows 13.0 vs 8.6, 16 rows 13.8 vs 12.5;
// at 9-12 rows one pass is as fast or faster (9: 7.4 vs 8.4).
#ifndef SPLIT_ABOVE
#define SPLIT_ABOVE 12
#endif

#if DS_AVX512
// 32 int8 weights (16 outputs x 2 k) -> 32 bf16 in the same order, exactly (|q| <= 127): `linear_i8`'s weights.
static inline __m512bh i8x32_to_bf16(const int8_t* p) {
  const __m512i w16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(w16)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(w16, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// Blocks [b0, b1) of 16 outputs, NB blocks at a time, all M rows: M*NB accumulators stay in registers.
// W = uint16_t: bf16 weights from `pack`, the bias (fp32) starts the sums. W = int8_t: int8 weights from
// `pack_i8`, widened to bf16 in registers, and y = scale * sum + bias at the end (`linear_i8`).
template <int M, int NB, class W = uint16_t>
static void run_blocks(const int32_t* x, int64_t Kp, const W* p, const float* bias,
                       int64_t b0, int64_t b1, uint16_t* y, int64_t N, const float* scale = nullptr) {
  constexpr bool I8 = std::is_same_v<W, int8_t>;
  for (int64_t b = b0; b < b1; b += NB) {
    __m512 acc[M][NB];
    for (int j = 0; j < NB; j++) {
      __m512 init = bias && !I8 ? _mm512_loadu_ps(bias + (b + j) * 16) : _mm512_setzero_ps();
      for (int m = 0; m < M; m++) acc[m][j] = init;
    }
    const W* w[NB];
    for (int j = 0; j < NB; j++) w[j] = p + (b + j) * Kp * 32;
    for (int64_t kp = 0; kp < Kp; kp++) {
      __m512bh wv[NB];
      for (int j = 0; j < NB; j++) {
        if constexpr (I8) wv[j] = i8x32_to_bf16(w[j] + kp * 32);
        else wv[j] = (__m512bh)_mm512_loadu_si512(w[j] + kp * 32);
      }
      if constexpr (!I8 && M >= PREFETCH_MIN_ROWS)
        for (int j = 0; j < NB; j++) _mm_prefetch((const char*)(w[j] + (kp + PREFETCH_LINES) * 32), _MM_HINT_T0);
      for (int m = 0; m < M; m++) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(x[m * Kp + kp]);  // x[m, 2kp:2kp+2] in every lane
        for (int j = 0; j < NB; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xb);
      }
    }
    for (int j = 0; j < NB; j++) {
      const int64_t n0 = (b + j) * 16;
      const __mmask16 mask = first(N - n0);
      for (int m = 0; m < M; m++) {
        __m512 v = acc[m][j];
        if constexpr (I8)
          v = _mm512_fmadd_ps(v, _mm512_loadu_ps(scale + n0), bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps());
        const __m256i r = (__m256i)_mm512_cvtneps_pbh(v);  // round to nearest even, as torch does
        _mm256_mask_storeu_epi16(y + m * N + n0, mask, r);
      }
    }
  }
}

// Rows [0, M1) then rows [M1, M1 + M2) over the same NB blocks: the second pass finds the blocks' weights
// (NB x K x 32 bytes, <= 100 KB here) in cache, so more than 12 rows still stream W from memory once
// with two reused broadcasts per weight load, where one pass over all rows would have room for one
// block only (M x NB accumulators in 32 registers) and reload each weight per 16 outputs. Each output
// is still summed over k in one fixed order, so the result does not depend on M.
template <int M1, int M2, int NB>
static void run_blocks_split(const int32_t* x, int64_t Kp, const uint16_t* p, const float* bias,
                             int64_t b0, int64_t b1, uint16_t* y, int64_t N) {
  for (int64_t b = b0; b < b1; b += NB) {
    run_blocks<M1, NB>(x, Kp, p, bias, b, b + NB, y, N);
    run_blocks<M2, NB>(x + M1 * Kp, Kp, p, bias, b, b + NB, y + M1 * N, N);
  }
}

template <int M, class W = uint16_t>
static void run_rows(const int32_t* x, int64_t Kp, const W* p, const float* bias, int64_t Nb,
                     uint16_t* y, int64_t N, const float* scale = nullptr) {
  // Enough blocks per accumulator set to reuse each broadcast, few enough to stay in 32 registers.
  constexpr int NB = M <= 4 ? 4 : 2;
  constexpr bool SPLIT = M > SPLIT_ABOVE;
  const int64_t groups = Nb / NB;
  at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
    if constexpr (SPLIT) {
      run_blocks_split<(M + 1) / 2, M / 2, NB>(x, Kp, p, bias, g0 * NB, g1 * NB, y, N);
    } else {
      run_blocks<M, NB, W>(x, Kp, p, bias, g0 * NB, g1 * NB, y, N, scale);
    }
  });
  if (groups * NB < Nb) run_blocks<M, 1, W>(x, Kp, p, bias, groups * NB, Nb, y, N, scale);
}
#else
// AVX2 + FMA has no bf16 dot product, so each packed 32-bit lane (one output's bf16 weights at k, k+1)
// is widened in registers to two fp32 vectors (bf16 -> fp32 is a 16-bit shift, exact) and two FMAs
// accumulate them against x[m, k] and x[m, k+1]: the same packed layout and the same single stream of
// the weights, at twice the FMAs of `vdpbf16ps`. Each output is summed over k in one order (k, k+1,
// k+2, ...) whatever M is, so the path is row-invariant like the AVX-512 one.

// One 64-byte line (bf16) or 32-byte line (int8) of a block: 16 outputs x (k, k+1) -> even/odd k, as two
// 8-output halves. int8 values are exact in fp32.
static inline __m256 even8(const uint16_t* p) {  // 8 outputs' weights at k: the low bf16 of each lane, shifted up
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)p), 16));
}
static inline __m256 odd8(const uint16_t* p) {  // ... at k + 1: the high bf16 of each lane, kept in place
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i*)p), _mm256_set1_epi32((int)0xffff0000u)));
}
static inline void widen(const uint16_t* p, __m256* e, __m256* o) {
  for (int h = 0; h < 2; h++) {
    e[h] = even8(p + 16 * h);
    o[h] = odd8(p + 16 * h);
  }
}
static inline void widen(const int8_t* p, __m256* e, __m256* o) {
  for (int h = 0; h < 2; h++) {
    const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + 16 * h)));  // 32-bit lane: (k, k+1)
    e[h] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16));
    o[h] = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 16));
  }
}

// The lines of the next span a pass prefetches into L2: one every `every` lines it reads, from `next` on.
template <class W>
struct Ahead {
  const W* next = nullptr;
  int64_t every = 1, count = 0;
  void step() {
    if (++count == every) {
      _mm_prefetch((const char*)next, FAR_HINT);  // a prefetch never faults, past the weights' end included
      next += 32;
      count = 0;
    }
  }
};

// One bf16 line (16 outputs x (k, k+1)) into block j's accumulators of R rows: every row's k, then every
// row's k + 1, each output's sum in run_blocks2's order. The line is read again for the odd half (from L1):
// the compiler barrier keeps it from holding the first read in two more registers.
template <int R, int NB>
static inline void step_split(const uint16_t* line, const float* xf, int64_t K, int64_t kp, __m256 (&acc)[R][NB][2],
                              int j) {
  __m256 w[2];
  for (int h = 0; h < 2; h++) w[h] = even8(line + 16 * h);
#pragma GCC unroll 16
  for (int m = 0; m < R; m++) {
    const __m256 xe = _mm256_broadcast_ss(xf + m * K + 2 * kp);
    for (int h = 0; h < 2; h++) acc[m][j][h] = _mm256_fmadd_ps(w[h], xe, acc[m][j][h]);
  }
  asm volatile("" ::: "memory");
  for (int h = 0; h < 2; h++) w[h] = odd8(line + 16 * h);
#pragma GCC unroll 16
  for (int m = 0; m < R; m++) {
    const __m256 xo = _mm256_broadcast_ss(xf + m * K + 2 * kp + 1);
    for (int h = 0; h < 2; h++) acc[m][j][h] = _mm256_fmadd_ps(w[h], xo, acc[m][j][h]);
  }
}

// Blocks [b0, b1) of 16 outputs, NB at a time, for the R rows of xf (fp32 [R, K], row stride K): 2*R*NB
// accumulators, the weights widened once per line for all R rows. W and `scale` as in the AVX-512 path.
// At SPLIT_ROWS rows a bf16 line is widened in two steps, its even k for every row and then its odd k,
// so it holds 2 weight registers instead of 4 and six rows' 12 accumulators fit the 16 ymm registers
// (docs/reference/kernels.md, "Six rows a pass").
constexpr int SPLIT_ROWS = 6;
template <int R, int NB, class W>
static void run_blocks2(const float* xf, int64_t K, const W* p, const float* bias, int64_t b0, int64_t b1,
                        uint16_t* y, int64_t N, const float* scale, Ahead<W>* ahead = nullptr) {
  constexpr bool I8 = std::is_same_v<W, int8_t>;
  constexpr int64_t LINE = 32;  // weights per line: 16 outputs x 2 k
  const int64_t Kp = K / 2;
  for (int64_t b = b0; b < b1; b += NB) {
    __m256 acc[R][NB][2];
#pragma GCC unroll 16
    for (int j = 0; j < NB; j++)
#pragma GCC unroll 16
      for (int h = 0; h < 2; h++) {
        const __m256 init = bias && !I8 ? _mm256_loadu_ps(bias + (b + j) * 16 + 8 * h) : _mm256_setzero_ps();
#pragma GCC unroll 16
        for (int m = 0; m < R; m++) acc[m][j][h] = init;
      }
    for (int64_t kp = 0; kp < Kp; kp++) {
#pragma GCC unroll 16
      for (int j = 0; j < NB; j++) {
        const W* line = p + ((b + j) * Kp + kp) * LINE;
        if constexpr (!I8) _mm_prefetch((const char*)(line + PREFETCH_LINES * LINE), _MM_HINT_T0);
        if (ahead) ahead->step();
        if constexpr (!I8 && R >= SPLIT_ROWS) {
          step_split<R, NB>(line, xf, K, kp, acc, j);
          continue;
        }
        __m256 we[2], wo[2];
        widen(line, we, wo);
#pragma GCC unroll 16
        for (int m = 0; m < R; m++) {
          const __m256 xe = _mm256_broadcast_ss(xf + m * K + 2 * kp), xo = _mm256_broadcast_ss(xf + m * K + 2 * kp + 1);
#pragma GCC unroll 16
          for (int h = 0; h < 2; h++) acc[m][j][h] = _mm256_fmadd_ps(wo[h], xo, _mm256_fmadd_ps(we[h], xe, acc[m][j][h]));
        }
      }
    }
#pragma GCC unroll 16
    for (int j = 0; j < NB; j++) {
      const int64_t n0 = (b + j) * 16, left = N - n0 < 16 ? N - n0 : 16;
#pragma GCC unroll 16
      for (int m = 0; m < R; m++) {
        __m256 v[2] = {acc[m][j][0], acc[m][j][1]};
        if constexpr (I8)
          for (int h = 0; h < 2; h++)
            v[h] = _mm256_fmadd_ps(v[h], _mm256_loadu_ps(scale + n0 + 8 * h), bias ? _mm256_loadu_ps(bias + n0 + 8 * h) : _mm256_setzero_ps());
        bf16x16_store_n(y + m * N + n0, {v[0], v[1]}, left);
      }
    }
  }
}

// R rows over blocks [b, e): two blocks at a time up to `pair`, then one at a time.
template <int R, class W>
static void run_pass(const float* xm, int64_t K, const W* p, const float* bias, int64_t b, int64_t pair, int64_t e,
                     uint16_t* ym, int64_t N, const float* scale, Ahead<W>* a) {
  run_blocks2<R, 2, W>(xm, K, p, bias, b, pair, ym, N, scale, a);
  run_blocks2<R, 1, W>(xm, K, p, bias, pair, e, ym, N, scale, a);
}

// Rows at most 6 at a time over a span of SPAN blocks (5 for int8 weights, and where 6 would leave a lone
// row in the last pass, which would widen every line for one row's FMAs: 0.95x at 7 rows). The first pass
// streams the span's weights from memory, later passes (more rows) find them in cache, so any row count
// streams W once. 12 accumulators (10 for int8) keep both FMA pipes busy across the two FMAs a line gives
// each; six rows a pass against five: a verify of 6 / 12 rows 1.08-1.10x / 1.08x faster
// (docs/reference/kernels.md, "Six rows a pass"). NB = 4 at one row, 2 for a later pass of 2-3 rows. From 2
// rows the passes share out the next span's prefetch, each a contiguous share, so the stream overlaps all
// the passes' FMAs, not the first's alone (docs/reference/kernels.md, "Sharing the prefetch among the passes").
template <class W>
static void gemm_rows(const float* xf, int64_t M, int64_t K, const W* p, const float* bias, int64_t Nb,
                      uint16_t* y, int64_t N, const float* scale) {
  constexpr int RMAX = std::is_same_v<W, int8_t> ? 5 : 6;  // int8 lines widen in one step: 4 weight registers
  constexpr int64_t SPAN = 4;
  const int64_t rows = M > RMAX && M % RMAX == 1 ? 5 : RMAX;  // a pass's rows: no lone row in the last pass
  const int64_t passes = (M + rows - 1) / rows, Kp = K / 2;
  at::parallel_for(0, (Nb + SPAN - 1) / SPAN, 4, [&](int64_t s0, int64_t s1) {
    const int64_t b0 = s0 * SPAN, b1 = s1 * SPAN < Nb ? s1 * SPAN : Nb;
    for (int64_t b = b0; b < b1; b += SPAN) {
      const int64_t e = b + SPAN < b1 ? b + SPAN : b1, full = b + (e - b) / 4 * 4, pair = b + (e - b) / 2 * 2;
      const int64_t share = ((e - b) * Kp + passes - 1) / passes;  // lines of the next span each pass prefetches
      for (int64_t m = 0, t = 0; m < M; m += rows, t++) {
        const int64_t h = M - m < rows ? M - m : rows;
        const float* xm = xf + m * K;
        uint16_t* ym = y + m * N;
        // None for one row (bound by the stream alone) or a thread's last span.
        Ahead<W> ahead{p + (e * Kp + t * share) * 32, passes};
        Ahead<W>* a = M >= PREFETCH_MIN_ROWS && e < b1 ? &ahead : nullptr;
        const int64_t two = m ? pair : b;  // a first pass of 2-3 rows, from memory, one block at a time
        switch (h) {
          case 1:
            run_blocks2<1, 4, W>(xm, K, p, bias, b, full, ym, N, scale, a);
            run_blocks2<1, 1, W>(xm, K, p, bias, full, e, ym, N, scale, a);
            break;
          case 2: run_pass<2, W>(xm, K, p, bias, b, two, e, ym, N, scale, a); break;
          case 3: run_pass<3, W>(xm, K, p, bias, b, two, e, ym, N, scale, a); break;
          case 4: run_blocks2<4, 1, W>(xm, K, p, bias, b, e, ym, N, scale, a); break;
          case 5: run_blocks2<5, 1, W>(xm, K, p, bias, b, e, ym, N, scale, a); break;
          default: run_blocks2<RMAX, 1, W>(xm, K, p, bias, b, e, ym, N, scale, a); break;
        }
      }
    }
  });
}

// Many rows (prefill, generate's batches): each block's weights are widened once into an fp32 panel
// [K][16] in cache, then R rows at a time run a 6 x 16 register tile over it: one FMA per weight and row,
// two panel loads per k shared by six rows, as an AVX2 GEMM's micro-kernel does, with none of the per-pass
// widening and dependent FMA pairs of run_blocks2 (the figures: docs/reference/kernels.md). Each output
// starts from the bias and adds k = 0, 1, 2, ... one FMA each, run_blocks2's order, so the two kernels give
// the same bits and the row-invariance holds across PANEL_MIN_ROWS.
#ifndef PANEL_MIN_ROWS
#define PANEL_MIN_ROWS 17
#endif
static_assert(PANEL_MIN_ROWS >= 8, "gemm_panel's tiles are 4-6 rows only from 8 rows on");

static void widen_panel(const uint16_t* blk, int64_t Kp, float* panel) {  // one block -> [2 Kp][16] fp32
  for (int64_t kp = 0; kp < Kp; kp++) {
    __m256 e[2], o[2];
    widen(blk + kp * 32, e, o);
    for (int h = 0; h < 2; h++) {
      _mm256_storeu_ps(panel + (2 * kp) * 16 + 8 * h, e[h]);
      _mm256_storeu_ps(panel + (2 * kp + 1) * 16 + 8 * h, o[h]);
    }
  }
}

// The tiles walk k in chunks of PANEL_KC so that a chunk of the panel (12 KB) and the rows' x stay in L1
// while every tile of the block passes over it; between chunks a tile's sums wait in fp32 scratch, so each
// output still adds k = 0, 1, 2, ... in order: 32 / 48 rows 1.06-1.07x (docs/reference/kernels.md).
#ifndef PANEL_KC
#define PANEL_KC 192
#endif
template <int R>
static void panel_tile(const float* xf, int64_t K, int64_t k0, int64_t k1, const float* panel, const float* bias16,
                       float* c, uint16_t* y, int64_t N, int64_t n0, const uint16_t* next = nullptr) {
  __m256 acc[R][2];
  const bool first = k0 == 0, last = k1 == K;
#pragma GCC unroll 2
  for (int h = 0; h < 2; h++) {
    const __m256 init = bias16 ? _mm256_loadu_ps(bias16 + 8 * h) : _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < R; m++) acc[m][h] = first ? init : _mm256_loadu_ps(c + m * 16 + 8 * h);
  }
  for (int64_t k = k0; k < k1; k++) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * 16), w1 = _mm256_loadu_ps(panel + k * 16 + 8);
    if (next && !(k & 1)) _mm_prefetch((const char*)(next + k * 16), FAR_HINT);
#pragma GCC unroll 8
    for (int m = 0; m < R; m++) {
      const __m256 xb = _mm256_broadcast_ss(xf + m * K + k);
      acc[m][0] = _mm256_fmadd_ps(w0, xb, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(w1, xb, acc[m][1]);
    }
  }
  if (!last) {
#pragma GCC unroll 8
    for (int m = 0; m < R; m++) { _mm256_storeu_ps(c + m * 16, acc[m][0]); _mm256_storeu_ps(c + m * 16 + 8, acc[m][1]); }
    return;
  }
  const int64_t left = N - n0 < 16 ? N - n0 : 16;
#pragma GCC unroll 8
  for (int m = 0; m < R; m++) bf16x16_store_n(y + m * N + n0, {acc[m][0], acc[m][1]}, left);
}

static void gemm_panel(const float* xf, int64_t M, int64_t K, const uint16_t* p, const float* bias, int64_t Nb,
                       uint16_t* y, int64_t N) {
  const int64_t Kp = K / 2;
  at::parallel_for(0, Nb, 1, [&](int64_t b0, int64_t b1) {
    static thread_local std::vector<float> pbuf, cbuf;
    float* const panel = grown(pbuf, K * 16);
    float* const cc = grown(cbuf, M * 16);
    for (int64_t b = b0; b < b1; b++) {
      widen_panel(p + b * Kp * 32, Kp, panel);
      const float* bb = bias ? bias + b * 16 : nullptr;
      // ceil(M / 6) tiles of near-equal height, 4 to 6 rows from 8 rows on: a lone tile of one or two rows
      // would leave the FMA pipes waiting on its few accumulators.
      const int64_t tiles = (M + 5) / 6;
      for (int64_t k0 = 0; k0 < K; k0 += PANEL_KC) {
        const int64_t k1 = k0 + PANEL_KC < K ? k0 + PANEL_KC : K;
        for (int64_t t = 0, m = 0; t < tiles; t++) {
          const int64_t r = (M - m) / (tiles - t) + ((M - m) % (tiles - t) ? 1 : 0);
          const float* xm = xf + m * K;
          uint16_t* ym = y + m * N;
          float* cm = cc + m * 16;
          const uint16_t* next = (t == 0 && b + 1 < b1) ? p + (b + 1) * Kp * 32 : nullptr;
          switch (r) {
            case 4: panel_tile<4>(xm, K, k0, k1, panel, bb, cm, ym, N, b * 16, next); break;
            case 5: panel_tile<5>(xm, K, k0, k1, panel, bb, cm, ym, N, b * 16, next); break;
            default: panel_tile<6>(xm, K, k0, k1, panel, bb, cm, ym, N, b * 16, next); break;
          }
          m += r;
        }
      }
    }
  });
}

// bf16 x [M, K] -> fp32 [M, K] (exact): the broadcasts read it.
static const float* widen_rows(const uint16_t* x, int64_t n, std::vector<float>& big) {
  static thread_local std::vector<float> buf;
  float* xf = grown(buf, n, &big);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(xf + i, bf16x8_load(x + i));
  for (; i < n; i++) xf[i] = bf2f(x[i]);
  return xf;
}
#endif

#if DS_AMX
// AMX: one `tdpbf16ps` multiplies a 16-row x 32-k tile of x by a 32-k x 16-output tile of W into 16 x 16
// fp32 sums. `pack`'s layout is already AMX's B-tile layout (a 64-byte line holds 16 outputs x 2 k; 16
// consecutive lines are a tile), so the same packed weights serve both kernels. Why: on a 2-core AMX CPU the
// vdpbf16ps kernel is compute-bound from ~4 rows (16 rows cost 3x one row), AMX stays bandwidth-bound to 48
// rows and more (docs/reference/kernels.md). Each output is summed over k in one order, tile after tile,
// whatever M is, so this kernel is row-invariant at every row count; its last bits differ from vdpbf16ps's.
// Linux hands out AMX state only on request, once per process.
static bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

#ifndef AMX_PREFETCH_TILES
#define AMX_PREFETCH_TILES 2
#endif

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0..5: sums of six 16-output blocks for `rows` rows; 6: `rows` rows x 32 k of x; 7: one block's
// 32 k x 16 outputs.
static void amx_configure(int rows) {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; t++) c.rows[t] = t == 7 ? 16 : rows, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

// Blocks [b, b + NB) for the tiles' rows of xp (row stride K): the bias (or 0) starts each sum.
template <int NB>
static void amx_blocks(const uint16_t* xp, int64_t K, const uint16_t* p, const float* bias, int64_t b,
                       int64_t rows, uint16_t* y, int64_t N, float* cbuf) {
  const int64_t Kp = K / 2, stride = K * 2;
#define DS_INIT(j) if constexpr (NB > j) { if (bias) _tile_loadd(j, bias + (b + j) * 16, 0); else _tile_zero(j); }
  DS_INIT(0) DS_INIT(1) DS_INIT(2) DS_INIT(3) DS_INIT(4) DS_INIT(5)
#undef DS_INIT
  for (int64_t kb = 0; kb < K / 32; kb++) {
    _tile_loadd(6, xp + kb * 32, stride);
#define DS_DOT(j) if constexpr (NB > j) { \
      const uint16_t* t = p + ((b + j) * Kp + kb * 16) * 32; \
      for (int l = 0; l < 16; l++) _mm_prefetch((const char*)(t + (AMX_PREFETCH_TILES * 16 + l) * 32), _MM_HINT_T0); \
      _tile_loadd(7, t, 64); _tile_dpbf16ps(j, 6, 7); }
    DS_DOT(0) DS_DOT(1) DS_DOT(2) DS_DOT(3) DS_DOT(4) DS_DOT(5)
#undef DS_DOT
  }
#define DS_STORE(j) if constexpr (NB > j) _tile_stored(j, cbuf + j * 256, 64);
  DS_STORE(0) DS_STORE(1) DS_STORE(2) DS_STORE(3) DS_STORE(4) DS_STORE(5)
#undef DS_STORE
  for (int j = 0; j < NB; j++) {
    const int64_t n0 = (b + j) * 16;
    const __mmask16 mask = first(N - n0);
    for (int64_t m = 0; m < rows; m++)
      _mm256_mask_storeu_epi16(y + m * N + n0, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(cbuf + j * 256 + m * 16)));
  }
}

// y [M, N] = x [M, K] @ W^T (+ bias) on AMX, K a multiple of 32. Up to 16 rows the tiles hold exactly M
// rows; more go 16 at a time (a last partial chunk zero-padded) under each group of six blocks, so a
// group's weights come from cache after the first chunk.
static void amx_gemm(const uint16_t* x, int64_t M, int64_t K, const uint16_t* p, const float* bias, int64_t Nb,
                     uint16_t* y, int64_t N) {
  const int64_t chunks = (M + 15) / 16, tail = M > 16 ? M % 16 : 0;
  static thread_local std::vector<uint16_t> pad;  // the last chunk's rows, then zeros
  uint16_t* const padded = tail ? grown(pad, 16 * K) : nullptr;
  if (tail) {
    std::memcpy(padded, x + (chunks - 1) * 16 * K, tail * K * sizeof(uint16_t));
    std::memset(padded + tail * K, 0, (16 - tail) * K * sizeof(uint16_t));
  }
  constexpr int64_t NB = 6;
  const int64_t groups = (Nb + NB - 1) / NB;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    amx_configure(M < 16 ? (int)M : 16);
    alignas(64) float cbuf[NB * 256];
    for (int64_t g = g0; g < g1; g++) {
      const int64_t b = g * NB, nb = Nb - b < NB ? Nb - b : NB;
      for (int64_t c = 0; c < chunks; c++) {
        const uint16_t* xc = tail && c == chunks - 1 ? padded : x + c * 16 * K;
        uint16_t* yc = y + c * 16 * N;
        const int64_t rows = M - c * 16 < 16 ? M - c * 16 : 16;
        switch (nb) {
          case 6: amx_blocks<6>(xc, K, p, bias, b, rows, yc, N, cbuf); break;
          case 5: amx_blocks<5>(xc, K, p, bias, b, rows, yc, N, cbuf); break;
          case 4: amx_blocks<4>(xc, K, p, bias, b, rows, yc, N, cbuf); break;
          case 3: amx_blocks<3>(xc, K, p, bias, b, rows, yc, N, cbuf); break;
          case 2: amx_blocks<2>(xc, K, p, bias, b, rows, yc, N, cbuf); break;
          default: amx_blocks<1>(xc, K, p, bias, b, rows, yc, N, cbuf); break;
        }
      }
    }
    _tile_release();
  });
}
#endif

// bool: whether this build's matmul runs on AMX here (eval/cpu.py asks before it picks the amx-bf16 path).
bool amx_ready() {
#if DS_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// The matmul kernel on this path: y [M, N] = x [M, K] @ W^T (+ bias), W packed by `pack` (uint16_t) or
// `pack_i8` (int8_t, with per-output `scale`). Any M: AVX-512 runs 16 rows at a time (each row's sums are
// the same whatever the chunk), AVX2 five at a time over cached spans of the weights, or from
// PANEL_MIN_ROWS rows six at a time over each block's weights widened once to fp32 (gemm_panel).
template <class W>
static void gemm(const uint16_t* x, int64_t M, int64_t K, const W* p, const float* bias, int64_t Nb, uint16_t* y,
                 int64_t N, const float* scale) {
#if DS_AMX
  if constexpr (std::is_same_v<W, uint16_t>)
    if (K % 32 == 0 && amx_permitted()) return amx_gemm(x, M, K, p, bias, Nb, y, N);
#endif
#if DS_AVX512
  constexpr bool I8 = std::is_same_v<W, int8_t>;
  constexpr int64_t CH = I8 ? 4 : 16;  // the int8 kernel keeps at most 4 rows' accumulators
  const int64_t Kp = K / 2;
  for (int64_t r0 = 0; r0 < M; r0 += CH) {
    const int32_t* xp = reinterpret_cast<const int32_t*>(x + r0 * K);
    uint16_t* yp = y + r0 * N;
    const int64_t m = M - r0 < CH ? M - r0 : CH;
    if constexpr (I8) {
      switch (m) {
        case 1: run_rows<1>(xp, Kp, p, bias, Nb, yp, N, scale); break;
        case 2: run_rows<2>(xp, Kp, p, bias, Nb, yp, N, scale); break;
        case 3: run_rows<3>(xp, Kp, p, bias, Nb, yp, N, scale); break;
        default: run_rows<4>(xp, Kp, p, bias, Nb, yp, N, scale); break;
      }
    } else {
      switch (m) {
#define CASE(c) case c: run_rows<c>(xp, Kp, p, bias, Nb, yp, N); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
        CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
      }
    }
  }
#else
  std::vector<float> big;
  const float* xf = widen_rows(x, M * K, big);
  if constexpr (std::is_same_v<W, uint16_t>)
    if (M >= PANEL_MIN_ROWS) return gemm_panel(xf, M, K, p, bias, Nb, y, N);
  gemm_rows<W>(xf, M, K, p, bias, Nb, y, N, scale);
#endif
}

// x [M, K] bf16 contiguous, packed from `pack`, bias fp32 [Nb*16] or empty -> y [M, N] bf16. Any M >= 1;
// eval/cpu.py sends it up to VDP_MAX_ROWS rows on avx512-bf16 (oneDNN takes more), every row count elsewhere.
at::Tensor linear(at::Tensor x, at::Tensor packed, at::Tensor bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "linear: x [M, K] bf16");
  const int64_t M = x.size(0), K = x.size(1), Nb = packed.size(0), Kp = packed.size(1);
  TORCH_CHECK(K == 2 * Kp && M >= 1 && N <= Nb * 16, "linear: K must match the packed weight and M >= 1");
  auto y = fresh({M, N}, x.options());
  gemm<uint16_t>(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K,
                 reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
                 bias.numel() ? bias.data_ptr<float>() : nullptr, Nb,
                 reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), N, nullptr);
  return y;
}

// ---------------------------------------------------------------------------------------------------
// Weight-only int8 for the draft's matmuls (eval/int8.py, used by the Medusa heads' copies and the int8
// draft): at one or two rows a draft's matmuls are a stream of its weights (~31 MB of bf16 per round
// for the recipe's heads; docs/reference/kernels.md), so half the bytes is about half the time. Each output row n keeps a scale s_n = max |w_n| / 127 and
// q = round(w / s_n) in [-127, 127]; int8 values are exact in bf16, so a weight pair is widened to bf16
// in registers and `vdpbf16ps` accumulates exactly as in `linear`, and y = s_n * acc (+ b) is rounded
// to bf16. Only proposals use it: verification, and so the output, never sees these weights.

// W [N, K] (bf16 or fp32) -> (q [ceil(N/16), K/2, 16, 2] int8, scale [ceil(N/16) * 16] fp32).
std::vector<at::Tensor> pack_i8(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.size(1) % 2 == 0, "pack_i8: a 2-d weight with an even in_features");
  const int64_t N = w.size(0), K = w.size(1);
  auto wf = at::zeros({(N + 15) / 16 * 16, K}, w.options().dtype(at::kFloat));
  wf.narrow(0, 0, N).copy_(w);
  auto scale = (std::get<0>(wf.abs().max(1)) / 127.0).clamp_min(1e-30);  // [Nb * 16]
  auto q = (wf / scale.unsqueeze(1)).round().clamp(-127, 127).to(at::kChar);
  return {to_blocks(q), scale.contiguous()};
}

// x [M, K] bf16 contiguous, (q, scale) from `pack_i8`, bias fp32 [Nb*16] or empty -> y [M, N] bf16.
at::Tensor linear_i8(at::Tensor x, at::Tensor q, at::Tensor scale, at::Tensor bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "linear_i8: x [M, K] bf16");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 4 && scale.scalar_type() == at::kFloat, "linear_i8: pack_i8's tensors");
  const int64_t M = x.size(0), K = x.size(1), Nb = q.size(0), Kp = q.size(1);
  TORCH_CHECK(K == 2 * Kp && M >= 1 && N <= Nb * 16, "linear_i8: K must match the packed weight and M >= 1");
  auto y = at::empty({M, N}, x.options());
  gemm<int8_t>(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, q.data_ptr<int8_t>(),
               bias.numel() ? bias.data_ptr<float>() : nullptr, Nb,
               reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), N, scale.data_ptr<float>());
  return y;
}


// 16 cached key or value floats: the fp32 cache's as they are, the bf16 cache's widened (exactly: the cache
// holds k and v as the bf16 projections rounded them, so both caches give attention the same numbers).
static inline vf cload(const float* p) { return vload(p); }
static inline vf cload(const uint16_t* p) { return bf16x16_load(p); }
// hd bf16 values (a k or v head as projected) into a cache slot: widened to fp32 exactly, or as they are.
static inline void cstore(float* dst, const uint16_t* src, int64_t hd) {
  for (int64_t c = 0; c < hd; c += 16) vstore(dst + c, bf16x16_load(src + c));
}
static inline void cstore(uint16_t* dst, const uint16_t* src, int64_t hd) { std::memcpy(dst, src, hd * sizeof(uint16_t)); }

// f(k, v) on a pair of caches' data as the kernel reads it: float*, or a bf16 cache's raw uint16_t*.
template <class F>
static void with_cache(at::Tensor& kc, at::Tensor& vc, F&& f) {
  if (kc.scalar_type() == at::kFloat)
    f(kc.data_ptr<float>(), vc.data_ptr<float>());
  else
    f((uint16_t*)kc.data_ptr<at::BFloat16>(), (uint16_t*)vc.data_ptr<at::BFloat16>());
}

// How many visible slots ahead the attention loops prefetch a slot's key or value. In decoding a row sees
// fewer slots than its cache holds, so each (row, kv head) is a short run of lines from memory on which the
// hardware prefetcher starts over; 16 slots ahead took a fifth to a quarter off attention alone at batch
// 16-32, on AMX and AVX2 alike (docs/reference/kernels.md, "Prefetching the cache's next slots").
constexpr int64_t ATT_PREFETCH = 16;

// Slot ix[j + ATT_PREFETCH]'s hd values of one cache head into L1, where the row sees that many more slots.
template <class C>
static inline void prefetch_slot(const C* h, const int32_t* ix, int64_t j, int64_t n, int64_t hd) {
  if (j + ATT_PREFETCH >= n) return;
  const char* f = (const char*)(h + (int64_t)ix[j + ATT_PREFETCH] * hd);
  for (int64_t o = 0; o < hd * (int64_t)sizeof(C); o += 64) _mm_prefetch(f + o, _MM_HINT_T0);
}

// The query heads r0 .. r0 + NR - 1 of one kv head at one query row (see `attend`). NC = hd / 16 as a
// compile-time constant keeps q and the p.v accumulators in registers, and NR the real head count (no
// padded fourth head's FMAs); NC = 0 is the generic path (hd from `nc`). Every variant runs the same
// operations in the same order for a given head, so results do not depend on the variant. Against the
// one generic loop (4 heads always, hd at run time), µs per layer at SmolLM2's shapes with 300 cached
// slots: 17 -> 12 at one query row, 84 -> 44 at 9, 123 -> 77 at 16; bit-identical output.
template <int NC, int NR, class C>
static void attend_heads(const float* const* qrow, float* const* orow, const C* kh, const C* vh,
                         const int32_t* ix, int64_t n, int64_t nc_rt, int64_t hd, __m128 scv, float* const* sb) {
  const int64_t nc = NC ? NC : nc_rt;
  vf qv[4][NC ? NC : 16];
  for (int r = 0; r < 4; r++)
    for (int64_t c = 0; c < nc; c++) qv[r][c] = r < NR ? vload(qrow[r] + c * 16) : vzero();
  __m128 mx = _mm_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j++) {  // scores: a dot product over hd per visible slot and head
    const C* kr = kh + (int64_t)ix[j] * hd;
    prefetch_slot(kh, ix, j, n, hd);
    vf acc[4];
    for (int r = 0; r < 4; r++) acc[r] = vzero();
    for (int64_t c = 0; c < nc; c++) {
      const vf kv = cload(kr + c * 16);
      for (int r = 0; r < NR; r++) acc[r] = vfma(qv[r][c], kv, acc[r]);
    }
    const __m128 s4 = _mm_mul_ps(sum4(acc[0], acc[1], acc[2], acc[3]), scv);
    mx = _mm_max_ps(mx, s4);
    alignas(16) float tmp[4];
    _mm_store_ps(tmp, s4);
    for (int r = 0; r < NR; r++) sb[r][j] = tmp[r];
  }
  alignas(16) float mxs[4];
  _mm_store_ps(mxs, mx);
  float inv[4];
  for (int r = 0; r < NR; r++) {  // softmax numerators, lane j % 16 of the compact list
    vf sum = vzero();
    const vf mxv = vset(mxs[r]);
    for (int64_t j = 0; j < n; j += 16) {
      const vf e = vkeep_n(exp16(vsub(vload_n(sb[r] + j, n - j), mxv)), n - j);
      vstore_n(sb[r] + j, e, n - j);
      sum = vadd(sum, e);
    }
    inv[r] = 1.0f / vsum(sum);
  }
  vf acc[4][NC ? NC : 16];
  for (int r = 0; r < NR; r++) for (int64_t c = 0; c < nc; c++) acc[r][c] = vzero();
  for (int64_t j = 0; j < n; j++) {  // p . v, slot by slot in compact order
    const C* vr = vh + (int64_t)ix[j] * hd;
    prefetch_slot(vh, ix, j, n, hd);
    for (int64_t c = 0; c < nc; c++) {
      const vf vv = cload(vr + c * 16);
      for (int r = 0; r < NR; r++) acc[r][c] = vfma(vset(sb[r][j]), vv, acc[r][c]);
    }
  }
  for (int r = 0; r < NR; r++)
    for (int64_t c = 0; c < nc; c++)
      vstore(orow[r] + c * 16, vmul(acc[r][c], vset(inv[r])));
}

template <int NC, class C>
static void attend_heads_nr(int64_t nr, const float* const* qrow, float* const* orow, const C* kh, const C* vh,
                            const int32_t* ix, int64_t n, int64_t nc, int64_t hd, __m128 scv, float* const* sb) {
  switch (nr) {
    case 1: attend_heads<NC, 1, C>(qrow, orow, kh, vh, ix, n, nc, hd, scv, sb); break;
    case 2: attend_heads<NC, 2, C>(qrow, orow, kh, vh, ix, n, nc, hd, scv, sb); break;
    case 3: attend_heads<NC, 3, C>(qrow, orow, kh, vh, ix, n, nc, hd, scv, sb); break;
    default: attend_heads<NC, 4, C>(qrow, orow, kh, vh, ix, n, nc, hd, scv, sb); break;
  }
}

// The visible slots of each (b, t) row of vis [B, T, S] in slot order: idx[bt * S + i] for i < cnt[bt], in this
// thread's kept buffers (`grown`; a prefill's larger list in `big`, the caller's).
struct Slots { const int32_t* idx; const int64_t* cnt; };
static Slots visible_slots(const at::Tensor& vis, std::vector<int32_t>& big) {
  static thread_local std::vector<int32_t> kept;
  static thread_local std::vector<int64_t> counts;
  const int64_t BT = vis.size(0) * vis.size(1), S = vis.size(2);
  int32_t* idx = grown(kept, BT * S, &big);
  int64_t* cnt = grown(counts, BT);
  const bool* vp = vis.data_ptr<bool>();
  for (int64_t bt = 0; bt < BT; bt++) {
    int64_t c = 0;
    for (int64_t s = 0; s < S; s++) if (vp[bt * S + s]) idx[bt * S + c++] = (int32_t)s;
    cnt[bt] = c;
  }
  return {idx, cnt};
}

// One task per (b, kv head, t): the query heads sharing a kv head (4 at a time) read each key and value
// once, and their 4 dot products are reduced together in one fixed tree (`sum4`). `rows(bt, head0, nr,
// qbuf, obuf, qrow, orow)` points the task's 4 query and output rows somewhere (qbuf, obuf: hd floats
// per row, for a caller that widens q or narrows the output); `finish(bt, head0, nr, n, orow)` runs
// after the heads (n visible slots; n == 0: nothing was computed, the rows must read zeros).
template <class C, class Rows, class Finish>
static void attend_tasks(int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, int64_t S, int64_t Smax,
                         const C* kp, const C* vcp, Slots slots, double scale, Rows rows, Finish finish) {
  const int32_t* idx = slots.idx;
  const int64_t* cnt = slots.cnt;
  const int64_t nc = hd / 16, group = nh / nkv;
  const __m128 scv = _mm_set1_ps((float)scale);
  // A (row, kv head)'s T tasks are consecutive, so on one thread: the first reads its keys and values from
  // memory, the others from cache, each widening as it reads, which costs less than writing fp32 scratch
  // (docs/reference/kernels.md, "Prefetching the cache's next slots").
  at::parallel_for(0, B * nkv * T, 2, [&](int64_t i0, int64_t i1) {
    static thread_local std::vector<float> buf;
    float* const sbuf = grown(buf, 4 * (S + 16) + 8 * hd);  // scores of 4 heads, then q and out rows
    float* const qbuf = sbuf + 4 * (S + 16);
    float* const obuf = qbuf + 4 * hd;
    float* sb[4] = {sbuf, sbuf + (S + 16), sbuf + 2 * (S + 16), sbuf + 3 * (S + 16)};
    for (int64_t i = i0; i < i1; i++) {
      const int64_t t = i % T, g = (i / T) % nkv, b = i / (T * nkv);
      const int64_t bt = b * T + t, n = cnt[bt];
      const int32_t* ix = idx + bt * S;
      const C* kh = kp + (b * nkv + g) * Smax * hd;
      const C* vh = vcp + (b * nkv + g) * Smax * hd;
      for (int64_t r0 = 0; r0 < group; r0 += 4) {
        const int64_t nr = group - r0 < 4 ? group - r0 : 4, head0 = g * group + r0;
        const float* qrow[4];
        float* orow[4];
        rows(bt, head0, nr, qbuf, obuf, qrow, orow);
        if (n > 0) {
          if (nc == 4) attend_heads_nr<4>(nr, qrow, orow, kh, vh, ix, n, nc, hd, scv, sb);
          else if (nc == 8) attend_heads_nr<8>(nr, qrow, orow, kh, vh, ix, n, nc, hd, scv, sb);
          else attend_heads_nr<0>(nr, qrow, orow, kh, vh, ix, n, nc, hd, scv, sb);
        }
        finish(bt, head0, nr, n, orow);
      }
    }
  });
}

// Attention of each query row over the cache slots it may see, in fp32:
//   q [B, nh, T, hd], k/v cache [B, nkv, S_max, hd] (contiguous, fp32 or bf16), vis [B, T, S] bool -> [B, nh, T, hd].
// The visible slots of a row are gathered first, in slot order, and every sum (q.k over hd, the
// softmax's sum, p.v) runs over that compact list in a fixed order. So a row's result depends only on
// the keys/values it sees, in their order: a tree node over [committed slots + its ancestors' slots]
// gets exactly the numbers a one-token step at the same position gets over consecutive slots, which
// PyTorch's SDPA (blocked over the kv length, masked or not) does not guarantee.
at::Tensor attend(at::Tensor q, at::Tensor kc, at::Tensor vc, at::Tensor vis, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.is_contiguous(), "attend: q [B, nh, T, hd] fp32");
  TORCH_CHECK((kc.scalar_type() == at::kFloat || kc.scalar_type() == at::kBFloat16) && vc.scalar_type() == kc.scalar_type() &&
              kc.is_contiguous() && vc.is_contiguous(), "attend: fp32 or bf16 caches, both alike");
  TORCH_CHECK(vis.scalar_type() == at::kBool && vis.is_contiguous() && vis.dim() == 3, "attend: vis [B, T, S] bool");
  const int64_t B = q.size(0), nh = q.size(1), T = q.size(2), hd = q.size(3);
  const int64_t nkv = kc.size(1), Smax = kc.size(2), S = vis.size(2);
  TORCH_CHECK(hd % 16 == 0 && hd <= 256 && nh % nkv == 0 && S <= Smax && vis.size(0) == B && vis.size(1) == T,
              "attend: head_dim a multiple of 16 (<= 256), heads a multiple of kv heads, S <= cache length");
  auto out = at::empty_like(q);
  std::vector<int32_t> big;
  const Slots vs = visible_slots(vis, big);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto rows = [&](int64_t bt, int64_t head0, int64_t nr, float*, float*, const float** qrow, float** orow) {
    const int64_t b = bt / T, t = bt % T;
    for (int64_t r = 0; r < 4; r++) {  // q and out rows in place ([B, nh, T, hd]); a padded 4th reads row 0
      const int64_t off = ((b * nh + head0 + (r < nr ? r : 0)) * T + t) * hd;
      qrow[r] = qp + off;
      orow[r] = op + off;
    }
  };
  auto finish = [&](int64_t, int64_t, int64_t nr, int64_t n, float* const* orow) {
    if (n == 0) for (int64_t r = 0; r < nr; r++) std::memset(orow[r], 0, hd * sizeof(float));
  };
  with_cache(kc, vc, [&](auto* kp, auto* vp) {
    attend_tasks(B, T, nh, nkv, hd, S, Smax, kp, vp, vs, scale, rows, finish);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------
// Elementwise steps of a Llama layer in bf16, fused: at one to sixteen rows they are a few microseconds
// of arithmetic each, but as ATen ops ~20 dispatches and temporaries per layer (RMSNorm alone is 7:
// float, pow, mean, add, rsqrt, mul, cast, mul) that cost more than the arithmetic. Each rounds to bf16
// exactly where the PyTorch code it replaces does (eval/target.py), so results differ from it only by
// the order of RMSNorm's mean and by exp's last bits in SiLU; every row is computed alone, so a verify
// forward still rounds like a one-token step.

// One layer's attention straight from the projections, for the fused forward (eval/target.py):
//   qk [B, T, >= (nh + nkv) * hd] bf16 (q and k heads after RoPE), qkv [B, T, C] bf16 (v at columns
//   v_off .. v_off + nkv * hd), the layer's caches kc/vc [B, nkv, S_max, hd] (fp32 or bf16), slots [B, T] int64,
//   vis [B, T, S] bool -> [B, T, nh * hd] bf16, the input of o_proj.
// It writes k and v at `slots` (widened to fp32 exactly, or kept bf16), then runs `attend`'s per-head loop with q
// widened from bf16 and the output rounded to bf16 (round to nearest even, as .to(bf16)): the same
// numbers as cache.write + attend + the casts and transposes around them, which were ~12 ATen ops a
// layer whose copies grew with the rows (docs/reference/kernels.md).
at::Tensor attend_qkv(at::Tensor qk, at::Tensor qkv, int64_t v_off, at::Tensor kc, at::Tensor vc,
                         at::Tensor slots, at::Tensor vis, int64_t nh, double scale) {
  TORCH_CHECK(qk.dim() == 3 && qk.scalar_type() == at::kBFloat16 && qk.is_contiguous() &&
              qkv.dim() == 3 && qkv.scalar_type() == at::kBFloat16 && qkv.is_contiguous(), "attend_qkv: bf16 qk, qkv [B, T, C]");
  TORCH_CHECK(kc.dim() == 4 && (kc.scalar_type() == at::kFloat || kc.scalar_type() == at::kBFloat16) &&
              vc.scalar_type() == kc.scalar_type() && kc.is_contiguous() && vc.is_contiguous() && kc.sizes() == vc.sizes(),
              "attend_qkv: fp32 or bf16 caches [B, nkv, S_max, hd], both alike");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && vis.scalar_type() == at::kBool &&
              vis.is_contiguous() && vis.dim() == 3, "attend_qkv: slots [B, T] int64, vis [B, T, S] bool");
  const int64_t B = qk.size(0), T = qk.size(1), nkv = kc.size(1), Smax = kc.size(2), hd = kc.size(3);
  const int64_t S = vis.size(2), Cq = qk.size(2), C = qkv.size(2);
  TORCH_CHECK(kc.size(0) == B && qkv.size(0) == B && qkv.size(1) == T && slots.numel() == B * T &&
              vis.size(0) == B && vis.size(1) == T && S <= Smax && Cq >= (nh + nkv) * hd && v_off + nkv * hd <= C &&
              hd % 16 == 0 && hd <= 256 && nh % nkv == 0, "attend_qkv: shapes");
  const uint16_t* qkp = (const uint16_t*)qk.data_ptr<at::BFloat16>();
  const uint16_t* qkvp = (const uint16_t*)qkv.data_ptr<at::BFloat16>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; i++)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < Smax, "attend_qkv: slot out of the cache");
  with_cache(kc, vc, [&](auto* kp, auto* vp) {  // the cache write: k after RoPE, v as projected
    for (int64_t b = 0; b < B; b++)
      for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < nkv; g++) {
          const int64_t at = ((b * nkv + g) * Smax + sp[b * T + t]) * hd;
          cstore(kp + at, qkp + (b * T + t) * Cq + (nh + g) * hd, hd);
          cstore(vp + at, qkvp + (b * T + t) * C + v_off + g * hd, hd);
        }
  });
  auto out = fresh({B, T, nh * hd}, qk.options());
  std::vector<int32_t> big;
  const Slots vs = visible_slots(vis, big);
  uint16_t* op = (uint16_t*)out.data_ptr<at::BFloat16>();
  auto rows = [&](int64_t bt, int64_t head0, int64_t nr, float* qbuf, float* obuf, const float** qrow, float** orow) {
    for (int64_t r = 0; r < 4; r++) {  // q widened from bf16 into qbuf; the output into obuf
      const int64_t rr = r < nr ? r : 0;
      const uint16_t* qs = qkp + bt * Cq + (head0 + rr) * hd;
      for (int64_t c = 0; c < hd; c += 16) vstore(qbuf + r * hd + c, bf16x16_load(qs + c));
      qrow[r] = qbuf + r * hd;
      orow[r] = obuf + rr * hd;
    }
  };
  auto finish = [&](int64_t bt, int64_t head0, int64_t nr, int64_t n, float* const* orow) {
    uint16_t* o = op + bt * nh * hd + head0 * hd;  // [B, T, nh * hd]: o_proj's layout
    for (int64_t r = 0; r < nr; r++)
      for (int64_t c = 0; c < hd; c += 16)
        bf16x16_store(o + r * hd + c, n == 0 ? vzero() : vload(orow[r] + c));
  };
  with_cache(kc, vc, [&](auto* kp, auto* vp) {
    attend_tasks(B, T, nh, nkv, hd, S, Smax, kp, vp, vs, scale, rows, finish);
  });
  return out;
}

// The elementwise kernels below split their rows between threads in chunks of at least this many
// outputs: each row is computed alone, so the split changes no number. At a verify's 48 rows SiLU's
// division was one thread's 47 us a layer (docs/reference/kernels.md, "The tree's K/V move and the
// elementwise kernels on every thread").
#ifndef ELEM_GRAIN_ELEMS
#define ELEM_GRAIN_ELEMS 16384
#endif

// f(r0, r1) over rows [0, R) of `per_row` outputs each, split as above.
template <class F>
static void for_row_chunks(int64_t R, int64_t per_row, const F& f) {
  at::parallel_for(0, R, ELEM_GRAIN_ELEMS / per_row + 1, f);
}

// x [R, H] bf16 (updated in place to x + y, rounded to bf16, when y is given), w [H] bf16 ->
// h = w * bf16(x * rsqrt(mean(x^2) + eps)), HF's LlamaRMSNorm on the new x. H a multiple of 16.
// h: into `out` when given (x's shape, contiguous), else a new tensor.
static at::Tensor add_rmsnorm_to(at::Tensor x, c10::optional<at::Tensor> y, at::Tensor w, double eps,
                                    c10::optional<at::Tensor> out) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && w.scalar_type() == at::kBFloat16,
              "add_rmsnorm: bf16 x (contiguous) and weight");
  const int64_t H = x.size(-1), R = x.numel() / H;
  TORCH_CHECK(H % 16 == 0 && w.numel() == H, "add_rmsnorm: hidden size a multiple of 16");
  const bool add = y.has_value();
  if (add) TORCH_CHECK(y->scalar_type() == at::kBFloat16 && y->is_contiguous() && y->numel() == x.numel(), "add_rmsnorm: y like x");
  if (out) TORCH_CHECK(out->scalar_type() == at::kBFloat16 && out->is_contiguous() && out->sizes() == x.sizes(), "add_rmsnorm: out like x");
  auto h = out ? *out : fresh(x.sizes(), x.options());
  uint16_t* xp = (uint16_t*)x.data_ptr<at::BFloat16>();
  const uint16_t* yp = add ? (const uint16_t*)y->data_ptr<at::BFloat16>() : nullptr;
  const uint16_t* wp = (const uint16_t*)w.data_ptr<at::BFloat16>();
  uint16_t* hp = (uint16_t*)h.data_ptr<at::BFloat16>();
  for_row_chunks(R, H, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      uint16_t* xr = xp + r * H;
      vf ss = vzero();
      for (int64_t i = 0; i < H; i += 16) {
        vf v = bf16x16_load(xr + i);
        if (add) {
          bf16x16_store(xr + i, vadd(v, bf16x16_load(yp + r * H + i)));
          v = bf16x16_load(xr + i);  // the rounded sum: the residual stream is bf16
        }
        ss = vfma(v, v, ss);
      }
      const float inv = 1.0f / std::sqrt(vsum(ss) / (float)H + (float)eps);
      const vf iv = vset(inv);
      for (int64_t i = 0; i < H; i += 16) {
        const vf n = vmul(bf16x16_load(xr + i), iv);
        uint16_t tmp[16];
        bf16x16_store(tmp, n);  // .to(bf16) before the weight, as HF does
        bf16x16_store(hp + r * H + i, vmul(bf16x16_load(wp + i), bf16x16_load(tmp)));
      }
    }
  });
  return h;
}

at::Tensor add_rmsnorm(at::Tensor x, c10::optional<at::Tensor> y, at::Tensor w, double eps) {
  return add_rmsnorm_to(x, y, w, eps, c10::nullopt);
}

// gu [R, 2I] bf16 (gate | up, the fused projection's output) -> bf16(bf16(silu(gate)) * up) [R, I].
at::Tensor silu_mul(at::Tensor gu) {
  TORCH_CHECK(gu.scalar_type() == at::kBFloat16 && gu.is_contiguous(), "silu_mul: bf16 contiguous");
  const int64_t I2 = gu.size(-1), I = I2 / 2, R = gu.numel() / I2;
  TORCH_CHECK(I2 % 32 == 0, "silu_mul: intermediate size a multiple of 16");
  auto sizes = gu.sizes().vec();
  sizes.back() = I;
  auto out = fresh(sizes, gu.options());
  const uint16_t* gp = (const uint16_t*)gu.data_ptr<at::BFloat16>();
  uint16_t* op = (uint16_t*)out.data_ptr<at::BFloat16>();
  const vf one = vset(1.0f);
  for_row_chunks(R, I, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      for (int64_t i = 0; i < I; i += 16) {
        const vf g = bf16x16_load(gp + r * I2 + i);
        // silu(g) = g / (1 + exp(-g)); exp16 takes x <= 0, so: g >= 0: g / (1 + e), g < 0: g e / (1 + e),
        // with e = exp(-|g|)
        const vf e = exp16(vsub(vzero(), vabs(g)));
        const vf num = vmul_where_neg(g, e);
        uint16_t tmp[16];
        bf16x16_store(tmp, vdiv(num, vadd(one, e)));
        bf16x16_store(op + r * I + i, vmul(bf16x16_load(tmp), bf16x16_load(gp + r * I2 + I + i)));
      }
    }
  });
  return out;
}

// x [R, C] bf16 (contiguous rows; its first n * hd columns are n heads, e.g. q and k at the start of the
// fused q|k|v projection's output, read in place), cos/sin [R, hd] bf16 with rotate_half's sign folded
// into sin's first half -> [R, n * hd]: bf16(bf16(x * cos) + bf16(swap_halves(x) * sin)) per head, the
// roundings of eval/target.py's RoPE.
at::Tensor rope(at::Tensor x, int64_t n, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && cos.is_contiguous() && sin.is_contiguous()
              && cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16, "rope: bf16 contiguous");
  const int64_t C = x.size(-1), R = x.numel() / C, hd = cos.size(-1), half = hd / 2;
  TORCH_CHECK(hd % 2 == 0 && n * hd <= C && cos.numel() == R * hd && sin.numel() == R * hd,
              "rope: x [rows, >= n * hd], cos/sin [rows, hd]");
  auto out = fresh({R, n * hd}, x.options());
  const uint16_t* xp = (const uint16_t*)x.data_ptr<at::BFloat16>();
  const uint16_t* cp = (const uint16_t*)cos.data_ptr<at::BFloat16>();
  const uint16_t* sp = (const uint16_t*)sin.data_ptr<at::BFloat16>();
  uint16_t* op = (uint16_t*)out.data_ptr<at::BFloat16>();
  if (half % 16 == 0) {  // 16 lanes at a time (the head's halves are whole vectors): ~4x the scalar loop at 11 rows
    for_row_chunks(R, n * hd, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; r++)
        for (int64_t h = 0; h < n; h++) {
          const uint16_t* xr = xp + r * C + h * hd;
          uint16_t* o = op + (r * n + h) * hd;
          for (int64_t d = 0; d < hd; d += 16) {
            const vf a = bf16_round(vmul(bf16x16_load(xr + d), bf16x16_load(cp + r * hd + d)));
            const vf b = bf16_round(vmul(bf16x16_load(xr + (d < half ? d + half : d - half)), bf16x16_load(sp + r * hd + d)));
            bf16x16_store(o + d, vadd(a, b));
          }
        }
    });
    return out;
  }
  for (int64_t r = 0; r < R; r++)
    for (int64_t h = 0; h < n; h++) {
      const uint16_t* xr = xp + r * C + h * hd;
      uint16_t* o = op + (r * n + h) * hd;
      for (int64_t d = 0; d < hd; d++) {
        const float a = bf2f(f2bf(bf2f(xr[d]) * bf2f(cp[r * hd + d])));
        const float b = bf2f(f2bf(bf2f(xr[d < half ? d + half : d - half]) * bf2f(sp[r * hd + d])));
        o[d] = f2bf(a + b);
      }
    }
  return out;
}

// Columns [0, Vv) of one bf16 row (Vv a multiple of ARGMAX_LANES, > 0): each lane's maximum and the column
// where it first appeared (strictly greater replaces) into vals/ids; true when the row holds a NaN.
#if DS_AVX512
constexpr int ARGMAX_LANES = 16;
static bool lanes_max(const uint16_t* xr, int64_t Vv, float* vals, int32_t* ids) {
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 best = bf16x16_load(xr);
  __m512i bidx = idx;
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
  for (int64_t i = 16; i < Vv; i += 16) {
    const __m512 v = bf16x16_load(xr + i);
    idx = _mm512_add_epi32(idx, step);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    bidx = _mm512_mask_mov_epi32(bidx, gt, idx);
  }
  _mm512_store_ps(vals, best);
  _mm512_store_si512((__m512i*)ids, bidx);
  return nan != 0;
}
#else
constexpr int ARGMAX_LANES = 8;
static bool lanes_max(const uint16_t* xr, int64_t Vv, float* vals, int32_t* ids) {
  __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 best = bf16x8_load(xr);
  __m256i bidx = idx;
  const __m256i step = _mm256_set1_epi32(8);
  __m256 nan = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
  for (int64_t i = 8; i < Vv; i += 8) {
    const __m256 v = bf16x8_load(xr + i);
    idx = _mm256_add_epi32(idx, step);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, gt);
    bidx = _mm256_blendv_epi8(bidx, idx, _mm256_castps_si256(gt));
  }
  _mm256_store_ps(vals, best);
  _mm256_store_si256((__m256i*)ids, bidx);
  return _mm256_movemask_ps(nan) != 0;
}
#endif

// x [R, V] bf16 (contiguous rows) -> [R] int64, each row's index of its first maximum: the answer of
// torch's max(-1).indices, NaN included (a row holding a NaN answers its first NaN, as torch's max
// propagates it). Why by hand: the verify reads the argmax of every node's 49,152 logits, and ATen's
// bf16 max(-1) is several times slower than a read of a row's 98 KB (docs/reference/kernels.md).
// Each lane (16 on AVX-512, 8 on AVX2) keeps its own maximum and the index where it first appeared
// (strictly greater replaces), then the lanes reduce to the largest value at the smallest index.
at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.dim() >= 1 && x.size(-1) > 0,
              "argmax_rows: bf16 contiguous, non-empty last dim");
  const int64_t V = x.size(-1), R = x.numel() / V;
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  auto out = at::empty(sizes, x.options().dtype(at::kLong));
  const uint16_t* xp = (const uint16_t*)x.data_ptr<at::BFloat16>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const uint16_t* xr = xp + r * V;
      const int64_t Vv = V / ARGMAX_LANES * ARGMAX_LANES;
      alignas(64) float vals[ARGMAX_LANES];
      alignas(64) int32_t ids[ARGMAX_LANES];
      const bool nan = Vv > 0 && lanes_max(xr, Vv, vals, ids);
      float bv = -INFINITY;
      int64_t bi = -1;
      if (Vv > 0 && !nan)
        for (int l = 0; l < ARGMAX_LANES; l++)
          if (bi < 0 || vals[l] > bv || (vals[l] == bv && ids[l] < bi)) { bv = vals[l]; bi = ids[l]; }
      for (int64_t i = nan ? 0 : Vv; i < V; i++) {  // the tail, or every column of a row with a NaN
        const float v = bf2f(xr[i]);
        if (std::isnan(v)) { bi = i; break; }
        if (bi < 0 || v > bv) { bv = v; bi = i; }
      }
      op[r] = bi;
    }
  });
  return out;
}

// Inverse-CDF sampling (eval/cpu.py `cdf_search`, the same blocks and searches): ATen's
// version is ~12 small ops, 0.27 ms a row on the AVX2 EPYC where its arithmetic is a read of 192 KB
// (docs/reference/trees.md, "Sampling cost"). w [R, V] non-negative fp32 weights, u [R] uniforms in [0, 1)
// -> [R] ids: each 256-id block's mass summed in float64 (four lanes, then across them), the block whose
// running sum first exceeds u * total, then the id inside it by a float64 running sum; each search kept at
// the last id (block) with weight, so a zero-weight id is never drawn.
constexpr int64_t CDF_BLOCK = 256;
static double block_mass(const float* w, int64_t n) {
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd(), a2 = _mm256_setzero_pd(), a3 = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm_loadu_ps(w + i)));
    a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm_loadu_ps(w + i + 4)));
    a2 = _mm256_add_pd(a2, _mm256_cvtps_pd(_mm_loadu_ps(w + i + 8)));
    a3 = _mm256_add_pd(a3, _mm256_cvtps_pd(_mm_loadu_ps(w + i + 12)));
  }
  alignas(32) double l[4];
  _mm256_store_pd(l, _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3)));
  double s = (l[0] + l[1]) + (l[2] + l[3]);
  for (; i < n; i++) s += (double)w[i];
  return s;
}

at::Tensor cdf_sample(at::Tensor w, at::Tensor u) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.dim() == 2 && w.size(1) > 0,
              "cdf_sample: w fp32 contiguous [R, V], V > 0");
  TORCH_CHECK(u.scalar_type() == at::kDouble && u.is_contiguous() && u.numel() == w.size(0),
              "cdf_sample: u float64 [R]");
  const int64_t R = w.size(0), V = w.size(1), nb = (V + CDF_BLOCK - 1) / CDF_BLOCK;
  auto out = at::empty({R}, w.options().dtype(at::kLong));
  const float* wp = w.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 4, [&](int64_t r0, int64_t r1) {
    static thread_local std::vector<double> cdf_buf;
    double* cdf = grown(cdf_buf, (size_t)nb);
    for (int64_t r = r0; r < r1; r++) {
      const float* wr = wp + r * V;
      double run = 0.0;
      int64_t last = 0;  // the last block with mass
      for (int64_t j = 0; j < nb; j++) {
        const double m = block_mass(wr + j * CDF_BLOCK, std::min(CDF_BLOCK, V - j * CDF_BLOCK));
        if (m > 0) last = j;
        cdf[j] = run += m;
      }
      const double x = up[r] * cdf[nb - 1];
      int64_t b = std::upper_bound(cdf, cdf + nb, x) - cdf;
      b = std::min(b, last);
      const double y = x - (b > 0 ? cdf[b - 1] : 0.0);
      const float* wb = wr + b * CDF_BLOCK;
      const int64_t n = std::min(CDF_BLOCK, V - b * CDF_BLOCK);
      int64_t pick = -1, lastpos = 0;
      double acc = 0.0;
      for (int64_t i = 0; i < n; i++) {
        if (wb[i] > 0) lastpos = i;
        acc += (double)wb[i];
        if (pick < 0 && acc > y) pick = i;
      }
      op[r] = b * CDF_BLOCK + (pick < 0 ? lastpos : std::min(pick, lastpos));
    }
  });
  return out;
}

// One layer of the fused bf16 forward (eval/target.py `LeanLlama._forward_fused`) in one call: the same
// kernels in the same order, so the same numbers; what it saves is Python, ~10 calls and views a layer
// (docs/reference/kernels.md). x [B, T, H] the residual stream (updated in place), h [B, T, H] the input
// norm's output; w: (packed, bias) of q|k|v, o, gate|up and down from `pack` (bias fp32 or empty);
// cos/sin [B, T, hd]; the layer's caches, slots and vis as attend_qkv takes them; n1/n2: the
// post-attention norm and the next norm (the next layer's input norm, or the final one) -> their output, in
// `out` when given ([B, T, H] bf16, not x or h: the forward's buffers reused across layers), else a new tensor.
// B * T rows up to the path's kernel_rows (eval/cpu.py).
at::Tensor layer(at::Tensor x, at::Tensor h, std::vector<at::Tensor> w, std::vector<int64_t> n_out,
                    at::Tensor cos, at::Tensor sin, at::Tensor kc, at::Tensor vc, at::Tensor slots,
                    at::Tensor vis, int64_t nh, double scale, at::Tensor n1, double eps1, at::Tensor n2,
                    double eps2, c10::optional<at::Tensor> out) {
  TORCH_CHECK(w.size() == 8 && n_out.size() == 4 && x.dim() == 3 && h.sizes() == x.sizes(), "layer: 4 (packed, bias) pairs");
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), R = B * T, nkv = kc.size(1), hd = kc.size(3);
  // qkv, qk, a, o, h1, gate|up, silu, down: every output but the last, 64-byte aligned each
  Scratch scratch(2 * R * (n_out[0] + (nh + nkv) * hd + nh * hd + n_out[1] + H + n_out[2] + n_out[2] / 2 + n_out[3]) + 8 * 64);
  const auto qkv = linear(h.view({R, H}), w[0], w[1], n_out[0]);  // [R, q + k + v]
  const auto qk = rope(qkv, nh + nkv, cos, sin);  // [R, (nh + nkv) hd]
  const auto a = attend_qkv(qk.view({B, T, -1}), qkv.view({B, T, -1}), (nh + nkv) * hd, kc, vc, slots, vis, nh, scale);
  const auto h1 = add_rmsnorm(x, linear(a.view({R, nh * hd}), w[2], w[3], n_out[1]).view_as(x), n1, eps1);
  const auto mlp = linear(silu_mul(linear(h1.view({R, H}), w[4], w[5], n_out[2])), w[6], w[7], n_out[3]);
  scratch.close();  // the layer's output outlives the call
  return add_rmsnorm_to(x, mlp.view_as(x), n2, eps2, out);
}

// Every layer's k and v from cache slots src [B, P] to slots dst [B, P] of the same row (a tree round's accepted
// path to consecutive positions), each (layer, row, kv head)'s P slots read before any is written. K, V:
// [L, B, nkv, S_max, hd], fp32 or bf16, contiguous in their last two dims (a batch's later calls keep a view
// of fewer rows). As an indexed copy in ATen it cost 0.5-1 ms a round at batch 16 (docs/reference/kernels.md,
// "The tree's K/V move and the elementwise kernels on every thread").
void move_slots(at::Tensor K, at::Tensor V, at::Tensor src, at::Tensor dst) {
  TORCH_CHECK(K.dim() == 5 && K.sizes() == V.sizes() && K.strides() == V.strides() && K.scalar_type() == V.scalar_type() &&
              K.stride(4) == 1 && K.stride(3) == K.size(4), "move_slots: K, V [L, B, nkv, S_max, hd] alike, rows contiguous");
  TORCH_CHECK(src.scalar_type() == at::kLong && dst.scalar_type() == at::kLong && src.is_contiguous() && dst.is_contiguous() &&
              src.dim() == 2 && src.sizes() == dst.sizes() && src.size(0) == K.size(1), "move_slots: src, dst [B, P] int64");
  const int64_t L = K.size(0), B = K.size(1), nkv = K.size(2), Smax = K.size(3), P = src.size(1);
  const int64_t es = K.element_size(), row = K.size(4) * es;  // bytes of one slot of one head
  const int64_t* sp = src.data_ptr<int64_t>();
  const int64_t* dp = dst.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * P; i++)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < Smax && dp[i] >= 0 && dp[i] < Smax, "move_slots: slot out of the cache");
  const int64_t s0 = K.stride(0) * es, s1 = K.stride(1) * es, s2 = K.stride(2) * es;
  char* bases[2] = {(char*)K.data_ptr(), (char*)V.data_ptr()};
  at::parallel_for(0, 2 * L * B * nkv, 16, [&](int64_t i0, int64_t i1) {
    std::vector<char> buf(P * row);
    for (int64_t i = i0; i < i1; i++) {
      const int64_t h = i % nkv, b = (i / nkv) % B, l = (i / (nkv * B)) % L, which = i / (nkv * B * L);
      char* head = bases[which] + l * s0 + b * s1 + h * s2;  // [S_max, hd] of this layer, row and kv head
      for (int64_t p = 0; p < P; p++) std::memcpy(buf.data() + p * row, head + sp[b * P + p] * row, row);
      for (int64_t p = 0; p < P; p++) std::memcpy(head + dp[b * P + p] * row, buf.data() + p * row, row);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "pack a [N, K] bf16 weight for linear");
  m.def("linear", &linear, "y = x @ W^T (+ b), any M (row-invariant)");
  m.def("attend", &attend, "fp32 attention of each row over its visible cache slots (fp32 or bf16 caches), row-invariant");
  m.def("add_rmsnorm", &add_rmsnorm, "x += y (bf16, in place) then HF's RMSNorm of x", py::arg("x"), py::arg("y"),
        py::arg("w"), py::arg("eps"));
  m.def("silu_mul", &silu_mul, "bf16(silu(gate)) * up from the fused [gate | up]");
  m.def("pack_i8", &pack_i8, "W [N, K] -> (int8 weights packed for linear_i8, per-output scales)");
  m.def("linear_i8", &linear_i8, "y = x @ (s * q)^T (+ b), int8 weights");
  m.def("layer", &layer, "one Llama layer of the fused bf16 forward, any rows (packed weights)");
  m.def("attend_qkv", &attend_qkv, "write k, v at slots, then attend from the bf16 projections -> bf16 [B, T, nh * hd]");
  m.def("cdf_sample", &cdf_sample, "one id per row of non-negative fp32 weights by inverse CDF over 256-id blocks, float64 sums");
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum (bf16 rows), as torch's max(-1).indices");
  m.def("amx_ready", &amx_ready, "whether the matmul runs on AMX tiles here (built for amx-bf16, and Linux granted AMX)");
  m.def("move_slots", &move_slots, "copy every layer's k/v cache slots src [B, P] -> dst [B, P] per row, all reads first");
  m.def("rope", &rope, "RoPE on the first n heads of each row, cos and signed sin [rows, hd], bf16 roundings of eval/target.py");
}
