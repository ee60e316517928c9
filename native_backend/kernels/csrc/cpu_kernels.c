/* CPU kernels of the native engine (x86-64, AVX2 + FMA), loaded with ctypes by cpu_kernels.py
 * (one library with prefill_attention.c, layer_ops.c and decode_step.c).
 *
 * Two memory-bound operations that torch does poorly on this hardware:
 *
 * - paged decode attention: torch needs the K/V of every decoding sequence gathered into one
 *   padded tensor (one copy of the cache per layer per step) before SDPA; this kernel reads each
 *   key and value once, straight from its block, the way vLLM's paged-attention kernels do;
 * - small-batch linear layers (a few rows against a large weight): MKL's sgemv/sgemm reach about
 *   a third of the memory bandwidth there, and decode at small batch is nothing but weight reads.
 *
 * Threads: OpenMP. The library is built with -fopenmp and loaded after torch, so the dynamic
 * loader binds it to the libgomp that torch already loaded (same soname): one thread pool, sized
 * by torch.set_num_threads, no oversubscription.
 *
 * Every pointer is to contiguous float32 data unless said otherwise; shapes are in the comments.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd_math.h"

/* ------------------------------------------------------------------------------- attention */

/* Attention of single query rows over a paged cache (decode, and the few rows of a speculative
 * verification): row r belongs to sequence row_seq[r] and sees its first row_keys[r] positions.
 *
 *   position p of a sequence lives in block table[p / block_size], slot offset p % block_size;
 *   one slot holds every KV head:  cache[block][offset][kv_head][0 .. head_dim)
 *
 * The keys of each row are cut into chunks of whole blocks (flash-decoding): a work item is one
 * (row, chunk) and attends all heads of the row to that chunk, reading its blocks front to back
 * (each cache line once, in address order: the hardware prefetcher follows). It leaves, per
 * query head, the chunk's max score m, its sum of exp(score - m) l and the unnormalised sum of
 * exp(score - m) * v; the chunks of a row are then merged:
 *
 *   M = max_c m_c,   out = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c
 *
 * Within a chunk the softmax is exact two-pass (scores, max, exp, then the values). */

/* Quantized caches (kv_quant.c writes them) are read here, inside the loops: fp8 bytes through a
 * 256-entry table (one gather per 8 values), int8 widened and converted; the per-layer fp8 scale
 * and the per-row int8 scale multiply the score and the softmax weight, not every element. Each
 * format gets its own copy of the loops (the format is a constant where they are inlined), so
 * the float32 path is the same code as before formats existed. */

typedef struct {
    const char *cache_k, *cache_v; /* byte addresses: elements are 4 (float32) or 1 byte wide */
    const float *k_scales, *v_scales, *lut;
    float k_scale, v_scale;
    int64_t num_heads, kv_heads, group, head_dim, block_size;
    float scale;
} cache_view;

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE int64_t elem_bytes(int fmt) { return fmt == KVG_KV_F32 ? 4 : 1; }

/* 8 consecutive K/V elements from element index i of `cache`, as floats (unscaled). */
ALWAYS_INLINE __m256 load8(const char *cache, int64_t i, int fmt, const float *lut) {
    if (fmt == KVG_KV_F32) return _mm256_loadu_ps((const float *)cache + i);
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)(cache + i));
    if (fmt == KVG_KV_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    return _mm256_i32gather_ps(lut, _mm256_cvtepu8_epi32(bytes), 4);
}

/* Blocks of one sequence are scattered, so the hardware prefetcher loses the stream at every
 * block boundary: while a block is read, the same slot of the next block is fetched. */
static inline void prefetch_bytes(const char *p, int64_t bytes) {
    for (int64_t f = 0; f < bytes; f += 64) _mm_prefetch(p + f, _MM_HINT_T0);
}

/* The block holding keys i .. of a chunk that starts at position p0 (a block start) and has n
 * keys: the element index of its first slot, how many of the chunk's keys it holds, and the
 * first slot of the chunk's next block (-1 in the last one), for prefetching. */
typedef struct {
    int64_t base, next, count;
} chunk_block;

