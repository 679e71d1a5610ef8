// The block-quantized product on AVX-512 VNNI, exact in integers, for any number of activation rows
// (CPUs with AVX-512 VNNI: Intel since Cascade Lake, AMD since Zen 4). Included by cpu_kernels.cc (and
// by amx_matmul.h, whose tile path shares the activations' packing and the float32 steps); see
// parrot_qmatmul there for the operands.
//
// Numbers. The weights are the blocks' integers as the file stores them (Q4: 0..15, Q8_0: -128..127).
// Each block of 32 activations is written as x = s * (65536 l0 + 256 l1 + l2), s = max|x| / 2^22, with
// three signed byte limbs (the rounding of x to 23 bits below its block's largest activation is the only
// error). The integer sums S_l = sum_k w_k l_k are exact in int32, whatever computes them and in whatever
// order; float32 then computes, block after block, acc += (65536 S0 + 256 S1 + S2) * (d * s), and
// acc += m * sum(x) for the blocks with a minimum (Q4_1's m, Q4_0's -8 d). These float32 steps are the
// same for every row whatever the others are (and the same on AMX's tiles), so a row's result is bit for
// bit the same alone and in any batch, decode or prefill. Compared with the float32 product with the
// dequantized matrix, the error is of the order of float32 rounding (tests: rtol 1e-5; the model's logits
// within 1e-4 of transformers').
//
// VNNI. Each 32-bit lane is one of 16 weight rows; vpdpbusd multiplies four of its weights (unsigned
// bytes: Q4's nibbles as they are, Q8_0's plus 128, taken off again as 128 times the limbs' sum) by four
// limb bytes broadcast to every lane. A block's weights are transposed once for up to 16 activation rows
// (a token group); more rows go in groups of 16 over the same 16 weight rows, which stay in the cache.
// With 2 limbs and many rows, `lanes_rows` (below) puts the tokens in the lanes instead.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "aligned.h"
#include "avx2_int8.h"
#include "tiled_rows.h"

