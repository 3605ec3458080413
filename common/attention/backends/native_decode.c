// Paged decode attention on the CPU: one query per sequence over its cached context.
//
// Built and loaded by native_decode.py (common/native/build.py). For each KV head of a sequence:
// its group of G query heads over positions [lo, hi). The rows' byte offsets in the cache are
// worked out once per sequence from the block table, then three passes over a float32 score
// row per query head: scores (q . k, 16 positions at a time, the 16 dot products reduced
// together), softmax (a vectorized exp), and the weighted sum of V (the accumulators of a few
// query heads held in registers). Float32 accumulation throughout; bf16 q and k are multiplied
// with `vdpbf16ps` (exact products, float32 sums) where the CPU has AVX512-BF16. A work item is
// a whole sequence when there are at least 4 per thread, else one KV head; it first writes its
// part of the sequence's new K/V row into the cache (the step's own token, which it attends
// to). Rows are prefetched ahead, every head's part of them on a sequence's first head, and V
// rows into L2 during the score pass: a layer's KV is never in the CPU's caches when the layer
// runs, and without prefetch a first version of this kernel took 2.9x as long on a cold cache
// as on a warm one. With AVX2 and FMA but no AVX-512 (`pdserve_decode_attention_init()` says
// which was built), the same passes 8 lanes wide: 8 positions scored at a time, bf16 rows read
// as float32 by shifting each 16-bit value into the top of a 32-bit lane (the even values of a
// 32-byte load by a shift, the odd ones by a mask, matched by q split the same way). Without
// either, and for head dims the vector code does not take, plain C loops.

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define ISA 2  // what pdserve_decode_attention_init() reports
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA 1
#else
#define ISA 0
#endif
#if ISA > 0
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

#include "../../native/bf16.h"
#include "../../native/exp512.h"
#include "../../native/sum16.h"

#define MAX_GROUP 16
#define MAX_DIM 256
#ifndef PREFETCH_V
#define PREFETCH_V 32  // V rows requested this many positions ahead
#endif
#ifndef PREFETCH_K
#define PREFETCH_K 32  // K rows requested this many positions ahead (whole tiles)
#endif

typedef struct {
    const char *q;           // (B, Hkv * G, D)
    char *out;               // (B, Hkv * G, D)
    char *k, *v;             // (slots, Hkv, D)
    const char *k_new, *v_new;  // (B, Hkv, D): each sequence's new row, or NULL
    const int64_t *new_slots;   // (B,) the slot it goes to
    const int64_t *table;    // (B, table_stride) block ids
    const int64_t *lo, *hi;  // (B,) the valid positions [lo, hi) of each context
    int64_t table_stride, num_kv_heads, group, head_dim, block_size, max_len;
    float scale;
    int elem;  // bytes per element: 2 (bf16) or 4 (fp32)
} Args;

typedef struct {  // one KV head h of sequence b
    const Args *a;
    int64_t b, h, n;      // n = hi - lo positions
    const int64_t *off;   // (n,) byte offset of each position's row (all heads) in k and v
    int64_t head;         // byte offset of head h in a row
    int64_t pf_start, pf_bytes;  // what of each row to prefetch: the heads of the work item
    float *s;             // (G, max_len) scores, then probabilities
} Item;

static inline float load(const char *p, int64_t i, int elem) {
    return elem == 2 ? bf16_to_f32(((const bf16_t *)p)[i]) : ((const float *)p)[i];
}

static void row_offsets(const Args *a, int64_t b, int64_t lo, int64_t hi, int64_t *off) {
    const int64_t bs = a->block_size, row = a->num_kv_heads * a->head_dim * a->elem;
    int64_t pos = lo;
    while (pos < hi) {
        const int64_t blk = pos / bs, end = (blk + 1) * bs < hi ? (blk + 1) * bs : hi;
        const int64_t base = a->table[b * a->table_stride + blk] * bs;
        for (; pos < end; pos++) off[pos - lo] = (base + pos % bs) * row;
    }
}

// ---------------------------------------------------------------------------------------------
// Pass 1: scores s[g][i] = scale * q_g . k_i

