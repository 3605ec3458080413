// Shared by the C kernels (common/native/build.py builds them): bfloat16 as its 16 bits, and the
// two conversions, scalar. float32 -> bf16 rounds to nearest even, as torch does; NaN stays NaN.

#ifndef PDSERVE_BF16_H
#define PDSERVE_BF16_H

#include <stdint.h>
#include <string.h>

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

#endif