ALWAYS_INLINE chunk_block block_of_chunk(const cache_view *c, const int64_t *table, int64_t p0, int64_t i, int64_t n) {
    const int64_t block_elems = c->block_size * c->kv_heads * c->head_dim, b = (p0 + i) / c->block_size;
    const chunk_block blk = {table[b] * block_elems, i + c->block_size < n ? table[b + 1] * block_elems : -1,
                             n - i < c->block_size ? n - i : c->block_size};
    return blk;
}

/* scores[h * n + i] = q_h . k_i * scale for the n keys at positions p0 .. p0+n-1 (p0 at a block start). */
ALWAYS_INLINE void chunk_scores(const cache_view *c, int fmt, const float *q, const int64_t *table, int64_t p0,
                                int64_t n, float *scores) {
    const int64_t slot_stride = c->kv_heads * c->head_dim, D = c->head_dim, es = elem_bytes(fmt);
    for (int64_t i = 0; i < n; i += c->block_size) {
        const chunk_block blk = block_of_chunk(c, table, p0, i, n);
        for (int64_t o = 0; o < blk.count; o++) {
            const int64_t ks = blk.base + o * slot_stride;
            if (blk.next >= 0) prefetch_bytes(c->cache_k + (blk.next + o * slot_stride) * es, slot_stride * es);
            for (int64_t h = 0; h < c->num_heads; h++) {
                const int64_t k = ks + (h / c->group) * D;
                const float *qh = q + h * D;
                __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                int64_t d = 0;
                for (; d + 16 <= D; d += 16) {
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), load8(c->cache_k, k + d, fmt, c->lut), a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d + 8), load8(c->cache_k, k + d + 8, fmt, c->lut), a1);
                }
                if (d < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), load8(c->cache_k, k + d, fmt, c->lut), a0);
                float s = hsum256(_mm256_add_ps(a0, a1)) * c->scale;
                if (fmt == KVG_KV_INT8) s *= c->k_scales[ks / D + h / c->group];
                else if (fmt != KVG_KV_F32) s *= c->k_scale;
                scores[h * n + i + o] = s;
            }
        }
    }
}

/* In place: s[i] = exp(s[i] - max); returns the sum, *max_out = max. */
static float exp_and_sum(float *s, int64_t n, float *max_out) {
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    __m256 vmx = _mm256_set1_ps(mx), vsum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp256_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmx));
        _mm256_storeu_ps(s + i, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum256(vsum);
    for (; i < n; i++) sum += (s[i] = expf(s[i] - mx));
    *max_out = mx;
    return sum;
}

/* acc[h][0..D) = sum_i weights[h * n + i] * v_i[kv_head(h)] over the chunk's n keys. */
ALWAYS_INLINE void chunk_values(const cache_view *c, int fmt, const float *weights, const int64_t *table, int64_t p0,
                                int64_t n, float *acc) {
    const int64_t slot_stride = c->kv_heads * c->head_dim, D = c->head_dim, es = elem_bytes(fmt);
    for (int64_t j = 0; j < c->num_heads * D; j += 8) _mm256_storeu_ps(acc + j, _mm256_setzero_ps());
    for (int64_t i = 0; i < n; i += c->block_size) {
        const chunk_block blk = block_of_chunk(c, table, p0, i, n);
        for (int64_t o = 0; o < blk.count; o++) {
            const int64_t vs = blk.base + o * slot_stride;
            if (blk.next >= 0) prefetch_bytes(c->cache_v + (blk.next + o * slot_stride) * es, slot_stride * es);
            for (int64_t h = 0; h < c->num_heads; h++) {
                const int64_t v = vs + (h / c->group) * D;
                float wv = weights[h * n + i + o];
                if (fmt == KVG_KV_INT8) wv *= c->v_scales[vs / D + h / c->group];
                else if (fmt != KVG_KV_F32) wv *= c->v_scale;
                const __m256 w = _mm256_set1_ps(wv);
                float *a = acc + h * D;
                for (int64_t d = 0; d < D; d += 8)
                    _mm256_storeu_ps(a + d, _mm256_fmadd_ps(w, load8(c->cache_v, v + d, fmt, c->lut), _mm256_loadu_ps(a + d)));
            }
        }
    }
}