namespace vnni {

constexpr int kGroupRows = 16;  // activation rows (tokens) multiplied per pass over 16 weight rows

using tiled::kTileBlockBytes;
using tiled::kTileScaleBytes;
using tiled::prefetch_slice;

// ---- activations ----------------------------------------------------------------------------------
// Token tiles of tn = min(T, 16) tokens (the last one padded with zero tokens).
struct XPack {
  int64_t T = 0, tn = 0, tiles = 0, blocks = 0;
  int limbs = 3;                        // 2: the last limb is zero and skipped (15 bits below the block's largest)
  bool for_tiles = false;               // packed for AMX's tiles (`b`) or for VNNI (`rows`, `limb_sums`)
  bool lanes = false;                   // 2 limbs as int16 pairs with tokens in lanes (`pairs`, below)
  aligned::vector<uint32_t> b;          // tiles: [tiles][blocks][3 limbs][8 groups][tn]
  aligned::vector<float> scales;        // [tiles][blocks][16]: s per token
  aligned::vector<float> scales256;     // the same for 2 limbs: 256 s (exact), see block_tokens
  aligned::vector<float> sums;          // [tiles][blocks][16]: sum(x) per token
  // VNNI (and AMX's tiles from the tiled weights, amx::tiled_rows): each row's limbs contiguous, and their
  // sums; the last token tile padded with zero rows (a tile loads all of its tn rows)
  aligned::vector<uint32_t> rows;       // [tiles * tn][blocks][3 limbs][8 groups]
  aligned::vector<int32_t> limb_sums;   // [tiles * tn][blocks][3]
  // tokens in lanes: each 2-limb activation 256 l0 + l1 as one int16, pairs (x[2j], x[2j+1]) in a 32-bit lane
  aligned::vector<uint32_t> pairs;      // [tiles][blocks][16 pairs][16 tokens]
};

// `tiles`: for AMX's tile unit (`b`), else for VNNI (`rows`), or with `lanes` (2 limbs only) for
// `lanes_rows` (`pairs`); scales and sums are laid out alike for all three.
inline void pack_x(const float* x, int64_t T, int64_t K, XPack& p, int limbs = 3, bool for_tiles = false,
                   bool lanes = false) {
  lanes = lanes && limbs == 2 && !for_tiles;
  p.T = T, p.blocks = K / 32, p.limbs = limbs, p.for_tiles = for_tiles, p.lanes = lanes;
  p.tn = std::min<int64_t>(T, 16);
  p.tiles = (T + p.tn - 1) / p.tn;
  const bool vnni = !for_tiles && !lanes;
  p.b.assign(for_tiles ? p.tiles * p.blocks * 3 * 8 * p.tn : 0, 0);
  p.scales.assign(p.tiles * p.blocks * 16, 0.f);
  p.scales256.assign(limbs == 2 ? p.tiles * p.blocks * 16 : 0, 0.f);
  p.sums.assign(p.tiles * p.blocks * 16, 0.f);
  p.rows.assign(vnni ? p.tiles * p.tn * p.blocks * 24 : 0, 0);
  p.limb_sums.assign(vnni ? p.tiles * p.tn * p.blocks * 3 : 0, 0);
  p.pairs.assign(lanes ? p.tiles * p.blocks * 256 : 0, 0);
  const __m512i c128 = _mm512_set1_epi32(128), c255 = _mm512_set1_epi32(255);
  alignas(64) uint32_t limb[3][8];
  for (int64_t t = 0; t < T; ++t) {
    const int64_t tile = t / p.tn, col = t % p.tn;
    for (int64_t b = 0; b < p.blocks; ++b) {
      const float* xb = x + t * K + b * 32;
      const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
      const int64_t at = (tile * p.blocks + b) * 16 + col;
      const __m256 halves[4] = {_mm512_castps512_ps256(x0), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x0), 1)),
                                _mm512_castps512_ps256(x1), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x1), 1))};
      p.sums[at] = avx2i8::sum32(halves);  // one tree of additions whatever the compiler: the AVX2 code's
      const float a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      // (max_ps passes a NaN on only from its second operand, so NaNs are looked for apart)
      const bool nan = (_mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q)) != 0;
      if (nan || !(a <= 3.4e38f)) {  // NaN or infinity: the products become NaN, as in float32
        p.scales[at] = NAN;
        if (!p.scales256.empty()) p.scales256[at] = NAN;
        continue;
      }
      if (!(a >= 1e-30f)) continue;  // zero (or too small to scale to 2^22): limbs and scale stay zero
      p.scales[at] = a / 4194304.f;
      if (!p.scales256.empty()) p.scales256[at] = a / 16384.f;  // 256 s: both divisions by powers of 2 are exact
      // two limbs: x rounded to 2^14 steps of the block's largest, written as 256 times that integer
      // (limbs 0 and 1 as three limbs would have them, limb 2 zero), so the sums and scales are the same
      const __m512 inv = _mm512_set1_ps((limbs == 2 ? 16384.f : 4194304.f) / a);
      __m512i lsum[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
      for (int h = 0; h < 2; ++h) {
        const __m512i xi = _mm512_cvtps_epi32(_mm512_mul_ps(h ? x1 : x0, inv));  // |xi| <= 2^22 + 1
        if (lanes) {  // |xi| <= 2^14 + 1: as int16, pairs 8h .. 8h + 7
          alignas(32) uint32_t pr[8];
          _mm256_store_si256(reinterpret_cast<__m256i*>(pr), _mm512_cvtepi32_epi16(xi));
          uint32_t* dst = p.pairs.data() + ((tile * p.blocks + b) * 16 + 8 * h) * 16 + col;
          for (int j = 0; j < 8; ++j) dst[j * 16] = pr[j];
          continue;
        }
        __m512i l2 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(xi, c128), c255), c128);
        __m512i r = _mm512_srai_epi32(_mm512_sub_epi32(xi, l2), 8);
        if (limbs == 2) r = xi, l2 = _mm512_setzero_si512();
        const __m512i l1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(r, c128), c255), c128);
        const __m512i l0 = _mm512_srai_epi32(_mm512_sub_epi32(r, l1), 8);  // |l0| <= 64
        _mm_store_si128(reinterpret_cast<__m128i*>(limb[0] + 4 * h), _mm512_cvtepi32_epi8(l0));
        _mm_store_si128(reinterpret_cast<__m128i*>(limb[1] + 4 * h), _mm512_cvtepi32_epi8(l1));
        _mm_store_si128(reinterpret_cast<__m128i*>(limb[2] + 4 * h), _mm512_cvtepi32_epi8(l2));
        lsum[0] = _mm512_add_epi32(lsum[0], l0), lsum[1] = _mm512_add_epi32(lsum[1], l1);
        lsum[2] = _mm512_add_epi32(lsum[2], l2);
      }
      if (lanes) continue;
      for (int l = 0; l < limbs; ++l) {  // two limbs: the third's bytes and sum stay zero (assign)
        if (for_tiles) {
          uint32_t* dst = p.b.data() + ((tile * p.blocks + b) * 3 + l) * 8 * p.tn + col;
          for (int r = 0; r < 8; ++r) dst[r * p.tn] = limb[l][r];
        } else {
          std::memcpy(p.rows.data() + (t * p.blocks + b) * 24 + l * 8, limb[l], 32);
          p.limb_sums[(t * p.blocks + b) * 3 + l] = _mm512_reduce_add_epi32(lsum[l]);
        }
      }
    }
  }
}

