/* A decode step's whole decoder stack in one call (x86-64 CPUs).
 *
 * A decode layer is ~13 small kernel calls; from Python each costs a ctypes call and a few tensor
 * checks, ~0.2 ms per layer, which at batch 1 is a third of the step. This runs the same kernels
 * in the same order as the Python path (KernelOps, KernelLinear, the "cpu" attention backend), so
 * its results are bit-identical to it:
 *
 *   for each layer:
 *     residual, x = add_rms_norm(residual, delta, input_norm)     (layer 0: residual = embeddings)
 *     q, k, v = x Wq, x Wk, x Wv;  rope(q, k);  k -= k_offset (if any);  write k, v into their slots
 *     delta = paged_decode(q) Wo
 *     residual, x = add_rms_norm(residual, delta, post_norm)
 *     delta = (silu(x Wgate) * x Wup) Wdown
 *   out = add_rms_norm(residual, delta, final_norm)
 *
 * A linear is float32 (kvgate_linear_f32) or int4 (kvgate_int4_linear_f32), per layer as the
 * model was built: an int4 model runs its packed weights here as on the per-layer path.
 *
 * Every row must be a short query (decode, or the few rows of a verification) and M within what
 * the linear kernel serves; the caller checks both, and every pointer's dtype and layout. */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "simd_math.h"

typedef struct {
    const float *w, *bias; /* (n, k) row-major, or NULL for an int4 layer; bias (n,) or NULL */
    int64_t n, k;
    /* An int4 layer (the AutoAWQ GEMM tensors, see int4_linear.c), or all NULL: the float w.
     * The offset variant (GGUF Q4_0 / Q4_1) has offsets in place of qzeros. */
    const int32_t *qweight, *qzeros;  /* (k, n/8), (k/group, n/8) */
    const uint16_t *scales, *offsets; /* (k/group, n) fp16 bits */
    int64_t group;
} kvg_linear;

typedef struct {
    const float *input_norm, *post_norm; /* (hidden,) */
    kvg_linear q, k, v, o, gate, up, down;
    float *cache_k, *cache_v; /* (num_blocks, block_size, kv_heads, head_dim) */
    const kvg_kv *kv;         /* a quantized cache (fp8, int8), or NULL: the float32 cache_k / cache_v */
    /* (kv_heads, head_dim), or NULL: subtracted from every new key before it is written (a calibrated
     * fp8 cache stores keys minus their mean: kv_cache.KVLayer.k_offset, Attention.forward) */
    const float *k_offset;
} kvg_layer;

typedef struct {
    int64_t hidden, num_heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
} kvg_dims;

/* The paged cache side of the step (see kvgate_paged_decode_f32). */
typedef struct {
    const int64_t *positions, *slots, *block_tables, *row_seq, *row_keys;
    const float *cos, *sin; /* (max_positions, head_dim / 2) */
    int64_t table_stride, chunk_blocks;
} kvg_step;

/* k (M, kv_heads * head_dim) -= offset (kv_heads * head_dim,) row by row: Attention.forward's
 * `k - kv.k_offset`, one float32 subtraction per value, so the stored keys are bit-identical to it. */
static void subtract_key_offset(float *k, const float *offset, int64_t M, int64_t row) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < row; j++) k[i * row + j] -= offset[j];
}

/* The kernel the layer's linear method calls on the per-layer path: int4 or float. */
static int project(const kvg_linear *l, const float *x, float *y, int64_t M) {
    if (l->qweight && l->offsets)
        return kvgate_int4_linear_off_f32(y, x, l->qweight, l->offsets, l->scales, l->bias, M, l->k, l->n, l->group);
    if (l->qweight)
        return kvgate_int4_linear_f32(y, x, l->qweight, l->qzeros, l->scales, l->bias, M, l->k, l->n, l->group);
    return kvgate_linear_f32(y, x, l->w, l->bias, M, l->k, l->n);
}

static int layer_forward(const kvg_layer *L, const kvg_dims *d, const kvg_step *s, float *residual,
                         const float *delta_in, float *delta, float *x, float *q, float *k, float *v, float *attn,
                         float *gate, float *up, int64_t M) {
    const int64_t H = d->num_heads, KV = d->kv_heads, D = d->head_dim;
    int rc = kvgate_add_rms_norm_f32(residual, delta_in, L->input_norm, x, M, d->hidden, d->eps);
    rc |= project(&L->q, x, q, M) | project(&L->k, x, k, M) | project(&L->v, x, v, M);
    rc |= kvgate_rope_qk_f32(q, k, s->positions, s->cos, s->sin, M, H, KV, D);
    if (L->k_offset) subtract_key_offset(k, L->k_offset, M, KV * D);
    if (L->kv) { /* the same two kernels the "cpu" backend calls for a quantized cache */
        const kvg_kv *c = L->kv;
        rc |= kvgate_write_kv_q((void *)c->cache_k, (void *)c->cache_v, (float *)c->k_scales, (float *)c->v_scales, k, v,
                                s->slots, M, KV, D, (int)c->fmt, c->k_scale, c->v_scale, c->clamped);
        rc |= kvgate_paged_decode_q(attn, q, c, s->block_tables, s->table_stride, s->row_seq, s->row_keys, M, H, KV, D,
                                    d->block_size, d->scale, s->chunk_blocks);
    } else {
        rc |= kvgate_write_kv_f32(L->cache_k, L->cache_v, k, v, s->slots, M, KV * D);
        rc |= kvgate_paged_decode_f32(attn, q, L->cache_k, L->cache_v, s->block_tables, s->table_stride, s->row_seq,
                                      s->row_keys, M, H, KV, D, d->block_size, d->scale, s->chunk_blocks);
    }
    rc |= project(&L->o, attn, delta, M);
    rc |= kvgate_add_rms_norm_f32(residual, delta, L->post_norm, x, M, d->hidden, d->eps);
    rc |= project(&L->gate, x, gate, M) | project(&L->up, x, up, M);
    rc |= kvgate_silu_mul_f32(gate, gate, up, M, d->intermediate);
    rc |= project(&L->down, gate, delta, M);
    return rc;
}

/*   h:   (M, hidden) the embeddings of the step's tokens; the residual stream afterwards
 *   out: (M, hidden) the final norm of the stream
 * Returns 0, or < 0 on bad arguments (from any kernel) or no memory. */
KVG_API int kvgate_decode_layers_f32(const kvg_layer *layers, int64_t num_layers, const kvg_dims *d,
                                     const kvg_step *s, const float *final_norm, float *h, float *out, int64_t M) {
    const int64_t hd = d->num_heads * d->head_dim, kvd = d->kv_heads * d->head_dim;
    const int64_t per_row = 2 * d->hidden + 2 * hd + 2 * kvd + 2 * d->intermediate;
    float *buf = (float *)malloc(sizeof(float) * per_row * M);
    if (!buf) return -2;
    float *x = buf, *delta = x + M * d->hidden, *q = delta + M * d->hidden, *attn = q + M * hd;
    float *k = attn + M * hd, *v = k + M * kvd, *gate = v + M * kvd, *up = gate + M * d->intermediate;
    int rc = 0;
    for (int64_t i = 0; i < num_layers && rc == 0; i++)
        rc = layer_forward(&layers[i], d, s, h, i == 0 ? NULL : delta, delta, x, q, k, v, attn, gate, up, M);
    if (rc == 0) rc = kvgate_add_rms_norm_f32(h, num_layers ? delta : NULL, final_norm, out, M, d->hidden, d->eps);
    free(buf);
    return rc;
}
