// The block-quantized product on AVX-512 VNNI (up to kVnniRows activation rows) and Intel AMX's integer
// tiles (more rows), for CPUs with AMX-INT8. Included by cpu_kernels.cc; see parrot_qmatmul there for the
// operands.
//
// Numbers. The weights are the blocks' integers as the file stores them (Q4: 0..15, Q8_0: -128..127).
// Each block of 32 activations is written as x = s * (65536 l0 + 256 l1 + l2), s = max|x| / 2^22, with
// three signed byte limbs (the rounding of x to 23 bits below its block's largest activation is the only
// error). The integer sums S_l = sum_k w_k l_k are exact in int32, whatever computes them and in whatever
// order; float32 then computes, block after block, acc += (65536 S0 + 256 S1 + S2) * (d * s), and
// acc += m * sum(x) for the blocks with a minimum (Q4_1's m, Q4_0's -8 d). These float32 steps are the
// same on both paths, so a row's result is bit for bit the same alone and in any batch, decode or
// prefill. Compared with the float32 product with the dequantized matrix, the error is of the order of
// float32 rounding (tests: rtol 1e-5; the model's logits within 1e-4 of transformers').
//
// VNNI. Each 32-bit lane is one of 16 weight rows; vpdpbusd multiplies four of its weights (unsigned
// bytes: Q4's nibbles as they are, Q8_0's plus 128, taken off again as 128 times the limbs' sum) by four
// limb bytes broadcast to every lane. The weights are read once per block for all the rows.
// Tiles. A: 16 weight rows x one block (32 bytes; Q8_0 read in place at the row stride, Q4's nibbles
// unpacked to bytes); B: a token tile's limb l for the block, [8 groups of 4 weights, tn tokens x 4 bytes];
// C: three int32 tiles [16 weight rows, tn tokens], one per limb.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "aligned.h"

