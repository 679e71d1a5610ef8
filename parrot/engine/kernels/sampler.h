// The sampler of a CPU step: one token per row of logits, with the semantics of parrot/engine/sampling.py's
// `_choose` (temperature, top-k, top-p renormalized over what top-k and min-p keep, min-p, one uniform number
// per row drawing by the inverse CDF in vocabulary order). Included by cpu_kernels.cc, whose
// parrot_sample calls `sample_row` for each row in turn on XLA's intra-op threads.
//
// Why a kernel: XLA's CPU code for these steps reads and writes whole [B, V] arrays many times (the scaled
// logits, their exponentials, 32 bisection passes for a whole-vocabulary top-p), so the rows leave the cache:
// a 64-row batch of a 49,152-token vocabulary took 12-92 ms there (1-9 ms here). Here each row (196 KB) is
// scaled once into a scratch buffer that stays in L2, and every later pass reads only the part that matters:
// - the row's maximum and the maxima of its spans of 64 tokens come with the scaling;
// - top-k: the k-th largest span maximum bounds the k-th largest value from below, so only the spans
//   reaching it are searched (nth_element over a few thousand values; the whole row only for k above the
//   number of spans);
// - top-p: the pass that computes the weights measures the weight above 12 values at once; the values in the
//   range that then holds the cut-off are gathered and spread over 256 buckets (again over the bucket that
//   holds it) until at most 64 are left to sort;
// - the draw skips the spans whose maximum is below the threshold, and reads top-p's weights instead of
//   computing them again.
// Sums are in float within a span of 64 values (or 1,024 values a lane), in double across; AVX-512 takes 16
// values a vector where the CPU has it (each value the same bits as AVX2 gives). The cut-offs are values of
// the row, as the sorted definition gives them; the exponentials are a polynomial (within 2 ulp of exp), so
// a draw can differ from XLA's only where the uniform number falls within rounding of a boundary between
// two tokens.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "aligned.h"

namespace sampler {

constexpr int64_t kSpan = 64;       // tokens per span (span maxima: the top-k search and the draw's skips)

struct Params {
  float temperature = 0.f;  // <= 0: the argmax
  int32_t top_k = 0;        // <= 0 or >= V: off
  float top_p = 1.f;        // >= 1: off
  float min_p = 0.f;        // <= 0: off
  float u = 0.f;            // the row's uniform number in [0, 1)
};

struct Scratch {
  aligned::vector<float> s;   // the scaled row
  aligned::vector<float> e;   // top-p: the kept tokens' weights
  std::vector<float> span_max, cand, cand_w;
  std::vector<uint16_t> bucket;  // top-p: each candidate's bucket (not a char type: no aliasing)
  std::vector<double> span_mass;
  std::vector<std::pair<float, float>> edge;  // top-p: the (value, weight) pairs where the cut-off lies
};

// e^x for x <= 0 (x = -inf and x < -87.3 give 0): x = n ln 2 + r, |r| <= ln2 / 2 (ln 2 in two parts),
// e^r = 1 + r + r^2 P(r) by Cephes' expf polynomial, 2^n put into the exponent. The 8- and 16-lane
// versions take the same steps: each lane the same bits.
constexpr float kExpMin = -87.3f, kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline __m256 exp_nonpositive(__m256 x) {
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(kExpMin), _CMP_LT_OQ);  // also -inf
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpMin));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x));
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

#ifdef __AVX512F__
inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpMin), _CMP_GE_OQ);  // not -inf either
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(keep, y, _mm512_castsi512_ps(e));
}
#endif

inline float exp_nonpositive(float x) {
  alignas(32) float v[8] = {x};
  _mm256_store_ps(v, exp_nonpositive(_mm256_load_ps(v)));
  return v[0];
}

