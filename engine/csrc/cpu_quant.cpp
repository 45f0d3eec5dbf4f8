// y[M, N] = x[M, K] @ W^T (+ bias) on the CPU, W [N, K] held as a GGUF stores it: each row
// its K / 32 blocks in order, Q4_1 (fp16 d, fp16 m, 16 bytes of 4-bit codes; weight j is
// d * code + m, the low nibbles weights 0-15, the high 16-31) or Q8_0 (fp16 d, 32 int8
// codes; weight j is d * code). A block is widened in registers to exactly the fp32 values
// gguf's `dequantize` gives (d * code rounded, then + m rounded: no FMA contraction), and
// multiplied into the rows of x; x, the products and the sums stay fp32. So the result is
// the fp32 weights' up to summation order, while a step reads 20 bytes (Q4_1) or 34 (Q8_0)
// per 32 weights instead of 128.
//
// Built by engine/cpu_build.py (cpu_vec.h: the ISA), on torch's own OpenMP threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_vec.h"

namespace {

using namespace tandem_cpu;

constexpr int kBlock = 32;  // weights a block
constexpr int64_t kQ4_1 = 3, kQ8_0 = 8;  // ggml's type ids (gguf.GGMLQuantizationType)
constexpr int64_t kQ4_1Bytes = 20, kQ8_0Bytes = 34;

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// A tile: up to kTileRows rows of x by kTileOutputs output columns, the blocks of its
// weight rows widened once and multiplied into every row; each x vector loaded serves every
// output column. Measured on the 2-core Zen 4, one core, Q4_1 weights in cache, in ns per
// block of 32 weights (tiles of 8 rows x 4 columns keep more accumulators than there are
// registers, and still win): AVX-512 at 8 rows, 4 columns 5.7, 2 8.0, 3 8.1, 6 8.1, as
// two tiles of 4 rows 6.9; at 16 rows 12.2 (4 columns), no better than two passes of 8; at
// one row, 4 columns 1.9-2.1, 6 or 8 no faster. AVX2 (the same CPU) at 8 rows, 4 columns
// 7.8, 2 9.0, 1 7.9; at one row 2.8, 2.8, 3.9.
constexpr int kTileRows = 8;
constexpr int kTileOutputs = 4;
// Tiles ahead that a tile prefetches into L2, a block of each weight row at a time (past
// the end too: a prefetch never faults): the hardware alone does not stream the weights
// fast enough. SmolLM2's layers and logits at
// one row, weights from memory (2 cores): the [49152, 576] Q8_0 logits 3.6 ms without,
// 1.7-2.4 prefetching into L1 (2-8 tiles ahead), 1.0-1.1 into L2 4 tiles ahead (1.1-1.3
// at 8); the [3072, 576] Q4_1 gate/up 105-155 us without, 62-91 with any of them.
constexpr int64_t kPrefetchTiles = 4;

#if defined(__AVX512F__)
// The block's 16 possible weights, d * code + m for code 0..15, then each weight looked up
// by its code: vpermps reads the low 4 bits of an index lane, the low nibble as it is.
inline void widen_q4_1(const uint8_t* b, vec w[2]) {
  const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u32(b))));
  const vec codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const vec table = _mm512_add_ps(_mm512_mul_ps(_mm512_broadcastss_ps(dm), codes),
                                  _mm512_broadcastss_ps(_mm_movehdup_ps(dm)));
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)));
  w[0] = _mm512_permutexvar_ps(q, table);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
}

inline void widen_q8_0(const uint8_t* b, vec w[2]) {
  const vec d = _mm512_set1_ps(_cvtsh_ss(load_u16(b)));
  for (int v = 0; v < 2; ++v) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * v));
    w[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
  }
}
#else  // AVX2, FMA and F16C (cpu_vec.h)
inline void widen_q4_1(const uint8_t* b, vec w[4]) {
  const vec d = _mm256_set1_ps(_cvtsh_ss(load_u16(b)));
  const vec m = _mm256_set1_ps(_cvtsh_ss(load_u16(b + 2)));
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
  const __m128i nibble = _mm_set1_epi8(15);
  const __m128i half[2] = {_mm_and_si128(q, nibble), _mm_and_si128(_mm_srli_epi16(q, 4), nibble)};
  for (int h = 0; h < 2; ++h) {
    for (int v = 0; v < 2; ++v) {
      const __m256i c = _mm256_cvtepu8_epi32(v ? _mm_srli_si128(half[h], 8) : half[h]);
      w[2 * h + v] = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(c)), m);
    }
  }
}

