// Parrot's CPU kernels, called from jitted JAX code through XLA's FFI (see parrot/engine/kernels/__init__.py).
//
// parrot_qmatmul: y[T, N] = x[T, K] (float32) times the transpose of a block-quantized weight W[N, K]
// kept as GGUF stores it: each of the N rows is K/32 blocks of 32 weights (Q8_0: f16 scale + 32 int8;
// Q4_0: f16 scale + 16 bytes of nibbles, value d * (q - 8); Q4_1: f16 scale, f16 minimum + 16 bytes of
// nibbles, value d * q + m). Each block is dequantized exactly to float32 in registers and multiplied by
// the float32 activations: the result is the float32 product with the dequantized matrix (up to the
// order of the additions), while the weights are read in their quantized size. Output rows are split
// into chunks that XLA's intra-op threads take in turn.
//
// Three codes multiply (`parrot_matmul_select` chooses; the best the CPU has by default): the AVX2 code
// below (every x86-64 CPU with AVX2/FMA/F16C; generated tokens' rows asked for on 2 limbs in the integer
// sums of the VNNI code, from vpmaddubsw: avx2_int8.h, the same bits), AVX-512 VNNI for any number of rows (vnni_matmul.h: exact
// integer sums of the weights' integers and the activations' byte limbs, so a row's result is the same bits
// in any batch; with 2 limbs and many rows, the tokens in lanes and 16-bit products; Intel since Cascade
// Lake, AMD since Zen 4), and on CPUs with AMX-INT8 (Intel Sapphire
// Rapids and later) VNNI up to 16 rows and the integer tile unit above (amx_matmul.h: the same integer
// sums and float32 steps), once the kernel has granted the tile state. The rows the `fill` operand flags
// (prompt tokens, in an engine that fills prompts in bfloat16) run in bfloat16 instead while an integer
// code runs: on AMX's bf16 tiles (amx_bf16.h) or, without them, with AVX512-BF16's pair products
// (avx512_bf16.h); `parrot_bf16_enable(0)` keeps them exact.
//
// parrot_paged_decode: one query token per sequence attending to its keys and values read in place
// from the paged KV cache ([Hkv, pages, page_size, D] per layer), optionally with a shared prefix read
// through the same pages (the cascade layout of parrot/engine/batch.py). Online softmax in float32; the
// products in float32, or in bfloat16 pairs for the engine's bfloat16 mode on CPUs with AVX512-BF16
// (decode_bf16.h).
//
// parrot_paged_prefill: a prefill step's query tokens attending causally to their sequences' keys and
// values read in place from the same caches (prefill_attention.h).
//
// parrot_sample: one token per row of logits (temperature, top-k, top-p, min-p and a uniform number per
// row; the argmax where the temperature is 0), each row on one thread (sampler.h).
//
// parrot_logprobs: raw log probabilities of rows of logits, at a target token and for the most likely
// tokens, each row on one thread (logprobs.h).

#include <immintrin.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#include "aligned.h"
#include "avx2_int8.h"
#include "logprobs.h"
#include "team.h"
#include "sampler.h"
#include "tiled_rows.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PARROT_VNNI 1
#include "vnni_matmul.h"
#else
#define PARROT_VNNI 0
#endif
#if PARROT_VNNI && defined(__AVX512BF16__)
#define PARROT_AVX512_BF16 1
#include "avx512_bf16.h"
#else
#define PARROT_AVX512_BF16 0
#endif
#if PARROT_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define PARROT_AMX 1
#include "amx_matmul.h"
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PARROT_AMX_BF16 1
#include "amx_bf16.h"
#else
#define PARROT_AMX_BF16 0
#endif
#else
#define PARROT_AMX_BF16 0
#define PARROT_AMX 0
#endif

namespace ffi = xla::ffi;

// The library is built from this file as several translation units at once (kernels/__init__.py: `UNITS`),
// each compiled with some of PARROT_PART_Q8_0, PARROT_PART_Q4_0, PARROT_PART_Q4_1 (the products of one block
// type: most of the compile time) and PARROT_PART_REST (the entry points and every other kernel); a unit
// with none of them holds everything.
#if !defined(PARROT_PART_Q8_0) && !defined(PARROT_PART_Q4_0) && !defined(PARROT_PART_Q4_1) && \
    !defined(PARROT_PART_REST)
#define PARROT_PART_Q8_0 1
#define PARROT_PART_Q4_0 1
#define PARROT_PART_Q4_1 1
#define PARROT_PART_REST 1
#endif

// ---- switches: one of each in the library, whichever units read them ---------------------------------
namespace parrot_switch {

// `hot`: a call of a decode step of up to kHotRows rows (short calls back to back, little of XLA's own work
// between them), whose chunks the kernels' own helper threads (team.h) take where they can (see
// parrot_team_enable). Other calls use XLA's pool: prompt chunks' (long calls, with XLA's own threads busy
// between them, where a spinning helper only took time from them: 0.88-0.95x the time of a 64- or 512-token
// prefill on a 2-core Zen 4) and larger batches' (long enough for the pool's helpers).
inline std::atomic<bool> g_team{true};

// The quantized product's code (see parrot_matmul_select) and whether rows asked for in bf16 take AMX's
// bf16 tiles (see parrot_bf16_enable).
enum MatmulPath : int { kPathAvx2 = 0, kPathVnni = 1, kPathAmx = 2 };
inline std::atomic<int> g_path{kPathAvx2};
inline std::atomic<bool> g_bf16{true};
inline std::atomic<bool> g_decode_bf16{true};  // see parrot_decode_bf16_enable

// amx::few_rows for 5-8 decode rows and amx::tiled_rows from 9 (below) on (the default) or off (VNNI below
// 16 rows, the tiles from the tiled copy from 16, as before them; a same-process comparison, the same bits):
// parrot_amx_few_enable.
inline std::atomic<bool> g_amx_few{true};

// Whether the AVX2 code multiplies generated tokens' rows on 2 limbs in integers (avx2_int8.h) where it is
// asked for 2 limbs: on (the default; parrot_avx2_int8_enable) or float32 with the dequantized weights.
inline std::atomic<bool> g_avx2_int8{true};

inline std::atomic<bool> g_tiled{true};  // see parrot_tiled_enable

}  // namespace parrot_switch

// ---- the products of one block type, each defined in the unit of its PARROT_PART_* --------------------
namespace parrot_part {

struct Product {  // parrot_qmatmul's operands (QMatmulImpl)
  const float* x;
  const int32_t* fill;
  int64_t T, K;
  const uint8_t* w;
  const uint8_t* wt;
  float* y;
  int64_t N;
  int limbs;
  bool swiglu;
};

void qmatmul_q8_0(ffi::ThreadPool& pool, const Product& p);
void qmatmul_q4_0(ffi::ThreadPool& pool, const Product& p);
void qmatmul_q4_1(ffi::ThreadPool& pool, const Product& p);

}  // namespace parrot_part

namespace {

using namespace parrot_switch;  // NOLINT: the switches read as before

// ---- work splitting over XLA's intra-op thread pool --------------------------------------------------
// Chunks are claimed from a shared counter by the calling thread and by helper tasks. The caller only
// waits for chunks some thread has claimed, so a helper that starts late (or never) cannot block it; the
// shared state lives on the heap because a late helper may still run after the caller has returned.
struct Split {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t chunks = 0;
};

// rows (tokens, sequences) up to which a product or sampler call is hot (at 64 rows a decode step took as
// long or longer with the team: its calls are long enough for the pool's helpers)
constexpr int64_t kHotRows = 32;

template <typename F>
void parallel_chunks(ffi::ThreadPool& pool, int64_t chunks, F&& body, bool hot = false) {
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (chunks <= 1 || threads <= 1) {
    for (int64_t c = 0; c < chunks; ++c) body(c);
    return;
  }
  if (hot && g_team.load(std::memory_order_relaxed)) {
    if (team::Team* t = team::get(static_cast<int>(threads) - 1); t != nullptr && t->run(chunks, body)) return;
  }
  auto split = std::make_shared<Split>();
  split->chunks = chunks;
  auto work = [split, &body]() {
    for (;;) {
      int64_t c = split->next.fetch_add(1);
      if (c >= split->chunks) return;
      body(c);
      split->done.fetch_add(1, std::memory_order_release);
    }
  };
  // helpers copy `split`; `body` is only touched for claimed chunks, all finished before we return
  int64_t helpers = std::min<int64_t>(threads, chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([split, work]() mutable { work(); });
  }
  work();
  // the last chunks are in other threads' hands: spin briefly, then yield (a busy machine may have
  // descheduled them, and spinning would take their core)
  for (int spins = 0; split->done.load(std::memory_order_acquire) < chunks; ++spins) {
    if (spins < 4096) _mm_pause();
    else std::this_thread::yield();
  }
}

// Two kinds of chunks in one hand-out of helpers: every chunk of the first kind is done before any of the
// second starts. A thread that finds no first-kind chunk left waits for those others hold (they are running
// them), then takes second-kind chunks; the caller returns once every chunk is done. As parallel_chunks, a
// helper only touches `first` or `second` for chunks it claimed.
template <typename F1, typename F2>
void parallel_phases(ffi::ThreadPool& pool, int64_t n1, F1&& first, int64_t n2, F2&& second) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (threads <= 1 || std::max(n1, n2) <= 1) {
    for (int64_t c = 0; c < n1; ++c) first(c);
    for (int64_t c = 0; c < n2; ++c) second(c);
    return;
  }
  auto one = std::make_shared<Split>(), two = std::make_shared<Split>();
  one->chunks = n1, two->chunks = n2;
  auto wait = [](const Split& s) {  // spin briefly, then yield (see parallel_chunks)
    for (int spins = 0; s.done.load(std::memory_order_acquire) < s.chunks; ++spins) {
      if (spins < 4096) _mm_pause();
      else std::this_thread::yield();
    }
  };
  auto work = [one, two, &first, &second, wait]() {
    for (int64_t c; (c = one->next.fetch_add(1)) < one->chunks;) {
      first(c);
      one->done.fetch_add(1, std::memory_order_release);
    }
    wait(*one);
    for (int64_t c; (c = two->next.fetch_add(1)) < two->chunks;) {
      second(c);
      two->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min(threads, std::max(n1, n2)) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work]() mutable { work(); });
  work();
  wait(*two);
}

// ---- block formats ----------------------------------------------------------------------------------
enum QType : int32_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

template <int Q>
struct Block;

template <>
struct Block<kQ8_0> {
  static constexpr int kBytes = 34;
  // w[c] = weights 8c..8c+7 of the block, as float32
  static inline void ints(const uint8_t* b, __m256 q[4]) {
    for (int c = 0; c < 4; ++c) {
      __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * c));
      q[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    }
  }
  static inline float scale(const uint8_t* b) { return f16(b); }
  static inline float offset(const uint8_t*) { return 0.f; }
  static inline void dequant(const uint8_t* b, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(scale(b));
    ints(b, w);
    for (int c = 0; c < 4; ++c) w[c] = _mm256_mul_ps(w[c], d);
  }
};