// ---- shared pieces --------------------------------------------------------------------------------
alignas(64) inline constexpr uint8_t kZeros[32] = {};

// 16 rows' scales d (and minima m) for one block, from the first 4 bytes of each row's block.
template <class F>
inline void scales(const uint8_t* blk, __m512i offsets, __mmask16 rowmask, __m512& d, __m512& m) {
  const __m512i dm = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rowmask, offsets, blk, 1);
  d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
  if constexpr (F::kMin == 1) m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
  else if constexpr (F::kMin == 2) m = _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
  else m = _mm512_setzero_ps();
}

inline __m512i row_offsets(int64_t ldw) {
  return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                            _mm512_set1_epi32(static_cast<int>(ldw)));
}

// 65536 S0 + 256 S1 + S2 in float32, the same steps in every path
inline __m512 limb_sum(__m512i s0, __m512i s1, __m512i s2) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_set1_ps(65536.f),
                         _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(s2)));
}

// A block's float32 steps for one token with 16 weight rows in the lanes, from its limb sums S (unsigned
// weights: Q8_0's +128 not yet taken off, through the token's limb sums `ls`), into acc: every path that
// puts the weight rows in the lanes ends here (block_tokens, amx::tiled_rows, amx::few_rows), so a row's
// result is the same bits on each. `at`: the token's index into the pack's per-token scales and sums.
// Two limbs: S = 256 S0 + S1 exactly in int32 (|S| < 2^28), so float(S) * 256 is 65536 S0 + 256 S1 rounded
// once, as limb_sum rounds it, and the factor 256 rides in the token's scale (scales256 = 256 s, so
// d * 256 s = 256 (d * s) exactly): the same product with three float32 steps fewer. (Only where 256 d s
// overflows, activations near 1e35, could an empty block's 0 * inf differ.)
template <class F, int LIMBS>
inline __m512 lane_steps(const XPack& xp, int64_t at, const int32_t* ls, const __m512i S[3], __m512 d, __m512 m,
                         __m512 acc) {
  if constexpr (LIMBS == 2) {
    __m512i S2 = _mm512_add_epi32(_mm512_slli_epi32(S[0], 8), S[1]);
    if constexpr (F::kSigned) S2 = _mm512_sub_epi32(S2, _mm512_set1_epi32(128 * (256 * ls[0] + ls[1])));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S2), _mm512_mul_ps(d, _mm512_set1_ps(xp.scales256[at])), acc);
  } else {
    __m512i s[3] = {S[0], S[1], S[2]};
    if constexpr (F::kSigned)
      for (int l = 0; l < 3; ++l) s[l] = _mm512_sub_epi32(s[l], _mm512_set1_epi32(128 * ls[l]));
    acc = _mm512_fmadd_ps(limb_sum(s[0], s[1], s[2]), _mm512_mul_ps(d, _mm512_set1_ps(xp.scales[at])), acc);
  }
  if constexpr (F::kMin != 0) acc = _mm512_fmadd_ps(m, _mm512_set1_ps(xp.sums[at]), acc);
  return acc;
}