static void scores_plain(const Item *it) {
    const Args *a = it->a;
    const int64_t G = a->group, D = a->head_dim;
    const char *q = a->q + (it->b * a->num_kv_heads + it->h) * G * D * a->elem;
    for (int64_t i = 0; i < it->n; i++) {
        const char *k = a->k + it->off[i] + it->head;
        for (int64_t g = 0; g < G; g++) {
            float acc = 0.f;
            for (int64_t d = 0; d < D; d++)
                acc += load(q, g * D + d, a->elem) * load(k, d, a->elem);
            it->s[g * a->max_len + i] = acc * a->scale;
        }
    }
}

#if ISA > 0
static inline void prefetch_row(const char *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

static inline void prefetch_row_l2(const char *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
}

// rows [i0, i1) of K into L1, their V into L2 (the weighted sum finds them there)
static inline void prefetch_kv(const Item *it, int64_t i0, int64_t i1) {
    const char *pf = it->a->k + it->pf_start, *pfv = it->a->v + it->pf_start;
    for (int64_t i = i0; i < i1 && i < it->n; i++) {
        prefetch_row(pf + it->off[i], it->pf_bytes);
        prefetch_row_l2(pfv + it->off[i], it->pf_bytes);
    }
}
#endif

#if ISA == 2

// q . k[i] for 16 rows k[i], one query head: nv 64-byte chunks a row (32 bf16 or 16 fp32)
static inline __m512 dots16(const char *q, const char *const k[16], int64_t nv, int bf) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) {
        __m512 x = _mm512_setzero_ps();
        for (int64_t j = 0; j < nv; j++) {
#if defined(__AVX512BF16__)
            if (bf) {
                x = _mm512_dpbf16_ps(x, (__m512bh)_mm512_loadu_si512(q + j * 64),
                                     (__m512bh)_mm512_loadu_si512(k[i] + j * 64));
                continue;
            }
#endif
            x = _mm512_fmadd_ps(_mm512_loadu_ps(q + j * 64), _mm512_loadu_ps(k[i] + j * 64), x);
        }
        acc[i] = x;
    }
    return sum16_ordered(acc);
}

static int scores_avx512(const Item *it) {
    const Args *a = it->a;
    const int64_t G = a->group, D = a->head_dim, bytes = D * a->elem;
    const int bf = a->elem == 2;
    if (bytes % 64 != 0) return 0;
#if !defined(__AVX512BF16__)
    if (bf) return 0;
#endif
    const char *q = a->q + (it->b * a->num_kv_heads + it->h) * G * bytes;
    const __m512 scale = _mm512_set1_ps(a->scale);
    prefetch_kv(it, 0, PREFETCH_K);
    for (int64_t p0 = 0; p0 < it->n; p0 += 16) {
        const int64_t n = it->n - p0 < 16 ? it->n - p0 : 16;
        const char *k[16];
        for (int64_t i = 0; i < 16; i++) k[i] = a->k + it->off[p0 + (i < n ? i : 0)] + it->head;
        prefetch_kv(it, p0 + PREFETCH_K, p0 + PREFETCH_K + 16);
        for (int64_t g = 0; g < G; g++) {
            __m512 r = _mm512_mul_ps(dots16(q + g * bytes, k, bytes / 64, bf), scale);
            _mm512_mask_storeu_ps(it->s + g * a->max_len + p0, (__mmask16)((1u << n) - 1), r);
        }
    }
    return 1;
}

#endif


#if ISA == 1
// one vector of 8 lanes from 8: lane i is the sum of v[i]'s lanes (one reduction for 8 rows)
static inline __m256 sum8(const __m256 v[8]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

static inline __m256 bf16_even(__m256i x) {  // values 0, 2, .. 14 of 16 bf16, as float32
    return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}

static inline __m256 bf16_odd(__m256i x) {  // values 1, 3, .. 15
    return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000u)));
}

// q . k[i] for 8 rows k[i], one query head in float32: nv 32-byte chunks a row (8 fp32, or 16
// bf16 whose even and odd values meet q's 16 values split the same way, evens first)
static inline __m256 dots8(const float *q, const char *const k[8], int64_t nv, int bf) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nv; j++) {
        if (bf) {
            const __m256 qe = _mm256_loadu_ps(q + 16 * j), qo = _mm256_loadu_ps(q + 16 * j + 8);
            for (int i = 0; i < 8; i++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(k[i] + 32 * j));
                acc[i] = _mm256_fmadd_ps(qe, bf16_even(x), acc[i]);
                acc[i] = _mm256_fmadd_ps(qo, bf16_odd(x), acc[i]);
            }
        } else {
            const __m256 qv = _mm256_loadu_ps(q + 8 * j);
            for (int i = 0; i < 8; i++) {
                const __m256 x = _mm256_loadu_ps((const float *)(k[i] + 32 * j));
                acc[i] = _mm256_fmadd_ps(qv, x, acc[i]);
            }
        }
    }
    return sum8(acc);
}

