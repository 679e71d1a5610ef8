// Paged prefill attention (parrot_paged_prefill): the query tokens of a prefill step attend to their
// sequences' keys and values read in place from the paged KV cache ([Hkv, pages, page_size, D] per layer,
// float32 or bfloat16 bit patterns), causally, with an online softmax in float32. Included by
// cpu_kernels.cc inside its anonymous namespace (it uses vexp, load8, transpose8, hsum and
// parallel_chunks from there).
//
// Work. One task is (sequence, KV head, block of up to kQueries query tokens); its rows are the block's
// (query, group head) pairs, so a key is read once for all of them. Keys go in tiles of W positions
// (W = the vector width: 16 on AVX-512, 8 on AVX2), only up to the last position some row may see:
// a causal chunk does half the work of the padded square XLA's masked product computes.
//  * scores: the tile's keys transposed to [D][W] (widened from bfloat16 on the way), eight rows at a
//    time, one broadcast query element and one multiply-add per dimension and row;
//  * softmax: per row, the running maximum and sum are updated by the tile's masked scores;
//  * values: four rows x up to 4W dimensions in registers, one value row loaded for the four.
//
// Numbers. Every row's arithmetic depends only on its own query, position and keys: tiles start at key 0
// and go in order, a tile past the row's position leaves it alone, masked scores give exact zeros. So a
// token's attention is the same bits whatever chunk or batch it is filled in, and whichever other rows
// share its task.
#pragma once

template <int W>
struct Lanes;

