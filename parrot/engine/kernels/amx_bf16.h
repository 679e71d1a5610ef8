// The block-quantized product in bfloat16 on Intel AMX's bf16 tiles, for the steps that fill prompts
// (many rows) where the engine multiplies in bfloat16 (its default on CPUs with bf16 matrix units).
// Included by cpu_kernels.cc after amx_matmul.h and avx512_bf16.h; see parrot_qmatmul there for the operands.
//
// Numbers. The weights are dequantized to float32 as the file defines them (d q + m) and rounded to
// bfloat16; the activations are rounded to bfloat16; the tile unit multiplies pairs and adds them into
// float32 accumulators. Unlike the integer path, no block's sums are read out: a block's scale is inside
// its weights, so the accumulators run over the whole of K, block after block. Each output is computed by
// the same instructions in the same order whatever the number of rows (padding rows are zero and only ever
// meet their own outputs; an accumulator set aside between two runs of blocks is stored and reloaded in
// float32, unchanged), so a row's result is bit for bit the same alone and in any batch.
//
// Tiles. C: [16 tokens, 16 weight rows] float32, 2 x 2 of them (tmm0-3) for two token tiles and two
// weight tiles; A: 16 tokens x 32 activations (one quantization block; tmm4, tmm5) from pack_x_rows' copy
// of x, which lays each such tile out as 1 KB in a row; B: one block of 16 weight rows in pairs, [16 pairs,
// 16 rows x 2] (tmm6, tmm7), dequantized once per call into panels of 32 rows.
//
// Order. The tile unit keeps up only where one of its two operands comes from the L1 cache (with both from
// L2 it runs at half its rate), and a prompt step's output is larger than L2. So a call first dequantizes
// all its panels (at most kPackedBytes: they stay in L2); then for each pair of token tiles and each run of
// up to kRunBlocks blocks (the pair's 32 x 32 x kRunBlocks activations stay in L1) it takes every panel in
// turn, its accumulators set aside in float32 between runs. y is written a pair of token tiles' rows at a
// time (one panel at a time over every token, the order before, wrote 128 bytes of every row in turn).
// A 512-token step's gate|up product of SmolLM2-135M took 1.8x less time so on a Xeon with AMX (two
// threads, each layer's output in memory of its own as in a step; docs/benchmarks.md).