namespace amx {

constexpr int64_t kChunk = 16;     // blocks prepared before the tile unit runs over them
constexpr int64_t kTileGroup = 8;  // token tiles (16 tokens each) whose sums are held at once
constexpr int kVnniRows = 16;  // up to this many activation rows: VNNI (as fast per row as the tiles, up to 16)

// Linux hands a process the tile data state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
inline bool request_permission() { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

// Block formats: bytes per block, where the 32 weights start, signed (Q8_0) or nibbles, and the minimum
// (0: none, 1: Q4_1's float16 after d, 2: Q4_0's -8 d).
struct Q8_0 { static constexpr int kBytes = 34, kQs = 2, kMin = 0; static constexpr bool kSigned = true; };
struct Q4_0 { static constexpr int kBytes = 18, kQs = 2, kMin = 2; static constexpr bool kSigned = false; };
struct Q4_1 { static constexpr int kBytes = 20, kQs = 4, kMin = 1; static constexpr bool kSigned = false; };

// ---- activations ----------------------------------------------------------------------------------
// Token tiles of tn = min(T, 16) tokens (the last one padded with zero tokens).
struct XPack {
  int64_t T = 0, tn = 0, tiles = 0, blocks = 0;
  int limbs = 3;                        // 2: the last limb is zero and skipped (15 bits below the block's largest)
  aligned::vector<uint32_t> b;          // more than kVnniRows rows: [tiles][blocks][3 limbs][8 groups][tn]
  aligned::vector<float> scales;        // [tiles][blocks][16]: s per token
  aligned::vector<float> sums;          // [tiles][blocks][16]: sum(x) per token
  // up to kVnniRows rows, for VNNI: each row's limbs contiguous, and their sums
  aligned::vector<uint32_t> rows;       // [T][blocks][3 limbs][8 groups]
  aligned::vector<int32_t> limb_sums;   // [T][blocks][3]
};

inline void pack_x(const float* x, int64_t T, int64_t K, XPack& p, int limbs = 3) {
  p.T = T, p.blocks = K / 32, p.limbs = limbs;
  p.tn = std::min<int64_t>(T, 16);
  p.tiles = (T + p.tn - 1) / p.tn;
  const bool vnni = T <= kVnniRows;  // VNNI reads `rows`; the tiles read `b`
  p.b.assign(vnni ? 0 : p.tiles * p.blocks * 3 * 8 * p.tn, 0);
  p.scales.assign(p.tiles * p.blocks * 16, 0.f);
  p.sums.assign(p.tiles * p.blocks * 16, 0.f);
  p.rows.assign(vnni ? T * p.blocks * 24 : 0, 0);
  p.limb_sums.assign(vnni ? T * p.blocks * 3 : 0, 0);
  const __m512i c128 = _mm512_set1_epi32(128), c255 = _mm512_set1_epi32(255);
  alignas(64) uint32_t limb[3][8];
  for (int64_t t = 0; t < T; ++t) {
    const int64_t tile = t / p.tn, col = t % p.tn;
    for (int64_t b = 0; b < p.blocks; ++b) {
      const float* xb = x + t * K + b * 32;
      const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
      const int64_t at = (tile * p.blocks + b) * 16 + col;
      p.sums[at] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
      const float a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      if (!(a <= 3.4e38f)) {  // NaN or infinity: the products become NaN, as in float32
        p.scales[at] = NAN;
        continue;
      }
      if (!(a >= 1e-30f)) continue;  // zero (or too small to scale to 2^22): limbs and scale stay zero
      p.scales[at] = a / 4194304.f;
      // two limbs: x rounded to 2^14 steps of the block's largest, written as 256 times that integer
      // (limbs 0 and 1 as three limbs would have them, limb 2 zero), so the sums and scales are the same
      const __m512 inv = _mm512_set1_ps((limbs == 2 ? 16384.f : 4194304.f) / a);
      for (int h = 0; h < 2; ++h) {
        const __m512i xi = _mm512_cvtps_epi32(_mm512_mul_ps(h ? x1 : x0, inv));  // |xi| <= 2^22 + 1
        __m512i l2 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(xi, c128), c255), c128);
        __m512i r = _mm512_srai_epi32(_mm512_sub_epi32(xi, l2), 8);
        if (limbs == 2) r = xi, l2 = _mm512_setzero_si512();
        const __m512i l1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(r, c128), c255), c128);
        const __m512i l0 = _mm512_srai_epi32(_mm512_sub_epi32(r, l1), 8);  // |l0| <= 64
        _mm_store_si128(reinterpret_cast<__m128i*>(limb[0] + 4 * h), _mm512_cvtepi32_epi8(l0));
        _mm_store_si128(reinterpret_cast<__m128i*>(limb[1] + 4 * h), _mm512_cvtepi32_epi8(l1));
        _mm_store_si128(reinterpret_cast<__m128i*>(limb[2] + 4 * h), _mm512_cvtepi32_epi8(l2));
      }
      for (int l = 0; l < 3; ++l) {
        if (!vnni) {
          uint32_t* dst = p.b.data() + ((tile * p.blocks + b) * 3 + l) * 8 * p.tn + col;
          for (int r = 0; r < 8; ++r) dst[r * p.tn] = limb[l][r];
        } else {
          std::memcpy(p.rows.data() + (t * p.blocks + b) * 24 + l * 8, limb[l], 32);
          int32_t sum = 0;
          for (int k = 0; k < 32; ++k) sum += reinterpret_cast<const int8_t*>(limb[l])[k];
          p.limb_sums[(t * p.blocks + b) * 3 + l] = sum;
        }
      }
    }
  }
}

// ---- shared pieces --------------------------------------------------------------------------------
alignas(64) inline constexpr uint8_t kZeros[32] = {};

// The next 16 weight rows (contiguous: `bytes` from `next`) are fetched into the cache a slice per block
// while this tile's blocks are read: short rows leave the hardware prefetcher little to go on.
inline void prefetch_slice(const uint8_t* next, int64_t bytes, int64_t j, int64_t slices) {
  const int64_t per = (bytes + 64 * slices - 1) / (64 * slices) * 64;
  for (int64_t o = j * per; o < std::min(bytes, (j + 1) * per); o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T0);
}

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

