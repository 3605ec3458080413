// y (M, N) = x (M, K) . w (N, K)^T (+ bias) for the few rows of a decode step, on a weight
// packed once for it.
//
// Built and loaded by common/native/build.py; called from packed_linear.py. A decode step's
// GEMM has 1-64 rows: there oneDNN's packed GEMM ran at 155 GFLOP/s with 8 rows and 285 with
// 32 on this box, against ~425 at 256 rows and more (its blocking is tuned for tall inputs, and
// at a few rows a GEMM is a stream of its weight). Here the weight is packed in blocks of
// LANES output columns, one register wide: 16 with AVX-512, 8 with AVX2 (the library's own
// pack function lays it out for the code it was built with). For bf16, [N/16][K/2][16][2] (each
// 64-byte line holds one pair of K for 16 columns, the operand layout of `vdpbf16ps`); for
// float32, [N/LANES][K][LANES]. Each thread takes a contiguous run of column blocks and streams
// it once; a micro-tile of up to MR rows by NR blocks keeps MR x NR accumulators in registers,
// broadcasting one input pair (bf16) or value (float32) per row per step. The following MR-row
// tiles of the same column blocks read them from L2. Every output is one float32 sum over K in
// order, whatever M, the tiling and the threads: a row's result does not depend on the batch it
// runs in. bf16 output rounded to nearest even.
// Needs AVX-512 (and AVX512-BF16 for bf16) or AVX2 with FMA (float32 only: a CPU without native
// bf16 never packs a bf16 layer, see packed_linear.py's can_pack); `pdserve_skinny_supports`
// says which dtypes run, `pdserve_skinny_isa` which code.

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define ISA "avx512"
#define LANES 16  // output columns of a block: one register
#define NR 4      // blocks per micro-tile
#define NR_FEW 4  // ... in a pass of at most 3 rows
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA "avx2"
#define LANES 8
#define NR 2      // 6 x 2 accumulators + 2 weights + 1 input of 16 registers
#define NR_FEW 4  // 1-3 rows: 4 independent sums a row hide the FMA latency
#else
#define ISA "none"
#define LANES 16
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define HAS_KERNEL 1
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

#define MR 6                // rows per micro-tile
#define MC 192              // rows per pass over the weight
#define LINE (LANES * 4)    // bytes of one step of one block: LANES x (one bf16 pair | one float)

int pdserve_skinny_supports(int is_bf16) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    (void)is_bf16;
    return 1;
#elif defined(HAS_KERNEL)
    return !is_bf16;
#else
    (void)is_bf16;
    return 0;
#endif
}

// the code this build runs: "avx512", "avx2" or "none" (the caller's own GEMM runs)
const char *pdserve_skinny_isa(void) { return ISA; }

// steps along K: pairs for bf16 (K even), values for float32
static inline int64_t steps_of(int64_t K, int bf) { return bf ? K / 2 : K; }

// bytes of the packed weight; 0 where the shape does not pack (odd K in bf16)
int64_t pdserve_skinny_packed_bytes(int64_t N, int64_t K, int is_bf16) {
    if (N < 1 || K < 1 || (is_bf16 && K % 2)) return 0;
    return (N + LANES - 1) / LANES * steps_of(K, is_bf16) * LINE;
}

// w (N, K) row-major → wp, columns past N zero
void pdserve_skinny_pack(const void *w, void *wp, int64_t N, int64_t K, int is_bf16) {
    const int64_t blocks = (N + LANES - 1) / LANES, steps = steps_of(K, is_bf16);
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t s = 0; s < steps; s++) {
            uint32_t *line = (uint32_t *)((char *)wp + (b * steps + s) * LINE);
            for (int64_t j = 0; j < LANES; j++) {
                const int64_t n = b * LANES + j;
                uint32_t v = 0;
                if (n < N && is_bf16) {
                    const uint16_t *row = (const uint16_t *)w + n * K;
                    v = (uint32_t)row[2 * s] | (uint32_t)row[2 * s + 1] << 16;
                } else if (n < N) {
                    memcpy(&v, (const float *)w + n * K + s, 4);
                }
                line[j] = v;
            }
        }
}

#if defined(HAS_KERNEL)
typedef struct {
    const char *x, *wp, *bias;
    char *y;
    int64_t M, N, steps;  // x's rows are `steps` 4-byte words
    int bf;
} Gemm;