// nibble layout shared by Q4_0 / Q4_1: weight j < 16 is the low nibble of byte j, weight j >= 16 the
// high nibble of byte j - 16
inline void nibbles(const uint8_t* q, __m256 out[4]) {
  const __m256i mask = _mm256_set1_epi32(0x0F);
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));
  out[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, mask));
  out[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
  out[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
  out[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}

template <>
struct Block<kQ4_0> {
  static constexpr int kBytes = 18;
  static inline void ints(const uint8_t* b, __m256 q[4]) { nibbles(b + 2, q); }
  static inline float scale(const uint8_t* b) { return f16(b); }
  static inline float offset(const uint8_t* b) { return -8.0f * f16(b); }
  static inline void dequant(const uint8_t* b, __m256 w[4]) {
    const __m256 vd = _mm256_set1_ps(scale(b)), vm = _mm256_set1_ps(offset(b));
    ints(b, w);
    for (int c = 0; c < 4; ++c) w[c] = _mm256_fmadd_ps(w[c], vd, vm);
  }
};

template <>
struct Block<kQ4_1> {
  static constexpr int kBytes = 20;
  static inline void ints(const uint8_t* b, __m256 q[4]) { nibbles(b + 4, q); }
  static inline float scale(const uint8_t* b) { return f16(b); }
  static inline float offset(const uint8_t* b) { return f16(b + 2); }
  static inline void dequant(const uint8_t* b, __m256 w[4]) {
    const __m256 vd = _mm256_set1_ps(scale(b)), vm = _mm256_set1_ps(offset(b));
    ints(b, w);
    for (int c = 0; c < 4; ++c) w[c] = _mm256_fmadd_ps(w[c], vd, vm);
  }
};

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One activation row (decode at batch 1): y[r] for RR weight rows. Each block is dequantized exactly
// (d * q, plus Q4_1's minimum) and multiplied into one accumulator per row; the rows of a tile are
// interleaved so that the memory stream has several rows in flight.
#ifndef PARROT_HINT
#define PARROT_HINT _MM_HINT_T0
#endif
#ifndef PARROT_PF
#define PARROT_PF 8192
#endif
constexpr int64_t kPrefetch = PARROT_PF;

template <int Q, int RR>
inline void gemv_tile(const float* x, const uint8_t* w, int64_t ldw, int64_t blocks, float* y) {
  __m256 acc[RR];
  for (int r = 0; r < RR; ++r) acc[r] = _mm256_setzero_ps();
  // the tile's rows are contiguous: stream the bytes `kPrefetch` ahead of the ones being read (rows
  // are short, 612 bytes for K = 576, so the hardware prefetcher alone barely starts before each ends)
  const uint8_t* ahead = w + kPrefetch;
  for (int64_t b = 0; b < blocks; ++b) {
#if PARROT_PF
    for (int l = 0; l < RR * Block<Q>::kBytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + l), PARROT_HINT);
    ahead += RR * Block<Q>::kBytes;
#endif
    __m256 xv[4];
    for (int c = 0; c < 4; ++c) xv[c] = _mm256_loadu_ps(x + b * 32 + 8 * c);
    for (int r = 0; r < RR; ++r) {
      __m256 wv[4];  // the block's weights, dequantized exactly (as the panel and XLA's path do)
      Block<Q>::dequant(w + r * ldw + b * Block<Q>::kBytes, wv);
      for (int c = 0; c < 4; ++c) acc[r] = _mm256_fmadd_ps(xv[c], wv[c], acc[r]);
    }
  }
  for (int r = 0; r < RR; ++r) y[r] = hsum(acc[r]);
}

// A few activation rows (small decode batches): each weight row's blocks are dequantized once and
// multiplied into up to 8 activation rows, in the same order as `gemv_tile` (so a sequence decodes the
// same tokens alone and in a batch of up to kSmallT). Dequantizing into a panel first (below) costs more
// than the products themselves when T is this small.
#ifndef PARROT_SMALL_T
#define PARROT_SMALL_T 16
#endif
constexpr int64_t kSmallT = PARROT_SMALL_T;

template <int Q, int TT>
inline void gemv_multi(const float* x, int64_t K, const uint8_t* w, int64_t blocks, float* y, int64_t ldy) {
  static_assert(TT >= 1 && TT <= 8);
  // named accumulators (with an array GCC keeps them on the stack, see `micro`)
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t b = 0; b < blocks; ++b) {
#if PARROT_PF
    _mm_prefetch(reinterpret_cast<const char*>(w + b * Block<Q>::kBytes + kPrefetch), PARROT_HINT);
#endif
    __m256 wv[4];  // dequantized once for every activation row, the same products as `gemv_tile`
    Block<Q>::dequant(w + b * Block<Q>::kBytes, wv);
    const float* xb = x + b * 32;
#define PARROT_DOT(i)                                                  \
  if constexpr (TT > i) {                                              \
    const float* xi = xb + i * K;                                      \
    a##i = _mm256_fmadd_ps(_mm256_loadu_ps(xi), wv[0], a##i);          \
    a##i = _mm256_fmadd_ps(_mm256_loadu_ps(xi + 8), wv[1], a##i);      \
    a##i = _mm256_fmadd_ps(_mm256_loadu_ps(xi + 16), wv[2], a##i);     \
    a##i = _mm256_fmadd_ps(_mm256_loadu_ps(xi + 24), wv[3], a##i);     \
  }
    PARROT_DOT(0) PARROT_DOT(1) PARROT_DOT(2) PARROT_DOT(3) PARROT_DOT(4) PARROT_DOT(5) PARROT_DOT(6) PARROT_DOT(7)
#undef PARROT_DOT
  }
#define PARROT_OUT(i) \
  if constexpr (TT > i) y[i * ldy] = hsum(a##i);
  PARROT_OUT(0) PARROT_OUT(1) PARROT_OUT(2) PARROT_OUT(3) PARROT_OUT(4) PARROT_OUT(5) PARROT_OUT(6) PARROT_OUT(7)
#undef PARROT_OUT
}

template <int Q>
inline void gemv_multi_rows(const float* x, int64_t T, int64_t K, const uint8_t* wrow, int64_t blocks, float* y,
                            int64_t N) {
  for (int64_t t = 0; t < T; t += 8) {
    const float* xt = x + t * K;
    float* yt = y + t * N;
    switch (std::min<int64_t>(8, T - t)) {
      case 8: gemv_multi<Q, 8>(xt, K, wrow, blocks, yt, N); break;
      case 7: gemv_multi<Q, 7>(xt, K, wrow, blocks, yt, N); break;
      case 6: gemv_multi<Q, 6>(xt, K, wrow, blocks, yt, N); break;
      case 5: gemv_multi<Q, 5>(xt, K, wrow, blocks, yt, N); break;
      case 4: gemv_multi<Q, 4>(xt, K, wrow, blocks, yt, N); break;
      case 3: gemv_multi<Q, 3>(xt, K, wrow, blocks, yt, N); break;
      case 2: gemv_multi<Q, 2>(xt, K, wrow, blocks, yt, N); break;
      default: gemv_multi<Q, 1>(xt, K, wrow, blocks, yt, N); break;
    }
  }
}

// Several activation rows: 16 weight rows at a time are dequantized once into a k-major panel
// P[k][16] (reused by every activation row), then a register-blocked product in the manner of BLIS:
// 6 activation rows x 16 outputs in 12 accumulators, one broadcast activation and two panel loads per k.
constexpr int kNR = 16, kMR = 6;

inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// Dequantize `rows` (<= 16) weight rows into the panel P[K][16]; missing rows are zeros.
template <int Q>
void pack_panel(const uint8_t* w, int64_t ldw, int64_t blocks, int rows, float* P) {
  alignas(32) float tile[kNR][32];
  const uint8_t* next = w + kNR * ldw;  // the next panel's rows (contiguous): fetched while this one packs
  for (int64_t b = 0; b < blocks; ++b) {
#if PARROT_PF
    for (int l = 0; l < kNR * Block<Q>::kBytes; l += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(next + b * kNR * Block<Q>::kBytes + l), PARROT_HINT);
    }
#endif
    for (int r = 0; r < kNR; ++r) {
      __m256 wv[4];
      if (r < rows) {
        Block<Q>::dequant(w + r * ldw + b * Block<Q>::kBytes, wv);
      } else {
        wv[0] = wv[1] = wv[2] = wv[3] = _mm256_setzero_ps();
      }
      for (int c = 0; c < 4; ++c) _mm256_store_ps(tile[r] + 8 * c, wv[c]);
    }
    float* out = P + b * 32 * kNR;
    for (int c = 0; c < 4; ++c) {
      for (int g = 0; g < 2; ++g) {
        __m256 v[8];
        for (int i = 0; i < 8; ++i) v[i] = _mm256_load_ps(tile[g * 8 + i] + 8 * c);
        transpose8(v);  // v[j]: weight k = 8c + j of the 8 rows
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + (8 * c + j) * kNR + 8 * g, v[j]);
      }
    }
  }
}

// (Named accumulators: with arrays of vectors GCC stores every accumulator to the stack each iteration.)
template <int MR>
inline void micro(const float* x, int64_t K, const float* P, float* y, int64_t ldy, int cols) {
  static_assert(MR >= 1 && MR <= kMR);
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
         c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(P + k * kNR), b1 = _mm256_loadu_ps(P + k * kNR + 8);
    __m256 a;
#define PARROT_ROW(i)                                \
  if constexpr (MR > i) {                            \
    a = _mm256_broadcast_ss(x + i * K + k);          \
    c##i##0 = _mm256_fmadd_ps(a, b0, c##i##0);       \
    c##i##1 = _mm256_fmadd_ps(a, b1, c##i##1);       \
  }
    PARROT_ROW(0) PARROT_ROW(1) PARROT_ROW(2) PARROT_ROW(3) PARROT_ROW(4) PARROT_ROW(5)
#undef PARROT_ROW
  }
  alignas(32) float tmp[kMR][kNR];
#define PARROT_OUT(i)                                \
  if constexpr (MR > i) {                            \
    _mm256_store_ps(tmp[i], c##i##0);                \
    _mm256_store_ps(tmp[i] + 8, c##i##1);            \
  }
  PARROT_OUT(0) PARROT_OUT(1) PARROT_OUT(2) PARROT_OUT(3) PARROT_OUT(4) PARROT_OUT(5)
#undef PARROT_OUT
  for (int i = 0; i < MR; ++i) std::memcpy(y + i * ldy, tmp[i], sizeof(float) * cols);
}

// rows [n0, n1) of the output, every activation row
// `prompt`: the rows are prompt tokens', always multiplied through the panel, whose sums run in one order for a
// row whatever the number of rows (the few-row products below sum in another): a prompt token's bits then do not
// depend on the size of the chunk it was fed in.
template <int Q>
void qmatmul_rows(const float* x, int64_t T, int64_t K, const uint8_t* w, int64_t n0, int64_t n1, float* y,
                  int64_t N, bool prompt = false) {
  const int64_t blocks = K / 32, ldw = blocks * Block<Q>::kBytes;
  if (T == 1 && !prompt) {
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) gemv_tile<Q, 4>(x, w + n * ldw, ldw, blocks, y + n);
    for (; n < n1; ++n) gemv_tile<Q, 1>(x, w + n * ldw, ldw, blocks, y + n);
    return;
  }
  if (T <= kSmallT && !prompt) {
    for (int64_t n = n0; n < n1; ++n) gemv_multi_rows<Q>(x, T, K, w + n * ldw, blocks, y + n, N);
    return;
  }
  thread_local aligned::vector<float> panel;
  panel.resize(K * kNR);
  for (int64_t n = n0; n < n1; n += kNR) {
    const int cols = static_cast<int>(std::min<int64_t>(kNR, n1 - n));
    pack_panel<Q>(w + n * ldw, ldw, blocks, cols, panel.data());
    int64_t t = 0;
    for (; t + kMR <= T; t += kMR) micro<kMR>(x + t * K, K, panel.data(), y + t * N + n, N, cols);
    switch (T - t) {
      case 5: micro<5>(x + t * K, K, panel.data(), y + t * N + n, N, cols); break;
      case 4: micro<4>(x + t * K, K, panel.data(), y + t * N + n, N, cols); break;
      case 3: micro<3>(x + t * K, K, panel.data(), y + t * N + n, N, cols); break;
      case 2: micro<2>(x + t * K, K, panel.data(), y + t * N + n, N, cols); break;
      case 1: micro<1>(x + t * K, K, panel.data(), y + t * N + n, N, cols); break;
      default: break;
    }
  }
}

// How rows asked for in bf16 are multiplied: on AMX's bf16 tiles, with AVX512-BF16's pair products (where
// an integer path runs and there are no bf16 tiles), or exactly (the bf16 products switched off, the AVX2
// code, or neither unit).
enum FillPath : int { kFillExact = 0, kFillAmxTiles = 1, kFillAvx512 = 2 };
inline int fill_path() {
  if (!g_bf16.load(std::memory_order_relaxed)) return kFillExact;
  const int path = g_path.load(std::memory_order_relaxed);
  if (PARROT_AMX_BF16 && path == kPathAmx) return kFillAmxTiles;
  if (PARROT_AVX512_BF16 && path != kPathAvx2) return kFillAvx512;
  return kFillExact;
}

// More activation rows than this go to AMX's tiles on the AMX path.
constexpr int64_t amx_vnni_rows() {
#if PARROT_AMX
  return amx::kVnniRows;
#else
  return 16;
#endif
}

// The most rows amx::few_rows takes (0 without AMX).
constexpr int64_t amx_few_rows() {
#if PARROT_AMX
  return amx::kFewMaxRows;
#else
  return 0;
#endif
}

// From this many activation rows, where the weights' tiled copy is given, the AMX path multiplies them on
// the tiles from that copy (amx::tiled_rows). `benchmarks.products` on a 2-core Xeon, against the VNNI
// code: 1.0-1.16x at 16 rows, 1.17-1.24x at 32, 1.23-1.39x at 64. One thread's 16 x 30 blocks of Q4_1 /
// Q8_0 / Q4_0 weights from L2 on a Xeon 6: 1.2-1.4x VNNI's speed from 9 rows up, 2 or 3 limbs (8 rows 1.2x,
// 4 rows 0.65-0.88x).
constexpr int64_t kAmxTiledMinRows = 9;
constexpr int64_t kAmxTiledMinRowsAlone = 16;  // the same, with amx::few_rows off (parrot_amx_few_enable)
// From this many rows up to amx::kFewMaxRows, on 2 limbs, the AMX path takes every limb of every row as a row
// of one tile (amx::few_rows): in the same harness 1.1x VNNI's speed at 5 rows, 1.3-1.45x at 8 (tiled_rows
// 1.2x); `benchmarks.products` (30 layers' weights from memory, in turns) 0.97-1.05x at 5 rows, 1.0-1.16x
// at 6-8; at 4 rows VNNI was as fast or 2-9% faster.
constexpr int64_t kAmxFewMinRows = 5;

// From this many activation rows, 2-limb products put the tokens in lanes (vnni::lanes_rows): 4-7% off a
// decode step at batch 32-64 on a Zen 4. Below, its 16 token lanes are too empty to pay for widening the
// weights, and the weight rows in lanes (vnni::rows) are as fast or faster (batch 16: 0.93x).
constexpr int64_t kLanesMinRows = 32;
// ... and where the weights' tiled copy is given (vnni::rows<F, true>): at 32 rows that took 0.95x the time of
// the tokens in lanes in a decode step on a Zen 4, at 64 rows as long within the noise.
constexpr int64_t kLanesMinRowsTiled = 64;

// Linux hands a process AMX's tile data state only on request.
inline bool request_tiles() {
#if PARROT_AMX
  return amx::request_permission();
#else
  return false;
#endif
}

// The block format of a QType, for the kernels' templates.
template <int Q>
using Format = std::conditional_t<Q == kQ8_0, tiled::Q8_0, std::conditional_t<Q == kQ4_0, tiled::Q4_0, tiled::Q4_1>>;

