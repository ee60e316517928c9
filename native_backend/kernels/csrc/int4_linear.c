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
 * One or two rows of x (decode) take wide bands of 64 columns instead (below).
 *
 * The offset variant (kvgate_int4_linear_off_f32: GGUF's Q4_0 / Q4_1 blocks, repacked into this
 * layout at load) has a float offset per group instead of an integer zero point:
 *
 *   W[k, n] = q[k, n] * s[k / G, n] + o[k / G, n]   (Q4_1: o = m;  Q4_0: o = -8 d)
 *
 * so the group's correction is + o * xsum instead of - s z * xsum; the rest is the same code. */
#include <omp.h>
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

/* Group g's scale s and correction sz of the 8 columns from c (a multiple of 8), so that the
 * group adds s * sum(x q) - sz * xsum: sz = s z (zero points) or -o (the offset variant). */
static inline void group_scale(const int4_args *a, int64_t g, int64_t c, __m256 *s, __m256 *sz) {
    *s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a->scales + g * a->N + c)));
    *sz = a->qzeros ? _mm256_mul_ps(*s, unpack8(a->qzeros[g * (a->N / 8) + c / 8]))
                    : _mm256_sub_ps(_mm256_setzero_ps(),
                                    _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a->offsets + g * a->N + c))));
}

/* Rows m0 .. m0+R-1 (R <= TILE_ROWS) by columns c0 .. c0+8*V-1 (V = 1 or 2), the whole of K.
 * Constant R and V at each call site: the compiler unrolls the loops and keeps acc in registers.
 * The band's first row tile asks for the qweight row PREFETCH_ROWS ahead at every step: walking
 * down K, the rows are N / 2 bytes apart and cross a page every few rows, which the hardware
 * prefetchers do not follow (the later row tiles find the band in L1/L2). */
#define PREFETCH_ROWS 64
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
            if (m0 == 0) _mm_prefetch((const char *)(qw + PREFETCH_ROWS * words), _MM_HINT_T0);
            for (int v = 0; v < V; v++) w[v] = unpack8(qw[v]);
            for (int r = 0; r < R; r++) {
                const __m256 xb = _mm256_broadcast_ss(xg + r * a->K + k);
                for (int v = 0; v < V; v++) acc[r][v] = _mm256_fmadd_ps(xb, w[v], acc[r][v]);
            }
        }
        for (int v = 0; v < V; v++) {
            __m256 s, sz;
            group_scale(a, g, c0 + 8 * v, &s, &sz);
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

/* ---------------------------------------------------------------- decode rows: wide bands
 *
 * At one or two rows of x the tiles above leave too few independent FMA chains (one row by two
 * words is two accumulators, each FMA waiting on the last): the loop runs at the FMA's latency,
 * a third of its throughput. A wide band is 64 columns, the 8 consecutive words of a qweight row:
 * one 256-bit load whose lane w is run w. A constant shift by 4 NIBBLE[c] and a mask put column c
 * of every run in lane w, so one accumulator per column-in-run (8 at one row) walks K on its own.
 * After a group, acc[c] lane w is column 8 w + c: an 8 x 8 transpose puts the band's columns in
 * order for the group's scales. Two rows take two passes of 4 columns (8 accumulators), one row
 * one pass of 8. At three rows the 4-row tiles' chains are enough and win (measured: a third pass
 * over the weights costs more than the chains save). */

#define WIDE_COLUMNS 64
#define WIDE_MAX_ROWS 2

static const int NIBBLE[8] = {0, 4, 1, 5, 2, 6, 3, 7}; /* nibble of column c of a run (AWQ order) */

static inline __m256 column_of_runs(__m256i words, const int c) {
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(words, 4 * NIBBLE[c]), _mm256_set1_epi32(0xF)));
}

/* part[r][c] (lane w) = sum over the group's k of x[m0 + r, k] * q[k, 8 w + c], for columns c0 ..
 * c0 + C - 1 of each run; R * C <= 8 accumulators. With prefetch, the same rows of the next group
 * are asked for, one a step (a burst of them would fill the CPU's queue of misses and stall). */