// The sum of a vector's float lanes, in double (pairwise: a few dependent adds, not one per lane).
inline double lane_sum(__m256 acc) {
  const __m256d d = _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(acc)),
                                  _mm256_cvtps_pd(_mm256_extractf128_ps(acc, 1)));
  const __m128d h = _mm_add_pd(_mm256_castpd256_pd128(d), _mm256_extractf128_pd(d, 1));
  return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
}
#ifdef __AVX512F__
inline double lane_sum(__m512 acc) {
  return lane_sum(_mm256_add_ps(_mm512_castps512_ps256(acc), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1))));
}
#endif

// Weights exp(s[i] - top) where s[i] >= threshold, else 0, for i in [a, b); returns their sum (in double,
// the float lanes of a vector summed apart). With `out`, the weights are written there (indexed from a).
inline double weights(const float* s, int64_t a, int64_t b, float top, float threshold, float* out = nullptr) {
  double sum = 0.0;
  int64_t i = a;
#ifdef __AVX512F__
  {
    const __m512 vt = _mm512_set1_ps(top), vth = _mm512_set1_ps(threshold);
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= b; i += 16) {
      const __m512 v = _mm512_loadu_ps(s + i);
      const __m512 w = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, vth, _CMP_GE_OQ), exp_nonpositive(_mm512_sub_ps(v, vt)));
      if (out) _mm512_storeu_ps(out + (i - a), w);
      acc = _mm512_add_ps(acc, w);
    }
    sum += lane_sum(acc);
  }
#endif
  const __m256 vt = _mm256_set1_ps(top), vth = _mm256_set1_ps(threshold);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= b; i += 8) {
    const __m256 v = _mm256_loadu_ps(s + i);
    const __m256 w = _mm256_and_ps(_mm256_cmp_ps(v, vth, _CMP_GE_OQ), exp_nonpositive(_mm256_sub_ps(v, vt)));
    if (out) _mm256_storeu_ps(out + (i - a), w);
    acc = _mm256_add_ps(acc, w);
  }
  sum += lane_sum(acc);
  for (; i < b; ++i) {
    const float w = s[i] >= threshold ? exp_nonpositive(s[i] - top) : 0.f;
    if (out) out[i - a] = w;
    sum += w;
  }
  return sum;
}

// `weights` from weights already computed (`e`, indexed as s, written for a threshold at or below this
// one): the same values and the same sum, without the exponentials.
inline double kept(const float* s, const float* e, int64_t a, int64_t b, float threshold, float* out = nullptr) {
  double sum = 0.0;
  int64_t i = a;
#ifdef __AVX512F__
  {
    const __m512 vth = _mm512_set1_ps(threshold);
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= b; i += 16) {
      const __m512 w = _mm512_maskz_loadu_ps(_mm512_cmp_ps_mask(_mm512_loadu_ps(s + i), vth, _CMP_GE_OQ), e + i);
      if (out) _mm512_storeu_ps(out + (i - a), w);
      acc = _mm512_add_ps(acc, w);
    }
    sum += lane_sum(acc);
  }
#endif
  const __m256 vth = _mm256_set1_ps(threshold);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= b; i += 8) {
    const __m256 w = _mm256_and_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + i), vth, _CMP_GE_OQ), _mm256_loadu_ps(e + i));
    if (out) _mm256_storeu_ps(out + (i - a), w);
    acc = _mm256_add_ps(acc, w);
  }
  sum += lane_sum(acc);
  for (; i < b; ++i) {
    const float w = s[i] >= threshold ? e[i] : 0.f;
    if (out) out[i - a] = w;
    sum += w;
  }
  return sum;
}

// The first position of the row's largest value (NaNs skipped; 0 where nothing is above -inf), as
// numpy's and sampling.argmax's first maximum.
inline int32_t argmax(const float* x, int64_t V) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) m = _mm256_max_ps(_mm256_loadu_ps(x + i), m);  // a NaN in x keeps m
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float best = lanes[0];
  for (float l : lanes) best = std::max(best, l);
  for (; i < V; ++i) best = x[i] > best ? x[i] : best;
  if (!(best > -std::numeric_limits<float>::infinity())) return 0;
  for (int64_t j = 0; j < V; ++j)
    if (x[j] == best) return static_cast<int32_t>(j);
  return 0;
}