/* One work item: a row's chunk of keys -> its partial {acc (H*D), m (H), l (H)}. */
ALWAYS_INLINE void attend_chunk(const cache_view *c, int fmt, const float *q, const int64_t *table, int64_t p0,
                                int64_t n, float *scores, float *part) {
    float *m = part + c->num_heads * c->head_dim, *l = m + c->num_heads;
    chunk_scores(c, fmt, q, table, p0, n, scores);
    for (int64_t h = 0; h < c->num_heads; h++) l[h] = exp_and_sum(scores + h * n, n, m + h);
    chunk_values(c, fmt, scores, table, p0, n, part);
}

/* out (num_heads, D) of one row from its chunks' partials: part[c] = {acc (H*D), m (H), l (H)}. */
static void merge_chunks(float *out, const float *parts, int64_t num_chunks, int64_t H, int64_t D) {
    const int64_t part_len = H * (D + 2);
    for (int64_t h = 0; h < H; h++) {
        float M = -INFINITY, L = 0.0f;
        for (int64_t ch = 0; ch < num_chunks; ch++) {
            const float m = parts[ch * part_len + H * D + h];
            M = m > M ? m : M;
        }
        for (int64_t d = 0; d < D; d++) out[h * D + d] = 0.0f;
        for (int64_t ch = 0; ch < num_chunks; ch++) {
            const float *p = parts + ch * part_len;
            const float w = expf(p[H * D + h] - M);
            L += w * p[H * D + H + h];
            for (int64_t d = 0; d < D; d++) out[h * D + d] += w * p[h * D + d];
        }
        const float inv = 1.0f / L;
        for (int64_t d = 0; d < D; d++) out[h * D + d] *= inv;
    }
}

static int paged_decode(float *out, const float *q, const cache_view *c, int fmt, const int64_t *block_tables,
                        int64_t table_stride, const int64_t *row_seq, const int64_t *row_keys, int64_t num_rows,
                        int64_t chunk_blocks) {
    const int64_t num_heads = c->num_heads, head_dim = c->head_dim;
    if (head_dim % 8 != 0 || num_heads % c->kv_heads != 0 || chunk_blocks < 1 || num_rows < 1) return -1;
    const int64_t chunk_keys = chunk_blocks * c->block_size, part_len = num_heads * (head_dim + 2);
    int64_t *first_item = (int64_t *)malloc(sizeof(int64_t) * (num_rows + 1));
    if (!first_item) return -2;
    first_item[0] = 0;
    for (int64_t r = 0; r < num_rows; r++) first_item[r + 1] = first_item[r] + (row_keys[r] + chunk_keys - 1) / chunk_keys;
    const int64_t num_items = first_item[num_rows];
    float *parts = (float *)malloc(sizeof(float) * num_items * part_len);
    int64_t *item_row = (int64_t *)malloc(sizeof(int64_t) * num_items);
    if (!parts || !item_row) {
        free(first_item), free(parts), free(item_row);
        return -2;
    }
    for (int64_t r = 0; r < num_rows; r++)
        for (int64_t it = first_item[r]; it < first_item[r + 1]; it++) item_row[it] = r;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * num_heads * chunk_keys);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < num_items; it++) {
            if (!scores) continue;
            const int64_t r = item_row[it], p0 = (it - first_item[r]) * chunk_keys;
            const int64_t n = row_keys[r] - p0 < chunk_keys ? row_keys[r] - p0 : chunk_keys;
            const int64_t *table = block_tables + row_seq[r] * table_stride;
            const float *qr = q + r * num_heads * head_dim;
            float *part = parts + it * part_len;
            switch (fmt) { /* a constant format in each branch: one specialised copy of the loops each */
            case KVG_KV_F32: attend_chunk(c, KVG_KV_F32, qr, table, p0, n, scores, part); break;
            case KVG_KV_INT8: attend_chunk(c, KVG_KV_INT8, qr, table, p0, n, scores, part); break;
            default: attend_chunk(c, KVG_KV_FP8_E4M3, qr, table, p0, n, scores, part); break; /* any fp8: the table decodes */
            }
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < num_rows; r++)
            merge_chunks(out + r * num_heads * head_dim, parts + first_item[r] * part_len,
                         first_item[r + 1] - first_item[r], num_heads, head_dim);
        free(scores);
    }
    free(first_item), free(parts), free(item_row);
    return failed ? -2 : 0;
}