// Two rows' Q4 blocks as 2 x 32 weight bytes, in order (weight j < 16: byte j's low nibble; j >= 16: byte
// j - 16's high nibble): [row a | row b] in a 512-bit register.
inline __m512i q4_pair(const uint8_t* qa, const uint8_t* qb) {
  const __m256i v = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(qb), reinterpret_cast<const __m128i*>(qa));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  // [a_lo, b_lo, a_hi, b_hi] in 128-bit lanes -> [a_lo, a_hi, b_lo, b_hi]
  const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  return _mm512_shuffle_i64x2(z, z, 0xD8);
}

// ---- a few activation rows: AVX-512 VNNI ------------------------------------------------------------
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

template <class F, int TT>
void rows_vnni(const XPack& xp, const uint8_t* w, int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t blocks = xp.blocks, ldw = blocks * F::kBytes;
  const __m512i perm = lane_rows(), offsets = _mm512_mullo_epi32(perm, _mm512_set1_epi32(static_cast<int>(ldw)));
  const __m512i nib = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t n = n0; n < n1; n += 16) {
    const int rows_here = static_cast<int>(std::min<int64_t>(16, n1 - n));
    const __mmask16 lanes = _mm512_cmplt_epi32_mask(perm, _mm512_set1_epi32(rows_here));
    __m512 acc[TT];
    for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = w + n * ldw + b * F::kBytes;
      if (n + 16 < n1) prefetch_slice(w + (n + 16) * ldw, 16 * ldw, b, blocks);
      const uint8_t* rows[16];
      for (int i = 0; i < 16; ++i) rows[i] = i < rows_here ? blk + i * ldw + F::kQs : kZeros;
      __m512i wg[8];  // weights 4c..4c+3 of every row, as unsigned bytes
      __m512i g[4];
      transpose16x4(rows, g);
      if constexpr (F::kSigned) {
        for (int c = 0; c < 4; ++c) wg[c] = _mm512_xor_si512(g[c], flip);
        for (int i = 0; i < 16; ++i) rows[i] += 16;
        transpose16x4(rows, g);
        for (int c = 0; c < 4; ++c) wg[4 + c] = _mm512_xor_si512(g[c], flip);
      } else {  // bytes 4c..4c+3: low nibbles are weights 4c.., high ones 16 + 4c..
        for (int c = 0; c < 4; ++c) {
          wg[c] = _mm512_and_si512(g[c], nib);
          wg[4 + c] = _mm512_and_si512(_mm512_srli_epi16(g[c], 4), nib);
        }
      }
      __m512 d, m;
      scales<F>(blk, offsets, lanes, d, m);
      for (int t = 0; t < TT; ++t) {
        const uint32_t* xb = xp.rows.data() + (t * blocks + b) * 24;
        __m512i S[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
        for (int l = 0; l < xp.limbs; ++l) {
          __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();  // two chains
          for (int c = 0; c < 8; c += 2) {
            s0 = _mm512_dpbusd_epi32(s0, wg[c], _mm512_set1_epi32(static_cast<int>(xb[8 * l + c])));
            s1 = _mm512_dpbusd_epi32(s1, wg[c + 1], _mm512_set1_epi32(static_cast<int>(xb[8 * l + c + 1])));
          }
          S[l] = _mm512_add_epi32(s0, s1);
          if constexpr (F::kSigned)
            S[l] = _mm512_sub_epi32(S[l], _mm512_set1_epi32(128 * xp.limb_sums[(t * blocks + b) * 3 + l]));
        }
        const int64_t at = b * 16 + t;  // one token tile
        acc[t] = _mm512_fmadd_ps(limb_sum(S[0], S[1], S[2]), _mm512_mul_ps(d, _mm512_set1_ps(xp.scales[at])), acc[t]);
        if constexpr (F::kMin != 0) acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xp.sums[at]), acc[t]);
      }
    }
    const __mmask16 rowmask = static_cast<__mmask16>((1u << rows_here) - 1);
    for (int t = 0; t < TT; ++t) _mm512_mask_storeu_ps(y + t * N + n, rowmask, _mm512_permutexvar_ps(perm, acc[t]));
  }
}

