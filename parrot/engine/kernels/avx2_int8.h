// Generated tokens' rows on two limbs with AVX2 only: the integer sums of VNNI's 2-limb products
// (vnni_matmul.h) from vpmaddubsw, so a row's result is the same bits as on an AVX-512 VNNI or AMX CPU, and
// the same in any batch. Included by cpu_kernels.cc on every CPU (AVX2, FMA and F16C are its baseline).
//
// Numbers. As `vnni::pack_x` with 2 limbs: each block of 32 activations is x = s * (65536 l0 + 256 l1),
// s = max|x| / 2^22, with l0, l1 signed bytes (x rounded to 2^14 steps of the block's largest), and the
// weights' integers are the blocks' as the file stores them (the tiled copy, tiled_rows.h, or the GGUF rows,
// transposed per block). The sums
// S_l = sum_k w_k l_k are exact in integers, so S = 256 S0 + S1 is the integer VNNI sums; then float32
// computes, block after block, acc += float(S) * (d * 256 s) and acc += m * sum(x), the steps and the
// order of `vnni::block_tokens`. The block's sum(x) is reduced in the same tree as `vnni::pack_x`'s.
//
// Products. A 32-bit lane is one weight row (8 rows a register: a tile's two halves in turn). Q4: vpmaddubsw
// multiplies a row's four nibbles (0..15, unsigned) by four limb bytes (signed, |l| <= 128) broadcast to
// every lane and adds pairs into int16 (within 3,840), as vpdpbusd does; a block's 8 groups add up in int16
// (<= 30,720) before one vpmaddwd widens them. Q8_0's bytes (w + 128, up to 255) would overflow those
// pairs: its weights are widened to int16 pairs once per block (128 taken off) and vpmaddwd multiplies
// them by pairs of the 2-limb integers xi = 256 l0 + l1 (|xi| <= 2^14 + 1) as int16: int32 sums, exact.
//
// Against the float32 code with dequantized weights on the same CPU (AVX2 build, 2-core Zen 4, one thread,
// docs/benchmarks.md) the products of 1 to 16 rows take less time: no dequantizing, 4-byte groups of
// 8 rows per instruction.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "aligned.h"
#include "tiled_rows.h"

#define PARROT_INLINE inline __attribute__((always_inline))

namespace avx2i8 {

// Activations packed for the products: per token and block, each limb's 32 bytes as 8 words (word c:
// activations 4c..4c+3; Q4) or the 2-limb integers as int16 pairs (Q8_0), the block's 256 s and sum(x).
struct Packed {
  int64_t T = 0, blocks = 0;
  aligned::vector<uint32_t> words;   // [T][blocks][2 limbs][8] (Q4)
  aligned::vector<float> s256;       // [T][blocks]
  aligned::vector<float> sums;       // [T][blocks]
  aligned::vector<uint32_t> pairs;   // `pairs` packs (Q8_0): [T][blocks][16], xi[2j], xi[2j + 1] as int16
};

// The sum of 32 floats v[0..3] (8 each) in the tree of vnni::pack_x: (x[i] + x[16 + i]) over 16 lanes,
// upper 8 plus lower 8, upper 4 plus lower 4, then pairs.
inline float sum32(const __m256 v[4]) {
  const __m256 lo = _mm256_add_ps(v[0], v[2]), hi = _mm256_add_ps(v[1], v[3]);
  const __m256 t3 = _mm256_add_ps(hi, lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}

inline __m256 abs256(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }

// int32 lanes (|v| <= 2^14 + 1) -> their low bytes, packed into 8 bytes (two words)
inline uint64_t low_bytes(__m256i v) {
  const __m256i b = _mm256_shuffle_epi8(v, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                            0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
  const uint32_t lo = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_castsi256_si128(b)));
  const uint32_t hi = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_extracti128_si256(b, 1)));
  return lo | (static_cast<uint64_t>(hi) << 32);
}

