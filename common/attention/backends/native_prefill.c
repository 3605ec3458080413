// Causal prefill attention on the CPU: each sequence's new tokens over their own K/V.
//
// Built and loaded by native_prefill.py (common/native/build.py). One call takes all of a step's
// prefill sequences that have no cached prefix: sequence s is tokens [begin[s], end[s]) of q, k
// and v (rows of `*_stride` elements, heads of head_dim contiguous in them). Two phases in one
// OpenMP region:
//   1. pack: each (sequence, KV head)'s K and V into tiles of 32 positions laid out for the
//      multiply (zero past the sequence's end), shared by every query block that reads them;
//   2. attend: a work item is one KV head's G query heads at BQ query positions of a sequence
//      (rows = BQ * G, ordered position-major); it walks the key tiles up to its last position,
//      four rows at a time, with an online (flash-style) softmax in float32: per row a running
//      max m, sum l and output accumulator O, rescaled when m grows.
// Float32 accumulation throughout. With AVX-512 BF16, q.k runs on `vdpbf16ps` (exact products
// of bf16 pairs, float32 sums; K packed as (D/2 pairs, 32 keys, 2)); p.v runs in float32 on V
// packed as (32 keys, D) floats, with p unrounded: rounding p to bf16 for `vdpbf16ps` there
// was ~15% faster but put each output ~10% further from float64 than a correctly rounded one,
// enough to flip a greedy near-tie (SmolLM2's first token for "What is the capital of
// France?"). With AVX-512 and float32 inputs, the same tiles in float32 and `vfmadd`.
// Otherwise (AVX2, no AVX-512, bf16 without AVX512-BF16, head dims not a multiple of 16) the
// generic code: float32 tiles and plain C loops over 32 keys and over D, which -O3 vectorizes
// for the target (`pdserve_prefill_attention_init()` says which was built).

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define ISA 3  // what pdserve_prefill_attention_init() reports
#elif defined(__AVX512F__)
#define ISA 2
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA 1
#else
#define ISA 0
#endif
#if ISA >= 2
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

#include "../../native/bf16.h"
#include "../../native/exp512.h"

#define MAX_GROUP 16
#define MAX_DIM 256
#define KT 32          // keys a tile
#define ROWS 96        // query rows (positions x group heads) a work item aims for
#define MAX_ROWS 128   // rows a work item holds at most (BQ * G rounded up to 4)

typedef struct {
    const char *q, *k, *v;
    char *out;
    int64_t q_stride, k_stride, v_stride, out_stride;  // elements a token's row
    const int64_t *begin, *end;                        // (S,) each sequence's tokens
    const int64_t *pack_at;                            // (S,) its packed tiles' first tile
    int64_t num_seqs, num_kv_heads, group, head_dim, bq;
    float scale;
    int elem;   // bytes per element: 2 (bf16) or 4 (fp32)
    int mode;   // 2: dpbf16 tiles, 1: AVX-512 float32 tiles, 0: generic float32 tiles
    char *pack; // the packed tiles
} Args;

static inline float load(const char *p, int64_t i, int elem) {
    return elem == 2 ? bf16_to_f32(((const bf16_t *)p)[i]) : ((const float *)p)[i];
}

// bytes of one packed tile of K for one KV head (bf16 pairs in mode 2, else float32); its V
// tile, always float32, takes KT * head_dim * 4
static int64_t k_tile_bytes(int64_t head_dim, int mode) {
    return KT * head_dim * (mode == 2 ? 2 : 4);
}

static int64_t tile_pair_bytes(int64_t head_dim, int mode) {
    return k_tile_bytes(head_dim, mode) + KT * head_dim * 4;
}

// the packed K tile t of sequence s, KV head h; its V tile follows it
static char *tile_at(const Args *a, int64_t s, int64_t h, int64_t t) {
    const int64_t pair = tile_pair_bytes(a->head_dim, a->mode);
    return a->pack + ((a->pack_at[s] + t) * a->num_kv_heads + h) * pair;
}

// ---------------------------------------------------------------------------------------------
// Phase 1: pack positions [t * KT, t * KT + KT) of sequence s, KV head h

