// Paged prefill attention (parrot_paged_prefill): the query tokens of a prefill step attend to their
// sequences' keys and values read in place from the paged KV cache ([Hkv, pages, page_size, D] per layer,
// float32 or bfloat16 bit patterns), causally, with an online softmax in float32. Included by
// cpu_kernels.cc inside its anonymous namespace (it uses vexp, load8, transpose8, hsum and
// parallel_chunks from there).
//
// Work. One task is (sequence, KV head, block of up to kQueries query tokens); its rows are the block's
// (query, group head) pairs, so a key is read once for all of them, and only up to the last position some
// row may see: a causal chunk does half the work of the padded square XLA's masked product computes.
// Three variants, each below with its own notes:
//  * float32 (`f32_blocks`; AVX2-only CPUs, and the exact mode everywhere): blocks of 32 keys, W query
//    rows in a vector's lanes (W = 16 on AVX-512, 8 on AVX2);
//  * bfloat16 products over a bfloat16 cache, in the engine's bfloat16 mode: on AMX's bf16 tiles
//    (`prefill_block_tiles`) or with AVX512-BF16's pair products (`prefill_pair_blocks`);
//  * heads whose D the float32 variant does not take: tiles of W keys (`prefill_tile`): the tile's keys
//    transposed to [D][W], eight rows at a time; per row, the running maximum and sum updated by the
//    tile's masked scores; values four rows x up to 4W dimensions in registers.
//
// Numbers. Every row's arithmetic depends only on its own query, position and keys: blocks (tiles) start at
// key 0 and go in order, one past the row's position leaves it alone, masked scores give exact zeros. So a
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
  static V max2(V a, V b) { return _mm256_max_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  // per lane: s where k <= lim, else -inf
  static V keep_le(V s, float k, V lim) {
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, _mm256_cmp_ps(_mm256_set1_ps(k), lim, _CMP_LE_OQ));
  }
  static unsigned ge(V a, float b) { return static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(b), _CMP_GE_OQ))); }
  static constexpr unsigned kAll = 0xFF;
  // exp(old - mx), exactly 1 where they are equal (rows whose max did not grow, and rows with no keys yet)
  static V rescale(V old, V mx) {
    return _mm256_blendv_ps(vexp(_mm256_sub_ps(old, mx)), _mm256_set1_ps(1.f), _mm256_cmp_ps(old, mx, _CMP_EQ_OQ));
  }
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
  static V max2(V a, V b) { return _mm512_max_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V keep_le(V s, float k, V lim) {
    return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), _mm512_cmp_ps_mask(_mm512_set1_ps(k), lim, _CMP_LE_OQ), s);
  }
  static unsigned ge(V a, float b) { return _mm512_cmp_ps_mask(a, _mm512_set1_ps(b), _CMP_GE_OQ); }
  static constexpr unsigned kAll = 0xFFFF;
  static V rescale(V old, V mx) {
    return _mm512_mask_mov_ps(vexp(_mm512_sub_ps(old, mx)), _mm512_cmp_ps_mask(old, mx, _CMP_EQ_OQ), _mm512_set1_ps(1.f));
  }
};
constexpr int kPrefillLanes = 16;
#else
constexpr int kPrefillLanes = 8;
#endif

constexpr int64_t kPrefillQueries = 32;  // query tokens per task
constexpr int64_t kPrefillMaxRows = 128;  // query tokens x group heads per task, at most

