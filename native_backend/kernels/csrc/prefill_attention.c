/* Causal attention of a prompt chunk over a paged cache (prefill), x86-64 AVX2 + FMA.
 *
 * FlashAttention's loop on the CPU: a work item is a few query rows of one KV head's group (up to
 * 6: the 3 heads of a group at 2 positions for SmolLM2's 9/3 heads), and walks the keys it may
 * see in tiles of 16 with an online softmax, never materialising the score matrix:
 *
 *   S = Q K^T * scale        6 x 16 scores in 12 registers; K transposed once per call (KT, below)
 *   m' = max(m, rowmax S);   P = exp(S - m');   l = l e^(m - m') + rowsum P;   O = O e^(m - m') + P V
 *   out = O / l
 *
 * Both products are register tiles that reuse each load several times (the QK tile broadcasts a
 * query element against 16 keys, the PV tile a probability against 16 values), so they run near
 * the FMA limit, where torch's SDPA on this CPU calls small GEMMs with a 64-wide inner dimension.
 *
 * The sequence's queries sit at positions ctx - q_len .. ctx - 1 (a chunk after a cached prefix
 * or a whole prompt) and query i sees keys 0 .. ctx - q_len + i (bottom-right causal). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd_math.h"

#define KEY_TILE 16
#define MAX_ROWS 6

typedef struct {
    const float *q;         /* (q_len, num_heads, D) */
    const float *kt;        /* (kv_heads, D, ctx_pad): the keys transposed */
    const float *cache_v;   /* (num_blocks, block_size, kv_heads, D) */
    const float *zeros;     /* D zeros: the value of a key past ctx (its probability is 0) */
    const int64_t *blocks;  /* the sequence's block table */
    float *out;             /* (q_len, num_heads, D) */
    int64_t q_len, ctx, ctx_pad, num_heads, kv_heads, D, block_size;
    float scale;
} prefill_args;

/* Rows of one work item: query vectors (position index, head) of one KV head's group. */
typedef struct {
    int64_t n, pos[MAX_ROWS], head[MAX_ROWS], limit[MAX_ROWS]; /* limit: keys the row sees */
} row_set;

/* v[j] = the value row of key j0 + j for head g (keys past ctx: zeros), walking the block table
 * without a division per key. */
static void value_rows(const prefill_args *a, int64_t g, int64_t j0, const float *v[KEY_TILE]) {
    int64_t b = j0 / a->block_size, o = j0 % a->block_size;
    const int64_t row = a->kv_heads * a->D;
    for (int64_t j = 0; j < KEY_TILE; j++) {
        v[j] = j0 + j < a->ctx ? a->cache_v + (a->blocks[b] * a->block_size + o) * row + g * a->D : a->zeros;
        if (++o == a->block_size) o = 0, b++;
    }
}