template <class F, int... I>
void vnni_dispatch(const XPack& xp, const uint8_t* w, int64_t n0, int64_t n1, float* y, int64_t N,
                   std::integer_sequence<int, I...>) {
  ((xp.T == I + 1 ? rows_vnni<F, I + 1>(xp, w, n0, n1, y, N) : void()), ...);
}

// ---- several activation rows: the tiles -------------------------------------------------------------
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0, tmm3, tmm4: C per limb [16 weight rows, tn tokens] int32; tmm1: A [16 weight rows, 32 bytes];
// tmm2: B [8 groups of 4 weights, tn tokens x 4 bytes]. Loaded by every call on its own thread: the
// configuration is per thread, and other libraries (oneDNN) set their own on the same threads.
inline void configure(int tn) {
  TileConfig cfg;
  for (int t : {0, 3, 4}) cfg.rows[t] = 16, cfg.colsb[t] = static_cast<uint16_t>(4 * tn);
  cfg.rows[1] = 16, cfg.colsb[1] = 32;
  cfg.rows[2] = 8, cfg.colsb[2] = static_cast<uint16_t>(4 * tn);
  asm volatile("" : : "r"(&cfg) : "memory");  // GCC does not see ldtilecfg read `cfg`: keep its stores
  _tile_loadconfig(&cfg);
}

template <bool kSigned>
inline void tile_products(const uint32_t* xt, int64_t tn, int limbs) {
  _tile_zero(0);
  _tile_zero(3);
  _tile_zero(4);
  _tile_loadd(2, xt, 4 * tn);
  if constexpr (kSigned) _tile_dpbssd(0, 1, 2); else _tile_dpbusd(0, 1, 2);
  _tile_loadd(2, xt + 8 * tn, 4 * tn);
  if constexpr (kSigned) _tile_dpbssd(3, 1, 2); else _tile_dpbusd(3, 1, 2);
  if (limbs == 2) return;  // the third limb is zero: its sums stay zero
  _tile_loadd(2, xt + 16 * tn, 4 * tn);
  if constexpr (kSigned) _tile_dpbssd(4, 1, 2); else _tile_dpbusd(4, 1, 2);
}