// The scratch of one task, per thread.
struct PrefillScratch {
  aligned::vector<float> qs, o, p, kt, vt, m, l, corr, lim;
  aligned::vector<int32_t> active;
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
template <int W, typename KT, typename VT>
void prefill_tile(PrefillScratch& s, int64_t rows, int64_t D, const KT* kb, const VT* vb, const int32_t* pages,
                  int64_t npos, int64_t S, int64_t l0, int64_t cnt) {
  using L = Lanes<W>;
  // keys transposed to kt[d][W] and values widened to vt[W][D]; positions past `cnt` are zeros
  const KT* krow[W];
  const VT* vrow[W];
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

// ---- float32 with W query rows in the lanes ---------------------------------------------------------
// The float32 path for heads whose D is a multiple of kF32Dims<W> (the tiles above take the rest). Keys go
// in blocks of 32 positions, widened once per block to float32 rows ([32][D], zeros past the block's end)
// for every group of W rows:
//  * scores: per group, 8 (AVX2) or 16 keys at a time, one query vector ([D][W], transposed once per task)
//    times each key's element broadcast, summed over D in order;
//  * softmax: vertical over the block's 32 key vectors (a row's max, its rescaling exp and its exps as
//    lanes, the sum as a fixed tree), so no reductions across lanes and no scalar exps;
//  * values: R rows x NV vectors of dimensions in registers, one value vector loaded for the R rows, each
//    row's probability broadcast; blocks that every row of the task sees in full go in runs of kRunBlocks,
//    the outputs staying in registers from one block to the next.
// Each lane is one row, and every row's arithmetic (block boundaries from key 0, sums in a fixed order) is
// its own, so a token's result is still the same bits in any chunk or batch.
constexpr int kRunBlocks = 4;  // whole blocks whose values go in one pass (here and in the bf16 pairs below)

// f(std::integral_constant<int, R>, rows + a) for n rows taken four at a time (R = 4, the last 1-4)
template <typename F>
inline void in_fours(const int32_t* rows, int n, F&& f) {
  for (int a = 0; a < n; a += 4) {
    switch (std::min(4, n - a)) {
      case 4: f(std::integral_constant<int, 4>{}, rows + a); break;
      case 3: f(std::integral_constant<int, 3>{}, rows + a); break;
      case 2: f(std::integral_constant<int, 2>{}, rows + a); break;
      default: f(std::integral_constant<int, 1>{}, rows + a); break;
    }
  }
}

template <int W>
struct F32Shape;
template <>
struct F32Shape<8> {  // 16 ymm registers: 8 score accumulators; values (four rows at a time) x 2 vectors
  static constexpr int kKeys = 8, kVecs = 2;
};
template <>
struct F32Shape<16> {  // 32 zmm registers: 16 score accumulators; values (four rows at a time) x 4 vectors
  static constexpr int kKeys = 16, kVecs = 4;
};
template <int W>
constexpr int64_t kF32Dims = W * F32Shape<W>::kVecs;  // D must be a multiple of this

struct PrefillF32 {
  aligned::vector<float> qt;  // [groups][D][W]: scaled queries, W rows in the lanes
  aligned::vector<float> kw, vw;  // [kRunBlocks][32][D]: keys and values of the blocks in hand, float32
  aligned::vector<float> pr;  // [kRunBlocks][32][W]: one group's probabilities
  aligned::vector<float> corr;  // [kRunBlocks][W]: its rescaling factors
  aligned::vector<int32_t> act;
  alignas(64) float sc[32 * 16];  // one group's scores, [key][W]
};

// keys and values l0 .. l0 + cnt - 1 of a KV head as float32 rows (zeros after cnt)
template <typename KT, typename VT>
inline void f32_block(const KT* kb, const VT* vb, const int32_t* pages, int64_t npos, int64_t S, int64_t D,
                      int64_t l0, int64_t cnt, float* kw, float* vw) {
  for (int i = 0; i < 32; ++i) {
    const int64_t l = l0 + i;
    float* kd = kw + i * D;
    float* vd = vw + i * D;
    if (i >= cnt || l >= npos) {
      std::fill(kd, kd + D, 0.f), std::fill(vd, vd + D, 0.f);
      continue;
    }
    const int64_t at = (static_cast<int64_t>(pages[l / S]) * S + l % S) * D;
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(kd + d, load8(kb + at + d)), _mm256_storeu_ps(vd + d, load8(vb + at + d));
  }
}

template <int W>
inline void f32_scores(const float* qt, const float* kw, int64_t D, float* sc) {
  using L = Lanes<W>;
  constexpr int KS = F32Shape<W>::kKeys;
  for (int k0 = 0; k0 < 32; k0 += KS) {
    typename L::V acc[KS];
    for (int k = 0; k < KS; ++k) acc[k] = L::zero();
    const float* kr = kw + k0 * D;
    for (int64_t d = 0; d < D; ++d) {
      const typename L::V q = L::load(qt + d * W);
      for (int k = 0; k < KS; ++k) acc[k] = L::fma(q, L::set1(kr[k * D + d]), acc[k]);
    }
    for (int k = 0; k < KS; ++k) L::store(sc + (k0 + k) * W, acc[k]);
  }
}

// One block's softmax update for the W rows of group g (rows r0 ..): running max and sum, rescaling factor
// (`corr`), probabilities ([32][W] to `pr`); returns the lanes with keys in the block.
template <int W>
inline unsigned f32_softmax(PrefillScratch& s, PrefillF32& t, int64_t r0, int64_t l0, float* corr_out, float* pr) {
  using L = Lanes<W>;
  using V = typename L::V;
  const V lim = L::sub(L::load(s.lim.data() + r0), L::set1(static_cast<float>(l0)));
  const unsigned active = L::ge(lim, 0.f);
  if (!active) return 0;
  const V old = L::load(s.m.data() + r0);
  V mx = old;
  if (L::ge(lim, 31.f) == L::kAll) {  // every row sees the whole block
    for (int k = 0; k < 32; ++k) mx = L::max2(mx, L::load(t.sc + k * W));
  } else {
    for (int k = 0; k < 32; ++k) {
      const V v = L::keep_le(L::load(t.sc + k * W), static_cast<float>(k), lim);
      L::store(t.sc + k * W, v);
      mx = L::max2(mx, v);
    }
  }
  const V corr = L::rescale(old, mx);
  V e[32];
  for (int k0 = 0; k0 < 32; k0 += 8) {
    for (int k = k0; k < k0 + 8; ++k) e[k] = L::sub(L::load(t.sc + k * W), mx);
    vexp_n<8>(e + k0);
  }
  for (int k = 0; k < 32; ++k) L::store(pr + k * W, e[k]);
  for (int i = 0; i < 16; ++i) e[i] = L::add(e[i], e[i + 16]);
  for (int i = 0; i < 8; ++i) e[i] = L::add(e[i], e[i + 8]);
  for (int i = 0; i < 4; ++i) e[i] = L::add(e[i], e[i + 4]);
  const V sum = L::add(L::add(e[0], e[2]), L::add(e[1], e[3]));
  L::store(s.m.data() + r0, mx);
  L::store(corr_out, corr);
  L::store(s.l.data() + r0, L::fma(L::load(s.l.data() + r0), corr, sum));
  return active;
}

// R rows (`rows`) of one group, dimensions d0 ..: o = o c + P V for nb blocks in turn (keys < cnt in the
// last), the outputs in registers throughout; a rescale by exactly 1 is skipped.
template <int W, int R>
inline void f32_values(PrefillScratch& s, const PrefillF32& t, const int32_t* rows, int nb, int64_t cnt, int64_t D,
                       int64_t d0) {
  using L = Lanes<W>;
  constexpr int NV = F32Shape<W>::kVecs;
  typename L::V o[R][NV];
  int lane[R];
  for (int r = 0; r < R; ++r) {
    lane[r] = rows[r] % W;
    for (int c = 0; c < NV; ++c) o[r][c] = L::load(s.o.data() + rows[r] * D + d0 + c * W);
  }
  for (int i = 0; i < nb; ++i) {
    for (int r = 0; r < R; ++r) {
      const float c = t.corr[i * W + lane[r]];
      if (c != 1.f)
        for (int v = 0; v < NV; ++v) o[r][v] = L::mul(o[r][v], L::set1(c));
    }
    const float* pr = t.pr.data() + i * 32 * W;
    const float* vw = t.vw.data() + i * 32 * D + d0;
    const int64_t kn = i == nb - 1 ? cnt : 32;
    for (int64_t k = 0; k < kn; ++k) {
      typename L::V vv[NV];
      for (int c = 0; c < NV; ++c) vv[c] = L::load(vw + k * D + c * W);
      for (int r = 0; r < R; ++r) {
        const typename L::V p = L::set1(pr[k * W + lane[r]]);
        for (int c = 0; c < NV; ++c) o[r][c] = L::fma(p, vv[c], o[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) L::store(s.o.data() + rows[r] * D + d0 + c * W, o[r][c]);
}

// nb blocks from key l0 (nb > 1 only where every row with a query sees all their keys; keys < cnt in the last)
template <int W, typename KT, typename VT>
void f32_blocks(PrefillScratch& s, PrefillF32& t, int64_t rows, int64_t D, const KT* kb, const VT* vb,
                const int32_t* pages, int64_t npos, int64_t S, int64_t l0, int nb, int64_t cnt) {
  for (int i = 0; i < nb; ++i)
    f32_block(kb, vb, pages, npos, S, D, l0 + 32 * i, i == nb - 1 ? cnt : 32, t.kw.data() + i * 32 * D,
              t.vw.data() + i * 32 * D);
  const int64_t groups = (rows + W - 1) / W;
  for (int64_t g = 0; g < groups; ++g) {
    unsigned act = 0;
    for (int i = 0; i < nb; ++i) {
      f32_scores<W>(t.qt.data() + g * D * W, t.kw.data() + i * 32 * D, D, t.sc);
      const unsigned a = f32_softmax<W>(s, t, g * W, l0 + 32 * i, t.corr.data() + i * W, t.pr.data() + i * 32 * W);
      if (i == 0) act = a;
    }
    int n = 0;  // rows with keys in the first block (with nb > 1: in every block)
    for (; act; act &= act - 1) t.act[n++] = static_cast<int32_t>(g * W + __builtin_ctz(act));
    for (int64_t d0 = 0; d0 < D; d0 += kF32Dims<W>)
      in_fours(t.act.data(), n, [&](auto r, const int32_t* rw) { f32_values<W, decltype(r)::value>(s, t, rw, nb, cnt, D, d0); });
  }
}

#if PARROT_AVX512_BF16
// 32 float8_e4m3fn bytes as bfloat16 bits, exactly (e4m3's 3 mantissa bits fit bfloat16's 7): each byte as
// a float16 of the value times 2^-8 (as load16 reads them), widened, times 256, narrowed.
inline __m512i e4m3_bf16x32(const uint8_t* p) {
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i h = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8),
                                    _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x7F)), 7));
  const __m512 k = _mm512_set1_ps(256.f);
  const __m512 lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), k);
  const __m512 hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), k);
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}
#endif