// x [T, K] -> p, the values of vnni::pack_x(x, T, K, ..., limbs = 2) (scales256, sums, the limbs' bytes),
// laid out for `rows`; with `pairs` (Q8_0's products), each 2-limb integer xi = 256 l0 + l1 as int16 pairs
// instead of the limbs' bytes.
inline void pack(const float* x, int64_t T, int64_t K, Packed& p, bool pairs = false) {
  p.T = T, p.blocks = K / 32;
  p.pairs.resize(pairs ? T * p.blocks * 16 : 0);
  p.words.resize(pairs ? 0 : T * p.blocks * 16);
  p.s256.resize(T * p.blocks);
  p.sums.resize(T * p.blocks);
  const __m256i c128 = _mm256_set1_epi32(128), c255 = _mm256_set1_epi32(255);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < p.blocks; ++b) {
      const int64_t at = t * p.blocks + b;
      const float* xb = x + t * K + b * 32;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
      p.sums[at] = sum32(v);
      uint32_t* out = (pairs ? p.pairs.data() : p.words.data()) + at * 16;  // limb words or int16 pairs
      std::memset(out, 0, 64);
      p.s256[at] = 0.f;
      const __m256 mx = _mm256_max_ps(_mm256_max_ps(abs256(v[0]), abs256(v[1])), _mm256_max_ps(abs256(v[2]), abs256(v[3])));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_shuffle_ps(m4, m4, _MM_SHUFFLE(1, 0, 3, 2)));
      m4 = _mm_max_ps(m4, _mm_shuffle_ps(m4, m4, _MM_SHUFFLE(2, 3, 0, 1)));
      const float a = _mm_cvtss_f32(m4);
      bool nan = false;
      for (int i = 0; i < 4; ++i) nan |= _mm256_movemask_ps(_mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q)) != 0;
      if (nan || !(a <= 3.4e38f)) {  // NaN or infinity: the products become NaN, as in float32
        p.s256[at] = NAN;
        continue;
      }
      if (!(a >= 1e-30f)) continue;  // zero (or too small to scale): limbs and scale stay zero
      p.s256[at] = a / 16384.f;
      const __m256 inv = _mm256_set1_ps(16384.f / a);
      for (int i = 0; i < 4; ++i) {  // activations 8i..8i+7: words 2i, 2i + 1 of each limb
        const __m256i xi = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
        if (pairs) {  // int32 -> int16 (|xi| <= 2^14 + 1), in order: pairs 4i..4i+3
          const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(xi), _mm256_extracti128_si256(xi, 1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 4 * i), h);
          continue;
        }
        const __m256i l1 = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(xi, c128), c255), c128);
        const __m256i l0 = _mm256_srai_epi32(_mm256_sub_epi32(xi, l1), 8);
        const uint64_t b0 = low_bytes(l0), b1 = low_bytes(l1);
        std::memcpy(out + 2 * i, &b0, 8);
        std::memcpy(out + 8 + 2 * i, &b1, 8);
      }
    }
}

// sum over the block's 8 groups of vpmaddubsw(w[c], limb word c broadcast), in int16 (see the header)
PARROT_INLINE __m256i limb_products(const __m256i w[8], const uint32_t* words) {
  __m256i a = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(static_cast<int>(words[0])));
  __m256i b = _mm256_maddubs_epi16(w[1], _mm256_set1_epi32(static_cast<int>(words[1])));
  for (int c = 2; c < 8; c += 2) {
    a = _mm256_add_epi16(a, _mm256_maddubs_epi16(w[c], _mm256_set1_epi32(static_cast<int>(words[c]))));
    b = _mm256_add_epi16(b, _mm256_maddubs_epi16(w[c + 1], _mm256_set1_epi32(static_cast<int>(words[c + 1]))));
  }
  return _mm256_add_epi16(a, b);
}

// One block of 8 weight rows, each row in a 32-bit lane: scales d, minima m, and the weights as the
// products take them (Q4: 8 vectors of 4-byte groups of nibbles; Q8_0: 16 vectors of int16 pairs).
struct RowBlock {
  __m256 d, m;
  __m256i w[8];
  alignas(32) __m256i wide[16];
};

// Q8_0: groups g[c] (bytes 4c..4c+3 of each lane's row, as w + 128) -> int16 pairs (2j, 2j + 1)
PARROT_INLINE void widen_signed(const __m256i g[8], RowBlock& rb) {
  const __m256i lo = _mm256_setr_epi8(0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1,
                                      0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1);
  const __m256i hi = _mm256_add_epi8(lo, _mm256_setr_epi8(2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0,
                                                           2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0));
  const __m256i c128 = _mm256_set1_epi16(128);
  for (int c = 0; c < 8; ++c) {  // widened, then 128 taken off
    rb.wide[2 * c] = _mm256_sub_epi16(_mm256_shuffle_epi8(g[c], lo), c128);
    rb.wide[2 * c + 1] = _mm256_sub_epi16(_mm256_shuffle_epi8(g[c], hi), c128);
  }
}

// Q4: groups g[c] (bytes 4c..4c+3 of the 16 nibble bytes) -> weights 4c.. (low nibbles), 16 + 4c.. (high)
PARROT_INLINE void split_nibbles(const __m256i g[4], RowBlock& rb) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {
    rb.w[c] = _mm256_and_si256(g[c], nib);
    rb.w[4 + c] = _mm256_and_si256(_mm256_srli_epi16(g[c], 4), nib);
  }
}