#if defined(__AVX512F__)
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const char *p) { return _mm512_loadu_ps(p); }

// one step of x (one float, or one bf16 pair of K) in every lane
static inline vec broadcast(const uint32_t *x) {
    return _mm512_castsi512_ps(_mm512_set1_epi32((int)*x));
}

// acc + x . w for one step
static inline vec fma_step(vec acc, vec xb, vec w, int bf) {
#if defined(__AVX512BF16__)
    if (bf) return _mm512_dpbf16_ps(acc, (__m512bh)xb, (__m512bh)w);
#endif
    (void)bf;
    return _mm512_fmadd_ps(xb, w, acc);
}

static inline void store(const Gemm *g, vec v, int64_t m, int64_t block) {
    const int64_t n0 = block * 16, left = g->N - n0;
    const __mmask16 mask = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
    if (g->bias != NULL) {
        __m512 b = g->bf ? _mm512_castsi512_ps(_mm512_slli_epi32(
                               _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(
                                   mask, g->bias + n0 * 2)),
                               16))
                         : _mm512_maskz_loadu_ps(mask, g->bias + n0 * 4);
        v = _mm512_add_ps(v, b);
    }
#if defined(__AVX512BF16__)
    if (g->bf) {
        _mm256_mask_storeu_epi16(g->y + (m * g->N + n0) * 2, mask, (__m256i)_mm512_cvtneps_pbh(v));
        return;
    }
#endif
    _mm512_mask_storeu_ps(g->y + (m * g->N + n0) * 4, mask, v);
}
#else  // AVX2 + FMA: float32 only
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const char *p) { return _mm256_loadu_ps((const float *)p); }

// NOTE: not _mm256_broadcast_ss: gcc takes it to read any memory and keeps every accumulator
// stored to the stack after each FMA
static inline vec broadcast(const uint32_t *x) {
    return _mm256_castsi256_ps(_mm256_set1_epi32((int)*x));
}

static inline vec fma_step(vec acc, vec xb, vec w, int bf) {
    (void)bf;
    return _mm256_fmadd_ps(xb, w, acc);
}

static inline void store(const Gemm *g, vec v, int64_t m, int64_t block) {
    const int64_t n0 = block * 8, left = g->N - n0;
    float *y = (float *)g->y + m * g->N + n0;
    const float *bias = (const float *)g->bias + n0;
    if (left >= 8) {
        if (g->bias != NULL) v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
        _mm256_storeu_ps(y, v);
        return;
    }
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    if (g->bias != NULL) v = _mm256_add_ps(v, _mm256_maskload_ps(bias, mask));
    _mm256_maskstore_ps(y, mask, v);
}
#endif

// rows [m0, m0 + mr) by blocks [b0, b0 + nr); mr, nr constants after inlining
// `pf`: a run of the next column blocks to prefetch into L2 meanwhile, `pf_lines` lines a step
static inline __attribute__((always_inline)) void tile(const Gemm *g, int64_t m0, int64_t b0,
                                                       const int mr, const int nr,
                                                       const char *pf, int64_t pf_lines,
                                                       const char *pf_end) {
    vec acc[MR][NR_FEW > NR ? NR_FEW : NR];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < nr; j++) acc[r][j] = vzero();
    const int64_t steps = g->steps, block = steps * LINE;
    const char *w = g->wp + b0 * block;
    const uint32_t *x = (const uint32_t *)g->x + m0 * steps;
    for (int64_t s = 0; s < steps; s++) {
        for (int64_t i = 0; i < pf_lines; i++)
            if (pf + (s * pf_lines + i) * LINE < pf_end)
                _mm_prefetch(pf + (s * pf_lines + i) * LINE, _MM_HINT_T1);
        vec wv[NR_FEW > NR ? NR_FEW : NR];
        for (int j = 0; j < nr; j++) wv[j] = vload(w + j * block + s * LINE);
        for (int r = 0; r < mr; r++) {
            const vec xb = broadcast(x + r * steps + s);
            for (int j = 0; j < nr; j++) acc[r][j] = fma_step(acc[r][j], xb, wv[j], g->bf);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < nr; j++) store(g, acc[r][j], m0 + r, b0 + j);
}