#if PARROT_AMX_BF16 || PARROT_AVX512_BF16
// The key and value rows of the positions l0 .. l0 + 31 (null past `cnt` or the pages).
inline void block_rows(const uint16_t* kb, const uint16_t* vb, const int32_t* pages, int64_t npos, int64_t S,
                       int64_t D, int64_t l0, int64_t cnt, const uint16_t* krow[32], const uint16_t* vrow[32]) {
  int64_t page = l0 / S, slot = l0 % S;  // stepped, not divided, per key
  for (int i = 0; i < 32; ++i) {
    const int64_t l = l0 + i;
    const int64_t at = i < cnt && l < npos ? (static_cast<int64_t>(pages[page]) * S + slot) * D : -1;
    krow[i] = at >= 0 ? kb + at : nullptr;
    vrow[i] = at >= 0 ? vb + at : nullptr;
    if (++slot == S) slot = 0, ++page;
  }
}

// Each half of a block's 32 keys (`krow`, null past the block's end) as 16 rows of D: in place where they
// are one run of rows in a page, else copied to `kz` ([32][D], zeros for null rows).
inline void block_keys(const uint16_t* const krow[32], int64_t D, uint16_t* kz, const uint16_t* keys[2]) {
  for (int h = 0; h < 2; ++h) {
    bool run = krow[16 * h] != nullptr;
    for (int k = 1; k < 16 && run; ++k) run = krow[16 * h + k] == krow[16 * h] + k * D;
    if (run) {
      keys[h] = krow[16 * h];
      continue;
    }
    uint16_t* dst = kz + h * 16 * D;
    for (int k = 0; k < 16; ++k)
      for (int64_t i = 0; i < D; ++i) dst[k * D + i] = krow[16 * h + k] ? krow[16 * h + k][i] : 0;
    keys[h] = dst;
  }
}

#endif

#if PARROT_AVX512_BF16
// ---- the bfloat16 variant with AVX512-BF16's pair products ----------------------------------------
// The same numbers as the tiles' variant above (scaled queries and probabilities rounded to bfloat16,
// products summed in float32, one max and one sum per row and 32 keys), for CPUs without AMX. The scores
// and the softmax put 16 rows in the lanes, so a row's max, sum and rescaling are vertical operations
// over the block's 32 key vectors instead of reductions across lanes:
//  * the task's scaled queries are transposed once ([16-row group][D/2 pairs][16 rows]);
//  * a group's scores for 16 keys are D/2 x 16 vdpbf16ps, each key's pair j broadcast from the cache;
//  * the softmax (`prefill_lane_softmax`, which the tiles' variant below shares): the max over the 32 key
//    vectors, one vector exp per key vector, and the sum over them in the order GCC's `_mm512_reduce_add_ps`
//    sums a vector's lanes (key t with t + 16, then 8, 4, 2, 1 apart); the rescaling exp of a row whose
//    max grew is the scalar std::exp;
//  * the probabilities, as bfloat16 pairs of keys per row ([16 pairs][16 rows] per block), multiply the values
//    interleaved by pairs of keys ([16 pairs][D/16 vectors], whose dimensions come out permuted within each
//    64: bf16_dim): 16 x D/16 vdpbf16ps per row with a pair of its probabilities broadcast.
// Every lane's arithmetic is its own row's, so every row's result is still its own.
struct PrefillPairs {
  aligned::vector<uint32_t> qp;  // [rows][D/2]: scaled queries in bfloat16 pairs
  aligned::vector<uint32_t> qt;  // [groups][D/2][16]: the same, 16 rows in the lanes
  aligned::vector<aligned::Bits512> vp;  // [kRunBlocks][16][D/16]: each block's key pairs interleaved per dimension
  aligned::vector<uint32_t> pt;  // [kRunBlocks][16 pairs of keys][16 rows]: one group's probabilities
  alignas(64) float corr[kRunBlocks * 16];  // its rescaling factors
  aligned::vector<int32_t> act;  // rows with keys in the first block
  alignas(64) float sc[32 * 16];  // a group's scores, [key][16 rows]
  aligned::vector<uint16_t> kz;  // [kRunBlocks][32][D]: half blocks' keys where they are not one run in a page
};

// sc[16 h + k][lane] = the scores of keys 16 h + k for the 16 rows of `qt`; key k of half h at keys[h] + k D.
template <int64_t D>
inline void prefill_lane_scores(const uint32_t* qt, const uint16_t* const keys[2], float* sc) {
  constexpr int64_t pairs = D / 2;
  for (int h = 0; h < 2; ++h) {
    const uint16_t* kw = keys[h];
    __m512 acc[16];
    for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_ps();
    for (int64_t j = 0; j < pairs; ++j) {
      const __m512bh q = as_bh(_mm512_load_si512(qt + j * 16));
      for (int k = 0; k < 16; ++k) {
        int32_t pair;  // dimensions 2j, 2j + 1 of key k (memcpy: the bytes are uint16_t, read as one word)
        std::memcpy(&pair, kw + k * D + 2 * j, sizeof pair);
        acc[k] = _mm512_dpbf16_ps(acc[k], q, as_bh(_mm512_set1_epi32(pair)));
      }
    }
    for (int k = 0; k < 16; ++k) _mm512_store_ps(sc + (16 * h + k) * 16, acc[k]);
  }
}