#if PARROT_VNNI
// `wt`: the same weights tiled for the lanes (tiled::tile_rows), or null
// `on_tiles`: the AMX tile path from the tiled copy that takes the rows, if any (packed for VNNI; rows packed
// for the tiles go to amx::rows); `few`: the few rows' pack (kAmxFew).
enum AmxRows { kAmxNone, kAmxTiled, kAmxFew };
template <class F>
void int8_rows(const vnni::XPack& xp, const uint8_t* w, const uint8_t* wt, int64_t n0, int64_t n1, float* y,
               int64_t N, AmxRows on_tiles = kAmxNone, const uint8_t* few = nullptr) {
#if PARROT_AMX
  if (xp.for_tiles) return amx::rows<F>(xp, w, n0, n1, y, N);
  if (on_tiles == kAmxTiled) return amx::tiled_rows<F>(xp, wt, n0, n1, y, N);
  if (on_tiles == kAmxFew) return amx::few_rows<F>(xp, few, wt, n0, n1, y, N);
#else
  (void)on_tiles, (void)few;
#endif
  if (xp.lanes) return vnni::lanes_rows<F>(xp, w, n0, n1, y, N);
  if (wt != nullptr) return vnni::rows<F, true>(xp, wt, n0, n1, y, N);
  vnni::rows<F>(xp, w, n0, n1, y, N);
}

#endif

// The product of rows x [T, K] (every row the same whatever rows share the call on the integer paths).
// `generated`: the rows are generated tokens' (the AVX2 code takes them on 2 limbs in integers, the same
// bits as VNNI's, where `limbs` is 2, from `wt` where given; prompt rows it multiplies in float32).
template <int Q>
void qmatmul(ffi::ThreadPool& pool, const float* x, int64_t T, int64_t K, const uint8_t* w, const uint8_t* wt,
             float* y, int64_t N, int limbs, bool generated = true) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // chunks of output rows small enough to spread over the threads, large enough to amortize claiming
#ifndef PARROT_CPT
#define PARROT_CPT 8
#endif
  int64_t rows = std::max<int64_t>(16, N / (threads * PARROT_CPT));
  rows = (rows + kNR - 1) / kNR * kNR;
  const int64_t chunks = (N + rows - 1) / rows;
#if PARROT_VNNI
  const int path = g_path.load(std::memory_order_relaxed);
  if (path != kPathAvx2) {
    thread_local vnni::XPack packed;  // this thread's; the helpers read it through `xp` until every chunk is done
    const vnni::XPack* xp = &packed;
    const bool few_on = g_amx_few.load(std::memory_order_relaxed);
    const bool amx_few = few_on && path == kPathAmx && wt != nullptr && limbs == 2 && T >= kAmxFewMinRows &&
                         T <= amx_few_rows();
    const bool amx_tiled = path == kPathAmx && wt != nullptr && !amx_few &&
                           T >= (few_on ? kAmxTiledMinRows : kAmxTiledMinRowsAlone);
    const bool tiles = path == kPathAmx && !amx_tiled && !amx_few && T > amx_vnni_rows();
    vnni::pack_x(x, T, K, packed, limbs, tiles,
                 !tiles && !amx_tiled && !amx_few && T >= (wt != nullptr ? kLanesMinRowsTiled : kLanesMinRows));
    const uint8_t* few = nullptr;
#if PARROT_AMX
    thread_local aligned::vector<uint8_t> few_pack;  // as `packed`
    if (amx_few) amx::pack_few(packed, few_pack), few = few_pack.data();
#endif
    const AmxRows on_tiles = amx_few ? kAmxFew : amx_tiled ? kAmxTiled : kAmxNone;
    parallel_chunks(pool, chunks, [&](int64_t c) {
      int8_rows<Format<Q>>(*xp, w, wt, c * rows, std::min(N, (c + 1) * rows), y, N, on_tiles, few);
    }, T <= kHotRows);
    return;
  }
#endif
  if (generated && limbs == 2 && g_avx2_int8.load(std::memory_order_relaxed)) {
    thread_local avx2i8::Packed packed;  // this thread's; the helpers read it until every chunk is done
    const avx2i8::Packed* xp = &packed;
    avx2i8::pack(x, T, K, packed, Format<Q>::kSigned);
    parallel_chunks(pool, chunks, [&](int64_t c) {
      avx2i8::rows<Format<Q>>(*xp, w, wt, c * rows, std::min(N, (c + 1) * rows), y, N);
    }, T <= kHotRows);
    return;
  }
  parallel_chunks(pool, chunks, [&](int64_t c) {
    qmatmul_rows<Q>(x, T, K, w, c * rows, std::min(N, (c + 1) * rows), y, N, !generated);
  }, T <= kHotRows);
}

// The output columns of one chunk of a bf16 product call: whole panels of `panel` columns, about four
// chunks a thread, at most `most` panels.
inline int64_t chunk_cols(ffi::ThreadPool& pool, int64_t ncols, int64_t panel, int64_t most = INT64_MAX) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  return panel * std::min(std::max<int64_t>(1, ncols / (panel * threads * 4)), most);
}

#if PARROT_AMX_BF16
// Rows asked for in bf16 on AMX's tiles (amxbf16::rows): the threads first make x's bfloat16 copy together,
// a pair of token tiles at a time, then take chunks of whole panels of the `ncols` output columns, about
// four a thread, in one hand-out of helpers (parallel_phases: a 512-token step ~2% faster than two);
// `out(n1)` is the output policy of a chunk ending at column n1 (amxbf16::Plain, SwigluOut).
template <int Q, class MakeOut>
void amx_fill(ffi::ThreadPool& pool, const float* x, int64_t T, int64_t K, const uint8_t* w, const uint8_t* wt,
              int64_t ncols, MakeOut out) {
  const int64_t cols = chunk_cols(pool, ncols, decltype(out(int64_t{0}))::kCols, amxbf16::panels_per_call(K));
  const int64_t Tp = amxbf16::padded_rows(T);
  thread_local aligned::vector<uint16_t> packed;  // the caller's; helpers read it until every chunk is done
  packed.resize(Tp * K);
  uint16_t* xb = packed.data();
  auto pack = [&](int64_t c) { amxbf16::pack_x_rows(x, T, K, 32 * c, 32 * c + 32, xb); };
  auto product = [&](int64_t c) {
    const int64_t n1 = std::min(ncols, (c + 1) * cols);
    amxbf16::rows<Format<Q>>(xb, T, K, w, wt, c * cols, n1, out(n1));
  };
  parallel_phases(pool, Tp / 32, pack, (ncols + cols - 1) / cols, product);
}
#endif

// The product in bfloat16 (fill_path(): AMX's bf16 tiles or AVX512-BF16): chunks of whole panels of weight
// rows (32 on AMX's tiles, 48 for AVX512-BF16), taken in turn, each dequantized from the weights' tiled copy
// `wt` where given (the same values in less time), else from the GGUF rows.
template <int Q>
void qmatmul_bf16(ffi::ThreadPool& pool, int how, const float* x, int64_t T, int64_t K, const uint8_t* w,
                  const uint8_t* wt, float* y, int64_t N) {
#if PARROT_AMX_BF16
  if (how == kFillAmxTiles)
    return amx_fill<Q>(pool, x, T, K, w, wt, N, [&](int64_t n1) { return amxbf16::Plain{y, N, T, n1}; });
#endif
#if PARROT_AVX512_BF16
  const int64_t cols = chunk_cols(pool, N, 16 * avx512bf16::kPanels);
  thread_local aligned::vector<uint32_t> pairs;  // the caller's; helpers read it until every chunk is done
  avx512bf16::pack_x(x, T, K, pairs);
  const uint32_t* xb = pairs.data();
  parallel_chunks(pool, (N + cols - 1) / cols, [&](int64_t c) {
    avx512bf16::rows<Format<Q>>(xb, T, K, w, wt, c * cols, std::min(N, (c + 1) * cols), y, N);
  });
#else
  (void)pool, (void)how, (void)x, (void)T, (void)K, (void)w, (void)wt, (void)y, (void)N;
#endif
}

// Rows with fill[t] > 0 in bfloat16 where fill_path() says so, the others exactly: each kind gathered into
// a call of its own, so a row's result depends only on its own kind. The AVX2 code takes both kinds
// exactly, and still apart: its sums are the same row by row only up to kSmallT rows, so a mixed step's
// generated rows must not share a call with its prompt rows. The trailing rows with fill[t] < 0 (a step's
// padding: the batch's tokens come first) are not computed: their outputs are zeros.
template <int Q>
void qmatmul_rows_of_kind(ffi::ThreadPool& pool, const float* x, const int32_t* fill, int64_t T, int64_t K,
                          const uint8_t* w, const uint8_t* wt, float* y, int64_t N, int limbs) {
  const int64_t all = T;
  while (T > 0 && fill[T - 1] < 0) --T;
  if (T < all) std::memset(y + T * N, 0, sizeof(float) * (all - T) * N);
  if (T == 0) return;
  const int how = fill_path();
  const bool avx2 = !PARROT_VNNI || g_path.load(std::memory_order_relaxed) == kPathAvx2;
  int64_t nfill = 0;
  if (how != kFillExact || avx2)
    for (int64_t t = 0; t < T; ++t) nfill += fill[t] > 0;
  if (nfill == T && how != kFillExact) return qmatmul_bf16<Q>(pool, how, x, T, K, w, wt, y, N);
  if (nfill > 0 && nfill < T) {
    thread_local aligned::vector<float> xs, ys;
    for (int kind = 0; kind < 2; ++kind) {
      const int64_t n = kind ? nfill : T - nfill;
      xs.resize(n * K), ys.resize(n * N);
      for (int64_t t = 0, i = 0; t < T; ++t)
        if ((fill[t] > 0) == (kind == 1)) std::memcpy(xs.data() + K * i++, x + K * t, 4 * K);
      if (kind && how != kFillExact) qmatmul_bf16<Q>(pool, how, xs.data(), n, K, w, wt, ys.data(), N);
      else qmatmul<Q>(pool, xs.data(), n, K, w, wt, ys.data(), N, limbs, kind == 0);
      for (int64_t t = 0, i = 0; t < T; ++t)
        if ((fill[t] > 0) == (kind == 1)) std::memcpy(y + N * t, ys.data() + N * i++, 4 * N);
    }
    return;
  }
  qmatmul<Q>(pool, x, T, K, w, wt, y, N, limbs, nfill == 0);
}

// Tiles a [N, K] matrix of `qtype` for the integer codes' lanes into `out` (tiled::tile_rows; null: only
// sizes it); returns its bytes.
int64_t tile_rows(int32_t qtype, const uint8_t* w, int64_t N, int64_t K, uint8_t* out) {
  auto tile = [&](auto format) -> int64_t {
    using F = decltype(format);
    if (out != nullptr) tiled::tile_rows<F>(w, N, K, out);
    return tiled::tiled_bytes<F>(N, K);
  };
  switch (qtype) {
    case kQ8_0: return tile(tiled::Q8_0{});
    case kQ4_0: return tile(tiled::Q4_0{});
    case kQ4_1: return tile(tiled::Q4_1{});
  }
  return -1;
}

template <int Q>
void qmatmul_swiglu(ffi::ThreadPool& pool, const float* x, const int32_t* fill, int64_t T, int64_t K,
                    const uint8_t* w, const uint8_t* wt, float* y, int64_t N, int limbs);

// `wt`: the same weights tiled for the integer codes' lanes (parrot_tile_rows), read by the products of
// generated rows (VNNI's of few rows, the AVX2 code's on 2 limbs: the same bits as from `w`); empty: none.
// `swiglu`: y [T, N / 2] is silu(gate) * up of the product (qmatmul_swiglu); else y [T, N] is the product.
ffi::Error QMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::U8> wt,
                       ffi::Buffer<ffi::S32> fill, ffi::ResultBuffer<ffi::F32> y, int32_t qtype, int32_t limbs,
                       int32_t swiglu) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("qmatmul: x and w must be 2-D");
  const int64_t T = xd[0], K = xd[1], N = wd[0];
  if (K % 32) return ffi::Error::InvalidArgument("qmatmul: K must be a multiple of 32");
  const int64_t blocks = K / 32;
  const int64_t bytes = qtype == kQ8_0 ? 34 : qtype == kQ4_0 ? 18 : qtype == kQ4_1 ? 20 : -1;
  if (bytes < 0) return ffi::Error::InvalidArgument("qmatmul: unknown block type");
  if (limbs != 2 && limbs != 3) return ffi::Error::InvalidArgument("qmatmul: limbs must be 2 or 3");
  if (wd[1] != blocks * bytes) return ffi::Error::InvalidArgument("qmatmul: weight row size does not match K");
  if (fill.element_count() != static_cast<size_t>(T))
    return ffi::Error::InvalidArgument("qmatmul: fill must hold one flag per row of x");
  auto yd = y->dimensions();
  if (swiglu && N % 2) return ffi::Error::InvalidArgument("qmatmul: a fused gate|up matrix has an even number of rows");
  if (yd.size() != 2 || yd[0] != T || yd[1] != (swiglu ? N / 2 : N))
    return ffi::Error::InvalidArgument("qmatmul: y must be [T, N] ([T, N / 2] with swiglu)");
  const int32_t* fp = fill.typed_data();
  const float* xp = x.typed_data();
  const uint8_t* wp = w.typed_data();
  const uint8_t* tp = nullptr;
  if (wt.element_count() > 0) {
    if (static_cast<int64_t>(wt.element_count()) != tile_rows(qtype, nullptr, N, K, nullptr))
      return ffi::Error::InvalidArgument("qmatmul: the tiled weights' size does not match w");
    if (g_tiled.load(std::memory_order_relaxed)) tp = wt.typed_data();
  }
  const parrot_part::Product p{xp, fp, T, K, wp, tp, y->typed_data(), N, limbs, swiglu != 0};
  switch (qtype) {
    case kQ8_0: parrot_part::qmatmul_q8_0(pool, p); break;
    case kQ4_0: parrot_part::qmatmul_q4_0(pool, p); break;
    default: parrot_part::qmatmul_q4_1(pool, p); break;
  }
  return ffi::Error::Success();
}

