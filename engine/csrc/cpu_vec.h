// The fp32 vector of the ISA a build targets (engine/cpu_build.py compiles each library
// for one: -mavx512f, or -mavx2 with FMA and F16C), and the few operations the kernels
// use on it. Built with -ffp-contract=off: a product and a sum are each rounded unless a
// kernel asks for vfma, as torch's own elementwise kernels round them.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace tandem_cpu {

#if defined(__AVX512F__)
using vec = __m512;
using ivec = __m512i;
constexpr int kLanes = 16;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset1(float a) { return _mm512_set1_ps(a); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec a) { _mm512_storeu_ps(p, a); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec vmin(vec a, vec b) { return _mm512_min_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
inline float vhmax(vec a) { return _mm512_reduce_max_ps(a); }
inline vec vround(vec a) {
  return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline __m256 vhalves(vec a) {  // a's two halves added: [8]
  return _mm256_add_ps(_mm512_castps512_ps256(a),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
// 2^n for whole n in [-126, 127], as a float's exponent field.
inline vec vexp2i(vec n) {
  const ivec e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
  return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
using vec = __m256;
using ivec = __m256i;
constexpr int kLanes = 8;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset1(float a) { return _mm256_set1_ps(a); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec a) { _mm256_storeu_ps(p, a); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec vmin(vec a, vec b) { return _mm256_min_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vhmax(vec a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline vec vround(vec a) {
  return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline __m256 vhalves(vec a) { return a; }
inline vec vexp2i(vec n) {
  const ivec e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
#else
#error "engine/csrc needs AVX-512F, or AVX2 with FMA and F16C"
#endif

// The sums of four vectors' lanes, [sum a, sum b, sum c, sum d], in fewer shuffles than
// four vsum: the lanes pair up across the vectors.
inline __m128 vsum4(vec a, vec b, vec c, vec d) {
  const __m256 ab = _mm256_hadd_ps(vhalves(a), vhalves(b));
  const __m256 cd = _mm256_hadd_ps(vhalves(c), vhalves(d));
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

}  // namespace tandem_cpu
