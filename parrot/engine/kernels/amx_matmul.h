// The block-quantized product on Intel AMX tiles (bfloat16), for CPUs with AMX-BF16 and AVX-512 BF16.
// Included by cpu_kernels.cc; see parrot_qmatmul there for the operands.
//
// Numbers. Each block's integer weights (Q4: 0..15, Q8_0: -128..127) are exact in bfloat16, and each
// float32 activation is split into three bfloat16 parts that add up to it exactly (hi + mid + lo: 8 + 8 + 8
// significant bits). The tile unit multiplies every part by the integers (each product exact in float32)
// and sums them in float32; the block's float32 sum is then scaled by its `d` and, for the blocks with a
// minimum `m` (Q4_1; Q4_0's `-8 d`), `m` times the block's activation sum is added, block after block. So
// the product equals the float32 product with the exactly dequantized matrix up to the order of the
// additions, like the AVX2 path; and every output row is computed alone (a tile's rows and columns never
// mix), in the same way whatever the number of rows: a sequence gets the same result alone and in any
// batch, decode or prefill.
//
// Layout. The weights are the tiles' A operand: 16 weight rows x one block (32 weights) per tile, widened
// from the file's bytes on the fly, with no transposition. The activations are the B operand, packed once
// per call into tiles of 16 weight pairs x up to 16 tokens. C is [16 weight rows, tokens].
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace amx {

constexpr int kParts = 3;           // bfloat16 parts of each activation
constexpr int64_t kChunk = 16;      // blocks widened before the tile unit runs over them
constexpr int64_t kTileGroup = 8;   // token tiles (16 tokens each) whose sums are held at once

// Linux hands a process the tile data state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
inline bool request_permission() { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The next 16 weight rows (contiguous: `bytes` from `next`) are fetched into the cache a slice per block
// while this tile's blocks are read: tile loads and short rows leave the hardware prefetcher little to go on.
inline void prefetch_slice(const uint8_t* next, int64_t bytes, int64_t j, int64_t slices) {
  const int64_t per = (bytes + 64 * slices - 1) / (64 * slices) * 64;
  for (int64_t o = j * per; o < std::min(bytes, (j + 1) * per); o += 64) _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T0);
}

// tmm0: C [16 weight rows, tn tokens] float32; tmm1: A [16 weight rows, 32 weights] bfloat16;
// tmm2: B [16 weight pairs, tn tokens x 2] bfloat16. Loaded by every call on its own thread: the
// configuration is per thread, and other libraries (oneDNN) set their own on the same threads.
inline void configure(int tn) {
  TileConfig cfg;
  cfg.rows[0] = 16, cfg.colsb[0] = static_cast<uint16_t>(4 * tn);
  cfg.rows[1] = 16, cfg.colsb[1] = 64;
  cfg.rows[2] = 16, cfg.colsb[2] = static_cast<uint16_t>(4 * tn);
  _tile_loadconfig(&cfg);
}

// The activations as B tiles: token tiles of tn tokens (tn = min(T, 16); the last tile padded with zero
// tokens), each [blocks][kParts][16 pairs][tn] of two bfloat16, and each block's activation sums.
struct XPack {
  int64_t T = 0, tn = 0, tiles = 0, K = 0, blocks = 0;
  std::vector<uint32_t> b;
  std::vector<float> sums;  // [tiles][blocks][16]
};

inline __m512 widen_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void pack_x(const float* x, int64_t T, int64_t K, XPack& p) {
  p.T = T, p.K = K, p.blocks = K / 32;
  p.tn = std::min<int64_t>(T, 16);
  p.tiles = (T + p.tn - 1) / p.tn;
  p.b.assign(p.tiles * p.blocks * kParts * 16 * p.tn, 0);
  p.sums.assign(p.tiles * p.blocks * 16, 0.f);
  alignas(64) uint32_t part[kParts][16];
  for (int64_t t = 0; t < T; ++t) {
    const int64_t tile = t / p.tn, col = t % p.tn;
    for (int64_t b = 0; b < p.blocks; ++b) {
      const float* xb = x + t * K + b * 32;
      __m512 r0 = _mm512_loadu_ps(xb), r1 = _mm512_loadu_ps(xb + 16);
      p.sums[(tile * p.blocks + b) * 16 + col] = _mm512_reduce_add_ps(_mm512_add_ps(r0, r1));
      for (int i = 0; i < kParts; ++i) {  // rounded to nearest: each remainder is exact in float32
        const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(r1, r0);
        _mm512_store_si512(part[i], h);
        r0 = _mm512_sub_ps(r0, widen_bf16(_mm512_castsi512_si256(h)));
        r1 = _mm512_sub_ps(r1, widen_bf16(_mm512_extracti64x4_epi64(h, 1)));
      }
      uint32_t* dst = p.b.data() + (tile * p.blocks + b) * kParts * 16 * p.tn + col;
      for (int i = 0; i < kParts; ++i)
        for (int r = 0; r < 16; ++r) dst[(i * 16 + r) * p.tn] = part[i][r];
    }
  }
}

// bfloat16 of 0..15, twice (a permutation reads the low five bits of each index word)
alignas(64) inline constexpr uint16_t kNibbleBf16[32] = {
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120,
    0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0,
    0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
// word k of a Q4 row holds byte k % 16 twice; shifted right by 0 (k < 16) or 4 (k >= 16), its low four bits
// are weight k (weight j < 16 is byte j's low nibble, j >= 16 byte j-16's high one)
alignas(64) inline constexpr uint8_t kNibbleBytes[64] = {
    0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15,
    0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};
alignas(64) inline constexpr uint8_t kZeros[32] = {};

struct Q4Widen {
  __m512i bytes = _mm512_load_si512(kNibbleBytes), lut = _mm512_load_si512(kNibbleBf16);
  __m512i shifts = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0x0004000400040004, 0x0004000400040004,
                                    0, 0, 0, 0);
};

// One weight row's Q4 block (16 bytes of nibbles) as an A row of 32 bfloat16.
inline void a_row_q4(const uint8_t* q, uint16_t* out, const Q4Widen& c) {
  const __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  const __m512i words = _mm512_srlv_epi16(_mm512_permutexvar_epi8(c.bytes, v), c.shifts);
  _mm512_store_si512(out, _mm512_permutexvar_epi16(words, c.lut));
}

// One weight row's Q8_0 block (32 signed bytes) as an A row.
inline void a_row_q8(const uint8_t* q, uint16_t* out) {
  const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
  _mm512_store_si512(out, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
}

// Output columns [n0, n1) of every activation row, for block format Q (kBytes per block, integer weights
// at kQs, `offset` true where blocks have a minimum). 16 weight rows at a time, in three phases over up
// to kChunk blocks, so that no phase waits on memory the one before has just written: (1) the blocks'
// integer weights widened into A tiles, with their scales; (2) the tile unit stores each block's sums
// for each token tile; (3) vector code scales and adds them in block order.
template <int kBytes, int kQs, bool kQ8, int kMin>  // kMin: 0 none, 1 Q4_1's f16 minimum, 2 Q4_0's -8 d
void rows(const XPack& xp, const uint8_t* w, int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t blocks = xp.blocks, ldw = blocks * kBytes, tn = xp.tn, T = xp.T;
  configure(static_cast<int>(tn));
  alignas(64) uint16_t A[kChunk][16 * 32];
  alignas(64) float C[kChunk][16 * 16];
  alignas(64) float dd[kChunk][16], mm[kChunk][16];
  if (tn > 1) std::memset(C, 0, sizeof(C));  // the columns past tn stay zero (a tile store writes tn)
  thread_local std::vector<__m512> accbuf;   // [token tiles of the group][16 weight rows] x 16 tokens
  accbuf.resize(kTileGroup * 16);
  float* acc = reinterpret_cast<float*>(accbuf.data());
  const Q4Widen q4;
  const __m512i offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(static_cast<int>(ldw)));
  for (int64_t g0 = 0; g0 < xp.tiles; g0 += kTileGroup) {
    const int64_t group = std::min(kTileGroup, xp.tiles - g0);
    for (int64_t n = n0; n < n1; n += 16) {
      const int rows_here = static_cast<int>(std::min<int64_t>(16, n1 - n));
      const __mmask16 rowmask = static_cast<__mmask16>((1u << rows_here) - 1);
      __m512 acc1 = _mm512_setzero_ps();  // one token: the 16 rows' outputs
      if (tn > 1) std::memset(acc, 0, sizeof(float) * group * 256);
      for (int64_t b0 = 0; b0 < blocks; b0 += kChunk) {
        const int64_t nb = std::min(kChunk, blocks - b0);
        for (int64_t j = 0; j < nb; ++j) {  // (1)
          const uint8_t* blk = w + n * ldw + (b0 + j) * kBytes;
          if (n + 16 < n1) prefetch_slice(w + (n + 16) * ldw, 16 * ldw, b0 + j, blocks);
          if constexpr (kQ8) {
            for (int i = 0; i < 16; ++i) a_row_q8(i < rows_here ? blk + i * ldw + kQs : kZeros, A[j] + i * 32);
          } else {
            for (int i = 0; i < 16; ++i) a_row_q4(i < rows_here ? blk + i * ldw + kQs : kZeros, A[j] + i * 32, q4);
          }
          const __m512i dm = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rowmask, offsets, blk, 1);
          const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
          __m512 m = _mm512_setzero_ps();
          if constexpr (kMin == 1) m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
          if constexpr (kMin == 2) m = _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
          _mm512_store_ps(dd[j], d), _mm512_store_ps(mm[j], m);
        }
        for (int64_t gt = 0; gt < group; ++gt) {
          const int64_t tt = g0 + gt;
          const uint32_t* xt = xp.b.data() + (tt * blocks + b0) * kParts * 16 * tn;
          for (int64_t j = 0; j < nb; ++j) {  // (2)
            _tile_loadd(1, A[j], 64);
            _tile_zero(0);
            _tile_loadd(2, xt + (j * kParts + 0) * 16 * tn, 4 * tn);
            _tile_dpbf16ps(0, 1, 2);
            _tile_loadd(2, xt + (j * kParts + 1) * 16 * tn, 4 * tn);
            _tile_dpbf16ps(0, 1, 2);
            _tile_loadd(2, xt + (j * kParts + 2) * 16 * tn, 4 * tn);
            _tile_dpbf16ps(0, 1, 2);
            _tile_stored(0, C[j], tn == 1 ? 4 : 64);  // one token: the column, contiguous
          }
          const float* sb = xp.sums.data() + (tt * blocks + b0) * 16;
          if (tn == 1) {  // (3)
            for (int64_t j = 0; j < nb; ++j) {
              acc1 = _mm512_fmadd_ps(_mm512_load_ps(C[j]), _mm512_load_ps(dd[j]), acc1);
              if constexpr (kMin != 0) acc1 = _mm512_fmadd_ps(_mm512_load_ps(mm[j]), _mm512_set1_ps(sb[j * 16]), acc1);
            }
            continue;
          }
          float* at = acc + gt * 256;
          for (int i = 0; i < 16; ++i) {
            __m512 v = _mm512_load_ps(at + i * 16);
            for (int64_t j = 0; j < nb; ++j) {
              v = _mm512_fmadd_ps(_mm512_load_ps(C[j] + i * 16), _mm512_set1_ps(dd[j][i]), v);
              if constexpr (kMin != 0) v = _mm512_fmadd_ps(_mm512_set1_ps(mm[j][i]), _mm512_loadu_ps(sb + j * 16), v);
            }
            _mm512_store_ps(at + i * 16, v);
          }
        }
      }
      if (tn == 1) {
        _mm512_mask_storeu_ps(y + n, rowmask, acc1);
        continue;
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

// ---- Q8_0 on the integer tiles ------------------------------------------------------------------
// Q8_0's weights are signed bytes already: the A tiles are read straight from the matrix (16 rows of a
// block's 32 bytes, at the row stride), with nothing to widen. Each activation block is written as
// x = s * (65536 l0 + 256 l1 + l2) with s = max|x| / 2^22 and three signed byte limbs; the tile unit sums
// the limbs times the weights exactly in int32 (three C tiles), and vector code computes
// d * s * (65536 S0 + 256 S1 + S2) in float32. The error is the rounding of x to 23 bits below its block's
// largest activation; again every output row is computed alone, the same way for any number of rows.
struct XPack8 {
  int64_t T = 0, tn = 0, tiles = 0, K = 0, blocks = 0;
  std::vector<uint32_t> b;     // [tiles][blocks][3 limbs][8 quads][tn]: four limb bytes per entry
  std::vector<float> scales;   // [tiles][blocks][16]: s per token
  std::vector<int32_t> limb_sums;  // one row only: [blocks][3] sums of its limbs
};

inline void pack_x8(const float* x, int64_t T, int64_t K, XPack8& p) {
  p.T = T, p.K = K, p.blocks = K / 32;
  p.tn = std::min<int64_t>(T, 16);
  p.tiles = (T + p.tn - 1) / p.tn;
  p.b.assign(p.tiles * p.blocks * 3 * 8 * p.tn, 0);
  p.scales.assign(p.tiles * p.blocks * 16, 0.f);
  p.limb_sums.assign(T == 1 ? p.blocks * 3 : 0, 0);
  const __m512i c128 = _mm512_set1_epi32(128), c255 = _mm512_set1_epi32(255);
  alignas(64) uint32_t limb[3][8];
  for (int64_t t = 0; t < T; ++t) {
    const int64_t tile = t / p.tn, col = t % p.tn;
    for (int64_t b = 0; b < p.blocks; ++b) {
      const float* xb = x + t * K + b * 32;
      const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
      const float a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      if (!(a > 0.f)) continue;  // all zero: limbs and scale stay zero
      p.scales[(tile * p.blocks + b) * 16 + col] = a / 4194304.f;
      const __m512 inv = _mm512_set1_ps(4194304.f / a);
      for (int h = 0; h < 2; ++h) {
        const __m512i xi = _mm512_cvtps_epi32(_mm512_mul_ps(h ? x1 : x0, inv));  // |xi| <= 2^22 + 1
        const __m512i l2 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(xi, c128), c255), c128);
        const __m512i r = _mm512_srai_epi32(_mm512_sub_epi32(xi, l2), 8);
        const __m512i l1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(r, c128), c255), c128);
        const __m512i l0 = _mm512_srai_epi32(_mm512_sub_epi32(r, l1), 8);
        _mm_store_si128(reinterpret_cast<__m128i*>(limb[0] + 4 * h), _mm512_cvtepi32_epi8(l0));
        _mm_store_si128(reinterpret_cast<__m128i*>(limb[1] + 4 * h), _mm512_cvtepi32_epi8(l1));
        _mm_store_si128(reinterpret_cast<__m128i*>(limb[2] + 4 * h), _mm512_cvtepi32_epi8(l2));
      }
      uint32_t* dst = p.b.data() + (tile * p.blocks + b) * 3 * 8 * p.tn + col;
      for (int l = 0; l < 3; ++l)
        for (int r = 0; r < 8; ++r) dst[(l * 8 + r) * p.tn] = limb[l][r];
      if (T == 1) {
        for (int l = 0; l < 3; ++l) {
          int32_t sum = 0;
          for (int k = 0; k < 32; ++k) sum += reinterpret_cast<const int8_t*>(limb[l])[k];
          p.limb_sums[b * 3 + l] = sum;
        }
      }
    }
  }
}