// The product of block type Q (parrot_part::qmatmul_*).
template <int Q>
void product(ffi::ThreadPool& pool, const parrot_part::Product& p) {
  if (p.swiglu) qmatmul_swiglu<Q>(pool, p.x, p.fill, p.T, p.K, p.w, p.wt, p.y, p.N, p.limbs);
  else qmatmul_rows_of_kind<Q>(pool, p.x, p.fill, p.T, p.K, p.w, p.wt, p.y, p.N, p.limbs);
}

// ---- paged decode attention ----------------------------------------------------------------------
// exp(x) for float32 lanes (Cephes' polynomial after range reduction by ln 2; ~1 ulp); lanes below
// -87.3 give 0. One body for 8 lanes (AVX2) and 16 (AVX-512), through these overloads.
inline __m256 vset(__m256, float a) { return _mm256_set1_ps(a); }
inline __m256 vmul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
inline __m256 vadd(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
inline __m256 vdiv(__m256 a, __m256 b) { return _mm256_div_ps(a, b); }
inline __m256 vfma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 vfnma(__m256 a, __m256 b, __m256 c) { return _mm256_fnmadd_ps(a, b, c); }
inline __m256 vround(__m256 a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline __m256 vclamp(__m256 a, __m256 lo, __m256 hi) { return _mm256_min_ps(_mm256_max_ps(a, lo), hi); }
inline __m256 vpow2(__m256 fx) {  // 2^fx for integral fx
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23));
}
inline __m256 vzero_below(__m256 y, __m256 x, __m256 lo) { return _mm256_and_ps(y, _mm256_cmp_ps(x, lo, _CMP_GE_OQ)); }
inline __m256 vtimes_pow2(__m256 y, __m256 fx) { return vmul(y, vpow2(fx)); }  // y 2^fx, fx integral in [-126, 127]
#ifdef __AVX512F__
inline __m512 vset(__m512, float a) { return _mm512_set1_ps(a); }
inline __m512 vmul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
inline __m512 vadd(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
inline __m512 vdiv(__m512 a, __m512 b) { return _mm512_div_ps(a, b); }
inline __m512 vfma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512 vfnma(__m512 a, __m512 b, __m512 c) { return _mm512_fnmadd_ps(a, b, c); }
inline __m512 vround(__m512 a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline __m512 vclamp(__m512 a, __m512 lo, __m512 hi) { return _mm512_min_ps(_mm512_max_ps(a, lo), hi); }
inline __m512 vzero_below(__m512 y, __m512 x, __m512 lo) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), y); }
// y 2^fx in one instruction: the same product, rounded once, as vmul(y, vpow2(fx))
inline __m512 vtimes_pow2(__m512 y, __m512 fx) { return _mm512_scalef_ps(y, fx); }
#endif

// exp of N vectors in place (the constants and polynomial of sampler.h's exp), each step applied to all of
// them before the next: N independent chains interleaved in program order (one exp after another leaves
// its chain's latency bare). The operations per lane do not depend on N.
template <int N, typename V>
inline void vexp_n(V x[N]) {
  const V hi = vset(x[0], 88.3762626647949f), lo = vset(x[0], -87.3365447504019f);
  V in[N], fx[N], y[N];
  for (int i = 0; i < N; ++i) in[i] = x[i], x[i] = vclamp(x[i], lo, hi);
  for (int i = 0; i < N; ++i) fx[i] = vround(vmul(x[i], vset(x[i], sampler::kLog2e)));
  for (int i = 0; i < N; ++i) x[i] = vfnma(fx[i], vset(x[i], sampler::kLn2Hi), x[i]);
  for (int i = 0; i < N; ++i) x[i] = vfnma(fx[i], vset(x[i], sampler::kLn2Lo), x[i]);
  for (int i = 0; i < N; ++i) y[i] = vset(x[i], sampler::kExpPoly[0]);
  for (int j = 1; j < 6; ++j)
    for (int i = 0; i < N; ++i) y[i] = vfma(y[i], x[i], vset(x[i], sampler::kExpPoly[j]));
  for (int i = 0; i < N; ++i) y[i] = vfma(y[i], vmul(x[i], x[i]), vadd(x[i], vset(x[i], 1.0f)));
  for (int i = 0; i < N; ++i) x[i] = vzero_below(vtimes_pow2(y[i], fx[i]), in[i], lo);
}

template <typename V>
inline V vexp(V x) {
  vexp_n<1>(&x);
  return x;
}
inline __m256 exp256(__m256 x) { return vexp(x); }

// ---- silu(gate) * up of the fused gate|up product ----------------------------------------------------
// out[j] = silu(g[j]) u[j] = g[j] / (1 + exp(-g[j])) u[j] for n values, sixteen lanes at a time on AVX-512,
// then eight, a short tail through a buffer: every element by the same operations (vexp's are the same
// per lane at either width) wherever it falls.
template <typename V>
inline V silu_times(V g, V u) {
  const V e = vexp(vmul(g, vset(g, -1.f)));
  return vmul(vdiv(g, vadd(vset(g, 1.f), e)), u);
}
inline void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  int64_t j = 0;
#ifdef __AVX512F__
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(out + j, silu_times(_mm512_loadu_ps(g + j), _mm512_loadu_ps(u + j)));
#endif
  auto eight = [](__m256 gv, __m256 uv) { return silu_times(gv, uv); };
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(out + j, eight(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j)));
  if (j < n) {
    alignas(32) float gb[8] = {}, ub[8] = {}, ob[8];
    std::memcpy(gb, g + j, 4 * (n - j));
    std::memcpy(ub, u + j, 4 * (n - j));
    _mm256_store_ps(ob, eight(_mm256_load_ps(gb), _mm256_load_ps(ub)));
    std::memcpy(out + j, ob, 4 * (n - j));
  }
}

#if PARROT_AMX_BF16
// The fused product's outputs on AMX's tiles: a panel holds 16 gate rows and the up rows of the same
// columns (f further on), and its tiles go through silu_mul to out [T, f]: the gate|up product itself is
// never written.
struct SwigluOut {
  float* out;
  int64_t f, T, n1;  // out's width (the gate's rows), its rows, the end of the call's columns
  static constexpr int64_t kCols = 16;
  void halves(int64_t n, int64_t r0[2], int64_t r1[2]) const { r0[0] = n, r0[1] = f + n, r1[0] = n1, r1[1] = f + n1; }
  void finish(int64_t t, int64_t n) const {
    alignas(64) float g[256], u[256];
    const int64_t cols = std::min<int64_t>(16, n1 - n);
    for (int half = 0; half < 2; ++half) {  // tokens t.. (tiles 0, 1), then t + 16.. (tiles 2, 3)
      const int64_t t0 = t + 16 * half;
      if (t0 >= T) return;
      amxbf16::tile_store(2 * half, g, 64);
      amxbf16::tile_store(2 * half + 1, u, 64);
      for (int64_t i = 0; i < std::min<int64_t>(16, T - t0); ++i)
        silu_mul(g + 16 * i, u + 16 * i, out + (t0 + i) * f + n, cols);
    }
  }
};
#endif

// y [T, N / 2] = silu(gate) * up of x times a fused gate|up matrix (W's first N / 2 rows the gate's, the
// rest the up's). Where every row is a prompt's and AMX's bf16 tiles multiply them, in the tiles'
// epilogue (SwigluOut); otherwise the product as parrot_qmatmul computes it, into a scratch, then silu_mul:
// the same function of the same products either way.
template <int Q>
void qmatmul_swiglu(ffi::ThreadPool& pool, const float* x, const int32_t* fill, int64_t T, int64_t K,
                    const uint8_t* w, const uint8_t* wt, float* y, int64_t N, int limbs) {
  const int64_t f = N / 2;
#if PARROT_AMX_BF16
  if (fill_path() == kFillAmxTiles) {
    int64_t rows = T;  // the trailing padding rows (fill < 0) are not computed: zeros
    while (rows > 0 && fill[rows - 1] < 0) --rows;
    bool prompts = rows > 0;
    for (int64_t t = 0; t < rows && prompts; ++t) prompts = fill[t] > 0;
    if (prompts) {
      if (rows < T) std::memset(y + rows * f, 0, sizeof(float) * (T - rows) * f);
      amx_fill<Q>(pool, x, rows, K, w, f % 16 == 0 ? wt : nullptr, f,  // the up rows' tiles start at f
                  [&](int64_t n1) { return SwigluOut{y, f, rows, n1}; });
      return;
    }
  }
#endif
  thread_local aligned::vector<float> full;  // the caller's; helpers read it until every chunk is done
  full.resize(T * N);
  float* yf = full.data();
  qmatmul_rows_of_kind<Q>(pool, x, fill, T, K, w, wt, yf, N, limbs);
  parallel_chunks(pool, (T + 7) / 8, [&](int64_t c) {
    for (int64_t t = 8 * c; t < std::min(T, 8 * c + 8); ++t) silu_mul(yf + t * N, yf + t * N + f, y + t * f, f);
  }, T <= kHotRows);
}

// eight KV elements as float32: float32 as they are, bfloat16 (stored as uint16) widened exactly
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Eight float8_e4m3fn values (the bytes of an fp8 cache) as float32, exactly: each byte's sign, exponent and
// mantissa moved to a float16's places (e4m3's exponent bias is 7, float16's 15: that float16 is the value
// times 2^-8, subnormals included), widened, times 256. (0x7F, e4m3's NaN, reads 480: caches never hold it.)
inline __m256 load8(const uint8_t* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}

template <typename KV>
inline float dot(const float* a, const KV* b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
  return hsum(acc);
}

// One sequence, one KV head: its `group` query heads attend to `n` tokens read page by page.
struct HeadState {
  static constexpr int kMaxGroup = 16;
  float m[kMaxGroup], l[kMaxGroup];
};

// A page's rows [cnt, D] as float32: float32 pages as they are, bfloat16 pages widened into `buf`.
inline const float* rows_f32(const float* p, int64_t, int64_t, float*) { return p; }
inline const float* rows_f32(const uint16_t* p, int64_t cnt, int64_t D, float* buf) {
  for (int64_t i = 0; i < cnt * D; i += 8) _mm256_store_ps(buf + i, load8(p + i));
  return buf;
}
inline const float* rows_f32(const uint8_t* p, int64_t cnt, int64_t D, float* buf) {
  for (int64_t i = 0; i < cnt * D; i += 8) _mm256_store_ps(buf + i, load8(p + i));
  return buf;
}

#ifndef PARROT_PAGES_AHEAD
#define PARROT_PAGES_AHEAD 2
#endif
constexpr int64_t kPagesAhead = PARROT_PAGES_AHEAD;  // pages fetched ahead of the one being read

// Into L2, not L1: on a 2-core AMD EPYC (Zen 4) the T0 hint left decode attention over pages from memory
// at half the speed (64 sequences x 2,048 tokens, a layer: 7.1 -> 4.0 ms with T1; pages from L3: the same).
inline void prefetch_rows(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T1);
}

// Eight dot products of one query row with eight key rows (float32, stride D), as one vector: eight
// independent accumulators (a single chain of D/8 multiply-adds per score would leave the CPU waiting
// on each one's latency), reduced by a tree of horizontal adds.
inline __m256 dot8(const float* q, const float* k, int64_t D) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 x = _mm256_load_ps(q + i);
    a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + i), a0);
    a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + D + i), a1);
    a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 2 * D + i), a2);
    a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 3 * D + i), a3);
    a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 4 * D + i), a4);
    a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 5 * D + i), a5);
    a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 6 * D + i), a6);
    a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 7 * D + i), a7);
  }
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// acc[0, D) = acc * corr + sum_t p[t] * v[t] over `cnt` value rows (float32, stride D). D % 64 == 0:
// 64 dimensions at a time in eight registers, one multiply-add chain each.
inline void weighted_rows(const float* p, const float* v, int64_t cnt, int64_t D, float corr, float* acc) {
  const __m256 c = _mm256_set1_ps(corr);
  for (int64_t i = 0; i < D; i += 64) {
    float* a = acc + i;
    __m256 o0 = _mm256_mul_ps(_mm256_loadu_ps(a), c), o1 = _mm256_mul_ps(_mm256_loadu_ps(a + 8), c),
           o2 = _mm256_mul_ps(_mm256_loadu_ps(a + 16), c), o3 = _mm256_mul_ps(_mm256_loadu_ps(a + 24), c),
           o4 = _mm256_mul_ps(_mm256_loadu_ps(a + 32), c), o5 = _mm256_mul_ps(_mm256_loadu_ps(a + 40), c),
           o6 = _mm256_mul_ps(_mm256_loadu_ps(a + 48), c), o7 = _mm256_mul_ps(_mm256_loadu_ps(a + 56), c);
    for (int64_t t = 0; t < cnt; ++t) {
      const __m256 w = _mm256_broadcast_ss(p + t);
      const float* r = v + t * D + i;
      o0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r), o0);
      o1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 8), o1);
      o2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 16), o2);
      o3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 24), o3);
      o4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 32), o4);
      o5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 40), o5);
      o6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 48), o6);
      o7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 56), o7);
    }
    _mm256_storeu_ps(a, o0), _mm256_storeu_ps(a + 8, o1), _mm256_storeu_ps(a + 16, o2);
    _mm256_storeu_ps(a + 24, o3), _mm256_storeu_ps(a + 32, o4), _mm256_storeu_ps(a + 40, o5);
    _mm256_storeu_ps(a + 48, o6), _mm256_storeu_ps(a + 56, o7);
  }
}