// ---- AVX-512 VNNI ------------------------------------------------------------------------------------
// Each 32-bit lane is one of 16 weight rows and takes four of its weights per vpdpbusd, against four limb
// bytes broadcast to every lane: the rows' 4-byte groups are transposed once per block (lane p holds row
// 4 (p % 4) + p / 4, its own inverse), and no lane ever needs adding to another.
inline __m512i lane_rows() { return _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0); }

// 16 rows x 16 bytes -> g[c]: the rows' 4-byte group c, lane p from row 4 (p % 4) + p / 4
inline void transpose16x4(const uint8_t* const rows[16], __m512i g[4]) {
  __m512i z[4];
  for (int j = 0; j < 4; ++j) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * j])));
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * j + 1])), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * j + 2])), 2);
    z[j] = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * j + 3])), 3);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  g[0] = _mm512_unpacklo_epi64(t0, t2), g[1] = _mm512_unpackhi_epi64(t0, t2);
  g[2] = _mm512_unpacklo_epi64(t1, t3), g[3] = _mm512_unpackhi_epi64(t1, t3);
}

// Token group g's TT rows (tokens 16 g .. 16 g + TT - 1) times one block of 16 weight rows in lanes (`wg`:
// weights 4c..4c+3 of every lane's row as unsigned bytes; `d`, `m`: the lanes' scales and minima), into
// acc[t]. Both weight layouts (below) end here, so a row's float32 steps are the same on either.
template <class F, int TT, int LIMBS>
inline void block_tokens(const XPack& xp, int64_t g, int64_t b, const __m512i wg[8], __m512 d, __m512 m,
                         __m512 acc[TT]) {
  const int64_t blocks = xp.blocks, t0 = g * 16;
  for (int t = 0; t < TT; ++t) {
    const uint32_t* xb = xp.rows.data() + ((t0 + t) * blocks + b) * 24;
    __m512i S[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int l = 0; l < LIMBS; ++l) {
      if constexpr (TT >= 4) {  // the tokens' chains run side by side: one chain per limb
        for (int c = 0; c < 8; ++c)
          S[l] = _mm512_dpbusd_epi32(S[l], wg[c], _mm512_set1_epi32(static_cast<int>(xb[8 * l + c])));
      } else {  // two chains, so that one token does not wait on each product's latency
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        for (int c = 0; c < 8; c += 2) {
          s0 = _mm512_dpbusd_epi32(s0, wg[c], _mm512_set1_epi32(static_cast<int>(xb[8 * l + c])));
          s1 = _mm512_dpbusd_epi32(s1, wg[c + 1], _mm512_set1_epi32(static_cast<int>(xb[8 * l + c + 1])));
        }
        S[l] = _mm512_add_epi32(s0, s1);
      }
    }
    acc[t] = lane_steps<F, LIMBS>(xp, (g * blocks + b) * 16 + t, xp.limb_sums.data() + ((t0 + t) * blocks + b) * 3,
                                  S, d, m, acc[t]);
  }
}

