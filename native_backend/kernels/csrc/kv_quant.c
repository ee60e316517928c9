/* Writing K/V into a quantized paged cache (x86-64): fp8 e4m3 / e5m2 with a per-layer scale,
 * int8 with a scale per token and KV head. The rules are attention/kv_quant.py's, bit for bit:
 *
 *   fp8:  stored = fp8(clamp(x / scale, -max, max)), rounded to nearest even (torch's cast)
 *   int8: s = max|x| / 127 over the head's head_dim values; stored = clamp(rint(x / s), -127, 127)
 *         (s = 0: every value is 0, divided by 1), s kept beside the block
 *
 * Reading happens inside the attention kernels (cpu_kernels.c), through a 256-entry table for fp8. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "simd_math.h"

/* float -> fp8 with `man` mantissa bits and exponent bias `bias`, round to nearest even. `f` is
 * finite and already within the format's range (the caller clamps), so no overflow handling.
 *
 *   f = m x 2^(E-23), m the 24-bit significand;  normal target: keep man bits of m
 *   subnormal target (biased exponent <= 0): drop 1 - e more bits, exponent field 0 */
static inline uint8_t encode_fp8(float f, int man, int bias) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    u &= 0x7FFFFFFFu;
    if (u < 0x00800000u) return sign; /* zero, or a float32 subnormal: far below fp8's range */
    int e = (int)(u >> 23) - 127 + bias;
    const uint32_t m = (u & 0x7FFFFFu) | 0x800000u;
    int shift = 23 - man;
    if (e <= 0) shift += 1 - e, e = 0;
    if (shift > 25) return sign; /* below half the smallest subnormal: rounds to zero */
    const uint32_t half = 1u << (shift - 1), rem = m & ((1u << shift) - 1);
    uint32_t q = m >> shift;
    if (rem > half || (rem == half && (q & 1u))) q++;
    /* a mantissa that rounds up to 2^(man+1) carries into the exponent by the addition itself */
    const uint32_t bits = e > 0 ? ((uint32_t)e << man) + q - (1u << man) : q;
    return sign | (uint8_t)bits;
}

/* `clamped` (kv_heads,), or NULL: each head's count of values beyond the format's range, added to
 * (what tells a scale too small for the traffic from plain rounding error). */
static void write_fp8_rows(uint8_t *cache, const float *x, const int64_t *slots, int64_t n, int64_t kv_heads,
                           int64_t D, float scale, int man, int bias, float max, int64_t *clamped) {
    const int64_t row = kv_heads * D;
    for (int64_t i = 0; i < n; i++) {
        uint8_t *dst = cache + slots[i] * row;
        const float *src = x + i * row;
        for (int64_t g = 0; g < kv_heads; g++) {
            int64_t over = 0;
            for (int64_t d = g * D; d < (g + 1) * D; d++) {
                float y = src[d] / scale;
                over += y > max || y < -max;
                y = y > max ? max : (y < -max ? -max : y);
                dst[d] = encode_fp8(y, man, bias);
            }
            if (clamped) clamped[g] += over;
        }
    }
}

static void write_int8_rows(int8_t *cache, float *scales, const float *x, const int64_t *slots, int64_t n,
                            int64_t kv_heads, int64_t D) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t g = 0; g < kv_heads; g++) {
            const float *src = x + (i * kv_heads + g) * D;
            int8_t *dst = cache + (slots[i] * kv_heads + g) * D;
            float amax = 0.0f;
            for (int64_t d = 0; d < D; d++) amax = fabsf(src[d]) > amax ? fabsf(src[d]) : amax;
            const float s = amax / 127.0f, safe = s == 0.0f ? 1.0f : s;
            for (int64_t d = 0; d < D; d++) {
                float r = rintf(src[d] / safe);
                r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
                dst[d] = (int8_t)r;
            }
            scales[slots[i] * kv_heads + g] = s;
        }
}

/*   cache_k/v: (num_blocks, block_size, kv_heads, D) of 1-byte elements; k_scales/v_scales:
 *   (num_blocks * block_size, kv_heads) float32 for int8 (NULL otherwise); k, v: (n, kv_heads, D)
 *   float32; fmt: KVG_KV_FP8_E4M3 | KVG_KV_FP8_E5M2 | KVG_KV_INT8; clamped: fp8's (2, kv_heads)
 *   clamp counters (K, then V), added to, or NULL. Returns 0, or -1 on a bad format. */
KVG_API int kvgate_write_kv_q(void *cache_k, void *cache_v, float *k_scales, float *v_scales, const float *k,
                              const float *v, const int64_t *slots, int64_t n, int64_t kv_heads, int64_t D, int fmt,
                              float k_scale, float v_scale, int64_t *clamped) {
    int64_t *clamped_v = clamped ? clamped + kv_heads : NULL;
    switch (fmt) {
    case KVG_KV_FP8_E4M3:
        write_fp8_rows(cache_k, k, slots, n, kv_heads, D, k_scale, 3, 7, 448.0f, clamped);
        write_fp8_rows(cache_v, v, slots, n, kv_heads, D, v_scale, 3, 7, 448.0f, clamped_v);
        return 0;
    case KVG_KV_FP8_E5M2:
        write_fp8_rows(cache_k, k, slots, n, kv_heads, D, k_scale, 2, 15, 57344.0f, clamped);
        write_fp8_rows(cache_v, v, slots, n, kv_heads, D, v_scale, 2, 15, 57344.0f, clamped_v);
        return 0;
    case KVG_KV_INT8:
        if (!k_scales || !v_scales) return -1;
        write_int8_rows(cache_k, k_scales, k, slots, n, kv_heads, D);
        write_int8_rows(cache_v, v_scales, v, slots, n, kv_heads, D);
        return 0;
    default:
        return -1;
    }
}