// A lower bound of the k-th largest value of a row: its k-th largest span maximum (k distinct values reach
// it), so every value above the k-th largest, and enough values equal to it, lie in the spans whose maximum
// reaches the bound; -inf where k exceeds the spans. `tmp` is scratch.
inline float kth_span_max(const std::vector<float>& span_max, int64_t k, std::vector<float>& tmp) {
  if (k > static_cast<int64_t>(span_max.size())) return -std::numeric_limits<float>::infinity();
  tmp.assign(span_max.begin(), span_max.end());
  std::nth_element(tmp.begin(), tmp.begin() + (k - 1), tmp.end(), std::greater<float>());
  return tmp[k - 1];
}

// The k-th largest value of s (1 <= k < V), among the values of the spans reaching kth_span_max.
inline float kth_largest(const float* s, int64_t V, int64_t k, Scratch& w) {
  const int64_t spans = static_cast<int64_t>(w.span_max.size());
  const float t0 = kth_span_max(w.span_max, k, w.cand);
  w.cand.clear();
  for (int64_t j = 0; j < spans; ++j) {
    if (!(w.span_max[j] >= t0)) continue;
    for (int64_t i = j * kSpan, e = std::min(V, i + kSpan); i < e; ++i)
      if (s[i] >= t0) w.cand.push_back(s[i]);
  }
  std::nth_element(w.cand.begin(), w.cand.begin() + (k - 1), w.cand.end(), std::greater<float>());
  return w.cand[k - 1];
}

// M(t_j) = the weight of the values above t_j, for kDepths thresholds at once: sums in float for up to
// 1,024 values a lane, then in double.
constexpr int kDepths = 12;
struct Above {
  __m256 th[kDepths], acc[kDepths];
#ifdef __AVX512F__
  __m512 th16[kDepths], acc16[kDepths];
#endif
  double sum[kDepths] = {};
  int pending = 0;
  explicit Above(const float (&t)[kDepths]) {
    for (int j = 0; j < kDepths; ++j) th[j] = _mm256_set1_ps(t[j]), acc[j] = _mm256_setzero_ps();
#ifdef __AVX512F__
    for (int j = 0; j < kDepths; ++j) th16[j] = _mm512_set1_ps(t[j]), acc16[j] = _mm512_setzero_ps();
#endif
  }
  void add(__m256 v, __m256 w) {  // 8 values and their weights (lanes to skip: weight 0)
    for (int j = 0; j < kDepths; ++j)
      acc[j] = _mm256_add_ps(acc[j], _mm256_and_ps(_mm256_cmp_ps(v, th[j], _CMP_GT_OQ), w));
    if (++pending == 128) flush();
  }
  void add_range(const float* v, const float* w, int64_t n) {  // n values and their weights
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {
      const __m512 x = _mm512_loadu_ps(v + i), y = _mm512_loadu_ps(w + i);
      for (int j = 0; j < kDepths; ++j)
        acc16[j] = _mm512_mask_add_ps(acc16[j], _mm512_cmp_ps_mask(x, th16[j], _CMP_GT_OQ), acc16[j], y);
      if (++pending == 64) flush();
    }
#endif
    for (; i + 8 <= n; i += 8) add(_mm256_loadu_ps(v + i), _mm256_loadu_ps(w + i));
    if (i < n) {
      alignas(32) float a[8] = {}, b[8] = {};
      for (int64_t k = i; k < n; ++k) a[k - i] = v[k], b[k - i] = w[k];
      add(_mm256_load_ps(a), _mm256_load_ps(b));
    }
  }
  void flush() {
    for (int j = 0; j < kDepths; ++j) {
      sum[j] += lane_sum(acc[j]);
      acc[j] = _mm256_setzero_ps();
#ifdef __AVX512F__
      sum[j] += lane_sum(acc16[j]);
      acc16[j] = _mm512_setzero_ps();
#endif
    }
    pending = 0;
  }
};