// Block `b` of half `half` (rows 8 half..) of a tile of the tiled layout (`tile`: its first block).
template <class F>
PARROT_INLINE void tiled_block(const uint8_t* tile, int64_t b, int half, RowBlock& rb) {
  const uint8_t* blk = tile + b * tiled::kTileBlockBytes<F>;
  rb.d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * half)));
  rb.m = _mm256_setzero_ps();
  if constexpr (F::kMin == 1) rb.m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * half)));
  const uint8_t* q = blk + tiled::kTileScaleBytes<F> + 32 * half;
  __m256i g[8];
  for (int c = 0; c < (F::kSigned ? 8 : 4); ++c) g[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * c));
  if constexpr (F::kSigned) widen_signed(g, rb);
  else split_nibbles(g, rb);
}

// 8 rows' 16 bytes (a[r]) -> out[c]: their 4-byte group c, lane r from row r
inline void transpose8x4(const __m128i a[8], __m256i out[4]) {
  __m256i y[4];
  for (int i = 0; i < 4; ++i) y[i] = _mm256_inserti128_si256(_mm256_castsi128_si256(a[i]), a[i + 4], 1);
  const __m256i t0 = _mm256_unpacklo_epi32(y[0], y[1]), t1 = _mm256_unpackhi_epi32(y[0], y[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(y[2], y[3]), t3 = _mm256_unpackhi_epi32(y[2], y[3]);
  out[0] = _mm256_unpacklo_epi64(t0, t2), out[1] = _mm256_unpackhi_epi64(t0, t2);
  out[2] = _mm256_unpacklo_epi64(t1, t3), out[3] = _mm256_unpackhi_epi64(t1, t3);
}

alignas(32) inline constexpr uint8_t kZeroBlock[64] = {};

// Block `b` of 8 GGUF rows (`rows[r]`: row r's first block; kZeroBlock past the matrix's last row).
template <class F>
PARROT_INLINE void gguf_block(const uint8_t* const rows[8], int64_t b, RowBlock& rb) {
  alignas(16) uint16_t d[8], m[8];
  __m128i a[8], a2[8];
  for (int r = 0; r < 8; ++r) {
    const uint8_t* blk = rows[r] == kZeroBlock ? kZeroBlock : rows[r] + b * F::kBytes;
    std::memcpy(d + r, blk, 2);
    if constexpr (F::kMin == 1) std::memcpy(m + r, blk + 2, 2);
    a[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + F::kQs));
    if constexpr (F::kSigned) a2[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + F::kQs + 16));
  }
  rb.d = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(d)));
  rb.m = _mm256_setzero_ps();
  if constexpr (F::kMin == 1) rb.m = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(m)));
  __m256i g[8];
  transpose8x4(a, g);
  if constexpr (F::kSigned) {
    transpose8x4(a2, g + 4);
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));  // signed bytes -> w + 128, as tiled
    for (int c = 0; c < 8; ++c) g[c] = _mm256_xor_si256(g[c], flip);
    widen_signed(g, rb);
  } else {
    split_nibbles(g, rb);
  }
}

// One token's products with one block of 8 weight rows (`at`: its block in `p`), added to `acc` (the steps of
// vnni::block_tokens for 2 limbs).
template <class F>
PARROT_INLINE __m256 token_block(const Packed& p, int64_t at, const RowBlock& rb, __m256 m, __m256 acc) {
  __m256i S2;  // sum w xi = 256 S0 + S1, exactly VNNI's
  if constexpr (F::kSigned) {  // int16 pairs: |w xi + w' xi'| <= 2^22.1, 16 of them well within int32
    const uint32_t* xp = p.pairs.data() + at * 16;
    __m256i a = _mm256_madd_epi16(rb.wide[0], _mm256_set1_epi32(static_cast<int>(xp[0])));
    __m256i a2 = _mm256_madd_epi16(rb.wide[1], _mm256_set1_epi32(static_cast<int>(xp[1])));
    for (int j = 2; j < 16; j += 2) {
      a = _mm256_add_epi32(a, _mm256_madd_epi16(rb.wide[j], _mm256_set1_epi32(static_cast<int>(xp[j]))));
      a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(rb.wide[j + 1], _mm256_set1_epi32(static_cast<int>(xp[j + 1]))));
    }
    S2 = _mm256_add_epi32(a, a2);
  } else {
    const __m256i ones = _mm256_set1_epi16(1);
    const uint32_t* words = p.words.data() + at * 16;
    const __m256i S0 = _mm256_madd_epi16(limb_products(rb.w, words), ones);
    const __m256i S1 = _mm256_madd_epi16(limb_products(rb.w, words + 8), ones);
    S2 = _mm256_add_epi32(_mm256_slli_epi32(S0, 8), S1);
  }
  __m256 r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S2), _mm256_mul_ps(rb.d, _mm256_set1_ps(p.s256[at])), acc);
  if constexpr (F::kMin != 0) r = _mm256_fmadd_ps(m, _mm256_set1_ps(p.sums[at]), r);
  return r;
}