/*   out, q:        (num_rows, num_heads, head_dim)
 *   cache_k/v:     (num_blocks, block_size, kv_heads, head_dim)
 *   block_tables:  (num_seqs, table_stride) int64
 *   row_seq:       (num_rows,) int64;  row_keys: (num_rows,) int64, each >= 1
 *   chunk_blocks:  blocks per work item (> 0)
 * head_dim must be a multiple of 8. Returns 0, or < 0 on bad arguments / no memory. */
KVG_API int kvgate_paged_decode_f32(float *out, const float *q, const float *cache_k, const float *cache_v,
                                    const int64_t *block_tables, int64_t table_stride, const int64_t *row_seq,
                                    const int64_t *row_keys, int64_t num_rows, int64_t num_heads,
                                    int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                                    int64_t chunk_blocks) {
    if (kv_heads < 1) return -1;
    const cache_view c = {(const char *)cache_k, (const char *)cache_v, NULL, NULL, NULL, 1.0f, 1.0f,
                          num_heads, kv_heads, num_heads / kv_heads, head_dim, block_size, scale};
    return paged_decode(out, q, &c, KVG_KV_F32, block_tables, table_stride, row_seq, row_keys, num_rows, chunk_blocks);
}

/* kvgate_paged_decode_f32 over a quantized cache (kv->fmt fp8 or int8). */
KVG_API int kvgate_paged_decode_q(float *out, const float *q, const kvg_kv *kv, const int64_t *block_tables,
                                  int64_t table_stride, const int64_t *row_seq, const int64_t *row_keys,
                                  int64_t num_rows, int64_t num_heads, int64_t kv_heads, int64_t head_dim,
                                  int64_t block_size, float scale, int64_t chunk_blocks) {
    const int fmt = (int)kv->fmt;
    if (kv_heads < 1 || fmt == KVG_KV_F32 || fmt > KVG_KV_INT8) return -1;
    if ((fmt == KVG_KV_INT8 && (!kv->k_scales || !kv->v_scales)) || (fmt != KVG_KV_INT8 && !kv->lut)) return -1;
    const cache_view c = {kv->cache_k, kv->cache_v, kv->k_scales, kv->v_scales, kv->lut, kv->k_scale, kv->v_scale,
                          num_heads, kv_heads, num_heads / kv_heads, head_dim, block_size, scale};
    return paged_decode(out, q, &c, fmt, block_tables, table_stride, row_seq, row_keys, num_rows, chunk_blocks);
}

/* ------------------------------------------------------------------------------- linear */

/* y (M, N) = x (M, K) @ W (N, K)^T + bias: each weight row is streamed from memory once for all M
 * rows of x, in register tiles of a few weight rows x a few x rows that reduce along K (W stays
 * in its (N, K) layout, no packing). Two tile shapes:
 *
 *   4 weight rows x 2 x rows (8 accumulators): for a handful of rows, where the step is nothing
 *     but weight reads and the tile must not leave x rows over;
 *   3 weight rows x 4 x rows (12 accumulators, 7 loads per 12 FMAs; 6 x 4 in the avx512 build,
 *     tile_wide): from a dozen rows up, where
 *     the FMAs are the limit.
 *
 * The tile of weight rows stays in L1 while every tile of x rows goes past it. Two things keep
 * the weights streaming: while a tile computes, the next tile's rows are prefetched into L2 a
 * slice per pass over x (without it DRAM idles during every pass but the first: 12-25% slower
 * at 2-16 rows), and rows longer than K_SLICE are reduced in slices so that a tile's weight and x
 * rows still fit L1 together. */

static inline float dot(const float *a, const float *b, int64_t K) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
    return hsum256(acc);
}

/* [sum(a), sum(b), sum(c), sum(d)]: four accumulators reduced together (3 hadds, not 12 shuffles). */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* y[0..4) = v + bias[0..4) (bias may be NULL), or y[0..4) += v when acc (a later slice of K). */
static inline void store4(float *y, __m128 v, const float *bias, int acc) {
    if (acc) v = _mm_add_ps(v, _mm_loadu_ps(y));
    else if (bias) v = _mm_add_ps(v, _mm_loadu_ps(bias));
    _mm_storeu_ps(y, v);
}