inline void widen_q8_0(const uint8_t* b, vec w[4]) {
  const vec d = _mm256_set1_ps(_cvtsh_ss(load_u16(b)));
  for (int v = 0; v < 4; ++v) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * v));
    w[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
  }
}
#endif

constexpr int kVecs = kBlock / kLanes;

struct Q4_1 {
  static constexpr int64_t kBytes = kQ4_1Bytes;
  static void widen(const uint8_t* b, vec w[kVecs]) { widen_q4_1(b, w); }
};

struct Q8_0 {
  static constexpr int64_t kBytes = kQ8_0Bytes;
  static void widen(const uint8_t* b, vec w[kVecs]) { widen_q8_0(b, w); }
};

struct Problem {
  const uint8_t* w;   // [N, row_bytes]
  const float* x;     // [M, K]
  const float* bias;  // [N] or null
  float* y;           // [M, N]
  int64_t n, k, row_bytes;
};

// y's rows [m0, m0 + MR) at columns [n0, n0 + NR).
template <class F, int MR, int NR>
void tile(const Problem& p, int64_t m0, int64_t n0) {
  vec acc[NR][MR];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) acc[r][i] = vzero();
  const uint8_t* w = p.w + n0 * p.row_bytes;
  const float* x = p.x + m0 * p.k;
  for (int64_t b = 0; b < p.k / kBlock; ++b) {
    vec wv[NR][kVecs];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const uint8_t* block = w + r * p.row_bytes + b * F::kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchTiles * NR * p.row_bytes),
                   _MM_HINT_T1);
      F::widen(block, wv[r]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) {
        const vec xv = vload(x + i * p.k + b * kBlock + v * kLanes);
#pragma GCC unroll 8
        for (int r = 0; r < NR; ++r) acc[r][i] = vfma(wv[r][v], xv, acc[r][i]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    const float bias = p.bias ? p.bias[n0 + r] : 0.f;
    for (int i = 0; i < MR; ++i) p.y[(m0 + i) * p.n + n0 + r] = vsum(acc[r][i]) + bias;
  }
}

// Output columns [n0, n0 + NR) for `rows` rows of x from m0, rows <= kTileRows.
template <class F, int NR, int MR = kTileRows>
void columns(const Problem& p, int64_t m0, int rows, int64_t n0) {
  if constexpr (MR > 1) {
    if (rows < MR) return columns<F, NR, MR - 1>(p, m0, rows, n0);
  }
  tile<F, MR, NR>(p, m0, n0);
}

template <class F>
void run(const Problem& p, int64_t m) {
  // A thread takes a contiguous range of tiles of output columns; each tile runs every
  // row of x, kTileRows at a time, while its weights stay in cache. The last tile may be
  // narrower, its columns one at a time.
  const int64_t tiles = (p.n + kTileOutputs - 1) / kTileOutputs;
  at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t n0 = t0 * kTileOutputs; n0 < std::min(p.n, t1 * kTileOutputs);) {
      const bool whole = n0 + kTileOutputs <= p.n;
      for (int64_t m0 = 0; m0 < m; m0 += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - m0));
        if (whole) {
          columns<F, kTileOutputs>(p, m0, rows, n0);
        } else {
          columns<F, 1>(p, m0, rows, n0);
        }
      }
      n0 += whole ? kTileOutputs : 1;
    }
  });
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& blocks, int64_t kind,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(kind == kQ4_1 || kind == kQ8_0, "cpu_quant: kind ", kind,
              " is neither Q4_1 (3) nor Q8_0 (8)");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "cpu_quant: x must be a 2-D fp32 CPU tensor");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "cpu_quant: blocks must be a contiguous 2-D uint8 tensor");
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0);
  const int64_t block_bytes = kind == kQ4_1 ? kQ4_1Bytes : kQ8_0Bytes;
  TORCH_CHECK(k % kBlock == 0 && blocks.size(1) == k / kBlock * block_bytes, "cpu_quant: blocks [",
              n, ", ", blocks.size(1), "] do not hold rows of ", k, " weights");
  const float* b = nullptr;
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous(),
                "cpu_quant: bias must be a contiguous fp32 [", n, "]");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const Problem p{blocks.data_ptr<uint8_t>(), x.data_ptr<float>(), b, y.data_ptr<float>(),
                  n, k, blocks.size(1)};
  if (kind == kQ4_1) {
    run<Q4_1>(p, m);
  } else {
    run<Q8_0>(p, m);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(tandem_cpu_quant, m) {
  m.def("linear(Tensor x, Tensor blocks, int kind, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu_quant, CPU, m) { m.impl("linear", &linear); }
