// Decode attention with bfloat16 products: parrot_paged_decode for the engine's bfloat16 mode over a
// bfloat16 cache (the `bf16` attribute), on CPUs with AVX512-BF16, for head sizes that are multiples of 64.
// Included by cpu_kernels.cc inside its anonymous namespace (HeadState, for_each_page and vexp from there).
//
// Numbers. The scaled queries and the probabilities are rounded to bfloat16; keys and values are read in
// place as they are stored (bfloat16); vdpbf16ps sums products of pairs in float32. The softmax runs in
// float32, online per tile of up to 16 keys of a page, as the float32 kernel does per page; the running
// sum adds the rounded probabilities, the ones the values are weighted by. A row's arithmetic depends only
// on its own query and its keys and values, in page order, so a sequence gets the same bits alone, in any
// batch, and with a shared prefix read once for several sequences (tiles never straddle pages, and a
// prefix ends on a page boundary).
//
// Work, per tile of 16 keys:
//  * keys: their dimension pairs transposed once, [D/2 pairs][16 keys] (16 x 16 dword transposes in
//    registers), for every (sequence, head) row that reads the tile; a row's 16 scores are then D/2
//    vdpbf16ps with its query's pair broadcast: no horizontal sums;
//  * values: two keys' rows interleaved per dimension (vpunpck*wd) for vdpbf16ps with the row's pair of
//    probabilities broadcast. Unpacking works within 128-bit lanes, so the output's dimensions come out
//    permuted within each 64 (`bf16_dim`); the caller puts them in order when it normalizes.
#pragma once

#if PARROT_AVX512_BF16
#define PARROT_DECODE_BF16 1

using avx512bf16::as_bh;
using avx512bf16::transpose16x16;

// The dimension that the accumulators' position p (within each 64) holds: vector c = p / 16, lane
// i = p % 16 came from unpacking 128-bit lane i / 4 of the rows' 32-dimension half c / 2.
inline int bf16_dim(int p) {
  const int c = p / 16, i = p % 16;
  return 32 * (c / 2) + 8 * (i / 4) + 4 * (c % 2) + i % 4;
}

// One (sequence, head) row of a call: its query's bfloat16 pairs, its softmax state and its accumulator.
struct Bf16Row {
  const uint32_t* q;  // D/2 pairs, scaled
  float* m;
  float* l;
  float* acc;         // D floats, permuted (bf16_dim)
};

constexpr int kBf16ScoreRows = 8;  // rows whose scores are computed together (two accumulators each)
constexpr int kBf16ValueRows = 4;  // rows whose 64 output dimensions are accumulated together

template <int R>
inline void bf16_scores(const Bf16Row* rows, const __m512i* kt, int64_t pairs, __m512* s) {
  __m512 a[R], b[R];
  for (int r = 0; r < R; ++r) a[r] = b[r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; j += 2) {
    const __m512bh k0 = as_bh(_mm512_load_si512(kt + j)), k1 = as_bh(_mm512_load_si512(kt + j + 1));
    for (int r = 0; r < R; ++r) {
      a[r] = _mm512_dpbf16_ps(a[r], k0, as_bh(_mm512_set1_epi32(static_cast<int>(rows[r].q[j]))));
      b[r] = _mm512_dpbf16_ps(b[r], k1, as_bh(_mm512_set1_epi32(static_cast<int>(rows[r].q[j + 1]))));
    }
  }
  for (int r = 0; r < R; ++r) s[r] = _mm512_add_ps(a[r], b[r]);
}