// The lines of the page kPagesAhead ahead (its keys, then its values), fetched a piece at a time between a
// page's phases (`piece()`, kPieces calls) rather than in one burst with the page before: on a 2-core AMD EPYC
// (Zen 3), 64 prefetches at once (a 2 KB key page and a 2 KB value page) left decode attention over pages from
// memory 1.1-1.3x slower than four pieces of 16 (one core, a C++ harness; benchmarks.decode_attention).
struct Fetch {
  static constexpr int kPieces = 4;
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t kbytes = 0, total = 0, step = 0, done = 0;
  void piece() {
    const int64_t end = std::min(total, done + step);
    for (int64_t i = done; i < end; i += 64) _mm_prefetch(i < kbytes ? k + i : v + (i - kbytes), _MM_HINT_T1);
    done = end;
  }
};

// Calls page(k, v, cnt) for each page of the tokens [0, n) in order (its keys and values, cnt tokens).
// Pages lie anywhere in the pool, so the next pages' keys and values are fetched while one is read: the
// next kPagesAhead pages before the first one, then each page kPagesAhead ahead before its page is read, or,
// where `page` takes a Fetch as its fourth argument, by that page in pieces (`Fetch`).
template <typename KT, typename VT, typename F>
inline void for_each_page(const KT* kbase, const VT* vbase, const int32_t* pages, int64_t n, int64_t page_size,
                          int64_t D, F&& page) {
  constexpr bool spread = std::is_invocable_v<F&, const KT*, const VT*, int64_t, Fetch&>;
  const int64_t kbytes = page_size * D * static_cast<int64_t>(sizeof(KT));
  const int64_t vbytes = page_size * D * static_cast<int64_t>(sizeof(VT));
  for (int64_t start = 0; start < n; start += page_size) {
    Fetch fetch;
    for (int64_t ahead = start == 0 ? 1 : kPagesAhead; ahead <= kPagesAhead; ++ahead) {
      if (start + ahead * page_size >= n) break;
      const int64_t next = pages[start / page_size + ahead];
      if (spread && ahead == kPagesAhead) {
        const int64_t total = kbytes + vbytes;
        fetch = {reinterpret_cast<const char*>(kbase + next * page_size * D),
                 reinterpret_cast<const char*>(vbase + next * page_size * D), kbytes, total,
                 (total / Fetch::kPieces + 63) / 64 * 64, 0};
        continue;
      }
      prefetch_rows(kbase + next * page_size * D, kbytes);
      prefetch_rows(vbase + next * page_size * D, vbytes);
    }
    const int64_t at = pages[start / page_size] * page_size * D;
    if constexpr (spread) page(kbase + at, vbase + at, std::min(page_size, n - start), fetch);
    else page(kbase + at, vbase + at, std::min(page_size, n - start));
  }
}

// The online softmax of one head's page of scores s[0, cnt) (eight at a time): the running maximum `m` and sum
// `l` updated, s turned into the probabilities; returns the factor the head's accumulator is rescaled by.
inline float page_softmax(float* s, int64_t cnt, float& m, float& l) {
  float mx = m;
  int64_t t = 0;
  if (cnt >= 8) {
    __m256 m8 = _mm256_loadu_ps(s);
    for (t = 8; t + 8 <= cnt; t += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + t));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    mx = std::max(mx, _mm_cvtss_f32(m4));
  }
  for (; t < cnt; ++t) mx = std::max(mx, s[t]);
  const float corr = mx == m ? 1.f : std::exp(m - mx);  // exp(-inf) = 0 on the first page
  m = mx;
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 sum8 = _mm256_setzero_ps();
  for (t = 0; t + 8 <= cnt; t += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmx));
    _mm256_storeu_ps(s + t, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = hsum(sum8);
  for (; t < cnt; ++t) sum += (s[t] = std::exp(s[t] - mx));
  l = l * corr + sum;
  return corr;
}

// One page's update of a sequence's `group` query heads (scaled queries `qs`) against its keys and values
// `kp`, `vp` ([cnt, D] float32): scores, the running maximum and sum, the weighted values into `acc`.
inline void page_update(const float* qs, int group, int64_t D, const float* kp, const float* vp, int64_t cnt,
                        HeadState& st, float* acc) {
  alignas(32) float s[HeadState::kMaxGroup][64];
  for (int h = 0; h < group; ++h) {
    const float* qh = qs + h * D;
    int64_t t = 0;
    for (; t + 8 <= cnt; t += 8) _mm256_store_ps(s[h] + t, dot8(qh, kp + t * D, D));
    for (; t < cnt; ++t) s[h][t] = dot(qh, kp + t * D, D);
    const float corr = page_softmax(s[h], cnt, st.m[h], st.l[h]);
    float* a = acc + h * D;
    if (D % 64 == 0) {
      weighted_rows(s[h], vp, cnt, D, corr, a);
      continue;
    }
    const __m256 vc = _mm256_set1_ps(corr);
    for (int64_t i = 0; i < D; i += 8) {
      __m256 o = _mm256_mul_ps(_mm256_loadu_ps(a + i), vc);
      for (t = 0; t < cnt; ++t) o = _mm256_fmadd_ps(_mm256_broadcast_ss(s[h] + t), _mm256_loadu_ps(vp + t * D + i), o);
      _mm256_storeu_ps(a + i, o);
    }
  }
}

#include "decode_pairs.h"

// Whether decode attention reads bfloat16 pages as pairs (decode_pairs.h): builds without AVX-512 (which
// widen pages to 16 lanes), bfloat16 keys and values, whole groups of 16 dimensions and of 4 rows a page.
// The queries then come in pair order and the outputs go out in it.
template <typename KT, typename VT>
constexpr bool kPairPages = std::is_same_v<KT, uint16_t> && std::is_same_v<VT, uint16_t>;
template <typename KT, typename VT>
inline bool uses_pairs(int64_t D, int64_t page_size) {
#ifdef __AVX512F__
  (void)D, (void)page_size;
  return false;
#else
  return kPairPages<KT, VT> && pairs_fit(D) && page_size % 4 == 0;
#endif
}

// Attend to the tokens [0, n) of the pages `pages` (each `page_size` tokens of [page_size, D] rows) for
// `members` sequences at once (their scaled queries `qs[j]`, states `st[j]` and outputs `acc[j]`): a
// sequence's own pages (one member), or a shared prefix read once for all the sequences forked from it.
// Pages lie anywhere in the pool, so the next page's keys and values are fetched while this one is read;
// each page is widened to float32 once for every head that reads it (bfloat16 pages where `uses_pairs`: read
// as pairs, widened in registers). Each member's arithmetic is the same whatever the other members are.
template <typename KT, typename VT>
void attend_pages(const float* const* qs, int members, int group, int64_t D, const KT* kbase, const VT* vbase,
                  const int32_t* pages, int64_t n, int64_t page_size, HeadState* const* st, float* const* acc) {
  if constexpr (kPairPages<KT, VT>) {
    if (uses_pairs<KT, VT>(D, page_size)) {
      for_each_page(kbase, vbase, pages, n, page_size, D, [&](const KT* kp, const VT* vp, int64_t cnt, Fetch& ahead) {
        ahead.piece();
        ahead.piece();
        for (int j = 0; j < members; ++j) pair_page_update(qs[j], group, D, kp, vp, cnt, *st[j], acc[j]);
        ahead.piece();
        ahead.piece();
      });
      return;
    }
  }
  alignas(32) float kbuf[64 * 256], vbuf[64 * 256];  // one page (page_size <= 64, D <= 256)
  for_each_page(kbase, vbase, pages, n, page_size, D, [&](const KT* kpage, const VT* vpage, int64_t cnt,
                                                          Fetch& ahead) {
    ahead.piece();
    const float* kp = rows_f32(kpage, cnt, D, kbuf);
    ahead.piece();
    const float* vp = rows_f32(vpage, cnt, D, vbuf);
    ahead.piece();
    for (int j = 0; j < members; ++j) page_update(qs[j], group, D, kp, vp, cnt, *st[j], acc[j]);
    ahead.piece();
  });
}

#ifdef __AVX512F__
// The same attention with 16-wide vectors, for CPUs with AVX-512 and head sizes that are multiples of 16.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline __m512 load16(const uint8_t* p) {  // float8_e4m3fn bytes, as load8 reads them
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}

inline __m512 exp512(__m512 x) { return vexp(x); }

// Sixteen dot products of one query row with sixteen key rows (stride D) as one vector: sixteen
// independent accumulators, reduced by a transposing tree of adds.
inline __m512 dot16(const float* q, const float* k, int64_t D) {
  __m512 a[16];
  for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += 16) {
    const __m512 x = _mm512_loadu_ps(q + i);
    for (int j = 0; j < 16; ++j) a[j] = _mm512_fmadd_ps(x, _mm512_loadu_ps(k + j * D + i), a[j]);
  }
  __m512 b[8], c[4], d[2];
  for (int j = 0; j < 8; ++j)  // lanes: pairs of keys (2j, 2j + 1) interleaved
    b[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d x = _mm512_castps_pd(b[2 * j]), y = _mm512_castps_pd(b[2 * j + 1]);
    c[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // c[j]: per 128-bit lane L, keys 4j..4j+3 summed over that lane's dimensions
  for (int j = 0; j < 2; ++j)
    d[j] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0x88), _mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0xDD));
  // d[j]'s 128-bit lanes: keys 8j..8j+3 (over lanes 0, 1 of c), the same (lanes 2, 3), keys 8j+4..8j+7 likewise
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

// One page's update (as page_update, 16 lanes): `kbuf`, `vbuf` hold its keys and values in float32, the
// key rows past cnt up to a multiple of 16 zero.
inline void page_update512(const float* qs, int group, int64_t D, const float* kbuf, const float* vbuf, int64_t cnt,
                           HeadState& st, float* acc) {
  alignas(64) float s[HeadState::kMaxGroup][64];
  const int64_t padded = (cnt + 15) / 16 * 16;  // rows past cnt: zeros (their scores are masked)
  // In phases over all the heads, so that their dependency chains (scores -> maximum -> exponentials ->
  // sums) overlap instead of running one head after the other.
  for (int h = 0; h < group; ++h) {  // scores
    for (int64_t t = 0; t < padded; t += 16) {
      const __mmask16 valid = static_cast<__mmask16>(cnt - t >= 16 ? 0xFFFF : (1u << (cnt - t)) - 1);
      _mm512_store_ps(s[h] + t, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, dot16(qs + h * D, kbuf + t * D, D)));
    }
  }
  alignas(64) float corr[HeadState::kMaxGroup];
  for (int h = 0; h < group; ++h) {  // maxima; the running sums rescaled where the maximum grew
    __m512 m = _mm512_load_ps(s[h]);
    for (int64_t t = 16; t < padded; t += 16) m = _mm512_max_ps(m, _mm512_load_ps(s[h] + t));
    const float mx = std::max(st.m[h], _mm512_reduce_max_ps(m));
    corr[h] = mx == st.m[h] ? 1.f : std::exp(st.m[h] - mx);  // exp(-inf) = 0 on the first page
    st.m[h] = mx;
  }
  for (int h = 0; h < group; ++h) {  // probabilities
    const __m512 mx = _mm512_set1_ps(st.m[h]);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < padded; t += 16) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_load_ps(s[h] + t), mx));
      _mm512_store_ps(s[h] + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    st.l[h] = st.l[h] * corr[h] + _mm512_reduce_add_ps(sum);
  }
  // values: up to four heads at a time over each 64 dimensions, each value row loaded once for them
  for (int h0 = 0; h0 < group; h0 += 4) {
    const int hn = std::min(4, group - h0);
    for (int64_t i = 0; i < D; i += 64) {
      const int64_t w = std::min<int64_t>(64, D - i);
      __m512 o[4][4];
      for (int k = 0; k < 4; ++k)
        for (int r = 0; r < 4; ++r)
          o[k][r] = k < hn && r * 16 < w ? _mm512_mul_ps(_mm512_loadu_ps(acc + (h0 + k) * D + i + 16 * r),
                                                         _mm512_set1_ps(corr[h0 + k]))
                                         : _mm512_setzero_ps();
      for (int64_t t = 0; t < cnt; ++t) {
        const float* row = vbuf + t * D + i;
        __m512 v[4];
        for (int r = 0; r < 4; ++r) v[r] = r * 16 < w ? _mm512_loadu_ps(row + 16 * r) : _mm512_setzero_ps();
        for (int k = 0; k < 4; ++k) {
          if (k >= hn) break;
          const __m512 pw = _mm512_set1_ps(s[h0 + k][t]);
          for (int r = 0; r < 4; ++r) o[k][r] = _mm512_fmadd_ps(pw, v[r], o[k][r]);
        }
      }
      for (int k = 0; k < hn; ++k)
        for (int r = 0; r < 4; ++r)
          if (r * 16 < w) _mm512_storeu_ps(acc + (h0 + k) * D + i + 16 * r, o[k][r]);
    }
  }
}

