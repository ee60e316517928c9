/* Int4 linear layers in the AutoAWQ GEMM layout (x86-64, AVX2 + FMA + F16C), for few rows of x.
 *
 *   y (M, N) = x (M, K) @ W (K, N) + bias,   W[k, n] = (q[k, n] - z[k / G, n]) * s[k / G, n]
 *
 *   qweight (K, N/8) int32: nibble j of a word holds column AWQ_ORDER[j] of its run of 8
 *   qzeros  (K/G, N/8) int32, the same packing;  scales (K/G, N) fp16
 *
 * The scale and zero are per group, so they leave the inner loop:
 *
 *   y[m, n] = sum_g  s[g, n] * (sum_{k in g} x[m, k] q[k, n])  -  s[g, n] z[g, n] * xsum[m, g]
 *
 * with xsum[m, g] = sum_{k in g} x[m, k] worked out once per call. The inner loop is then one
 * unpack (broadcast word, per-lane shift, mask, convert) and one FMA per 8 weights per row of x.
 *
 * Unpacking in column order: column c of a run lives in nibble AWQ_NIBBLE_OF_COLUMN[c], so a lane
 * shift of 4 x [0, 4, 1, 5, 2, 6, 3, 7] puts column c in lane c (no shuffle after).
 *
 * Work split: bands of 16 columns (two words a row), contiguous runs of bands per thread (two
 * threads rarely share a cache line of qweight). Within a band, tiles of up to 4 rows x 16
 * columns (8 accumulators) walk K; a band's qweight (K x 8 bytes) stays in L1/L2 across row tiles.
 * A run of 8 columns left at the right edge (N = 16 j + 8) is a band of one word.
 *
 * The offset variant (kvgate_int4_linear_off_f32: GGUF's Q4_0 / Q4_1 blocks, repacked into this
 * layout at load) has a float offset per group instead of an integer zero point:
 *
 *   W[k, n] = q[k, n] * s[k / G, n] + o[k / G, n]   (Q4_1: o = m;  Q4_0: o = -8 d)
 *
 * so the group's correction is + o * xsum instead of - s z * xsum; the rest is the same code. */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "simd_math.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#define TILE_ROWS 4

typedef struct {
    const float *x, *xsum, *bias;
    const int32_t *qweight, *qzeros; /* qzeros NULL: the offset variant */
    const uint16_t *scales, *offsets; /* offsets (K/G, N) fp16 bits, or NULL */
    float *y;
    int64_t M, K, N, G;
} int4_args;

static inline __m256 unpack8(int32_t word) {
    const __m256i shifts = _mm256_setr_epi32(0, 16, 4, 20, 8, 24, 12, 28), low = _mm256_set1_epi32(0xF);
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), low));
}

/* Rows m0 .. m0+R-1 (R <= TILE_ROWS) by columns c0 .. c0+8*V-1 (V = 1 or 2), the whole of K.
 * Constant R and V at each call site: the compiler unrolls the loops and keeps acc in registers. */
static inline __attribute__((always_inline)) void tile(const int4_args *a, int64_t m0, int64_t c0, const int R,
                                                       const int V) {
    const int64_t words = a->N / 8, groups = a->K / a->G, w0 = c0 / 8;
    __m256 out[TILE_ROWS][2];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) out[r][v] = a->bias ? _mm256_loadu_ps(a->bias + c0 + 8 * v) : _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256 acc[TILE_ROWS][2];
        for (int r = 0; r < R; r++)
            for (int v = 0; v < V; v++) acc[r][v] = _mm256_setzero_ps();
        const int32_t *qw = a->qweight + g * a->G * words + w0;
        const float *xg = a->x + m0 * a->K + g * a->G;
        for (int64_t k = 0; k < a->G; k++, qw += words) {
            __m256 w[2];
            for (int v = 0; v < V; v++) w[v] = unpack8(qw[v]);
            for (int r = 0; r < R; r++) {
                const __m256 xb = _mm256_broadcast_ss(xg + r * a->K + k);
                for (int v = 0; v < V; v++) acc[r][v] = _mm256_fmadd_ps(xb, w[v], acc[r][v]);
            }
        }
        for (int v = 0; v < V; v++) {
            const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a->scales + g * a->N + c0 + 8 * v)));
            const __m256 sz = a->qzeros ? _mm256_mul_ps(s, unpack8(a->qzeros[g * words + w0 + v]))
                                        : _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(_mm_loadu_si128(
                                              (const __m128i *)(a->offsets + g * a->N + c0 + 8 * v))));
            for (int r = 0; r < R; r++) {
                const __m256 xs = _mm256_broadcast_ss(a->xsum + (m0 + r) * groups + g);
                out[r][v] = _mm256_fnmadd_ps(sz, xs, _mm256_fmadd_ps(s, acc[r][v], out[r][v]));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) _mm256_storeu_ps(a->y + (m0 + r) * a->N + c0 + 8 * v, out[r][v]);
}