// TT activation rows (tokens 16 g .. 16 g + TT - 1) times the weight rows [n, n + 16) (`rows_here` of them,
// from `w16`), into y's columns n... The next 16 weight rows are fetched meanwhile where `fetch` (the first
// token group).
template <class F, int TT, int LIMBS>
void group_vnni(const XPack& xp, int64_t g, const uint8_t* w16, int64_t n, int rows_here, const uint8_t* fetch,
                float* y, int64_t N) {
  const int64_t blocks = xp.blocks, ldw = blocks * F::kBytes, t0 = g * 16;
  const __m512i perm = lane_rows(), offsets = _mm512_mullo_epi32(perm, _mm512_set1_epi32(static_cast<int>(ldw)));
  const __m512i nib = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __mmask16 lanes = _mm512_cmplt_epi32_mask(perm, _mm512_set1_epi32(rows_here));
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = w16 + b * F::kBytes;
    if (fetch) prefetch_slice(fetch, 16 * ldw, b, blocks);
    const uint8_t* rows[16];
    for (int i = 0; i < 16; ++i) rows[i] = i < rows_here ? blk + i * ldw + F::kQs : kZeros;
    __m512i wg[8];  // weights 4c..4c+3 of every row, as unsigned bytes
    __m512i gr[4];
    transpose16x4(rows, gr);
    if constexpr (F::kSigned) {
      for (int c = 0; c < 4; ++c) wg[c] = _mm512_xor_si512(gr[c], flip);
      for (int i = 0; i < 16; ++i) rows[i] += 16;
      transpose16x4(rows, gr);
      for (int c = 0; c < 4; ++c) wg[4 + c] = _mm512_xor_si512(gr[c], flip);
    } else {  // bytes 4c..4c+3: low nibbles are weights 4c.., high ones 16 + 4c..
      for (int c = 0; c < 4; ++c) {
        wg[c] = _mm512_and_si512(gr[c], nib);
        wg[4 + c] = _mm512_and_si512(_mm512_srli_epi16(gr[c], 4), nib);
      }
    }
    __m512 d, m;
    scales<F>(blk, offsets, lanes, d, m);
    block_tokens<F, TT, LIMBS>(xp, g, b, wg, d, m, acc);
  }
  const __mmask16 rowmask = static_cast<__mmask16>((1u << rows_here) - 1);
  for (int t = 0; t < TT; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * N + n, rowmask, _mm512_permutexvar_ps(perm, acc[t]));
}

// ---- weight rows tiled for the lanes ---------------------------------------------------------------
// (tiled_rows.h lays them out.)
// As group_vnni, on one tile of the tiled layout (`tile`: its first block); `fetch`: the next tile.
// (`rows<F, true>` runs it.)
template <class F, int TT, int LIMBS>
void group_tiled(const XPack& xp, int64_t g, const uint8_t* tile, int64_t n, int rows_here, const uint8_t* fetch,
                 float* y, int64_t N) {
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < xp.blocks; ++b) {
    const uint8_t* blk = tile + b * kTileBlockBytes<F>;
    if (fetch)
      for (int o = 0; o < kTileBlockBytes<F>; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(fetch + b * kTileBlockBytes<F> + o), _MM_HINT_T0);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    __m512 m = _mm512_setzero_ps();
    if constexpr (F::kMin == 1) m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
    else if constexpr (F::kMin == 2) m = _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
    const uint8_t* q = blk + kTileScaleBytes<F>;
    __m512i wg[8];
    if constexpr (F::kSigned) {
      for (int c = 0; c < 8; ++c) wg[c] = _mm512_loadu_si512(q + 64 * c);
    } else {
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(q + 64 * c);
        wg[c] = _mm512_and_si512(v, nib);
        wg[4 + c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      }
    }
    block_tokens<F, TT, LIMBS>(xp, g, b, wg, d, m, acc);
  }
  const __mmask16 rowmask = static_cast<__mmask16>((1u << rows_here) - 1);
  for (int t = 0; t < TT; ++t) _mm512_mask_storeu_ps(y + (g * 16 + t) * N + n, rowmask, acc[t]);
}

