// The small ops of a CPU decode step, each one call instead of the torch references' few
// to a dozen (kernels/rms_norm.py, rope.py, silu_mul.py, kv_store.py, paged_attention.py):
// RMSNorm with the residual add, RoPE in place on q and k, SiLU·mul, and attention of
// one query a row straight from the paged fp32 cache, its new K/V stored first. fp32 in
// and out; engine/cpu_ops.py says where the engine runs them.
//
// Rounding: products and sums are each rounded as torch's elementwise kernels round them
// (built with -ffp-contract=off), so RoPE and the K/V store equal their references bit for
// bit; RMSNorm's and attention's sums run in another order than the references', and
// exp is this file's own (`vexp`), so those agree to a few ulp (tests/test_cpu_ops.py,
// measured: RMSNorm within 3.4 ulp, SiLU·mul 2.4, attention 8e-7 of outputs up to ~1).
//
// Built by engine/cpu_build.py (cpu_vec.h: the ISA), on torch's own OpenMP threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_vec.h"

namespace {

using namespace tandem_cpu;

// Elements an op gives each thread at least: at::parallel_for runs a range under this
// inline, without waking the OpenMP team (~1 us on the 2-core machine), so a decode
// step's few rows run on the calling thread and a prompt's split. One thread against two
// there: RMSNorm of 64 rows of 576, 10.8 against 7.9 us; SiLU·mul of 16 rows of 3072,
// 11.3 against 7.9; of 8 rows, 5.6 against 5.7.
constexpr int64_t kGrainElements = 1 << 15;

int64_t grain(int64_t elements_per_item) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, elements_per_item));
}

// exp(x), Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-7 polynomial,
// times 2^n. x is clamped to [-87.3, 88]: below, e^x is under 1.2e-38 (softmax weights
// and SiLU gates that small are zero for every use here), above it overflows.
inline vec vexp(vec x) {
  x = vmin(vmax(x, vset1(-87.33654f)), vset1(88.0f));
  const vec n = vround(vmul(x, vset1(1.44269504088896341f)));
  vec r = vfma(n, vset1(-0.693359375f), x);  // ln2 in two parts: n * hi is exact
  r = vfma(n, vset1(2.12194440e-4f), r);
  vec p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset1(1.f)));
  return vmul(p, vexp2i(n));
}

// The ops' index tensors (positions, slots) are int32 (the runner's step buffer) or int64.
std::vector<int64_t> indices(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 1 && (t.scalar_type() == at::kInt || t.scalar_type() == at::kLong),
              "cpu_ops: ", what, " must be a 1-D int32 or int64 tensor");
  const at::Tensor c = t.contiguous();
  std::vector<int64_t> out(c.size(0));
  if (c.scalar_type() == at::kInt) {
    std::copy_n(c.data_ptr<int32_t>(), out.size(), out.begin());
  } else {
    std::copy_n(c.data_ptr<int64_t>(), out.size(), out.begin());
  }
  return out;
}

void check_fp32_rows(const at::Tensor& t, int64_t dim, const char* what) {
  TORCH_CHECK(t.dim() == dim && t.scalar_type() == at::kFloat && t.device().is_cpu() &&
                  t.stride(dim - 1) == 1,
              "cpu_ops: ", what, " must be a ", dim, "-D fp32 CPU tensor, unit last stride");
}

// --- RMSNorm ----------------------------------------------------------------------------

