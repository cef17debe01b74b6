/* radixserve's CPU kernels: paged decode attention and fused residual add + RMSNorm.
 * Built at first use by kernels/cpu.py with
 * `cc -O3 -march=native -fopenmp`; it links the libgomp that torch has already loaded, so it
 * shares torch's OpenMP thread pool instead of starting a second one.
 *
 * Paged decode attention: one query token per sequence, keys and values read in place from
 * the paged KV pool (no gather copy). Layouts (all row-major):
 *   q:          [B, H, D] with strides (q_stride_b, q_stride_h, 1)
 *   k/v cache:  [num_pages, P, Hkv, D] contiguous
 *   page_table: int64 [B, pt_cols] (row stride pt_stride), ids < num_pages;
 *   seq_lens: int64 [B], keys per sequence, 1 <= len <= pt_cols * P
 *   out:        [B, H, D] contiguous
 * dtype 0 = float32, 1 = bfloat16 (computed in float32).
 *
 * Per task (a sequence, or one KV head of it): the G = H / Hkv query heads of a group share every key and
 * value row they read (GQA), scores for the whole context go to a per-thread buffer, then an
 * exact two-pass softmax (max, exp, sum) and one pass over V. A speculating request's verify
 * rows (consecutive rows, one key longer each, over the same pages) share tasks, each row's
 * arithmetic unchanged (not on the scalar path, D % 8 != 0).
 *
 * bfloat16 on CPUs with AVX-512 (picked at build time by -march=native; `rs_kernel_isa` says
 * which): scores with AVX512-BF16 pair dot products straight from the bf16 rows, and P.V with
 * the value rows widened in registers. Measured on a 2-core Zen 5 at batch 64 x 128 keys,
 * K/V from DRAM: 0.37 -> 0.25 ms per layer (`benchmarks/decode_kernel_ab.py --layers 30`).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#include <omp.h>
#endif

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* Row of D elements at element offset `off` as float32: the row itself for float32 storage,
 * else converted into `tmp`. */
static inline const float *row_f32(int dtype, const void *base, int64_t off, int64_t D,
                                   float *tmp) {
    if (dtype == 0) return (const float *)base + off;
    const uint16_t *src = (const uint16_t *)base + off;
    for (int64_t i = 0; i < D; ++i) tmp[i] = bf16_to_f32(src[i]);
    return tmp;
}

/* Ask for a token's row a few tokens ahead: pages sit at random places in the pool, so the
 * hardware prefetcher restarts at every page boundary. */
#define PREFETCH_AHEAD 16
/* the most K and V bytes prefetched for a thread's next decode task: a quarter of a Zen 4/5
 * core's L2 (1 MiB), so the current task's rows stay in it */
#define NEXT_TASK_BYTES (256 * 1024)
static inline void prefetch_row(int dtype, const void *base, int64_t off, int64_t n) {
    const char *p = (const char *)base + off * (dtype == 0 ? 4 : 2);
    const int64_t bytes = n * (dtype == 0 ? 4 : 2);
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

/* A cursor over the K and V rows of the decode task a thread most likely runs next:
 * `burst_keys` requests the next n keys' rows (prefetcht0), so the requests can be spread over
 * the current task's work. */
typedef struct {
    const char *k, *v;     /* the caches */
    const int64_t *pages;  /* the next sequence's page ids */
    int64_t P, row, col;   /* page size, elements per token row, first element (its KV head) */
    int64_t bytes;         /* bytes of each key's K (and V) part */
    int64_t es;            /* element size */
    int64_t next, end;     /* keys requested so far, keys to request */
} burst_t;

static inline void burst_keys(burst_t *b, int64_t n) {
    for (const int64_t stop = b->next + n < b->end ? b->next + n : b->end; b->next < stop;
         ++b->next) {
        const int64_t a = b->next;
        const int64_t o = ((b->pages[a / b->P] * b->P + a % b->P) * b->row + b->col) * b->es;
        for (int64_t i = 0; i < b->bytes; i += 64) {
            __builtin_prefetch(b->k + o + i, 0, 3);
            __builtin_prefetch(b->v + o + i, 0, 3);
        }
    }
}

/* 8 floats in one register (AVX) or two (SSE): GCC/Clang vector extensions, so the same code
 * builds on any x86-64 or Arm compiler without intrinsics. */
typedef float v8f __attribute__((vector_size(32)));
/* 16 floats: one AVX-512 register, for element-wise work, where the width does not change
 * any value; only in AVX-512 builds (an AVX2 target gets it through the stack, `PV_ROWS_64`) */
typedef float v16f __attribute__((vector_size(64)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* Decode and prefill attention share their per-row arithmetic, so a token's attention is
 * bit-identical whether it is computed in a prefill chunk of any size or as a decode in a batch
 * of any size. Every reduction therefore spells its order out: 8 lanes over the vector, then
 * `hsum8`'s fixed tree, then a scalar tail. (`omp simd reduction` lets the compiler pick the
 * order, and its alignment peeling made the result depend on the address.) Element-wise code
 * has no order and is left to the compiler. */
static inline float dot(const float *a, const float *b, int64_t n) {
    v8f acc = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc += load8(a + i) * load8(b + i);
    float s = hsum8(acc);
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

/* Scores of one query row (q: D floats, already scaled; D % 8 == 0, D <= 8 * MAX_D8) against
 * eight key rows: eight independent 8-lane FMA chains (eight, so the FMA units are not waiting
 * on one chain's latency), then `hsum8`. Both kernels score every key through this one
 * function: a one-key loop compiled to a different rounding (measured: 1 ulp off in float32),
 * so a group of fewer than eight keys repeats its last key instead. */
#define MAX_D8 32
#define SCORE_KEYS 8
static inline void scores8(const float *q, const float *const k[SCORE_KEYS], int64_t D,
                           float r[SCORE_KEYS]) {
    v8f a[SCORE_KEYS];
    for (int u = 0; u < SCORE_KEYS; ++u) a[u] = (v8f){0};
    for (int64_t i = 0; i < D; i += 8) {
        const v8f qv = load8(q + i);
        for (int u = 0; u < SCORE_KEYS; ++u) a[u] += qv * load8(k[u] + i);
    }
    for (int u = 0; u < SCORE_KEYS; ++u) r[u] = hsum8(a[u]);
}

/* bfloat16 scores with AVX512-BF16's pair dot products (`vdpbf16ps`): the query and key rows
 * are read as stored, with no widening to float32, and each key's 16-lane accumulator is
 * reduced with its neighbours' in one transposing tree (46 instructions for 16 keys instead of
 * a horizontal sum per key). Products of two bfloat16 values are exact in float32; the sum
 * order of a key's score depends only on D: lane i accumulates elements 2i, 2i+1 (mod 32) in
 * order, then the tree adds lanes (i, i+8), then quarters (0,1) and (2,3), then lanes (0,2),
 * (1,3), then the two halves. So a key's score is the same whichever slot of the 16 it takes,
 * which keeps the decode and prefill kernels bit-identical however the keys are blocked.
 * Used for bfloat16 with D % 32 == 0 where the compiler targets AVX512-BF16 (-march=native on
 * Zen 4/5, Cooper Lake, Sapphire Rapids and later); elsewhere both kernels use `scores8`. */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define RS_BF16_DOT 1
#define BF16_KEYS 16
/* s[0..nk) = scale * (q . row u), row u at base + offs[u] + add (bf16 elements), 1 <= nk <= 16;
 * a group of fewer than 16 keys repeats its last key and stores only nk scores */
static inline void scores16_bf16(const uint16_t *q, const uint16_t *base, const int64_t *offs,
                                 int64_t add, int64_t nk, int64_t D, float scale, float *s) {
    __m512 a[BF16_KEYS];
    const uint16_t *k[BF16_KEYS];
    for (int u = 0; u < BF16_KEYS; ++u) {
        a[u] = _mm512_setzero_ps();
        k[u] = base + offs[u < nk ? u : nk - 1] + add;
    }
    for (int64_t i = 0; i < D; i += 32) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + i);
        for (int u = 0; u < BF16_KEYS; ++u)
            a[u] = _mm512_dpbf16_ps(a[u], qv, (__m512bh)_mm512_loadu_si512(k[u] + i));
    }
    __m512 b[8], c[4], e[2];
    for (int u = 0; u < 8; ++u) /* [x.q0+x.q2, x.q1+x.q3, y.q0+y.q2, y.q1+y.q3] */
        b[u] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * u], a[2 * u + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * u], a[2 * u + 1], 0xEE));
    for (int u = 0; u < 4; ++u) /* quarter j: key 4u + j, four partial sums */
        c[u] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * u], b[2 * u + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * u], b[2 * u + 1], 0xDD));
    for (int u = 0; u < 2; ++u)
        e[u] = _mm512_add_ps(_mm512_unpacklo_ps(c[2 * u], c[2 * u + 1]),
                             _mm512_unpackhi_ps(c[2 * u], c[2 * u + 1]));
    const __m512d e0 = _mm512_castps_pd(e[0]), e1 = _mm512_castps_pd(e[1]);
    /* lane 4j + i now holds key 4i + j */
    const __m512 r = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(e0, e1)),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(e0, e1)));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    const __m512 v = _mm512_mul_ps(_mm512_permutexvar_ps(order, r), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(s, (__mmask16)((1u << nk) - 1u), v);
}
#else
#define RS_BF16_DOT 0
#endif

/* exp(x) for x <= 0 on 8 float32 lanes (no libm call): Cephes' expf (S. L. Moshier), the range
 * reduction and degree-5 polynomial also used by sse_mathfun; within ~2 ulp of expf. Spelled
 * with vector operations because GCC does not vectorize the scalar form (its float -> int ->
 * float rounding step defeats it). */
typedef int32_t v8i __attribute__((vector_size(32)));
#define DEFINE_EXP_NONPOS(NAME, VF, VI)                                                        \
    static inline VF NAME(VF x) {                                                              \
        const VF lo = (VF){0} - 87.0f;                                                         \
        const VI below = x < lo;                                                               \
        x = (VF)(((VI)x & ~below) | ((VI)lo & below));                                         \
        /* nearest integer to x / ln 2 (ties up): truncating a value <= 0 rounds it up */      \
        const VI ni = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, VI);            \
        const VF n = __builtin_convertvector(ni, VF);                                          \
        const VF r = x - n * 0.693359375f + n * 2.12194440e-4f;                                \
        VF p = (VF){0} + 1.9875691500e-4f;                                                     \
        p = p * r + 1.3981999507e-3f;                                                          \
        p = p * r + 8.3334519073e-3f;                                                          \
        p = p * r + 4.1665795894e-2f;                                                          \
        p = p * r + 1.6666665459e-1f;                                                          \
        p = p * r + 5.0000001201e-1f;                                                          \
        p = p * r * r + r + 1.0f;                                                              \
        const VI bits = (ni + 127) << 23;                                                      \
        VF scale;                                                                              \
        memcpy(&scale, &bits, sizeof scale);                                                   \
        return p * scale;                                                                      \
    }
DEFINE_EXP_NONPOS(exp8_nonpos, v8f, v8i)

/* s[0..L) <- softmax(s[0..L)) in place: exact two passes (max; exp and sum), then a scale.
 * The sum's order depends only on L (8 lanes, `hsum8`, then the tail in order), so a row gets
 * the same values in the decode and the prefill kernel. */
static inline void softmax_row(float *s, int64_t L) {
    float m = s[0];
    int64_t u0 = 1;
#if defined(__AVX2__)
    /* four chains of `_mm256_max_ps(x, m)` (x > m ? x : m, the scalar loop's choice, NaN
     * included): one chain of scalar maxes cost 4 cycles a key, 15% of a prefill's attention */
    if (L >= 33) {
        __m256 m0 = _mm256_set1_ps(m), m1 = m0, m2 = m0, m3 = m0;
        for (; u0 + 32 <= L; u0 += 32) {
            m0 = _mm256_max_ps(_mm256_loadu_ps(s + u0), m0);
            m1 = _mm256_max_ps(_mm256_loadu_ps(s + u0 + 8), m1);
            m2 = _mm256_max_ps(_mm256_loadu_ps(s + u0 + 16), m2);
            m3 = _mm256_max_ps(_mm256_loadu_ps(s + u0 + 24), m3);
        }
        /* a chain holds NaN only if s[0] is NaN, and then all do: any order gives the same */
        m0 = _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m0), _mm256_extractf128_ps(m0, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        m = _mm_cvtss_f32(h);
    }
#endif
    for (int64_t u = u0; u < L; ++u) m = s[u] > m ? s[u] : m;
    v8f acc = {0};
    int64_t u = 0;
    for (; u + 8 <= L; u += 8) {
        const v8f e = exp8_nonpos(load8(s + u) - m);
        memcpy(s + u, &e, sizeof e);
        acc += e;
    }
    float sum = hsum8(acc);
    if (u < L) { /* the tail, padded with zeros whose exponentials are dropped */
        float t[8] = {0};
        for (int64_t j = 0; u + j < L; ++j) t[j] = s[u + j] - m;
        const v8f e = exp8_nonpos(load8(t));
        for (int64_t j = 0; u + j < L; ++j) {
            s[u + j] = e[j];
            sum += e[j];
        }
    }
    const float inv = 1.f / sum;
    for (u = 0; u < L; ++u) s[u] *= inv;
}

/* acc[0..D) += p * v[0..D): element-wise fused multiply-adds, so any vectorization gives the
 * same result per element (inlined freely) */
static inline void axpy(float *acc, float p, const float *v, int64_t D) {
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) acc[i] += p * v[i];
}

/* acc[0..D) += sum over j < n of p[j] * row j, row j at base + offs[j]: `axpy`'s chain of
 * fused multiply-adds per element in key order, with the D accumulators in registers (the
 * common head sizes get a constant trip count, which is what keeps them in registers) */
#define PV_ROWS_BODY(D8, LOAD)                                                                 \
    do {                                                                                       \
        v8f a[MAX_D8];                                                                         \
        for (int64_t i = 0; i < (D8); ++i) a[i] = load8(acc + 8 * i);                          \
        for (int64_t j = 0; j < n; ++j) {                                                      \
            const v8f pj = (v8f){0} + p[j];                                                    \
            const __typeof__(base) v = base + offs[j];                                         \
            for (int64_t i = 0; i < (D8); ++i) a[i] += pj * LOAD(v + 8 * i);                   \
        }                                                                                      \
        for (int64_t i = 0; i < (D8); ++i) memcpy(acc + 8 * i, &a[i], sizeof(v8f));            \
    } while (0)
/* the same chains 16 lanes at a time (each element's chain unchanged, so the same values),
 * half the instructions: the common head sizes */