static void pack_tile(const Args *a, int64_t s, int64_t h, int64_t t) {
    const int64_t D = a->head_dim, n = a->end[s] - a->begin[s], k0 = t * KT;
    char *kp = tile_at(a, s, h, t), *vp = kp + k_tile_bytes(D, a->mode);
    memset(kp, 0, tile_pair_bytes(D, a->mode));
    const char *krow = a->k + ((a->begin[s] + k0) * a->k_stride + h * D) * a->elem;
    const char *vrow = a->v + ((a->begin[s] + k0) * a->v_stride + h * D) * a->elem;
    const int64_t kstep = a->k_stride * a->elem, vstep = a->v_stride * a->elem;
    for (int64_t j = 0; j < KT && k0 + j < n; j++) {
        const char *kr = krow + j * kstep, *vr = vrow + j * vstep;
        if (a->mode == 2) {  // K (D/2, KT, 2) as 32-bit pairs of bf16
            const uint32_t *k32 = (const uint32_t *)kr;
            for (int64_t p = 0; p < D / 2; p++) ((uint32_t *)kp)[p * KT + j] = k32[p];
        } else {  // K (D, KT) float32
            for (int64_t d = 0; d < D; d++) ((float *)kp)[d * KT + j] = load(kr, d, a->elem);
        }
        for (int64_t d = 0; d < D; d++) ((float *)vp)[j * D + d] = load(vr, d, a->elem);  // (KT, D)
    }
}

// ---------------------------------------------------------------------------------------------
// Phase 2: one work item. Rows r in [0, rows): position p0 + r / G, query head h * G + r % G.

typedef struct {
    const Args *a;
    int64_t s, h, p0, rows;
    const char *q[MAX_ROWS];  // each row's query (clamped to the last row past `rows`)
    int64_t pos[MAX_ROWS];    // each row's position in its sequence
    float *o, *m, *l;         // (MAX_ROWS, D), (MAX_ROWS,), (MAX_ROWS,)
    float *lv;                // (MAX_ROWS, 16): l lane by lane in the vector code
} Item;

// generic: one row over one tile: scores, online softmax, p.v (the compiler vectorizes the
// loops over the KT keys and over D)
static void row_tile_generic(const Item *it, int64_t r, int64_t t) {
    const Args *a = it->a;
    const int64_t D = a->head_dim, k0 = t * KT;
    const float *kp = (const float *)tile_at(a, it->s, it->h, t);
    const float *vp = kp + KT * D;
    float s[KT], qf[MAX_DIM];
    for (int64_t d = 0; d < D; d++) qf[d] = load(it->q[r], d, a->elem);
    for (int j = 0; j < KT; j++) s[j] = 0.f;
    for (int64_t d0 = 0; d0 < D; d0 += 32) {  // blocked sums: rounding grows with 32 + D / 32
        float part[KT] = {0.f};
        for (int64_t d = d0; d < D && d < d0 + 32; d++)
            for (int j = 0; j < KT; j++) part[j] += qf[d] * kp[d * KT + j];
        for (int j = 0; j < KT; j++) s[j] += part[j];
    }
    const int64_t valid = it->pos[r] - k0 + 1 < KT ? it->pos[r] - k0 + 1 : KT;  // >= 1
    float mt = -INFINITY;
    for (int64_t j = 0; j < valid; j++) {
        s[j] *= a->scale;
        mt = s[j] > mt ? s[j] : mt;
    }
    float *o = it->o + r * D;
    const float m_old = it->m[r], m_new = mt > m_old ? mt : m_old;
    if (m_new > m_old) {
        const float corr = expf(m_old - m_new);  // 0 on the first tile (m_old = -inf)
        it->l[r] *= corr;
        for (int64_t d = 0; d < D; d++) o[d] *= corr;
        it->m[r] = m_new;
    }
    float sum = 0.f;
    for (int64_t j = 0; j < valid; j++) {
        s[j] = expf(s[j] - m_new);
        sum += s[j];
    }
    it->l[r] += sum;
    float part[MAX_DIM] = {0.f};  // the tile's sum, then added: blocked, as the scores
    for (int64_t j = 0; j < valid; j++)
        for (int64_t d = 0; d < D; d++) part[d] += s[j] * vp[j * D + d];
    for (int64_t d = 0; d < D; d++) o[d] += part[d];
}

#if ISA >= 2

static inline __m512 bf16x16_to_f32(__m256i x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

// scores of 4 rows over one tile's 32 keys: s[i][0] keys 0-15, s[i][1] keys 16-31
static inline __attribute__((always_inline)) void scores4(const Item *it, int64_t r0,
                                                          const char *kp, __m512 s[4][2],
                                                          int bf) {
    const int64_t D = it->a->head_dim;
    for (int i = 0; i < 4; i++) s[i][0] = s[i][1] = _mm512_setzero_ps();
    const char *const *q = it->q + r0;  // the 4 rows' queries (loops over them unroll)
#if ISA == 3
    if (bf) {
        for (int64_t p = 0; p < D / 2; p++) {
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + p * 128);
            const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + p * 128 + 64);
            for (int i = 0; i < 4; i++) {
                const __m512bh b = (__m512bh)_mm512_set1_epi32(((const int32_t *)q[i])[p]);
                s[i][0] = _mm512_dpbf16_ps(s[i][0], b, k0);
                s[i][1] = _mm512_dpbf16_ps(s[i][1], b, k1);
            }
        }
        return;
    }