/* s[r][0..16) = q_r . k_j * scale for keys j0 .. j0+15 (rows beyond rs->n repeat the last). */
static void tile_scores(const prefill_args *a, const row_set *rs, int64_t g, int64_t j0, __m256 s[MAX_ROWS][2]) {
    const float *qr[MAX_ROWS];
    for (int r = 0; r < MAX_ROWS; r++) {
        const int64_t i = r < rs->n ? r : rs->n - 1;
        qr[r] = a->q + (rs->pos[i] * a->num_heads + rs->head[i]) * a->D;
    }
    __m256 acc[MAX_ROWS][2];
    for (int r = 0; r < MAX_ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float *kt = a->kt + g * a->D * a->ctx_pad + j0;
    for (int64_t d = 0; d < a->D; d++) {
        const __m256 k0 = _mm256_loadu_ps(kt + d * a->ctx_pad), k1 = _mm256_loadu_ps(kt + d * a->ctx_pad + 8);
        for (int r = 0; r < MAX_ROWS; r++) {
            const __m256 qv = _mm256_broadcast_ss(qr[r] + d);
            acc[r][0] = _mm256_fmadd_ps(qv, k0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(qv, k1, acc[r][1]);
        }
    }
    const __m256 scale = _mm256_set1_ps(a->scale);
    for (int r = 0; r < MAX_ROWS; r++) s[r][0] = _mm256_mul_ps(acc[r][0], scale), s[r][1] = _mm256_mul_ps(acc[r][1], scale);
}

static inline float hmax256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* Online softmax of one tile for row r: p[r][0..16) = exp(s - m), keys at or past `limit` exactly
 * 0; returns the factor e^(m_old - m) that the row's O (and l, done here) must be scaled by.
 *
 * m only moves when the tile's max exceeds it by more than RESCALE_SLACK: any m gives the same
 * softmax (O and l share it), and p <= e^RESCALE_SLACK stays far from overflow, so most tiles
 * skip rescaling O (FlashAttention-3's lazy rescaling). */
#define RESCALE_SLACK 8.0f
static float tile_softmax(__m256 s[2], int64_t j0, int64_t limit, float *m, float *l, float *p) {
    __m256 keep0 = _mm256_castsi256_ps(_mm256_set1_epi32(-1)), keep1 = keep0;
    if (j0 + KEY_TILE > limit) { /* the row's causal edge is in this tile */
        const __m256 idx0 = _mm256_add_ps(_mm256_set1_ps((float)j0), _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 idx1 = _mm256_add_ps(idx0, _mm256_set1_ps(8.0f)), lim = _mm256_set1_ps((float)limit);
        keep0 = _mm256_cmp_ps(idx0, lim, _CMP_LT_OQ), keep1 = _mm256_cmp_ps(idx1, lim, _CMP_LT_OQ);
        const __m256 ninf = _mm256_set1_ps(-INFINITY);
        s[0] = _mm256_blendv_ps(ninf, s[0], keep0), s[1] = _mm256_blendv_ps(ninf, s[1], keep1);
    }
    float alpha = 1.0f;
    const float tile_max = hmax256(_mm256_max_ps(s[0], s[1]));
    if (tile_max > *m + RESCALE_SLACK || *m == -INFINITY) {
        alpha = *m == -INFINITY ? 0.0f : expf(*m - tile_max);
        *m = tile_max;
    }
    const __m256 mv = _mm256_set1_ps(*m);
    /* s - m <= RESCALE_SLACK: exp of a small positive number is still exact enough through the
     * x <= 0 polynomial shifted by the slack */
    const __m256 slack = _mm256_set1_ps(RESCALE_SLACK), e_slack = _mm256_set1_ps(2980.9579870417283f);
    const __m256 p0 = _mm256_and_ps(_mm256_mul_ps(exp256_nonpos(_mm256_sub_ps(_mm256_sub_ps(s[0], mv), slack)), e_slack), keep0);
    const __m256 p1 = _mm256_and_ps(_mm256_mul_ps(exp256_nonpos(_mm256_sub_ps(_mm256_sub_ps(s[1], mv), slack)), e_slack), keep1);
    _mm256_storeu_ps(p, p0), _mm256_storeu_ps(p + 8, p1);
    *l = *l * alpha + hsum256(_mm256_add_ps(p0, p1));
    return alpha;
}

/* o[r][d0 .. d0+16) += sum_j p[r][j] v_j[d0 .. d0+16) for the tile's 16 keys, all 6 rows (those
 * past n computed from zero probabilities and not stored): 12 accumulators, 2 value loads and 6
 * broadcasts per key, within AVX2's 16 registers. */
static void tile_values(const float *const *v, const float p[MAX_ROWS][KEY_TILE], float *o, int64_t D, int64_t n,
                        int64_t d0) {
    __m256 acc[MAX_ROWS][2];
    for (int r = 0; r < MAX_ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int j = 0; j < KEY_TILE; j++) {
        const __m256 v0 = _mm256_loadu_ps(v[j] + d0), v1 = _mm256_loadu_ps(v[j] + d0 + 8);
        for (int r = 0; r < MAX_ROWS; r++) {
            const __m256 pr = _mm256_broadcast_ss(&p[r][j]);
            acc[r][0] = _mm256_fmadd_ps(pr, v0, acc[r][0]), acc[r][1] = _mm256_fmadd_ps(pr, v1, acc[r][1]);
        }
    }
    for (int r = 0; r < n; r++) {
        float *orow = o + r * D + d0;
        _mm256_storeu_ps(orow, _mm256_add_ps(_mm256_loadu_ps(orow), acc[r][0]));
        _mm256_storeu_ps(orow + 8, _mm256_add_ps(_mm256_loadu_ps(orow + 8), acc[r][1]));
    }
}

static void attend_rows(const prefill_args *a, const row_set *rs, int64_t g) {
    float o[MAX_ROWS * 256], m[MAX_ROWS], l[MAX_ROWS], p[MAX_ROWS][KEY_TILE];
    const int64_t D = a->D;
    int64_t max_limit = 0;
    for (int64_t r = 0; r < rs->n; r++) {
        m[r] = -INFINITY, l[r] = 0.0f;
        max_limit = rs->limit[r] > max_limit ? rs->limit[r] : max_limit;
    }
    memset(o, 0, sizeof(float) * rs->n * D);
    memset(p, 0, sizeof(p));
    for (int64_t j0 = 0; j0 < max_limit; j0 += KEY_TILE) {
        __m256 s[MAX_ROWS][2];
        tile_scores(a, rs, g, j0, s);
        for (int64_t r = 0; r < rs->n; r++) {
            const float alpha = tile_softmax(s[r], j0, rs->limit[r], &m[r], &l[r], p[r]);
            if (alpha != 1.0f) {
                const __m256 av = _mm256_set1_ps(alpha);
                for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + r * D + d, _mm256_mul_ps(_mm256_loadu_ps(o + r * D + d), av));
            }
        }
        const float *v[KEY_TILE];
        value_rows(a, g, j0, v);
        for (int64_t d0 = 0; d0 < D; d0 += 16) tile_values(v, (const float(*)[KEY_TILE])p, o, D, rs->n, d0);
    }
    for (int64_t r = 0; r < rs->n; r++) {
        float *dst = a->out + (rs->pos[r] * a->num_heads + rs->head[r]) * D;
        const __m256 inv = _mm256_set1_ps(1.0f / l[r]);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(o + r * D + d), inv));
    }
}

/* KT[g][d][j] = k_j[g][d] for j < ctx, 0 up to ctx_pad; a tile of 16 keys at a time, so that
 * every write is a whole cache line of KT and the 16 keys' rows stay in L1 while read. */
static void transpose_keys(float *kt, const float *cache_k, const int64_t *blocks, int64_t ctx, int64_t ctx_pad,
                           int64_t kv_heads, int64_t D, int64_t block_size) {
    const int64_t row = kv_heads * D;
#pragma omp for schedule(static)
    for (int64_t j0 = 0; j0 < ctx_pad; j0 += KEY_TILE) {
        const float *k[KEY_TILE];
        for (int64_t j = 0; j < KEY_TILE; j++)
            k[j] = j0 + j < ctx ? cache_k + (blocks[(j0 + j) / block_size] * block_size + (j0 + j) % block_size) * row
                                : NULL;
        for (int64_t e = 0; e < row; e++) {
            float *dst = kt + e * ctx_pad + j0;
            for (int64_t j = 0; j < KEY_TILE; j++) dst[j] = k[j] ? k[j][e] : 0.0f;
        }
    }
}

/*   out, q:   (q_len, num_heads, head_dim), rows at positions ctx - q_len .. ctx - 1
 *   cache_k/v (num_blocks, block_size, kv_heads, head_dim); blocks: the sequence's block ids
 * head_dim a multiple of 32 and at most 256. Returns 0, or < 0 on bad arguments / no memory. */
KVG_API int kvgate_prefill_attention_f32(float *out, const float *q, const float *cache_k, const float *cache_v,
                                         const int64_t *blocks, int64_t q_len, int64_t ctx, int64_t num_heads,
                                         int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale) {
    if (head_dim % 32 != 0 || head_dim > 256 || num_heads % kv_heads != 0 || q_len < 1 || q_len > ctx) return -1;
    const int64_t group = num_heads / kv_heads, ctx_pad = (ctx + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
    /* rows per item: the whole group at several positions, or 6 heads of a wider group at one */
    const int64_t heads_per_item = group < MAX_ROWS ? group : MAX_ROWS;
    const int64_t pos_per_item = group < MAX_ROWS ? MAX_ROWS / group : 1;
    const int64_t head_splits = (group + heads_per_item - 1) / heads_per_item;
    const int64_t pos_blocks = (q_len + pos_per_item - 1) / pos_per_item;
    const int64_t items = kv_heads * head_splits * pos_blocks;
    float *kt = (float *)malloc(sizeof(float) * kv_heads * head_dim * ctx_pad);
    float *zeros = (float *)calloc(head_dim, sizeof(float));
    if (!kt || !zeros) {
        free(kt), free(zeros);
        return -2;
    }
    const prefill_args a = {q, kt, cache_v, zeros, blocks, out, q_len, ctx, ctx_pad, num_heads, kv_heads,
                            head_dim, block_size, scale};
#pragma omp parallel
    {
        transpose_keys(kt, cache_k, blocks, ctx, ctx_pad, kv_heads, head_dim, block_size);
        /* later positions see more keys: hand items out from the longest down */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t pb = pos_blocks - 1 - it / (kv_heads * head_splits), rest = it % (kv_heads * head_splits);
            const int64_t g = rest / head_splits, h0 = rest % head_splits * heads_per_item;
            row_set rs = {0};
            for (int64_t pi = pb * pos_per_item; pi < (pb + 1) * pos_per_item && pi < q_len; pi++)
                for (int64_t h = h0; h < h0 + heads_per_item && h < group; h++) {
                    rs.pos[rs.n] = pi, rs.head[rs.n] = g * group + h, rs.limit[rs.n] = ctx - q_len + pi + 1;
                    rs.n++;
                }
            attend_rows(&a, &rs, g);
        }
    }
    free(kt), free(zeros);
    return 0;
}