#define PV16_ROWS_BODY(D16)                                                                    \
    do {                                                                                       \
        v16f a[D16];                                                                           \
        for (int64_t i = 0; i < (D16); ++i) memcpy(&a[i], acc + 16 * i, sizeof(v16f));         \
        for (int64_t j = 0; j < n; ++j) {                                                      \
            const v16f pj = (v16f){0} + p[j];                                                  \
            const float *v = base + offs[j];                                                   \
            for (int64_t i = 0; i < (D16); ++i) {                                              \
                v16f x;                                                                        \
                memcpy(&x, v + 16 * i, sizeof x);                                              \
                a[i] += pj * x;                                                                \
            }                                                                                  \
        }                                                                                      \
        for (int64_t i = 0; i < (D16); ++i) memcpy(acc + 16 * i, &a[i], sizeof(v16f));         \
    } while (0)
/* 16 lanes only where one register holds them: GCC lowers a 64-byte vector on an AVX2 target
 * through the stack (scalar stores, then vector reloads), which made the float32 decode
 * attention 3x slower than 8 lanes (-march=haswell on Zen 5, CHANGELOG.md, 2026-11-24) */
#if defined(__AVX512F__)
#define PV_ROWS_64(LOAD) PV16_ROWS_BODY(4)
#define PV_ROWS_128(LOAD) PV16_ROWS_BODY(8)
#else
#define PV_ROWS_64(LOAD) PV_ROWS_BODY(8, LOAD)
#define PV_ROWS_128(LOAD) PV_ROWS_BODY(16, LOAD)
#endif
#define DEFINE_PV_ROWS(NAME, T, LOAD)                                                          \
    static inline void NAME(const float *p, const T *base, const int64_t *offs, int64_t n,     \
                            int64_t D, float *acc) {                                           \
        if (D == 64)                                                                           \
            PV_ROWS_64(LOAD);                                                                  \
        else if (D == 128)                                                                     \
            PV_ROWS_128(LOAD);                                                                 \
        else                                                                                   \
            PV_ROWS_BODY(D / 8, LOAD);                                                         \
    }
DEFINE_PV_ROWS(pv_rows, float, load8)

/* One output row of D floats: copied (float32) or rounded to bfloat16. */
static inline void store_row(int dtype, void *out, int64_t off, const float *acc, int64_t D) {
    if (dtype == 0) {
        memcpy((float *)out + off, acc, sizeof(float) * (size_t)D);
    } else {
        uint16_t *dst = (uint16_t *)out + off;
        for (int64_t i = 0; i < D; ++i) dst[i] = f32_to_bf16(acc[i]);
    }
}

#if defined(__AVX512F__)
/* bfloat16 P.V of the decode kernel for the common head sizes: acc (HS heads of one GQA group,
 * D16 16-lane chunks each, in registers) += p_h[t] * row t for every key t < L, each value row
 * widened in registers once for the HS heads (no float32 copy of the block through memory).
 * Each element's chain is `pv_block`'s, one fused multiply-add per key in key order, so the
 * values are bit for bit the prefill kernel's. */
#define DEFINE_PV_BF16(NAME, D16, HS)                                                          \
    static void NAME(const float *p, int64_t p_stride, const uint16_t *base,                  \
                     const int64_t *offs, int64_t L, float *acc, int64_t D) {                  \
        __m512 a[HS][D16];                                                                     \
        for (int h = 0; h < (HS); ++h)                                                         \
            for (int i = 0; i < (D16); ++i) a[h][i] = _mm512_loadu_ps(acc + h * D + 16 * i);    \
        for (int64_t t = 0; t < L; ++t) {                                                      \
            if (t + PREFETCH_AHEAD < L) prefetch_row(1, base, offs[t + PREFETCH_AHEAD], D);     \
            const uint16_t *v = base + offs[t];                                                \
            __m512 x[D16];                                                                     \
            for (int i = 0; i < (D16); ++i)                                                    \
                x[i] = _mm512_castsi512_ps(_mm512_slli_epi32(                                  \
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + 16 * i))), \
                    16));                                                                      \
            for (int h = 0; h < (HS); ++h) {                                                   \
                const __m512 ph = _mm512_set1_ps(p[h * p_stride + t]);                         \
                for (int i = 0; i < (D16); ++i) a[h][i] = _mm512_fmadd_ps(ph, x[i], a[h][i]);   \
            }                                                                                  \
        }                                                                                      \
        for (int h = 0; h < (HS); ++h)                                                         \
            for (int i = 0; i < (D16); ++i) _mm512_storeu_ps(acc + h * D + 16 * i, a[h][i]);    \
    }
DEFINE_PV_BF16(pv_bf16_4_1, 4, 1)
DEFINE_PV_BF16(pv_bf16_4_2, 4, 2)
DEFINE_PV_BF16(pv_bf16_4_3, 4, 3)
DEFINE_PV_BF16(pv_bf16_4_4, 4, 4)
DEFINE_PV_BF16(pv_bf16_8_1, 8, 1)
DEFINE_PV_BF16(pv_bf16_8_2, 8, 2)
typedef void (*pv_bf16_fn)(const float *, int64_t, const uint16_t *, const int64_t *, int64_t,
                           float *, int64_t);
/* the variant for D (64 or 128) and up to `heads` heads: 16 accumulators at most, so they stay
 * in AVX-512's 32 registers; *hs gets the heads it takes */
static pv_bf16_fn pv_bf16_for(int64_t D, int64_t heads, int64_t *hs) {
    static const pv_bf16_fn d64[4] = {pv_bf16_4_1, pv_bf16_4_2, pv_bf16_4_3, pv_bf16_4_4};
    static const pv_bf16_fn d128[2] = {pv_bf16_8_1, pv_bf16_8_2};
    const int64_t most = D == 64 ? 4 : 2;
    *hs = heads < most ? heads : most;
    return D == 64 ? d64[*hs - 1] : d128[*hs - 1];
}
#define RS_PV_BF16 1
#else
#define RS_PV_BF16 0
#endif

/* Which of the instruction-set paths above this build has: bit 0 the AVX512-BF16 scores
 * (`scores16_bf16`), bit 1 the AVX-512 bfloat16 P.V (`pv_bf16_*`). */
int rs_kernel_isa(void) { return RS_BF16_DOT | (RS_PV_BF16 << 1); }

/* value rows widened per block in the bfloat16 decode kernel */
#define DECODE_VB 32

/* scores[j * max_len + t + u] for the keys kr[u] (float32 rows of all the task's KV heads)
 * below L and each of the TG query heads j (qs: [TG, D], pre-scaled; G per KV head), through
 * `scores8` */
static inline void scores8_heads(const float *qs, const float *const kr[SCORE_KEYS], int64_t TG,
                                 int64_t G, int64_t D, int64_t t, int64_t L, float *scores,
                                 int64_t max_len) {
    for (int64_t j = 0; j < TG && t < L; ++j) {
        const float *ko[SCORE_KEYS];
        for (int u = 0; u < SCORE_KEYS; ++u) ko[u] = kr[u] + (j / G) * D;
        float s8[SCORE_KEYS];
        scores8(qs + j * D, ko, D, s8);
        for (int64_t u = 0; u < SCORE_KEYS && t + u < L; ++u) scores[j * max_len + t + u] = s8[u];
    }
}

/* Whether row b continues row b - 1's verify run: the same sequence one key longer (a
 * speculating request's k + 1 rows are consecutive decode rows at consecutive lengths over one
 * page table row's pages) */
static int continues_run(const int64_t *page_table, int64_t pt_stride, const int64_t *seq_lens,
                         int64_t b, int64_t P) {
    if (b == 0 || seq_lens[b] != seq_lens[b - 1] + 1) return 0;
    const int64_t *x = page_table + b * pt_stride, *y = x - pt_stride;
    if (x == y) return 1;
    for (int64_t j = 0; j < (seq_lens[b] + P - 1) / P; ++j)
        if (x[j] != y[j]) return 0;
    return 1;
}

/* one task of the decode kernel: rows [b0, b1) (several only for a verify run) and KV heads
 * [kh0, kh0 + nkv) */
typedef struct {
    int64_t b0, b1, kh0, nkv;
} attn_task_t;