#define TILE_NR(mr)                                        \
    switch (nr) {                                          \
        case 4: tile(g, m0, b0, mr, 4, pf, pf_lines, pf_end); break;  \
        case 3: tile(g, m0, b0, mr, 3, pf, pf_lines, pf_end); break;  \
        case 2: tile(g, m0, b0, mr, 2, pf, pf_lines, pf_end); break;  \
        default: tile(g, m0, b0, mr, 1, pf, pf_lines, pf_end); break; \
    }

static void tile_any(const Gemm *g, int64_t m0, int64_t b0, int mr, int nr, const char *pf,
                     int64_t pf_lines, const char *pf_end) {
    switch (mr) {
        case 6: TILE_NR(6); break;
        case 5: TILE_NR(5); break;
        case 4: TILE_NR(4); break;
        case 3: TILE_NR(3); break;
        case 2: TILE_NR(2); break;
        default: TILE_NR(1); break;
    }
}

// blocks [b_lo, b_hi) of rows [m_lo, m_hi): NR blocks at a time (NR_FEW for a pass of 1-3
// rows), MC rows over them (the rows stay in L2; more rows than that re-stream the weight,
// which prefill's compute hides)
static void run(const Gemm *g, int64_t b_lo, int64_t b_hi, int64_t m_lo, int64_t m_hi) {
    for (int64_t mc = m_lo; mc < m_hi; mc += MC) {
        const int64_t mc_end = m_hi - mc < MC ? m_hi : mc + MC;
        const int64_t group = mc_end - mc <= 3 ? NR_FEW : NR;
        for (int64_t b0 = b_lo; b0 < b_hi; b0 += group) {
            const int nr = b_hi - b0 < group ? (int)(b_hi - b0) : (int)group;
            // the next blocks' lines, spread over this group's tiles: the weight streams in
            // while these rows compute, not when the next group's first tile waits for it
            const int64_t tiles = (mc_end - mc + MR - 1) / MR, block = g->steps * LINE;
            const int64_t next = b_hi - b0 - nr < group ? b_hi - b0 - nr : group;
            const int64_t lines = next * g->steps, per_tile = (lines + tiles - 1) / tiles;
            // (one tile alone is a stream, which the hardware prefetcher follows better)
            const int64_t pf_lines = tiles > 1 ? (per_tile + g->steps - 1) / g->steps : 0;
            const char *pf = g->wp + (b0 + nr) * block;
            for (int64_t m0 = mc, i = 0; m0 < mc_end; m0 += MR, i++)
                tile_any(g, m0, b0, mc_end - m0 < MR ? (int)(mc_end - m0) : MR, nr,
                         pf + i * pf_lines * g->steps * LINE, pf_lines, pf + lines * LINE);
        }
    }
}
#endif

// 0 done; -1 not here (dtype, shape or CPU): the caller runs its own GEMM. x (M, K) and y
// (M, N) row-major, wp from pdserve_skinny_pack
int pdserve_skinny_gemm(const void *x, const void *wp, const void *bias, void *y, int64_t M,
                        int64_t N, int64_t K, int is_bf16, int threads) {
#if defined(HAS_KERNEL)
    if (!pdserve_skinny_supports(is_bf16) || M < 1 || !pdserve_skinny_packed_bytes(N, K, is_bf16))
        return -1;
    const Gemm g = {(const char *)x, (const char *)wp, (const char *)bias, (char *)y,
                    M, N, steps_of(K, is_bf16), is_bf16};
    const int64_t blocks = (N + LANES - 1) / LANES;
    // threads split the column blocks; with many rows and under 64 columns a thread (many
    // cores, a narrow weight) they split the rows too, on a grid of tn x tm threads
    int tn = threads < blocks ? threads : (int)blocks, tm = 1;
    if (M >= 64 && threads > 1) {
        tn = threads;
        while (tn > 1 && (blocks * LANES / tn < 64 || threads % tn)) tn--;
        tm = threads / tn;
    }
#pragma omp parallel num_threads(tn * tm)
    {
#if defined(_OPENMP)
        const int64_t t = omp_get_thread_num();
#else
        const int64_t t = 0;
#endif
        const int64_t bn = t % tn, rm = t / tn;
        run(&g, blocks * bn / tn, blocks * (bn + 1) / tn, M * rm / tm, M * (rm + 1) / tm);
    }
    return 0;
#else
    (void)x, (void)wp, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)is_bf16,
        (void)threads;
    return -1;
#endif
}
