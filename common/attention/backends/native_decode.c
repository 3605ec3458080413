// Paged decode attention on the CPU: one query per sequence over its cached context.
//
// Built and loaded by native_decode.py (gcc -O3 -march=native -fopenmp). One work item is
// (sequence, KV head): its group of G query heads over positions [lo, hi) of the sequence,
// read from the cache by slot (block table), in three passes over a float32 score row per
// query head: scores (q . k, 16 positions at a time, the 16 dot products reduced together),
// softmax (a vectorized exp), then the weighted sum of V. Accumulation is float32 throughout;
// bf16 K and Q are multiplied with `vdpbf16ps` (exact products, float32 sums) where the CPU
// has AVX512-BF16. Every other CPU, and head dims that are not a multiple of 32, take the
// plain C loops of the same passes.

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

typedef struct {
    const void *q;             // (B, Hkv * G, D)
    void *out;                 // (B, Hkv * G, D)
    const void *k;             // (slots, Hkv, D)
    const void *v;             // (slots, Hkv, D)
    const int64_t *table;      // (B, table_stride) block ids
    const int64_t *lo, *hi;    // (B,) the valid positions [lo, hi) of each context
    float *scratch;            // (threads, G, max_len) scores
    int64_t table_stride, num_kv_heads, group, head_dim, block_size, max_len;
    float scale;
    int is_bf16;
} Args;

static inline const char *row(const void *base, int64_t slot, int64_t h, const Args *a) {
    int64_t elem = a->is_bf16 ? 2 : 4;
    return (const char *)base + ((slot * a->num_kv_heads + h) * a->head_dim) * elem;
}

static inline int64_t slot_of(const Args *a, int64_t b, int64_t pos) {
    return a->table[b * a->table_stride + pos / a->block_size] * a->block_size + pos % a->block_size;
}

static inline float load(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const bf16_t *)p)[i]) : ((const float *)p)[i];
}

// ---------------------------------------------------------------------------------------------
// Pass 1: scores s[g][pos - lo] = scale * q_g . k_pos

static void scores_plain(const Args *a, int64_t b, int64_t h, float *s, int64_t lo, int64_t hi) {
    const int64_t G = a->group, D = a->head_dim;
    for (int64_t pos = lo; pos < hi; pos++) {
        const char *k = row(a->k, slot_of(a, b, pos), h, a);
        for (int64_t g = 0; g < G; g++) {
            const char *q = row(a->q, b * a->num_kv_heads + h, 0, a) + g * D * (a->is_bf16 ? 2 : 4);
            float acc = 0.f;
            for (int64_t d = 0; d < D; d++) acc += load(q, d, a->is_bf16) * load(k, d, a->is_bf16);
            s[g * a->max_len + pos - lo] = acc * a->scale;
        }
    }
}