/* store4 for three lanes: lane 3 is neither read nor written. */
static inline void store3(float *y, __m128 v, const float *bias, int acc) {
    const __m128i three = _mm_setr_epi32(-1, -1, -1, 0);
    if (acc) v = _mm_add_ps(v, _mm_maskload_ps(y, three));
    else if (bias) v = _mm_add_ps(v, _mm_maskload_ps(bias, three));
    _mm_maskstore_ps(y, three, v);
}

static inline void store(float *y, int64_t N, int64_t m, int64_t n, float v, const float *bias) {
    y[m * N + n] = v + (bias ? bias[n] : 0.0f);
}

/* Cache lines of the next weight tile that one pass over x rows fetches ahead (see the linear). */
typedef struct {
    const char *next, *end;
    int64_t per_step;
} prefetch_run;

static inline void prefetch_step(prefetch_run *pf) {
    for (int64_t j = 0; j < pf->per_step && pf->next < pf->end; j++, pf->next += 64)
        _mm_prefetch(pf->next, _MM_HINT_T1);
}

/* The slice k0 .. k0+len of the reduction that a tile call covers; ld is the rows' full length. */
typedef struct {
    int64_t k0, len, ld;
} k_slice;

/* The tiles below walk K a kvf at a time (16 floats in the avx512 build, 8 in the AVX2 one); a
 * slice whose length is 8 past a multiple of 16 ends with one half-width step (tail). */

/* One step of the 4 x 2 tile at k: 8 FMAs. */
static inline __attribute__((always_inline)) void step_4x2(kvf a[4][2], const float *x0, const float *x1,
                                                           const float *const w[4], int64_t k, const int tail) {
    const kvf xa = kvf_load_part(x0 + k, tail), xb = kvf_load_part(x1 + k, tail);
    for (int i = 0; i < 4; i++) {
        const kvf v = kvf_load_part(w[i] + k, tail);
        a[i][0] = kvf_fmadd(v, xa, a[i][0]), a[i][1] = kvf_fmadd(v, xb, a[i][1]);
    }
}

/* Weight rows n0..n0+3 against x rows m, m+1, over one slice of K. */
static inline void tile_4x2(float *y, const float *x, const float *w, const float *bias, int64_t m, int64_t n0,
                            int64_t N, const k_slice *ks, prefetch_run *pf) {
    const int64_t ld = ks->ld, K = ks->len;
    const float *x0 = x + m * ld + ks->k0, *x1 = x0 + ld;
    const float *const wr[4] = {w + n0 * ld + ks->k0, w + (n0 + 1) * ld + ks->k0, w + (n0 + 2) * ld + ks->k0,
                                w + (n0 + 3) * ld + ks->k0};
    kvf a[4][2];
    for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = kvf_zero();
    int64_t k = 0;
    for (; k + KVF_LANES <= K; k += KVF_LANES) {
        prefetch_step(pf);
        step_4x2(a, x0, x1, wr, k, 0);
    }
    if (k < K) step_4x2(a, x0, x1, wr, k, 1);
    const float *b = bias ? bias + n0 : NULL;
    store4(y + m * N + n0, hsum4(kvf_fold(a[0][0]), kvf_fold(a[1][0]), kvf_fold(a[2][0]), kvf_fold(a[3][0])), b,
           ks->k0 > 0);
    store4(y + (m + 1) * N + n0, hsum4(kvf_fold(a[0][1]), kvf_fold(a[1][1]), kvf_fold(a[2][1]), kvf_fold(a[3][1])), b,
           ks->k0 > 0);
}

/* The wide tile: WIDE_W weight rows x 4 x rows. AVX2 has 16 vector registers: 3 x 4 (12
 * accumulators, 7 loads per 12 FMAs). AVX-512 has 32: 6 x 4 (24 accumulators, 10 loads per 24
 * FMAs), where the 3 x 4 tile's loads, not its FMAs, were the limit. */
#ifdef __AVX512F__
#define WIDE_W 6
#else
#define WIDE_W 3
#endif