#endif
    (void)bf;
    __m512 part[4][2];
    for (int i = 0; i < 4; i++) part[i][0] = part[i][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        if (d % 32 == 0 && d > 0) {  // blocked sums: rounding grows with 32 + D / 32
            for (int i = 0; i < 4; i++) {
                part[i][0] = _mm512_add_ps(part[i][0], s[i][0]);
                part[i][1] = _mm512_add_ps(part[i][1], s[i][1]);
                s[i][0] = s[i][1] = _mm512_setzero_ps();
            }
        }
        const __m512 k0 = _mm512_loadu_ps(kp + d * 128), k1 = _mm512_loadu_ps(kp + d * 128 + 64);
        for (int i = 0; i < 4; i++) {
            const __m512 b = _mm512_set1_ps(((const float *)q[i])[d]);
            s[i][0] = _mm512_fmadd_ps(b, k0, s[i][0]);
            s[i][1] = _mm512_fmadd_ps(b, k1, s[i][1]);
        }
    }
    for (int i = 0; i < 4; i++) {
        s[i][0] = _mm512_add_ps(part[i][0], s[i][0]);
        s[i][1] = _mm512_add_ps(part[i][1], s[i][1]);
    }
}

// online softmax of one row's 32 scores: p written to `pw` (32 float32); m, l and
// the row's O (rescaled) updated
static inline __attribute__((always_inline)) void softmax_row(const Item *it, int64_t r,
                                                              int64_t k0, __m512 s0, __m512 s1,
                                                              float *pw) {
    const int64_t D = it->a->head_dim;
    const int64_t valid = it->pos[r] - k0 + 1;  // keys of the tile this row sees (may be <= 0)
    const int64_t v0 = valid < 0 ? 0 : valid > 16 ? 16 : valid;
    const int64_t v1 = valid < 16 ? 0 : valid > 32 ? 16 : valid - 16;
    const __mmask16 m0 = (__mmask16)((1u << v0) - 1), m1 = (__mmask16)((1u << v1) - 1);
    const __m512 scale = _mm512_set1_ps(it->a->scale), ninf = _mm512_set1_ps(-INFINITY);
    s0 = _mm512_mask_mul_ps(ninf, m0, s0, scale);
    s1 = _mm512_mask_mul_ps(ninf, m1, s1, scale);
    const float mt = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
    const float m_old = it->m[r];
    if (mt > m_old) {
        float *o = it->o + r * D;
        const float corr = expf(m_old - mt);  // 0 on the first tile (m_old = -inf)
        const __m512 c = _mm512_set1_ps(corr);
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(o + d, _mm512_mul_ps(c, _mm512_loadu_ps(o + d)));
        _mm512_storeu_ps(it->lv + 16 * r, _mm512_mul_ps(c, _mm512_loadu_ps(it->lv + 16 * r)));
        it->m[r] = mt;
    }
    const __m512 mx = _mm512_set1_ps(it->m[r]);
    __m512 p0 = _mm512_maskz_mov_ps(m0, exp512(_mm512_sub_ps(s0, mx)));
    __m512 p1 = _mm512_maskz_mov_ps(m1, exp512(_mm512_sub_ps(s1, mx)));
    _mm512_storeu_ps(pw, p0);
    _mm512_storeu_ps(pw + 16, p1);
    p0 = _mm512_add_ps(p0, p1);
    _mm512_storeu_ps(it->lv + 16 * r, _mm512_add_ps(p0, _mm512_loadu_ps(it->lv + 16 * r)));
}