int rs_paged_decode_attention(int dtype, const void *q, int64_t q_stride_b, int64_t q_stride_h,
                              const void *k_cache, const void *v_cache,
                              const int64_t *page_table, int64_t pt_stride, int64_t pt_cols,
                              int64_t num_pages, const int64_t *seq_lens, void *out, int64_t B,
                              int64_t H, int64_t Hkv, int64_t D, int64_t P, float scale,
                              int num_threads) {
    if (B <= 0) return 0;
    if (Hkv <= 0 || H % Hkv != 0 || D <= 0 || P <= 0) return 1;
    const int64_t G = H / Hkv;
    int64_t max_len = 1;
    /* validate here, once per call: a bad length or page id would read outside the pool */
    for (int64_t b = 0; b < B; ++b) {
        const int64_t L = seq_lens[b];
        if (L < 1 || L > pt_cols * P) return 2;
        if (L > max_len) max_len = L;
        for (int64_t j = 0; j < (L + P - 1) / P; ++j) {
            const int64_t pg = page_table[b * pt_stride + j];
            if (pg < 0 || pg >= num_pages) return 4;
        }
    }
    const int fast = D % 8 == 0 && D / 8 <= MAX_D8;
    const int bf16dot = RS_BF16_DOT && dtype == 1 && D % 32 == 0;
    /* A verify run's rows share their tasks: one task reads each key's row once for all of
     * its rows, takes the key offsets and prefetches once, and widens each key and value row
     * once for every row's heads. Each row's arithmetic is the one it gets alone (each key's
     * score computed on its own, its own softmax over its own length, each output element's
     * chain in key order over the same blocks), so the bits do not change. Not on the scalar
     * path (D % 8 != 0). */
    const int runs = fast;
    /* One task per sequence reads each token's K and V rows (all KV heads, contiguous) once.
     * With too few sequences to keep every thread busy, split each sequence by KV head
     * instead (the heads of one token then share cache lines across tasks). A verify run is
     * split by KV head and into as many row chunks as give every thread two tasks. */
    int64_t nseq = 0, max_run = 1;
    for (int64_t b = 0, r0 = 0; b < B; ++b) {
        if (runs && b + 1 < B && continues_run(page_table, pt_stride, seq_lens, b + 1, P)) continue;
        ++nseq;
        if (b + 1 - r0 > max_run) max_run = b + 1 - r0;
        r0 = b + 1;
    }
    const int64_t per_task = nseq >= 2 * (int64_t)num_threads ? Hkv : 1;
    const int64_t chunks = max_run > 1 ? (2 * num_threads + Hkv - 1) / Hkv : 1;
    const int64_t rows_per_task = (max_run + chunks - 1) / chunks;
    attn_task_t *tasks = (attn_task_t *)malloc(sizeof(attn_task_t) * (size_t)(B * Hkv));
    if (tasks == NULL) return 3;
    int64_t ntasks = 0;
    for (int64_t b = 0, r0 = 0; b < B; ++b) {
        if (runs && b + 1 < B && continues_run(page_table, pt_stride, seq_lens, b + 1, P)) continue;
        if (b == r0) {
            for (int64_t kh = 0; kh < Hkv; kh += per_task)
                tasks[ntasks++] = (attn_task_t){b, b + 1, kh, per_task};
        } else {
            for (int64_t kh = 0; kh < Hkv; ++kh)
                for (int64_t c = r0; c <= b; c += rows_per_task)
                    tasks[ntasks++] = (attn_task_t){c, c + rows_per_task < b + 1 ? c + rows_per_task
                                                                             : b + 1, kh, 1};
        }
        r0 = b + 1;
    }
    /* rows x query heads a task holds at most */
    const int64_t HG = per_task * G > rows_per_task * G ? per_task * G : rows_per_task * G;
    const int64_t row = Hkv * D;     /* elements of one token's K (or V) row */
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* scores [HG, max_len], queries [HG, D], accumulators [HG, D], rows widened to
         * float32 [DECODE_VB, row]; then the rows' element offsets int64 [max_len] */
        const size_t nf = (size_t)(HG * max_len + 2 * HG * D + DECODE_VB * row);
        float *buf = (float *)malloc(sizeof(float) * (nf + 1) + sizeof(int64_t) * (size_t)max_len);
        int64_t *offs = buf == NULL ? NULL : (int64_t *)(void *)(buf + nf + (nf & 1));
        if (buf == NULL) {
#pragma omp atomic write
            failed = 3;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < ntasks; ++task) {
            if (buf == NULL) continue;
            const attn_task_t tk = tasks[task];
            const int64_t b = tk.b1 - 1, kh0 = tk.kh0, nr = tk.b1 - tk.b0;
            const int64_t L = seq_lens[b]; /* the run's longest row */
            const int64_t TG = tk.nkv * G; /* query heads per row of the task */
            float *scores = buf, *qs = buf + HG * max_len, *acc = qs + HG * D;
            float *tmp = acc + HG * D;
            const int64_t *pages = page_table + b * pt_stride;
            /* float32 queries, pre-scaled, for `scores8`/`dot` (the bf16 scores read q as
             * stored), [nr, TG, D] */
            for (int64_t j = 0; !bf16dot && j < nr * TG; ++j) {
                const int64_t h = kh0 * G + j % TG;
                const float *qr = row_f32(dtype, q, (tk.b0 + j / TG) * q_stride_b
                                                        + h * q_stride_h, D, tmp);
                for (int64_t i = 0; i < D; ++i) qs[j * D + i] = qr[i] * scale;
            }
            /* every key's element offset, page by page: no division per key (a 64-bit
             * division by the runtime page size cost more than the key's scores) */
            for (int64_t t = 0, pg = 0, in = 0; t < L; ++t) {
                offs[t] = (pages[pg] * P + in) * row + kh0 * D;
                if (++in == P) {
                    in = 0;
                    ++pg;
                }
            }
            int64_t t = 0;
#if RS_BF16_DOT
            for (; bf16dot && t < L; t += BF16_KEYS) {
                /* values too: the P.V pass then finds them in cache */
                for (int64_t a = t + PREFETCH_AHEAD; a < t + PREFETCH_AHEAD + BF16_KEYS && a < L;
                     ++a) {
                    prefetch_row(dtype, k_cache, offs[a], tk.nkv * D);
                    prefetch_row(dtype, v_cache, offs[a], tk.nkv * D);
                }
                if (nr == 1) { /* a decode row: its own loop (the run loop cost 5% here) */
                    const int64_t nk = L - t < BF16_KEYS ? L - t : BF16_KEYS;
                    for (int64_t j = 0; j < TG; ++j)
                        scores16_bf16((const uint16_t *)q + b * q_stride_b
                                          + (kh0 * G + j) * q_stride_h,
                                      (const uint16_t *)k_cache, offs + t, (j / G) * D, nk, D,
                                      scale, scores + j * max_len + t);
                    continue;
                }
                for (int64_t r = 0; r < nr; ++r) {
                    const int64_t Lr = seq_lens[tk.b0 + r];
                    if (t >= Lr) continue;
                    const int64_t nk = Lr - t < BF16_KEYS ? Lr - t : BF16_KEYS;
                    for (int64_t j = 0; j < TG; ++j)
                        scores16_bf16((const uint16_t *)q + (tk.b0 + r) * q_stride_b
                                          + (kh0 * G + j) * q_stride_h,
                                      (const uint16_t *)k_cache, offs + t, (j / G) * D, nk, D,
                                      scale, scores + (r * TG + j) * max_len + t);
                }
            }
#endif
            for (; fast && t < L; t += SCORE_KEYS) {
                for (int64_t a = t + PREFETCH_AHEAD; a < t + PREFETCH_AHEAD + SCORE_KEYS && a < L;
                     ++a)
                    prefetch_row(dtype, k_cache, offs[a], tk.nkv * D);
                const float *kr[SCORE_KEYS];
                for (int64_t u = 0; u < SCORE_KEYS; ++u) {
                    const int64_t tu = t + u < L ? t + u : L - 1;
                    kr[u] = row_f32(dtype, k_cache, offs[tu], tk.nkv * D, tmp + u * row);
                }
                /* each key's score is its own chain: the keys beside it in the group (a
                 * shorter row's group may hold a longer row's keys) change no value */
                if (nr == 1) /* a decode row: no run loop around it (it cost 2% here) */
                    scores8_heads(qs, kr, TG, G, D, t, L, scores, max_len);
                for (int64_t r = 0; nr > 1 && r < nr; ++r)
                    scores8_heads(qs + r * TG * D, kr, TG, G, D, t, seq_lens[tk.b0 + r],
                                  scores + r * TG * max_len, max_len);
            }
            for (; t < L; ++t) {
                const float *kr = row_f32(dtype, k_cache, offs[t], tk.nkv * D, tmp);
                for (int64_t j = 0; j < TG; ++j)
                    scores[j * max_len + t] = dot(qs + j * D, kr + (j / G) * D, D);
            }
            if (fast) {
                /* the first value blocks come from DRAM while the softmax runs */
                for (t = 0; t < L && t < 2 * DECODE_VB; ++t)
                    prefetch_row(dtype, v_cache, offs[t], tk.nkv * D);
            }
            /* the keys and values of the task this thread most likely runs next (tasks are
             * handed out in order), up to NEXT_TASK_BYTES, requested in equal parts between
             * this task's softmax rows: its pages lie scattered in the pool, and requests made
             * ahead keep more of them in flight than the in-loop prefetch does. Requested all
             * at once, they filled the miss queue while this task waited (spread: bf16
             * 1.06-1.09x per layer, CHANGELOG.md, 2026-11-24). */
            burst_t burst = {0};
            if (fast && task + num_threads < ntasks) {
                const attn_task_t nx = tasks[task + num_threads];
                const int64_t nb = nx.b1 - 1;
                const int64_t es = dtype == 0 ? 4 : 2;
                const int64_t keys = NEXT_TASK_BYTES / (2 * nx.nkv * D * es);
                burst = (burst_t){(const char *)k_cache, (const char *)v_cache,
                                  page_table + nb * pt_stride, P, row, nx.kh0 * D,
                                  nx.nkv * D * es, es, 0,
                                  keys < seq_lens[nb] ? keys : seq_lens[nb]};
            }
            for (int64_t j = 0; j < nr * TG; ++j) {
                burst_keys(&burst, (burst.end + nr * TG - 1) / (nr * TG));
                softmax_row(scores + j * max_len, seq_lens[tk.b0 + j / TG]);
            }
            memset(acc, 0, sizeof(float) * (size_t)(nr * TG * D));
#if RS_PV_BF16
            if (dtype == 1 && (D == 64 || D == 128)) {
                /* a run's rows: every row over the first row's keys, its query heads of a KV
                 * head side by side; then each longer row's last keys, its chains continued */
                const int64_t L0 = seq_lens[tk.b0];
                for (int64_t kv = 0; kv < tk.nkv; ++kv) {
                    const uint16_t *vb = (const uint16_t *)v_cache + kv * D;
                    if (nr == 1) {
                        for (int64_t g0 = 0, hs = 0; g0 < G; g0 += hs) {
                            const int64_t j0 = kv * G + g0;
                            pv_bf16_for(D, G - g0, &hs)(scores + j0 * max_len, max_len, vb, offs,
                                                        L0, acc + j0 * D, D);
                        }
                        continue;
                    }
                    /* tk.nkv == 1 here: rows x G heads in one uniform stride */
                    for (int64_t j0 = 0, hs = 0; j0 < nr * G; j0 += hs)
                        pv_bf16_for(D, nr * G - j0, &hs)(scores + j0 * max_len, max_len, vb, offs,
                                                         L0, acc + j0 * D, D);
                    for (int64_t r = 1; r < nr; ++r) {
                        const int64_t Lr = seq_lens[tk.b0 + r];
                        for (int64_t g0 = 0, hs = 0; g0 < G && Lr > L0; g0 += hs) {
                            const int64_t j0 = r * G + g0;
                            pv_bf16_for(D, G - g0, &hs)(scores + j0 * max_len + L0, max_len, vb,
                                                        offs + L0, Lr - L0, acc + j0 * D, D);
                        }
                    }
                }
            } else
#endif
            if (fast) {
                /* head by head, its accumulators in registers over a block of keys (the
                 * prefill kernel's `pv_block` chain), the block two ahead on its way in */
                const int64_t w = tk.nkv * D;
                int64_t boffs[DECODE_VB];
                for (int64_t u = 0; u < DECODE_VB; ++u) boffs[u] = u * w;
                for (int64_t t0 = 0; t0 < L; t0 += DECODE_VB) {
                    const int64_t nk = L - t0 < DECODE_VB ? L - t0 : DECODE_VB;
                    for (int64_t a = t0 + 2 * DECODE_VB; a < t0 + 3 * DECODE_VB && a < L; ++a)
                        prefetch_row(dtype, v_cache, offs[a], w);
                    if (dtype == 1) {
                        /* bfloat16: widen the block once for all the rows' heads */
                        for (int64_t u = 0; u < nk; ++u) {
                            const uint16_t *src = (const uint16_t *)v_cache + offs[t0 + u];
                            for (int64_t i = 0; i < w; ++i) tmp[u * w + i] = bf16_to_f32(src[i]);
                        }
                    }
                    for (int64_t j = 0; nr == 1 && j < TG; ++j) { /* a decode row */
                        if (dtype == 0)
                            pv_rows(scores + j * max_len + t0,
                                    (const float *)v_cache + (j / G) * D, offs + t0, nk, D,
                                    acc + j * D);
                        else
                            pv_rows(scores + j * max_len + t0, tmp + (j / G) * D, boffs, nk, D,
                                    acc + j * D);
                    }
                    for (int64_t r = 0; nr > 1 && r < nr; ++r) {
                        /* a shorter row of a run stops at its own last key */
                        const int64_t left = seq_lens[tk.b0 + r] - t0;
                        const int64_t n = left < nk ? left : nk;
                        for (int64_t jj = 0; jj < TG && n > 0; ++jj) {
                            const int64_t j = r * TG + jj, o = (jj / G) * D;
                            if (dtype == 0)
                                pv_rows(scores + j * max_len + t0, (const float *)v_cache + o,
                                        offs + t0, n, D, acc + j * D);
                            else
                                pv_rows(scores + j * max_len + t0, tmp + o, boffs, n, D,
                                        acc + j * D);
                        }
                    }
                }
            } else {
                for (t = 0; t < L; ++t) {
                    const float *vr = row_f32(dtype, v_cache, offs[t], tk.nkv * D, tmp);
                    for (int64_t j = 0; j < TG; ++j)
                        axpy(acc + j * D, scores[j * max_len + t], vr + (j / G) * D, D);
                }
            }
            for (int64_t r = 0; r < nr; ++r)
                for (int64_t j = 0; j < TG; ++j)
                    store_row(dtype, out, ((tk.b0 + r) * H + kh0 * G + j) * D,
                              acc + (r * TG + j) * D, D);
        }
        free(buf);
    }
    free(tasks);
    return failed;
}

/* Paged prefill (extend) attention of one sequence's chunk: the n queries at positions
 * [ctx - n, ctx) attend causally over the sequence's first ctx keys, read in place from its
 * pages. Row r (position ctx - n + r) gets exactly the decode kernel's arithmetic for a context
 * of ctx - n + r + 1 keys: each score is the same 8-lane dot product and `hsum8`, the same out-of-line `softmax_row`, and each output
 * element the same chain of fused multiply-adds in key order. So a token's result depends
 * neither on how its prompt was chunked nor on what else ran in the step, and equals what a
 * decode of that token would compute.
 *
 * Work is tiled for reuse: a task is one KV head and PREFILL_TILE query rows; keys and values
 * are converted to float32 a block of PREFILL_KB rows at a time and shared by every query row of
 * the tile; a query row's lanes and an output row's accumulators stay in registers across the
 * block.
 *   q:     [n, H, D] with strides (q_stride_t, q_stride_h, 1)
 *   pages: int64 [>= ceil(ctx / P)] page ids of the sequence
 *   out:   [n, H, D] contiguous */
#define PREFILL_TILE 16
#define PREFILL_KB 32

/* Scores of one query row against keys kb[0..nk) of a block ([nk, D] float32), through
 * `scores8` as the decode kernel does. */
static inline void scores_block(const float *q, const float *kb, int64_t nk, int64_t D,
                                float *s) {
    for (int64_t j = 0; j < nk; j += SCORE_KEYS) {
        const int64_t last = nk - 1;
        const float *k[SCORE_KEYS];
        for (int64_t u = 0; u < SCORE_KEYS; ++u) k[u] = kb + (j + u < last ? j + u : last) * D;
        float r[SCORE_KEYS];
        scores8(q, k, D, r);
        for (int64_t u = 0; u < SCORE_KEYS && j + u < nk; ++u) s[j + u] = r[u];
    }
}

/* acc[0..D) += sum over j < nk of p[j] * vb[j] ([nk, D]), one fused multiply-add per element
 * and key in key order (the decode kernel's `axpy` chain), accumulators in registers. */
static inline void pv_block(const float *p, const float *vb, int64_t nk, int64_t D, float *acc) {
    /* through `pv_rows`, whose common head sizes keep the accumulators in registers (a loop
     * to D / 8 kept them on the stack: a load and a store per multiply-add) */
    int64_t offs[PREFILL_KB];
    for (int64_t j = 0; j < nk; ++j) offs[j] = j * D;
    pv_rows(p, vb, offs, nk, D, acc);
}

int rs_paged_prefill_attention(int dtype, const void *q, int64_t q_stride_t, int64_t q_stride_h,
                               const void *k_cache, const void *v_cache, const int64_t *pages,
                               int64_t num_page_ids, int64_t num_pages, int64_t ctx, int64_t n,
                               void *out, int64_t H, int64_t Hkv, int64_t D, int64_t P,
                               float scale, int num_threads) {
    if (n <= 0) return 0;
    if (Hkv <= 0 || H % Hkv != 0 || D <= 0 || P <= 0) return 1;
    if (n > ctx || ctx > num_page_ids * P) return 2;
    for (int64_t j = 0; j < (ctx + P - 1) / P; ++j)
        if (pages[j] < 0 || pages[j] >= num_pages) return 4;
    const int64_t G = H / Hkv;
    const int64_t row = Hkv * D;
    const int64_t tiles = (n + PREFILL_TILE - 1) / PREFILL_TILE;
    /* the decode kernel's condition for `scores8`; otherwise both score with `dot` */
    const int fast = D % 8 == 0 && D / 8 <= MAX_D8;
    /* the decode kernel's condition for `scores16_bf16` */
    const int bf16dot = RS_BF16_DOT && dtype == 1 && D % 32 == 0;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t HG = PREFILL_TILE * G;
        /* scores [HG, ctx], queries [HG, D], accumulators [HG, D], K/V block [KB, D] */
        float *buf = (float *)malloc(sizeof(float) *
                                     (size_t)(HG * ctx + 2 * HG * D + PREFILL_KB * D + D));
        if (buf == NULL) {
#pragma omp atomic write
            failed = 3;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < Hkv * tiles; ++task) {
            if (buf == NULL) continue;
            /* the longest tiles (last rows) first: better balance at the end */
            const int64_t tile = tiles - 1 - task / Hkv, kh = task % Hkv;
            const int64_t r0 = tile * PREFILL_TILE;
            const int64_t nr = n - r0 < PREFILL_TILE ? n - r0 : PREFILL_TILE;
            const int64_t L0 = ctx - n + r0 + 1; /* keys of the tile's first row */
            const int64_t Lmax = L0 + nr - 1;
            float *scores = buf, *qs = buf + HG * ctx, *acc = qs + HG * D;
            float *blk = acc + HG * D, *tmp = blk + PREFILL_KB * D;
            for (int64_t r = 0; !bf16dot && r < nr; ++r)
                for (int64_t g = 0; g < G; ++g) {
                    const float *qr = row_f32(dtype, q, (r0 + r) * q_stride_t +
                                              (kh * G + g) * q_stride_h, D, tmp);
                    for (int64_t i = 0; i < D; ++i) qs[(r * G + g) * D + i] = qr[i] * scale;
                }
            /* scores, a block of keys at a time */
#if RS_BF16_DOT
            for (int64_t t0 = 0; bf16dot && t0 < Lmax; t0 += PREFILL_KB) {
                /* keys read in place as bfloat16: only their offsets per block */
                const int64_t nk = Lmax - t0 < PREFILL_KB ? Lmax - t0 : PREFILL_KB;
                int64_t koffs[PREFILL_KB];
                for (int64_t j = 0; j < nk; ++j) {
                    const int64_t t = t0 + j;
                    koffs[j] = (pages[t / P] * P + t % P) * row + kh * D;
                }
                for (int64_t r = 0; r < nr; ++r) {
                    const int64_t L = L0 + r;
                    if (t0 >= L) continue;
                    const int64_t m = L - t0 < nk ? L - t0 : nk;
                    for (int64_t g = 0; g < G; ++g) {
                        const uint16_t *qr = (const uint16_t *)q + (r0 + r) * q_stride_t +
                                             (kh * G + g) * q_stride_h;
                        for (int64_t j = 0; j < m; j += BF16_KEYS)
                            scores16_bf16(qr, (const uint16_t *)k_cache, koffs + j, 0,
                                          m - j < BF16_KEYS ? m - j : BF16_KEYS, D, scale,
                                          scores + (r * G + g) * ctx + t0 + j);
                    }
                }
            }
#endif
            for (int64_t t0 = 0; !bf16dot && t0 < Lmax; t0 += PREFILL_KB) {
                const int64_t nk = Lmax - t0 < PREFILL_KB ? Lmax - t0 : PREFILL_KB;
                for (int64_t j = 0; j < nk; ++j) {
                    const int64_t t = t0 + j, slot = pages[t / P] * P + t % P;
                    const float *kr = row_f32(dtype, k_cache, slot * row + kh * D, D, tmp);
                    if (kr != blk + j * D) memcpy(blk + j * D, kr, sizeof(float) * (size_t)D);
                }
                for (int64_t r = 0; r < nr; ++r) {
                    const int64_t L = L0 + r;
                    if (t0 >= L) continue;
                    const int64_t m = L - t0 < nk ? L - t0 : nk;
                    for (int64_t g = 0; g < G; ++g) {
                        float *sr = scores + (r * G + g) * ctx + t0;
                        if (fast) {
                            scores_block(qs + (r * G + g) * D, blk, m, D, sr);
                        } else {
                            for (int64_t j = 0; j < m; ++j)
                                sr[j] = dot(qs + (r * G + g) * D, blk + j * D, D);
                        }
                    }
                }
            }
            for (int64_t r = 0; r < nr; ++r)
                for (int64_t g = 0; g < G; ++g) softmax_row(scores + (r * G + g) * ctx, L0 + r);
            memset(acc, 0, sizeof(float) * (size_t)(nr * G * D));
            for (int64_t t0 = 0; t0 < Lmax; t0 += PREFILL_KB) {
                const int64_t nk = Lmax - t0 < PREFILL_KB ? Lmax - t0 : PREFILL_KB;
                for (int64_t j = 0; j < nk; ++j) {
                    const int64_t t = t0 + j, slot = pages[t / P] * P + t % P;
                    const float *vr = row_f32(dtype, v_cache, slot * row + kh * D, D, tmp);
                    if (vr != blk + j * D) memcpy(blk + j * D, vr, sizeof(float) * (size_t)D);
                }
                for (int64_t r = 0; r < nr; ++r) {
                    const int64_t L = L0 + r;
                    if (t0 >= L) continue;
                    const int64_t m = L - t0 < nk ? L - t0 : nk;
                    for (int64_t g = 0; g < G; ++g) {
                        const float *pr = scores + (r * G + g) * ctx + t0;
                        float *ar = acc + (r * G + g) * D;
                        if (fast) {
                            pv_block(pr, blk, m, D, ar);
                        } else {
                            for (int64_t j = 0; j < m; ++j) axpy(ar, pr[j], blk + j * D, D);
                        }
                    }
                }
            }
            for (int64_t r = 0; r < nr; ++r)
                for (int64_t g = 0; g < G; ++g)
                    store_row(dtype, out, ((r0 + r) * H + kh * G + g) * D, acc + (r * G + g) * D,
                              D);
        }
        free(buf);
    }
    return failed;
}