// One block's softmax update for the 16 rows of group `g` (rows r0 ..): their running max and sum, their
// rescaling factor (to `corr_out`, 16 floats), their probabilities as bfloat16 pairs (to `pt_out`, [16
// pairs][16 rows]); returns the lanes with keys in the block.
inline __mmask16 prefill_lane_softmax(PrefillScratch& s, float* sc, int64_t g, int64_t l0, float* corr_out,
                                      uint32_t* pt_out) {
  const int64_t r0 = 16 * g;
  const __m512 lim = _mm512_sub_ps(_mm512_loadu_ps(s.lim.data() + r0), _mm512_set1_ps(static_cast<float>(l0)));
  const __mmask16 active = _mm512_cmp_ps_mask(lim, _mm512_setzero_ps(), _CMP_GE_OQ);
  if (!active) return 0;
  const __m512 old = _mm512_loadu_ps(s.m.data() + r0);
  __m512 mx = old;
  if (_mm512_cmp_ps_mask(lim, _mm512_set1_ps(31.f), _CMP_GE_OQ) == 0xFFFF) {  // every row sees the whole block
    for (int k = 0; k < 32; ++k) mx = _mm512_max_ps(mx, _mm512_load_ps(sc + 16 * k));
  } else {  // keys past a row's position (and every key of a row past the block) give it -inf
    for (int k = 0; k < 32; ++k) {
      const __m512 v = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY),
                                          _mm512_cmp_ps_mask(_mm512_set1_ps(static_cast<float>(k)), lim, _CMP_LE_OQ),
                                          _mm512_load_ps(sc + 16 * k));
      _mm512_store_ps(sc + 16 * k, v);
      mx = _mm512_max_ps(mx, v);
    }
  }
  // exp(old - max) where the max grew (exp(-inf) = 0 on a row's first block), else exactly 1
  __m512 corr = _mm512_set1_ps(1.f);
  if (_mm512_cmp_ps_mask(mx, old, _CMP_NEQ_UQ)) {
    alignas(64) float o[16], m[16], c[16];
    _mm512_store_ps(o, old), _mm512_store_ps(m, mx);
    for (int r = 0; r < 16; ++r) c[r] = m[r] == o[r] ? 1.f : std::exp(o[r] - m[r]);
    corr = _mm512_load_ps(c);
  }
  // e = exp(score - max) (0 for -inf scores; rows past the block have no other), summed in reduce_add's tree
  __m512 e[32];
  for (int k0 = 0; k0 < 32; k0 += 8) {
    for (int k = k0; k < k0 + 8; ++k) e[k] = _mm512_sub_ps(_mm512_load_ps(sc + 16 * k), mx);
    vexp_n<8>(e + k0);
  }
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_add_ps(e[i], e[i + 16]);
  for (int i = 0; i < 8; ++i) a[i] = _mm512_add_ps(a[i + 8], a[i]);
  for (int i = 0; i < 4; ++i) a[i] = _mm512_add_ps(a[i + 4], a[i]);
  const __m512 sum = _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3]));
  _mm512_storeu_ps(s.m.data() + r0, mx);
  _mm512_storeu_ps(corr_out, corr);
  _mm512_storeu_ps(s.l.data() + r0, _mm512_fmadd_ps(_mm512_loadu_ps(s.l.data() + r0), corr, sum));
  // probabilities: dword r of pair p = (e[2p][r], e[2p + 1][r]) in bfloat16
  const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512i* pt = reinterpret_cast<__m512i*>(pt_out);
  for (int p = 0; p < 16; ++p)
    _mm512_store_si512(pt + p, _mm512_permutexvar_epi16(inter, (__m512i)_mm512_cvtne2ps_pbh(e[2 * p + 1], e[2 * p])));
  return active;
}

// dst = src * inv for one row of D outputs (a multiple of 64), whose dimensions the value products leave
// permuted within each 64 (bf16_dim): output vector w of a 64 takes its lanes from accumulators 2 (w / 2)
// and 2 (w / 2) + 1.
inline void prefill_store_row(const float* src, float* dst, int64_t D, float inv) {
  // dimension 32 h + r of half h is lane 4 (r / 8) + r % 4 of accumulator 2 h + (r % 8) / 4 (permutex2var's
  // index: + 16 for the second)
  alignas(64) static constexpr int32_t kLanes[2][16] = {{0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23},
                                                        {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31}};
  const __m512i idx[2] = {_mm512_load_si512(kLanes[0]), _mm512_load_si512(kLanes[1])};
  const __m512 f = _mm512_set1_ps(inv);
  for (int64_t d0 = 0; d0 < D; d0 += 64)
    for (int w = 0; w < 4; ++w) {
      const float* a = src + d0 + 32 * (w / 2);
      const __m512 x = _mm512_permutex2var_ps(_mm512_loadu_ps(a), idx[w % 2], _mm512_loadu_ps(a + 16));
      _mm512_storeu_ps(dst + d0 + 16 * w, _mm512_mul_ps(x, f));
    }
}

// The task's scaled queries (`qp`: [rows][D/2] bfloat16 pairs) in 16-row groups, transposed into `qt`
// ([groups][D/2][16]; rows past `rows` zero).
inline void prefill_lane_queries(const uint32_t* qp, aligned::vector<uint32_t>& qt, int64_t rows, int64_t D) {
  const int64_t pairs = D / 2, groups = (rows + 15) / 16;
  qt.resize(groups * pairs * 16);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t j0 = 0; j0 < pairs; j0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = 16 * g + i < rows ? _mm512_load_si512(qp + (16 * g + i) * pairs + j0) : _mm512_setzero_si512();
      transpose16x16(r);
      for (int j = 0; j < 16; ++j) _mm512_store_si512(qt.data() + ((g * pairs) + j0 + j) * 16, r[j]);
    }
}

// A block's values interleaved by pairs of keys into `vp` ([16][D/16]) and its two halves' keys (`keys`:
// in place where a half's 16 keys are one run of rows in a page, else copied to `kz`, [32][D], zeros past
// the block's end).
inline void prefill_block_operands(const uint16_t* kb, const uint16_t* vb, const int32_t* pages, int64_t npos,
                                   int64_t S, int64_t D, int64_t l0, int64_t cnt, aligned::Bits512* vp,
                                   uint16_t* kz, const uint16_t* keys[2]) {
  const uint16_t* krow[32];
  const uint16_t* vrow[32];
  block_rows(kb, vb, pages, npos, S, D, l0, cnt, krow, vrow);
  const int64_t nv = D / 16;
  for (int p = 0; p < 16; ++p)
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      const __m512i a = vrow[2 * p] ? _mm512_loadu_si512(vrow[2 * p] + d0) : _mm512_setzero_si512();
      const __m512i b = vrow[2 * p + 1] ? _mm512_loadu_si512(vrow[2 * p + 1] + d0) : _mm512_setzero_si512();
      __m512i* v = reinterpret_cast<__m512i*>(vp) + p * nv + d0 / 16;
      _mm512_store_si512(v, _mm512_unpacklo_epi16(a, b));
      _mm512_store_si512(v + 1, _mm512_unpackhi_epi16(a, b));
    }
  block_keys(krow, D, kz, keys);
}