template <>
struct Lanes<8> {
  using V = __m256;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V zero() { return _mm256_setzero_ps(); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V iota() { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }
  // lanes at index <= lim keep s, the others -inf
  static V keep_upto(V s, float lim) {
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, _mm256_cmp_ps(iota(), _mm256_set1_ps(lim), _CMP_LE_OQ));
  }
  static float max(V v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
  static float sum(V v) { return hsum(v); }
};

#ifdef __AVX512F__
template <>
struct Lanes<16> {
  using V = __m512;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V zero() { return _mm512_setzero_ps(); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V iota() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static V keep_upto(V s, float lim) {
    return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), _mm512_cmp_ps_mask(iota(), _mm512_set1_ps(lim), _CMP_LE_OQ), s);
  }
  static float max(V v) { return _mm512_reduce_max_ps(v); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
};
constexpr int kPrefillLanes = 16;
#else
constexpr int kPrefillLanes = 8;
#endif

constexpr int64_t kPrefillQueries = 32;  // query tokens per task
constexpr int64_t kPrefillMaxRows = 128;  // query tokens x group heads per task, at most

// The scratch of one task, per thread.
struct PrefillScratch {
  std::vector<float> qs, o, p, kt, vt, m, l, corr, lim;
  std::vector<int32_t> active;
  void size(int64_t rows, int64_t D, int W) {
    const int64_t padded = (rows + 7) / 8 * 8;
    qs.assign(padded * D, 0.f), o.assign(rows * D, 0.f), p.assign(rows * W, 0.f);
    kt.resize(D * W), vt.resize(W * D);
    m.assign(rows, -INFINITY), l.assign(rows, 0.f), corr.assign(rows, 1.f), lim.resize(rows);
    active.resize(rows);
  }
};

// o[r] = o[r] * corr[r] + sum_t p[r][t] v[t] for four rows r, over NV vectors of dimensions from `i`.
template <int W, int NV>
inline void prefill_values(PrefillScratch& s, const int32_t* rows, int nr, int64_t cnt, int64_t D, int64_t i) {
  using L = Lanes<W>;
  typename L::V o[4][NV];
  for (int k = 0; k < 4; ++k)
    for (int v = 0; v < NV; ++v)
      o[k][v] = k < nr ? L::mul(L::load(s.o.data() + rows[k] * D + i + v * W), L::set1(s.corr[rows[k]])) : L::zero();
  for (int64_t t = 0; t < cnt; ++t) {
    typename L::V vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = L::load(s.vt.data() + t * D + i + v * W);
    for (int k = 0; k < 4; ++k) {
      if (k >= nr) break;
      const typename L::V pw = L::set1(s.p[rows[k] * W + t]);
      for (int v = 0; v < NV; ++v) o[k][v] = L::fma(pw, vv[v], o[k][v]);
    }
  }
  for (int k = 0; k < nr; ++k)
    for (int v = 0; v < NV; ++v) L::store(s.o.data() + rows[k] * D + i + v * W, o[k][v]);
}

// One tile of W keys (positions l0.. in the sequence's pages) for the task's rows.
template <int W, typename KV>
void prefill_tile(PrefillScratch& s, int64_t rows, int64_t D, const KV* kb, const KV* vb, const int32_t* pages,
                  int64_t npos, int64_t S, int64_t l0, int64_t cnt) {
  using L = Lanes<W>;
  // keys transposed to kt[d][W] and values widened to vt[W][D]; positions past `cnt` are zeros
  const KV* krow[W];
  const KV* vrow[W];
  for (int t = 0; t < W; ++t) {
    const int64_t l = l0 + t;
    const int64_t at = t < cnt && l < npos ? (static_cast<int64_t>(pages[l / S]) * S + l % S) * D : -1;
    krow[t] = at >= 0 ? kb + at : nullptr;
    vrow[t] = at >= 0 ? vb + at : nullptr;
  }
  for (int t0 = 0; t0 < W; t0 += 8) {
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      __m256 r[8];
      for (int t = 0; t < 8; ++t) r[t] = krow[t0 + t] ? load8(krow[t0 + t] + d0) : _mm256_setzero_ps();
      transpose8(r);
      for (int d = 0; d < 8; ++d) _mm256_storeu_ps(s.kt.data() + (d0 + d) * W + t0, r[d]);
    }
  }
  for (int t = 0; t < W; ++t) {
    float* dst = s.vt.data() + t * D;
    for (int64_t i = 0; i < D; i += 8) _mm256_storeu_ps(dst + i, vrow[t] ? load8(vrow[t] + i) : _mm256_setzero_ps());
  }
  // scores, eight rows at a time; then each row's softmax update
  int nact = 0;
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    typename L::V acc[8];
    for (int r = 0; r < 8; ++r) acc[r] = L::zero();
    const float* q = s.qs.data() + r0 * D;
    for (int64_t d = 0; d < D; ++d) {
      const typename L::V k = L::load(s.kt.data() + d * W);
      for (int r = 0; r < 8; ++r) acc[r] = L::fma(L::set1(q[r * D + d]), k, acc[r]);
    }
    for (int r = 0; r < 8 && r0 + r < rows; ++r) {
      const int64_t row = r0 + r;
      const float lim = s.lim[row] - static_cast<float>(l0);
      if (lim < 0.f) continue;  // the whole tile is past this row's position
      const typename L::V sc = L::keep_upto(acc[r], lim);
      const float old = s.m[row], mx = std::max(old, L::max(sc));
      const float corr = mx == old ? 1.f : std::exp(old - mx);  // exp(-inf) = 0 on the first tile
      const typename L::V e = vexp(L::sub(sc, L::set1(mx)));
      s.m[row] = mx, s.corr[row] = corr;
      s.l[row] = s.l[row] * corr + L::sum(e);
      L::store(s.p.data() + row * W, e);
      s.active[nact++] = static_cast<int32_t>(row);
    }
  }
  // values, four rows at a time
  for (int a = 0; a < nact; a += 4) {
    const int nr = std::min(4, nact - a);
    const int32_t* rws = s.active.data() + a;
    int64_t i = 0;
    for (; i + 4 * W <= D; i += 4 * W) prefill_values<W, 4>(s, rws, nr, cnt, D, i);
    for (; i + W <= D; i += W) prefill_values<W, 1>(s, rws, nr, cnt, D, i);
    if (i < D) {  // D % W == 8 with 16 lanes: the last eight dimensions, 8 lanes wide
      for (int k = 0; k < nr; ++k) {
        float* o = s.o.data() + rws[k] * D + i;
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(o), _mm256_set1_ps(s.corr[rws[k]]));
        for (int64_t t = 0; t < cnt; ++t)
          acc = _mm256_fmadd_ps(_mm256_set1_ps(s.p[rws[k] * W + t]), _mm256_loadu_ps(s.vt.data() + t * D + i), acc);
        _mm256_storeu_ps(o, acc);
      }
    }
  }
}