/* residual [M, N] += x (when x is not NULL); out = residual * rsqrt(mean(residual^2) + eps)
 * * weight, all float32 (transformers' LlamaRMSNorm arithmetic). Rows are split across threads
 * only when there is enough work to pay for waking them. */
int rs_add_rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t M,
                    int64_t N, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (M * N >= 65536) schedule(static)
    for (int64_t m = 0; m < M; ++m) {
        float *r = residual + m * N;
        if (x != NULL) {
            const float *xr = x + m * N;
#pragma omp simd
            for (int64_t i = 0; i < N; ++i) r[i] += xr[i];
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < N; ++i) ss += r[i] * r[i];
        const float inv = 1.f / sqrtf(ss / (float)N + eps);
        float *o = out + m * N;
#pragma omp simd
        for (int64_t i = 0; i < N; ++i) o[i] = (r[i] * inv) * weight[i];
    }
    return 0;
}

/* The bfloat16 forms of the layer's element-wise steps, fused. Each rounds to bfloat16 exactly
 * where torch's bfloat16 ops round (after every op, as transformers' Llama modules run them), so
 * they compute the eager forward's values in one pass instead of 3-8 torch ops, each of which
 * reads and writes the activations and costs a dispatch. */

/* residual [M, N] += x (rounded, when x is not NULL); out = bf16(weight * bf16(r * rsqrt(
 * mean(r^2) + eps))) with r and the mean in float32: transformers' LlamaRMSNorm on bfloat16
 * activations. */
int rs_add_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight,
                         uint16_t *out, int64_t M, int64_t N, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (M * N >= 65536) schedule(static)
    for (int64_t m = 0; m < M; ++m) {
        uint16_t *r = residual + m * N;
        if (x != NULL) {
            const uint16_t *xr = x + m * N;
#pragma omp simd
            for (int64_t i = 0; i < N; ++i) r[i] = f32_to_bf16(bf16_to_f32(r[i]) + bf16_to_f32(xr[i]));
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < N; ++i) ss += bf16_to_f32(r[i]) * bf16_to_f32(r[i]);
        const float inv = 1.f / sqrtf(ss / (float)N + eps);
        uint16_t *o = out + m * N;
#pragma omp simd
        for (int64_t i = 0; i < N; ++i)
            o[i] = f32_to_bf16(bf16_to_f32(weight[i]) *
                               bf16_to_f32(f32_to_bf16(bf16_to_f32(r[i]) * inv)));
    }
    return 0;
}

/* Rotate-half RoPE in place on x [T, heads, D] (row stride `stride_t` elements, heads
 * contiguous): x1' = x1*cos - x2*sin, x2' = x2*cos + x1*sin with cos, sin [T, D/2] in x's dtype,
 * each product and sum rounded as torch rounds it (no fused multiply-add: float32 torch does
 * not contract them either). */
__attribute__((optimize("fp-contract=off")))
int rs_rope(int dtype, void *x, int64_t T, int64_t heads, int64_t D, int64_t stride_t,
            const void *cos, const void *sin, int num_threads) {
    if (D % 2) return 1;
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(num_threads) if (T * heads * D >= 65536) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
            if (dtype == 0) {
                float *a = (float *)x + t * stride_t + h * D, *b = a + half;
                const float *c = (const float *)cos + t * half, *s = (const float *)sin + t * half;
#pragma omp simd
                for (int64_t i = 0; i < half; ++i) {
                    const float x1 = a[i], x2 = b[i];
                    const float p = x1 * c[i], q = x2 * s[i], u = x2 * c[i], v = x1 * s[i];
                    a[i] = p - q;
                    b[i] = u + v;
                }
            } else {
                uint16_t *a = (uint16_t *)x + t * stride_t + h * D, *b = a + half;
                const uint16_t *c = (const uint16_t *)cos + t * half;
                const uint16_t *s = (const uint16_t *)sin + t * half;
#pragma omp simd
                for (int64_t i = 0; i < half; ++i) {
                    const float x1 = bf16_to_f32(a[i]), x2 = bf16_to_f32(b[i]);
                    const float ci = bf16_to_f32(c[i]), si = bf16_to_f32(s[i]);
                    const float p = bf16_to_f32(f32_to_bf16(x1 * ci));
                    const float q = bf16_to_f32(f32_to_bf16(x2 * si));
                    const float u = bf16_to_f32(f32_to_bf16(x2 * ci));
                    const float v = bf16_to_f32(f32_to_bf16(x1 * si));
                    a[i] = f32_to_bf16(p - q);
                    b[i] = f32_to_bf16(u + v);
                }
            }
        }
    }
    return 0;
}

/* The element-wise kernels below work on VL lanes, one register of the target: 16 with
 * AVX-512, else 8 (a wider generic vector than the target's registers goes through the stack
 * with GCC, see `PV_ROWS_64`). Element-wise arithmetic gives the same values at any width. */
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
typedef float vlf __attribute__((vector_size(VL * 4)));
typedef int32_t vli __attribute__((vector_size(VL * 4)));
typedef uint32_t vlu32 __attribute__((vector_size(VL * 4)));
typedef uint16_t vlu16 __attribute__((vector_size(VL * 2)));
DEFINE_EXP_NONPOS(expv_nonpos, vlf, vli)

/* VL values of a float32 or bfloat16 row from element i, widened to float32 (exact) */
static inline vlf loadv_any(int dtype, const void *base, int64_t i) {
    vlf f;
    if (dtype == 0) {
        memcpy(&f, (const float *)base + i, sizeof f);
        return f;
    }
    vlu16 h;
    memcpy(&h, (const uint16_t *)base + i, sizeof h);
    const vlu32 w = __builtin_convertvector(h, vlu32) << 16;
    memcpy(&f, &w, sizeof f);
    return f;
}

/* `f32_to_bf16` on VL lanes (the same bit operations, so the same values): rounded to
 * bfloat16 and widened back, or stored as bfloat16. GCC leaves the scalar helper in a
 * per-lane loop. */
static inline vlu32 bf16_bitsv(vlf f) {
    vlu32 u;
    memcpy(&u, &f, sizeof u);
    return u + 0x7FFFu + ((u >> 16) & 1u);
}
static inline vlf round_bf16_v(vlf f) {
    const vlu32 u = bf16_bitsv(f) & 0xFFFF0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline void storev_any(int dtype, void *base, int64_t i, vlf f) {
    if (dtype == 0) {
        memcpy((float *)base + i, &f, sizeof f);
        return;
    }
    const vlu16 h = __builtin_convertvector(bf16_bitsv(f) >> 16, vlu16);
    memcpy((uint16_t *)base + i, &h, sizeof h);
}

/* silu(g) * u on VL lanes, the SiLU rounded to the activation dtype first (torch's two ops);
 * sigmoid through `expv_nonpos` of -|g|, so no lane overflows. Returns float32 lanes of the
 * product (still to be rounded to bfloat16 by the caller). */
static inline vlf silu_mulv(int dtype, vlf g, vlf u) {
    const vli neg = g < (vlf){0};
    const vli abs_mask = (vli){0} + 0x7fffffff;
    const vlf e = expv_nonpos((vlf){0} - (vlf)((vli)g & abs_mask)); /* exp(-|g|) */
    const vlf one = (vlf){0} + 1.0f;
    /* g * sigmoid(g): g / (1 + e) for g >= 0 (torch's formula), g * e / (1 + e) below */
    const vlf num = (vlf)(((vli)one & ~neg) | ((vli)e & neg));
    vlf silu = (g * num) / (one + e);
    if (dtype != 0) silu = round_bf16_v(silu);
    return silu * u;
}

/* out [T, I] = silu(gu[:, :I]) * gu[:, I:] (gu [T, 2I] contiguous, out contiguous): SwiGLU's
 * activation in one pass. */
int rs_silu_mul(int dtype, const void *gu, void *out, int64_t T, int64_t I, int num_threads) {
    const size_t es = dtype == 0 ? 4 : 2;
#pragma omp parallel for num_threads(num_threads) if (T * I >= 65536) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const int64_t g0 = t * 2 * I, u0 = g0 + I, o0 = t * I;
        int64_t i = 0;
        for (; i + VL <= I; i += VL)
            storev_any(dtype, out, o0 + i,
                        silu_mulv(dtype, loadv_any(dtype, gu, g0 + i),
                                   loadv_any(dtype, gu, u0 + i)));
        if (i < I) { /* the tail, padded with its own first element */
            char g[64], u[64], y[64];
            for (int64_t j = 0; j < VL; ++j) {
                const int64_t k = i + (i + j < I ? j : 0);
                memcpy(g + j * es, (const char *)gu + (g0 + k) * es, es);
                memcpy(u + j * es, (const char *)gu + (u0 + k) * es, es);
            }
            storev_any(dtype, y, 0, silu_mulv(dtype, loadv_any(dtype, g, 0),
                                                loadv_any(dtype, u, 0)));
            memcpy((char *)out + (o0 + i) * es, y, (size_t)(I - i) * es);
        }
    }
    return 0;
}

/* out[s] = argmax of row s of x [S, V] (float32, row stride `stride` elements), torch's
 * `argmax` semantics: the first index of the maximum, or of the first NaN when the row has one.
 * Rows split across threads; each row is two passes over VL lanes (the maximum and whether a
 * NaN is there, then the first index holding it), ~3.3x faster than torch's CPU argmax on a
 * 64 x 49,152 step (docs/benchmarks.md). */
int rs_argmax_rows(const float *x, int64_t S, int64_t V, int64_t stride, int64_t *out,
                   int num_threads) {
    if (V <= 0) return 1;
#pragma omp parallel for num_threads(num_threads) if (S * V >= 65536) schedule(static)
    for (int64_t s = 0; s < S; ++s) {
        const float *r = x + s * stride;
        vlf m = (vlf){0} - INFINITY;
        vli nan = (vli){0};
        int64_t i = 0;
        for (; i + VL <= V; i += VL) {
            vlf v;
            memcpy(&v, r + i, sizeof v);
            const vli gt = v > m;
            m = (vlf)(((vli)v & gt) | ((vli)m & ~gt));
            nan |= v != v;
        }
        float best = -INFINITY;
        int any_nan = 0;
        for (int j = 0; j < VL; ++j) {
            best = m[j] > best ? m[j] : best;
            any_nan |= nan[j] != 0;
        }
        for (int64_t k = i; k < V; ++k) {
            best = r[k] > best ? r[k] : best;
            any_nan |= r[k] != r[k];
        }
        int64_t at = 0;
        if (any_nan) {
            while (r[at] == r[at]) ++at;
        } else {
            while (r[at] != best) ++at;
        }
        out[s] = at;
    }
    return 0;
}

/* The step's new K and V rows into their slots of the paged pool: row t of k and v (Hkv * D
 * contiguous elements each, token strides k_stride / v_stride: views of the fused QKV output)
 * goes to slot slots[t] of k_cache / v_cache [num_slots, Hkv * D]. One call for both caches,
 * instead of two `index_copy_` dispatches per layer. Returns 4 for a slot outside the pool
 * (checked before anything is written). */
int rs_store_kv(int dtype, const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                void *k_cache, void *v_cache, const int64_t *slots, int64_t T, int64_t row,
                int64_t num_slots) {
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots) return 4;
    const size_t es = dtype == 0 ? 4 : 2, bytes = (size_t)row * es;
    for (int64_t t = 0; t < T; ++t) {
        memcpy((char *)k_cache + (size_t)slots[t] * bytes, (const char *)k + (size_t)(t * k_stride) * es, bytes);
        memcpy((char *)v_cache + (size_t)slots[t] * bytes, (const char *)v + (size_t)(t * v_stride) * es, bytes);
    }
    return 0;
}

/* One row through a linear layer whose bfloat16 weights oneDNN has packed (torch's
 * `mkldnn._reorder_linear_weight`): y[N] = x[K] . W^T, read from oneDNN's own buffer, laid out
 * [N/64][K/2][64][2] (64 outputs per block, consecutive k in pairs: the VNNI layout that
 * `vdpbf16ps` consumes). oneDNN runs a single row through a matrix-vector path that streams the
 * weights at ~31 GB/s on a 2-core Zen 5 (of the ~47 GB/s this VM reads) and whose sums differ
 * from its GEMM's; this kernel streams them sequentially per thread and reproduces the GEMM's
 * arithmetic, so a lone decode gets the bits a batched one gets:
 *   each output accumulates its k pairs in order with `vdpbf16ps`, restarting every `kblk`
 *   elements (oneDNN's K blocking, measured per shape by the caller), the blocks' sums added
 *   in order, then rounded to bfloat16 (nearest even).
 *   x: K bf16; w: oneDNN's buffer; y: N bf16; sizes checked by `rs_linear_bf16_packed`. */
