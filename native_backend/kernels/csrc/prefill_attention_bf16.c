/* Causal attention of a prompt chunk over a paged cache (prefill) with bf16 products, AVX512_BF16.
 *
 * The loop of prefill_attention.c (FlashAttention's online softmax over tiles of keys, never the
 * score matrix), with both products on vdpbf16ps: bf16 operands, float32 accumulation, the
 * softmax in float32:
 *
 *   S = bf16(Q) bf16(K)^T * scale        12 rows x 32 keys in 24 registers, fp32 sums
 *   m, l, P = exp(S - m) as the fp32 kernel (lazy rescaling), P rounded to bf16
 *   O += bf16(P) bf16(V)                 12 rows x 32 values in 24 registers, fp32 sums
 *   out = O / l                          (l sums the probabilities as rounded)
 *
 * vdpbf16ps multiplies pairs: lane i of the sum gets a[2i] b[2i] + a[2i+1] b[2i+1]. So the keys are
 * packed once per call as pairs of dimensions with the key as the lane (KP: (kv_heads, tiles of 16
 * keys, D/2, 16) pairs (k_j[2p], k_j[2p+1])), the values as pairs of keys with the dimension as the
 * lane (VP: (kv_heads, ctx_pad/2, D) pairs (v_2i[d], v_2i+1[d])); a query's pair and a probability's
 * pair are broadcast. Half the bytes of the fp32 kernel's K^T and V, and twice its rows per pass
 * over them (12, not 6): at a few thousand keys the fp32 kernel waits on memory.
 *
 * Rounding is round-to-nearest-even (vcvtne2ps2bf16). Compiled in the avx512 build only, for the
 * CPUs that have AVX512_BF16 (checked at run time); elsewhere the entry point returns -3. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd_math.h"

#ifdef __AVX512F__

#define BF_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define KT 32     /* keys per tile */
#define BR 12     /* query rows per work item */
#define SLACK 8.0f /* lazy rescaling, as prefill_attention.c's RESCALE_SLACK */

typedef struct {
    const float *q;      /* (q_len, num_heads, D) */
    const uint32_t *kp;  /* (kv_heads, ctx_pad / 16, D / 2, 16) */
    const uint32_t *vp;  /* (kv_heads, ctx_pad / 2, D) */
    float *out;          /* (q_len, num_heads, D) */
    int64_t q_len, ctx, ctx_pad, num_heads, kv_heads, D;
    float scale;
} bf_args;

typedef struct {
    int64_t n, pos[BR], head[BR], limit[BR]; /* limit: keys the row sees */
} bf_rows;

/* 16 floats' bf16 (round to nearest even) in the low halves of 16 32-bit lanes. */
BF_TARGET static inline __m512i bf16_low(__m512 x) {
    return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x));
}

/* The row of key `key` (head g) as D/2 bf16 pairs, in `pairs` (zeros past ctx). */
BF_TARGET static void key_pairs(uint32_t *pairs, const float *cache, const int64_t *blocks, int64_t key, int64_t ctx,
                                int64_t g, int64_t kv_heads, int64_t D, int64_t block_size) {
    if (key >= ctx) {
        memset(pairs, 0, sizeof(uint32_t) * D / 2);
        return;
    }
    const float *src = cache + ((blocks[key / block_size] * block_size + key % block_size) * kv_heads + g) * D;
    for (int64_t d = 0; d < D; d += 32)
        _mm512_storeu_si512(pairs + d / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + d + 16),
                                                                          _mm512_loadu_ps(src + d)));
}

/* KP and VP (see the top) for every KV head, split over the threads by tiles of 16 keys. */
BF_TARGET static void pack_kv(uint32_t *kp, uint32_t *vp, const float *cache_k, const float *cache_v,
                              const int64_t *blocks, int64_t ctx, int64_t ctx_pad, int64_t kv_heads, int64_t D,
                              int64_t block_size) {
    const int64_t tiles = ctx_pad / 16;
#pragma omp for schedule(static) collapse(2)
    for (int64_t g = 0; g < kv_heads; g++)
        for (int64_t t = 0; t < tiles; t++) {
            uint32_t pairs[128], *dst = kp + (g * tiles + t) * (D / 2) * 16;
            for (int64_t j = 0; j < 16; j++) {
                key_pairs(pairs, cache_k, blocks, t * 16 + j, ctx, g, kv_heads, D, block_size);
                for (int64_t p = 0; p < D / 2; p++) dst[p * 16 + j] = pairs[p];
            }
            for (int64_t i = t * 8; i < t * 8 + 8; i++) { /* the tile's 8 pairs of keys */
                const float *v[2];
                for (int e = 0; e < 2; e++) {
                    const int64_t key = 2 * i + e;
                    v[e] = key < ctx ? cache_v + ((blocks[key / block_size] * block_size + key % block_size) * kv_heads
                                                  + g) * D
                                     : NULL;
                }
                uint32_t *vdst = vp + (g * (ctx_pad / 2) + i) * D;
                for (int64_t d = 0; d < D; d += 16) {
                    const __m512i lo = v[0] ? bf16_low(_mm512_loadu_ps(v[0] + d)) : _mm512_setzero_si512();
                    const __m512i hi = v[1] ? bf16_low(_mm512_loadu_ps(v[1] + d)) : _mm512_setzero_si512();
                    _mm512_storeu_si512(vdst + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
                }
            }
        }
}

/* exp(x) for x <= 0: exp256_nonpos's polynomial in 512-bit registers. */
BF_TARGET static inline __m512 exp512_nonpos(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3365f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    const __m512i pow2n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(pow2n));
}