#if defined(__AVX512F__)
// 16 vectors in, one out: lane i holds the sum of the lanes of v[perm[i]] (a tree of adds
// over halves; `perm` is fixed, undone by the caller's permute)
static inline __m512 sum16(__m512 v[16]) {
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

static __m512i SUM16_ORDER;  // lane i of sum16's result is the sum of input SUM16_ORDER[i]

static void init_sum16_order(void) {
    __m512 v[16];
    for (int i = 0; i < 16; i++) v[i] = _mm512_set1_ps((float)i);
    float got[16];
    _mm512_storeu_ps(got, sum16(v));
    int32_t inverse[16];  // input i's sum sits in lane inverse[i]
    for (int lane = 0; lane < 16; lane++) inverse[(int)(got[lane] / 16.f + 0.5f)] = lane;
    SUM16_ORDER = _mm512_loadu_si512(inverse);
}

#define MAX_DV 8  // head_dim / 16 (bf16: head_dim / 32) registers per row, head_dim <= 128

static int scores_avx512(const Args *a, int64_t b, int64_t h, float *s, int64_t lo, int64_t hi) {
    const int64_t G = a->group, D = a->head_dim;
    const int bf = a->is_bf16;
    const int64_t nv = bf ? D / 32 : D / 16;
    if ((bf ? D % 32 : D % 16) != 0 || nv > MAX_DV || G > 16) return 0;
#if !defined(__AVX512BF16__)
    if (bf) return 0;
#endif
    __m512 qv[16][MAX_DV];
    const char *qrow = row(a->q, b * a->num_kv_heads + h, 0, a);
    for (int64_t g = 0; g < G; g++)
        for (int64_t j = 0; j < nv; j++)
            qv[g][j] = _mm512_loadu_ps(qrow + (g * D + j * 16 * (bf ? 2 : 1)) * (bf ? 2 : 4));
    const __m512 scale = _mm512_set1_ps(a->scale);
    for (int64_t i = lo; i < lo + 16 && i < hi; i++) {  // the first tile's rows
        const char *first = row(a->k, slot_of(a, b, i), h, a);
        for (int64_t off = 0; off < D * (bf ? 2 : 4); off += 64) _mm_prefetch(first + off, _MM_HINT_T0);
    }
    for (int64_t p0 = lo; p0 < hi; p0 += 16) {
        const int64_t n = hi - p0 < 16 ? hi - p0 : 16;
        const char *k[16];
        for (int64_t i = 0; i < 16; i++) k[i] = row(a->k, slot_of(a, b, p0 + (i < n ? i : 0)), h, a);
        for (int64_t i = p0 + 16; i < p0 + 32 && i < hi; i++) {  // the next tile's rows
            const char *next = row(a->k, slot_of(a, b, i), h, a);
            for (int64_t off = 0; off < D * (bf ? 2 : 4); off += 64)
                _mm_prefetch(next + off, _MM_HINT_T0);
        }
        for (int64_t g = 0; g < G; g++) {
            __m512 acc[16];
            for (int i = 0; i < 16; i++) {
                __m512 x = _mm512_setzero_ps();
                for (int64_t j = 0; j < nv; j++) {
#if defined(__AVX512BF16__)
                    if (bf) {
                        __m512bh kk = (__m512bh)_mm512_loadu_si512(k[i] + j * 64);
                        x = _mm512_dpbf16_ps(x, (__m512bh)qv[g][j], kk);
                        continue;
                    }
#endif
                    x = _mm512_fmadd_ps(qv[g][j], _mm512_loadu_ps(k[i] + j * 64), x);
                }
                acc[i] = x;
            }
            __m512 r = _mm512_mul_ps(_mm512_permutexvar_ps(SUM16_ORDER, sum16(acc)), scale);
            _mm512_mask_storeu_ps(s + g * a->max_len + p0 - lo, (__mmask16)((1u << n) - 1), r);
        }
    }
    return 1;
}

// exp(x) for x <= 0: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p of degree 6
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}
#endif

// ---------------------------------------------------------------------------------------------
// Pass 2: s <- exp(s - max) in place; returns the sum

static float softmax_row(float *s, int64_t n) {
    float m = -INFINITY, sum = 0.f;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 vm = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + i));
    m = _mm512_reduce_max_ps(vm);
#endif
    for (; i < n; i++) m = s[i] > m ? s[i] : m;
    i = 0;
#if defined(__AVX512F__)
    __m512 vs = _mm512_setzero_ps(), vmax = _mm512_set1_ps(m);
    for (; i + 16 <= n; i += 16) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + i), vmax));
        _mm512_storeu_ps(s + i, e);
        vs = _mm512_add_ps(vs, e);
    }
    sum = _mm512_reduce_add_ps(vs);
#endif
    for (; i < n; i++) {
        s[i] = expf(s[i] - m);
        sum += s[i];
    }
    return sum;
}

// ---------------------------------------------------------------------------------------------
// Pass 3: out_g = sum_pos p[g][pos] v_pos / sum_g

#define PREFETCH_V 8  // V rows requested this many positions ahead