// O of 4 rows, head dims [c0 * 16, (c0 + NC) * 16), += p . v over one tile: 4 * NC
// accumulators in registers (NC a constant where inlined)
static inline __attribute__((always_inline)) void pv4(const Item *it, int64_t r0, const char *vp,
                                                      const float *pf, int64_t c0, int NC) {
    const int64_t D = it->a->head_dim;
    __m512 acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < NC; c++) acc[i][c] = _mm512_setzero_ps();  // the tile's sum
    for (int64_t j = 0; j < KT; j++) {
        const float *v = (const float *)vp + j * D + c0 * 16;
        __m512 x[4];
        for (int c = 0; c < NC; c++) x[c] = _mm512_loadu_ps(v + c * 16);
        for (int i = 0; i < 4; i++) {
            const __m512 b = _mm512_set1_ps(pf[i * KT + j]);
            for (int c = 0; c < NC; c++) acc[i][c] = _mm512_fmadd_ps(b, x[c], acc[i][c]);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < NC; c++) {
            float *o = it->o + (r0 + i) * D + (c0 + c) * 16;
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), acc[i][c]));
        }
}

// 4 rows [r0, r0 + 4) over tile t
static inline __attribute__((always_inline)) void rows4_tile(const Item *it, int64_t r0,
                                                             int64_t t, int bf) {
    const Args *a = it->a;
    const int64_t D = a->head_dim;
    const char *kp = tile_at(a, it->s, it->h, t), *vp = kp + k_tile_bytes(D, a->mode);
    __m512 s[4][2];
    scores4(it, r0, kp, s, bf);
    float pbuf[4 * KT];  // 4 rows of p in float32
    for (int i = 0; i < 4; i++) softmax_row(it, r0 + i, t * KT, s[i][0], s[i][1], pbuf + i * KT);
    const int64_t chunks = D / 16;
    for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
        switch (chunks - c0 < 4 ? chunks - c0 : 4) {
            case 1: pv4(it, r0, vp, pbuf, c0, 1); break;
            case 2: pv4(it, r0, vp, pbuf, c0, 2); break;
            case 3: pv4(it, r0, vp, pbuf, c0, 3); break;
            default: pv4(it, r0, vp, pbuf, c0, 4); break;
        }
    }
}

static void rows4_tile_f32(const Item *it, int64_t r0, int64_t t) { rows4_tile(it, r0, t, 0); }
#if ISA == 3
static void rows4_tile_bf16(const Item *it, int64_t r0, int64_t t) { rows4_tile(it, r0, t, 1); }
#endif
#endif

static void attend_item(const Args *a, int64_t s, int64_t h, int64_t qb, float *scratch) {
    const int64_t G = a->group, D = a->head_dim, n = a->end[s] - a->begin[s];
    const int64_t p0 = qb * a->bq, p1 = p0 + a->bq < n ? p0 + a->bq : n;
    Item it = {.a = a, .s = s, .h = h, .p0 = p0, .rows = (p1 - p0) * G};
    it.o = scratch;
    it.m = scratch + MAX_ROWS * D;
    it.l = it.m + MAX_ROWS;
    it.lv = it.l + MAX_ROWS;
    const int64_t padded = (it.rows + 3) & ~(int64_t)3;
    for (int64_t r = 0; r < padded; r++) {
        const int64_t rr = r < it.rows ? r : it.rows - 1;
        it.pos[r] = p0 + rr / G;
        it.q[r] = a->q + ((a->begin[s] + it.pos[r]) * a->q_stride + (h * G + rr % G) * D) * a->elem;
        it.m[r] = -INFINITY;
        it.l[r] = 0.f;
    }
    memset(it.o, 0, sizeof(float) * padded * D);
    memset(it.lv, 0, sizeof(float) * padded * 16);
    if (a->mode == 0) {
        for (int64_t t = 0; t * KT < p1; t++)
            for (int64_t r = 0; r < it.rows; r++)
                if (t * KT <= it.pos[r]) row_tile_generic(&it, r, t);
    } else {
#if ISA >= 2
        for (int64_t t = 0; t * KT < p1; t++)
            for (int64_t r0 = 0; r0 < padded; r0 += 4) {
                // rows are in position order: a row with no key in the tile gets p = 0
                if (t * KT > it.pos[r0 + 3]) continue;
#if ISA == 3
                if (a->mode == 2) {
                    rows4_tile_bf16(&it, r0, t);
                    continue;
                }
#endif
                rows4_tile_f32(&it, r0, t);
            }
        for (int64_t r = 0; r < it.rows; r++)
            it.l[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(it.lv + 16 * r));
#endif
    }
    for (int64_t r = 0; r < it.rows; r++) {
        const int64_t pos = p0 + r / G;
        const float l = it.l[r];
        const float *o = it.o + r * D;
        char *dst = a->out + ((a->begin[s] + pos) * a->out_stride + (h * G + r % G) * D) * a->elem;
        int64_t d = 0;
#if ISA >= 2
        for (; d + 16 <= D; d += 16) {
            const __m512 x = _mm512_div_ps(_mm512_loadu_ps(o + d), _mm512_set1_ps(l));
#if ISA == 3
            if (a->elem == 2) {
                _mm256_storeu_si256((__m256i *)(dst + 2 * d), (__m256i)_mm512_cvtneps_pbh(x));
                continue;
            }
#endif
            if (a->elem == 2) break;
            _mm512_storeu_ps(dst + 4 * d, x);
        }
#endif
        for (; d < D; d++) {
            if (a->elem == 2)
                ((bf16_t *)dst)[d] = f32_to_bf16(o[d] / l);
            else
                ((float *)dst)[d] = o[d] / l;
        }
    }
}