inline void prefill_group_scores(const uint32_t* qt, const uint16_t* const keys[2], int64_t D, float* sc) {
  switch (D) {
    case 64: prefill_lane_scores<64>(qt, keys, sc); break;
    case 128: prefill_lane_scores<128>(qt, keys, sc); break;
    case 192: prefill_lane_scores<192>(qt, keys, sc); break;
    default: prefill_lane_scores<256>(qt, keys, sc); break;
  }
}

// R rows of one group (`rows`), dimensions d0 .. d0 + 63: o = o c + P V for nb blocks in turn, the outputs
// kept in registers between blocks (o c skipped where c is exactly 1: the same bits).
template <int R>
inline void prefill_pair_values(PrefillScratch& s, const PrefillPairs& t, const int32_t* rows, int nb, int64_t D,
                                int64_t d0) {
  const int64_t nv = D / 16;
  __m512 o[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) o[r][c] = _mm512_loadu_ps(s.o.data() + rows[r] * D + d0 + 16 * c);
  for (int i = 0; i < nb; ++i) {
    for (int r = 0; r < R; ++r) {
      const float corr = t.corr[16 * i + (rows[r] & 15)];
      if (corr != 1.f)
        for (int c = 0; c < 4; ++c) o[r][c] = _mm512_mul_ps(o[r][c], _mm512_set1_ps(corr));
    }
    const uint32_t* pt = t.pt.data() + 256 * i;
    const __m512i* vi = reinterpret_cast<const __m512i*>(t.vp.data()) + i * 16 * nv + d0 / 16;
    for (int p = 0; p < 16; ++p) {
      const __m512i* v = vi + p * nv;
      for (int r = 0; r < R; ++r) {
        const __m512bh w = as_bh(_mm512_set1_epi32(static_cast<int>(pt[16 * p + (rows[r] & 15)])));
        for (int c = 0; c < 4; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], as_bh(_mm512_load_si512(v + c)), w);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s.o.data() + rows[r] * D + d0 + 16 * c, o[r][c]);
}

// nb blocks from key l0 (nb > 1 only where every row with a query sees all their keys; keys < cnt in the
// last): per group, the blocks' scores and softmax updates in order, then their value products at once.
inline void prefill_pair_blocks(PrefillScratch& s, PrefillPairs& t, int64_t rows, int64_t D, const uint16_t* kb,
                                const uint16_t* vb, const int32_t* pages, int64_t npos, int64_t S, int64_t l0, int nb,
                                int64_t cnt) {
  const uint16_t* keys[kRunBlocks][2];
  for (int i = 0; i < nb; ++i)
    prefill_block_operands(kb, vb, pages, npos, S, D, l0 + 32 * i, i == nb - 1 ? cnt : 32, t.vp.data() + i * D,
                           t.kz.data() + i * 32 * D, keys[i]);
  const int64_t pairs = D / 2, groups = (rows + 15) / 16;
  for (int64_t g = 0; g < groups; ++g) {
    __mmask16 act = 0;
    for (int i = 0; i < nb; ++i) {
      prefill_group_scores(t.qt.data() + g * pairs * 16, keys[i], D, t.sc);
      const __mmask16 a = prefill_lane_softmax(s, t.sc, g, l0 + 32 * i, t.corr + 16 * i, t.pt.data() + 256 * i);
      if (i == 0) act = a;
    }
    int n = 0;  // rows with keys in the first block (with nb > 1: in every block)
    for (; act; act &= act - 1) t.act[n++] = static_cast<int32_t>(16 * g + __builtin_ctz(act));
    for (int64_t d0 = 0; d0 < D; d0 += 64)
      in_fours(t.act.data(), n, [&](auto r, const int32_t* rw) { prefill_pair_values<decltype(r)::value>(s, t, rw, nb, D, d0); });
  }
}
#endif

#if PARROT_AMX_BF16
// ---- the bfloat16 variant on AMX's bf16 tiles ------------------------------------------------------
// For prompts the engine multiplies in bfloat16 (its bfloat16 mode), over a bfloat16 cache: the scaled
// queries and the probabilities are rounded to bfloat16, the products summed in float32 on the tiles. As
// the pair products' variant above, 16 rows go in a vector's lanes, so the softmax is vertical (its
// `prefill_lane_softmax`, the same numbers): the tiles compute the transposes of the usual products.
//  * scores^T = K Q^T: A is 16 keys x 32 dimensions read in place from their page (one run of 16 rows,
//    else copied), B the group's scaled queries in pairs of dimensions ([D/2][16 rows], made once a task);
//    C [16 keys][16 rows] for each half of the block's 32 keys;
//  * O^T += V^T P^T: A is 16 dimensions x 32 keys (the block's values transposed: once per sequence and head
//    for a sequence with several query blocks, else per task and block),
//    B the probabilities in pairs of keys ([16][16 rows], as the softmax leaves them); C [16 dimensions][16
//    rows] is added to the group's float32 output as o c + C, c the rows' rescaling in the lanes.
// Every lane is its own row's, so every row's result is still its own.
struct PrefillTiles {
  aligned::vector<uint32_t> qp;  // [rows][D/2]: scaled queries in bfloat16 pairs
  aligned::vector<uint32_t> qt;  // [groups][D/2][16]: the same, 16 rows in the lanes
  aligned::vector<uint32_t> vt;  // [D][16]: the block's values transposed, dimension d's 32 keys in pairs
  aligned::vector<uint16_t> kz;  // [32][D]: half blocks' keys where they are not one run in a page
  aligned::vector<float> ot;     // [groups][D][16]: the outputs, 16 rows in the lanes
  aligned::vector<float> pv;     // [2][D][16]: two groups' P x V sums, between the tiles and the outputs
  alignas(64) float sc[32 * 16];  // a group's scores, [key][16 rows]
  alignas(64) uint32_t pt[2][256];  // two groups' probabilities, [16 pairs of keys][16 rows]
  alignas(64) float corr[2][16];    // and their rescaling factors
};

inline void prefill_tiles_configure() {
  // tmm0, tmm1 scores (two halves), tmm2 keys (and values), tmm3 queries, tmm4 values, tmm5 P, tmm6-7 P x V
  amx::TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  asm volatile("" : : "r"(&cfg) : "memory");  // see amx::configure
  _tile_loadconfig(&cfg);
}

// A block's values (`vrow`, null past its end) transposed for the P x V tiles into `vt` ([D][16]):
// vt[d][p] = (v[2p][d], v[2p + 1][d]), per 16 dimensions the keys' pairs interleaved, then transposed.
inline void prefill_values_t(const uint16_t* const vrow[32], int64_t D, uint32_t* vt) {
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    __m512i r[16];
    for (int p = 0; p < 16; ++p) {
      const __m256i a = vrow[2 * p] ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[2 * p] + d0))
                                    : _mm256_setzero_si256();
      const __m256i b = vrow[2 * p + 1] ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow[2 * p + 1] + d0))
                                        : _mm256_setzero_si256();
      const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);  // dims 0-3, 8-11 | 4-7, 12-15
      r[p] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(lo, hi, 0x20)),
                                _mm256_permute2x128_si256(lo, hi, 0x31), 1);
    }
    transpose16x16(r);
    for (int i = 0; i < 16; ++i) _mm512_store_si512(vt + (d0 + i) * 16, r[i]);
  }
}