// the item's G query heads as float32 (G, D): fp32 as it is, bf16 widened into `buf` with
// each 16 values split into evens then odds; NULL where rows are not whole 32-byte chunks
static const float *query_f32(const Item *it, float *buf) {
    const Args *a = it->a;
    const int64_t GD = a->group * a->head_dim;
    if (a->head_dim * a->elem % 32 != 0) return NULL;
    const char *q = a->q + (it->b * a->num_kv_heads + it->h) * GD * a->elem;
    if (a->elem == 4) return (const float *)q;
    for (int64_t c = 0; c < GD; c += 16)
        for (int64_t i = 0; i < 8; i++) {
            buf[c + i] = bf16_to_f32(((const bf16_t *)q)[c + 2 * i]);
            buf[c + 8 + i] = bf16_to_f32(((const bf16_t *)q)[c + 2 * i + 1]);
        }
    return buf;
}

static void scores_avx2(const Item *it, const float *q) {
    const Args *a = it->a;
    const int64_t G = a->group, D = a->head_dim, nv = D * a->elem / 32;
    const __m256 scale = _mm256_set1_ps(a->scale);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    prefetch_kv(it, 0, PREFETCH_K);
    for (int64_t p0 = 0; p0 < it->n; p0 += 8) {
        const int64_t n = it->n - p0 < 8 ? it->n - p0 : 8;
        const char *k[8];
        for (int64_t i = 0; i < 8; i++) k[i] = a->k + it->off[p0 + (i < n ? i : 0)] + it->head;
        prefetch_kv(it, p0 + PREFETCH_K, p0 + PREFETCH_K + 8);
        const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lanes);
        for (int64_t g = 0; g < G; g++) {
            __m256 r = _mm256_mul_ps(dots8(q + g * D, k, nv, a->elem == 2), scale);
            _mm256_maskstore_ps(it->s + g * a->max_len + p0, keep, r);
        }
    }
}

// exp(x) for x <= 0, as exp512: 2^n * p(r), 2^n built in the exponent bits
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float hsum8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}
#endif

// ---------------------------------------------------------------------------------------------
// Pass 2: s <- exp(s - max) in place; returns the sum

static float softmax_row(float *s, int64_t n) {
    float m = -INFINITY, sum = 0.f;
    int64_t i = 0;
#if ISA == 2
    __m512 vm = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + i));
    m = _mm512_reduce_max_ps(vm);
#elif ISA == 1
    __m256 vm = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + i));
    m = hmax8(vm);
#endif
    for (; i < n; i++) m = s[i] > m ? s[i] : m;
    i = 0;
#if ISA == 2
    __m512 vs = _mm512_setzero_ps(), vmax = _mm512_set1_ps(m);
    for (; i + 16 <= n; i += 16) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + i), vmax));
        _mm512_storeu_ps(s + i, e);
        vs = _mm512_add_ps(vs, e);
    }
    sum = _mm512_reduce_add_ps(vs);
#elif ISA == 1
    __m256 vs = _mm256_setzero_ps(), vmax = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmax));
        _mm256_storeu_ps(s + i, e);
        vs = _mm256_add_ps(vs, e);
    }
    sum = hsum8(vs);
#endif
    for (; i < n; i++) {
        s[i] = expf(s[i] - m);
        sum += s[i];
    }
    return sum;
}

// ---------------------------------------------------------------------------------------------
// Pass 3: acc_g = sum_i p[g][i] v_i (not yet divided by the sum)