static void weighted_v(const Args *a, int64_t b, int64_t h, const float *s, int64_t lo,
                       int64_t hi, const float *sums) {
    const int64_t G = a->group, D = a->head_dim, bf = a->is_bf16;
    char *out = (char *)a->out + ((b * a->num_kv_heads + h) * G * D) * (bf ? 2 : 4);
    float acc[16 * 256];
    if (G > 16 || D > 256) return;
    memset(acc, 0, sizeof(float) * G * D);
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        const int64_t bytes = D * (bf ? 2 : 4);
        for (int64_t pos = lo; pos < hi && pos < lo + PREFETCH_V; pos++)
            for (int64_t off = 0; off < bytes; off += 64)
                _mm_prefetch(row(a->v, slot_of(a, b, pos), h, a) + off, _MM_HINT_T0);
        for (int64_t pos = lo; pos < hi; pos++) {
            const char *v = row(a->v, slot_of(a, b, pos), h, a);
            if (pos + PREFETCH_V < hi) {
                const char *next = row(a->v, slot_of(a, b, pos + PREFETCH_V), h, a);
                for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
            }
            for (int64_t j = 0; j < D; j += 16) {
                __m512 vv = bf ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                         (const __m256i *)(v + j * 2))), 16))
                               : _mm512_loadu_ps(v + j * 4);
                for (int64_t g = 0; g < G; g++) {
                    __m512 w = _mm512_set1_ps(s[g * a->max_len + pos - lo]);
                    float *o = acc + g * D + j;
                    _mm512_storeu_ps(o, _mm512_fmadd_ps(w, vv, _mm512_loadu_ps(o)));
                }
            }
        }
    } else
#endif
    for (int64_t pos = lo; pos < hi; pos++) {
        const char *v = row(a->v, slot_of(a, b, pos), h, a);
        for (int64_t g = 0; g < G; g++) {
            float w = s[g * a->max_len + pos - lo];
            for (int64_t d = 0; d < D; d++) acc[g * D + d] += w * load(v, d, bf);
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float inv = 1.f / sums[g];
        for (int64_t d = 0; d < D; d++) {
            float x = acc[g * D + d] * inv;
            if (bf)
                ((bf16_t *)out)[g * D + d] = f32_to_bf16(x);
            else
                ((float *)out)[g * D + d] = x;
        }
    }
}

// ---------------------------------------------------------------------------------------------

static void attend_one(const Args *a, int64_t b, int64_t h, float *s) {
    const int64_t lo = a->lo[b], hi = a->hi[b], G = a->group;
    int done = 0;
#if defined(__AVX512F__)
    done = scores_avx512(a, b, h, s, lo, hi);
#endif
    if (!done) scores_plain(a, b, h, s, lo, hi);
    float sums[16];
    for (int64_t g = 0; g < G; g++) sums[g] = softmax_row(s + g * a->max_len, hi - lo);
    weighted_v(a, b, h, s, lo, hi, sums);
}

int pdserve_decode_attention(const void *q, void *out, const void *k, const void *v,
                             const int64_t *table, int64_t table_stride, const int64_t *lo,
                             const int64_t *hi, float *scratch, int64_t batch,
                             int64_t num_kv_heads, int64_t group, int64_t head_dim,
                             int64_t block_size, int64_t max_len, float scale, int is_bf16,
                             int threads) {
    if (group > 16 || head_dim > 256) return -1;
    Args a = {q, out, k, v, table, lo, hi, scratch, table_stride, num_kv_heads, group,
              head_dim, block_size, max_len, scale, is_bf16};
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < batch * num_kv_heads; item++) {
        int tid = 0;
#if defined(_OPENMP)
        tid = omp_get_thread_num();
#endif
        attend_one(&a, item / num_kv_heads, item % num_kv_heads, scratch + tid * group * max_len);
    }
    return 0;
}

int pdserve_decode_attention_init(void) {
#if defined(__AVX512F__)
    init_sum16_order();
    return 1;
#else
    return 0;
#endif
}