template <typename KT, typename VT>
void attend_pages512(const float* const* qs, int members, int group, int64_t D, const KT* kbase, const VT* vbase,
                     const int32_t* pages, int64_t n, int64_t page_size, HeadState* const* st, float* const* acc) {
  alignas(64) float kbuf[64 * 256], vbuf[64 * 256];
  for_each_page(kbase, vbase, pages, n, page_size, D, [&](const KT* kp, const VT* vp, int64_t cnt) {
    const int64_t padded = (cnt + 15) / 16 * 16;
    for (int64_t i = 0; i < cnt * D; i += 16) {
      _mm512_store_ps(kbuf + i, load16(kp + i));
      _mm512_store_ps(vbuf + i, load16(vp + i));
    }
    for (int64_t i = cnt * D; i < padded * D; i += 16) _mm512_store_ps(kbuf + i, _mm512_setzero_ps());
    for (int j = 0; j < members; ++j) page_update512(qs[j], group, D, kbuf, vbuf, cnt, *st[j], acc[j]);
  });
}
#endif

#ifndef PARROT_PREFIX_MEMBERS
#define PARROT_PREFIX_MEMBERS 8
#endif
constexpr int kPrefixMembers = PARROT_PREFIX_MEMBERS;  // sequences that read one widened prefix page in turn

#include "decode_bf16.h"
// The dimension an accumulator position of the bf16 pair products holds (bf16_dim within each 64).
inline int64_t bf16_dim_of(int64_t i) {
#if PARROT_DECODE_BF16
  return (i & ~int64_t{63}) + bf16_dim(static_cast<int>(i & 63));
#else
  return i;
#endif
}

// Pages [0, n) for `members` sequences (see attend_pages), on 16 lanes where the CPU and D allow.
template <typename KT, typename VT>
void attend(const float* const* qs, int members, int group, int64_t D, const KT* kb, const VT* vb,
            const int32_t* pages, int64_t n, int64_t S, HeadState* const* st, float* const* acc) {
#ifdef __AVX512F__
  if (D % 16 == 0) return attend_pages512(qs, members, group, D, kb, vb, pages, n, S, st, acc);
#endif
  attend_pages(qs, members, group, D, kb, vb, pages, n, S, st, acc);
}

// Two phases. (1) The shared prefix, per KV head and up to kPrefixMembers of the sequences in it: each
// page is read and widened once for all of them. (2) Each sequence's own pages, per (sequence, KV head),
// from the state the prefix left. A sequence's arithmetic is the same whether or not others share its
// prefix: the same page updates in the same order. `bf16` (the engine's bfloat16 mode; taken over a
// bfloat16 cache where D % 64 == 0 and the CPU has AVX512-BF16): products in bfloat16 (decode_bf16.h).
template <typename KT, typename VT>
void paged_decode(ffi::ThreadPool& pool, const float* qp, const KT* kc, const VT* vc, const int32_t* bt,
                  const int32_t* off, const int32_t* lens, const int32_t* pp, int64_t plen, const int32_t* inp,
                  float* op, int64_t B, int64_t H, int64_t D, int64_t Hkv, int64_t P, int64_t S, int64_t maxp,
                  float scale, bool bf16) {
  const int group = static_cast<int>(H / Hkv);
  const int64_t head_stride = P * S * D;
  thread_local aligned::vector<float> qbuf;  // the queries, scaled (dot8 loads them aligned)
  qbuf.resize(B * H * D);
  float* qs = qbuf.data();
  for (int64_t i = 0; i < B * H * D; ++i) qs[i] = qp[i] * scale;
  const bool pairs = uses_pairs<KT, VT>(D, S);  // queries in pair order, outputs put back in order
  if (pairs) {
    alignas(32) float row[256];
    for (int64_t r = 0; r < B * H; ++r) {
      float* x = qs + r * D;
      for (int64_t i = 0; i < D; ++i) row[i] = x[pair_dim(i)];
      std::copy(row, row + D, x);
    }
  }
  // bf16: the scaled queries rounded to bfloat16, as pairs (this thread's buffer: helpers read it through
  // `qp2`, as they read `qs`, until every chunk is done)
  thread_local aligned::vector<uint32_t> qpairs;
  constexpr bool bf16_pages = std::is_same_v<KT, uint16_t> && std::is_same_v<VT, uint16_t>;
  bf16 = bf16 && PARROT_DECODE_BF16 && bf16_pages && D % 64 == 0 && D <= 256;
  uint32_t* qp2 = nullptr;
  (void)qp2;  // read only where the CPU has AVX512-BF16
#if PARROT_DECODE_BF16
  if (bf16) {
    qpairs.resize(B * H * D / 2);
    qp2 = qpairs.data();
    for (int64_t i = 0; i < B * H * D; i += 32) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_load_ps(qs + i + 16), _mm512_load_ps(qs + i));
      _mm512_store_si512(qp2 + i / 2, (__m512i)v);
    }
  }
#endif
  std::vector<HeadState> states(B * Hkv);
  for (HeadState& st : states)
    for (int h = 0; h < group; ++h) st.m[h] = -INFINITY, st.l[h] = 0.f;
  std::fill(op, op + B * H * D, 0.f);
  // KV head g's pages [0, n) for the sequences seqs[0..m)
  auto attend_seqs = [&](const int64_t* seqs, int m, int64_t g, const int32_t* pages, int64_t n) {
    const float* q[kPrefixMembers];
    HeadState* st[kPrefixMembers];
    float* acc[kPrefixMembers];
    for (int j = 0; j < m; ++j) {
      q[j] = qs + (seqs[j] * H + g * group) * D;
      st[j] = &states[seqs[j] * Hkv + g];
      acc[j] = op + (seqs[j] * H + g * group) * D;
    }
#if PARROT_DECODE_BF16
    if constexpr (bf16_pages) {
      if (bf16) {
        const uint32_t* qb[kPrefixMembers];
        for (int j = 0; j < m; ++j) qb[j] = qp2 + (seqs[j] * H + g * group) * D / 2;
        return attend_bf16(qb, m, group, D, kc + g * head_stride, vc + g * head_stride, pages, n, S, st, acc);
      }
    }
#endif
    attend(q, m, group, D, kc + g * head_stride, vc + g * head_stride, pages, n, S, st, acc);
  };
  std::vector<int64_t> members;  // the sequences that read the prefix
  for (int64_t b = 0; b < B && plen > 0; ++b)
    if (inp[b] && lens[b] > 0) members.push_back(b);
  const int64_t member_chunks = (static_cast<int64_t>(members.size()) + kPrefixMembers - 1) / kPrefixMembers;
  if (member_chunks > 0) {
    parallel_chunks(pool, member_chunks * Hkv, [&](int64_t task) {
      const int64_t g = task % Hkv, c = task / Hkv;
      const int m = static_cast<int>(std::min<int64_t>(kPrefixMembers, members.size() - c * kPrefixMembers));
      attend_seqs(members.data() + c * kPrefixMembers, m, g, pp, plen);
    }, B <= kHotRows);
  }
  parallel_chunks(pool, B * Hkv, [&](int64_t task) {
    const int64_t b = task / Hkv, g = task % Hkv;
    float* acc = op + (b * H + g * group) * D;
    const int64_t len = lens[b];
    if (len <= 0) return;
    HeadState* st = &states[b * Hkv + g];
    const int64_t own = std::min<int64_t>(len - off[b], maxp * S);
    if (own > 0) attend_seqs(&b, 1, g, bt + b * maxp, own);
    alignas(64) float ordered[256];
    for (int h = 0; h < group; ++h) {
      const float inv = st->l[h] > 0.f ? 1.f / st->l[h] : 0.f;
      float* a = acc + h * D;
      if (!pairs && !bf16) {
        for (int64_t i = 0; i < D; ++i) a[i] *= inv;
        continue;
      }
      // the accumulators' dimensions as the pair code (pair_dim) or the bf16 products (bf16_dim_of) hold them
      for (int64_t i = 0; i < D; ++i) ordered[pairs ? pair_dim(i) : bf16_dim_of(i)] = a[i];
      for (int64_t i = 0; i < D; ++i) a[i] = ordered[i] * inv;
    }
  }, B <= kHotRows);
}

#include "prefill_attention.h"

// Calls f(keys, values) with the caches' data as their element types: float32, bfloat16 (as bfloat16 or as the
// uint16 bit patterns the engine stores) or float8 e4m3fn (uint8 bit patterns), both alike or bfloat16 keys
// with float8 values (`--v-dtype fp8`); anything else is an error naming `what`.
template <class F>
ffi::Error with_cache_types(ffi::AnyBuffer k, ffi::AnyBuffer v, const char* what, F&& f) {
  auto kind = [](ffi::DataType t) {
    return t == ffi::DataType::F32 ? 0 : (t == ffi::DataType::BF16 || t == ffi::DataType::U16) ? 1
                                                                                                : t == ffi::DataType::U8 ? 2 : -1;
  };
  const int kk = kind(k.element_type()), vk = kind(v.element_type());
  const void* kd = k.untyped_data();
  const void* vd = v.untyped_data();
  if (kk == 0 && vk == 0) f(static_cast<const float*>(kd), static_cast<const float*>(vd));
  else if (kk == 1 && vk == 1) f(static_cast<const uint16_t*>(kd), static_cast<const uint16_t*>(vd));
  else if (kk == 2 && vk == 2) f(static_cast<const uint8_t*>(kd), static_cast<const uint8_t*>(vd));
  else if (kk == 1 && vk == 2) f(static_cast<const uint16_t*>(kd), static_cast<const uint8_t*>(vd));
  else
    return ffi::Error::InvalidArgument(std::string(what) + ": the caches must be float32, bfloat16 or float8 bits, "
                                       "both alike or bfloat16 keys with float8 values");
  return ffi::Error::Success();
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                           ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> block_tables,
                           ffi::Buffer<ffi::S32> kv_offset, ffi::Buffer<ffi::S32> kv_lens,
                           ffi::Buffer<ffi::S32> prefix_pages, ffi::Buffer<ffi::S32> prefix_len,
                           ffi::Buffer<ffi::S32> in_prefix, ffi::ResultBuffer<ffi::F32> out, float scale,
                           int32_t bf16) {
  auto qd = q.dimensions(), kd = k_cache.dimensions(), bd = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || bd.size() != 2)
    return ffi::Error::InvalidArgument("paged_decode: q [B,H,D], caches [Hkv,P,S,D], block_tables [B,P]");
  const int64_t B = qd[0], H = qd[1], D = qd[2], Hkv = kd[0], P = kd[1], S = kd[2], maxp = bd[1];
  const int64_t Pp = prefix_pages.dimensions()[0];
  if (kd[3] != D || D % 8 || D > 256 || H % Hkv || H / Hkv > HeadState::kMaxGroup || S > 64 || bd[0] != B)
    return ffi::Error::InvalidArgument("paged_decode: unsupported shapes");
  const int64_t plen = Pp > 0 ? std::min<int64_t>(prefix_len.typed_data()[0], Pp * S) : 0;
  const int32_t* args[] = {block_tables.typed_data(), kv_offset.typed_data(), kv_lens.typed_data(),
                           prefix_pages.typed_data(), in_prefix.typed_data()};
  // bf16: products in bfloat16 pairs where both caches are bfloat16 (paged_decode decides)
  const bool pairs = bf16 != 0 && g_decode_bf16.load(std::memory_order_relaxed);
  return with_cache_types(k_cache, v_cache, "paged_decode", [&](const auto* kc, const auto* vc) {
    paged_decode(pool, q.typed_data(), kc, vc, args[0], args[1], args[2], args[3], plen, args[4], out->typed_data(),
                 B, H, D, Hkv, P, S, maxp, scale, pairs);
  });
}

ffi::Error PagedPrefillImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                            ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> q_index, ffi::Buffer<ffi::S32> positions,
                            ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> kv_offset,
                            ffi::Buffer<ffi::S32> kv_lens, ffi::ResultBuffer<ffi::F32> out, float scale,
                            int32_t bf16) {
  auto qd = q.dimensions(), kd = k_cache.dimensions(), bd = block_tables.dimensions(), id = q_index.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || bd.size() != 2 || id.size() != 2)
    return ffi::Error::InvalidArgument("paged_prefill: q [T,H,D], caches [Hkv,P,S,D], q_index [B,Q], block_tables [B,P]");
  const int64_t T = qd[0], H = qd[1], D = qd[2], Hkv = kd[0], P = kd[1], S = kd[2], B = id[0], Q = id[1];
  if (kd[3] != D || D % 8 || H % Hkv || bd[0] != B || positions.dimensions()[0] != T)
    return ffi::Error::InvalidArgument("paged_prefill: unsupported shapes");
  // float8 pages: widened to bfloat16 for the bf16 codes (FillPath), else read as float32
  const int how = bf16 != 0 ? fill_path() : kFillExact;
  return with_cache_types(k_cache, v_cache, "paged_prefill", [&](const auto* kc, const auto* vc) {
    paged_prefill(pool, q.typed_data(), kc, vc, q_index.typed_data(), positions.typed_data(), block_tables.typed_data(),
                  kv_offset.typed_data(), kv_lens.typed_data(), out->typed_data(), T, H, D, Hkv, P, S, B, Q, bd[1],
                  scale, how);
  });
}