// tmm0, tmm3, tmm4: C [16 weight rows, tn tokens] int32 per limb; tmm1: A [16 weight rows, 32 bytes];
// tmm2: B [8 quads of weights, tn tokens x 4 bytes]
inline void configure8(int tn) {
  TileConfig cfg;
  for (int t : {0, 3, 4}) cfg.rows[t] = 16, cfg.colsb[t] = static_cast<uint16_t>(4 * tn);
  cfg.rows[1] = 16, cfg.colsb[1] = 32;
  cfg.rows[2] = 8, cfg.colsb[2] = static_cast<uint16_t>(4 * tn);
  _tile_loadconfig(&cfg);
}

inline __m512 limb_sum(const int32_t* c0, const int32_t* c1, const int32_t* c2) {
  const __m512 s0 = _mm512_cvtepi32_ps(_mm512_load_si512(c0)), s1 = _mm512_cvtepi32_ps(_mm512_load_si512(c1));
  const __m512 s2 = _mm512_cvtepi32_ps(_mm512_load_si512(c2));
  return _mm512_fmadd_ps(s0, _mm512_set1_ps(65536.f), _mm512_fmadd_ps(s1, _mm512_set1_ps(256.f), s2));
}

// One activation row (decode at batch 1): the same exact integer sums with AVX-512 VNNI instead of the
// tiles, which at one row spend more on tile loads and stores than on products. vpdpbusd multiplies
// unsigned by signed bytes, so the weights go in as w + 128 and 128 times the limbs' sum is taken off
// again. The float32 steps are those of rows_q8: the results are bit for bit the tiles' ones.
inline __m512i row_sums(const __m512i p[8]) {  // p[i]: rows 2i (low half) and 2i + 1 (high half), 8 partials each
  __m512i q[4], r[2];
  for (int i = 0; i < 4; ++i)
    q[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_epi32(p[2 * i], p[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    r[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(q[2 * i], q[2 * i + 1]), _mm512_unpackhi_epi64(q[2 * i], q[2 * i + 1]));
  // r[i]'s 128-bit lanes: rows 8i + (0, 2, 4, 6) first and second halves, rows 8i + (1, 3, 5, 7) likewise
  const __m512i f = _mm512_add_epi32(_mm512_shuffle_i32x4(r[0], r[1], 0x88), _mm512_shuffle_i32x4(r[0], r[1], 0xDD));
  const __m512i order = _mm512_set_epi32(15, 11, 14, 10, 13, 9, 12, 8, 7, 3, 6, 2, 5, 1, 4, 0);
  return _mm512_permutexvar_epi32(order, f);
}

inline void rows_q8_one(const XPack8& xp, const uint8_t* w, int64_t n0, int64_t n1, float* y) {
  constexpr int64_t kBytes = 34;
  const int64_t blocks = xp.blocks, ldw = blocks * kBytes;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(static_cast<int>(ldw)));
  for (int64_t n = n0; n < n1; n += 16) {
    const int rows_here = static_cast<int>(std::min<int64_t>(16, n1 - n));
    const __mmask16 rowmask = static_cast<__mmask16>((1u << rows_here) - 1);
    __m512 acc1 = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = w + n * ldw + b * kBytes;
      if (n + 16 < n1) prefetch_slice(w + (n + 16) * ldw, 16 * ldw, b, blocks);
      __m512i wz[8];
      for (int i = 0; i < 8; ++i) {
        const uint8_t* r0 = 2 * i < rows_here ? blk + 2 * i * ldw + 2 : kZeros;
        const uint8_t* r1 = 2 * i + 1 < rows_here ? blk + (2 * i + 1) * ldw + 2 : kZeros;
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0))),
                                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1)), 1);
        wz[i] = _mm512_xor_si512(v, flip);
      }
      const uint32_t* xb = xp.b.data() + b * 3 * 8;
      __m512i S[3];
      for (int l = 0; l < 3; ++l) {
        const __m512i limbs = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 8 * l)));
        __m512i p[8];
        for (int i = 0; i < 8; ++i) p[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wz[i], limbs);
        S[l] = _mm512_sub_epi32(row_sums(p), _mm512_set1_epi32(128 * xp.limb_sums[b * 3 + l]));
      }
      const __m512i dm = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rowmask, offsets, blk, 1);
      const __m512 scale = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)), _mm512_set1_ps(xp.scales[b * 16]));
      alignas(64) int32_t c[3][16];
      for (int l = 0; l < 3; ++l) _mm512_store_si512(c[l], S[l]);
      acc1 = _mm512_fmadd_ps(limb_sum(c[0], c[1], c[2]), scale, acc1);
    }
    _mm512_mask_storeu_ps(y + n, rowmask, acc1);
  }
}

