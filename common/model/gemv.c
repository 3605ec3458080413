// y (M, N) = x (M, K) . w (N, K)^T (+ bias) for the few rows of a decode step (M <= 4).
//
// Built and loaded by common/native/build.py; called from packed_linear.py. At one or two rows
// a linear layer only streams its weight, and oneDNN's packed GEMM read it at 16-19 GB/s of the
// ~33 GB/s this box reads: here each thread streams its own run of weight rows, 16 rows at a
// time, their 16 dot products reduced by one tree of shuffles. bf16 products with `vdpbf16ps`
// (exact, float32 sums), float32 with FMAs; the output rounded to bf16 to nearest even. Needs
// AVX-512 (and AVX512-BF16 for bf16): `pdserve_gemv_supports` says which dtypes run here.

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "../native/sum16.h"

#define MAX_ROWS 4

#if defined(__AVX512F__)
static inline __m512 dot_chunk(__m512 acc, const char *x, const char *w, int bf) {
#if defined(__AVX512BF16__)
    if (bf)
        return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x),
                                (__m512bh)_mm512_loadu_si512(w));
#endif
    (void)bf;
    return _mm512_fmadd_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(w), acc);
}

// rows [n0, n0 + count) of the output, count <= 16, for every input row
static void tile(const char *x, const char *w, const char *bias, char *y, int64_t M, int64_t N,
                 int64_t K, int bf, int64_t n0, int64_t count) {
    const int64_t elem = bf ? 2 : 4, row = K * elem, chunks = row / 64;
    for (int64_t m = 0; m < M; m++) {
        __m512 acc[16];
        const char *xm = x + m * row;
        for (int64_t i = 0; i < 16; i++) {
            const char *wr = w + (n0 + (i < count ? i : 0)) * row;
            __m512 a = _mm512_setzero_ps();
            for (int64_t j = 0; j < chunks; j++) a = dot_chunk(a, xm + j * 64, wr + j * 64, bf);
            acc[i] = a;
        }
        __m512 r = sum16_ordered(acc);
        const __mmask16 mask = (__mmask16)((1u << count) - 1);
        if (bias != NULL) {
            __m512 b = bf ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                _mm256_maskz_loadu_epi16(mask, bias + n0 * 2)), 16))
                          : _mm512_maskz_loadu_ps(mask, bias + n0 * 4);
            r = _mm512_add_ps(r, b);
        }
        char *ym = y + (m * N + n0) * elem;
#if defined(__AVX512BF16__)
        if (bf) {
            _mm256_mask_storeu_epi16(ym, mask, (__m256i)_mm512_cvtneps_pbh(r));
            continue;
        }
#endif
        _mm512_mask_storeu_ps(ym, mask, r);
    }
}
#endif

int pdserve_gemv_supports(int is_bf16) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    (void)is_bf16;
    return 1;
#elif defined(__AVX512F__)
    return !is_bf16;
#else
    (void)is_bf16;
    return 0;
#endif
}

void pdserve_gemv_init(void) {
#if defined(__AVX512F__)
    sum16_init();
#endif
}

// 0 done; -1 not here (shape or CPU): the caller runs its own GEMM
int pdserve_gemv(const void *x, const void *w, const void *bias, void *y, int64_t M, int64_t N,
                 int64_t K, int is_bf16, int threads) {
#if defined(__AVX512F__)
    if (!pdserve_gemv_supports(is_bf16) || M < 1 || M > MAX_ROWS || (K * (is_bf16 ? 2 : 4)) % 64)
        return -1;
    const int64_t tiles = (N + 15) / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * 16, count = N - n0 < 16 ? N - n0 : 16;
        tile((const char *)x, (const char *)w, (const char *)bias, (char *)y, M, N, K, is_bf16,
             n0, count);
    }
    return 0;
#else
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)is_bf16,
        (void)threads;
    return -1;
#endif
}