// The block's keys for the scores' A tiles (`keys`: each half's 16 rows of D, in place where they are one
// run in a page, else copied to `kz` with zeros past the block's end) and its values transposed: into `vt`,
// unless `shared` holds them already (made once for every task of the sequence and head; returned).
inline const uint32_t* prefill_tile_operands(PrefillTiles& t, const uint16_t* kb, const uint16_t* vb,
                                             const int32_t* pages, int64_t npos, int64_t S, int64_t D, int64_t l0,
                                             int64_t cnt, const uint16_t* keys[2], const uint32_t* shared) {
  const uint16_t* krow[32];
  const uint16_t* vrow[32];
  block_rows(kb, vb, pages, npos, S, D, l0, cnt, krow, vrow);
  block_keys(krow, D, t.kz.data(), keys);
  if (shared != nullptr) return shared;
  prefill_values_t(vrow, D, t.vt.data());
  return t.vt.data();
}

// One block of 32 keys from l0 for every group of the task's rows, in three stages a group apart, so that no
// vector code waits on a tile store just issued (the tile unit runs its loads, products and stores in order,
// and a vector load of a tile's stored sums waits for the store): group g's scores are stored and its softmax
// runs while the tile unit takes group g + 1's scores and group g - 1's P x V; group g - 2's P x V sums, stored
// a group earlier, are added to its outputs first. Each row's steps are the same, in the same order.
inline void prefill_block_tiles(PrefillScratch& s, PrefillTiles& t, int64_t groups, int64_t D, const uint16_t* kb,
                                const uint16_t* vb, const int32_t* pages, int64_t npos, int64_t S, int64_t l0,
                                int64_t cnt, const uint32_t* shared_vt) {
  const uint16_t* keys[2];
  const uint32_t* vt = prefill_tile_operands(t, kb, vb, pages, npos, S, D, l0, cnt, keys, shared_vt);
  const int64_t pairs = D / 2;
  auto scores = [&](int64_t g) {  // group g's scores into tmm0 (keys 0-15) and tmm1 (keys 16-31)
    const uint32_t* qt = t.qt.data() + g * pairs * 16;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < D / 32; ++c) {
      _tile_loadd(3, qt + c * 256, 64);
      _tile_loadd(2, keys[0] + 32 * c, D * 2);
      _tile_dpbf16ps(0, 2, 3);
      _tile_loadd(2, keys[1] + 32 * c, D * 2);
      _tile_dpbf16ps(1, 2, 3);
    }
  };
  auto products = [&](int64_t g) {  // group g's P x V into t.pv[g % 2], 32 dimensions a round (tmm4-7)
    _tile_loadd(5, t.pt[g % 2], 64);
    float* pv = t.pv.data() + (g % 2) * D * 16;
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      _tile_zero(6);
      _tile_zero(7);
      _tile_loadd(4, vt + d0 * 16, 64);
      _tile_dpbf16ps(6, 4, 5);
      _tile_loadd(4, vt + (d0 + 16) * 16, 64);
      _tile_dpbf16ps(7, 4, 5);
      _tile_stored(6, pv + d0 * 16, 64);
      _tile_stored(7, pv + (d0 + 16) * 16, 64);
    }
  };
  auto add = [&](int64_t g) {  // group g's P x V sums into its outputs: o c + P V, c its rows' rescaling
    const __m512 corr = _mm512_load_ps(t.corr[g % 2]);
    const bool rescale = _mm512_cmp_ps_mask(corr, _mm512_set1_ps(1.f), _CMP_NEQ_UQ) != 0;
    const float* pv = t.pv.data() + (g % 2) * D * 16;
    float* o = t.ot.data() + g * D * 16;
    for (int64_t i = 0; i < D; ++i) {
      const __m512 c = _mm512_load_ps(pv + 16 * i);
      _mm512_store_ps(o + 16 * i, rescale ? _mm512_fmadd_ps(_mm512_load_ps(o + 16 * i), corr, c)
                                          : _mm512_add_ps(_mm512_load_ps(o + 16 * i), c));
    }
  };
  int64_t prev = -1, older = -1;  // groups with keys in the block whose products / sums are pending
  if (groups > 0) scores(0);
  for (int64_t g = 0; g < groups; ++g) {
    _tile_stored(0, t.sc, 64);
    _tile_stored(1, t.sc + 256, 64);
    if (g + 1 < groups) scores(g + 1);
    if (prev >= 0) products(prev);
    if (older >= 0) add(older);  // before the softmax below takes its buffers (older % 2 == g % 2)
    const bool active = prefill_lane_softmax(s, t.sc, g, l0, t.corr[g % 2], t.pt[g % 2]) != 0;
    older = prev, prev = active ? g : -1;
  }
  if (prev >= 0) products(prev);
  if (older >= 0) add(older);
  if (prev >= 0) add(prev);
}
#endif