#if ISA == 2
static inline __m512 load16(const char *p, int bf) {  // 16 values as float32
    if (!bf) return _mm512_loadu_ps(p);
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// query heads [g0, g0 + GC) at once, head dim 16 * NV: GC * NV accumulators in registers when
// both are constants (the dispatch below inlines it for each pair)
static inline __attribute__((always_inline)) void weighted_v_block(const Item *it, float *acc,
                                                                   int64_t g0, int GC, int NV) {
    const Args *a = it->a;
    const int bf = a->elem == 2;
    __m512 r[6][8];
    for (int g = 0; g < GC; g++)
        for (int j = 0; j < NV; j++) r[g][j] = _mm512_setzero_ps();
    const char *pf = a->v + it->pf_start;
    for (int64_t i = 0; i < PREFETCH_V && i < it->n; i++) prefetch_row(pf + it->off[i], it->pf_bytes);
    for (int64_t i = 0; i < it->n; i++) {
        if (i + PREFETCH_V < it->n) prefetch_row(pf + it->off[i + PREFETCH_V], it->pf_bytes);
        const char *v = a->v + it->off[i] + it->head;
        __m512 w[6];
        for (int g = 0; g < GC; g++) w[g] = _mm512_set1_ps(it->s[(g0 + g) * a->max_len + i]);
        for (int j = 0; j < NV; j++) {
            __m512 x = load16(v + j * 16 * a->elem, bf);
            for (int g = 0; g < GC; g++) r[g][j] = _mm512_fmadd_ps(w[g], x, r[g][j]);
        }
    }
    for (int g = 0; g < GC; g++)
        for (int j = 0; j < NV; j++) _mm512_storeu_ps(acc + (g0 + g) * 16 * NV + j * 16, r[g][j]);
}

#define BLOCK_CASE(GC, NV) \
    case (GC) * 16 + (NV): \
        weighted_v_block(it, acc, g0, GC, NV); \
        break;

static int weighted_v_avx512(const Item *it, float *acc) {
    const int64_t G = it->a->group, D = it->a->head_dim;
    if (D % 16 != 0 || D / 16 > 8) return 0;
    const int NV = (int)(D / 16), step = NV <= 2 ? 6 : NV <= 4 ? 4 : 2;  // <= 24 accumulators
    for (int64_t g0 = 0; g0 < G; g0 += step) {
        const int GC = (int)(G - g0 < step ? G - g0 : step);
        switch (GC * 16 + NV) {
            BLOCK_CASE(1, 1) BLOCK_CASE(2, 1) BLOCK_CASE(3, 1) BLOCK_CASE(4, 1) BLOCK_CASE(5, 1)
            BLOCK_CASE(6, 1) BLOCK_CASE(1, 2) BLOCK_CASE(2, 2) BLOCK_CASE(3, 2) BLOCK_CASE(4, 2)
            BLOCK_CASE(5, 2) BLOCK_CASE(6, 2) BLOCK_CASE(1, 3) BLOCK_CASE(2, 3) BLOCK_CASE(3, 3)
            BLOCK_CASE(4, 3) BLOCK_CASE(1, 4) BLOCK_CASE(2, 4) BLOCK_CASE(3, 4) BLOCK_CASE(4, 4)
            BLOCK_CASE(1, 5) BLOCK_CASE(2, 5) BLOCK_CASE(1, 6) BLOCK_CASE(2, 6) BLOCK_CASE(1, 7)
            BLOCK_CASE(2, 7) BLOCK_CASE(1, 8) BLOCK_CASE(2, 8)
            default:
                return 0;
        }
    }
    return 1;
}
#endif

#if ISA == 1
// query heads [g0, g0 + GC) over the 32-byte chunks [c0, c0 + NC) of a row, GC * NC * (1 + BF)
// accumulators in registers (constants: the dispatch below inlines each case); a bf16 chunk
// is two of them, its even values then its odd ones, as they are stored in acc
static inline __attribute__((always_inline)) void weighted_v_block8(const Item *it, float *acc,
                                                                    int64_t g0, int GC,
                                                                    int64_t c0, int NC, int BF) {
    const Args *a = it->a;
    const int64_t D = a->head_dim;
    __m256 r[3][8];
    for (int g = 0; g < GC; g++)
        for (int j = 0; j < NC * (1 + BF); j++) r[g][j] = _mm256_setzero_ps();
    const char *pf = a->v + it->pf_start;
    if (c0 == 0)
        for (int64_t i = 0; i < PREFETCH_V && i < it->n; i++)
            prefetch_row(pf + it->off[i], it->pf_bytes);
    for (int64_t i = 0; i < it->n; i++) {
        if (c0 == 0 && i + PREFETCH_V < it->n)
            prefetch_row(pf + it->off[i + PREFETCH_V], it->pf_bytes);
        const char *v = a->v + it->off[i] + it->head + c0 * 32;
        __m256 w[3];
        for (int g = 0; g < GC; g++) w[g] = _mm256_broadcast_ss(it->s + (g0 + g) * a->max_len + i);
        for (int c = 0; c < NC; c++) {
            if (BF) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(v + 32 * c));
                const __m256 e = bf16_even(x), o = bf16_odd(x);
                for (int g = 0; g < GC; g++) {
                    r[g][2 * c] = _mm256_fmadd_ps(w[g], e, r[g][2 * c]);
                    r[g][2 * c + 1] = _mm256_fmadd_ps(w[g], o, r[g][2 * c + 1]);
                }
            } else {
                const __m256 x = _mm256_loadu_ps((const float *)(v + 32 * c));
                for (int g = 0; g < GC; g++) r[g][c] = _mm256_fmadd_ps(w[g], x, r[g][c]);
            }
        }
    }
    float *dst = acc + g0 * D + c0 * 32 / a->elem;
    for (int g = 0; g < GC; g++)
        for (int j = 0; j < NC * (1 + BF); j++) _mm256_storeu_ps(dst + g * D + 8 * j, r[g][j]);
}

