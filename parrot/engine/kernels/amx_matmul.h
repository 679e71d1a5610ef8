// The block-quantized product on Intel AMX's integer tiles for many activation rows, and on AVX-512 VNNI
// (vnni_matmul.h) for up to kVnniRows, for CPUs with AMX-INT8. Included by cpu_kernels.cc; see
// parrot_qmatmul there for the operands, and vnni_matmul.h for the numbers: the tiles compute the same
// exact integer sums and the same float32 steps, so a row's result is the same bits on either path.
//
// Tiles. A: 16 weight rows x one block (32 bytes; Q8_0 read in place at the row stride, Q4's nibbles
// unpacked to bytes); B: a token tile's limb l for the block, [8 groups of 4 weights, tn tokens x 4 bytes];
// C: three int32 tiles [16 weight rows, tn tokens], one per limb.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "aligned.h"
#include "vnni_matmul.h"

namespace amx {

using namespace vnni;  // NOLINT: the block formats, the activations' packing and the shared float32 steps

constexpr int64_t kChunk = 16;     // blocks prepared before the tile unit runs over them
constexpr int64_t kTileGroup = 8;  // token tiles (16 tokens each) whose sums are held at once
constexpr int kVnniRows = 16;  // up to this many activation rows: VNNI (as fast per row as the tiles, up to 16)

// Linux hands a process the tile data state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
inline bool request_permission() { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

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
  if (!xp.for_tiles) return vnni::rows<F>(xp, w, n0, n1, y, N);
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
