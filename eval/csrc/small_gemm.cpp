// y[M, N] = x[M, K] @ W[N, K]^T (+ b) in bf16 with fp32 accumulation, for M <= 16 rows on CPUs with
// AVX512-BF16. Why by hand: see eval/kernels.py. W is packed once (`pack`) so that one 64-byte load
// holds 16 output rows x 2 consecutive k, and `vdpbf16ps` against a broadcast pair of x accumulates
// 16 outputs at once: no horizontal sums, and W is streamed exactly once whatever M is. The sum for
// each output runs over k in the same order for every M, so a row's result does not depend on how
// many other rows share the call (a verify forward rounds like a one-token step).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>

// W [N, K] bf16 -> [ceil(N/16), K/2, 16, 2] bf16 (N zero-padded to a multiple of 16). K must be even.
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack: a 2-d bf16 weight");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % 2 == 0, "pack: in_features must be even");
  const int64_t Nb = (N + 15) / 16, Kp = K / 2;
  auto wp = torch::zeros({Nb * 16, K}, w.options());
  wp.narrow(0, 0, N).copy_(w);
  return wp.view({Nb, 16, Kp, 2}).permute({0, 2, 1, 3}).contiguous();
}

// Blocks [b0, b1) of 16 outputs, NB blocks at a time, all M rows: M*NB accumulators stay in registers.
template <int M, int NB>
static void run_blocks(const int32_t* x, int64_t Kp, const uint16_t* p, const float* bias,
                       int64_t b0, int64_t b1, uint16_t* y, int64_t N) {
  for (int64_t b = b0; b < b1; b += NB) {
    __m512 acc[M][NB];
    for (int j = 0; j < NB; j++) {
      __m512 init = bias ? _mm512_loadu_ps(bias + (b + j) * 16) : _mm512_setzero_ps();
      for (int m = 0; m < M; m++) acc[m][j] = init;
    }
    const __m512i* w[NB];
    for (int j = 0; j < NB; j++) w[j] = reinterpret_cast<const __m512i*>(p + (b + j) * Kp * 32);
    for (int64_t kp = 0; kp < Kp; kp++) {
      __m512bh wv[NB];
      for (int j = 0; j < NB; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w[j] + kp);
      for (int m = 0; m < M; m++) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(x[m * Kp + kp]);  // x[m, 2kp:2kp+2] in every lane
        for (int j = 0; j < NB; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xb);
      }
    }
    for (int j = 0; j < NB; j++) {
      const int64_t n0 = (b + j) * 16;
      const int64_t left = N - n0;
      const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
      for (int m = 0; m < M; m++) {
        const __m256i r = (__m256i)_mm512_cvtneps_pbh(acc[m][j]);  // round to nearest even, as torch does
        _mm256_mask_storeu_epi16(y + m * N + n0, mask, r);
      }
    }
  }
}

template <int M>
static void run_rows(const int32_t* x, int64_t Kp, const uint16_t* p, const float* bias, int64_t Nb,
                     uint16_t* y, int64_t N) {
  // Enough blocks per accumulator set to reuse each broadcast, few enough to stay in 32 registers.
  constexpr int NB = M <= 4 ? 4 : (M <= 12 ? 2 : 1);
  const int64_t groups = Nb / NB;
  at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
    run_blocks<M, NB>(x, Kp, p, bias, g0 * NB, g1 * NB, y, N);
  });
  if (groups * NB < Nb) run_blocks<M, 1>(x, Kp, p, bias, groups * NB, Nb, y, N);
}

// x [M, K] bf16 contiguous, packed from `pack`, bias fp32 [Nb*16] or empty -> y [M, N] bf16.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "linear: x [M, K] bf16");
  const int64_t M = x.size(0), K = x.size(1), Nb = packed.size(0), Kp = packed.size(1);
  TORCH_CHECK(K == 2 * Kp && M >= 1 && M <= 16, "linear: K must match the packed weight and 1 <= M <= 16");
  auto y = torch::empty({M, N}, x.options());
  const int32_t* xp = reinterpret_cast<const int32_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  switch (M) {
#define CASE(m) case m: run_rows<m>(xp, Kp, pp, bp, Nb, yp, N); break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
    CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "pack a [N, K] bf16 weight for linear");
  m.def("linear", &linear, "y = x @ W^T (+ b), M <= 16 rows");
}