// Top-p among the tokens with s >= lower: the smallest value whose larger values' weight (in descending
// order, renormalized over the kept tokens) is below top_p of their total, i.e. the value of the last token
// of the shortest descending prefix whose weight reaches top_p (ties with it kept too). With M(t) the weight
// above t, the answer lies in a bracket (a, b] with M(a) >= target > M(b), first (lower, max]. The pass
// that computes the weights (kept in `w.e` for the draw) measures M at 12 fixed depths below the maximum
// (spaced where flat and peaked rows have their answers). The values in the bracket then left are gathered, and each
// later pass spreads their weights over 256 buckets of (a, b], keeping the bucket where the descending
// weight reaches the target, until at most 64 are left. Those are sorted and walked from the top.
inline float top_p_cut(const float* s, int64_t V, float lower, float top, float top_p, Scratch& w) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  constexpr int kBuckets = 256;
  const int64_t spans = static_cast<int64_t>(w.span_max.size());
  // every token with weight is above a (exp underflows to 0 below top - 87.3), none is above b
  float a = lower > -kInf ? std::nextafter(lower, -kInf) : top - 88.f, b = top;
  float t[kDepths];  // where flat rows (cut-offs 8-12 below the maximum) and peaked ones (0-2) have theirs
  const float depth[kDepths] = {32.f, 20.f, 16.f, 13.f, 11.f, 9.5f, 8.f, 6.f, 4.f, 2.f, 1.f, 0.5f};
  for (int j = 0; j < kDepths; ++j) t[j] = std::max(a, top - depth[j]);
  w.e.resize(V);  // written for the spans reaching `lower`, the only ones read
  float* e = w.e.data();
  Above m(t);
  double total = 0.0;
  for (int64_t j = 0; j < spans; ++j) {
    if (!(w.span_max[j] >= lower)) continue;
    const int64_t i0 = j * kSpan, i1 = std::min(V, i0 + kSpan);
    total += weights(s, i0, i1, top, lower, e + i0);
    m.add_range(s + i0, e + i0, i1 - i0);
  }
  m.flush();
  const double target = static_cast<double>(top_p) * total;
  if (!(target > 0.0)) return top;
  double above_b = 0.0;
  for (int j = 0; j < kDepths; ++j) {  // thresholds ascend, so M descends
    if (!(t[j] > a) || !(t[j] < b)) continue;
    if (m.sum[j] >= target) a = t[j];
    else b = t[j], above_b = m.sum[j];
  }
  auto& cv = w.cand;  // the values in (a, b] with weight, and their weights
  auto& cw = w.cand_w;
  cv.resize(V + 16), cw.resize(V + 16);  // room for a whole vector's store past the last candidate
  size_t n = 0;
  for (int64_t j = 0; j < spans; ++j) {
    if (!(w.span_max[j] > a)) continue;
    const int64_t i0 = j * kSpan, i1 = std::min(V, i0 + kSpan);
    int64_t i = i0;
#ifdef __AVX512F__
    const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b), zero = _mm512_setzero_ps();
    for (; i + 16 <= i1; i += 16) {
      const __m512 v = _mm512_loadu_ps(s + i), ew = _mm512_loadu_ps(e + i);
      const __mmask16 in = _mm512_cmp_ps_mask(v, va, _CMP_GT_OQ) & _mm512_cmp_ps_mask(v, vb, _CMP_LE_OQ) &
                           _mm512_cmp_ps_mask(ew, zero, _CMP_GT_OQ);
      if (!in) continue;
      _mm512_storeu_ps(cv.data() + n, _mm512_maskz_compress_ps(in, v));
      _mm512_storeu_ps(cw.data() + n, _mm512_maskz_compress_ps(in, ew));
      n += static_cast<size_t>(__builtin_popcount(in));
    }