// q [T, H, D]; q_index [B, Q] (flat token of query j of sequence b, T where none); positions [T];
// block_tables [B, maxp]; the sequence's key l is at position kv_offset[b] + l, seen by a query at
// position p when kv_offset[b] + l <= p and < kv_lens[b]. out [T, H, D]: zeros for tokens no query names.
template <typename KT, typename VT>
void paged_prefill(ffi::ThreadPool& pool, const float* q, const KT* kc, const VT* vc, const int32_t* qidx,
                   const int32_t* pos, const int32_t* bt, const int32_t* off, const int32_t* lens, float* out,
                   int64_t T, int64_t H, int64_t D, int64_t Hkv, int64_t P, int64_t S, int64_t B, int64_t Q,
                   int64_t maxp, float scale, int bf16 = kFillExact) {
  constexpr int W = kPrefillLanes;
  // bfloat16 products (FillPath: on AMX's tiles, or with AVX512-BF16) over bfloat16 caches, or float8 ones
  // (keys, values or both) whose pages a task reads are first widened to bfloat16 (exactly)
  constexpr bool k8 = std::is_same<KT, uint8_t>::value, v8 = std::is_same<VT, uint8_t>::value;
  constexpr bool fp8_cache = k8 || v8;
  const bool bf16_cache = (std::is_same<KT, uint16_t>::value || k8) && (std::is_same<VT, uint16_t>::value || v8) &&
                          (!fp8_cache || PARROT_AVX512_BF16);
  const bool tiles = PARROT_AMX_BF16 && bf16 == kFillAmxTiles && bf16_cache && D % 32 == 0;
  const bool pairs = PARROT_AVX512_BF16 && bf16 == kFillAvx512 && bf16_cache && D % 64 == 0 && D <= 256;
  (void)tiles, (void)pairs;  // read only where the CPU has those codes
  const bool f32lanes = !tiles && !pairs && D % kF32Dims<W> == 0;  // float32, W rows in the lanes
  const int64_t group = H / Hkv, head_stride = P * S * D;
  const int64_t per = std::max<int64_t>(1, std::min(kPrefillQueries, kPrefillMaxRows / group));
  const int64_t blocks = (Q + per - 1) / per;
  std::fill(out, out + T * H * D, 0.f);
  // the tasks: (sequence, KV head, query block) for the blocks naming a query token (a wide padded shape,
  // e.g. decode rows beside a prompt chunk, leaves most blocks empty); the last query blocks see the most
  // keys: they go first
  thread_local std::vector<int64_t> todo;
  todo.clear();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < Hkv; ++g)
      for (int64_t qb = blocks - 1; qb >= 0; --qb) {
        const int32_t* idx = qidx + b * Q + qb * per;
        const int64_t nq = std::min(per, Q - qb * per);
        bool real = false;
        for (int64_t j = 0; j < nq && !real; ++j) real = idx[j] >= 0 && idx[j] < T;
        if (real) todo.push_back((b * Hkv + g) * blocks + qb);
      }
  const int64_t* tasks = todo.data();  // the caller's; helpers read it until every chunk is done
  // On the tiles over a bfloat16 cache, a sequence's whole blocks of values are transposed once for all of its
  // tasks (each KV head's query blocks read the same blocks), where it has several query blocks: `vshared`
  // [sequence's base + (head * its blocks + block) * D * 16], `vbase[b]` (-1: each task its own).
#if PARROT_AMX_BF16
  thread_local aligned::vector<uint32_t> vshared;
  thread_local std::vector<int64_t> vbase, vblocks, vwork;
  vbase.assign(B, -1), vblocks.assign(B, 0), vwork.clear();
  if (tiles && !fp8_cache) {
    int64_t total = 0;
    for (int64_t b = 0; b < B; ++b) {
      int64_t qblocks = 0, vend = 0;
      for (int64_t qb = 0; qb < blocks; ++qb) {
        bool real = false;
        for (int64_t j = qb * per; j < std::min(Q, (qb + 1) * per); ++j) {
          const int32_t t = qidx[b * Q + j];
          if (t < 0 || t >= T) continue;
          real = true;
          vend = std::max<int64_t>(vend, std::min<int64_t>(pos[t], lens[b] - 1) - off[b] + 1);
        }
        qblocks += real;
      }
      vend = std::min<int64_t>(vend, maxp * S);
      if (qblocks < 2 || vend < 32) continue;
      vbase[b] = total, vblocks[b] = vend / 32;  // the whole blocks (a task's last partial one is its own)
      total += Hkv * vblocks[b] * D * 16;
      for (int64_t i = 0; i < Hkv * vblocks[b]; ++i) vwork.push_back(b * Hkv * (maxp * S / 32 + 1) + i);
    }
    vshared.resize(total);
  }
  // the caller's thread-locals, read by the helpers through these pointers (a lambda does not capture them)
  uint32_t* const vsh_all = vshared.data();
  const int64_t* const vb0 = vbase.data();
  const int64_t* const vnb = vblocks.data();
  if (!vwork.empty()) {
    const int64_t stride = maxp * S / 32 + 1;
    const int64_t* work = vwork.data();
    parallel_chunks(pool, static_cast<int64_t>(vwork.size()), [&](int64_t item) {
      const int64_t b = work[item] / (Hkv * stride), i = work[item] % (Hkv * stride);
      const int64_t g = i / vnb[b], blk = i % vnb[b];
      const uint16_t* krow[32];
      const uint16_t* vrow[32];
      block_rows(reinterpret_cast<const uint16_t*>(kc + g * head_stride),
                 reinterpret_cast<const uint16_t*>(vc + g * head_stride), bt + b * maxp, maxp * S, S, D, 32 * blk, 32,
                 krow, vrow);
      prefill_values_t(vrow, D, vsh_all + vb0[b] + i * D * 16);
    });
  }