// The first byte of weight rows n.. (n a multiple of 16) in the GGUF rows or (kTiled) their tiled copy.
template <class F, bool kTiled>
const uint8_t* rows_at(const uint8_t* w, int64_t n, int64_t blocks) {
  return kTiled ? w + n / 16 * blocks * kTileBlockBytes<F> : w + n * blocks * F::kBytes;
}

template <class F, bool kTiled, int... I>
void group_dispatch(int tt, const XPack& xp, int64_t g, const uint8_t* w16, int64_t n, int rows_here,
                    const uint8_t* fetch, float* y, int64_t N, std::integer_sequence<int, I...>) {
  auto one = [&](auto rows, auto limbs) {
    constexpr int TT = decltype(rows)::value, LIMBS = decltype(limbs)::value;
    if constexpr (kTiled) group_tiled<F, TT, LIMBS>(xp, g, w16, n, rows_here, fetch, y, N);
    else group_vnni<F, TT, LIMBS>(xp, g, w16, n, rows_here, fetch, y, N);
  };
  if (xp.limbs == 2)
    ((tt == I + 1 ? one(std::integral_constant<int, I + 1>{}, std::integral_constant<int, 2>{}) : void()), ...);
  else ((tt == I + 1 ? one(std::integral_constant<int, I + 1>{}, std::integral_constant<int, 3>{}) : void()), ...);
}

// Output columns [n0, n1) (n0 a multiple of 16) of every activation row (pack_x's `rows` layout): 16 weight
// rows at a time, from the GGUF rows `w` or (kTiled) their tiled copy, each multiplied by the tokens in
// groups of 16 (every token by the same steps whatever its group).
template <class F, bool kTiled = false>
void rows(const XPack& xp, const uint8_t* w, int64_t n0, int64_t n1, float* y, int64_t N) {
  for (int64_t n = n0; n < n1; n += 16) {
    const int rows_here = static_cast<int>(std::min<int64_t>(16, n1 - n));
    for (int64_t g = 0; g * 16 < xp.T; ++g) {
      const uint8_t* fetch = g == 0 && n + 16 < n1 ? rows_at<F, kTiled>(w, n + 16, xp.blocks) : nullptr;
      const int tt = static_cast<int>(std::min<int64_t>(16, xp.T - g * 16));
      group_dispatch<F, kTiled>(tt, xp, g, rows_at<F, kTiled>(w, n, xp.blocks), n, rows_here, fetch, y, N,
                                std::make_integer_sequence<int, kGroupRows>{});
    }
  }
}

// ---- tokens in lanes (2 limbs) ----------------------------------------------------------------------
// With 2 limbs an activation is one 15-bit integer, xi = 256 l0 + l1, which fits int16. Here each 32-bit
// lane is one of 16 tokens and holds a pair of its integers (xi[2j], xi[2j + 1]); vpdpwssd multiplies the
// pair by the same pair of one weight row's integers (widened to int16 once per pass, broadcast from
// memory), so S = sum_k w_k xi_k = 256 S0 + S1 exactly, in one int32 sum with no unsigned offset to take
// off (|S| < 2^26). The weights need no transposing, a block's 16 activation registers serve every weight
// row, and the float32 steps are those of `block_tokens`: float(S) times d * 256 s (float(S) * 256 is
// 65536 S0 + 256 S1 rounded once), plus m * sum(x), block after block. So a row's result is the same bits
// on either code.
constexpr int kLaneRows = 8;  // weight rows per pass over a token group's blocks

