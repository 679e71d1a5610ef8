// The block-quantized product on Intel AMX's integer tiles for many activation rows, and on AVX-512 VNNI
// (vnni_matmul.h) for fewer, for CPUs with AMX-INT8. Included by cpu_kernels.cc; see parrot_qmatmul there
// for the operands, and vnni_matmul.h for the numbers: the tiles compute the same exact integer sums and
// the same float32 steps, so a row's result is the same bits on any path.
//
// Three tile paths:
// - `rows`, from the GGUF rows: A 16 weight rows x one block (32 bytes; Q8_0 read in place at the row
//   stride, Q4's nibbles unpacked to bytes); B a token tile's limb l for the block, [8 groups of 4
//   weights, tn tokens x 4 bytes]; C an int32 tile [16 weight rows, tn tokens] per limb. Rows of
//   prompt tokens in integers, and generated rows where no tiled copy is given.
// - `tiled_rows`, from the weights' copy tiled for the lanes (tiled_rows.h): B the block's 16 weight rows
//   as that copy holds them, A a limb of tn tokens, C [tn tokens, 16 weight rows]; no transposing or
//   gathering of weights, outputs stored 16 columns at a time. The decode steps' products from 9 rows.
// - `few_rows`, from the tiled copy too, for 5-8 rows on 2 limbs: every limb of every token a row of one A
//   tile, so a block costs one product and one store.
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
constexpr int kVnniRows = 16;  // without the tiled copy, up to this many rows: VNNI (as fast per row as `rows`)

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

// Both tile paths keep two blocks in flight, so that one block's stores overlap the next one's products:
// block j uses set j % 2. Set 0: A tmm1, B tmm2, C per limb tmm0, tmm3 (and tmm4 for a third limb); set 1
// (2 limbs only): A tmm6, B tmm7, C tmm4, tmm5. C tiles [c_rows, c_bytes], A [a_rows, 32 bytes: a block],
// B [8 groups of 4 bytes, b_bytes]. Loaded by every call on its own thread: the configuration is per
// thread, and other libraries (oneDNN) set their own on the same threads.
inline void configure(int c_rows, int c_bytes, int a_rows, int b_bytes) {
  TileConfig cfg;
  for (int t : {0, 3, 4, 5}) cfg.rows[t] = static_cast<uint8_t>(c_rows), cfg.colsb[t] = static_cast<uint16_t>(c_bytes);
  for (int t : {1, 6}) cfg.rows[t] = static_cast<uint8_t>(a_rows), cfg.colsb[t] = 32;
  for (int t : {2, 7}) cfg.rows[t] = 8, cfg.colsb[t] = static_cast<uint16_t>(b_bytes);
  asm volatile("" : : "r"(&cfg) : "memory");  // GCC does not see ldtilecfg read `cfg`: keep its stores
  _tile_loadconfig(&cfg);
}

// One block's limb sums into c[limb] (the tile intrinsics take the registers' numbers as literals): the
// operand the limbs share (`once`, into tile kOnce) loaded once, each limb's (`per`, `step` apart, into
// tile kPer) in turn, `dp(C, A, B)` into C tiles kC0, kC1 (a third limb: tmm4), stored 64 bytes a row.
#define PARROT_AMX_LIMB_SUMS(dp, kOnce, once, once_ld, kPer, per, per_ld, step, kA, kB, kC0, kC1) \
  _tile_loadd(kOnce, once, once_ld);                                                              \
  _tile_zero(kC0);                                                                                \
  _tile_zero(kC1);                                                                                \
  _tile_loadd(kPer, per, per_ld);                                                                 \
  dp(kC0, kA, kB);                                                                                \
  _tile_loadd(kPer, (per) + (step), per_ld);                                                      \
  dp(kC1, kA, kB);                                                                                \
  if constexpr (LIMBS == 3) {                                                                     \
    _tile_zero(4);                                                                                \
    _tile_loadd(kPer, (per) + 2 * (step), per_ld);                                                \
    dp(4, kA, kB);                                                                                \
    _tile_stored(4, c[LIMBS - 1], 64);                                                            \
  }                                                                                               \
  _tile_stored(kC0, c[0], 64);                                                                    \
  _tile_stored(kC1, c[1], 64)