/* Every row tile of one band of V words. */
static void band(const int4_args *a, int64_t c0, const int V) {
    int64_t m = 0;
    for (; m + 4 <= a->M; m += 4) V == 2 ? tile(a, m, c0, 4, 2) : tile(a, m, c0, 4, 1);
    switch (a->M - m) {
        case 3: V == 2 ? tile(a, m, c0, 3, 2) : tile(a, m, c0, 3, 1); break;
        case 2: V == 2 ? tile(a, m, c0, 2, 2) : tile(a, m, c0, 2, 1); break;
        case 1: V == 2 ? tile(a, m, c0, 1, 2) : tile(a, m, c0, 1, 1); break;
        default: break;
    }
}

/* xsum[m, g] = sum of x[m, g*G .. (g+1)*G) */
static void group_sums(const float *x, float *xsum, int64_t M, int64_t K, int64_t G) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < K / G; g++) {
            __m256 s = _mm256_setzero_ps();
            const float *p = x + m * K + g * G;
            for (int64_t k = 0; k < G; k += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(p + k));
            xsum[m * (K / G) + g] = hsum256(s);
        }
}

/* 1 when this CPU has what the kernel is compiled for (AVX2, FMA, F16C). */
KVG_API int kvgate_int4_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

static int run(float *y, const float *x, const int32_t *qweight, const int32_t *qzeros, const uint16_t *scales,
               const uint16_t *offsets, const float *bias, int64_t M, int64_t K, int64_t N, int64_t G) {
    if (M < 1 || G < 8 || G % 8 || K % G || N % 8) return -1;
    if (!kvgate_int4_supported()) return -3;
    float *xsum = (float *)malloc(sizeof(float) * M * (K / G));
    if (!xsum) return -2;
    group_sums(x, xsum, M, K, G);
    const int4_args a = {x, xsum, bias, qweight, qzeros, scales, offsets, y, M, K, N, G};
    const int64_t full_bands = N / 16;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < full_bands + (N % 16 != 0); b++) {
        if (b < full_bands) band(&a, b * 16, 2);
        else band(&a, b * 16, 1);
    }
    free(xsum);
    return 0;
}

/* x (M, K) float32; qweight (K, N/8), qzeros (K/G, N/8) int32; scales (K/G, N) fp16 bits; bias
 * (N,) float32 or NULL; y (M, N) float32. G a multiple of 8 dividing K, N a multiple of 8.
 * Returns 0; -1 bad sizes; -2 no memory; -3 the CPU lacks AVX2/FMA/F16C. */
KVG_API int kvgate_int4_linear_f32(float *y, const float *x, const int32_t *qweight, const int32_t *qzeros,
                                   const uint16_t *scales, const float *bias, int64_t M, int64_t K, int64_t N,
                                   int64_t G) {
    return run(y, x, qweight, qzeros, scales, NULL, bias, M, K, N, G);
}

/* The offset variant: offsets (K/G, N) fp16 bits in place of qzeros; otherwise the same. */
KVG_API int kvgate_int4_linear_off_f32(float *y, const float *x, const int32_t *qweight, const uint16_t *offsets,
                                       const uint16_t *scales, const float *bias, int64_t M, int64_t K, int64_t N,
                                       int64_t G) {
    return run(y, x, qweight, NULL, scales, offsets, bias, M, K, N, G);
}

#pragma GCC pop_options

/* ------------------------------------------------------------------------------- int8 rows */

/* The LM head of an int4 model, stored int8 with a scale per output row (vocabulary entry):
 *
 *   y (M, N) = x (M, K) @ (w8 (N, K) * scale[n])^T
 *
 * Decode reads the whole head every step: a quarter of float32's bytes. Rows of w8 are split
 * over the threads; each row is converted 8 weights at a time and dotted with up to 4 rows of x. */
#pragma GCC push_options
#pragma GCC target("avx2,fma")

static inline __m256 load8_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* x (M, K) float32, w8 (N, K) int8, scale (N,) float32 -> y (M, N). K a multiple of 8. */
KVG_API int kvgate_int8_rows_f32(float *y, const float *x, const int8_t *w8, const float *scale, int64_t M,
                                 int64_t K, int64_t N) {
    if (K % 8 || M < 1) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *w = w8 + n * K;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t R = M - m0 < 4 ? M - m0 : 4;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            const float *x0 = x + m0 * K;
            for (int64_t k = 0; k < K; k += 8) {
                const __m256 wv = load8_i8(w + k);
                a0 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x0 + k), a0);
                if (R > 1) a1 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x0 + K + k), a1);
                if (R > 2) a2 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x0 + 2 * K + k), a2);
                if (R > 3) a3 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x0 + 3 * K + k), a3);
            }
            const __m256 acc[4] = {a0, a1, a2, a3};
            for (int64_t r = 0; r < R; r++) y[(m0 + r) * N + n] = hsum256(acc[r]) * scale[n];
        }
    }
    return 0;
}

#pragma GCC pop_options