#endif
  parallel_chunks(pool, static_cast<int64_t>(todo.size()), [&](int64_t task) {
    const int64_t qb = tasks[task] % blocks, g = (tasks[task] / blocks) % Hkv, b = tasks[task] / (blocks * Hkv);
    const int32_t* idx = qidx + b * Q + qb * per;
    const int64_t nq = std::min(per, Q - qb * per), rows = nq * group;
    thread_local PrefillScratch s;
    s.size(rows, D, W);
    const int64_t o0 = off[b], len = lens[b], npos = maxp * S;
    float last = -1.f, first = INFINITY;  // the largest and smallest position seen by a row with a query
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
      if (real) first = std::min(first, lim);
    }
    const KT* kb = kc + g * head_stride;
    const VT* vb = vc + g * head_stride;
    const int64_t end = std::min<int64_t>(static_cast<int64_t>(last) + 1, npos);
    // the bfloat16 paths' keys, values and page table: the cache's own, or (a float8 cache) the pages the
    // task reads widened in order into this thread's buffers, their table 0, 1, 2, ...
    const uint16_t* kh = reinterpret_cast<const uint16_t*>(kb);
    const uint16_t* vh = reinterpret_cast<const uint16_t*>(vb);
    const int32_t* bth = bt + b * maxp;
    (void)kh, (void)vh, (void)bth;  // read only where the CPU has the bfloat16 codes
#if PARROT_AVX512_BF16
    if constexpr (fp8_cache) {
      if (tiles || pairs) {
        thread_local aligned::vector<uint16_t> kw, vw;
        thread_local std::vector<int32_t> order;
        const int64_t np = (end + S - 1) / S, page = S * D;
        kw.resize(std::max<int64_t>(np, 1) * page), vw.resize(std::max<int64_t>(np, 1) * page);
        order.resize(std::max<int64_t>(maxp, 1));
        for (int64_t i = 0; i < static_cast<int64_t>(order.size()); ++i) order[i] = static_cast<int32_t>(i);
        // a float8 cache's pages widened, a bfloat16 one's copied (both then lie in one page order)
        auto gather = [&](const auto* src, uint16_t* dst) {
          for (int64_t i = 0; i < np; ++i) {
            const auto* from = src + static_cast<int64_t>(bth[i]) * page;
            if constexpr (std::is_same_v<std::remove_cv_t<std::remove_pointer_t<decltype(src)>>, uint8_t>) {
              for (int64_t e = 0; e < page; e += 32) _mm512_store_si512(dst + i * page + e, e4m3_bf16x32(from + e));
            } else {
              std::memcpy(dst + i * page, from, page * sizeof(uint16_t));
            }
          }
        };
        gather(kb, kw.data());
        gather(vb, vw.data());
        kh = kw.data(), vh = vw.data(), bth = order.data();
      }
    }
#endif
    // keys 0 .. seen - 1 are seen by every row with a query: whole blocks there go in runs (f32 and pairs)
    const int64_t seen = first >= 0.f && first <= last ? std::min<int64_t>(end, static_cast<int64_t>(first) + 1) : 0;
#if PARROT_AMX_BF16
    if (tiles) {
      thread_local PrefillTiles t;
      const int64_t groups = (rows + 15) / 16, padded = groups * 16;  // rows past `rows` see no key
      t.qp.resize(padded * D / 2), t.vt.resize(D * 16), t.kz.resize(32 * D), t.pv.resize(2 * D * 16);
      t.ot.assign(groups * D * 16, 0.f);
      s.m.resize(padded, -INFINITY), s.l.resize(padded, 0.f), s.lim.resize(padded, -1.f);
      for (int64_t i = 0; i < rows * D; i += 32)
        _mm512_store_si512(t.qp.data() + i / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s.qs.data() + i + 16),
                                                                            _mm512_loadu_ps(s.qs.data() + i)));
      prefill_lane_queries(t.qp.data(), t.qt, rows, D);
      prefill_tiles_configure();
      const uint32_t* vsh = vb0[b] >= 0 ? vsh_all + vb0[b] + g * vnb[b] * D * 16 : nullptr;
      for (int64_t l0 = 0; l0 < end; l0 += 32)
        prefill_block_tiles(s, t, groups, D, kh, vh, bth, npos, S, l0, std::min<int64_t>(32, end - l0),
                            vsh != nullptr && l0 + 32 <= end && l0 / 32 < vnb[b] ? vsh + l0 / 32 * D * 16 : nullptr);
      _tile_release();
      for (int64_t g = 0; g < groups; ++g)  // the outputs back to a row per token and head
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
          __m512i r[16];
          for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(t.ot.data() + (g * D + d0 + i) * 16);
          transpose16x16(r);
          for (int i = 0; i < 16 && 16 * g + i < rows; ++i) _mm512_storeu_si512(s.o.data() + (16 * g + i) * D + d0, r[i]);
        }
    } else
#endif
#if PARROT_AVX512_BF16
    if (pairs) {
      thread_local PrefillPairs t;
      const int64_t padded = (rows + 15) / 16 * 16;  // the rows of the last group past `rows` see no key
      t.qp.resize(rows * D / 2), t.vp.resize(kRunBlocks * D), t.kz.resize(kRunBlocks * 32 * D);
      t.pt.resize(kRunBlocks * 256), t.act.resize(padded);
      s.m.resize(padded, -INFINITY), s.l.resize(padded, 0.f), s.lim.resize(padded, -1.f);
      for (int64_t i = 0; i < rows * D; i += 32)
        _mm512_store_si512(t.qp.data() + i / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s.qs.data() + i + 16),
                                                                            _mm512_loadu_ps(s.qs.data() + i)));
      prefill_lane_queries(t.qp.data(), t.qt, rows, D);
      int64_t l0 = 0;
      for (; l0 + 32 * kRunBlocks <= seen; l0 += 32 * kRunBlocks)
        prefill_pair_blocks(s, t, rows, D, kh, vh, bth, npos, S, l0, kRunBlocks, 32);
      for (; l0 < end; l0 += 32)
        prefill_pair_blocks(s, t, rows, D, kh, vh, bth, npos, S, l0, 1, std::min<int64_t>(32, end - l0));
    } else
#endif
    if (f32lanes) {
      thread_local PrefillF32 t;
      const int64_t groups = (rows + W - 1) / W, padded = groups * W;  // rows past `rows` see no key
      t.qt.resize(groups * D * W), t.kw.resize(kRunBlocks * 32 * D), t.vw.resize(kRunBlocks * 32 * D);
      t.pr.resize(kRunBlocks * 32 * W), t.corr.resize(kRunBlocks * W), t.act.resize(padded);
      s.m.resize(padded, -INFINITY), s.l.resize(padded, 0.f), s.lim.resize(padded, -1.f);
      for (int64_t g = 0; g < groups; ++g)
        for (int w = 0; w < W; ++w) {
          const int64_t row = g * W + w;
          for (int64_t d = 0; d < D; ++d) t.qt[(g * D + d) * W + w] = row < rows ? s.qs[row * D + d] : 0.f;
        }
      int64_t l0 = 0;
      for (; l0 + 32 * kRunBlocks <= seen; l0 += 32 * kRunBlocks)
        f32_blocks<W>(s, t, rows, D, kb, vb, bt + b * maxp, npos, S, l0, kRunBlocks, 32);
      for (; l0 < end; l0 += 32)
        f32_blocks<W>(s, t, rows, D, kb, vb, bt + b * maxp, npos, S, l0, 1, std::min<int64_t>(32, end - l0));
    } else {
      for (int64_t l0 = 0; l0 < end; l0 += W)
        prefill_tile<W>(s, rows, D, kb, vb, bt + b * maxp, npos, S, l0, std::min<int64_t>(W, end - l0));
    }
    for (int64_t j = 0; j < nq; ++j) {
      if (idx[j] < 0 || idx[j] >= T) continue;
      for (int64_t h = 0; h < group; ++h) {
        const int64_t row = j * group + h;
        const float inv = s.l[row] > 0.f ? 1.f / s.l[row] : 0.f;
        float* dst = out + (static_cast<int64_t>(idx[j]) * H + g * group + h) * D;
#if PARROT_AVX512_BF16
        if (pairs) {  // the dimensions permuted within each 64 (bf16_dim)
          prefill_store_row(s.o.data() + row * D, dst, D, inv);
          continue;
        }
#endif
        for (int64_t i = 0; i < D; ++i) dst[i] = s.o[row * D + i] * inv;
      }
    }
  });
}