static inline __attribute__((always_inline)) void wide_pass(const int32_t *qw, int64_t words, const float *xg,
                                                            int64_t K, int64_t G, __m256 part[][8], const int R,
                                                            const int c0, const int C, const int prefetch) {
    __m256 acc[2][8];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < G; k++, qw += words) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)qw);
        if (prefetch) _mm_prefetch((const char *)(qw + G * words), _MM_HINT_T0);
        __m256 xb[2];
        for (int r = 0; r < R; r++) xb[r] = _mm256_broadcast_ss(xg + r * K + k);
        for (int c = 0; c < C; c++) {
            const __m256 q = column_of_runs(v, c0 + c);
            for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(xb[r], q, acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) part[r][c0 + c] = acc[r][c];
}

/* In place: t[i] lane j <-> t[j] lane i. */
static inline void transpose8(__m256 t[8]) {
    __m256 a[8], b[8];
    for (int i = 0; i < 8; i += 2) {
        a[i] = _mm256_unpacklo_ps(t[i], t[i + 1]);
        a[i + 1] = _mm256_unpackhi_ps(t[i], t[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        b[i] = _mm256_shuffle_ps(a[i], a[i + 2], 0x44);
        b[i + 1] = _mm256_shuffle_ps(a[i], a[i + 2], 0xEE);
        b[i + 2] = _mm256_shuffle_ps(a[i + 1], a[i + 3], 0x44);
        b[i + 3] = _mm256_shuffle_ps(a[i + 1], a[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm256_permute2f128_ps(b[i], b[i + 4], 0x20);
        t[i + 4] = _mm256_permute2f128_ps(b[i], b[i + 4], 0x31);
    }
}

/* Rows 0 .. M-1 (M <= WIDE_MAX_ROWS) by the wide bands b0 .. b1-1, group by group: a group's rows
 * of qweight are one contiguous slab, read across its width one band after the other (the next
 * band's 32 bytes share the cache lines the last one brought), while the next group's slab is
 * prefetched. Walking a band down the whole of K instead would read 32 bytes a row at a stride of
 * N / 2 bytes, a new page every few rows, which the hardware prefetchers do not follow: measured
 * at decode, that ran at a fifth of the memory bandwidth. y holds the running sums. */
static void wide_bands(const int4_args *a, int64_t b0, int64_t b1) {
    const int64_t words = a->N / 8, groups = a->K / a->G;
    for (int64_t r = 0; r < a->M; r++)
        for (int64_t c = b0 * WIDE_COLUMNS; c < b1 * WIDE_COLUMNS; c += 8)
            _mm256_storeu_ps(a->y + r * a->N + c, a->bias ? _mm256_loadu_ps(a->bias + c) : _mm256_setzero_ps());
    for (int64_t g = 0; g < groups; g++) {
        const float *xg = a->x + g * a->G;
        for (int64_t b = b0; b < b1; b++) {
            const int64_t c0 = b * WIDE_COLUMNS, w0 = c0 / 8;
            const int32_t *qw = a->qweight + g * a->G * words + w0;
            const int next = g + 1 < groups;
            __m256 part[WIDE_MAX_ROWS][8];
            if (a->M == 2) {
                wide_pass(qw, words, xg, a->K, a->G, part, 2, 0, 4, next);
                wide_pass(qw, words, xg, a->K, a->G, part, 2, 4, 4, 0);
            } else {
                wide_pass(qw, words, xg, a->K, a->G, part, 1, 0, 8, next);
            }
            for (int64_t r = 0; r < a->M; r++) transpose8(part[r]);
            for (int w = 0; w < 8; w++) {
                __m256 s, sz;
                group_scale(a, g, c0 + 8 * w, &s, &sz);
                for (int64_t r = 0; r < a->M; r++) {
                    float *out = a->y + r * a->N + c0 + 8 * w;
                    const __m256 xs = _mm256_broadcast_ss(a->xsum + r * groups + g);
                    _mm256_storeu_ps(out, _mm256_fnmadd_ps(sz, xs, _mm256_fmadd_ps(s, part[r][w], _mm256_loadu_ps(out))));
                }
            }
        }
    }
}

#ifdef __AVX512F__
/* ---------------------------------------------------------------- decode rows: AVX-512 bands
 *
 * The avx512 build's wide band is 128 columns: the 16 consecutive words of a qweight row, one
 * 512-bit load (one cache line). The same constant shift and mask give column c of all 16 runs,
 * so each FMA does twice the work of the AVX2 band's, and with 32 registers two rows take one
 * pass (16 accumulators) instead of two over the weights. After a group, each half (8 runs) of
 * the accumulators goes through the same 8 x 8 transpose and the same scaling as the AVX2 band:
 * every column sums the same products in the same order, so the results are bit-identical to
 * the AVX2 build's. */

#define WIDE512_COLUMNS 128

static inline __m512 column_of_runs512(__m512i words, const int c) {
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(words, 4 * NIBBLE[c]), _mm512_set1_epi32(0xF)));
}

/* wide_pass over 16 runs, every column of the run: part[r][c] (lane w) = sum over the group's k of
 * x[r, k] * q[k, 8 w + c]; R <= 2. */
static inline __attribute__((always_inline)) void wide_pass512(const int32_t *qw, int64_t words, const float *xg,
                                                               int64_t K, int64_t G, __m512 part[][8], const int R,
                                                               const int prefetch) {
    __m512 acc[2][8];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 8; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < G; k++, qw += words) {
        const __m512i v = _mm512_loadu_si512((const void *)qw);
        if (prefetch) _mm_prefetch((const char *)(qw + G * words), _MM_HINT_T0);
        __m512 xb[2];
        for (int r = 0; r < R; r++) xb[r] = _mm512_set1_ps(xg[r * K + k]);
        for (int c = 0; c < 8; c++) {
            const __m512 q = column_of_runs512(v, c);
            for (int r = 0; r < R; r++) acc[r][c] = _mm512_fmadd_ps(xb[r], q, acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 8; c++) part[r][c] = acc[r][c];
}

/* One group of the 128-column band at c0: its sums, transposed half by half, scaled into y. */
static inline void wide_group512(const int4_args *a, int64_t g, int64_t c0) {
    const int64_t words = a->N / 8, groups = a->K / a->G;
    const int32_t *qw = a->qweight + g * a->G * words + c0 / 8;
    const float *xg = a->x + g * a->G;
    __m512 part[WIDE_MAX_ROWS][8];
    if (a->M == 2) wide_pass512(qw, words, xg, a->K, a->G, part, 2, g + 1 < groups);
    else wide_pass512(qw, words, xg, a->K, a->G, part, 1, g + 1 < groups);
    for (int64_t r = 0; r < a->M; r++) {
        const __m256 xs = _mm256_broadcast_ss(a->xsum + r * groups + g);
        for (int half = 0; half < 2; half++) {
            __m256 t[8];
            for (int c = 0; c < 8; c++) t[c] = half ? _mm512_extractf32x8_ps(part[r][c], 1) : _mm512_castps512_ps256(part[r][c]);
            transpose8(t);
            for (int w = 0; w < 8; w++) {
                const int64_t col = c0 + 64 * half + 8 * w;
                __m256 s, sz;
                group_scale(a, g, col, &s, &sz);
                float *out = a->y + r * a->N + col;
                _mm256_storeu_ps(out, _mm256_fnmadd_ps(sz, xs, _mm256_fmadd_ps(s, t[w], _mm256_loadu_ps(out))));
            }
        }
    }
}
#endif

/* Columns c_lo .. c_hi - 1 (whole 64-column bands) of rows 0 .. M-1, group by group (see
 * wide_bands): in the avx512 build, 128-column bands where two fit, the AVX2 band for one left. */
static void wide_columns(const int4_args *a, int64_t c_lo, int64_t c_hi) {
#ifdef __AVX512F__
    const int64_t groups = a->K / a->G, wide512 = (c_hi - c_lo) / WIDE512_COLUMNS;
    for (int64_t r = 0; r < a->M; r++)
        for (int64_t c = c_lo; c < c_lo + wide512 * WIDE512_COLUMNS; c += 8)
            _mm256_storeu_ps(a->y + r * a->N + c, a->bias ? _mm256_loadu_ps(a->bias + c) : _mm256_setzero_ps());
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < wide512; b++) wide_group512(a, g, c_lo + b * WIDE512_COLUMNS);
    c_lo += wide512 * WIDE512_COLUMNS;
#endif
    if (c_lo < c_hi) wide_bands(a, c_lo / WIDE_COLUMNS, c_hi / WIDE_COLUMNS);
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
    float small[256]; /* decode's group sums (M * K / G of them) fit here: no malloc per call */
    float *xsum = M * (K / G) <= 256 ? small : (float *)malloc(sizeof(float) * M * (K / G));
    if (!xsum) return -2;
    group_sums(x, xsum, M, K, G);
    const int4_args a = {x, xsum, bias, qweight, qzeros, scales, offsets, y, M, K, N, G};
    /* Decode rows: wide bands of 64 columns, then the columns left (N % 64) in bands of 16 and 8. */
    const int64_t wide = M <= WIDE_MAX_ROWS ? N / WIDE_COLUMNS : 0, c_rest = wide * WIDE_COLUMNS;
    const int64_t full_bands = (N - c_rest) / 16, units = wide + full_bands + ((N - c_rest) % 16 != 0);
#pragma omp parallel
    {
        if (wide) { /* one contiguous run of wide bands per thread */
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            if (wide * t / nt < wide * (t + 1) / nt)
                wide_columns(&a, wide * t / nt * WIDE_COLUMNS, wide * (t + 1) / nt * WIDE_COLUMNS);
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < units - wide; b++) {
            if (b < full_bands) band(&a, c_rest + b * 16, 2);
            else band(&a, c_rest + b * 16, 1);
        }
    }
    if (xsum != small) free(xsum);
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

/* One row of x against one row of w8: four accumulators walk K (one would wait on the FMA's
 * latency each step; at batch 1 this dot product is the whole head). */
static inline float dot_i8_row(const float *x, const int8_t *w, int64_t K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        a0 = _mm256_fmadd_ps(load8_i8(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(load8_i8(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(load8_i8(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(load8_i8(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k < K; k += 8) a0 = _mm256_fmadd_ps(load8_i8(w + k), _mm256_loadu_ps(x + k), a0);
    return hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

/* x (M, K) float32, w8 (N, K) int8, scale (N,) float32 -> y (M, N). K a multiple of 8. */
KVG_API int kvgate_int8_rows_f32(float *y, const float *x, const int8_t *w8, const float *scale, int64_t M,
                                 int64_t K, int64_t N) {
    if (K % 8 || M < 1) return -1;
    if (M == 1) {
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n++) y[n] = dot_i8_row(x, w8 + n * K, K) * scale[n];
        return 0;
    }
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *w = w8 + n * K;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t R = M - m0 < 4 ? M - m0 : 4;
            const float *x0 = x + m0 * K;
            /* Two accumulators a row (even and odd runs of 8 along K): 2 R chains, not R. */
            __m256 acc[4][2];
            for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
            int64_t k = 0;
            for (; k + 16 <= K; k += 16) {
                const __m256 w0 = load8_i8(w + k), w1 = load8_i8(w + k + 8);
                for (int r = 0; r < 4; r++) {
                    if (r >= R) break;
                    acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + r * K + k), acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x0 + r * K + k + 8), acc[r][1]);
                }
            }
            if (k < K) { /* K % 16 == 8 */
                const __m256 w0 = load8_i8(w + k);
                for (int r = 0; r < R; r++) acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + r * K + k), acc[r][0]);
            }
            for (int64_t r = 0; r < R; r++) y[(m0 + r) * N + n] = hsum256(_mm256_add_ps(acc[r][0], acc[r][1])) * scale[n];
        }
    }
    return 0;
}

#pragma GCC pop_options