#define BLOCK8_CASE(GC, NC, BF) \
    case (BF) * 64 + (GC) * 8 + (NC): \
        weighted_v_block8(it, acc, g0, GC, c0, NC, BF); \
        break;

// rows are whole 32-byte chunks here (query_f32 said so)
static void weighted_v_avx2(const Item *it, float *acc) {
    const int64_t G = it->a->group, chunks = it->a->head_dim * it->a->elem / 32;
    const int bf = it->a->elem == 2, per = bf ? 2 : 4;  // <= 12 accumulators
    for (int64_t c0 = 0; c0 < chunks; c0 += per) {
        const int NC = (int)(chunks - c0 < per ? chunks - c0 : per);
        for (int64_t g0 = 0; g0 < G; g0 += 3) {
            const int GC = (int)(G - g0 < 3 ? G - g0 : 3);
            switch (bf * 64 + GC * 8 + NC) {
                BLOCK8_CASE(1, 1, 0) BLOCK8_CASE(2, 1, 0) BLOCK8_CASE(3, 1, 0)
                BLOCK8_CASE(1, 2, 0) BLOCK8_CASE(2, 2, 0) BLOCK8_CASE(3, 2, 0)
                BLOCK8_CASE(1, 3, 0) BLOCK8_CASE(2, 3, 0) BLOCK8_CASE(3, 3, 0)
                BLOCK8_CASE(1, 4, 0) BLOCK8_CASE(2, 4, 0) BLOCK8_CASE(3, 4, 0)
                BLOCK8_CASE(1, 1, 1) BLOCK8_CASE(2, 1, 1) BLOCK8_CASE(3, 1, 1)
                BLOCK8_CASE(1, 2, 1) BLOCK8_CASE(2, 2, 1) BLOCK8_CASE(3, 2, 1)
            }
        }
    }
}
#endif

static void weighted_v_plain(const Item *it, float *acc) {
    const Args *a = it->a;
    const int64_t G = a->group, D = a->head_dim;
    memset(acc, 0, sizeof(float) * G * D);
    for (int64_t i = 0; i < it->n; i++) {
        const char *v = a->v + it->off[i] + it->head;
        for (int64_t g = 0; g < G; g++) {
            const float w = it->s[g * a->max_len + i];
            for (int64_t d = 0; d < D; d++) acc[g * D + d] += w * load(v, d, a->elem);
        }
    }
}

// ---------------------------------------------------------------------------------------------

