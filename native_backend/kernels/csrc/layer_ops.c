/* The small per-layer operations of a Llama decoder step (x86-64, AVX2 + FMA), one pass each.
 *
 * Each is a few multiplies per float, so in torch the cost is the dispatch and the temporaries
 * (RoPE alone is a roll, two multiplies and an add, each a new tensor, for q and for k): these
 * read their inputs once and write in place where the caller allows it.
 *
 * Rows are contiguous float32; rows are spread over the OpenMP threads only when there are
 * enough of them to pay for waking the pool (prefill chunks, not single decodes). */
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "simd_math.h"

#define PARALLEL_MIN_ROWS 32

/* sum of squares of x[0 .. D), D a multiple of 8 */
static inline float sum_squares(const float *x, int64_t D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        const __m256 u = _mm256_loadu_ps(x + d), v = _mm256_loadu_ps(x + d + 8);
        a0 = _mm256_fmadd_ps(u, u, a0), a1 = _mm256_fmadd_ps(v, v, a1);
    }
    if (d < D) {
        const __m256 u = _mm256_loadu_ps(x + d);
        a0 = _mm256_fmadd_ps(u, u, a0);
    }
    return hsum256(_mm256_add_ps(a0, a1));
}

/* The residual stream and the norm that opens the next block, in one pass over each row:
 *
 *   residual += delta          (skipped when delta is NULL)
 *   out = residual * rsqrt(mean(residual^2) + eps) * weight
 *
 * residual, delta, out: (M, D); weight: (D,). D must be a multiple of 8. */
KVG_API int kvgate_add_rms_norm_f32(float *residual, const float *delta, const float *weight, float *out, int64_t M,
                                    int64_t D, float eps) {
    if (D % 8 != 0) return -1;
#pragma omp parallel for schedule(static) if (M >= PARALLEL_MIN_ROWS)
    for (int64_t m = 0; m < M; m++) {
        float *r = residual + m * D, *o = out + m * D;
        if (delta) {
            const float *dl = delta + m * D;
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(r + d, _mm256_add_ps(_mm256_loadu_ps(r + d), _mm256_loadu_ps(dl + d)));
        }
        const __m256 scale = _mm256_set1_ps(1.0f / sqrtf(sum_squares(r, D) / (float)D + eps));
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(r + d), scale),
                                                  _mm256_loadu_ps(weight + d)));
    }
    return 0;
}

/* Rotate pairs (i, i + D/2) of every head of one token (Hugging Face's rotate_half):
 *   x1' = x1 cos - x2 sin,   x2' = x2 cos + x1 sin */
static inline void rope_heads(float *x, int64_t heads, int64_t D, const float *cos, const float *sin) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *x1 = x + h * D, *x2 = x1 + half;
        for (int64_t j = 0; j < half; j += 8) {
            const __m256 a = _mm256_loadu_ps(x1 + j), b = _mm256_loadu_ps(x2 + j);
            const __m256 c = _mm256_loadu_ps(cos + j), s = _mm256_loadu_ps(sin + j);
            _mm256_storeu_ps(x1 + j, _mm256_fmsub_ps(a, c, _mm256_mul_ps(b, s)));
            _mm256_storeu_ps(x2 + j, _mm256_fmadd_ps(b, c, _mm256_mul_ps(a, s)));
        }
    }
}

/* Rotary embedding of a step's queries and keys, in place:
 *   q: (n, q_heads, D), k: (n, k_heads, D), positions: (n,) int64
 *   cos, sin: (max_positions, D/2), the tables of every position (row p = angles p * inv_freq)
 * D/2 must be a multiple of 8; positions are trusted to be < max_positions. */
KVG_API int kvgate_rope_qk_f32(float *q, float *k, const int64_t *positions, const float *cos, const float *sin,
                               int64_t n, int64_t q_heads, int64_t k_heads, int64_t D) {
    if (D % 16 != 0) return -1;
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN_ROWS)
    for (int64_t i = 0; i < n; i++) {
        const float *c = cos + positions[i] * half, *s = sin + positions[i] * half;
        rope_heads(q + i * q_heads * D, q_heads, D, c, s);
        rope_heads(k + i * k_heads * D, k_heads, D, c, s);
    }
    return 0;
}

/* SwiGLU's gate: out = silu(gate) * up = gate * sigmoid(gate) * up, with
 * sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, e = exp(-|g|) (never overflows).
 *   gate, up, out: (M, N); out may be gate. N must be a multiple of 8. */
KVG_API int kvgate_silu_mul_f32(float *out, const float *gate, const float *up, int64_t M, int64_t N) {
    if (N % 8 != 0) return -1;
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
#pragma omp parallel for schedule(static) if (M >= PARALLEL_MIN_ROWS)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gate + m * N, *u = up + m * N;
        float *o = out + m * N;
        for (int64_t j = 0; j < N; j += 8) {
            const __m256 x = _mm256_loadu_ps(g + j);
            const __m256 e = exp256_nonpos(_mm256_or_ps(x, sign));  /* exp(-|x|) */
            const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
            const __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), x);  /* sign bit of x picks e/(1+e) */
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + j)));
        }
    }
    return 0;
}
