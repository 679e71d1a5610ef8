// The block-quantized product in bfloat16 on Intel AMX's bf16 tiles, for the steps that fill prompts
// (many rows) where the engine multiplies in bfloat16 (its default on CPUs with bf16 matrix units).
// Included by cpu_kernels.cc after amx_matmul.h and avx512_bf16.h; see parrot_qmatmul there for the operands.
//
// Numbers. The weights are dequantized to float32 as the file defines them (d q + m) and rounded to
// bfloat16; the activations are rounded to bfloat16; the tile unit multiplies pairs and adds them into
// float32 accumulators. Unlike the integer path, no block's sums are read out: a block's scale is inside
// its weights, so the accumulators run over the whole of K. Each output is computed by the same
// instructions in the same order whatever the number of rows (padding rows are zero and only ever meet
// their own outputs), so a row's result is bit for bit the same alone and in any batch.
//
// Tiles. C: [16 tokens, 16 weight rows] float32, 2 x 2 of them (tmm0-3) for two token tiles and two
// weight tiles; A: 16 tokens x 32 activations (one quantization block), read in place from the bfloat16
// copy of x (tmm4, tmm5); B: one block of 16 weight rows in pairs, [16 pairs, 16 rows x 2] (tmm6, tmm7),
// dequantized once per call into a panel that every token tile then reads.

namespace amxbf16 {

using avx512bf16::block_pairs;  // one block of one weight row as 32 bfloat16, in order

// The panel of weight rows [n, n + 32) (rows past n1 are zero): for each block, two B tiles of 16 rows,
// B[pair p][row r] = (w[r][2p], w[r][2p + 1]). The rows' 32-bit pairs are transposed four at a time by
// amx::transpose16x4, whose lane order (lane p from row 4 (p % 4) + p / 4) is its own inverse: taking
// the rows in that order puts row p in lane p.
// The next panel's rows (when there is one) are fetched a slice per block meanwhile.
template <class F>
void pack_panel(const uint8_t* w, int64_t ldw, int64_t blocks, int64_t n, int64_t n1, uint32_t* panel) {
  alignas(64) uint8_t rowbuf[16][64];
  const int64_t ahead = std::min<int64_t>(32, n1 - (n + 32));
  for (int64_t b = 0; b < blocks; ++b) {
    if (ahead > 0) amx::prefetch_slice(w + (n + 32) * ldw, ahead * ldw, b, blocks);
    for (int half = 0; half < 2; ++half) {
      const int64_t r0 = n + 16 * half;
      for (int i = 0; i < 16; ++i) {
        const __m512i v = r0 + i < n1 ? block_pairs<F>(w + (r0 + i) * ldw + b * F::kBytes) : _mm512_setzero_si512();
        _mm512_store_si512(rowbuf[i], v);
      }
      const uint8_t* rows[16];
      uint32_t* tile = panel + (b * 2 + half) * 256;
      for (int q = 0; q < 4; ++q) {
        for (int i = 0; i < 16; ++i) rows[i] = rowbuf[4 * (i % 4) + i / 4] + 16 * q;
        __m512i g[4];
        amx::transpose16x4(rows, g);
        for (int c = 0; c < 4; ++c) _mm512_storeu_si512(tile + (4 * q + c) * 16, g[c]);
      }
    }
  }
}

// x [T, K] float32 -> bfloat16 rows, T rounded up to 32 with zero rows.
inline void pack_x(const float* x, int64_t T, int64_t K, aligned::vector<uint16_t>& out) {
  const int64_t Tp = (T + 31) / 32 * 32;
  out.assign(Tp * K, 0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; k += 32) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + t * K + k + 16), _mm512_loadu_ps(x + t * K + k));
      _mm512_storeu_si512(out.data() + t * K + k, reinterpret_cast<__m512i>(v));
    }
}

inline void configure() {
  amx::TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  asm volatile("" : : "r"(&cfg) : "memory");  // see amx::configure
  _tile_loadconfig(&cfg);
}

// Tile c (tmm0-3) to memory: the tile instructions name their tile in the instruction itself.
inline void tile_store(int c, void* p, int64_t stride) {
  switch (c) {
    case 0: _tile_stored(0, p, stride); break;
    case 1: _tile_stored(1, p, stride); break;
    case 2: _tile_stored(2, p, stride); break;
    default: _tile_stored(3, p, stride); break;
  }
}

// C tile c (tokens t.., weight rows n..) into y, through a buffer where it overhangs T or n1.
inline void store(int c, float* y, int64_t N, int64_t T, int64_t t, int64_t n, int64_t n1) {
  if (t >= T || n >= n1) return;
  if (t + 16 <= T && n + 16 <= n1) return tile_store(c, y + t * N + n, N * 4);
  alignas(64) float buf[16 * 16];
  tile_store(c, buf, 64);
  const int64_t rows = std::min<int64_t>(16, T - t), cols = std::min<int64_t>(16, n1 - n);
  for (int64_t i = 0; i < rows; ++i) std::memcpy(y + (t + i) * N + n, buf + 16 * i, 4 * cols);
}

// Output columns [n0, n1) of every activation row (`xb`: pack_x's rows).
template <class F>
void rows(const uint16_t* xb, int64_t T, int64_t K, const uint8_t* w, int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t blocks = K / 32, ldw = blocks * F::kBytes, Tp = (T + 31) / 32 * 32, lda = 2 * K;
  thread_local aligned::vector<uint32_t> panelbuf;
  panelbuf.resize(blocks * 2 * 256);
  uint32_t* panel = panelbuf.data();
  configure();
  for (int64_t n = n0; n < n1; n += 32) {
    pack_panel<F>(w, ldw, blocks, n, n1, panel);
    for (int64_t t = 0; t < Tp; t += 32) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const uint16_t* a = xb + t * K;
      for (int64_t b = 0; b < blocks; ++b) {
        _tile_loadd(4, a + 32 * b, lda);
        _tile_loadd(5, a + 16 * K + 32 * b, lda);
        _tile_loadd(6, panel + b * 512, 64);
        _tile_loadd(7, panel + b * 512 + 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      store(0, y, N, T, t, n, n1);
      store(1, y, N, T, t, n + 16, n1);
      store(2, y, N, T, t + 16, n, n1);
      store(3, y, N, T, t + 16, n + 16, n1);
    }
  }
  _tile_release();
}

}  // namespace amxbf16