#define PARROT_AMX_DP(c, a, b) \
  if constexpr (kSigned) _tile_dpbssd(c, a, b); else _tile_dpbusd(c, a, b)

// One block's limb sums for a token tile: A from `a` (row stride `lda`), B from `xt` (the block's limbs),
// stored to c[limb] (16 x 16 int32 each), on tile set S (above).
template <bool kSigned, int LIMBS, int S>
inline void block_sums(const uint8_t* a, int64_t lda, const uint32_t* xt, int64_t tn, int32_t (*c)[256]) {
  static_assert(S == 0 || LIMBS == 2, "a third limb's C is set 1's");
  if constexpr (S == 0) {
    PARROT_AMX_LIMB_SUMS(PARROT_AMX_DP, 1, a, lda, 2, xt, 4 * tn, 8 * tn, 1, 2, 0, 3);
  } else {
    PARROT_AMX_LIMB_SUMS(PARROT_AMX_DP, 6, a, lda, 7, xt, 4 * tn, 8 * tn, 6, 7, 4, 5);
  }
}
#undef PARROT_AMX_DP

// Output columns [n0, n1) of every activation row, 16 weight rows at a time, in three phases over up to
// kChunk blocks, so that no phase waits on memory the one before has just written: (1) the blocks' A
// tiles (Q4 unpacked) and scales; (2) the tile unit stores each block's limb sums for a token tile;
// (3) vector code adds them up in block order, with block_tokens' float32 steps (2 limbs: 256 S0 + S1 in
// int32, times d * 256 s; 3 limbs: limb_sum times d * s), so a row's result is the same bits as VNNI's.
template <class F, int LIMBS>
void rows_limbs(const XPack& xp, const uint8_t* w, int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t blocks = xp.blocks, ldw = blocks * F::kBytes, tn = xp.tn, T = xp.T;
  configure(16, static_cast<int>(4 * tn), 16, static_cast<int>(4 * tn));
  alignas(64) uint8_t A[kChunk][16 * 32];
  alignas(64) int32_t C[kChunk][LIMBS][256];
  alignas(64) float dd[kChunk][16], mm[kChunk][16];
  std::memset(C, 0, sizeof(C));  // the columns past tn stay zero (a tile store writes tn of them)
  struct alignas(64) Row { float v[16]; };
  thread_local std::vector<Row> accbuf;  // [token tiles of the group][16 weight rows] x 16 tokens
  accbuf.resize(kTileGroup * 16);
  float* acc = accbuf.data()->v;
  const float* tscale = LIMBS == 2 ? xp.scales256.data() : xp.scales.data();
  const __m512i offsets = row_offsets(ldw);
  for (int64_t g0 = 0; g0 < xp.tiles; g0 += kTileGroup) {
    const int64_t group = std::min(kTileGroup, xp.tiles - g0);
    for (int64_t n = n0; n < n1; n += 16) {
      const int rows_here = static_cast<int>(std::min<int64_t>(16, n1 - n));
      const __mmask16 rowmask = static_cast<__mmask16>((1u << rows_here) - 1);
      const bool in_place = F::kSigned && rows_here == 16;  // Q8_0's bytes are A as they are
      std::memset(acc, 0, sizeof(float) * group * 256);
      for (int64_t b0 = 0; b0 < blocks; b0 += kChunk) {
        const int64_t nb = std::min(kChunk, blocks - b0);
        for (int64_t j = 0; j < nb; ++j) {  // (1)
          const uint8_t* blk = w + n * ldw + (b0 + j) * F::kBytes;
          if (n + 16 < n1) prefetch_slice(w + (n + 16) * ldw, 16 * ldw, b0 + j, blocks);
          if constexpr (F::kSigned) {  // read in place below, but for a partial tile
            if (!in_place) {
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
            const uint8_t* a = in_place ? w + n * ldw + (b0 + j) * F::kBytes + F::kQs : A[j];
            const int64_t lda = in_place ? ldw : 32;
            if constexpr (LIMBS == 2) {
              if (j % 2) {
                block_sums<F::kSigned, LIMBS, 1>(a, lda, xt + j * 3 * 8 * tn, tn, C[j]);
                continue;
              }
            }
            block_sums<F::kSigned, LIMBS, 0>(a, lda, xt + j * 3 * 8 * tn, tn, C[j]);
          }
          const float* sb = tscale + (tt * blocks + b0) * 16;
          const float* xs = xp.sums.data() + (tt * blocks + b0) * 16;
          float* at = acc + gt * 256;
          for (int i = 0; i < 16; ++i) {  // (3)
            __m512 v = _mm512_load_ps(at + i * 16);
            for (int64_t j = 0; j < nb; ++j) {
              const __m512i s0 = _mm512_load_si512(C[j][0] + i * 16), s1 = _mm512_load_si512(C[j][1] + i * 16);
              __m512 ls;
              if constexpr (LIMBS == 2) ls = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(s0, 8), s1));
              else ls = limb_sum(s0, s1, _mm512_load_si512(C[j][2] + i * 16));
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

template <class F>
void rows(const XPack& xp, const uint8_t* w, int64_t n0, int64_t n1, float* y, int64_t N) {
  if (!xp.for_tiles) return vnni::rows<F>(xp, w, n0, n1, y, N);
  if (xp.limbs == 2) return rows_limbs<F, 2>(xp, w, n0, n1, y, N);
  rows_limbs<F, 3>(xp, w, n0, n1, y, N);
}

// ---- weight rows tiled for the lanes (tiled_rows.h), activations as VNNI packs them -------------------
// The roles turned around: B is a block of 16 weight rows as the tiled layout holds it (row r of B: K
// 4r..4r+3 of the 16 rows, 64 bytes; Q4's nibbles split into rows 0-3 and 4-7, Q8_0's bytes in place,
// 128 added), A a limb of tn tokens' activations (pack_x's `rows`: 32 bytes a token, at the token's
// stride), and C [tn tokens, 16 weight rows], one per limb: each C row is block_tokens' S for a token with
// the weight rows in the lanes, and the float32 steps after it are VNNI's own (lane_steps), so a row's
// result is the same bits as VNNI's. No weight row is transposed or gathered, and the outputs are stored
// a token's 16 columns at a time. The tile unit takes block j + 1 while the vector unit adds up block j.

// One block's limb sums for a token tile: B (the weights, unsigned bytes) from `wb`, A from `x` (the tile's
// first token's limb 0 for the block; `ldx` between tokens), into c[limb] [tn tokens][16 rows] int32.
template <int LIMBS, int S>
inline void tiled_sums(const uint8_t* wb, const uint8_t* x, int64_t ldx, int32_t (*c)[256]) {
  static_assert(S == 0 || LIMBS == 2, "a third limb's C is set 1's");
  if constexpr (S == 0) {
    PARROT_AMX_LIMB_SUMS(_tile_dpbsud, 2, wb, 64, 1, x, ldx, 32, 1, 2, 0, 3);
  } else {
    PARROT_AMX_LIMB_SUMS(_tile_dpbsud, 7, wb, 64, 6, x, ldx, 32, 6, 7, 4, 5);
  }
}
#undef PARROT_AMX_LIMB_SUMS

// A block's sums (c) into the token tile's accumulators (acc[t]: token t's 16 weight rows), by VNNI's
// float32 steps (lane_steps).
template <class F, int LIMBS>
inline void tiled_epilogue(const XPack& xp, int64_t g, int64_t b, const int32_t (*c)[256], __m512 d, __m512 m,
                           int64_t tn, __m512* acc) {
  for (int64_t t = 0; t < tn; ++t) {
    const __m512i S[3] = {_mm512_load_si512(c[0] + 16 * t), _mm512_load_si512(c[1] + 16 * t),
                          LIMBS == 3 ? _mm512_load_si512(c[LIMBS - 1] + 16 * t) : _mm512_setzero_si512()};
    acc[t] = lane_steps<F, LIMBS>(xp, (g * xp.blocks + b) * 16 + t,
                                  xp.limb_sums.data() + ((g * 16 + t) * xp.blocks + b) * 3, S, d, m, acc[t]);
  }
}

// A chunk's B tiles from the tiled copy (kChunk blocks of the 16 weight rows at `tile`): Q4's nibbles split
// into their two halves of K (`make`), Q8_0's bytes read in place.
template <class F>
struct ChunkB {
  alignas(64) uint8_t q[F::kSigned ? 1 : kChunk][512];
  const uint8_t* tile = nullptr;
  int64_t b0 = 0;
  void make(const uint8_t* t, int64_t first, int64_t nb) {
    tile = t, b0 = first;
    if constexpr (!F::kSigned) {
      const __m512i nib = _mm512_set1_epi8(0x0F);
      for (int64_t j = 0; j < nb; ++j) {
        const uint8_t* src = tile + (b0 + j) * kTileBlockBytes<F> + kTileScaleBytes<F>;
        for (int c = 0; c < 4; ++c) {
          const __m512i v = _mm512_loadu_si512(src + 64 * c);
          _mm512_store_si512(q[j] + 64 * c, _mm512_and_si512(v, nib));
          _mm512_store_si512(q[j] + 64 * (4 + c), _mm512_and_si512(_mm512_srli_epi16(v, 4), nib));
        }
      }
    }
  }
  const uint8_t* operator[](int64_t j) const {  // the chunk's block j
    if constexpr (F::kSigned) return tile + (b0 + j) * kTileBlockBytes<F> + kTileScaleBytes<F>;
    else return q[j];
  }
};

// Block b of the 16 weight rows at `tile`: its rows' scales d and minima m (Q4_1's m, Q4_0's -8 d), the same
// block of the next 16 rows (`next`, if any) fetched meanwhile, spread over this tile's work.
template <class F>
inline void tile_block(const uint8_t* tile, const uint8_t* next, int64_t b, __m512& d, __m512& m) {
  if (next) tiled::prefetch_block<F>(next, b);
  const uint8_t* blk = tile + b * kTileBlockBytes<F>;
  d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
  m = _mm512_setzero_ps();
  if constexpr (F::kMin == 1) m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
  else if constexpr (F::kMin == 2) m = _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
}

// body(n, tile, next, rows_here, b0, nb) for each 16 weight rows [n, n + 16) of [n0, n1) of the tiled weights
// `wt` (`tile`: their first block; `next`: the next 16 rows', null at the last) and each chunk of up to kChunk
// of their blocks from b0, the chunk's B tiles made ready in `wblock` first.
template <class F, class Body>
inline void tile_chunks(const uint8_t* wt, int64_t blocks, int64_t n0, int64_t n1, ChunkB<F>& wblock, Body&& body) {
  for (int64_t n = n0; n < n1; n += 16) {
    const uint8_t* tile = wt + n / 16 * blocks * kTileBlockBytes<F>;
    const uint8_t* next = n + 16 < n1 ? tile + blocks * kTileBlockBytes<F> : nullptr;
    const int rows_here = static_cast<int>(std::min<int64_t>(16, n1 - n));
    for (int64_t b0 = 0; b0 < blocks; b0 += kChunk) {
      const int64_t nb = std::min(kChunk, blocks - b0);
      wblock.make(tile, b0, nb);
      body(n, tile, next, rows_here, b0, nb);
    }
  }
}

// Output columns [n0, n1) (n0 a multiple of 16) of every activation row, from the tiled weights `wt`: per
// 16 weight rows, a chunk of up to kChunk blocks' B tiles made ready (Q4's nibbles split), then each
// token tile's blocks, the tile unit one block ahead of the vector unit, its 16 tokens' accumulators in
// registers.
template <class F, int LIMBS>
void tiled_rows_limbs(const XPack& xp, const uint8_t* wt, int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t blocks = xp.blocks, tn = xp.tn, T = xp.T, ldx = blocks * 96;
  configure(static_cast<int>(tn), 64, static_cast<int>(tn), 64);
  ChunkB<F> wblock;
  alignas(64) int32_t C[2][LIMBS][256];
  thread_local aligned::vector<float> accbuf;  // [token tiles][16 tokens][16 rows], between chunks
  accbuf.resize(xp.tiles * 256);
  const uint8_t* xrows = reinterpret_cast<const uint8_t*>(xp.rows.data());
  tile_chunks<F>(wt, blocks, n0, n1, wblock, [&](int64_t n, const uint8_t* tile, const uint8_t* next, int rows_here,
                                                  int64_t b0, int64_t nb) {
    for (int64_t g = 0; g < xp.tiles; ++g) {
      __m512 acc[16];
      float* saved = accbuf.data() + g * 256;
      const int64_t cnt = std::min(tn, T - g * 16);  // the tile's tokens; the last tile's padding is not added up
      for (int64_t t = 0; t < cnt; ++t) acc[t] = b0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(saved + 16 * t);
      const uint8_t* x0 = xrows + (g * 16 * blocks + b0) * 96;
      auto sums = [&](int64_t j) {  // block j's sums on tile set j % 2 into C[j % 2] (a third limb: set 0)
        if constexpr (LIMBS == 2) {
          if (j % 2) return tiled_sums<LIMBS, 1>(wblock[j], x0 + j * 96, ldx, C[1]);
        }
        tiled_sums<LIMBS, 0>(wblock[j], x0 + j * 96, ldx, C[LIMBS == 2 ? j % 2 : 0]);
      };
      sums(0);
      for (int64_t j = 0; j < nb; ++j) {
        if (LIMBS == 2 && j + 1 < nb) sums(j + 1);  // two sets: the next block's sums go first
        __m512 d, m;
        tile_block<F>(tile, g == 0 ? next : nullptr, b0 + j, d, m);  // the next rows fetched beside the first tile
        tiled_epilogue<F, LIMBS>(xp, g, b0 + j, C[LIMBS == 2 ? j % 2 : 0], d, m, cnt, acc);
        if (LIMBS == 3 && j + 1 < nb) sums(j + 1);
      }
      if (b0 + nb < blocks) {
        for (int64_t t = 0; t < cnt; ++t) _mm512_store_ps(saved + 16 * t, acc[t]);
        continue;
      }
      const __mmask16 rowmask = static_cast<__mmask16>((1u << rows_here) - 1);
      for (int64_t t = 0; t < cnt; ++t) _mm512_mask_storeu_ps(y + (g * 16 + t) * N + n, rowmask, acc[t]);
    }
  });
  _tile_release();
}

template <class F>
void tiled_rows(const XPack& xp, const uint8_t* wt, int64_t n0, int64_t n1, float* y, int64_t N) {
  if (xp.limbs == 2) return tiled_rows_limbs<F, 2>(xp, wt, n0, n1, y, N);
  tiled_rows_limbs<F, 3>(xp, wt, n0, n1, y, N);
}

// ---- a few activation rows, every limb a row of one tile -----------------------------------------
// Below 16 tokens tiled_rows' tiles run mostly empty, and a tile's store (~19 cycles on a Xeon 6) and
// product (~12-20) cost about as much for a few rows as for 16, and do not overlap: at 8 tokens a block
// took 140 cycles there against VNNI's 165. Here every limb of every token is a row of one A tile (row
// l T + t: limb l of token t, 2 limbs), so a block is one product and one store. Each C row is
// block_tokens' limb sum S_l for one token with the weight rows in the lanes, and lane_steps takes it from
// there: the same bits as VNNI and tiled_rows.
constexpr int64_t kFewMaxRows = 8;  // tokens this path takes at most (2 limbs x 8 tokens: one tile's rows)

// The A tiles of `xp`'s T <= kFewMaxRows tokens (packed for VNNI, 2 limbs): [blocks][2 T rows][32 bytes].
inline void pack_few(const XPack& xp, aligned::vector<uint8_t>& a) {
  const int64_t T = xp.T, blocks = xp.blocks;
  a.resize(blocks * 2 * T * 32);
  const uint8_t* rows = reinterpret_cast<const uint8_t*>(xp.rows.data());
  for (int64_t b = 0; b < blocks; ++b)
    for (int l = 0; l < 2; ++l)
      for (int64_t t = 0; t < T; ++t)
        std::memcpy(a.data() + ((b * 2 + l) * T + t) * 32, rows + ((t * blocks + b) * 24 + l * 8) * 4, 32);
}

// Output columns [n0, n1) (n0 a multiple of 16) of the few rows packed in `a` (pack_few; `xp`, their VNNI
// pack) from the tiled weights `wt`: per 16 weight rows, a chunk of kChunk blocks' B tiles made ready (Q4's
// nibbles split; Q8_0's read in place), then one product per block on two tile sets, the tile unit one block
// ahead of the vector unit, the tokens' accumulators in registers.
template <class F>
void few_rows(const XPack& xp, const uint8_t* a, const uint8_t* wt, int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t blocks = xp.blocks, T = xp.T;
  configure(static_cast<int>(2 * T), 64, static_cast<int>(2 * T), 64);  // C tmm0 / tmm4, A tmm1 / tmm6, B tmm2 / tmm7
  ChunkB<F> wblock;
  alignas(64) int32_t C[2][16][16];
  thread_local aligned::vector<float> accbuf;  // [kFewMaxRows][16 rows], between chunks
  accbuf.resize(kFewMaxRows * 16);
  tile_chunks<F>(wt, blocks, n0, n1, wblock, [&](int64_t n, const uint8_t* tile, const uint8_t* next, int rows_here,
                                                  int64_t b0, int64_t nb) {
    __m512 acc[kFewMaxRows];
    for (int64_t t = 0; t < T; ++t) acc[t] = b0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(accbuf.data() + 16 * t);
    auto products = [&](int64_t j) {  // block b0 + j's limb sums on set j % 2
      const uint8_t* aj = a + (b0 + j) * 2 * T * 32;
      if (j % 2) {
        _tile_loadd(7, wblock[j], 64);
        _tile_loadd(6, aj, 32);
        _tile_zero(4);
        _tile_dpbsud(4, 6, 7);
      } else {
        _tile_loadd(2, wblock[j], 64);
        _tile_loadd(1, aj, 32);
        _tile_zero(0);
        _tile_dpbsud(0, 1, 2);
      }
    };
    auto store = [&](int64_t j) {  // ... into C[j % 2]
      if (j % 2) _tile_stored(4, C[1], 64);
      else _tile_stored(0, C[0], 64);
    };
    products(0);
    store(0);
    for (int64_t j = 0; j < nb; ++j) {
      if (j + 1 < nb) products(j + 1);  // the next block's product goes first, its store after this block's
      const int64_t b = b0 + j;         // vector work
      __m512 d, m;
      tile_block<F>(tile, next, b, d, m);
      const int32_t(*c)[16] = C[j % 2];
      for (int64_t t = 0; t < T; ++t) {
        const __m512i S[3] = {_mm512_load_si512(c[t]), _mm512_load_si512(c[T + t]), _mm512_setzero_si512()};
        acc[t] = lane_steps<F, 2>(xp, b * 16 + t, xp.limb_sums.data() + (t * blocks + b) * 3, S, d, m, acc[t]);
      }
      if (j + 1 < nb) store(j + 1);
    }
    if (b0 + nb < blocks) {
      for (int64_t t = 0; t < T; ++t) _mm512_store_ps(accbuf.data() + 16 * t, acc[t]);
      return;
    }
    const __mmask16 rowmask = static_cast<__mmask16>((1u << rows_here) - 1);
    for (int64_t t = 0; t < T; ++t) _mm512_mask_storeu_ps(y + t * N + n, rowmask, acc[t]);
  });
  _tile_release();
}

}  // namespace amx
