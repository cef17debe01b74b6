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
 * exact two-pass softmax (max, exp, sum) and one pass over V.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
#define PREFETCH_AHEAD 4
static inline void prefetch_row(int dtype, const void *base, int64_t off, int64_t n) {
    const char *p = (const char *)base + off * (dtype == 0 ? 4 : 2);
    const int64_t bytes = n * (dtype == 0 ? 4 : 2);
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
    return acc;
}

/* 8 floats in one register (AVX) or two (SSE): GCC/Clang vector extensions, so the same code
 * builds on any x86-64 or Arm compiler without intrinsics. */
typedef float v8f __attribute__((vector_size(32)));
#define MAX_GROUP 16

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* Scores of the G query heads against two key rows at once: 2 * G independent FMA chains keep
 * the FMA units busy where a single dot product would wait on its own latency.
 * Needs D % 8 == 0 and G <= MAX_GROUP. */
static inline void scores2(const float *qg, const float *k0, const float *k1, int64_t G,
                           int64_t D, float *s0, float *s1) {
    v8f a0[MAX_GROUP], a1[MAX_GROUP];
    for (int64_t g = 0; g < G; ++g) a0[g] = a1[g] = (v8f){0};
    for (int64_t i = 0; i < D; i += 8) {
        const v8f x0 = load8(k0 + i), x1 = load8(k1 + i);
        for (int64_t g = 0; g < G; ++g) {
            const v8f qv = load8(qg + g * D + i);
            a0[g] += qv * x0;
            a1[g] += qv * x1;
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        s0[g] = hsum8(a0[g]);
        s1[g] = hsum8(a1[g]);
    }
}

/* exp(x) for x <= 0 in float32, vectorizable (no libm call): Cephes' expf (S. L. Moshier), the
 * range reduction and degree-5 polynomial also used by sse_mathfun; within ~2 ulp of expf. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    /* nearest integer to x / ln 2 (ties up); truncation of a value <= 0 rounds up, and
     * vectorizes where floorf would be a libm call */
    const float n = (float)(int32_t)(x * 1.44269504088896341f - 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

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
    /* One task per sequence reads each token's K and V rows (all KV heads, contiguous) once.
     * With too few sequences to keep every thread busy, split each sequence by KV head
     * instead (the heads of one token then share cache lines across tasks). */
    const int64_t per_task = B >= 2 * (int64_t)num_threads ? Hkv : 1;
    const int64_t tasks_per_seq = Hkv / per_task;
    const int64_t HG = per_task * G; /* query heads per task */
    const int64_t row = Hkv * D;     /* elements of one token's K (or V) row */
    const int fast = D % 8 == 0 && G <= MAX_GROUP;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* scores [HG, max_len], queries [HG, D], accumulators [HG, D], two rows [2, row] */
        float *buf = (float *)malloc(sizeof(float) *
                                     (size_t)(HG * max_len + 2 * HG * D + 2 * row));
        if (buf == NULL) {
#pragma omp atomic write
            failed = 3;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < B * tasks_per_seq; ++task) {
            if (buf == NULL) continue;
            const int64_t b = task / tasks_per_seq, kh0 = (task % tasks_per_seq) * per_task;
            const int64_t L = seq_lens[b];
            float *scores = buf, *qs = buf + HG * max_len, *acc = qs + HG * D;
            float *tmp = acc + HG * D;
            const int64_t *pages = page_table + b * pt_stride;
            for (int64_t j = 0; j < HG; ++j) {
                const int64_t h = kh0 * G + j;
                const float *qr = row_f32(dtype, q, b * q_stride_b + h * q_stride_h, D, tmp);
                for (int64_t i = 0; i < D; ++i) qs[j * D + i] = qr[i] * scale;
            }
            int64_t t = 0;
            for (; fast && t + 1 < L; t += 2) {
                for (int64_t a = t + PREFETCH_AHEAD; a < t + PREFETCH_AHEAD + 2 && a < L; ++a)
                    prefetch_row(dtype, k_cache, (pages[a / P] * P + a % P) * row + kh0 * D,
                                 per_task * D);
                const int64_t s0 = pages[t / P] * P + t % P;
                const int64_t s1 = pages[(t + 1) / P] * P + (t + 1) % P;
                const float *k0 = row_f32(dtype, k_cache, s0 * row + kh0 * D, per_task * D, tmp);
                const float *k1 = row_f32(dtype, k_cache, s1 * row + kh0 * D, per_task * D,
                                          tmp + row);
                for (int64_t kh = 0; kh < per_task; ++kh) {
                    float r0[MAX_GROUP], r1[MAX_GROUP];
                    scores2(qs + kh * G * D, k0 + kh * D, k1 + kh * D, G, D, r0, r1);
                    for (int64_t g = 0; g < G; ++g) {
                        scores[(kh * G + g) * max_len + t] = r0[g];
                        scores[(kh * G + g) * max_len + t + 1] = r1[g];
                    }
                }
            }
            for (; t < L; ++t) {
                const int64_t slot = pages[t / P] * P + t % P;
                const float *kr = row_f32(dtype, k_cache, slot * row + kh0 * D, per_task * D, tmp);
                for (int64_t j = 0; j < HG; ++j)
                    scores[j * max_len + t] = dot(qs + j * D, kr + (j / G) * D, D);
            }
            for (int64_t j = 0; j < HG; ++j) {
                float *s = scores + j * max_len;
                float m = s[0];
                for (int64_t u = 1; u < L; ++u) m = s[u] > m ? s[u] : m;
                float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                for (int64_t u = 0; u < L; ++u) {
                    s[u] = exp_nonpos(s[u] - m);
                    sum += s[u];
                }
                const float inv = 1.f / sum;
                for (int64_t u = 0; u < L; ++u) s[u] *= inv;
            }
            memset(acc, 0, sizeof(float) * (size_t)(HG * D));
            for (t = 0; t < L; ++t) {
                const int64_t a = t + PREFETCH_AHEAD;
                if (a < L)
                    prefetch_row(dtype, v_cache, (pages[a / P] * P + a % P) * row + kh0 * D,
                                 per_task * D);
                const int64_t slot = pages[t / P] * P + t % P;
                const float *vr = row_f32(dtype, v_cache, slot * row + kh0 * D, per_task * D, tmp);
                for (int64_t j = 0; j < HG; ++j) {
                    const float p = scores[j * max_len + t];
                    const float *v = vr + (j / G) * D;
                    float *a = acc + j * D;
#pragma omp simd
                    for (int64_t i = 0; i < D; ++i) a[i] += p * v[i];
                }
            }
            for (int64_t j = 0; j < HG; ++j) {
                const int64_t o = (b * H + kh0 * G + j) * D;
                if (dtype == 0) {
                    memcpy((float *)out + o, acc + j * D, sizeof(float) * (size_t)D);
                } else {
                    uint16_t *dst = (uint16_t *)out + o;
                    for (int64_t i = 0; i < D; ++i) dst[i] = f32_to_bf16(acc[j * D + i]);
                }
            }
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