#else
    const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b), zero = _mm256_setzero_ps();
    for (; i + 8 <= i1; i += 8) {
      const __m256 v = _mm256_loadu_ps(s + i);
      const __m256 in = _mm256_and_ps(_mm256_and_ps(_mm256_cmp_ps(v, va, _CMP_GT_OQ), _mm256_cmp_ps(v, vb, _CMP_LE_OQ)),
                                      _mm256_cmp_ps(_mm256_loadu_ps(e + i), zero, _CMP_GT_OQ));
      for (unsigned bits = static_cast<unsigned>(_mm256_movemask_ps(in)); bits; bits &= bits - 1) {
        const int64_t k = i + __builtin_ctz(bits);
        cv[n] = s[k], cw[n] = e[k], ++n;
      }
    }
#endif
    for (; i < i1; ++i)
      if (s[i] > a && s[i] <= b && e[i] > 0.f) cv[n] = s[i], cw[n] = e[i], ++n;
  }
  // Buckets of (a, b]: the index grows with the value, so a higher bucket holds only larger values and
  // ties share one. Values and weights of the kept bucket move to the front; the weight of those above
  // it joins above_b.
  constexpr int kCopies = 8;  // histograms added in turn: neighbours often share a bucket, copies don't wait
  double hists[kCopies][kBuckets], hist[kBuckets];
  auto& bucket = w.bucket;
  while (n > 64 && b > a) {
    const float per = static_cast<float>(kBuckets) / (b - a);
    bucket.resize(n);
    std::fill(&hists[0][0], &hists[0][0] + kCopies * kBuckets, 0.0);
    for (size_t k = 0; k < n; ++k) {
      const int idx = std::min(kBuckets - 1, static_cast<int>((cv[k] - a) * per));
      bucket[k] = static_cast<uint16_t>(idx);
      hists[k % kCopies][idx] += cw[k];
    }
    for (int idx = 0; idx < kBuckets; ++idx) {
      double sum = 0.0;
      for (int c = 0; c < kCopies; ++c) sum += hists[c][idx];
      hist[idx] = sum;
    }
    int kept = -1;
    bool reached = false;
    double above = above_b;
    for (int idx = kBuckets - 1; idx >= 0 && !reached; --idx) {
      if (hist[idx] <= 0.0) continue;
      kept = idx;
      reached = above + hist[idx] >= target;
      if (!reached) above += hist[idx];
    }
    if (kept < 0) break;
    if (!reached) above -= hist[kept];  // rounding left the target unreached: the lowest bucket
    size_t left = 0;
    float lo = kInf, hi = -kInf;
    for (size_t k = 0; k < n; ++k) {
      if (bucket[k] != kept) continue;
      lo = std::min(lo, cv[k]), hi = std::max(hi, cv[k]);
      cv[left] = cv[k], cw[left] = cw[k], ++left;
    }
    above_b = above;
    if (left == n) break;  // one bucket held them all: values too close to split further
    n = left;
    a = std::nextafter(lo, -kInf), b = hi;
  }
  auto& c = w.edge;
  c.clear();
  for (size_t k = 0; k < n; ++k) c.emplace_back(cv[k], cw[k]);
  // a token is kept while the weight before it is below the target (the first always: M(a) >= target)
  std::sort(c.begin(), c.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
  double before = above_b;
  float cut = c.empty() ? b : c.front().first;
  for (const auto& [v, wt] : c) {
    if (!(before < target)) break;
    cut = v;
    before += wt;
  }
  return cut;
}