/* One step of the wide tile at k. */
static inline __attribute__((always_inline)) void step_wide(kvf a[WIDE_W][4], const float *const x[4],
                                                            const float *const w[WIDE_W], int64_t k, const int tail) {
    kvf v[WIDE_W];
    for (int i = 0; i < WIDE_W; i++) v[i] = kvf_load_part(w[i] + k, tail);
    for (int r = 0; r < 4; r++) {
        const kvf xv = kvf_load_part(x[r] + k, tail);
        for (int i = 0; i < WIDE_W; i++) a[i][r] = kvf_fmadd(v[i], xv, a[i][r]);
    }
}

/* y[0..lanes) = v + bias (bias may be NULL), or += v when acc; lanes 1..4, the others untouched. */
static inline __attribute__((always_inline)) void store_lanes(float *y, __m128 v, const float *bias, int acc,
                                                               int lanes) {
    if (lanes == 4 || lanes == 3) {
        (lanes == 4 ? store4 : store3)(y, v, bias, acc);
        return;
    }
    const __m128i mask = _mm_cmpgt_epi32(_mm_set1_epi32(lanes), _mm_setr_epi32(0, 1, 2, 3));
    if (acc) v = _mm_add_ps(v, _mm_maskload_ps(y, mask));
    else if (bias) v = _mm_add_ps(v, _mm_maskload_ps(bias, mask));
    _mm_maskstore_ps(y, mask, v);
}

/* Weight rows n0 .. n0+WIDE_W-1 against x rows m..m+3, over one slice of K. Forced inline: as a
 * call (gcc's choice for this size) the prefetch cursor went through memory at every step and the
 * accumulators through the stack after each tile; the AVX2 build's linear was 6-10 % slower at 16-64
 * rows than its hand-written 3 x 4 tile before the AVX-512 work (bench/kernel_floor.py). */
static inline __attribute__((always_inline)) void tile_wide(float *y, const float *x, const float *w,
                                                            const float *bias, int64_t m, int64_t n0, int64_t N,
                                                            const k_slice *ks, prefetch_run *pf) {
    const int64_t ld = ks->ld, K = ks->len;
    const float *xr[4], *wr[WIDE_W];
    for (int r = 0; r < 4; r++) xr[r] = x + (m + r) * ld + ks->k0;
    for (int i = 0; i < WIDE_W; i++) wr[i] = w + (n0 + i) * ld + ks->k0;
    kvf a[WIDE_W][4];
    for (int i = 0; i < WIDE_W; i++)
        for (int r = 0; r < 4; r++) a[i][r] = kvf_zero();
    int64_t k = 0;
    for (; k + KVF_LANES <= K; k += KVF_LANES) {
        prefetch_step(pf);
        step_wide(a, xr, wr, k, 0);
    }
    if (k < K) step_wide(a, xr, wr, k, 1);
    const __m256 z = _mm256_setzero_ps();
    const int acc = ks->k0 > 0;
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < WIDE_W; i += 4) { /* 4 weight rows' sums per store (3 in the AVX2 build) */
            const int lanes = WIDE_W - i < 4 ? WIDE_W - i : 4;
            const __m256 s1 = lanes > 1 ? kvf_fold(a[i + 1][r]) : z, s2 = lanes > 2 ? kvf_fold(a[i + 2][r]) : z;
            const __m256 s3 = lanes > 3 ? kvf_fold(a[i + 3][r]) : z;
            store_lanes(y + (m + r) * N + n0 + i, hsum4(kvf_fold(a[i][r]), s1, s2, s3), bias ? bias + n0 + i : NULL, acc,
                        lanes);
        }
}

/* Weight rows n0 .. n_end-1 against x rows m0 .. M-1 (tile edges: the x rows a tile leaves over,
 * and the lone x row of a batch-1 decode step): four weight rows at a time, each in its own
 * accumulator, so that four FMA chains run at once where one chain would wait out the FMA's
 * latency at every step. Each output is summed in dot()'s order, so the bits are dot()'s. */