template <class F>
PARROT_INLINE __m256 block_min(const RowBlock& rb) {
  if constexpr (F::kMin == 2) return _mm256_mul_ps(rb.d, _mm256_set1_ps(-8.f));
  return rb.m;
}

// Every token's products with one block of 8 weight rows, added into acc [T][8].
template <class F>
PARROT_INLINE void block_tokens(const Packed& p, int64_t b, const RowBlock& rb, float* acc) {
  const __m256 m = block_min<F>(rb);
  for (int64_t t = 0; t < p.T; ++t)
    _mm256_store_ps(acc + 8 * t, token_block<F>(p, t * p.blocks + b, rb, m, _mm256_load_ps(acc + 8 * t)));
}

// The next block of 8 weight rows, from the tiled copy `tile` (prefetching the next tile) or the GGUF rows.
template <class F>
PARROT_INLINE void next_block(const uint8_t* w, const uint8_t* tile, const uint8_t* const rows8[8], int64_t n,
                              int64_t n1, int half, int64_t b, int64_t blocks, int64_t ldw, int64_t tile_bytes,
                              RowBlock& rb) {
  if (tile != nullptr) {
    if (n + 16 - 8 * half < n1)  // the next tile, a slice a block of either half
      tiled::prefetch_slice(tile + tile_bytes, tile_bytes, half * blocks + b, 2 * blocks);
    tiled_block<F>(tile, b, half, rb);
  } else {
    if (n + 8 < n1) tiled::prefetch_slice(w + (n + 8) * ldw, 8 * ldw, b, blocks);  // the next 8 rows
    gguf_block<F>(rows8, b, rb);
  }
}

// T (at most 4) tokens' sums kept in registers from block to block (a few tokens: the sum of one block waits for
// the last otherwise, through memory).
template <class F, int T>
PARROT_INLINE void few_tokens(const Packed& p, const uint8_t* w, const uint8_t* tile, const uint8_t* const rows8[8],
                              int64_t n, int64_t n1, int half, int64_t ldw, int64_t tile_bytes, float* out8) {
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < p.blocks; ++b) {
    RowBlock rb;
    next_block<F>(w, tile, rows8, n, n1, half, b, p.blocks, ldw, tile_bytes, rb);
    const __m256 m = block_min<F>(rb);
    for (int t = 0; t < T; ++t) acc[t] = token_block<F>(p, t * p.blocks + b, rb, m, acc[t]);
  }
  for (int t = 0; t < T; ++t) _mm256_store_ps(out8 + 8 * t, acc[t]);
}

// Output columns [n0, n1) (n0 a multiple of 16) of every token of `p`: 8 weight rows at a time, from the
// tiled copy `wt` where given, else from the GGUF rows `w` (transposed per block: the same integers, the
// same bits).
template <class F>
void rows(const Packed& p, const uint8_t* w, const uint8_t* wt, int64_t n0, int64_t n1, float* y, int64_t N) {
  thread_local aligned::vector<float> acc;
  acc.resize(p.T * 8);
  const int64_t blocks = p.blocks, ldw = blocks * F::kBytes, tile_bytes = blocks * tiled::kTileBlockBytes<F>;
  for (int64_t n = n0; n < n1; n += 8) {
    const int cols = static_cast<int>(std::min<int64_t>(8, n1 - n));
    const uint8_t* tile = wt != nullptr ? wt + n / 16 * tile_bytes : nullptr;
    const int half = static_cast<int>(n / 8 % 2);
    const uint8_t* rows8[8];
    for (int r = 0; r < 8; ++r) rows8[r] = r < cols ? w + (n + r) * ldw : kZeroBlock;
    switch (p.T) {
      case 1: few_tokens<F, 1>(p, w, tile, rows8, n, n1, half, ldw, tile_bytes, acc.data()); break;
      case 2: few_tokens<F, 2>(p, w, tile, rows8, n, n1, half, ldw, tile_bytes, acc.data()); break;
      case 3: few_tokens<F, 3>(p, w, tile, rows8, n, n1, half, ldw, tile_bytes, acc.data()); break;
      case 4: few_tokens<F, 4>(p, w, tile, rows8, n, n1, half, ldw, tile_bytes, acc.data()); break;
      default:
        for (int64_t t = 0; t < p.T; ++t) _mm256_store_ps(acc.data() + 8 * t, _mm256_setzero_ps());
        for (int64_t b = 0; b < blocks; ++b) {
          RowBlock rb;
          next_block<F>(w, tile, rows8, n, n1, half, b, blocks, ldw, tile_bytes, rb);
          block_tokens<F>(p, b, rb, acc.data());
        }
    }
    for (int64_t t = 0; t < p.T; ++t) std::memcpy(y + t * N + n, acc.data() + 8 * t, 4 * cols);
  }
}

}  // namespace avx2i8

#undef PARROT_INLINE