#define GEMV_NB 64
/* `tile(R, ...)` with the tile's row count R = mr (1..6) as a compile-time constant: the tile
 * functions are always_inline, so each count gets its own register allocation */
#define TILE_BY_ROWS(tile, mr, ...)                                                          \
    do {                                                                                     \
        switch (mr) {                                                                        \
        case 6: tile(6, __VA_ARGS__); break;                                                 \
        case 5: tile(5, __VA_ARGS__); break;                                                 \
        case 4: tile(4, __VA_ARGS__); break;                                                 \
        case 3: tile(3, __VA_ARGS__); break;                                                 \
        case 2: tile(2, __VA_ARGS__); break;                                                 \
        default: tile(1, __VA_ARGS__); break;                                                \
        }                                                                                    \
    } while (0)
#if RS_BF16_DOT
static int gemv_bf16_packed(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t N,
                            int64_t K, int64_t kblk, int num_threads) {
    const int64_t blocks = N / GEMV_NB;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t nb = 0; nb < blocks; ++nb) {
        const uint16_t *wb = w + nb * K * GEMV_NB;
        __m512 tot[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                         _mm512_setzero_ps()};
        for (int64_t k0 = 0; k0 < K; k0 += kblk) {
            const int64_t k1 = k0 + kblk < K ? k0 + kblk : K;
            __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                           _mm512_setzero_ps()};
            for (int64_t k = k0; k < k1; k += 2) {
                const uint16_t *wk = wb + k * GEMV_NB;
                /* the four lines of the k pair 8 steps (2 KiB) ahead: a block's weights are
                 * one sequential stream, but the hardware prefetcher stops at 4 KiB pages */
                __builtin_prefetch(wk + 16 * GEMV_NB, 0, 3);
                __builtin_prefetch(wk + 16 * GEMV_NB + 32, 0, 3);
                __builtin_prefetch(wk + 16 * GEMV_NB + 64, 0, 3);
                __builtin_prefetch(wk + 16 * GEMV_NB + 96, 0, 3);
                int32_t xp;
                memcpy(&xp, x + k, 4);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp);
                for (int u = 0; u < 4; ++u)
                    a[u] = _mm512_dpbf16_ps(a[u], xv,
                                            (__m512bh)_mm512_loadu_si512(wk + 32 * u));
            }
            for (int u = 0; u < 4; ++u) tot[u] = k0 == 0 ? a[u] : _mm512_add_ps(tot[u], a[u]);
        }
        for (int u = 0; u < 4; ++u)
            _mm256_storeu_si256((__m256i *)(y + nb * GEMV_NB + 16 * u),
                                (__m256i)_mm512_cvtneps_pbh(tot[u]));
    }
    return 0;
}
#endif

/* Rows through the same packed bf16 linear as the GEMV above, with the same per-row
 * arithmetic (so every row gets the bits oneDNN's GEMM gives it, whatever M), tiled GEMM_MR rows
 * x 64 outputs in registers; one row goes to the GEMV. Why not oneDNN: at decode-sized M it
 * streams each weight block from DRAM while it computes on it (~680 GFLOP/s over SmolLM2's 30
 * layers at M = 64 on a 2-core Zen 5); here each thread prefetches its next 64-output block
 * while it computes the current one over all rows, which then come from L2 (~860 GFLOP/s; at
 * or above oneDNN for M = 2..512, CHANGELOG.md, 2026-11-24).
 *   x: M x K bf16 (row stride K); y: M x N bf16 (row stride N); N % 64 == 0, K, kblk even.
 * Returns 0; 1 on bad sizes; 5 where the build lacks AVX512-BF16 (the caller keeps oneDNN). */
/* The GEMMs' split of work among threads: their panels (64 or 16 outputs) times row tiles,
 * panel-major, cut into equal contiguous shares [*w0, *w1), so a share may end inside a panel
 * and leave its other row tiles to the next thread. Split by panel alone, the 576-output
 * projections' 9 blocks went 5 and 4 on two threads (~10% of those calls lost; CHANGELOG.md, 2026-11-24).
 * A row's arithmetic does not depend on its tile, so the results do not depend on the split.
 * Call inside the parallel region. */
static inline void thread_share(int64_t work, int64_t *w0, int64_t *w1) {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    *w0 = work * t / n;
    *w1 = work * (t + 1) / n;
}
/* the row tiles [*t0, *t1) of the panel whose items start at `first` (of `tiles`) that lie in
 * the share [w0, w1); empty where none do */
static inline void share_tiles(int64_t first, int64_t tiles, int64_t w0, int64_t w1,
                               int64_t *t0, int64_t *t1) {
    *t0 = first < w0 ? w0 - first : 0;
    *t1 = first + tiles > w1 ? w1 - first : tiles;
}

#define GEMM_MR 6
_Static_assert(GEMM_MR <= 6, "TILE_BY_ROWS covers 1..6 rows");
#if RS_BF16_DOT
static inline __attribute__((always_inline)) void gemm_tile(
        const int mr, const uint16_t *x, int64_t K, const uint16_t *wb, int64_t kblk,
        float *tot, const char *pf, int64_t *pf_off, int64_t pf_end, int64_t pf_lines) {
    for (int64_t k0 = 0; k0 < K; k0 += kblk) {
        const int64_t k1 = k0 + kblk < K ? k0 + kblk : K;
        __m512 a[GEMM_MR][4];
        for (int r = 0; r < mr; ++r)
            for (int u = 0; u < 4; ++u) a[r][u] = _mm512_setzero_ps();
        for (int64_t k = k0; k < k1; k += 2) {
            const uint16_t *wk = wb + k * GEMV_NB;
            const __m512bh b0 = (__m512bh)_mm512_loadu_si512(wk);
            const __m512bh b1 = (__m512bh)_mm512_loadu_si512(wk + 32);
            const __m512bh b2 = (__m512bh)_mm512_loadu_si512(wk + 64);
            const __m512bh b3 = (__m512bh)_mm512_loadu_si512(wk + 96);
            for (int64_t l = 0; l < pf_lines && *pf_off < pf_end; ++l, *pf_off += 64)
                __builtin_prefetch(pf + *pf_off, 0, 3);
            for (int r = 0; r < mr; ++r) {
                int32_t xp;
                memcpy(&xp, x + r * K + k, 4);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp);
                a[r][0] = _mm512_dpbf16_ps(a[r][0], xv, b0);
                a[r][1] = _mm512_dpbf16_ps(a[r][1], xv, b1);
                a[r][2] = _mm512_dpbf16_ps(a[r][2], xv, b2);
                a[r][3] = _mm512_dpbf16_ps(a[r][3], xv, b3);
            }
        }
        for (int r = 0; r < mr; ++r)
            for (int u = 0; u < 4; ++u) {
                float *t = tot + r * GEMV_NB + 16 * u;
                _mm512_storeu_ps(t, k0 == 0 ? a[r][u] : _mm512_add_ps(_mm512_loadu_ps(t), a[r][u]));
            }
    }
}
#endif

int rs_linear_bf16_packed(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M,
                          int64_t N, int64_t K, int64_t kblk, int num_threads) {
#if RS_BF16_DOT
    if (M <= 0 || N <= 0 || N % GEMV_NB || K <= 0 || K % 2 || kblk <= 0 || kblk % 2) return 1;
    if (M == 1) return gemv_bf16_packed(x, w, y, N, K, kblk, num_threads);
    const int64_t blocks = N / GEMV_NB, tiles = (M + GEMM_MR - 1) / GEMM_MR;
    const int64_t block_bytes = K * GEMV_NB * 2;
    /* lines of the next block to prefetch per k pair, so it is all requested within the
     * current block's first pass over the tiles */
    const int64_t pf_lines = (block_bytes / 64 + tiles * (K / 2) - 1) / (tiles * (K / 2));
#pragma omp parallel num_threads(num_threads)
    {
        float tot[GEMM_MR * GEMV_NB];
        int64_t w0, w1;
        thread_share(blocks * tiles, &w0, &w1);
        for (int64_t nb = w0 / tiles; nb * tiles < w1; ++nb) {
            const uint16_t *wb = w + nb * K * GEMV_NB;
            const char *pf = (const char *)(wb + K * GEMV_NB);
            int64_t pf_off = 0;
            /* the next block, where this share goes on to it */
            const int64_t pf_end = (nb + 1) * tiles < w1 ? block_bytes : 0;
            int64_t t0, t1;
            share_tiles(nb * tiles, tiles, w0, w1, &t0, &t1);
            for (int64_t m0 = t0 * GEMM_MR; m0 < M && m0 < t1 * GEMM_MR; m0 += GEMM_MR) {
                const int64_t mr = M - m0 < GEMM_MR ? M - m0 : GEMM_MR;
                const uint16_t *xm = x + m0 * K;
                TILE_BY_ROWS(gemm_tile, mr, xm, K, wb, kblk, tot, pf, &pf_off, pf_end, pf_lines);
                for (int64_t r = 0; r < mr; ++r)
                    for (int u = 0; u < 4; ++u)
                        _mm256_storeu_si256(
                            (__m256i *)(y + (m0 + r) * N + nb * GEMV_NB + 16 * u),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(tot + r * GEMV_NB + 16 * u)));
            }
        }
    }
    return 0;
#else
    (void)x, (void)w, (void)y, (void)M, (void)N, (void)K, (void)kblk, (void)num_threads;
    return 5;
#endif
}

/* The float32 twin of `rs_linear_bf16_packed`: rows through a float32 weight oneDNN has packed
 * ([N/64][K][64]: 64 outputs per block, k-major inside), each output summed as oneDNN's GEMM
 * sums it: one FMA per k in order, restarted every `kblk` elements of K, the blocks' sums added
 * in order (measured per shape by the caller: on the Zen 5 VM 512 for K = 576 and 1024 for
 * K = 1536 with AVX-512, 576 and 1024 with oneDNN capped at AVX2). Tiled F32_MR rows x
 * F32_NT vectors in registers (AVX-512: 6 x 4 zmm, a whole block; AVX2: 6 x 2 ymm, a quarter
 * of a block, within 16 registers); each thread prefetches its next block while it computes.
 *   x: M x K float32 (row stride K); y: M x N float32 (row stride N); N % 64 == 0.
 * Returns 0; 1 on bad sizes; 5 where the build has no AVX2 + FMA (the caller keeps oneDNN). */
#if defined(__AVX512F__)
#define RS_F32_GEMM 2 /* `rs_has_f32_gemm`: 2 AVX-512, 1 AVX2 */
#define F32_VW 16
#define F32_MR 6
#define F32_NT 4
typedef __m512 f32v;
#define F32_LOAD _mm512_loadu_ps
#define F32_STORE _mm512_storeu_ps
#define F32_ZERO _mm512_setzero_ps
#define F32_SET1 _mm512_set1_ps
#define F32_FMA _mm512_fmadd_ps
#define F32_ADD _mm512_add_ps
#define F32_MUL _mm512_mul_ps
#elif defined(__AVX2__) && defined(__FMA__)
#define RS_F32_GEMM 1
#define F32_VW 8
#define F32_MR 6
#define F32_NT 2
typedef __m256 f32v;
#define F32_LOAD _mm256_loadu_ps
#define F32_STORE _mm256_storeu_ps
#define F32_ZERO _mm256_setzero_ps
#define F32_SET1 _mm256_set1_ps
#define F32_FMA _mm256_fmadd_ps
#define F32_ADD _mm256_add_ps
#define F32_MUL _mm256_mul_ps
#else
#define RS_F32_GEMM 0
#endif