// q [T, H, D]; q_index [B, Q] (flat token of query j of sequence b, T where none); positions [T];
// block_tables [B, maxp]; the sequence's key l is at position kv_offset[b] + l, seen by a query at
// position p when kv_offset[b] + l <= p and < kv_lens[b]. out [T, H, D]: zeros for tokens no query names.
template <typename KV>
void paged_prefill(ffi::ThreadPool& pool, const float* q, const KV* kc, const KV* vc, const int32_t* qidx,
                   const int32_t* pos, const int32_t* bt, const int32_t* off, const int32_t* lens, float* out,
                   int64_t T, int64_t H, int64_t D, int64_t Hkv, int64_t P, int64_t S, int64_t B, int64_t Q,
                   int64_t maxp, float scale) {
  constexpr int W = kPrefillLanes;
  const int64_t group = H / Hkv, head_stride = P * S * D;
  const int64_t per = std::max<int64_t>(1, std::min(kPrefillQueries, kPrefillMaxRows / group));
  const int64_t blocks = (Q + per - 1) / per;
  std::fill(out, out + T * H * D, 0.f);
  // the last query blocks see the most keys: they go first
  parallel_chunks(pool, B * Hkv * blocks, [&](int64_t task) {
    const int64_t qb = blocks - 1 - task % blocks, g = (task / blocks) % Hkv, b = task / (blocks * Hkv);
    const int32_t* idx = qidx + b * Q + qb * per;
    const int64_t nq = std::min(per, Q - qb * per), rows = nq * group;
    thread_local PrefillScratch s;
    s.size(rows, D, W);
    const int64_t o0 = off[b], len = lens[b], npos = maxp * S;
    float last = -1.f;
    for (int64_t j = 0; j < nq; ++j) {
      const bool real = idx[j] >= 0 && idx[j] < T;
      const float lim = real ? static_cast<float>(std::min<int64_t>(pos[idx[j]], len - 1) - o0) : -1.f;
      for (int64_t h = 0; h < group; ++h) {
        const int64_t row = j * group + h;
        s.lim[row] = lim;
        if (real) {
          const float* src = q + (static_cast<int64_t>(idx[j]) * H + g * group + h) * D;
          for (int64_t i = 0; i < D; ++i) s.qs[row * D + i] = src[i] * scale;
        }
      }
      last = std::max(last, lim);
    }
    const KV* kb = kc + g * head_stride;
    const KV* vb = vc + g * head_stride;
    const int64_t end = std::min<int64_t>(static_cast<int64_t>(last) + 1, npos);
    for (int64_t l0 = 0; l0 < end; l0 += W)
      prefill_tile<W>(s, rows, D, kb, vb, bt + b * maxp, npos, S, l0, std::min<int64_t>(W, end - l0));
    for (int64_t j = 0; j < nq; ++j) {
      if (idx[j] < 0 || idx[j] >= T) continue;
      for (int64_t h = 0; h < group; ++h) {
        const int64_t row = j * group + h;
        const float inv = s.l[row] > 0.f ? 1.f / s.l[row] : 0.f;
        float* dst = out + (static_cast<int64_t>(idx[j]) * H + g * group + h) * D;
        for (int64_t i = 0; i < D; ++i) dst[i] = s.o[row * D + i] * inv;
      }
    }
  });
}