// `rows` (<= kLaneRows) weight rows from `w` as int16 (missing rows zero), with their blocks' d and m
template <class F>
void widen_rows(const uint8_t* w, int64_t ldw, int64_t blocks, int rows, int16_t* wx, float* d, float* m) {
  const __m128i nib = _mm_set1_epi8(0x0F);
  for (int r = 0; r < kLaneRows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      int16_t* o = wx + (r * blocks + b) * 32;
      const int64_t at = r * blocks + b;
      if (r >= rows) {
        _mm512_store_si512(o, _mm512_setzero_si512());
        d[at] = m[at] = 0.f;
        continue;
      }
      const uint8_t* blk = w + r * ldw + b * F::kBytes;
      uint16_t h;
      std::memcpy(&h, blk, 2);
      d[at] = _cvtsh_ss(h);
      if constexpr (F::kMin == 1) {
        std::memcpy(&h, blk + 2, 2);
        m[at] = _cvtsh_ss(h);
      } else if constexpr (F::kMin == 2) {
        m[at] = d[at] * -8.f;
      } else {
        m[at] = 0.f;
      }
      if constexpr (F::kSigned) {
        _mm512_store_si512(o, _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + F::kQs))));
      } else {  // weight j < 16: low nibble of byte j; j >= 16: high nibble of byte j - 16
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + F::kQs));
        const __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(q, nib));
        const __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(q, 4), nib));
        _mm512_store_si512(o, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
      }
    }
}

// Token group g times the widened rows: out[r][t] for kLaneRows rows and the group's 16 token lanes.
template <class F>
void lanes_group(const XPack& xp, int64_t g, const int16_t* wx, const float* d, const float* m, float* out) {
  const int64_t blocks = xp.blocks;
  __m512 acc[kLaneRows];
  for (int r = 0; r < kLaneRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint32_t* xb = xp.pairs.data() + (g * blocks + b) * 256;
    __m512i X[16];
    for (int j = 0; j < 16; ++j) X[j] = _mm512_load_si512(xb + 16 * j);
    const int64_t at = (g * blocks + b) * 16;
    const __m512 s = _mm512_loadu_ps(xp.scales256.data() + at);  // 256 s, as block_tokens takes it
    __m512 sums = _mm512_setzero_ps();
    if constexpr (F::kMin != 0) sums = _mm512_loadu_ps(xp.sums.data() + at);
#pragma GCC unroll 8
    for (int r = 0; r < kLaneRows; ++r) {
      const int32_t* wp = reinterpret_cast<const int32_t*>(wx + (r * blocks + b) * 32);
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int j = 0; j < 16; j += 2) {
        s0 = _mm512_dpwssd_epi32(s0, X[j], _mm512_set1_epi32(wp[j]));
        s1 = _mm512_dpwssd_epi32(s1, X[j + 1], _mm512_set1_epi32(wp[j + 1]));
      }
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)),
                               _mm512_mul_ps(_mm512_set1_ps(d[r * blocks + b]), s), acc[r]);
      if constexpr (F::kMin != 0) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(m[r * blocks + b]), sums, acc[r]);
    }
  }
  for (int r = 0; r < kLaneRows; ++r) _mm512_store_ps(out + 16 * r, acc[r]);
}

// Output columns [n0, n1) of every activation row (pack_x's `pairs` layout): kLaneRows weight rows at a
// time, widened once and multiplied by every token group.
template <class F>
void lanes_rows(const XPack& xp, const uint8_t* w, int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t blocks = xp.blocks, ldw = blocks * F::kBytes;
  thread_local aligned::vector<int16_t> wx;
  thread_local aligned::vector<float> d, m;
  wx.resize(kLaneRows * blocks * 32), d.resize(kLaneRows * blocks), m.resize(kLaneRows * blocks);
  alignas(64) float out[kLaneRows * 16];
  for (int64_t n = n0; n < n1; n += kLaneRows) {
    const int rows_here = static_cast<int>(std::min<int64_t>(kLaneRows, n1 - n));
    widen_rows<F>(w + n * ldw, ldw, blocks, rows_here, wx.data(), d.data(), m.data());
    for (int64_t g = 0; g * 16 < xp.T; ++g) {
      lanes_group<F>(xp, g, wx.data(), d.data(), m.data(), out);
      const int64_t tt = std::min<int64_t>(16, xp.T - g * 16);
      for (int64_t t = 0; t < tt; ++t)
        for (int r = 0; r < rows_here; ++r) y[(g * 16 + t) * N + n + r] = out[16 * r + t];
    }
  }
}

}  // namespace vnni