static void edge(float *y, const float *x, const float *w, const float *bias, int64_t m0, int64_t M, int64_t n0,
                 int64_t n_end, int64_t K, int64_t N) {
    for (int64_t m = m0; m < M; m++) {
        const float *xm = x + m * K;
        int64_t n = n0;
        for (; n + 4 <= n_end; n += 4) {
            const float *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t k = 0; k < K; k += 8) {
                const __m256 xv = _mm256_loadu_ps(xm + k);
                a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w0 + k), a0);
                a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w1 + k), a1);
                a2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w2 + k), a2);
                a3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w3 + k), a3);
            }
            store(y, N, m, n, hsum256(a0), bias), store(y, N, m, n + 1, hsum256(a1), bias);
            store(y, N, m, n + 2, hsum256(a2), bias), store(y, N, m, n + 3, hsum256(a3), bias);
        }
        for (; n < n_end; n++) store(y, N, m, n, dot(xm, w + n * K, K), bias);
    }
}

/* Long rows (the down projection's 1536) are reduced in slices, so that a tile's weight rows and
 * x rows fit L1 together (3 x 1536 + 4 x 1536 floats would not). */
#define K_SLICE 768
#define WIDE_TILE_MIN_ROWS 12  /* from here the wide tile is faster (AVX2: equal at 8, 10% ahead at 16) */

/* bias may be NULL. K must be a multiple of 8. */
KVG_API int kvgate_linear_f32(float *y, const float *x, const float *w, const float *bias, int64_t M, int64_t K,
                              int64_t N) {
    if (K % 8 != 0) return -1;
    const int wide = M >= WIDE_TILE_MIN_ROWS;
    const int64_t tile_n = wide ? WIDE_W : 4, tile_m = wide ? 4 : 2, n_tiles = (N + tile_n - 1) / tile_n;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < n_tiles; t++) {
        const int64_t n0 = t * tile_n;
        if (n0 + tile_n > N) {
            edge(y, x, w, bias, 0, M, n0, N, K, N);
            continue;
        }
        /* The next tile's weight rows are one contiguous run: fetch it a slice per pass, so that
         * DRAM is busy all along instead of only during each tile's first pass. */
        const int64_t slices = (K + K_SLICE - 1) / K_SLICE, slice_len = (K / slices + 7) / 8 * 8;
        const int64_t passes = M / tile_m * slices, next_end = n0 + 2 * tile_n < N ? n0 + 2 * tile_n : N;
        const char *pf_next = (const char *)(w + (n0 + tile_n) * K);
        const int64_t lines = n0 + tile_n < N ? ((next_end - n0 - tile_n) * K * 4 + 63) / 64 : 0;
        const int64_t lines_per_pass = passes ? (lines + passes - 1) / passes : 0;
        const int64_t steps = (slice_len + KVF_LANES - 1) / KVF_LANES; /* tile steps per pass */
        prefetch_run pf = {pf_next, pf_next + lines * 64, (lines_per_pass + steps - 1) / steps};
        for (int64_t k0 = 0; k0 < K; k0 += slice_len) {
            const k_slice ks = {k0, K - k0 < slice_len ? K - k0 : slice_len, K};
            for (int64_t m = 0; m + tile_m <= M; m += tile_m) {
                if (wide) tile_wide(y, x, w, bias, m, n0, N, &ks, &pf);
                else tile_4x2(y, x, w, bias, m, n0, N, &ks, &pf);
            }
        }
        edge(y, x, w, bias, M / tile_m * tile_m, M, n0, n0 + tile_n, K, N);
    }
    return 0;
}

/* ------------------------------------------------------------------------------- KV write */

/* cache_k[slot[i]] = k[i], cache_v[slot[i]] = v[i] for the step's n new tokens, one row being
 * kv_heads * head_dim floats; both caches in one call (two index_copy_ per layer cost more in
 * dispatch than in copying at decode). */
KVG_API int kvgate_write_kv_f32(float *cache_k, float *cache_v, const float *k, const float *v,
                                const int64_t *slots, int64_t n, int64_t row) {
    for (int64_t i = 0; i < n; i++) {
        memcpy(cache_k + slots[i] * row, k + i * row, sizeof(float) * row);
        memcpy(cache_v + slots[i] * row, v + i * row, sizeof(float) * row);
    }
    return 0;
}

/* ------------------------------------------------------------------------------- build */

/* The widest vectors this build computes with: 512 when compiled for AVX-512 (the avx512 path),
 * 256 for the AVX2 floor. cpu_kernels.py's tests check that a forced path loads its build. */
KVG_API int kvgate_vector_bits(void) {
#ifdef __AVX512F__
    return 512;
#else
    return 256;
#endif
}
