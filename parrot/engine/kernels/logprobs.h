// Raw log probabilities of a row of logits, as parrot/engine/logprobs.py's `token_logprobs` and the processed
// sampler report them: log_softmax(x) at one target token, and the K most likely tokens with theirs (the
// first of equal values first, as lax.top_k orders them). Included by cpu_kernels.cc, whose parrot_logprobs
// takes one row per thread.
//
// XLA's code materializes log_softmax over the whole [R, V] array and then runs top_k over it: 202 ms for
// the 512 rows of a prompt chunk at a 49,152-token vocabulary. Here a row is read three times while it is in
// the cache: its maximum and span maxima; the sum of exp(x - max) (float within a span of 64, double
// across); the top K from the spans whose maximum reaches the K-th largest span maximum (every value above
// the K-th largest, and enough equal to it, lie there). log_softmax(x)_i = (x_i - max) - log(sum), in that
// order as XLA computes it; the exponentials are sampler.h's polynomial.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "sampler.h"

namespace logprobs {

struct Scratch {
  std::vector<float> span_max, tops;
  std::vector<std::pair<float, int32_t>> cand;
};

// One row: `chosen` the target's log probability (a negative target reads token 0), `ids` / `lps` the K
// most likely tokens and theirs, most likely first. A row with a NaN or without a finite maximum gets NaNs
// (as log_softmax gives them) and the ids 0..K-1.
inline void row(const float* x, int64_t V, int32_t target, int64_t K, float* chosen, int32_t* ids, float* lps,
                Scratch& w) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  constexpr int64_t S = sampler::kSpan;
  const int64_t spans = (V + S - 1) / S;
  w.span_max.resize(spans);
  float top = -kInf;
  bool nan = false;
  for (int64_t j = 0; j < spans; ++j) {
    const int64_t a = j * S, b = std::min(V, a + S);
    __m256 m = _mm256_set1_ps(-kInf);
    __m256i unordered = _mm256_setzero_si256();
    int64_t i = a;
    for (; i + 8 <= b; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      m = _mm256_max_ps(v, m);  // a NaN in v keeps m
      unordered = _mm256_or_si256(unordered, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    float mx = lanes[0];
    for (float l : lanes) mx = std::max(mx, l);
    nan |= !_mm256_testz_si256(unordered, unordered);
    for (; i < b; ++i) {
      nan |= x[i] != x[i];
      mx = x[i] > mx ? x[i] : mx;
    }
    w.span_max[j] = mx;
    top = std::max(top, mx);
  }
  if (nan || !(top > -kInf) || top == kInf) {
    *chosen = std::numeric_limits<float>::quiet_NaN();
    for (int64_t k = 0; k < K; ++k) ids[k] = static_cast<int32_t>(k), lps[k] = *chosen;
    return;
  }
  double sum = 0.0;
  for (int64_t j = 0; j < spans; ++j)
    sum += sampler::weights(x, j * S, std::min(V, (j + 1) * S), top, -kInf);
  const float log_sum = static_cast<float>(std::log(sum));
  const int32_t t = target >= 0 && target < V ? target : 0;
  *chosen = (x[t] - top) - log_sum;
  // the K largest: from the spans reaching the K-th largest span maximum
  const float t0 = sampler::kth_span_max(w.span_max, K, w.tops);
  w.cand.clear();
  for (int64_t j = 0; j < spans; ++j) {
    if (!(w.span_max[j] >= t0)) continue;
    for (int64_t i = j * S, e = std::min(V, i + S); i < e; ++i)
      if (x[i] >= t0) w.cand.emplace_back(x[i], static_cast<int32_t>(i));
  }
  const int64_t n = std::min<int64_t>(K, static_cast<int64_t>(w.cand.size()));
  std::partial_sort(w.cand.begin(), w.cand.begin() + n, w.cand.end(), [](const auto& p, const auto& q) {
    return p.first > q.first || (p.first == q.first && p.second < q.second);
  });
  for (int64_t k = 0; k < K; ++k) {
    if (k < n) ids[k] = w.cand[k].second, lps[k] = (w.cand[k].first - top) - log_sum;
    else ids[k] = 0, lps[k] = -kInf;  // a vocabulary smaller than K
  }
}

}  // namespace logprobs