// Row s of [H]: out = weight * (s * rsqrt(mean(s^2) + eps)), the product rounded before
// the weight's, as kernels/rms_norm.py's reference rounds it (to fp32 here).
void rms_norm_row(const float* s, const float* w, float* out, int64_t h, float eps) {
  vec acc = vzero();
  int64_t i = 0;
  for (; i + kLanes <= h; i += kLanes) acc = vfma(vload(s + i), vload(s + i), acc);
  float sum = vsum(acc);
  for (; i < h; ++i) sum += s[i] * s[i];
  const float rstd = 1.f / std::sqrt(sum / static_cast<float>(h) + eps);
  const vec r = vset1(rstd);
  for (i = 0; i + kLanes <= h; i += kLanes) {
    vstore(out + i, vmul(vload(w + i), vmul(vload(s + i), r)));
  }
  for (; i < h; ++i) out[i] = w[i] * (s[i] * rstd);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const std::optional<at::Tensor>& residual) {
  check_fp32_rows(x, 2, "x");
  const int64_t t = x.size(0), h = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == h && weight.scalar_type() == at::kFloat &&
                  weight.is_contiguous(),
              "cpu_ops: weight must be a contiguous fp32 [", h, "]");
  if (residual) {
    check_fp32_rows(*residual, 2, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "cpu_ops: residual ", residual->sizes(),
                " is not x's ", x.sizes());
  }
  at::Tensor out = at::empty({t, h}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* rp = residual ? residual->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0;
  at::parallel_for(0, t, grain(h), [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const float* s = xp + row * xs;
      if (rp != nullptr) {  // residual <- x + residual, normed from there
        float* res = rp + row * rs;
        int64_t i = 0;
        for (; i + kLanes <= h; i += kLanes) vstore(res + i, vadd(vload(s + i), vload(res + i)));
        for (; i < h; ++i) res[i] = s[i] + res[i];
        s = res;
      }
      rms_norm_row(s, wp, op + row * h, h, static_cast<float>(eps));
    }
  });
  return out;
}

// --- RoPE -------------------------------------------------------------------------------

// Heads [n] of one token, each [D] at `stride` apart, rotated in place: (x1, x2) ->
// (x1 cos - x2 sin, x2 cos + x1 sin) over the two halves, each product rounded.
void rotate(float* x, int64_t heads, int64_t stride, const float* cos, const float* sin,
            int64_t half) {
  for (int64_t hd = 0; hd < heads; ++hd) {
    float* x1 = x + hd * stride;
    float* x2 = x1 + half;
    int64_t i = 0;
    for (; i + kLanes <= half; i += kLanes) {
      const vec a = vload(x1 + i), b = vload(x2 + i), c = vload(cos + i), s = vload(sin + i);
      vstore(x1 + i, vsub(vmul(a, c), vmul(b, s)));
      vstore(x2 + i, vadd(vmul(b, c), vmul(a, s)));
    }
    for (; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = a * cos[i] - b * sin[i];
      x2[i] = b * cos[i] + a * sin[i];
    }
  }
}

void rope_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
           const at::Tensor& cache) {
  check_fp32_rows(q, 3, "q");
  check_fp32_rows(k, 3, "k");
  const int64_t t = q.size(0), d = q.size(2);
  TORCH_CHECK(k.size(0) == t && k.size(2) == d && d % 2 == 0, "cpu_ops: q ", q.sizes(),
              " and k ", k.sizes(), " do not pair");
  TORCH_CHECK(cache.dim() == 2 && cache.size(1) == d && cache.scalar_type() == at::kFloat &&
                  cache.is_contiguous(),
              "cpu_ops: the cos/sin cache must be a contiguous fp32 [positions, ", d, "]");
  const std::vector<int64_t> pos = indices(positions, "positions");
  TORCH_CHECK(static_cast<int64_t>(pos.size()) == t, "cpu_ops: ", pos.size(),
              " positions for ", t, " tokens");
  for (const int64_t p : pos) {
    TORCH_CHECK(p >= 0 && p < cache.size(0), "cpu_ops: position ", p, " is past the cache's ",
                cache.size(0));
  }
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const float* cp = cache.data_ptr<float>();
  const int64_t half = d / 2;
  at::parallel_for(0, t, grain((q.size(1) + k.size(1)) * d), [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0; i < t1; ++i) {
      const float* cos = cp + pos[i] * d;
      rotate(qp + i * q.stride(0), q.size(1), q.stride(1), cos, cos + half, half);
      rotate(kp + i * k.stride(0), k.size(1), k.stride(1), cos, cos + half, half);
    }
  });
}

