/* SIMD helpers shared by the kernel sources: AVX2 + FMA, and the avx512 build's (cpu_kernels.py
 * compiles the sources once per path; __AVX512F__ is defined in the avx512 build only). */
#ifndef KVGATE_SIMD_MATH_H
#define KVGATE_SIMD_MATH_H

#include <immintrin.h>

#define KVG_API __attribute__((visibility("default")))

static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

/* exp(x) for x <= 0 (softmax after subtracting the max): Cephes' expf polynomial,
 * relative error ~2e-7; inputs below -87 flush to 0. */
static inline __m256 exp256_nonpos(__m256 x) {
    const __m256 ln2_hi = _mm256_set1_ps(0.693359375f), ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, ln2_hi, x);
    x = _mm256_fnmadd_ps(n, ln2_lo, x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

/* kvf: the widest float vector of this build, for loops that only load, multiply-add and reduce
 * (the linear kernel's tiles): 16 floats in the avx512 build, 8 in the AVX2 one. kvf_load8 loads
 * 8 floats and zeroes the rest (a row whose length is a multiple of 8 but not of 16); kvf_fold
 * adds the halves of a 512-bit vector into 8 lanes, for the AVX2 reductions that follow. */
#ifdef __AVX512F__
typedef __m512 kvf;
#define KVF_LANES 16
static inline kvf kvf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline kvf kvf_load8(const float *p) { return _mm512_maskz_loadu_ps(0xFF, p); }
static inline kvf kvf_zero(void) { return _mm512_setzero_ps(); }
static inline kvf kvf_fmadd(kvf a, kvf b, kvf c) { return _mm512_fmadd_ps(a, b, c); }
static inline __m256 kvf_fold(kvf v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }
#else
typedef __m256 kvf;
#define KVF_LANES 8
static inline kvf kvf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline kvf kvf_load8(const float *p) { return _mm256_loadu_ps(p); }
static inline kvf kvf_zero(void) { return _mm256_setzero_ps(); }
static inline kvf kvf_fmadd(kvf a, kvf b, kvf c) { return _mm256_fmadd_ps(a, b, c); }
static inline __m256 kvf_fold(kvf v) { return v; }
#endif

/* kvf_load, or kvf_load8 for the last 8 floats of a row (tail: a constant at each call site). */
static inline __attribute__((always_inline)) kvf kvf_load_part(const float *p, const int tail) {
    return tail ? kvf_load8(p) : kvf_load(p);
}

#endif