// floats of scratch each thread needs
int64_t pdserve_prefill_attention_scratch(int64_t head_dim) {
    return MAX_ROWS * head_dim + 18 * MAX_ROWS;
}

// bytes of packed K/V for `num_tiles` tiles of KT positions (summed over sequences)
int64_t pdserve_prefill_attention_pack_bytes(int64_t num_tiles, int64_t num_kv_heads,
                                             int64_t head_dim, int is_bf16) {
    const int mode = is_bf16 && ISA == 3 && head_dim % 16 == 0 ? 2 : 0;
    return num_tiles * num_kv_heads * tile_pair_bytes(head_dim, mode);
}

int pdserve_prefill_attention(const void *q, void *out, const void *k, const void *v,
                              int64_t q_stride, int64_t k_stride, int64_t v_stride,
                              int64_t out_stride, const int64_t *begin, const int64_t *end,
                              int64_t num_seqs, int64_t num_kv_heads, int64_t group,
                              int64_t head_dim, float scale, int is_bf16, void *pack,
                              float *scratch, int threads) {
    if (group > MAX_GROUP || group < 1 || head_dim > MAX_DIM || head_dim % 2) return -1;
    int mode = 0;
#if ISA >= 2
    if (head_dim % 16 == 0) mode = is_bf16 ? (ISA == 3 ? 2 : 0) : 1;
#endif
    int64_t bq = ROWS / group;
    bq = bq < 4 ? 4 : bq & ~(int64_t)3;  // rows = bq * G <= MAX_ROWS
    if (bq * group > MAX_ROWS) bq = MAX_ROWS / group;
    int64_t *pack_at = malloc(sizeof(int64_t) * 2 * (num_seqs + 1));
    if (pack_at == NULL) return -2;
    int64_t *items = pack_at + num_seqs + 1;
    pack_at[0] = items[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++) {  // running counts: tiles and work items
        const int64_t n = end[s] - begin[s];
        pack_at[s + 1] = pack_at[s] + (n + KT - 1) / KT;
        items[s + 1] = items[s] + num_kv_heads * ((n + bq - 1) / bq);
    }
    Args a = {.q = q, .k = k, .v = v, .out = out, .q_stride = q_stride, .k_stride = k_stride,
              .v_stride = v_stride, .out_stride = out_stride, .begin = begin, .end = end,
              .pack_at = pack_at, .num_seqs = num_seqs, .num_kv_heads = num_kv_heads,
              .group = group, .head_dim = head_dim, .bq = bq, .scale = scale,
              .elem = is_bf16 ? 2 : 4, .mode = mode, .pack = pack};
    const int64_t num_tiles = pack_at[num_seqs], num_items = items[num_seqs];
    const int64_t per_thread = pdserve_prefill_attention_scratch(head_dim);
#pragma omp parallel num_threads(threads)
    {
        int tid = 0;
#if defined(_OPENMP)
        tid = omp_get_thread_num();
#endif
#pragma omp for schedule(static)
        for (int64_t u = 0; u < num_tiles * num_kv_heads; u++) {
            const int64_t tile = u / num_kv_heads, h = u % num_kv_heads;
            int64_t s = 0;
            while (pack_at[s + 1] <= tile) s++;  // few sequences: a scan is enough
            pack_tile(&a, s, h, tile - pack_at[s]);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; i++) {
            int64_t s = 0;
            while (items[s + 1] <= i) s++;
            const int64_t n = end[s] - begin[s], blocks = (n + bq - 1) / bq;
            const int64_t j = i - items[s], h = j / blocks;
            // a sequence's longest items first
            attend_item(&a, s, h, blocks - 1 - j % blocks, scratch + tid * per_thread);
        }
    }
    free(pack_at);
    return 0;
}

// which code was built: 3 AVX-512 with BF16, 2 AVX-512, 1 AVX2 and FMA, 0 none (plain C)
int pdserve_prefill_attention_init(void) { return ISA; }