template <int R>
inline void bf16_values(const Bf16Row* rows, const uint32_t (*p)[8], const float* corr, const uint16_t* vp,
                        int64_t cnt, int64_t D, int64_t d0) {
  __m512 o[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) o[r][c] = _mm512_mul_ps(_mm512_loadu_ps(rows[r].acc + d0 + 16 * c), _mm512_set1_ps(corr[r]));
  for (int64_t t = 0; t < cnt; t += 2) {
    const uint16_t* ra = vp + t * D + d0;
    const __m512i a0 = _mm512_loadu_si512(ra), a1 = _mm512_loadu_si512(ra + 32);
    // the pair's second key, or zeros past the tile (whatever lies there, its probability is zero)
    const __m512i b0 = t + 1 < cnt ? _mm512_loadu_si512(ra + D) : _mm512_setzero_si512();
    const __m512i b1 = t + 1 < cnt ? _mm512_loadu_si512(ra + D + 32) : _mm512_setzero_si512();
    const __m512bh v[4] = {as_bh(_mm512_unpacklo_epi16(a0, b0)), as_bh(_mm512_unpackhi_epi16(a0, b0)),
                           as_bh(_mm512_unpacklo_epi16(a1, b1)), as_bh(_mm512_unpackhi_epi16(a1, b1))};
    for (int r = 0; r < R; ++r) {
      const __m512bh w = as_bh(_mm512_set1_epi32(static_cast<int>(p[r][t / 2])));
      for (int c = 0; c < 4; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], v[c], w);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(rows[r].acc + d0 + 16 * c, o[r][c]);
}

// One tile of cnt <= 16 keys (rows of D bfloat16 at kp, vp) for every row of `rows`.
inline void bf16_tile(const Bf16Row* rows, int n, int64_t D, const uint16_t* kp, const uint16_t* vp, int64_t cnt) {
  alignas(64) __m512i kt[128];  // [D/2 pairs][16 keys], D <= 256
  const int64_t pairs = D / 2;
  for (int64_t j0 = 0; j0 < pairs; j0 += 16) {
    __m512i r[16];
    for (int64_t t = 0; t < 16; ++t)
      r[t] = t < cnt ? _mm512_loadu_si512(kp + t * D + 2 * j0) : _mm512_setzero_si512();
    transpose16x16(r);
    for (int j = 0; j < 16; ++j) _mm512_store_si512(kt + j0 + j, r[j]);
  }
  const __mmask16 valid = static_cast<__mmask16>(cnt >= 16 ? 0xFFFF : (1u << cnt) - 1);
  alignas(64) uint32_t prob[HeadState::kMaxGroup * kPrefixMembers][8];
  float corr[HeadState::kMaxGroup * kPrefixMembers];
  for (int r0 = 0; r0 < n; r0 += kBf16ScoreRows) {
    const int rn = std::min(kBf16ScoreRows, n - r0);
    __m512 s[kBf16ScoreRows];
    switch (rn) {
      case 8: bf16_scores<8>(rows + r0, kt, pairs, s); break;
      case 7: bf16_scores<7>(rows + r0, kt, pairs, s); break;
      case 6: bf16_scores<6>(rows + r0, kt, pairs, s); break;
      case 5: bf16_scores<5>(rows + r0, kt, pairs, s); break;
      case 4: bf16_scores<4>(rows + r0, kt, pairs, s); break;
      case 3: bf16_scores<3>(rows + r0, kt, pairs, s); break;
      case 2: bf16_scores<2>(rows + r0, kt, pairs, s); break;
      default: bf16_scores<1>(rows + r0, kt, pairs, s); break;
    }
    for (int i = 0; i < rn; ++i) {  // the online softmax, in float32
      const Bf16Row& row = rows[r0 + i];
      const __m512 sc = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, s[i]);
      // the tile's maximum only where some score exceeds the running one (most tiles after the first few)
      const bool grows = _mm512_cmp_ps_mask(sc, _mm512_set1_ps(*row.m), _CMP_GT_OQ) != 0;
      const float mx = grows ? _mm512_reduce_max_ps(sc) : *row.m;
      corr[r0 + i] = mx == *row.m ? 1.f : std::exp(*row.m - mx);  // exp(-inf) = 0 on the first tile
      *row.m = mx;
      const __m256bh pb = _mm512_cvtneps_pbh(exp512(_mm512_sub_ps(sc, _mm512_set1_ps(mx))));
      const __m256i pi = (__m256i)pb;
      _mm256_store_si256(reinterpret_cast<__m256i*>(prob[r0 + i]), pi);
      const __m512 rounded = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pi), 16));
      *row.l = *row.l * corr[r0 + i] + _mm512_reduce_add_ps(rounded);
    }
  }
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    for (int r0 = 0; r0 < n; r0 += kBf16ValueRows) {
      const int rn = std::min(kBf16ValueRows, n - r0);
      switch (rn) {
        case 4: bf16_values<4>(rows + r0, prob + r0, corr + r0, vp, cnt, D, d0); break;
        case 3: bf16_values<3>(rows + r0, prob + r0, corr + r0, vp, cnt, D, d0); break;
        case 2: bf16_values<2>(rows + r0, prob + r0, corr + r0, vp, cnt, D, d0); break;
        default: bf16_values<1>(rows + r0, prob + r0, corr + r0, vp, cnt, D, d0); break;
      }
    }
  }
}

// Pages [0, n) for `members` sequences (as attend_pages): their rows are (member, head) pairs; `qb[j]` is
// member j's query pairs [group][D/2].
inline void attend_bf16(const uint32_t* const* qb, int members, int group, int64_t D, const uint16_t* kbase,
                        const uint16_t* vbase, const int32_t* pages, int64_t n, int64_t page_size,
                        HeadState* const* st, float* const* acc) {
  Bf16Row rows[HeadState::kMaxGroup * kPrefixMembers];
  int nrows = 0;
  for (int j = 0; j < members; ++j)
    for (int h = 0; h < group; ++h) rows[nrows++] = {qb[j] + h * D / 2, &st[j]->m[h], &st[j]->l[h], acc[j] + h * D};
  for_each_page(kbase, vbase, pages, n, page_size, D, [&](const uint16_t* kp, const uint16_t* vp, int64_t cnt) {
    for (int64_t t = 0; t < cnt; t += 16)
      bf16_tile(rows, nrows, D, kp + t * D, vp + t * D, std::min<int64_t>(16, cnt - t));
  });
}

#else
#define PARROT_DECODE_BF16 0
#endif
