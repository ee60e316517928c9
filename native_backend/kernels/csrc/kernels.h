/* The kernels' entry points, for the sources that call each other (decode_step.c). */
#ifndef KVGATE_KERNELS_H
#define KVGATE_KERNELS_H

#include <stdint.h>

/* How a paged cache stores K/V (kv_cache.py's KVCacheDType.code). */
enum { KVG_KV_F32 = 0, KVG_KV_FP8_E4M3 = 1, KVG_KV_FP8_E5M2 = 2, KVG_KV_INT8 = 3 };

/* A quantized layer's K/V (see kvgate_paged_decode_q): its storage and what decodes it. */
typedef struct {
    const void *cache_k, *cache_v;     /* (num_blocks, block_size, kv_heads, head_dim) */
    const float *k_scales, *v_scales;  /* int8: (num_blocks * block_size, kv_heads); else NULL */
    const float *lut;                  /* fp8: the float value of each of the 256 bytes; else NULL */
    float k_scale, v_scale;            /* fp8: the layer's scales; else 1 */
    int64_t fmt;                       /* KVG_KV_* */
    int64_t *clamped;                  /* fp8: (2, kv_heads) values clamped at the format's max while
                                          written (K row, then V), added to; NULL: not counted */
} kvg_kv;

int kvgate_paged_decode_f32(float *out, const float *q, const float *cache_k, const float *cache_v,
                            const int64_t *block_tables, int64_t table_stride, const int64_t *row_seq,
                            const int64_t *row_keys, int64_t num_rows, int64_t num_heads, int64_t kv_heads,
                            int64_t head_dim, int64_t block_size, float scale, int64_t chunk_blocks);
int kvgate_prefill_attention_f32(float *out, const float *q, const float *cache_k, const float *cache_v,
                                 const int64_t *blocks, int64_t q_len, int64_t ctx, int64_t num_heads,
                                 int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale);
int kvgate_paged_decode_q(float *out, const float *q, const kvg_kv *kv, const int64_t *block_tables,
                          int64_t table_stride, const int64_t *row_seq, const int64_t *row_keys, int64_t num_rows,
                          int64_t num_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                          int64_t chunk_blocks);
int kvgate_write_kv_q(void *cache_k, void *cache_v, float *k_scales, float *v_scales, const float *k, const float *v,
                      const int64_t *slots, int64_t n, int64_t kv_heads, int64_t D, int fmt, float k_scale,
                      float v_scale, int64_t *clamped);
int kvgate_linear_f32(float *y, const float *x, const float *w, const float *bias, int64_t M, int64_t K, int64_t N);
int kvgate_write_kv_f32(float *cache_k, float *cache_v, const float *k, const float *v, const int64_t *slots,
                        int64_t n, int64_t row);
int kvgate_add_rms_norm_f32(float *residual, const float *delta, const float *weight, float *out, int64_t M,
                            int64_t D, float eps);
int kvgate_rope_qk_f32(float *q, float *k, const int64_t *positions, const float *cos, const float *sin, int64_t n,
                       int64_t q_heads, int64_t k_heads, int64_t D);
int kvgate_silu_mul_f32(float *out, const float *gate, const float *up, int64_t M, int64_t N);
int kvgate_int4_linear_f32(float *y, const float *x, const int32_t *qweight, const int32_t *qzeros,
                           const uint16_t *scales, const float *bias, int64_t M, int64_t K, int64_t N, int64_t G);
int kvgate_int4_linear_off_f32(float *y, const float *x, const int32_t *qweight, const uint16_t *offsets,
                               const uint16_t *scales, const float *bias, int64_t M, int64_t K, int64_t N, int64_t G);
int kvgate_int4_supported(void);
int kvgate_vector_bits(void);
int kvgate_int8_rows_f32(float *y, const float *x, const int8_t *w8, const float *scale, int64_t M, int64_t K,
                         int64_t N);

#endif
