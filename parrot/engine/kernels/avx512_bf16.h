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

#ifdef __AVX512VBMI__
#define PARROT_TILED_PAIRS 1
// One block of 16 weight rows from their tiled copy (tiled_rows.h; `blk`: the block's scales, then its bytes
// in lanes) as 16 rows of pairs, out[p] lane r = (w[r][2p], w[r][2p + 1]) in bfloat16: what block_pairs
// and a transpose give, the same values by the same float32 steps (d q + m; Q4_0's m = -8 d; Q8_0's d q),
// with no transpose: a byte permute (vpermb) takes each pair's bytes of eight rows straight into 32-bit
// lanes. The last tile's padding rows are zeros (Q8_0's may come out as -0: no output reads them).
template <class F>
inline void tiled_pairs(const uint8_t* blk, __m512i* out) {
  // dword i of a permute: row rows0 + i / 2, weight byte 4 row + c0 + i % 2 (c0: 0 or 2, the group's first
  // or second pair); the other bytes zero
  struct Index {
    alignas(64) uint8_t b[4][64] = {};
    constexpr Index() {
      for (int k = 0; k < 4; ++k)
        for (int i = 0; i < 16; ++i) b[k][4 * i] = static_cast<uint8_t>(4 * (8 * (k % 2) + i / 2) + 2 * (k / 2) + i % 2);
    }
  };
  static constexpr Index kIndex;
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
  __m512 m = _mm512_setzero_ps();
  if constexpr (F::kMin == 1) m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
  else if constexpr (F::kMin == 2) m = _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
  const __m512i twice = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);  // rows 0-7, each twice
  const __m512i twice8 = _mm512_add_epi32(twice, _mm512_set1_epi32(8));                   // rows 8-15
  const __m512 d0 = _mm512_permutexvar_ps(twice, d), d1 = _mm512_permutexvar_ps(twice8, d);
  const __m512 m0 = _mm512_permutexvar_ps(twice, m), m1 = _mm512_permutexvar_ps(twice8, m);
  __m512i idx[4];
  for (int k = 0; k < 4; ++k) idx[k] = _mm512_load_si512(kIndex.b[k]);
  constexpr __mmask64 kDwords = 0x1111111111111111ull;
  auto pair_row = [&](__m512i q0, __m512i q1, int p) {  // integer weights of rows 0-7 and 8-15 -> out[p]
    __m512 f0 = _mm512_cvtepi32_ps(q0), f1 = _mm512_cvtepi32_ps(q1);
    if constexpr (F::kSigned) f0 = _mm512_mul_ps(d0, f0), f1 = _mm512_mul_ps(d1, f1);
    else f0 = _mm512_fmadd_ps(d0, f0, m0), f1 = _mm512_fmadd_ps(d1, f1, m1);
    _mm512_store_si512(out + p, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
  };
  const uint8_t* q = blk + tiled::kTileScaleBytes<F>;
  for (int c = 0; c < (F::kSigned ? 8 : 4); ++c) {  // 64-byte group c: bytes 4c..4c+3 of every row
    const __m512i v = _mm512_loadu_si512(q + 64 * c);
    __m512i g[4];  // pair 0 of the group for rows 0-7, 8-15; pair 1 for rows 0-7, 8-15
    for (int k = 0; k < 4; ++k) g[k] = _mm512_maskz_permutexvar_epi8(kDwords, idx[k], v);
    if constexpr (F::kSigned) {  // the copy's bytes are q + 128
      const __m512i k128 = _mm512_set1_epi32(128);
      pair_row(_mm512_sub_epi32(g[0], k128), _mm512_sub_epi32(g[1], k128), 2 * c);
      pair_row(_mm512_sub_epi32(g[2], k128), _mm512_sub_epi32(g[3], k128), 2 * c + 1);
    } else {  // low nibbles: weights 4c.., high nibbles: 16 + 4c..
      const __m512i nib = _mm512_set1_epi32(0x0F);
      pair_row(_mm512_and_si512(g[0], nib), _mm512_and_si512(g[1], nib), 2 * c);
      pair_row(_mm512_and_si512(g[2], nib), _mm512_and_si512(g[3], nib), 2 * c + 1);
      pair_row(_mm512_srli_epi32(g[0], 4), _mm512_srli_epi32(g[1], 4), 8 + 2 * c);
      pair_row(_mm512_srli_epi32(g[2], 4), _mm512_srli_epi32(g[3], 4), 9 + 2 * c);
    }
  }
}
#else
#define PARROT_TILED_PAIRS 0
#endif

// Weight rows [n, n + 16) (those past n1 zero) as a panel [K/2 pairs][16 rows]; the next rows are fetched
// meanwhile.
// With the tiled copy `wt` (n a multiple of 16), from its tile of the 16 rows (tiled_pairs; rows past n1 are
// there too, and their outputs never written).
template <class F>
void pack_panel(const uint8_t* w, const uint8_t* wt, int64_t ldw, int64_t blocks, int64_t n, int64_t n1,
                __m512i* panel) {
  const int64_t ahead = std::min<int64_t>(16, n1 - (n + 16));
#if PARROT_TILED_PAIRS
  if (wt != nullptr) {
    const uint8_t* tile = wt + n / 16 * blocks * tiled::kTileBlockBytes<F>;
    for (int64_t b = 0; b < blocks; ++b) {
      if (ahead > 0) tiled::prefetch_block<F>(tile + blocks * tiled::kTileBlockBytes<F>, b);
      tiled_pairs<F>(tile + b * tiled::kTileBlockBytes<F>, panel + b * 16);
    }
    return;
  }
#else
  (void)wt;
#endif
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
// `wt`: the weights' tiled copy (or null: the GGUF rows), n0 a multiple of 16.
template <class F>
void rows(const uint32_t* xb, int64_t T, int64_t K, const uint8_t* w, const uint8_t* wt, int64_t n0, int64_t n1,
          float* y, int64_t N) {
  const int64_t blocks = K / 32, ldw = blocks * F::kBytes;
  thread_local aligned::vector<aligned::Bits512> panels;
  panels.resize(kPanels * blocks * 16);
  __m512i* p = reinterpret_cast<__m512i*>(panels.data());
  for (int64_t n = n0; n < n1; n += 16 * kPanels) {
    const int np = static_cast<int>(std::min<int64_t>(kPanels, (n1 - n + 15) / 16));
    for (int q = 0; q < np; ++q) pack_panel<F>(w, wt, ldw, blocks, n + 16 * q, n1, p + q * blocks * 16);
    if (np == 3) all_tokens<3, 8>(xb, T, K, p, y, N, n, n1);
    else if (np == 2) all_tokens<2, 12>(xb, T, K, p, y, N, n, n1);
    else all_tokens<1, 16>(xb, T, K, p, y, N, n, n1);
  }
}

}  // namespace avx512bf16