/* s[r][0..2) = q_r . k_j * scale for keys j0 .. j0+31 (rows past n repeat the last row's pairs). */
BF_TARGET static void bf_scores(const bf_args *a, const uint32_t qp[BR][128], int64_t g, int64_t j0,
                                __m512 s[BR][2]) {
    __m512 acc[BR][2];
    for (int r = 0; r < BR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t tiles = a->ctx_pad / 16, half = a->D / 2;
    const uint32_t *k0 = a->kp + (g * tiles + j0 / 16) * half * 16, *k1 = k0 + half * 16;
    for (int64_t p = 0; p < half; p++) {
        const __m512bh kv0 = (__m512bh)_mm512_loadu_si512(k0 + p * 16), kv1 = (__m512bh)_mm512_loadu_si512(k1 + p * 16);
        for (int r = 0; r < BR; r++) {
            const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)qp[r][p]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qv, kv0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qv, kv1);
        }
    }
    const __m512 scale = _mm512_set1_ps(a->scale);
    for (int r = 0; r < BR; r++) s[r][0] = _mm512_mul_ps(acc[r][0], scale), s[r][1] = _mm512_mul_ps(acc[r][1], scale);
}

static inline __mmask16 keep_mask(int64_t first, int64_t limit) {
    const int64_t n = limit - first;
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* Online softmax of one tile for one row: `pp` gets the probabilities exp(s - m) as 16 bf16 pairs
 * (keys at or past `limit` exactly 0); returns the factor O must be scaled by. */
BF_TARGET static float bf_softmax(__m512 s[2], int64_t j0, int64_t limit, float *m, float *l, uint32_t *pp) {
    const __mmask16 k0 = keep_mask(j0, limit), k1 = keep_mask(j0 + 16, limit);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __m512 s0 = _mm512_mask_blend_ps(k0, ninf, s[0]), s1 = _mm512_mask_blend_ps(k1, ninf, s[1]);
    const float tile_max = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
    float alpha = 1.0f;
    if (tile_max > *m + SLACK || *m == -INFINITY) {
        alpha = *m == -INFINITY ? 0.0f : expf(*m - tile_max);
        *m = tile_max;
    }
    const __m512 shift = _mm512_set1_ps(*m + SLACK), e_slack = _mm512_set1_ps(2980.9579870417283f);
    const __m512 p0 = _mm512_maskz_mul_ps(k0, exp512_nonpos(_mm512_sub_ps(s[0], shift)), e_slack);
    const __m512 p1 = _mm512_maskz_mul_ps(k1, exp512_nonpos(_mm512_sub_ps(s[1], shift)), e_slack);
    /* l sums the probabilities as rounded, the weights P V applies: a row dominated by one key
     * then returns that key's value to float32's precision, not bf16's */
    const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
    const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xFFFF0000u)));
    *l = *l * alpha + _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
    _mm512_storeu_si512(pp, pairs);
    return alpha;
}

/* o[r][d0 .. d0+32) += sum_j p[r][j] v_j[d0 .. d0+32) over the tile's 32 keys, all BR rows (those
 * past n from zero probabilities, not stored). */