// Output columns [n0, n1) of every activation row, 16 weight rows at a time, in three phases over up to
// kChunk blocks, so that no phase waits on memory the one before has just written: (1) the blocks' A
// tiles (Q4 unpacked) and scales; (2) the tile unit stores each block's limb sums for a token tile;
// (3) vector code adds them up in block order.
template <class F>
void rows(const XPack& xp, const uint8_t* w, int64_t n0, int64_t n1, float* y, int64_t N) {
  if (xp.T <= kVnniRows) return vnni_dispatch<F>(xp, w, n0, n1, y, N, std::make_integer_sequence<int, kVnniRows>{});
  const int64_t blocks = xp.blocks, ldw = blocks * F::kBytes, tn = xp.tn, T = xp.T;
  configure(static_cast<int>(tn));
  alignas(64) uint8_t A[kChunk][16 * 32];
  alignas(64) int32_t C[kChunk][3][16 * 16];
  alignas(64) float dd[kChunk][16], mm[kChunk][16];
  std::memset(C, 0, sizeof(C));  // the columns past tn stay zero (a tile store writes tn of them)
  struct alignas(64) Row { float v[16]; };
  thread_local std::vector<Row> accbuf;  // [token tiles of the group][16 weight rows] x 16 tokens
  accbuf.resize(kTileGroup * 16);
  float* acc = accbuf.data()->v;
  const __m512i offsets = row_offsets(ldw);
  for (int64_t g0 = 0; g0 < xp.tiles; g0 += kTileGroup) {
    const int64_t group = std::min(kTileGroup, xp.tiles - g0);
    for (int64_t n = n0; n < n1; n += 16) {
      const int rows_here = static_cast<int>(std::min<int64_t>(16, n1 - n));
      const __mmask16 rowmask = static_cast<__mmask16>((1u << rows_here) - 1);
      std::memset(acc, 0, sizeof(float) * group * 256);
      for (int64_t b0 = 0; b0 < blocks; b0 += kChunk) {
        const int64_t nb = std::min(kChunk, blocks - b0);
        for (int64_t j = 0; j < nb; ++j) {  // (1)
          const uint8_t* blk = w + n * ldw + (b0 + j) * F::kBytes;
          if (n + 16 < n1) prefetch_slice(w + (n + 16) * ldw, 16 * ldw, b0 + j, blocks);
          if constexpr (F::kSigned) {  // read in place below, but for a partial tile
            if (rows_here < 16) {
              std::memset(A[j], 0, sizeof(A[j]));
              for (int i = 0; i < rows_here; ++i) std::memcpy(A[j] + 32 * i, blk + i * ldw + F::kQs, 32);
            }
          } else {
            for (int i = 0; i < 16; i += 2) {
              const __m512i v = q4_pair(i < rows_here ? blk + i * ldw + F::kQs : kZeros,
                                        i + 1 < rows_here ? blk + (i + 1) * ldw + F::kQs : kZeros);
              _mm512_store_si512(A[j] + 32 * i, v);
            }
          }
          __m512 d, m;
          scales<F>(blk, offsets, rowmask, d, m);
          _mm512_store_ps(dd[j], d), _mm512_store_ps(mm[j], m);
        }
        for (int64_t gt = 0; gt < group; ++gt) {
          const int64_t tt = g0 + gt;
          const uint32_t* xt = xp.b.data() + (tt * blocks + b0) * 3 * 8 * tn;
          for (int64_t j = 0; j < nb; ++j) {  // (2)
            if (F::kSigned && rows_here == 16) _tile_loadd(1, w + n * ldw + (b0 + j) * F::kBytes + F::kQs, ldw);
            else _tile_loadd(1, A[j], 32);
            tile_products<F::kSigned>(xt + j * 3 * 8 * tn, tn, xp.limbs);
            _tile_stored(0, C[j][0], 64);
            _tile_stored(3, C[j][1], 64);
            if (xp.limbs == 3) _tile_stored(4, C[j][2], 64);  // two limbs: C[j][2] stays zero (memset)
          }
          const float* sb = xp.scales.data() + (tt * blocks + b0) * 16;
          const float* xs = xp.sums.data() + (tt * blocks + b0) * 16;
          float* at = acc + gt * 256;
          for (int i = 0; i < 16; ++i) {  // (3)
            __m512 v = _mm512_load_ps(at + i * 16);
            for (int64_t j = 0; j < nb; ++j) {
              const __m512 ls = limb_sum(_mm512_load_si512(C[j][0] + i * 16), _mm512_load_si512(C[j][1] + i * 16),
                                         _mm512_load_si512(C[j][2] + i * 16));
              v = _mm512_fmadd_ps(ls, _mm512_mul_ps(_mm512_set1_ps(dd[j][i]), _mm512_loadu_ps(sb + j * 16)), v);
              if constexpr (F::kMin != 0) v = _mm512_fmadd_ps(_mm512_set1_ps(mm[j][i]), _mm512_loadu_ps(xs + j * 16), v);
            }
            _mm512_store_ps(at + i * 16, v);
          }
        }
      }
      for (int64_t gt = 0; gt < group; ++gt) {  // [weight row][token] -> y[token][column]
        const int64_t t0 = (g0 + gt) * tn, cnt = std::min(tn, T - t0);
        const float* at = acc + gt * 256;
        for (int64_t t = 0; t < cnt; ++t)
          for (int i = 0; i < rows_here; ++i) y[(t0 + t) * N + n + i] = at[i * 16 + t];
      }
    }
  }
  _tile_release();  // back to the initial state: a context switch then saves no tile data
}

}  // namespace amx