static void attend_head(Item *it) {
    const Args *a = it->a;
    const int64_t G = a->group, D = a->head_dim;
    int done = 0, split = 0;  // split: acc holds each 16 values as evens then odds
#if ISA == 2
    done = scores_avx512(it);
#elif ISA == 1
    float qbuf[MAX_GROUP * MAX_DIM];
    const float *q = query_f32(it, qbuf);
    if (q != NULL) scores_avx2(it, q);
    done = q != NULL;
#endif
    if (!done) scores_plain(it);
    float sums[MAX_GROUP], acc[MAX_GROUP * MAX_DIM];
    for (int64_t g = 0; g < G; g++) sums[g] = softmax_row(it->s + g * a->max_len, it->n);
#if ISA == 2
    done = weighted_v_avx512(it, acc);
#elif ISA == 1
    if (done) weighted_v_avx2(it, acc);
    split = done && a->elem == 2;
#endif
    if (!done) weighted_v_plain(it, acc);
    char *out = a->out + (it->b * a->num_kv_heads + it->h) * G * D * a->elem;
    for (int64_t g = 0; g < G; g++) {
        const float inv = 1.f / sums[g];
        for (int64_t d = 0; d < D; d++) {
            const int64_t at = split ? (d & ~15) + (d & 1) * 8 + ((d & 15) >> 1) : d;
            const float x = acc[g * D + at] * inv;
            if (a->elem == 2)
                ((bf16_t *)out)[g * D + d] = f32_to_bf16(x);
            else
                ((float *)out)[g * D + d] = x;
        }
    }
}

// KV heads [h0, h1) of sequence b, one after the other; the first one's passes prefetch the
// rows of all of them (a block's rows are contiguous), so the others read them from the cache
static void attend(const Args *a, int64_t b, int64_t h0, int64_t h1, float *scratch) {
    const int64_t lo = a->lo[b], hi = a->hi[b], G = a->group;
    const int64_t bytes = a->head_dim * a->elem;
    if (a->k_new != NULL) {  // the step's own row first: its heads [h0, h1), which it attends to
        const int64_t row = a->num_kv_heads * bytes, src = b * row + h0 * bytes;
        const int64_t dst = a->new_slots[b] * row + h0 * bytes;
        memcpy(a->k + dst, a->k_new + src, (h1 - h0) * bytes);
        memcpy(a->v + dst, a->v_new + src, (h1 - h0) * bytes);
    }
    int64_t *off = (int64_t *)(scratch + G * a->max_len + (G * a->max_len) % 2);
    row_offsets(a, b, lo, hi, off);
    for (int64_t h = h0; h < h1; h++) {
        const int first = h == h0;
        Item it = {a, b, h, hi - lo, off, h * bytes, first ? h0 * bytes : h * bytes,
                   first ? (h1 - h0) * bytes : bytes, scratch};
        attend_head(&it);
    }
}

// floats of scratch each thread needs: the scores and the row offsets
int64_t pdserve_decode_attention_scratch(int64_t group, int64_t max_len) {
    return group * max_len + (group * max_len) % 2 + 2 * max_len;
}

int pdserve_decode_attention(const void *q, void *out, void *k, void *v, const void *k_new,
                             const void *v_new, const int64_t *new_slots,
                             const int64_t *table, int64_t table_stride, const int64_t *lo,
                             const int64_t *hi, float *scratch, int64_t batch,
                             int64_t num_kv_heads, int64_t group, int64_t head_dim,
                             int64_t block_size, int64_t max_len, float scale, int is_bf16,
                             int threads) {
    if (group > MAX_GROUP || head_dim > MAX_DIM) return -1;
    Args a = {.q = q, .out = out, .k = k, .v = v, .k_new = k_new, .v_new = v_new,
              .new_slots = new_slots, .table = table, .lo = lo, .hi = hi,
              .table_stride = table_stride, .num_kv_heads = num_kv_heads, .group = group,
              .head_dim = head_dim, .block_size = block_size, .max_len = max_len,
              .scale = scale, .elem = is_bf16 ? 2 : 4};
    const int64_t per_thread = pdserve_decode_attention_scratch(group, max_len);
    // a work item is a whole sequence when there are enough of them to share out, else a head
    const int64_t heads = batch >= 4 * threads ? num_kv_heads : 1;
    const int64_t per_seq = num_kv_heads / heads;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < batch * per_seq; item++) {
        int tid = 0;
#if defined(_OPENMP)
        tid = omp_get_thread_num();
#endif
        const int64_t b = item / per_seq, h0 = item % per_seq * heads;
        attend(&a, b, h0, h0 + heads, scratch + tid * per_thread);
    }
    return 0;
}

// which vector code was built: 2 AVX-512, 1 AVX2 and FMA, 0 none (plain C)
int pdserve_decode_attention_init(void) {
#if ISA == 2
    sum16_init();
#endif
    return ISA;
}