// --- SiLU·mul ---------------------------------------------------------------------------

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_fp32_rows(gate_up, 2, "gate_up");
  const int64_t t = gate_up.size(0), f = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * f, "cpu_ops: gate_up's width ", gate_up.size(1),
              " is odd");
  at::Tensor out = at::empty({t, f}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t stride = gate_up.stride(0);
  at::parallel_for(0, t, grain(2 * f), [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const float* g = in + row * stride;
      const float* u = g + f;
      float* o = op + row * f;
      int64_t i = 0;
      for (; i + kLanes <= f; i += kLanes) {  // silu(g) = g / (1 + e^-g), as torch's
        const vec gv = vload(g + i);
        const vec e = vexp(vsub(vzero(), gv));
        vstore(o + i, vmul(vdiv(gv, vadd(vset1(1.f), e)), vload(u + i)));
      }
      for (; i < f; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// --- decode attention -------------------------------------------------------------------

// One row's KV head in the paged cache: token j of the sequence is at block
// table[j / block_size], offset j % block_size, its K at `keys`' offset and its V
// `values` floats past that.
struct Paged {
  const float* keys;      // cache[0] at the head's first element
  int64_t values;         // cache[1] - cache[0]
  const int32_t* table;   // the row's block ids
  int64_t block_size;
  int64_t token_stride;   // Hkv * D: one token to the next within a block
  int64_t len;
  bool first_head;        // KV head 0: its pass fetches every head's rows (see `scores`)

  // f(t, K row of token t), block by block.
  template <class F>
  void each(F f) const {
    for (int64_t t0 = 0, b = 0; t0 < len; t0 += block_size, ++b) {
      const float* block = keys + table[b] * block_size * token_stride;
      const int64_t n = std::min(block_size, len - t0);
      for (int64_t j = 0; j < n; ++j) f(t0 + j, block + j * token_stride);
    }
  }
};

// Query heads a pass attends at once (a GQA group, or a part of one): each K and V row
// loaded serves them all, and their scores are summed across lanes four at a time.
constexpr int kHeads = 4;

// A head's D as vectors: ND of them where the build knows it (the common head sizes,
// whose loops then unroll: D 64 at 8 rows of 150 tokens, one core, 78 -> 59 us a layer),
// else 0: D / kLanes at run time and the rest, D % kLanes, one float at a time.
template <int ND>
struct Dim {
  int64_t d;
  int64_t vecs() const { return ND ? ND : d / kLanes; }
  int64_t floats() const { return ND ? ND * kLanes : d; }
};

// s[h][t] = q[h] . K[t] * scale for N heads.
//
// A step's K/V come from memory (SmolLM2 at 8 rows of 150 tokens: 1.8 MB a layer), and
// a token's heads lie side by side, so KV head 0's pass fetches the whole of each token's
// K and V rows into L2 for the heads after it: 30 layers' caches in turn, 2 threads,
// 132 -> 112-117 us a layer. Fetching K a block (or two, four) ahead into L1 gained
// nothing.
template <int N, int ND>
void scores(const float* const q[], const Paged& kv, Dim<ND> dim, float scale, float* s) {
  const int64_t d = dim.floats(), nd = dim.vecs();
  kv.each([&](int64_t t, const float* k) {
    if (kv.first_head) {
      for (int64_t i = 0; i < kv.token_stride; i += 64 / sizeof(float)) {
        _mm_prefetch(reinterpret_cast<const char*>(k + i), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(k + kv.values + i), _MM_HINT_T1);
      }
    }
    vec acc[kHeads];
    for (int h = 0; h < kHeads; ++h) acc[h] = vzero();
#pragma GCC unroll 16
    for (int64_t i = 0; i < nd; ++i) {
      const vec ki = vload(k + i * kLanes);
#pragma GCC unroll 4
      for (int h = 0; h < N; ++h) acc[h] = vfma(vload(q[h] + i * kLanes), ki, acc[h]);
    }
    alignas(16) float sum[kHeads];
    _mm_store_ps(sum, vsum4(acc[0], acc[1], acc[2], acc[3]));
    for (int h = 0; h < N; ++h) {
      if constexpr (ND == 0) {
        for (int64_t j = nd * kLanes; j < d; ++j) sum[h] += q[h][j] * k[j];
      }
      s[h * kv.len + t] = sum[h] * scale;
    }
  });
}

// s [len] -> exp(s - max s) in place; returns their sum.
float softmax_numerators(float* s, int64_t len) {
  vec m = vset1(-INFINITY);
  int64_t t = 0;
  for (; t + kLanes <= len; t += kLanes) m = vmax(m, vload(s + t));
  float top = vhmax(m);
  for (; t < len; ++t) top = std::max(top, s[t]);
  vec sum = vzero();
  const vec topv = vset1(top);
  for (t = 0; t + kLanes <= len; t += kLanes) {
    const vec e = vexp(vsub(vload(s + t), topv));
    vstore(s + t, e);
    sum = vadd(sum, e);
  }
  float total = vsum(sum);
  for (; t < len; ++t) total += (s[t] = std::exp(s[t] - top));
  return total;
}

// out[h][c, c + NV * kLanes) = sum_t p[h][t] * V[t][c, ...) for N heads: one pass over the
// tokens, each V vector loaded once for every head.
template <int N, int NV>
void weighted_sum(const Paged& kv, const float* p, int64_t c, float* const out[]) {
  vec acc[N][NV];
  for (int h = 0; h < N; ++h)
    for (int j = 0; j < NV; ++j) acc[h][j] = vzero();
  kv.each([&](int64_t t, const float* k) {
    const float* v = k + kv.values + c;
    vec vj[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) vj[j] = vload(v + j * kLanes);
#pragma GCC unroll 4
    for (int h = 0; h < N; ++h) {
      const vec ph = vset1(p[h * kv.len + t]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[h][j] = vfma(ph, vj[j], acc[h][j]);
    }
  });
  for (int h = 0; h < N; ++h)
    for (int j = 0; j < NV; ++j) vstore(out[h] + c + j * kLanes, acc[h][j]);
}

// N query heads of one KV head over one sequence: softmax(q K^T * scale) V into out[h]
// [D], softmax in fp32, the scores in s [N * len].
template <int N, int ND>
void attend(const float* const q[], float* const out[], const Paged& kv, Dim<ND> dim,
            float scale, float* s) {
  scores<N>(q, kv, dim, scale, s);
  float total[N];
  for (int h = 0; h < N; ++h) total[h] = softmax_numerators(s + h * kv.len, kv.len);
  const int64_t d = dim.floats(), nd = dim.vecs();
  int64_t c = 0;
  for (; c + 4 <= nd; c += 4) weighted_sum<N, 4>(kv, s, c * kLanes, out);
  for (; c < nd; ++c) weighted_sum<N, 1>(kv, s, c * kLanes, out);
  for (int h = 0; h < N; ++h) {
    if constexpr (ND == 0) {
      for (int64_t i = nd * kLanes; i < d; ++i) {
        float acc = 0.f;
        kv.each([&](int64_t t, const float* k) {
          acc += s[h * kv.len + t] * k[kv.values + i];
        });
        out[h][i] = acc;
      }
    }
    for (int64_t i = 0; i < d; ++i) out[h][i] /= total[h];
  }
}

// attend for n <= kHeads heads, at a D the build knows or any.
template <int ND>
void attend_heads(int n, const float* const q[], float* const out[], const Paged& kv,
                  Dim<ND> dim, float scale, float* s) {
  switch (n) {
    case 1: return attend<1>(q, out, kv, dim, scale, s);
    case 2: return attend<2>(q, out, kv, dim, scale, s);
    case 3: return attend<3>(q, out, kv, dim, scale, s);
    default: return attend<4>(q, out, kv, dim, scale, s);
  }
}

void attend_heads(int n, const float* const q[], float* const out[], const Paged& kv,
                  int64_t d, float scale, float* s) {
  switch (d) {
    case 4 * kLanes: return attend_heads(n, q, out, kv, Dim<4>{d}, scale, s);
    case 8 * kLanes: return attend_heads(n, q, out, kv, Dim<8>{d}, scale, s);
    default: return attend_heads(n, q, out, kv, Dim<0>{d}, scale, s);
  }
}

// A step of rows with one query each: row b's new k[b], v[b] go to its slot, then every
// q head of it attends over its seq_lens[b] tokens through its block table row (GQA: q
// head h reads KV head h / (Hq / Hkv)). q, k, v: [B, H, D] views of a fused qkv are fine.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& kv_cache, const at::Tensor& slots,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale) {
  check_fp32_rows(q, 3, "q");
  check_fp32_rows(k, 3, "k");
  check_fp32_rows(v, 3, "v");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.scalar_type() == at::kFloat,
              "cpu_ops: the KV cache must be a contiguous fp32 [2, blocks, block_size, Hkv, D]");
  const int64_t rows = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), bs = kv_cache.size(2), hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == d && hq % hkv == 0 && k.sizes() == v.sizes() &&
                  k.size(0) == rows && k.size(1) == hkv && k.size(2) == d,
              "cpu_ops: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), " and the cache ",
              kv_cache.sizes(), " do not fit");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt &&
                  block_tables.stride(1) == 1 && block_tables.size(0) >= rows,
              "cpu_ops: block_tables must be int32 [rows, W], unit last stride");
  const std::vector<int64_t> slot = indices(slots, "slots");
  const std::vector<int64_t> lens = indices(seq_lens, "seq_lens");
  TORCH_CHECK(static_cast<int64_t>(slot.size()) == rows &&
                  static_cast<int64_t>(lens.size()) == rows,
              "cpu_ops: one slot and one length a row, for ", rows, " rows");
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t width = block_tables.size(1), table_stride = block_tables.stride(0);
  int64_t max_len = 0;
  for (int64_t b = 0; b < rows; ++b) {  // every read and write in bounds
    TORCH_CHECK(slot[b] >= 0 && slot[b] < num_blocks * bs, "cpu_ops: slot ", slot[b],
                " is outside the cache");
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= width * bs, "cpu_ops: row ", b, "'s length ",
                lens[b], " does not fit its table of ", width, " blocks");
    for (int64_t j = 0; j < (lens[b] + bs - 1) / bs; ++j) {
      const int32_t id = tables[b * table_stride + j];
      TORCH_CHECK(id >= 0 && id < num_blocks, "cpu_ops: block ", id, " is outside the cache");
    }
    max_len = std::max(max_len, lens[b]);
  }
  float* kc = kv_cache.data_ptr<float>();
  float* vc = kc + num_blocks * bs * hkv * d;
  const int64_t token = hkv * d;
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int64_t b = 0; b < rows; ++b) {  // the new K/V first: every head reads its own
    for (int64_t h = 0; h < hkv; ++h) {
      const int64_t dst = slot[b] * token + h * d;
      std::memcpy(kc + dst, kp + b * k.stride(0) + h * k.stride(1), d * sizeof(float));
      std::memcpy(vc + dst, vp + b * v.stride(0) + h * v.stride(1), d * sizeof(float));
    }
  }
  at::Tensor out = at::empty({rows, hq, d}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = hq / hkv;
  // A (row, KV head) a task, its group of q heads kHeads at a time.
  at::parallel_for(0, rows * hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> s(kHeads * max_len);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / hkv, kvh = i % hkv;
      const Paged kv{kc + kvh * d, vc - kc, tables + b * table_stride, bs, token, lens[b],
                     kvh == 0};
      for (int64_t h0 = kvh * group; h0 < (kvh + 1) * group; h0 += kHeads) {
        const float* qh[kHeads];
        float* oh[kHeads];
        const int n = static_cast<int>(std::min<int64_t>(kHeads, (kvh + 1) * group - h0));
        for (int h = 0; h < n; ++h) {
          qh[h] = qp + b * q.stride(0) + (h0 + h) * q.stride(1);
          oh[h] = op + (b * hq + h0 + h) * d;
        }
        attend_heads(n, qh, oh, kv, d, static_cast<float>(scale), s.data());
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tandem_cpu_ops, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!)? residual) -> Tensor");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cache) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slots, "
        "Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu_ops, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
  m.impl("decode_attention", &decode_attention);
}