ffi::Error SampleImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> temperature,
                      ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::F32> top_p, ffi::Buffer<ffi::F32> min_p,
                      ffi::Buffer<ffi::F32> u, ffi::ResultBuffer<ffi::S32> out) {
  auto ld = logits.dimensions();
  if (ld.size() != 2) return ffi::Error::InvalidArgument("sample: logits [B, V]");
  const int64_t B = ld[0], V = ld[1];
  for (auto n : {temperature.element_count(), top_k.element_count(), top_p.element_count(), min_p.element_count(),
                 u.element_count()})
    if (static_cast<int64_t>(n) != B) return ffi::Error::InvalidArgument("sample: one parameter per row");
  if (V < 1) return ffi::Error::InvalidArgument("sample: an empty vocabulary");
  const float* x = logits.typed_data();
  int32_t* tokens = out->typed_data();
  parallel_chunks(pool, B, [&](int64_t b) {
    thread_local sampler::Scratch scratch;
    const sampler::Params p{temperature.typed_data()[b], top_k.typed_data()[b], top_p.typed_data()[b],
                            min_p.typed_data()[b], u.typed_data()[b]};
    tokens[b] = sampler::sample_row(x + b * V, V, p, scratch);
  }, B <= kHotRows);
  return ffi::Error::Success();
}

ffi::Error LogprobsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> targets,
                        ffi::Buffer<ffi::S32> want, ffi::ResultBuffer<ffi::F32> chosen,
                        ffi::ResultBuffer<ffi::S32> top_ids, ffi::ResultBuffer<ffi::F32> top_lp) {
  auto ld = logits.dimensions(), od = top_ids->dimensions();
  if (ld.size() != 2 || od.size() != 2) return ffi::Error::InvalidArgument("logprobs: logits [R, V], top [R, K]");
  const int64_t R = ld[0], V = ld[1], K = od[1];
  if (od[0] != R || static_cast<int64_t>(targets.element_count()) != R ||
      static_cast<int64_t>(want.element_count()) != R || K < 1 || V < 1)
    return ffi::Error::InvalidArgument("logprobs: one target and flag per row, K >= 1");
  const float* x = logits.typed_data();
  parallel_chunks(pool, R, [&](int64_t r) {
    float* lp = top_lp->typed_data() + r * K;
    int32_t* ids = top_ids->typed_data() + r * K;
    if (!want.typed_data()[r]) {  // a row that did not ask: zeros
      chosen->typed_data()[r] = 0.f;
      std::fill(lp, lp + K, 0.f);
      std::fill(ids, ids + K, 0);
      return;
    }
    thread_local logprobs::Scratch scratch;
    logprobs::row(x + r * V, V, targets.typed_data()[r], K, chosen->typed_data() + r, ids, lp, scratch);
  }, R <= kHotRows);
  return ffi::Error::Success();
}

// ---- one layer's operands out of every layer's -----------------------------------------------------
// A decode loop that runs its layers as a loop (one layer's code, not the model's) hands each call every
// layer's weights or caches and the index of the one to use: XLA passes pointers, nothing is copied.

// The layer index (an int32 scalar) checked against the number of layers.
ffi::ErrorOr<int64_t> picked_layer(ffi::Buffer<ffi::S32> layer, size_t operands, size_t per_layer) {
  if (layer.element_count() != 1 || per_layer == 0 || operands % per_layer || operands == 0)
    return ffi::Unexpected(ffi::Error::InvalidArgument("pick: one layer index and whole layers of operands"));
  const int64_t i = layer.typed_data()[0], n = static_cast<int64_t>(operands / per_layer);
  if (i < 0 || i >= n) return ffi::Unexpected(ffi::Error::InvalidArgument("pick: layer index out of range"));
  return i;
}

// parrot_qmatmul with layer `layer`'s weights: rest = L weights, then L tiled copies (empty: none).
ffi::Error QMatmulPickImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::S32> fill, ffi::RemainingArgs rest, ffi::ResultBuffer<ffi::F32> y,
                           int32_t qtype, int32_t limbs, int32_t swiglu) {
  auto i = picked_layer(layer, rest.size(), 2);
  if (!i.has_value()) return i.error();
  const size_t n = rest.size() / 2;
  auto w = rest.get<ffi::Buffer<ffi::U8>>(*i);
  auto wt = rest.get<ffi::Buffer<ffi::U8>>(n + *i);
  if (!w.has_value() || !wt.has_value()) return ffi::Error::InvalidArgument("qmatmul_pick: weights must be uint8");
  return QMatmulImpl(pool, x, *w, *wt, fill, y, qtype, limbs, swiglu);
}

// parrot_paged_decode over layer `layer`'s caches: rest = L key caches, then L value caches.
ffi::Error PagedDecodePickImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> kv_offset,
                               ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> prefix_pages,
                               ffi::Buffer<ffi::S32> prefix_len, ffi::Buffer<ffi::S32> in_prefix,
                               ffi::RemainingArgs rest, ffi::ResultBuffer<ffi::F32> out, float scale, int32_t bf16) {
  auto i = picked_layer(layer, rest.size(), 2);
  if (!i.has_value()) return i.error();
  auto k = rest.get<ffi::AnyBuffer>(*i);
  auto v = rest.get<ffi::AnyBuffer>(rest.size() / 2 + *i);
  if (!k.has_value() || !v.has_value()) return ffi::Error::InvalidArgument("paged_decode_pick: caches must be buffers");
  return PagedDecodeImpl(pool, q, *k, *v, block_tables, kv_offset, kv_lens, prefix_pages, prefix_len, in_prefix,
                         out, scale, bf16);
}

// float32 -> bfloat16 bit pattern, rounded to nearest even (NaNs stay NaNs): XLA's conversion.
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

// float32 -> float8_e4m3fn bit pattern of the value clipped to [-448, 448], rounded to nearest even: XLA's
// conversion of the clipped value (attention.write_kv; a NaN stays NaN, 0x7F with its sign). Below e4m3's
// smallest normal, 2^-6, the value is a whole number of 2^-9 (rounded to nearest even by the default
// rounding mode); above it, the float32's bits are rounded at its 20th bit and its exponent re-biased
// (127 -> 7).
inline uint8_t e4m3_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 24) & 0x80u;
  if (std::isnan(f)) return static_cast<uint8_t>(sign | 0x7Fu);
  float a = std::fabs(f);
  a = a < 448.f ? a : 448.f;
  if (a < 0.015625f) return static_cast<uint8_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 512.f)));
  uint32_t v;
  std::memcpy(&v, &a, 4);
  return static_cast<uint8_t>(sign | (((v + 0x7FFFFu + ((v >> 20) & 1u)) >> 20) - (120u << 3)));
}

inline void store_e4m3_row(const float* src, int64_t D, uint8_t* dst) {
  int64_t d = 0;
#ifdef __AVX512F__
  // e4m3_bits in 16 lanes: the same steps (cvtps_epi32 rounds to nearest even)
  const __m512 top = _mm512_set1_ps(448.f), small = _mm512_set1_ps(0.015625f), scale = _mm512_set1_ps(512.f);
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFFF), bias = _mm512_set1_epi32(120 << 3);
  const __m512i sign_bit = _mm512_set1_epi32(0x80);
  for (; d + 16 <= D; d += 16) {
    const __m512 x = _mm512_loadu_ps(src + d);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 24), sign_bit);
    const __m512 a = _mm512_min_ps(_mm512_abs_ps(x), top);
    const __m512i v = _mm512_castps_si512(a);
    const __m512i normal = _mm512_sub_epi32(
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(v, half), _mm512_and_si512(_mm512_srli_epi32(v, 20), one)),
                          20),
        bias);
    const __mmask16 sub = _mm512_cmp_ps_mask(a, small, _CMP_LT_OQ);
    const __m512i mag = _mm512_mask_mov_epi32(normal, sub, _mm512_cvtps_epi32(_mm512_mul_ps(a, scale)));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i bits = _mm512_or_si512(_mm512_mask_mov_epi32(mag, nan, _mm512_set1_epi32(0x7F)), sign);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d), _mm512_cvtepi32_epi8(bits));
  }
#endif
  for (; d < D; ++d) dst[d] = e4m3_bits(src[d]);
}

enum class KvStore { kF32, kBf16, kE4m3 };

// One token's key or value row of D into a cache row (float32; bfloat16 bits or float8_e4m3fn bits, rounded
// as XLA converts).
inline void store_kv_row(const float* src, int64_t D, KvStore kind, void* cache, int64_t at) {
  if (kind == KvStore::kF32) return static_cast<void>(std::memcpy(static_cast<float*>(cache) + at, src, D * sizeof(float)));
  if (kind == KvStore::kE4m3) return store_e4m3_row(src, D, static_cast<uint8_t*>(cache) + at);
  uint16_t* dst = static_cast<uint16_t*>(cache) + at;
  int64_t d = 0;
#ifdef __AVX512F__
  // bf16_bits in 16 lanes: the same integer steps
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff), quiet = _mm512_set1_epi32(0x40);
  const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  for (; d + 16 <= D; d += 16) {
    const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(src + d));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, half), _mm512_and_si512(_mm512_srli_epi32(u, 16), one)), 16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, abs), inf);
    const __m512i bits = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16), quiet);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), _mm512_cvtepi32_epi16(bits));
  }
#endif
  for (; d < D; ++d) dst[d] = bf16_bits(src[d]);
}

// ---- RoPE and a layer's KV writes ---------------------------------------------------------------------
// One head's rotate-half RoPE (x: D = 2 half values; c, s: the token's cos and sin, half each) by XLA's
// operations for models/llama.py's apply_rope: x1 c - x2 s as fma(x1, c, -(x2 s)) and x2 c + x1 s as
// fma(x2, c, x1 s), the other product rounded first: the same bits.
inline void rope_head(const float* x, const float* c, const float* s, int64_t half, float* out) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= half; i += 16) {
    const __m512 x1 = _mm512_loadu_ps(x + i), x2 = _mm512_loadu_ps(x + half + i);
    const __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
    _mm512_storeu_ps(out + i, _mm512_fmsub_ps(x1, cv, _mm512_mul_ps(x2, sv)));
    _mm512_storeu_ps(out + half + i, _mm512_fmadd_ps(x2, cv, _mm512_mul_ps(x1, sv)));
  }
#endif
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
    const __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
    _mm256_storeu_ps(out + i, _mm256_fmsub_ps(x1, cv, _mm256_mul_ps(x2, sv)));
    _mm256_storeu_ps(out + half + i, _mm256_fmadd_ps(x2, cv, _mm256_mul_ps(x1, sv)));
  }
  for (; i < half; ++i) {
    const float a = x[half + i] * s[i], b = x[i] * s[i];
    out[i] = std::fma(x[i], c[i], -a);
    out[half + i] = std::fma(x[half + i], c[i], b);
  }
}

// models/llama.py's qkv_heads and attention.write_kv in one pass over the rows: qkv [T, (H + 2 Hkv) D] (the
// fused projection's output) -> q [T, H, D] rotated; k (rotated) and v stored at flat slot slots[t] of the
// caches ([Hkv, pages, page_size, D], float32 or bfloat16 bits; rest = the key cache, then the value cache,
// each aliased to its result). The same bits as XLA's code of them. Tokens sharing a slot (padding rows, all
// at the scratch slot) may be stored in any order: nothing reads that slot.
ffi::Error rope_kv(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> cos,
                   ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::S32> slots, ffi::AnyBuffer kb, ffi::AnyBuffer vb,
                   ffi::Result<ffi::Buffer<ffi::F32>>& q, int32_t heads) {
  auto cd = kb.dimensions(), xd = qkv.dimensions();
  if (cd.size() != 4 || xd.size() != 2) return ffi::Error::InvalidArgument("rope_kv: caches [Hkv,P,S,D], qkv [T, N]");
  const int64_t Hkv = cd[0], P = cd[1], S = cd[2], D = cd[3], T = xd[0], H = heads, half = D / 2;
  if (D % 2 || xd[1] != (H + 2 * Hkv) * D || static_cast<int64_t>(q->element_count()) != T * H * D ||
      static_cast<int64_t>(cos.element_count()) != T * half || static_cast<int64_t>(sin.element_count()) != T * half ||
      static_cast<int64_t>(slots.element_count()) != T)
    return ffi::Error::InvalidArgument("rope_kv: shapes do not match");
  auto store = [](ffi::DataType t) {
    return t == ffi::DataType::U16 ? KvStore::kBf16 : t == ffi::DataType::U8 ? KvStore::kE4m3 : KvStore::kF32;
  };
  const auto dt = kb.element_type(), vt = vb.element_type();
  for (auto t : {dt, vt})
    if (t != ffi::DataType::F32 && t != ffi::DataType::U16 && t != ffi::DataType::U8)
      return ffi::Error::InvalidArgument("rope_kv: caches must be float32, uint16 (bfloat16 bits) or uint8 "
                                         "(float8_e4m3fn bits)");
  const int32_t* sp = slots.typed_data();
  for (int64_t t = 0; t < T; ++t)
    if (sp[t] < 0 || sp[t] >= P * S) return ffi::Error::InvalidArgument("rope_kv: slot out of range");
  const KvStore kkind = store(dt), vkind = store(vt);
  auto rows = [&](int64_t t0, int64_t t1) {
    thread_local aligned::vector<float> kbuf;  // a rotated key row
    kbuf.resize(D);
    for (int64_t t = t0; t < t1; ++t) {
      const float* x = qkv.typed_data() + t * (H + 2 * Hkv) * D;
      const float* c = cos.typed_data() + t * half;
      const float* s = sin.typed_data() + t * half;
      for (int64_t h = 0; h < H; ++h) rope_head(x + h * D, c, s, half, q->typed_data() + (t * H + h) * D);
      const int64_t slot = sp[t];
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t at = ((h * P + slot / S) * S + slot % S) * D;
        rope_head(x + (H + h) * D, c, s, half, kbuf.data());
        store_kv_row(kbuf.data(), D, kkind, kb.untyped_data(), at);
        store_kv_row(x + (H + Hkv + h) * D, D, vkind, vb.untyped_data(), at);
      }
    }
  };
  constexpr int64_t kRows = 16;
  if (T <= 2 * kRows) return rows(0, T), ffi::Error::Success();
  parallel_chunks(pool, (T + kRows - 1) / kRows, [&](int64_t c) { rows(c * kRows, std::min(T, (c + 1) * kRows)); },
                  T <= kHotRows);
  return ffi::Error::Success();
}