#if RS_F32_GEMM == 2
/* 16 bfloat16 weights widened to float32: exact (a bf16 is a float32's high half) */
#define F32_LOAD_BF16(p)                                                                       \
    _mm512_castsi512_ps(                                                                       \
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#elif RS_F32_GEMM == 1
#define F32_LOAD_BF16(p)                                                                       \
    _mm256_castsi256_ps(                                                                       \
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#endif

#if RS_F32_GEMM == 2
/* 16 int8 weights widened to float32 (exact) */
#define F32_LOAD_I8(p)                                                                         \
    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#elif RS_F32_GEMM == 1
#define F32_LOAD_I8(p)                                                                         \
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#endif

#if RS_F32_GEMM
_Static_assert(F32_MR <= 6, "TILE_BY_ROWS covers 1..6 rows");
#define F32_TILE (F32_NT * F32_VW) /* outputs per tile: 64 (AVX-512) or 16 (AVX2) */
/* the locality of the float32 GEMM's prefetches of the weight stream: 1 (`prefetcht2`) brings
 * the lines into L2, whose request queue has ~3x the entries of L1's fill buffers, so a core
 * keeps more lines in flight from DRAM; the loads that follow find them in L2. Four layers of
 * Qwen2.5-1.5B's projections over bf16 weights (past the L3), best ms, locality 3 / 2 / 1,
 * avx512_bf16 VM: 1 row 15.17 / 14.02 / 13.70, 4 rows 18.24 / 16.95 / 16.96, 8 rows 22.37 /
 * 20.79 / 20.42, 16 rows 34.58 / 31.69 / 31.35, 24 rows 44.11 / 41.28 / 40.98; one layer of
 * Qwen2.5-7B's at 1 row 18.24 / 17.68 / 16.91 (`benchmarks/f32_gemm_variants_ab.py --macro
 * W_PF_HINT`); not measured on the Zen kinds. */
#ifndef W_PF_HINT
#define W_PF_HINT 1
#endif
/* The weight kinds the float32 GEMM reads: float32, bfloat16 or int8 (the latter two widened
 * exactly as they are loaded; int8 sums are multiplied by their output's scale at the end). */
enum { W_F32 = 0, W_BF16 = 1, W_I8 = 2 };
/* F32_VW weights of kind wk at element i of base, as float32 */
static inline __attribute__((always_inline)) f32v f32_load_w(const int wk, const void *base,
                                                             int64_t i) {
    if (wk == W_BF16) return F32_LOAD_BF16((const uint16_t *)base + i);
    if (wk == W_I8) return F32_LOAD_I8((const int8_t *)base + i);
    return F32_LOAD((const float *)base + i);
}
/* nv vectors of narrow weights (wk: W_BF16 or W_I8) at element i of base, widened into dst */
static inline __attribute__((always_inline)) void widen_w(const int wk, const void *base,
                                                          int64_t i, float *dst, int nv) {
    for (int u = 0; u < nv; ++u)
        F32_STORE(dst + u * F32_VW, wk == W_BF16 ? f32_load_w(W_BF16, base, i + u * F32_VW)
                                                 : f32_load_w(W_I8, base, i + u * F32_VW));
}
/* y[j] *= s[j] for j < n (n a multiple of F32_VW): an int8 weight's per-output scale */
static inline void scale_out(float *y, const float *s, int64_t n) {
    for (int64_t j = 0; j < n; j += F32_VW)
        F32_STORE(y + j, F32_MUL(F32_LOAD(y + j), F32_LOAD(s + j)));
}
/* One tile of rows x F32_TILE outputs. The weights at wb, k-major with row stride ws, are
 * float32, or bfloat16 or int8 widened as they are loaded (wk); either way each output is
 * the same chain of float32 FMAs, so the two give the same bits for bf16-exact weights. */
static inline __attribute__((always_inline)) void f32_tile(
        const int mr, const float *x, int64_t K, const void *wb, const int wk, int64_t ws,
        int64_t kblk, float *tot, const char *pf, int64_t *pf_off, int64_t pf_end,
        int64_t pf_lines) {
    for (int64_t k0 = 0; k0 < K; k0 += kblk) {
        const int64_t k1 = k0 + kblk < K ? k0 + kblk : K;
        f32v a[F32_MR][F32_NT];
        for (int r = 0; r < mr; ++r)
            for (int u = 0; u < F32_NT; ++u) a[r][u] = F32_ZERO();
        for (int64_t k = k0; k < k1; ++k) {
            for (int64_t l = 0; l < pf_lines && *pf_off < pf_end; ++l, *pf_off += 64)
                __builtin_prefetch(pf + *pf_off, 0, W_PF_HINT);
            f32v b[F32_NT];
            for (int u = 0; u < F32_NT; ++u) b[u] = f32_load_w(wk, wb, k * ws + u * F32_VW);
            for (int r = 0; r < mr; ++r) {
                const f32v xv = F32_SET1(x[r * K + k]);
                for (int u = 0; u < F32_NT; ++u) a[r][u] = F32_FMA(xv, b[u], a[r][u]);
            }
        }
        for (int r = 0; r < mr; ++r)
            for (int u = 0; u < F32_NT; ++u) {
                float *t = tot + r * F32_TILE + u * F32_VW;
                F32_STORE(t, k0 == 0 ? a[r][u] : F32_ADD(F32_LOAD(t), a[r][u]));
            }
    }
}
/* how far ahead of its reads `f32_row64` prefetches its block's stream, in bytes: one row
 * is bound by streaming the weights, and the hardware prefetcher stops at 4 KiB pages.
 * Qwen2.5-1.5B's four projections at one row, weights dropped from the caches first, median
 * GB/s on the avx512_bf16 VM: bf16 weights 18.4 prefetching the next block instead, 20.0 /
 * 20.8 / 19.8 at 4 / 8 / 16 KiB ahead; float32 weights 21.1, 25.7 / 25.3 (8 / 16 KiB) / 22.8
 * (32 KiB) */
#ifndef F32_ROW_PF_BYTES
#define F32_ROW_PF_BYTES 8192
#endif
/* One row x a whole 64-output block (AVX2's F32_TILE is a quarter of one): at one row the
 * kernel is bound by streaming the weights, which this reads front to back, 128 or 256 bytes
 * per k, where the quarter tiles would cross each block four times. Same FMAs per output. */
static inline __attribute__((always_inline)) void f32_row64(
        const float *x, int64_t K, const void *wb, const int wk, int64_t kblk, float *tot) {
    enum { NV = GEMV_NB / F32_VW };
    const int64_t es = wk == W_F32 ? 4 : wk == W_BF16 ? 2 : 1; /* bytes per weight */
    const char *ahead = (const char *)wb + F32_ROW_PF_BYTES;
    for (int64_t k0 = 0; k0 < K; k0 += kblk) {
        const int64_t k1 = k0 + kblk < K ? k0 + kblk : K;
        f32v a[NV];
        for (int u = 0; u < NV; ++u) a[u] = F32_ZERO();
        for (int64_t k = k0; k < k1; ++k) {
            /* the lines of step k + F32_ROW_PF_BYTES / row bytes; past the block's end they are
             * the next block's (blocks lie back to back), past the buffer's a prefetch that
             * cannot fault */
            for (int64_t l = 0; l < es; ++l)
                __builtin_prefetch(ahead + k * GEMV_NB * es + 64 * l, 0, W_PF_HINT);
            const f32v xv = F32_SET1(x[k]);
            for (int u = 0; u < NV; ++u)
                a[u] = F32_FMA(xv, f32_load_w(wk, wb, k * GEMV_NB + u * F32_VW), a[u]);
        }
        for (int u = 0; u < NV; ++u)
            F32_STORE(tot + u * F32_VW, k0 == 0 ? a[u] : F32_ADD(F32_LOAD(tot + u * F32_VW), a[u]));
    }
}
/* f32_row64 over two blocks at once (wb and wb2, each its own chain per output, the same
 * FMAs in the same order as f32_row64's), so each thread streams two weight regions, as the
 * read-bandwidth probe found faster than one: two layers of Qwen2.5-7B's projections at one
 * row (bf16 weights, `benchmarks/f32_gemm_variants_ab.py --macro F32_ROW_PAIR`, avx512_bf16
 * VM) median 33.8 -> 32.4 ms, the AVX2 build 34.3 -> 32.1 ms. F32_ROW_PAIR 1: one block at a
 * time. */
#ifndef F32_ROW_PAIR
#define F32_ROW_PAIR 2
#endif
static inline __attribute__((always_inline)) void f32_row64x2(
        const float *x, int64_t K, const void *wb, const void *wb2, const int wk, int64_t kblk,
        float *tot, float *tot2) {
    enum { NV = GEMV_NB / F32_VW };
    const int64_t es = wk == W_F32 ? 4 : wk == W_BF16 ? 2 : 1;
    const char *ahead = (const char *)wb + F32_ROW_PF_BYTES;
    const char *ahead2 = (const char *)wb2 + F32_ROW_PF_BYTES;
    for (int64_t k0 = 0; k0 < K; k0 += kblk) {
        const int64_t k1 = k0 + kblk < K ? k0 + kblk : K;
        f32v a[NV], c[NV];
        for (int u = 0; u < NV; ++u) a[u] = c[u] = F32_ZERO();
        for (int64_t k = k0; k < k1; ++k) {
            for (int64_t l = 0; l < es; ++l) {
                __builtin_prefetch(ahead + k * GEMV_NB * es + 64 * l, 0, W_PF_HINT);
                __builtin_prefetch(ahead2 + k * GEMV_NB * es + 64 * l, 0, W_PF_HINT);
            }
            const f32v xv = F32_SET1(x[k]);
            for (int u = 0; u < NV; ++u) {
                a[u] = F32_FMA(xv, f32_load_w(wk, wb, k * GEMV_NB + u * F32_VW), a[u]);
                c[u] = F32_FMA(xv, f32_load_w(wk, wb2, k * GEMV_NB + u * F32_VW), c[u]);
            }
        }
        for (int u = 0; u < NV; ++u) {
            F32_STORE(tot + u * F32_VW, k0 == 0 ? a[u] : F32_ADD(F32_LOAD(tot + u * F32_VW), a[u]));
            F32_STORE(tot2 + u * F32_VW, k0 == 0 ? c[u] : F32_ADD(F32_LOAD(tot2 + u * F32_VW), c[u]));
        }
    }
}
/* Steps [kc0, kc1) of one tile's sums over weights of kind wk at `panel`, k-major with row
 * stride ws (a widened panel: float32, F32_TILE; or a packed block's quarter, GEMV_NB), the
 * accumulators taken from and left in `acc` (zeroed first where `fresh`): splitting a chain at
 * any k this way changes no bit, the partial sums only pass through memory unrounded. */
static inline __attribute__((always_inline)) void f32_tile_kc(
        const int mr, const float *x, int64_t K, const void *panel, const int wk, int64_t ws,
        int64_t kc0, int64_t kc1, float *acc, int fresh, const char *pf, const int pf_lines) {
    f32v a[F32_MR][F32_NT];
    for (int r = 0; r < mr; ++r)
        for (int u = 0; u < F32_NT; ++u)
            a[r][u] = fresh ? F32_ZERO() : F32_LOAD(acc + r * F32_TILE + u * F32_VW);
    for (int64_t k = kc0; k < kc1; ++k) {
        /* pf_lines lines per k of what the caller reads next (none where pf is NULL) */
        if (pf != NULL)
            for (int l = 0; l < pf_lines; ++l)
                __builtin_prefetch(pf + (k - kc0) * 64 * pf_lines + 64 * l, 0, W_PF_HINT);
        f32v b[F32_NT];
        for (int u = 0; u < F32_NT; ++u) b[u] = f32_load_w(wk, panel, k * ws + u * F32_VW);
        for (int r = 0; r < mr; ++r) {
            const f32v xv = F32_SET1(x[r * K + k]);
            for (int u = 0; u < F32_NT; ++u) a[r][u] = F32_FMA(xv, b[u], a[r][u]);
        }
    }
    for (int r = 0; r < mr; ++r)
        for (int u = 0; u < F32_NT; ++u) F32_STORE(acc + r * F32_TILE + u * F32_VW, a[r][u]);
}
#define KC_TILE_W(R, xm, kc0, kc1, acc, fresh) \
    f32_tile_kc(R, xm, K, scratch, W_F32, F32_TILE, kc0, kc1, acc, fresh, NULL, 0)
/* the same over a packed block's quarter at wb, float32, bfloat16 or int8, each k prefetching
 * its row of the next chunk (GEMV_NB weights: es lines) where pf is set */
#define KD_TILE_F32(R, xm, kc0, kc1, acc, fresh) \
    f32_tile_kc(R, xm, K, wb, W_F32, GEMV_NB, kc0, kc1, acc, fresh, pf, 4)
#define KD_TILE_BF16(R, xm, kc0, kc1, acc, fresh) \
    f32_tile_kc(R, xm, K, wb, W_BF16, GEMV_NB, kc0, kc1, acc, fresh, pf, 2)
#define KD_TILE_I8(R, xm, kc0, kc1, acc, fresh) \
    f32_tile_kc(R, xm, K, wb, W_I8, GEMV_NB, kc0, kc1, acc, fresh, pf, 1)
/* the same over a widened chunk (wf: float32, GEMV_NB per k, its first row input kc0) */
#define KW_TILE(R, xm, kc0, kc1, acc, fresh) \
    f32_tile_kc(R, (xm) + (kc0), K, wf, W_F32, GEMV_NB, 0, (kc1) - (kc0), acc, fresh, NULL, 0)
/* row tiles from which the direct path widens each chunk once for all its tiles (below that
 * the conversions cost less than the pass over a scratch), and how far ahead it prefetches,
 * in chunks: Qwen2.5-0.5B's four projections over bf16 weights, 12 layers (past the L3),
 * best ms, avx512_bf16 VM, per tile widening and one chunk ahead / widened chunks and two
 * ahead: 7 rows 20.9 / 20.5, 12 rows 26.2 / 25.6, 16 rows 33.3 / 30.9, 20 rows 40.6 / 36.0;
 * each tile widening for itself, two ahead: 7 rows 19.5, 12 rows 25.2 */
#ifndef DIRECT_WIDEN_TILES
#define DIRECT_WIDEN_TILES 3
#endif
#ifndef PF_AHEAD
#define PF_AHEAD 2
#endif
/* inputs per pass over a widened panel's row tiles: F32_KC x F32_TILE float32 weights, 16 KiB
 * (AVX2: 256 inputs x 16 outputs; AVX-512: 64 x 64), stay in L1 while every tile of the share
 * runs them */
#define F32_KC (4096 / F32_TILE)
/* rows per chunk of a widened panel's share. The chunk's rows of x are read once per kc pass
 * for every panel of the share, so they must stay in L2 across the panels: 48 rows of a
 * K = 8960 input are 1.7 MiB. With 192 rows (3.7 MiB at K = 4864) the x lines came from L3 on
 * every pass, and at 1024-2048 rows the GEMM lost a quarter: Qwen2.5-1.5B's projections over
 * bf16 weights, best ms at 2048 rows, avx512_bf16 VM: 96 rows 871, 48 rows 712 (269 GFLOP/s),
 * 24 rows 720; Qwen2.5-0.5B's 299 (192 rows) against 237 (48 rows); the AVX2 build on the same
 * VM 1,411 (192 rows) against 1,285 (48 rows). Fewer rows also keep a pass on fewer pages of x
 * (Zen 3's L2 TLB has 2048 entries). A multiple of F32_MR. */
#ifndef F32_MC
#define F32_MC (8 * F32_MR)
#endif
/* row tiles (of F32_MR rows) up to which the GEMM runs whole blocks in k chunks (direct):
 * Qwen2.5-1.5B's projections over bf16 weights, two layers, Zen 3 kind, interleaved runs,
 * best ms: 8 rows 21.1 (widened panels: 29.3), 16 rows 23.5 (32.9), 24 rows 30.9 (37.0);
 * from 32 rows level with the widened panels, and at 96 rows 16 tiles lost 20% */
#ifndef F32_DIRECT_TILES
#define F32_DIRECT_TILES 4
#endif

#define F32_TILE_W(R, ...) f32_tile(R, __VA_ARGS__, W_F32, GEMV_NB, kblk, tot, pf, &pf_off, \
                                    pf_end, pf_lines)
#define BF16_TILE_W(R, ...) f32_tile(R, __VA_ARGS__, W_BF16, GEMV_NB, kblk, tot, pf, &pf_off, \
                                     pf_end, pf_lines)
#define I8_TILE_W(R, ...) f32_tile(R, __VA_ARGS__, W_I8, GEMV_NB, kblk, tot, pf, &pf_off, \
                                   pf_end, pf_lines)

/* rows [m0, m1) of a K block's sums (acc: F32_TILE floats per row, row m0 first) into their
 * F32_TILE outputs at y (row stride N): stored for the first block, added after, in order, as
 * f32_tile adds them into tot */
static inline void add_kblock_sums(float *y, int64_t N, int64_t m0, int64_t m1, const float *acc,
                                   int first) {
    for (int64_t m = m0; m < m1; ++m, acc += F32_TILE) {
        float *yr = y + m * N;
        for (int u = 0; u < F32_NT; ++u)
            F32_STORE(yr + u * F32_VW,
                      first ? F32_LOAD(acc + u * F32_VW)
                            : F32_ADD(F32_LOAD(yr + u * F32_VW), F32_LOAD(acc + u * F32_VW)));
    }
}
/* The float32 GEMM over weights packed [N/64][K][64], float32, bfloat16 or int8 (wk: W_F32,
 * W_BF16, W_I8; int8 sums are multiplied by `scale` [N], one float32 per output, at the end).
 * With narrow weights, a thread with more than one row tile of a panel widens that panel
 * (K x F32_TILE) into its own float32 scratch once and runs all its tiles over it F32_KC inputs
 * at a time (f32_tile_kc), so the weights each pass reads stay in L1 while the rows stream
 * through: over Qwen2.5-0.5B's projections at 256 and 2048 rows, 1.3-1.9x the tile-by-tile
 * order on the Zen 3 kind with other work on the machine. The FMAs are the same, in the same
 * order per output, whatever the path. */