// Output columns [n0, n1) of every activation row for a Q8_0 matrix (34-byte blocks: f16 d, 32 int8).
inline void rows_q8(const XPack8& xp, const uint8_t* w, int64_t n0, int64_t n1, float* y, int64_t N) {
  if (xp.T == 1) return rows_q8_one(xp, w, n0, n1, y);
  constexpr int64_t kBytes = 34;
  const int64_t blocks = xp.blocks, ldw = blocks * kBytes, tn = xp.tn, T = xp.T;
  configure8(static_cast<int>(tn));
  alignas(64) int32_t C[kChunk][3][16 * 16];
  alignas(64) float dd[kChunk][16];
  alignas(64) int8_t pad[16 * 32];  // a partial tile's rows, zeros past the matrix
  if (tn > 1) std::memset(C, 0, sizeof(C));
  thread_local std::vector<__m512> accbuf;
  accbuf.resize(kTileGroup * 16);
  float* acc = reinterpret_cast<float*>(accbuf.data());
  const __m512i offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(static_cast<int>(ldw)));
  for (int64_t g0 = 0; g0 < xp.tiles; g0 += kTileGroup) {
    const int64_t group = std::min(kTileGroup, xp.tiles - g0);
    for (int64_t n = n0; n < n1; n += 16) {
      const int rows_here = static_cast<int>(std::min<int64_t>(16, n1 - n));
      const __mmask16 rowmask = static_cast<__mmask16>((1u << rows_here) - 1);
      __m512 acc1 = _mm512_setzero_ps();
      if (tn > 1) std::memset(acc, 0, sizeof(float) * group * 256);
      for (int64_t b0 = 0; b0 < blocks; b0 += kChunk) {
        const int64_t nb = std::min(kChunk, blocks - b0);
        for (int64_t j = 0; j < nb; ++j) {
          if (n + 16 < n1) prefetch_slice(w + (n + 16) * ldw, 16 * ldw, b0 + j, blocks);
          const __m512i dm = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rowmask, offsets,
                                                         w + n * ldw + (b0 + j) * kBytes, 1);
          _mm512_store_ps(dd[j], _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)));
        }
        for (int64_t gt = 0; gt < group; ++gt) {
          const int64_t tt = g0 + gt;
          const uint32_t* xt = xp.b.data() + (tt * blocks + b0) * 3 * 8 * tn;
          const int64_t cstride = tn == 1 ? 4 : 64;
          for (int64_t j = 0; j < nb; ++j) {
            const uint8_t* a = w + n * ldw + (b0 + j) * kBytes + 2;
            if (rows_here == 16) {
              _tile_loadd(1, a, ldw);
            } else {
              std::memset(pad, 0, sizeof(pad));
              for (int i = 0; i < rows_here; ++i) std::memcpy(pad + 32 * i, a + i * ldw, 32);
              _tile_loadd(1, pad, 32);
            }
            _tile_zero(0);
            _tile_zero(3);
            _tile_zero(4);
            _tile_loadd(2, xt + (j * 3 + 0) * 8 * tn, 4 * tn);
            _tile_dpbssd(0, 1, 2);
            _tile_loadd(2, xt + (j * 3 + 1) * 8 * tn, 4 * tn);
            _tile_dpbssd(3, 1, 2);
            _tile_loadd(2, xt + (j * 3 + 2) * 8 * tn, 4 * tn);
            _tile_dpbssd(4, 1, 2);
            _tile_stored(0, C[j][0], cstride);
            _tile_stored(3, C[j][1], cstride);
            _tile_stored(4, C[j][2], cstride);
          }
          const float* sb = xp.scales.data() + (tt * blocks + b0) * 16;
          if (tn == 1) {
            for (int64_t j = 0; j < nb; ++j) {
              const __m512 scale = _mm512_mul_ps(_mm512_load_ps(dd[j]), _mm512_set1_ps(sb[j * 16]));
              acc1 = _mm512_fmadd_ps(limb_sum(C[j][0], C[j][1], C[j][2]), scale, acc1);
            }
            continue;
          }
          float* at = acc + gt * 256;
          for (int i = 0; i < 16; ++i) {
            __m512 v = _mm512_load_ps(at + i * 16);
            for (int64_t j = 0; j < nb; ++j) {
              const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(dd[j][i]), _mm512_loadu_ps(sb + j * 16));
              v = _mm512_fmadd_ps(limb_sum(C[j][0] + i * 16, C[j][1] + i * 16, C[j][2] + i * 16), scale, v);
            }
            _mm512_store_ps(at + i * 16, v);
          }
        }
      }
      if (tn == 1) {
        _mm512_mask_storeu_ps(y + n, rowmask, acc1);
        continue;
      }
      for (int64_t gt = 0; gt < group; ++gt) {
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
