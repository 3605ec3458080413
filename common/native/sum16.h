// Shared by the C kernels (common/native/build.py builds them): sixteen dot products at once.
//
// `sum16_ordered(v)` reduces 16 vectors of 16 float32 lanes into one vector whose lane i is the
// sum of v[i]'s lanes: a tree of adds over halves (15 shuffle-and-add steps in all, instead of
// a horizontal reduction per vector) and one permute that puts the sums in input order. Call
// `sum16_init()` once first.

#ifndef PDSERVE_SUM16_H
#define PDSERVE_SUM16_H

#if defined(__AVX512F__)
#include <immintrin.h>
#include <stdint.h>

static inline __m512 sum16(const __m512 v[16]) {
    __m512 c[8], e[4], f[2];
    for (int i = 0; i < 8; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        f[i] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * i], e[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(e[2 * i], e[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(f[0], f[1], 0x88), _mm512_shuffle_ps(f[0], f[1], 0xDD));
}

static __m512i SUM16_ORDER;  // where the tree leaves each input's sum, inverted

static void sum16_init(void) {
    __m512 v[16];
    for (int i = 0; i < 16; i++) v[i] = _mm512_set1_ps((float)i);
    float got[16];
    _mm512_storeu_ps(got, sum16(v));
    int32_t inverse[16];  // input i's sum sits in lane inverse[i]
    for (int lane = 0; lane < 16; lane++) inverse[(int)(got[lane] / 16.f + 0.5f)] = lane;
    SUM16_ORDER = _mm512_loadu_si512(inverse);
}

// lane i: the sum of v[i]'s lanes
static inline __m512 sum16_ordered(const __m512 v[16]) {
    return _mm512_permutexvar_ps(SUM16_ORDER, sum16(v));
}
#endif

#endif