static int linear_f32_core(const float *x, const void *w, const int wk, const float *scale,
                           float *y, int64_t M, int64_t N, int64_t K, int64_t kblk,
                           int num_threads) {
    if (M <= 0 || N <= 0 || N % GEMV_NB || K <= 0 || kblk <= 0) return 1;
    if ((wk == W_I8) != (scale != NULL)) return 1;
    const size_t es = wk == W_F32 ? 4 : wk == W_BF16 ? 2 : 1;
    const int64_t blocks = N / GEMV_NB, tiles = (M + F32_MR - 1) / F32_MR;
    const int row64 = M == 1; /* one row: whole blocks (f32_row64) */
    const int64_t halves = row64 ? 1 : GEMV_NB / F32_TILE;
    const int64_t block_bytes = K * GEMV_NB * (int64_t)es;
    const int64_t steps = tiles * halves * K; /* k steps per block, over which to prefetch */
    const int64_t pf_lines = (block_bytes / 64 + steps - 1) / steps;
    int rc = 0;
    /* 2..F32_DIRECT_TILES row tiles: whole blocks in k chunks (direct, below); one tile keeps
     * the tile-by-tile order with its next-block prefetch (M = 5: 10% faster), more tiles the
     * widened panels */
    const int direct = tiles >= 2 && tiles <= F32_DIRECT_TILES;
    /* a block's k chunk: 16 KiB of its weights, or with narrow weights widened the
     * inputs whose weights widen to 16 KiB of float32 (widen_chunk) */
    const int widen_chunk = wk != W_F32 && tiles >= DIRECT_WIDEN_TILES;
    const int64_t kd = widen_chunk ? 4096 / GEMV_NB : 16384 / (GEMV_NB * (int64_t)es);
#pragma omp parallel num_threads(num_threads)
    {
        float tot[F32_MR * F32_TILE > GEMV_NB ? F32_MR * F32_TILE : GEMV_NB];
        float *scratch = NULL;
        int64_t w0, w1;
        const int64_t per_block = halves * tiles;
        thread_share(blocks * per_block, &w0, &w1);
        if (direct) {
            /* Per block, kd inputs at a time (16 KiB of weights, in L1): every row tile of
             * every quarter of the block in the share over them, their sums kept in `acc`
             * between chunks. So the block's lines are read from memory once, front to back,
             * where quarter panels run one after another cross the block 4 times (AVX2), and
             * no panel is widened into a scratch that a long K (8960: 573 KiB) spills from L2.
             * The FMAs per output are the same, in the same order. */
            float accs[F32_DIRECT_TILES * F32_MR * GEMV_NB];
            float wide[4096] __attribute__((aligned(64)));
            for (int64_t nb = w0 / per_block; nb * per_block < w1; ++nb) {
                const char *blk = (const char *)w + (size_t)nb * (size_t)block_bytes;
                for (int64_t k0 = 0; k0 < K; k0 += kblk) {
                    const int64_t k1 = k0 + kblk < K ? k0 + kblk : K;
                    for (int64_t kc0 = k0; kc0 < k1; kc0 += kd) {
                        const int64_t kc1 = kc0 + kd < k1 ? kc0 + kd : k1;
                        /* the lines of the chunk PF_AHEAD chunks on (the next block's past
                         * the block's end: blocks lie back to back), asked for in the first
                         * pass, or while widening */
                        const char *pf =
                            blk + (size_t)(kc1 + (PF_AHEAD - 1) * kd) * GEMV_NB * es;
                        if (widen_chunk) {
                            /* the chunk widened once for all the share's tiles, which then
                             * read float32 (the same values, so the same FMAs), where each
                             * tile widening for itself spent conversion uops on the FMA ports
                             * once per tile */
                            for (int64_t k = kc0; k < kc1; ++k) {
                                for (int64_t l = 0; l < (int64_t)es; ++l)
                                    __builtin_prefetch(pf + (k - kc0) * GEMV_NB * es + 64 * l,
                                                       0, W_PF_HINT);
                                widen_w(wk, blk, k * GEMV_NB, wide + (k - kc0) * GEMV_NB,
                                        GEMV_NB / F32_VW);
                            }
                            pf = NULL;
                        }
                        for (int64_t hf = 0; hf < halves; ++hf) {
                            const void *wb = blk + es * (size_t)(hf * F32_TILE);
                            const float *wf = wide + hf * F32_TILE;
                            int64_t t0, t1;
                            share_tiles((nb * halves + hf) * tiles, tiles, w0, w1, &t0, &t1);
                            for (int64_t t = t0; t < t1; ++t) {
                                const int64_t m0 = t * F32_MR;
                                const int mr = M - m0 < F32_MR ? (int)(M - m0) : F32_MR;
                                float *acc = accs + (hf * tiles + t) * F32_MR * F32_TILE;
                                const float *xm = x + m0 * K;
                                if (widen_chunk)
                                    TILE_BY_ROWS(KW_TILE, mr, xm, kc0, kc1, acc, kc0 == k0);
                                else if (wk == W_BF16)
                                    TILE_BY_ROWS(KD_TILE_BF16, mr, xm, kc0, kc1, acc, kc0 == k0);
                                else if (wk == W_I8)
                                    TILE_BY_ROWS(KD_TILE_I8, mr, xm, kc0, kc1, acc, kc0 == k0);
                                else
                                    TILE_BY_ROWS(KD_TILE_F32, mr, xm, kc0, kc1, acc, kc0 == k0);
                                pf = NULL;
                            }
                        }
                    }
                    for (int64_t hf = 0; hf < halves; ++hf) {
                        int64_t t0, t1;
                        share_tiles((nb * halves + hf) * tiles, tiles, w0, w1, &t0, &t1);
                        const int64_t m_end = M < t1 * F32_MR ? M : t1 * F32_MR;
                        add_kblock_sums(y + nb * GEMV_NB + hf * F32_TILE, N, t0 * F32_MR, m_end,
                                        accs + (hf * tiles + t0) * F32_MR * F32_TILE, k0 == 0);
                    }
                }
                if (scale != NULL)
                    for (int64_t hf = 0; hf < halves; ++hf) {
                        int64_t t0, t1;
                        share_tiles((nb * halves + hf) * tiles, tiles, w0, w1, &t0, &t1);
                        const int64_t m_end = M < t1 * F32_MR ? M : t1 * F32_MR;
                        for (int64_t m = t0 * F32_MR; m < m_end; ++m)
                            scale_out(y + m * N + nb * GEMV_NB + hf * F32_TILE,
                                      scale + nb * GEMV_NB + hf * F32_TILE, F32_TILE);
                    }
            }
        }
        float *part = NULL; /* the share's tiles' running sums of one panel (kc passes) */
        if (!direct && wk != W_F32 && tiles > 1) {
            scratch = (float *)malloc(sizeof(float) * (size_t)K * F32_TILE);
            part = (float *)malloc(sizeof(float) * (size_t)F32_MC * F32_TILE);
            if (scratch == NULL || part == NULL) {
#pragma omp atomic write
                rc = 3;
                w1 = w0; /* this thread computes nothing */
            }
        }
        for (int64_t nb = w0 / per_block; !direct && nb * per_block < w1; ++nb) {
            const char *blk = (const char *)w + (size_t)nb * (size_t)block_bytes;
            if (F32_ROW_PAIR > 1 && row64 && (nb + 1) * per_block < w1) {
                float tot2[GEMV_NB];
                if (wk == W_BF16)
                    f32_row64x2(x, K, blk, blk + block_bytes, W_BF16, kblk, tot, tot2);
                else if (wk == W_I8)
                    f32_row64x2(x, K, blk, blk + block_bytes, W_I8, kblk, tot, tot2);
                else
                    f32_row64x2(x, K, blk, blk + block_bytes, W_F32, kblk, tot, tot2);
                memcpy(y + nb * GEMV_NB, tot, sizeof(float) * GEMV_NB);
                memcpy(y + (nb + 1) * GEMV_NB, tot2, sizeof(float) * GEMV_NB);
                if (scale != NULL) {
                    scale_out(y + nb * GEMV_NB, scale + nb * GEMV_NB, GEMV_NB);
                    scale_out(y + (nb + 1) * GEMV_NB, scale + (nb + 1) * GEMV_NB, GEMV_NB);
                }
                ++nb;
                continue;
            }
            const char *pf = blk + block_bytes;
            int64_t pf_off = 0;
            /* the next block, where this share goes on to it */
            const int64_t pf_end = (nb + 1) * per_block < w1 ? block_bytes : 0;
            for (int64_t hf = 0; hf < halves; ++hf) {
                const void *wb = blk + es * (size_t)(hf * F32_TILE);
                const float *sc = scale == NULL ? NULL : scale + nb * GEMV_NB + hf * F32_TILE;
                int64_t t0, t1;
                share_tiles((nb * halves + hf) * tiles, tiles, w0, w1, &t0, &t1);
                const int widen = wk != W_F32 && t1 - t0 > 1;
                if (widen) {
                    for (int64_t k = 0; k < K; ++k)
                        widen_w(wk, wb, k * GEMV_NB, scratch + k * F32_TILE, F32_NT);
                    /* F32_MC rows at a time, and per kblk block in F32_KC passes over their
                     * tiles; a block's sums are then added into y as f32_tile adds them into
                     * tot. Each row's chain is the same whatever the chunking. */
                    const int64_t m_stop = M < t1 * F32_MR ? M : t1 * F32_MR;
                    for (int64_t m_beg = t0 * F32_MR; m_beg < m_stop; m_beg += F32_MC) {
                        const int64_t m_end = m_beg + F32_MC < m_stop ? m_beg + F32_MC : m_stop;
                        for (int64_t k0 = 0; k0 < K; k0 += kblk) {
                            const int64_t k1 = k0 + kblk < K ? k0 + kblk : K;
                            for (int64_t kc0 = k0; kc0 < k1; kc0 += F32_KC) {
                                const int64_t kc1 = kc0 + F32_KC < k1 ? kc0 + F32_KC : k1;
                                for (int64_t m0 = m_beg; m0 < m_end; m0 += F32_MR) {
                                    const int64_t mr = M - m0 < F32_MR ? M - m0 : F32_MR;
                                    float *acc = part + (m0 - m_beg) * F32_TILE;
                                    TILE_BY_ROWS(KC_TILE_W, mr, x + m0 * K, kc0, kc1, acc,
                                                 kc0 == k0);
                                }
                            }
                            add_kblock_sums(y + nb * GEMV_NB + hf * F32_TILE, N, m_beg, m_end,
                                            part, k0 == 0);
                        }
                        if (sc != NULL)
                            for (int64_t m = m_beg; m < m_end; ++m)
                                scale_out(y + m * N + nb * GEMV_NB + hf * F32_TILE, sc,
                                          F32_TILE);
                    }
                    continue;
                }
                for (int64_t m0 = t0 * F32_MR; m0 < M && m0 < t1 * F32_MR; m0 += F32_MR) {
                    const int64_t mr = M - m0 < F32_MR ? M - m0 : F32_MR;
                    const float *xm = x + m0 * K;
                    if (row64) {
                        if (wk == W_BF16)
                            f32_row64(xm, K, wb, W_BF16, kblk, tot);
                        else if (wk == W_I8)
                            f32_row64(xm, K, wb, W_I8, kblk, tot);
                        else
                            f32_row64(xm, K, wb, W_F32, kblk, tot);
                        memcpy(y + nb * GEMV_NB, tot, sizeof(float) * GEMV_NB);
                        if (sc != NULL) scale_out(y + nb * GEMV_NB, sc, GEMV_NB);
                        continue;
                    }
                    if (wk == W_BF16)
                        TILE_BY_ROWS(BF16_TILE_W, mr, xm, K, wb);
                    else if (wk == W_I8)
                        TILE_BY_ROWS(I8_TILE_W, mr, xm, K, wb);
                    else
                        TILE_BY_ROWS(F32_TILE_W, mr, xm, K, wb);
                    for (int64_t r = 0; r < mr; ++r) {
                        float *yr = y + (m0 + r) * N + nb * GEMV_NB + hf * F32_TILE;
                        memcpy(yr, tot + r * F32_TILE, sizeof(float) * F32_TILE);
                        if (sc != NULL) scale_out(yr, sc, F32_TILE);
                    }
                }
            }
        }
        free(scratch);
        free(part);
    }
    return rc;
}
#endif

int rs_linear_f32_packed(const float *x, const float *w, float *y, int64_t M, int64_t N,
                         int64_t K, int64_t kblk, int num_threads) {
#if RS_F32_GEMM
    return linear_f32_core(x, w, W_F32, NULL, y, M, N, K, kblk, num_threads);
#else
    (void)x, (void)w, (void)y, (void)M, (void)N, (void)K, (void)kblk, (void)num_threads;
    return 5;
#endif
}

/* `rs_linear_f32_packed` over bfloat16 weights in the same [N/64][K][64] layout (radixserve's
 * own packing, `layers.bf16_weight_linear`): float32 activations and sums, half the weight
 * bytes read. A bf16 weight widened to float32 is exact, so each row gets the bits the float32
 * kernel gives it over the widened weight: a bf16 checkpoint served in float32 keeps its
 * arithmetic and reads half the bytes per decode step.
 *   x: M x K float32; w: N x K bf16 values, packed; y: M x N float32; N % 64 == 0.
 * Returns 0; 1 on bad sizes; 3 out of memory; 5 where the build has no AVX2 + FMA. */
int rs_linear_f32_bf16w(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N,
                        int64_t K, int64_t kblk, int num_threads) {
#if RS_F32_GEMM
    return linear_f32_core(x, w, W_BF16, NULL, y, M, N, K, kblk, num_threads);
#else
    (void)x, (void)w, (void)y, (void)M, (void)N, (void)K, (void)kblk, (void)num_threads;
    return 5;
#endif
}

/* `rs_linear_f32_packed` over int8 weights in the same [N/64][K][64] layout with one float32
 * scale per output (`layers.int8_weight_linear`, ``--quantization int8``: weight-only, per
 * output channel): y = (x . w_int8) * scale, float32 activations and sums, the int8 values
 * widened exactly as they are loaded, the scale applied once per output after its whole sum;
 * a quarter of the float32 weight bytes read, and the same chain of FMAs per output for every
 * M (a row's result does not depend on the batch).
 *   x: M x K float32; w: N x K int8, packed; scale: N float32; y: M x N float32; N % 64 == 0.
 * Returns 0; 1 on bad sizes; 3 out of memory; 5 where the build has no AVX2 + FMA. */