BF_TARGET static void bf_values(const bf_args *a, const uint32_t pp[BR][KT / 2], int64_t g, int64_t j0, float *o,
                                int64_t n, int64_t d0) {
    __m512 acc[BR][2];
    for (int r = 0; r < BR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint32_t *v = a->vp + (g * (a->ctx_pad / 2) + j0 / 2) * a->D + d0;
    for (int jp = 0; jp < KT / 2; jp++) {
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512(v + jp * a->D);
        const __m512bh v1 = (__m512bh)_mm512_loadu_si512(v + jp * a->D + 16);
        for (int r = 0; r < BR; r++) {
            const __m512bh pv = (__m512bh)_mm512_set1_epi32((int)pp[r][jp]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pv, v0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pv, v1);
        }
    }
    for (int64_t r = 0; r < n; r++) {
        float *orow = o + r * a->D + d0;
        _mm512_storeu_ps(orow, _mm512_add_ps(_mm512_loadu_ps(orow), acc[r][0]));
        _mm512_storeu_ps(orow + 16, _mm512_add_ps(_mm512_loadu_ps(orow + 16), acc[r][1]));
    }
}

BF_TARGET static void bf_attend(const bf_args *a, const bf_rows *rs, int64_t g) {
    uint32_t qp[BR][128], pp[BR][KT / 2];
    float o[BR * 256], m[BR], l[BR];
    const int64_t D = a->D;
    int64_t max_limit = 0;
    for (int64_t r = 0; r < BR; r++) {
        const int64_t i = r < rs->n ? r : rs->n - 1;
        const float *src = a->q + (rs->pos[i] * a->num_heads + rs->head[i]) * D;
        for (int64_t d = 0; d < D; d += 32)
            _mm512_storeu_si512(qp[r] + d / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + d + 16),
                                                                             _mm512_loadu_ps(src + d)));
    }
    for (int64_t r = 0; r < rs->n; r++) {
        m[r] = -INFINITY, l[r] = 0.0f;
        max_limit = rs->limit[r] > max_limit ? rs->limit[r] : max_limit;
    }
    memset(o, 0, sizeof(float) * rs->n * D);
    memset(pp, 0, sizeof(pp));
    for (int64_t j0 = 0; j0 < max_limit; j0 += KT) {
        __m512 s[BR][2];
        bf_scores(a, (const uint32_t(*)[128])qp, g, j0, s);
        for (int64_t r = 0; r < rs->n; r++) {
            const float alpha = bf_softmax(s[r], j0, rs->limit[r], &m[r], &l[r], pp[r]);
            if (alpha != 1.0f) {
                const __m512 av = _mm512_set1_ps(alpha);
                for (int64_t d = 0; d < D; d += 16)
                    _mm512_storeu_ps(o + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), av));
            }
        }
        for (int64_t d0 = 0; d0 < D; d0 += 32) bf_values(a, (const uint32_t(*)[KT / 2])pp, g, j0, o, rs->n, d0);
    }
    for (int64_t r = 0; r < rs->n; r++) {
        float *dst = a->out + (rs->pos[r] * a->num_heads + rs->head[r]) * D;
        const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), inv));
    }
}

/* The same arguments and contract as kvgate_prefill_attention_f32 (head_dim a multiple of 32, at
 * most 256). Returns 0; -1 bad arguments, -2 no memory, -3 no AVX512_BF16 on this CPU. */
BF_TARGET KVG_API int kvgate_prefill_attention_bf16(float *out, const float *q, const float *cache_k,
                                                    const float *cache_v, const int64_t *blocks, int64_t q_len,
                                                    int64_t ctx, int64_t num_heads, int64_t kv_heads, int64_t head_dim,
                                                    int64_t block_size, float scale) {
    if (!__builtin_cpu_supports("avx512bf16")) return -3;
    if (head_dim % 32 != 0 || head_dim > 256 || num_heads % kv_heads != 0 || q_len < 1 || q_len > ctx) return -1;
    const int64_t group = num_heads / kv_heads, ctx_pad = (ctx + KT - 1) / KT * KT;
    const int64_t heads_per_item = group < BR ? group : BR;
    const int64_t pos_per_item = group < BR ? BR / group : 1;
    const int64_t head_splits = (group + heads_per_item - 1) / heads_per_item;
    const int64_t pos_blocks = (q_len + pos_per_item - 1) / pos_per_item;
    const int64_t items = kv_heads * head_splits * pos_blocks;
    const size_t packed = sizeof(uint32_t) * kv_heads * (ctx_pad / 2) * head_dim; /* KP and VP alike */
    uint32_t *kp = (uint32_t *)malloc(packed), *vp = (uint32_t *)malloc(packed);
    if (!kp || !vp) {
        free(kp), free(vp);
        return -2;
    }
    const bf_args a = {q, kp, vp, out, q_len, ctx, ctx_pad, num_heads, kv_heads, head_dim, scale};
#pragma omp parallel
    {
        pack_kv(kp, vp, cache_k, cache_v, blocks, ctx, ctx_pad, kv_heads, head_dim, block_size);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) { /* later positions see more keys: longest first */
            const int64_t pb = pos_blocks - 1 - it / (kv_heads * head_splits), rest = it % (kv_heads * head_splits);
            const int64_t g = rest / head_splits, h0 = rest % head_splits * heads_per_item;
            bf_rows rs = {0};
            for (int64_t pi = pb * pos_per_item; pi < (pb + 1) * pos_per_item && pi < q_len; pi++)
                for (int64_t h = h0; h < h0 + heads_per_item && h < group; h++) {
                    rs.pos[rs.n] = pi, rs.head[rs.n] = g * group + h, rs.limit[rs.n] = ctx - q_len + pi + 1;
                    rs.n++;
                }
            bf_attend(&a, &rs, g);
        }
    }
    free(kp), free(vp);
    return 0;
}

#else /* the AVX2 build: no bf16 dot products */

KVG_API int kvgate_prefill_attention_bf16(float *out, const float *q, const float *cache_k, const float *cache_v,
                                          const int64_t *blocks, int64_t q_len, int64_t ctx, int64_t num_heads,
                                          int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale) {
    (void)out, (void)q, (void)cache_k, (void)cache_v, (void)blocks, (void)q_len, (void)ctx, (void)num_heads;
    (void)kv_heads, (void)head_dim, (void)block_size, (void)scale;
    return -3;
}

#endif
