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
// step of the product is one panel vector of each of two panels against one broadcast pair of each of
// up to kTokens tokens.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "aligned.h"
#include "vnni_matmul.h"

namespace avx512bf16 {

constexpr int kTokens = 12;  // tokens whose sums are held in registers (x 2 panels of 16 weight rows)

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

// Tokens [t0, t0 + R) times the panels p0 (rows n..) and p1 (rows n + 16.., where `two`), into y.
template <int R>
inline void tokens(const uint32_t* xb, int64_t K, int64_t t0, const __m512i* p0, const __m512i* p1, bool two,
                   float* y, int64_t N, int64_t n, int64_t n1) {
  __m512 a[R], c[R];
  for (int r = 0; r < R; ++r) a[r] = c[r] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  const uint32_t* x = xb + t0 * pairs;
  if (two) {
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512bh w0 = as_bh(_mm512_load_si512(p0 + p)), w1 = as_bh(_mm512_load_si512(p1 + p));
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = as_bh(_mm512_set1_epi32(static_cast<int>(x[r * pairs + p])));
        a[r] = _mm512_dpbf16_ps(a[r], w0, xv);
        c[r] = _mm512_dpbf16_ps(c[r], w1, xv);
      }
    }
  } else {
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512bh w0 = as_bh(_mm512_load_si512(p0 + p));
      for (int r = 0; r < R; ++r) a[r] = _mm512_dpbf16_ps(a[r], w0, as_bh(_mm512_set1_epi32(static_cast<int>(x[r * pairs + p]))));
    }
  }
  const __mmask16 m0 = static_cast<__mmask16>(n1 - n >= 16 ? 0xFFFF : (1u << (n1 - n)) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (t0 + r) * N + n, m0, a[r]);
  if (two) {
    const int64_t left = n1 - n - 16;
    const __mmask16 m1 = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (t0 + r) * N + n + 16, m1, c[r]);
  }
}

// Output columns [n0, n1) of every activation row (`xb`: pack_x's pairs), 32 weight rows at a time.
template <class F>
void rows(const uint32_t* xb, int64_t T, int64_t K, const uint8_t* w, int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t blocks = K / 32, ldw = blocks * F::kBytes;
  thread_local aligned::vector<aligned::Bits512> panels;
  panels.resize(2 * blocks * 16);
  __m512i* p0 = reinterpret_cast<__m512i*>(panels.data());
  __m512i* p1 = p0 + blocks * 16;
  for (int64_t n = n0; n < n1; n += 32) {
    const bool two = n + 16 < n1;
    pack_panel<F>(w, ldw, blocks, n, n1, p0);
    if (two) pack_panel<F>(w, ldw, blocks, n + 16, n1, p1);
    int64_t t = 0;
    for (; t + kTokens <= T; t += kTokens) tokens<kTokens>(xb, K, t, p0, p1, two, y, N, n, n1);
    switch (T - t) {
      case 11: tokens<11>(xb, K, t, p0, p1, two, y, N, n, n1); break;
      case 10: tokens<10>(xb, K, t, p0, p1, two, y, N, n, n1); break;
      case 9: tokens<9>(xb, K, t, p0, p1, two, y, N, n, n1); break;
      case 8: tokens<8>(xb, K, t, p0, p1, two, y, N, n, n1); break;
      case 7: tokens<7>(xb, K, t, p0, p1, two, y, N, n, n1); break;
      case 6: tokens<6>(xb, K, t, p0, p1, two, y, N, n, n1); break;
      case 5: tokens<5>(xb, K, t, p0, p1, two, y, N, n, n1); break;
      case 4: tokens<4>(xb, K, t, p0, p1, two, y, N, n, n1); break;
      case 3: tokens<3>(xb, K, t, p0, p1, two, y, N, n, n1); break;
      case 2: tokens<2>(xb, K, t, p0, p1, two, y, N, n, n1); break;
      case 1: tokens<1>(xb, K, t, p0, p1, two, y, N, n, n1); break;
      default: break;
    }
  }
}

}  // namespace avx512bf16
