// The block-quantized product in bfloat16 with AVX512-BF16's pair products, for the rows of prompt tokens
// where the engine multiplies in bfloat16 (its default on CPUs with bf16 units), on CPUs without AMX's
// bf16 tiles (AMD EPYC since Zen 4, Intel Xeons of Cooper Lake). Included by cpu_kernels.cc after
// vnni_matmul.h; see parrot_qmatmul there for the operands.
//
// Numbers, as on AMX's bf16 tiles (amx_bf16.h): the weights are dequantized to float32 as the file
// defines them (d q + m) and rounded to bfloat16; the activations are rounded to bfloat16; vdpbf16ps adds
// products of pairs into float32 accumulators, over the whole of K in order. Every output is computed by
// the same instructions in the same order whatever the number of rows, so a row's result is bit for bit
// the same alone and in any batch.
//
// Work. A panel of 16 weight rows, [K/2 pairs][16 rows] (each 32-bit lane one row's pair of weights),
// is dequantized once per call (a 16 x 16 transpose of pairs per block) and read by every token; a
// step of the product is one panel vector of each of three panels against one broadcast pair of each of
// eight tokens: 24 sums in registers, 11 loads for 24 pair products (two panels of twelve tokens took 14,
// and 8-10% longer on a Zen 4).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "aligned.h"
#include "vnni_matmul.h"

namespace avx512bf16 {

constexpr int kPanels = 3;  // panels of 16 weight rows multiplied together (with 8 tokens: 24 sums in registers)

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// One block of one weight row as 32 bfloat16 (16 pairs, in order).
template <class F>
inline __m512i block_pairs(const uint8_t* blk) {
  const __m512 d = _mm512_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk)));
  __m512 lo, hi;
  if constexpr (F::kSigned) {  // Q8_0: d q, q signed bytes
    const __m128i* q = reinterpret_cast<const __m128i*>(blk + F::kQs);
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
  } else {  // Q4: weight j < 16 is byte j's low nibble, j >= 16 byte j - 16's high nibble
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + F::kQs)));
    const __m512i nib = _mm512_set1_epi32(0x0F);
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, nib));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
    __m512 m;
    if constexpr (F::kMin == 1) m = _mm512_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(blk + 2)));
    else m = _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
    lo = _mm512_fmadd_ps(d, q0, m);
    hi = _mm512_fmadd_ps(d, q1, m);
  }
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// r[i] lane j -> r[j] lane i (16 x 16 dwords)
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int k = 0; k < 16; k += 4) {  // u[k + c], 128-bit lane L: rows k..k+3 of column 4L + c
    u[k] = _mm512_unpacklo_epi64(t[k], t[k + 2]);
    u[k + 1] = _mm512_unpackhi_epi64(t[k], t[k + 2]);
    u[k + 2] = _mm512_unpacklo_epi64(t[k + 1], t[k + 3]);
    u[k + 3] = _mm512_unpackhi_epi64(t[k + 1], t[k + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // 4 x 4 transposes of 128-bit lanes
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88), y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// Weight rows [n, n + 16) (those past n1 zero) as a panel [K/2 pairs][16 rows]; the next rows are fetched
// meanwhile.
template <class F>
void pack_panel(const uint8_t* w, int64_t ldw, int64_t blocks, int64_t n, int64_t n1, __m512i* panel) {
  const int64_t ahead = std::min<int64_t>(16, n1 - (n + 16));
  for (int64_t b = 0; b < blocks; ++b) {
    if (ahead > 0) vnni::prefetch_slice(w + (n + 16) * ldw, ahead * ldw, b, blocks);
    __m512i r[16];
    for (int i = 0; i < 16; ++i)
      r[i] = n + i < n1 ? block_pairs<F>(w + (n + i) * ldw + b * F::kBytes) : _mm512_setzero_si512();
    transpose16x16(r);
    for (int j = 0; j < 16; ++j) _mm512_store_si512(panel + b * 16 + j, r[j]);
  }
}

// x [T, K] float32 -> bfloat16 pairs [T][K/2].
inline void pack_x(const float* x, int64_t T, int64_t K, aligned::vector<uint32_t>& out) {
  out.resize(T * K / 2);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; k += 32) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + t * K + k + 16), _mm512_loadu_ps(x + t * K + k));
      _mm512_store_si512(out.data() + (t * K + k) / 2, (__m512i)v);
    }
}

// Tokens [t0, t0 + R) times NP panels of 16 weight rows each (rows n + 16 q.., panel q at p + q * pairs), into y.
template <int NP, int R>
inline void tokens(const uint32_t* xb, int64_t K, int64_t t0, const __m512i* p, float* y, int64_t N, int64_t n,
                   int64_t n1) {
  __m512 a[NP][R];
  for (int q = 0; q < NP; ++q)
    for (int r = 0; r < R; ++r) a[q][r] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  const uint32_t* x = xb + t0 * pairs;
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh w[NP];
    for (int q = 0; q < NP; ++q) w[q] = as_bh(_mm512_load_si512(p + q * pairs + i));
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = as_bh(_mm512_set1_epi32(static_cast<int>(x[r * pairs + i])));
      for (int q = 0; q < NP; ++q) a[q][r] = _mm512_dpbf16_ps(a[q][r], w[q], xv);
    }
  }
  for (int q = 0; q < NP; ++q) {
    const int64_t left = n1 - n - 16 * q;
    const __mmask16 m = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (t0 + r) * N + n + 16 * q, m, a[q][r]);
  }
}

// Tokens [t, t + left) times NP panels, left < R.
template <int NP, int R>
inline void tail(const uint32_t* xb, int64_t K, int64_t t, int64_t left, const __m512i* p, float* y, int64_t N,
                 int64_t n, int64_t n1) {
  if constexpr (R > 0) {
    if (left == R) return tokens<NP, R>(xb, K, t, p, y, N, n, n1);
    tail<NP, R - 1>(xb, K, t, left, p, y, N, n, n1);
  }
}

// Every token times NP panels, R tokens at a time (NP x R sums held in registers), then the rest.
template <int NP, int R>
inline void all_tokens(const uint32_t* xb, int64_t T, int64_t K, const __m512i* p, float* y, int64_t N, int64_t n,
                       int64_t n1) {
  int64_t t = 0;
  for (; t + R <= T; t += R) tokens<NP, R>(xb, K, t, p, y, N, n, n1);
  tail<NP, R - 1>(xb, K, t, T - t, p, y, N, n, n1);
}

// Output columns [n0, n1) of every activation row (`xb`: pack_x's pairs), kPanels x 16 weight rows at a time.
template <class F>
void rows(const uint32_t* xb, int64_t T, int64_t K, const uint8_t* w, int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t blocks = K / 32, ldw = blocks * F::kBytes;
  thread_local aligned::vector<aligned::Bits512> panels;
  panels.resize(kPanels * blocks * 16);
  __m512i* p = reinterpret_cast<__m512i*>(panels.data());
  for (int64_t n = n0; n < n1; n += 16 * kPanels) {
    const int np = static_cast<int>(std::min<int64_t>(kPanels, (n1 - n + 15) / 16));
    for (int q = 0; q < np; ++q) pack_panel<F>(w, ldw, blocks, n + 16 * q, n1, p + q * blocks * 16);
    if (np == 3) all_tokens<3, 8>(xb, T, K, p, y, N, n, n1);
    else if (np == 2) all_tokens<2, 12>(xb, T, K, p, y, N, n, n1);
    else all_tokens<1, 16>(xb, T, K, p, y, N, n, n1);
  }
}

}  // namespace avx512bf16
