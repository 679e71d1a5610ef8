// Decode attention over bfloat16 pages with AVX2 (no AVX-512): the page's keys and values read in place as
// pairs of bfloat16, widened in registers, every query head of a KV head at once. Included by cpu_kernels.cc
// inside its anonymous namespace (HeadState and page_softmax from there); attend_pages takes it for
// bfloat16 pages where D % 16 == 0 (`pairs_fit`).
//
// Numbers. Keys and values are widened exactly (bfloat16 -> float32), the products and sums are float32, as
// the float32 code computes them; only the order of the sums differs from it. A 32-bit word of a row holds
// dimensions 2j (low half) and 2j + 1 (high half): shifting the word up by 16 bits gives the first as a
// float32, masking off the low half the second, so 16 dimensions come from one load in two vectors, the even
// dimensions and the odd ones. Queries and outputs are kept in that order (`pair_dim`): the caller permutes
// its queries once and puts the outputs back in order when it normalizes them. A row's arithmetic depends
// only on its own query, keys and values, in page order: a sequence gets the same bits alone, in any batch,
// and through a shared prefix.
//
// Work per page and KV head: every key row is loaded once for up to three query heads (four rows at a time,
// twelve sums in registers, reduced by horizontal adds), every value row once for up to three heads (16
// dimensions at a time); nothing is widened into memory.
#pragma once

#define PARROT_PAIRS_INLINE inline __attribute__((always_inline))

// The dimension that position p of a row in pair order holds: within each 16, even dimensions first.
inline int64_t pair_dim(int64_t p) {
  const int64_t c = p & ~int64_t{15}, i = p & 15;
  return c + (i < 8 ? 2 * i : 2 * (i - 8) + 1);
}

// Where the pair path applies: bfloat16 pages, rows of whole 16-dimension groups.
inline bool pairs_fit(int64_t D) { return D % 16 == 0 && D <= 256; }

// 16 bfloat16 (8 words) -> the even dimensions and the odd ones, float32
PARROT_PAIRS_INLINE void widen_pairs(const uint16_t* p, __m256& even, __m256& odd) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Scores of NH heads (queries `q`, pair order, stride D) against 4 key rows at `k` into s[h][0..4).
template <int NH>
PARROT_PAIRS_INLINE void pair_scores4(const float* q, const uint16_t* k, int64_t D, float (*s)[64]) {
  __m256 a[NH][4];
  for (int h = 0; h < NH; ++h)
    for (int t = 0; t < 4; ++t) a[h][t] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    for (int t = 0; t < 4; ++t) {
      __m256 e, o;
      widen_pairs(k + t * D + d, e, o);
      for (int h = 0; h < NH; ++h) {
        a[h][t] = _mm256_fmadd_ps(e, _mm256_load_ps(q + h * D + d), a[h][t]);
        a[h][t] = _mm256_fmadd_ps(o, _mm256_load_ps(q + h * D + d + 8), a[h][t]);
      }
    }
  }
  for (int h = 0; h < NH; ++h) {
    const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a[h][0], a[h][1]), _mm256_hadd_ps(a[h][2], a[h][3]));
    _mm_storeu_ps(s[h], _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1)));
  }
}

// acc[h] (pair order) = acc[h] * corr[h] + sum_t p[h][t] v[t] for NH heads over `cnt` value rows at `v`.
template <int NH>
PARROT_PAIRS_INLINE void pair_values(const float (*p)[64], const float* corr, const uint16_t* v, int64_t cnt,
                                     int64_t D, float* const* acc) {
  for (int64_t d = 0; d < D; d += 16) {
    __m256 o[NH][2];
    for (int h = 0; h < NH; ++h) {
      const __m256 c = _mm256_set1_ps(corr[h]);
      o[h][0] = _mm256_mul_ps(_mm256_loadu_ps(acc[h] + d), c);
      o[h][1] = _mm256_mul_ps(_mm256_loadu_ps(acc[h] + d + 8), c);
    }
    for (int64_t t = 0; t < cnt; ++t) {
      __m256 e, od;
      widen_pairs(v + t * D + d, e, od);
      for (int h = 0; h < NH; ++h) {
        const __m256 w = _mm256_broadcast_ss(p[h] + t);
        o[h][0] = _mm256_fmadd_ps(w, e, o[h][0]);
        o[h][1] = _mm256_fmadd_ps(w, od, o[h][1]);
      }
    }
    for (int h = 0; h < NH; ++h) {
      _mm256_storeu_ps(acc[h] + d, o[h][0]);
      _mm256_storeu_ps(acc[h] + d + 8, o[h][1]);
    }
  }
}

// NH (<= 3) query heads of one sequence against one page's `cnt` keys and values (rows of D bfloat16 at kp,
// vp; the page holds whole groups of 4 rows past cnt, whatever they hold: their scores are not used).
template <int NH>
PARROT_PAIRS_INLINE void pair_heads(const float* q, int64_t D, const uint16_t* kp, const uint16_t* vp, int64_t cnt,
                                    float* m, float* l, float* acc) {
  alignas(32) float s[NH][64];
  for (int64_t t = 0; t < cnt; t += 4) {
    float (*st)[64] = reinterpret_cast<float (*)[64]>(&s[0][t]);
    pair_scores4<NH>(q, kp + t * D, D, st);
  }
  float corr[NH];
  float* accs[NH];
  for (int h = 0; h < NH; ++h) {
    corr[h] = page_softmax(s[h], cnt, m[h], l[h]);
    accs[h] = acc + h * D;
  }
  pair_values<NH>(s, corr, vp, cnt, D, accs);
}

// One page's update of a sequence's `group` query heads (scaled queries `qs` in pair order) against its
// bfloat16 keys and values `kp`, `vp` ([page rows, D], cnt of them read): three heads at a time.
inline void pair_page_update(const float* qs, int group, int64_t D, const uint16_t* kp, const uint16_t* vp,
                             int64_t cnt, HeadState& st, float* acc) {
  int h = 0;
  for (; h + 3 <= group; h += 3) pair_heads<3>(qs + h * D, D, kp, vp, cnt, st.m + h, st.l + h, acc + h * D);
  if (group - h == 2) pair_heads<2>(qs + h * D, D, kp, vp, cnt, st.m + h, st.l + h, acc + h * D);
  if (group - h == 1) pair_heads<1>(qs + h * D, D, kp, vp, cnt, st.m + h, st.l + h, acc + h * D);
}

#undef PARROT_PAIRS_INLINE