// rope_kv over layer `layer`'s caches: rest = L key caches, then L value caches, each aliased to the result
// of the same place (the others are left as they are; kernels.rope_kv passes one layer's).
ffi::Error RopeKvPickImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> qkv,
                          ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::S32> slots,
                          ffi::RemainingArgs rest, ffi::Result<ffi::Buffer<ffi::F32>> q, ffi::RemainingRets outs,
                          int32_t heads) {
  auto i = picked_layer(layer, rest.size(), 2);
  if (!i.has_value()) return i.error();
  if (outs.size() != rest.size()) return ffi::Error::InvalidArgument("rope_kv_pick: one result per cache");
  auto kc = outs.get<ffi::AnyBuffer>(*i);
  auto vc = outs.get<ffi::AnyBuffer>(rest.size() / 2 + *i);
  if (!kc.has_value() || !vc.has_value()) return ffi::Error::InvalidArgument("rope_kv_pick: caches must be buffers");
  return rope_kv(pool, qkv, cos, sin, slots, **kc, **vc, q, heads);
}

}  // namespace

#ifdef PARROT_PART_Q8_0
void parrot_part::qmatmul_q8_0(ffi::ThreadPool& pool, const Product& p) { product<kQ8_0>(pool, p); }
#endif
#ifdef PARROT_PART_Q4_0
void parrot_part::qmatmul_q4_0(ffi::ThreadPool& pool, const Product& p) { product<kQ4_0>(pool, p); }
#endif
#ifdef PARROT_PART_Q4_1
void parrot_part::qmatmul_q4_1(ffi::ThreadPool& pool, const Product& p) { product<kQ4_1>(pool, p); }
#endif

#ifdef PARROT_PART_REST
// The library's entry points: the only symbols it exports (built with -fvisibility=hidden).
#pragma GCC visibility push(default)

// Chooses the code of parrot_qmatmul: 0 AVX2, 1 AVX-512 VNNI, 2 AMX-INT8 tiles (with VNNI for few rows);
// -1 the best this build and CPU have. Returns the code in use: any other value, a code this build lacks,
// or AMX where the kernel refuses the tile state leaves the choice as it was.
extern "C" int parrot_matmul_select(int path) {
  if (path < -1 || path > kPathAmx) return g_path.load();
  const int best = PARROT_AMX && request_tiles() ? kPathAmx : PARROT_VNNI ? kPathVnni : kPathAvx2;
  if (path == -1) path = best;
  if (path == kPathAvx2 || (path == kPathVnni && PARROT_VNNI) || (path == kPathAmx && best == kPathAmx))
    g_path.store(path);
  return g_path.load();
}

// GGUF block rows w [N, K / 32 blocks] of `qtype` -> `out`, tiled for the integer codes' lanes
// (tiled::tile_rows; out null: nothing written); returns the tiled bytes, or -1 for an unknown block type.
extern "C" int64_t parrot_tile_rows(int32_t qtype, const uint8_t* w, int64_t N, int64_t K, uint8_t* out) {
  return tile_rows(qtype, w, N, K, out);
}

// Whether the products read the tiled copies they are given (1) or `w` alone (0; -1: unchanged); returns
// whether they read them.
extern "C" int parrot_tiled_enable(int on) {
  if (on >= 0) g_tiled.store(on != 0);
  return g_tiled.load() ? 1 : 0;
}

// The AMX path's tiles for 5-15 decode rows (amx::few_rows, amx::tiled_rows from 9 rows) on (1) or off (0:
// VNNI below 16 rows; -1: unchanged); returns whether they are on.
extern "C" int parrot_amx_few_enable(int on) {
  if (on >= 0) g_amx_few.store(on != 0);
  return g_amx_few.load() ? 1 : 0;
}

// The AVX2 code's integer products of generated rows on 2 limbs (avx2_int8.h) on (1) or off (0: float32
// with the dequantized weights; -1: unchanged); returns whether they are on.
extern "C" int parrot_avx2_int8_enable(int on) {
  if (on >= 0) g_avx2_int8.store(on != 0);
  return g_avx2_int8.load() ? 1 : 0;
}

// The kernels' helper threads on (1) or off (0, -1: unchanged); returns whether they are on.
extern "C" int parrot_team_enable(int on) {
  if (on >= 0) g_team.store(on != 0);
  return g_team.load() ? 1 : 0;
}

// Whether parrot_paged_decode's `bf16` attribute takes the bfloat16 products (decode_bf16.h): on (1) or off
// (0; -1 leaves it). Returns whether it will: 0 where this build has no AVX512-BF16.
extern "C" int parrot_decode_bf16_enable(int on) {
  if (on >= 0) g_decode_bf16.store(on != 0 && PARROT_DECODE_BF16);
  return g_decode_bf16.load() ? 1 : 0;
}

// Products asked for in bf16 (the rows parrot_qmatmul's `fill` operand flags) in bfloat16 (1: on AMX's bf16
// tiles while the AMX path runs, else with AVX512-BF16 while an integer path runs) or on the exact path
// (0); -1 leaves it. Returns how they will be multiplied now (FillPath).
extern "C" int parrot_bf16_enable(int on) {
  if (on >= 0) g_bf16.store(on != 0 && (PARROT_AMX_BF16 || PARROT_AVX512_BF16));
  return fill_path();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ParrotQMatmul, QMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // wt: w tiled for VNNI's lanes, or empty
                                  .Arg<ffi::Buffer<ffi::S32>>()  // fill [T]: rows asked for in bf16
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("qtype")
                                  .Attr<int32_t>("limbs")
                                  .Attr<int32_t>("swiglu"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ParrotPagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [B, H, D]
                                  .Arg<ffi::AnyBuffer>()          // k_cache [Hkv, P, S, D], f32 or bf16
                                  .Arg<ffi::AnyBuffer>()          // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables [B, Pmax]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_offset [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // prefix_pages [Pp]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // prefix_len [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // in_prefix [B]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [B, H, D]
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("bf16"));        // 1: products in bf16 where the CPU can

XLA_FFI_DEFINE_HANDLER_SYMBOL(ParrotQMatmulPick, QMatmulPickImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [1]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // fill [T]
                                  .RemainingArgs()               // L weights, then L tiled copies
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("qtype")
                                  .Attr<int32_t>("limbs")
                                  .Attr<int32_t>("swiglu"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ParrotPagedDecodePick, PagedDecodePickImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer [1]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [B, H, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables [B, Pmax]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_offset [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // prefix_pages [Pp]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // prefix_len [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // in_prefix [B]
                                  .RemainingArgs()                // L key caches, then L value caches
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [B, H, D]
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("bf16"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ParrotPagedPrefill, PagedPrefillImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [T, H, D]
                                  .Arg<ffi::AnyBuffer>()          // k_cache [Hkv, P, S, D], f32 or bf16
                                  .Arg<ffi::AnyBuffer>()          // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_index [B, Q]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // positions [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables [B, Pmax]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_offset [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens [B]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [T, H, D]
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("bf16"));         // 1: in bfloat16 on the bf16 tiles where on

XLA_FFI_DEFINE_HANDLER_SYMBOL(ParrotSample, SampleImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits [B, V]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // temperature [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // top_k [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // top_p [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // min_p [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // u [B]
                                  .Ret<ffi::Buffer<ffi::S32>>()); // tokens [B]

XLA_FFI_DEFINE_HANDLER_SYMBOL(ParrotRopeKvPick, RopeKvPickImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer [1]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // qkv [T, (H + 2 Hkv) D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // cos [T, D/2]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sin [T, D/2]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slots [T]
                                  .RemainingArgs()                // L key caches, then L value caches
                                  .Ret<ffi::Buffer<ffi::F32>>()   // q [T, H, D]
                                  .RemainingRets()                // the same caches (aliased)
                                  .Attr<int32_t>("heads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ParrotLogprobs, LogprobsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits [R, V]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // targets [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // want [R]: 0 gives the row zeros
                                  .Ret<ffi::Buffer<ffi::F32>>()   // chosen [R]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // top_ids [R, K]
                                  .Ret<ffi::Buffer<ffi::F32>>()); // top_lp [R, K]

// Zeros that take no memory until written: every result buffer (the KV pool's layers) is zeroed by giving
// its whole pages back to the kernel (madvise MADV_DONTNEED: a private anonymous page reads as zeros and is
// backed by memory only once written) and writing zeros to the partial pages at its two ends. A large pool
// is then resident in proportion to the pages the engine has used, not its size.
static void zero_lazily(void* data, size_t bytes) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t a = reinterpret_cast<uintptr_t>(data), e = a + bytes;
  const uintptr_t a1 = (a + page - 1) & ~(page - 1), e0 = e & ~(page - 1);
  if (a1 >= e0) {
    std::memset(data, 0, bytes);
    return;
  }
  std::memset(data, 0, a1 - a);
  if (madvise(reinterpret_cast<void*>(a1), e0 - a1, MADV_DONTNEED) != 0)
    std::memset(reinterpret_cast<void*>(a1), 0, e0 - a1);  // not anonymous memory: write the zeros
  std::memset(reinterpret_cast<void*>(e0), 0, e - e0);
}

static ffi::Error LazyZerosImpl(ffi::RemainingRets rets) {
  for (size_t i = 0; i < rets.size(); ++i) {
    auto r = rets.get<ffi::AnyBuffer>(i);
    if (!r.has_value()) return ffi::Error::InvalidArgument("parrot_lazy_zeros: a result is not a buffer");
    ffi::AnyBuffer b = **r;
    zero_lazily(b.untyped_data(), b.size_bytes());
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ParrotLazyZeros, LazyZerosImpl, ffi::Ffi::Bind().RemainingRets());

// Free pages given back to the OS (`kernels.release_pages`): operand 0 marks the pool's pages to give back
// (`release` [P], 1 to give back), then come the pool's caches ([Hkv, P, page_size, D] each), each aliased to
// its result. For every run of marked pages the whole OS pages inside each KV head's bytes of the run are
// given back (madvise MADV_DONTNEED: they read as zeros and are resident again once written); the bytes an OS
// page shares with an unmarked page are left as they are. A marked page's contents are not the pool's any more
// (the engine writes a page's keys and values before it reads them). XLA aliases each cache to its result (where
// the operand is not donated, it copies the operand first, and the pages marked are given back in the copy).
static ffi::Error ReleasePagesImpl(ffi::Buffer<ffi::U8> release, ffi::RemainingArgs caches, ffi::RemainingRets rets) {
  const uintptr_t os_page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const int64_t pages = static_cast<int64_t>(release.element_count());
  const uint8_t* mark = release.typed_data();
  for (size_t i = 0; i < rets.size(); ++i) {
    auto r = rets.get<ffi::AnyBuffer>(i);
    auto a = caches.get<ffi::AnyBuffer>(i);
    if (!r.has_value() || !a.has_value()) return ffi::Error::InvalidArgument("parrot_release_pages: not a buffer");
    ffi::AnyBuffer out = **r, in = *a;
    auto dims = out.dimensions();
    if (dims.size() != 4 || dims[1] != pages || in.size_bytes() != out.size_bytes())
      return ffi::Error::InvalidArgument("parrot_release_pages: a cache is not [Hkv, P, page_size, D]");
    if (out.untyped_data() != in.untyped_data())
      return ffi::Error::InvalidArgument("parrot_release_pages: a cache is not aliased to its result");
    const uintptr_t base = reinterpret_cast<uintptr_t>(out.untyped_data());
    const uintptr_t page_bytes = out.size_bytes() / static_cast<size_t>(dims[0] * pages);
    for (int64_t h = 0; h < dims[0]; ++h) {
      for (int64_t p = 0; p < pages;) {
        if (!mark[p]) {
          ++p;
          continue;
        }
        int64_t e = p;
        while (e < pages && mark[e]) ++e;
        const uintptr_t lo = base + static_cast<uintptr_t>(h * pages + p) * page_bytes;
        const uintptr_t hi = base + static_cast<uintptr_t>(h * pages + e) * page_bytes;
        const uintptr_t lo1 = (lo + os_page - 1) & ~(os_page - 1), hi0 = hi & ~(os_page - 1);
        if (lo1 < hi0) madvise(reinterpret_cast<void*>(lo1), hi0 - lo1, MADV_DONTNEED);  // best effort
        p = e;
      }
    }
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ParrotReleasePages, ReleasePagesImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()    // release [P]: 1 = give the page back
                                  .RemainingArgs()                // the caches
                                  .RemainingRets());              // the same caches (aliased)

#pragma GCC visibility pop
#endif  // PARROT_PART_REST