namespace amxbf16 {

using avx512bf16::block_pairs;  // one block of one weight row as 32 bfloat16, in order

// A panel of 32 weight rows in two halves of 16, half h the rows [r0[h], r0[h] + 16) (rows from r1[h] on
// are zero): for each block, two B tiles of 16 rows, B[pair p][row r] = (w[r][2p], w[r][2p + 1]). The
// rows' 32-bit pairs are transposed four at a time by amx::transpose16x4, whose lane order (lane p from
// row 4 (p % 4) + p / 4) is its own inverse: taking the rows in that order puts row p in lane p.
// The next panel's rows (each half's `next` rows on) are fetched a slice per block meanwhile.
// With the tiled copy `wt` (every r0[h] a multiple of 16), from its tiles (avx512bf16::tiled_pairs): 2.5-2.9x
// less time per block on a Xeon 6, the same values; a half's rows from r1[h] on are its tile's own there, and
// their outputs never written.
template <class F>
void pack_panel(const uint8_t* w, const uint8_t* wt, int64_t ldw, int64_t blocks, const int64_t r0[2],
                const int64_t r1[2], int64_t next, uint32_t* panel) {
#if PARROT_TILED_PAIRS
  if (wt != nullptr) {
    constexpr int64_t kTile = tiled::kTileBlockBytes<F>;
    for (int64_t b = 0; b < blocks; ++b)
      for (int half = 0; half < 2; ++half) {
        __m512i* tile = reinterpret_cast<__m512i*>(panel + (b * 2 + half) * 256);
        if (r0[half] >= r1[half]) {
          for (int i = 0; i < 16; ++i) _mm512_store_si512(tile + i, _mm512_setzero_si512());
          continue;
        }
        const uint8_t* rows = wt + r0[half] / 16 * blocks * kTile;
        if (r0[half] + next < r1[half]) tiled::prefetch_block<F>(rows + next / 16 * blocks * kTile, b);
        avx512bf16::tiled_pairs<F>(rows + b * kTile, tile);
      }
    return;
  }
#endif
  alignas(64) uint8_t rowbuf[16][64];
  for (int64_t b = 0; b < blocks; ++b) {
    for (int half = 0; half < 2; ++half) {
      const int64_t ahead = std::min<int64_t>(16, r1[half] - (r0[half] + next));
      if (ahead > 0) amx::prefetch_slice(w + (r0[half] + next) * ldw, ahead * ldw, b, blocks);
      for (int i = 0; i < 16; ++i) {
        const int64_t r = r0[half] + i;
        const __m512i v = r < r1[half] ? block_pairs<F>(w + r * ldw + b * F::kBytes) : _mm512_setzero_si512();
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

// Rows [t0, t1) of x [T, K] float32 into `out`, bfloat16 in A tiles' order: token tile i's block b is the
// 1 KB at (i * blocks + b) * 512, its 16 rows of 32 in turn. Rows from T on are zeros (padding to a pair
// of token tiles: `out` holds (T + 31) / 32 * 32 rows).
inline void pack_x_rows(const float* x, int64_t T, int64_t K, int64_t t0, int64_t t1, uint16_t* out) {
  const int64_t blocks = K / 32;
  for (int64_t t = t0; t < t1; ++t) {
    uint16_t* row = out + (t / 16) * blocks * 512 + (t % 16) * 32;
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i v = _mm512_setzero_si512();
      if (t < T) {
        const float* xs = x + t * K + 32 * b;
        v = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xs + 16), _mm512_loadu_ps(xs)));
      }
      _mm512_store_si512(row + b * 512, v);
    }
  }
}

// The packed copy's rows: T rounded up to a pair of token tiles.
inline int64_t padded_rows(int64_t T) { return (T + 31) / 32 * 32; }

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

// The plain product's outputs: a panel is 32 consecutive weight rows, its four C tiles go to y [T, N].
struct Plain {
  float* y;
  int64_t N, T, n1;  // y's width, its rows, the end of the call's columns
  static constexpr int64_t kCols = 32;  // output columns per panel
  void halves(int64_t n, int64_t r0[2], int64_t r1[2]) const { r0[0] = n, r0[1] = n + 16, r1[0] = r1[1] = n1; }
  void finish(int64_t t, int64_t n) const {
    store(0, y, N, T, t, n, n1);
    store(1, y, N, T, t, n + 16, n1);
    store(2, y, N, T, t + 16, n, n1);
    store(3, y, N, T, t + 16, n + 16, n1);
  }
};

constexpr int64_t kRunBlocks = 9;          // blocks per run: 18 KB of a token pair's activations
constexpr int64_t kPackedBytes = 1 << 20;  // a call's dequantized panels at most (see panels_per_call)

// The most panels of 32 weight rows one call of `rows` should take for K.
inline int64_t panels_per_call(int64_t K) { return std::max<int64_t>(1, kPackedBytes / (K / 32 * 2048)); }

// Output columns [n0, n1) of every activation row (`xb`: pack_x_rows' copy of all T rows), Out::kCols a
// panel, from the weights' tiled copy `wt` where given (null: the GGUF rows `w`; see pack_panel); `out`
// says which weight rows a panel's halves hold (`halves`) and takes its finished tiles (`finish`: C tiles
// 0-3 are tokens t.. x half 0, t.. x half 1, t + 16.. x half 0, t + 16.. x half 1).
template <class F, class Out>
void rows(const uint16_t* xb, int64_t T, int64_t K, const uint8_t* w, const uint8_t* wt, int64_t n0, int64_t n1,
          const Out& out) {
  const int64_t blocks = K / 32, ldw = blocks * F::kBytes, Tp = padded_rows(T);
  const int64_t panels = (n1 - n0 + Out::kCols - 1) / Out::kCols;
  const int64_t psz = blocks * 512;  // a panel's uint32s, a token tile's uint16s
  const int64_t runs = (blocks + kRunBlocks - 1) / kRunBlocks, run = (blocks + runs - 1) / runs;
  thread_local aligned::vector<uint32_t> panelbuf;
  thread_local aligned::vector<float> setaside;  // each panel's 4 accumulators between runs
  panelbuf.resize(panels * psz);
  if (runs > 1) setaside.resize(panels * 1024);
  uint32_t* packed = panelbuf.data();
  for (int64_t p = 0; p < panels; ++p) {
    int64_t r0[2], r1[2];
    out.halves(n0 + Out::kCols * p, r0, r1);
    pack_panel<F>(w, wt, ldw, blocks, r0, r1, Out::kCols, packed + p * psz);
  }
  configure();
  for (int64_t t = 0; t < Tp; t += 32) {
    const uint16_t* a0 = xb + (t / 16) * psz;  // token tiles t / 16 and t / 16 + 1
    const uint16_t* a1 = a0 + psz;
    for (int64_t b0 = 0; b0 < blocks; b0 += run) {
      const int64_t b1 = std::min(blocks, b0 + run);
      for (int64_t p = 0; p < panels; ++p) {
        const uint32_t* panel = packed + p * psz;
        float* c = setaside.data() + p * 1024;
        if (b0 == 0) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        } else {
          _tile_loadd(0, c, 64);
          _tile_loadd(1, c + 256, 64);
          _tile_loadd(2, c + 512, 64);
          _tile_loadd(3, c + 768, 64);
        }
        for (int64_t b = b0; b < b1; ++b) {
          _tile_loadd(4, a0 + b * 512, 64);
          _tile_loadd(5, a1 + b * 512, 64);
          _tile_loadd(6, panel + b * 512, 64);
          _tile_loadd(7, panel + b * 512 + 256, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        if (b1 < blocks) {
          _tile_stored(0, c, 64);
          _tile_stored(1, c + 256, 64);
          _tile_stored(2, c + 512, 64);
          _tile_stored(3, c + 768, 64);
          continue;
        }
        out.finish(t, n0 + Out::kCols * p);
      }
    }
  }
  _tile_release();
}

}  // namespace amxbf16