// One token: greedy rows the argmax; others draw among s >= threshold with weights exp(s - max), the token
// whose cumulative weight in vocabulary order first exceeds u times the total.
inline int32_t sample_row(const float* x, int64_t V, const Params& p, Scratch& w) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  if (!(p.temperature > 0.f)) return argmax(x, V);
  const float t = std::max(p.temperature, 1e-5f);
  const int64_t spans = (V + kSpan - 1) / kSpan;
  w.s.resize(V);
  w.span_max.resize(spans);
  float* s = w.s.data();
  const __m256 vt = _mm256_set1_ps(t), ninf = _mm256_set1_ps(-kInf);
  float top = -kInf;
  for (int64_t j = 0; j < spans; ++j) {
    const int64_t a = j * kSpan, b = std::min(V, a + kSpan);
    __m256 m = ninf;
    int64_t i = a;
    for (; i + 8 <= b; i += 8) {
      __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), vt);
      v = _mm256_blendv_ps(ninf, v, _mm256_cmp_ps(v, v, _CMP_ORD_Q));  // NaN -> -inf
      _mm256_storeu_ps(s + i, v);
      m = _mm256_max_ps(m, v);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    float mx = lanes[0];
    for (float l : lanes) mx = std::max(mx, l);
    for (; i < b; ++i) {
      const float v = x[i] / t;
      s[i] = v == v ? v : -kInf;
      mx = std::max(mx, s[i]);
    }
    w.span_max[j] = mx;
    top = std::max(top, mx);
  }
  if (!(top > -kInf)) return argmax(x, V);
  if (top == kInf) {  // infinite logits share the draw's whole weight: the first of them
    for (int64_t i = 0; i < V; ++i)
      if (s[i] == kInf) return static_cast<int32_t>(i);
  }
  float threshold = p.min_p > 0.f ? top + std::log(p.min_p) : -kInf;
  if (p.top_k > 0 && p.top_k < V) threshold = std::max(threshold, kth_largest(s, V, p.top_k, w));
  // top-p leaves every weight at or above the threshold in w.e: the draw reads them instead
  const bool have_e = p.top_p < 1.f;
  if (have_e) threshold = std::max(threshold, top_p_cut(s, V, threshold, top, p.top_p, w));
  const float* e = w.e.data();
  auto span_weights = [&](int64_t a, int64_t b, float* out) {
    return have_e ? kept(s, e, a, b, threshold, out) : weights(s, a, b, top, threshold, out);
  };
  // the draw: each span's weight, then the token within the span
  w.span_mass.assign(spans, 0.0);
  double total = 0.0;
  for (int64_t j = 0; j < spans; ++j) {
    if (!(w.span_max[j] >= threshold)) continue;
    w.span_mass[j] = span_weights(j * kSpan, std::min(V, (j + 1) * kSpan), nullptr);
    total += w.span_mass[j];
  }
  const double target = static_cast<double>(p.u) * total;
  double before = 0.0;
  int64_t last = -1;
  alignas(32) float buf[kSpan];
  for (int64_t j = 0; j < spans; ++j) {
    if (w.span_mass[j] <= 0.0) continue;
    last = j;
    if (before + w.span_mass[j] <= target) {
      before += w.span_mass[j];
      continue;
    }
    const int64_t a = j * kSpan, b = std::min(V, a + kSpan);
    span_weights(a, b, buf);
    int64_t pick = -1;
    for (int64_t i = a; i < b; ++i) {
      if (buf[i - a] <= 0.f) continue;
      pick = i;
      before += buf[i - a];
      if (before > target) return static_cast<int32_t>(i);
    }
    return static_cast<int32_t>(pick);  // rounding: the span's last token with weight
  }
  if (last < 0) return argmax(x, V);  // nothing kept (a min-p above 1): the argmax
  // rounding left the target unreached: the last token with weight
  const int64_t a = last * kSpan, b = std::min(V, a + kSpan);
  span_weights(a, b, buf);
  for (int64_t i = b - 1; i >= a; --i)
    if (buf[i - a] > 0.f) return static_cast<int32_t>(i);
  return argmax(x, V);
}

}  // namespace sampler
