// Block formats, the weights' tiled layout and their prefetching, shared by the integer codes: AVX-512 VNNI (vnni_matmul.h, and
// AMX's tiles through it) and the AVX2 code's integer products (avx2_int8.h). Plain C++: included by
// cpu_kernels.cc on every CPU.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace tiled {

// The next weight rows (contiguous: `bytes` from `next`) are fetched into the cache a slice (`j` of
// `slices`) per block while this tile's blocks are read: short rows leave the hardware prefetcher little
// to go on.
inline void prefetch_slice(const uint8_t* next, int64_t bytes, int64_t j, int64_t slices) {
  const int64_t per = (bytes + 64 * slices - 1) / (64 * slices) * 64;
  for (int64_t o = j * per; o < std::min(bytes, (j + 1) * per); o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T0);
}

// Block formats: bytes per block, where the 32 weights start, signed (Q8_0) or nibbles, and the minimum
// (0: none, 1: Q4_1's float16 after d, 2: Q4_0's -8 d).
struct Q8_0 { static constexpr int kBytes = 34, kQs = 2, kMin = 0; static constexpr bool kSigned = true; };
struct Q4_0 { static constexpr int kBytes = 18, kQs = 2, kMin = 2; static constexpr bool kSigned = false; };
struct Q4_1 { static constexpr int kBytes = 20, kQs = 4, kMin = 1; static constexpr bool kSigned = false; };

// ---- weight rows tiled for the lanes ---------------------------------------------------------------
// The weights laid out ahead of time (tile_rows, once per matrix) for 16 lanes of 32 bits (VNNI's
// `group_tiled`; the AVX2 code takes each tile as two halves of 8 rows), so that a block of 16 rows is
// three or more aligned 64-byte loads instead of 16 row reads, transposes and a gather of the scales: per
// tile of 16 rows (the last one padded with zero rows), block after block, the 16 rows' float16 scales d,
// then (Q4_1) their minima m, then the rows' weight bytes in lanes: 64-byte group c holds bytes 4c..4c+3 of
// row p at 4p (Q8_0's as unsigned bytes, 128 added). Lane p is row p, and every lane computes what
// `group_vnni` computes for that row (block_tokens), so the outputs are the same bits. On a 2-core Zen 4
// (two threads, 30 layers' matrices in turn) this took a VNNI Q4_1 product from 1 to 16 rows 1.13-1.45x
// less time.
template <class F> constexpr int kTileScaleBytes = F::kMin == 1 ? 64 : 32;
template <class F> constexpr int kTileBlockBytes = kTileScaleBytes<F> + (F::kSigned ? 512 : 256);

// Block b of the 16 weight rows at `tile` (in this layout) fetched into the cache.
template <class F>
inline void prefetch_block(const uint8_t* tile, int64_t b) {
  for (int o = 0; o < kTileBlockBytes<F>; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(tile + b * kTileBlockBytes<F> + o), _MM_HINT_T0);
}

template <class F>
int64_t tiled_bytes(int64_t N, int64_t K) {
  return (N + 15) / 16 * (K / 32) * kTileBlockBytes<F>;
}

// GGUF block rows w [N][K / 32 blocks] -> the tiled layout (tiled_bytes(N, K) bytes at `out`).
template <class F>
void tile_rows(const uint8_t* w, int64_t N, int64_t K, uint8_t* out) {
  const int64_t blocks = K / 32, ldw = blocks * F::kBytes;
  std::memset(out, 0, tiled_bytes<F>(N, K));
  for (int64_t n = 0; n < N; ++n) {
    const int64_t p = n % 16;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* src = w + n * ldw + b * F::kBytes;
      uint8_t* dst = out + ((n / 16) * blocks + b) * kTileBlockBytes<F>;
      std::memcpy(dst + 2 * p, src, 2);
      if constexpr (F::kMin == 1) std::memcpy(dst + 32 + 2 * p, src + 2, 2);
      uint8_t* q = dst + kTileScaleBytes<F>;
      for (int c = 0; c < (F::kSigned ? 8 : 4); ++c)
        for (int j = 0; j < 4; ++j) {
          const uint8_t v = src[F::kQs + 4 * c + j];
          q[64 * c + 4 * p + j] = F::kSigned ? static_cast<uint8_t>(v ^ 0x80) : v;
        }
    }
  }
}

}  // namespace tiled