int rs_linear_f32_i8w(const float *x, const int8_t *w, const float *scale, float *y, int64_t M,
                      int64_t N, int64_t K, int64_t kblk, int num_threads) {
#if RS_F32_GEMM
    if (scale == NULL) return 1;
    return linear_f32_core(x, w, W_I8, scale, y, M, N, K, kblk, num_threads);
#else
    (void)x, (void)w, (void)scale, (void)y, (void)M, (void)N, (void)K, (void)kblk;
    (void)num_threads;
    return 5;
#endif
}

/* The memory read bandwidth probe (`bench.bandwidth`): every float of x read once, into four
 * independent 8-wide sums per thread (so the loads, not an add chain, bound it). Each thread
 * reads its contiguous share as STREAM_READ_WAYS streams in lockstep, prefetched
 * STREAM_READ_PF bytes ahead into L2, as the linear kernels stream a weight's rows: on the
 * Intel avx512_bf16 VM one front-to-back stream per thread read 27 GB/s where a 7B decode
 * step streamed its weights at 35 GB/s; four prefetched streams read 33 GB/s. Returns the
 * sum (so the reads cannot be elided). */
#define STREAM_READ_WAYS 4
#define STREAM_READ_PF 2048
double rs_stream_read(const float *x, int64_t n, int num_threads) {
    double total = 0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        int64_t w0, w1;
        thread_share(n / 32, &w0, &w1);
        const int64_t len = (w1 - w0) / STREAM_READ_WAYS * 32; /* floats per stream */
        const float *base = x + w0 * 32;
        v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t i = 0; i < len; i += 32) {
            for (int s = 0; s < STREAM_READ_WAYS; ++s) {
                const float *p = base + s * len + i;
                __builtin_prefetch((const char *)p + STREAM_READ_PF, 0, W_PF_HINT);
                __builtin_prefetch((const char *)p + STREAM_READ_PF + 64, 0, W_PF_HINT);
                a0 += load8(p);
                a1 += load8(p + 8);
                a2 += load8(p + 16);
                a3 += load8(p + 24);
            }
        }
        /* the share's last (w1 - w0) % STREAM_READ_WAYS units */
        for (int64_t i = w0 * 32 + STREAM_READ_WAYS * len; i < w1 * 32; i += 32) {
            a0 += load8(x + i);
            a1 += load8(x + i + 8);
            a2 += load8(x + i + 16);
            a3 += load8(x + i + 24);
        }
        const v8f s = a0 + a1 + a2 + a3;
        for (int j = 0; j < 8; ++j) total += s[j];
    }
    for (int64_t i = n / 32 * 32; i < n; ++i) total += x[i];
    return total;
}

/* Write back and drop from every cache level each line of [p, p + bytes): start-up timings
 * of a model that does not fit in the last-level cache call it on the weights before each
 * timed call, so the call reads them from memory as a forward's pass over the layers does
 * (`path_choice`). `clflushopt` where the build has it (weakly ordered: ~5x the rate of
 * `clflush`, which every x86-64 build has), on torch's thread count; the fence orders the
 * flushes before the caller's next loads. */
void rs_evict_from_cache(const char *p, int64_t bytes, int num_threads) {
    if (bytes <= 0) return;
    /* from the line holding p to the one holding its last byte */
    const char *base = (const char *)((uintptr_t)p & ~(uintptr_t)63);
    const int64_t lines = (int64_t)((p + bytes - base + 63) / 64);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < lines; ++i) {
        const char *a = base + 64 * i;
#if defined(__CLFLUSHOPT__)
        _mm_clflushopt((void *)a);
#else
        _mm_clflush(a);
#endif
    }
    _mm_mfence();
}

/* whether `rs_linear_f32_packed` is built: 2 with AVX-512, 1 with AVX2 + FMA, 0 not */
int rs_has_f32_gemm(void) { return RS_F32_GEMM; }

/* A decode step's whole layer stack in one call (float32 or bfloat16: dtype 0 / 1; packed
 * weights through `rs_linear_f32_packed` / `rs_linear_bf16_packed`, or GGUF blocks through
 * `rs_quant_linear`, per projection): per layer, add + RMSNorm, QKV (+ its bias where the
 * table has one), RoPE on Q and K, K/V into their slots, paged decode attention, O, add + RMSNorm, gate/up, SiLU-and-multiply, down. These are
 * the functions the per-op path (`models/llama.py`, one ctypes call each) calls, in the same
 * order on the same data, so the results are the same bits; what goes is ~10 Python-level
 * calls, tensor allocations and argument checks per layer (~70 us per layer on the Zen 5 VM).
 *   layers: int64 [L, DL_FIELDS] addresses and K blockings (DL_* below);
 *   h: [B, hidden], the embeddings in, the last layer's output out; residual: [B, hidden],
 *   written (the first layer copies h into it); cos, sin: [B, D / 2]; all of dtype;
 *   slots: int64 [B]; page_table: int64 [B, pt_stride] (pt_cols used); seq_lens: int64 [B].
 * Returns 0, or the first failing kernel's code (3: out of memory). */
enum { DL_IN_NORM, DL_POST_NORM, DL_QKV, DL_QKV_KB, DL_O, DL_O_KB, DL_GATE_UP, DL_GATE_UP_KB,
       DL_DOWN, DL_DOWN_KB, DL_K_CACHE, DL_V_CACHE, DL_QKV_BIAS, DL_FIELDS };

/* quant_kernels.c, linked into the same library */
int rs_quant_linear(int wtype, const uint8_t *w, int64_t N, int64_t K, int xdt, const void *x,
                    int64_t M, int odt, void *out, int64_t ldo, int flags, int num_threads);

/* One projection of the layer table: kblk >= 0, radixserve's packed kernel over the packed
 * weight at w; kblk == DL_QUANTIZED, GGUF blocks: w is an int64 table {n, then per segment
 * ggml type, address of its rows' blocks, first row, end row}, each segment's rows written by
 * rs_quant_linear into their columns of y (`layers.quantized.QuantizedLinear`'s calls). */
#define DL_QUANTIZED (-1)
/* kblk == DL_AMX: w is a weight packed by rs_amx_pack_bf16 (amx_kernels.c; bfloat16 only) */
#define DL_AMX (-2)
int rs_amx_linear_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *packed,
                       int64_t N, uint16_t *y, int64_t ldy, int flags, int num_threads);
/* kblk with DL_W_BF16 set: w is bfloat16 weights packed as the float32 ones, run by
 * rs_linear_f32_bf16w with the K blocking in the low bits (bfloat16 activations widened and
 * the outputs rounded back) */
#define DL_W_BF16 ((int64_t)1 << 40)
/* kblk == DL_INT8: w is an int64 table {int8 weights packed [N/64][K][64], float32 scale [N],
 * K blocking}, run by rs_linear_f32_i8w; under bfloat16 activations the rows are widened to
 * float32 and the outputs rounded back, as `layers.int8_weight_linear` does per op */
#define DL_INT8 (-3)
int rs_linear_f32_i8w(const float *x, const int8_t *w, const float *scale, float *y, int64_t M,
                      int64_t N, int64_t K, int64_t kblk, int num_threads);

/* A float32 GEMM (`rs_linear_f32_i8w` over int8, `rs_linear_f32_bf16w` over bf16 weights) under
 * bfloat16 activations: the rows widened to float32 (exact), the outputs rounded back, as the
 * per-op layers (`layers.int8_weight_linear`, `layers.bf16_weight_linear`) do */
static int linear_f32_widened(int wk, const void *x, const int64_t *t, int64_t w, void *y,
                              int64_t M, int64_t N, int64_t K, int64_t kblk, int num_threads) {
    float *xf = (float *)malloc(sizeof(float) * (size_t)(M * K + M * N));
    if (xf == NULL) return 3;
    float *yf = xf + M * K;
    for (int64_t i = 0; i < M * K; ++i) xf[i] = bf16_to_f32(((const uint16_t *)x)[i]);
    const int rc =
        wk == 2 ? rs_linear_f32_i8w(xf, (const int8_t *)(intptr_t)t[0],
                                    (const float *)(intptr_t)t[1], yf, M, N, K, t[2], num_threads)
                : rs_linear_f32_bf16w(xf, (const uint16_t *)(intptr_t)w, yf, M, N, K, kblk,
                                      num_threads);
    for (int64_t i = 0; rc == 0 && i < M * N; ++i) ((uint16_t *)y)[i] = f32_to_bf16(yf[i]);
    free(xf);
    return rc;
}

static int linear_int8(int dtype, const void *x, const int64_t *t, void *y, int64_t M,
                       int64_t N, int64_t K, int num_threads) {
    if (dtype == 0)
        return rs_linear_f32_i8w(x, (const int8_t *)(intptr_t)t[0],
                                 (const float *)(intptr_t)t[1], y, M, N, K, t[2], num_threads);
    return linear_f32_widened(2, x, t, 0, y, M, N, K, 0, num_threads);
}

static int linear_packed(int dtype, const void *x, int64_t w, void *y, int64_t M, int64_t N,
                         int64_t K, int64_t kblk, int num_threads) {
    if (kblk == DL_QUANTIZED) {
        const int64_t *seg = (const int64_t *)(intptr_t)w;
        const size_t es = dtype == 0 ? 4 : 2;
        for (int64_t i = 0; i < seg[0]; ++i) {
            const int64_t *sg = seg + 1 + 4 * i;
            int rc = rs_quant_linear((int)sg[0], (const uint8_t *)(intptr_t)sg[1], sg[3] - sg[2],
                                     K, dtype, x, M, dtype, (char *)y + es * (size_t)sg[2], N,
                                     0, num_threads);
            if (rc) return rc;
        }
        return 0;
    }
    if (kblk == DL_INT8)
        return linear_int8(dtype, x, (const int64_t *)(intptr_t)w, y, M, N, K, num_threads);
    if (kblk > 0 && (kblk & DL_W_BF16))
        return dtype == 0 ? rs_linear_f32_bf16w(x, (const uint16_t *)(intptr_t)w, y, M, N, K,
                                                kblk & ~DL_W_BF16, num_threads)
                          : linear_f32_widened(1, x, NULL, w, y, M, N, K, kblk & ~DL_W_BF16,
                                               num_threads);
    if (kblk == DL_AMX)
        return dtype == 1 ? rs_amx_linear_bf16(x, M, K, (const uint16_t *)(intptr_t)w, N, y, N, 0,
                                               num_threads)
                          : 1;
    return dtype == 0 ? rs_linear_f32_packed(x, (const float *)(intptr_t)w, y, M, N, K, kblk,
                                             num_threads)
                      : rs_linear_bf16_packed(x, (const uint16_t *)(intptr_t)w, y, M, N, K, kblk,
                                              num_threads);
}

/* y[M, N] += bias[N], rounded to the dtype as torch's in-place add rounds it */
static void add_bias(int dtype, void *y, int64_t bias, int64_t M, int64_t N) {
    if (bias == 0) return;
    if (dtype == 0) {
        const float *b = (const float *)(intptr_t)bias;
        for (int64_t i = 0; i < M; ++i)
            for (int64_t j = 0; j < N; ++j) ((float *)y)[i * N + j] += b[j];
    } else {
        const uint16_t *b = (const uint16_t *)(intptr_t)bias;
        uint16_t *yr = (uint16_t *)y;
        for (int64_t i = 0; i < M; ++i)
            for (int64_t j = 0; j < N; ++j)
                yr[i * N + j] = f32_to_bf16(bf16_to_f32(yr[i * N + j]) + bf16_to_f32(b[j]));
    }
}

static int add_rms_norm(int dtype, const void *x, void *residual, int64_t w, void *out,
                        int64_t M, int64_t N, float eps, int num_threads) {
    return dtype == 0 ? rs_add_rms_norm(x, residual, (const float *)(intptr_t)w, out, M, N, eps,
                                        num_threads)
                      : rs_add_rms_norm_bf16(x, residual, (const uint16_t *)(intptr_t)w, out, M,
                                             N, eps, num_threads);
}

int rs_decode_layers(int dtype, const int64_t *layers, int64_t L, void *h, void *residual,
                     const void *cos, const void *sin, const int64_t *slots,
                          const int64_t *page_table, int64_t pt_stride, int64_t pt_cols,
                          int64_t num_pages, const int64_t *seq_lens, int64_t B, int64_t hidden,
                          int64_t inter, int64_t H, int64_t Hkv, int64_t D, int64_t P,
                          float eps, float scale, int num_threads) {
    const int64_t qd = H * D, kvd = Hkv * D, qkvd = qd + 2 * kvd;
    const size_t es = dtype == 0 ? 4 : 2;
    char *buf = (char *)malloc(es * (size_t)B * (size_t)(hidden + qkvd + qd + 3 * inter));
    if (buf == NULL) return 3;
    char *x = buf, *qkv = x + es * B * hidden, *o = qkv + es * B * qkvd, *gu = o + es * B * qd;
    char *act = gu + es * B * 2 * inter;
    int rc = 0;
    memcpy(residual, h, es * (size_t)(B * hidden));
    for (int64_t l = 0; l < L && rc == 0; ++l) {
        const int64_t *ly = layers + l * DL_FIELDS;
        void *k_cache = (void *)(intptr_t)ly[DL_K_CACHE], *v_cache = (void *)(intptr_t)ly[DL_V_CACHE];
        rc = add_rms_norm(dtype, l == 0 ? NULL : h, residual, ly[DL_IN_NORM], x, B, hidden, eps,
                          num_threads);
        if (rc) break;
        rc = linear_packed(dtype, x, ly[DL_QKV], qkv, B, qkvd, hidden, ly[DL_QKV_KB], num_threads);
        if (rc) break;
        add_bias(dtype, qkv, ly[DL_QKV_BIAS], B, qkvd);
        rc = rs_rope(dtype, qkv, B, H + Hkv, D, qkvd, cos, sin, num_threads);
        if (rc) break;
        rc = rs_store_kv(dtype, qkv + es * qd, qkvd, qkv + es * (qd + kvd), qkvd, k_cache, v_cache,
                         slots, B, kvd, num_pages * P);
        if (rc) break;
        rc = rs_paged_decode_attention(dtype, qkv, qkvd, D, k_cache, v_cache, page_table, pt_stride,
                                       pt_cols, num_pages, seq_lens, o, B, H, Hkv, D, P, scale,
                                       num_threads);
        if (rc) break;
        rc = linear_packed(dtype, o, ly[DL_O], h, B, hidden, qd, ly[DL_O_KB], num_threads);
        if (rc) break;
        rc = add_rms_norm(dtype, h, residual, ly[DL_POST_NORM], x, B, hidden, eps, num_threads);
        if (rc) break;
        rc = linear_packed(dtype, x, ly[DL_GATE_UP], gu, B, 2 * inter, hidden, ly[DL_GATE_UP_KB],
                           num_threads);
        if (rc) break;
        rc = rs_silu_mul(dtype, gu, act, B, inter, num_threads);
        if (rc) break;
        rc = linear_packed(dtype, act, ly[DL_DOWN], h, B, hidden, inter, ly[DL_DOWN_KB],
                           num_threads);
    }
    free(buf);
    return rc;
}
