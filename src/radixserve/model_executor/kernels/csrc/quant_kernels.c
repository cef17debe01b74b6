/* radixserve's kernels for GGUF-quantized linears: y[M, N] = x[M, K] @ W^T where W is N rows
 * of ggml blocks exactly as a GGUF file stores them (no float copy of the weights).
 * Built together with cpu_kernels.c by kernels/cpu.py (`cc -O3 -march=native -fopenmp`).
 *
 * Weight block layouts (ggml's `ggml-common.h`; gguf-py's `gguf/quants.py` dequantizes them):
 *   Q4_0 (id 2),  32 values, 18 B: fp16 d; u8 qs[16]. v[i] = d * ((qs[i] & 15) - 8),
 *                 v[i + 16] = d * ((qs[i] >> 4) - 8), i < 16.
 *   Q4_1 (id 3),  32 values, 20 B: fp16 d, fp16 m; u8 qs[16]. v = d * q + m (q as Q4_0's, no -8).
 *   Q5_0 (id 6),  32 values, 22 B: fp16 d; u8 qh[4]; u8 qs[16]. Value j's low 4 bits are Q4_0's
 *                 nibble, its fifth bit is bit j of qh read as a little-endian uint32;
 *                 v = d * (q - 16).
 *   Q5_1 (id 7),  32 values, 24 B: fp16 d, fp16 m; u8 qh[4]; u8 qs[16]. q as Q5_0's;
 *                 v = d * q + m.
 *   Q8_0 (id 8),  32 values, 34 B: fp16 d; i8 qs[32]. v[i] = d * qs[i].
 *   Q4_K (id 12), 256 values, 144 B: fp16 d, fp16 dmin; u8 scales[12] (8 six-bit scales and 8
 *                 six-bit mins, one per 32-value sub-block); u8 qs[128]. Sub-block 2j is the low
 *                 nibbles of qs[32j .. 32j + 31], sub-block 2j + 1 their high nibbles;
 *                 v = d * sc[s] * q - dmin * m[s].
 *   Q5_K (id 13), 256 values, 176 B: fp16 d, fp16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]. As
 *                 Q4_K with a fifth bit: bit s of qh[i] is bit 4 of value i of sub-block s.
 *   Q6_K (id 14), 256 values, 210 B: u8 ql[128]; u8 qh[64]; i8 scales[16] (one per 16 values);
 *                 fp16 d. Half h (128 values) uses ql[64h ..], qh[32h ..]; its 4 groups of 32
 *                 are ql[64h + i] & 15, ql[64h + 32 + i] & 15, ql[64h + i] >> 4,
 *                 ql[64h + 32 + i] >> 4, each with 2 bits of qh[32h + i] (bits 0-1, 2-3, 4-5,
 *                 6-7) on top; v = d * scales[e / 16] * (q - 32).
 *
 * Activations are quantized once per call, per block, into a scratch buffer (llama.cpp's
 * scheme): for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weights 32 values as int8 with a float scale, four
 * blocks to a group (`xq32_t`: the four scales, s = d * sum(q) for Q4_1/Q5_1's min, o = -8 *
 * sum(q) for Q4_0's offset (twice that for Q5_0's -16), side by side); for the K-quants 256 values with a float scale and the sums
 * of each 16 (and 32) values (`xqk_t`, Q8_K-style). Every scale is symmetric: d = amax / 127,
 * q = nearest-even(x * (127 / amax)) (0 for an all-zero block). The scale stays float32
 * (llama.cpp rounds Q8_0/Q8_1's to fp16).
 *
 * Dot products are exact integers per block; the float arithmetic is one fixed sequence per
 * output, whatever the tiling, the row count M or the instruction set:
 *   * Q4_0/Q8_0/Q4_1/Q5_0/Q5_1: per block b and output one exact integer dot (Q4_0's -8 and
 *     Q5_0's -16 included) and acc = fma(d_w * d_x, (float)dot, acc); Q4_1 and Q5_1 also
 *     accm = fma(m_w, s_x, accm); y = acc (+ accm). The SIMD tiles transpose the weights of 8
 *     (AVX2) or 16 (AVX-512) outputs so that one int32 lane holds 4 values of one output
 *     (Q5's fifth bits or-ed in), and a dot product instruction against 4 broadcast
 *     activation values adds into all of them (`q32b_cols_*`);
 *   * K-quants: per super-block b and output, one exact integer isum (every product with its
 *     sub-block scale, Q6_K's -32 offset subtracted as 32 * sum(sc * bs16)) and, for
 *     Q4_K/Q5_K, msum = sum over sub-blocks of m[s] * bs32[s]; acc = fma(d_w * d_x,
 *     (float)isum, acc), accm = fma(dmin_w * d_x, (float)msum, accm); y = acc - accm
 *     (Q6_K: y = acc). The integers may be summed in any order, so the SIMD tiles keep them
 *     in vector lanes and add the lanes of 8 outputs at once (`kcols_fma`), one FMA per 8
 *     outputs instead of one per lane.
 * The portable C path (`*_ref`) performs exactly these operations, so it gives the AVX2 path's
 * bits (tests compare them); the AVX-512 VNNI K-quant tiles (`*_cols_avx512`: 64 values per
 * maddubs, vpdpwssd applying the sub-block scales) give the same bits again. Each weight
 * block is decoded once per tile of up to TILE_MK activation rows, its products added into
 * each row's integer lanes. Threads split the N output rows, never K.
 *
 * Measured (2-core Zen 3 VM, AVX2 path, 2 threads, W [8960, 1536] rotated over copies past the
 * L3 as bench/quant_kernels.py does, best of 7 batches, quiet machine), microseconds per call:
 *            M=1    M=4    M=16   M=64
 *   Q4_0     386    774    2880  11273   (M=1: 20.1 GB/s of weight bytes; 341-382 on reruns)
 *   Q4_K     435    769    2921  11344   (M=1: 17.8 GB/s; 380-392 on reruns, ~20 GB/s)
 *   Q6_K     497    914    3098  12641   (M=1: 22.7 GB/s)
 *   Q8_0     597    971    3445  14778   (M=1: 24.5 GB/s)
 *   before the 4-block Q4_0/Q8_0 tiles and the K-quant rework, the same run: Q4_0 579 / 1298 /
 *   5217 / 20346, Q4_K 457 / 1114 / 4592 / 16675, Q6_K 693 / 1252 / 4956 / 18814, Q8_0 828 /
 *   1386 / 5359 / 21042. Earlier yardsticks (other runs): torch int4pack g32 (bf16 x) 1067 /
 *   2108 / 5920 / 33134; F.linear float32 3306 / 11114 / 12320 / 25797.
 * Q4_0 / Q4_1 / Q8_0 on the same VM, M = 1 / 16 / 64, row tiles (two lanes per block, one
 * 8-lane FMA per 4 blocks) -> transposed column tiles: AVX-512 356 / 2356 / 9937 -> 361 /
 * 1220 / 4823, 362 / 2394 / 9610 -> 420 / 1460 / 5788, 626 / 2331 / 9249 -> 673 / 1635 /
 * 5858; the AVX2 build on the same CPU 352 / 2349 / 9355 -> 375 / 2029 / 8107, 365 / 2480 /
 * 9822 -> 392 / 2052 / 8060, 627 / 2935 / 11657 -> 698 / 2788 / 10555.
 * The K-quants on the avx512_bf16 kind (a 2-vCPU "Intel Xeon Processor" VM without AMX, 2
 * threads, weights rotated over 640 MB, `benchmarks/quant_kernel_variants_ab.py`), best us at
 * M = 1 / 16 / 64 / 256, one lane FMA per output before -> AVX-512 tiles, same contract ->
 * 8-output columns, AVX-512, TILE_MK 16: Q4_K 364 / 2259 / 8922 / 36608 -> 362 / 1834 / 7233
 * / 29278 -> 337 / 1347 / 5339 / 21350; Q5_K 522 / 3102 / 9597 / 39253 -> 384 / 1419 / 5434 /
 * 22687; Q6_K 583 / 3298 / 8825 / 36726 -> 519 / 2016 / 6712 / 25900 (this VM's timings
 * spread by up to 20% between runs).
 * Q4_K from 8 rows on takes the transposed tiles (`qk45_t16_avx512`, 64 rows a tile), same
 * VM and script, best us, column tiles -> transposed: M = 8 811 -> 790, 16 1344 -> 1190, 32
 * 2552 -> 1965, 64 4901 -> 3608, 256 20473 -> 14984 (1.30x at 32 rows, 1.36-1.37x from 64);
 * Q5_K (its fifth bits or-ed in) 8 808 -> 821, 16 1393 -> 1280, 64 5185 -> 3681, 256 20822 ->
 * 14413. Q4_K, Q5_K and Q6_K weights are packed at load on these builds (rs_quant_pack16),
 * and their transposed tiles then run from one row on with no transposes. Transposing Q6_K per
 * call had been slower than its column tile (M = 8 1024 -> 1633, 64 7256 -> 7842: three
 * 16 x 16 transposes and 16 scale products per block); packed, Zen 5 kind, [1536, 8960] at
 * M = 1 / 4 / 16 / 64, us: 512 / 562 / 1604 / 6464 -> 323-370 / 403-486 / 1110-1165 /
 * 3616-4232.
 * At Qwen2.5-7B's down projection, W [3584, 18944], the driver had made weight groups of 64 KiB
 * (8 Q4_K rows, 4 Q8_0 rows: the 16-output tiles half or three-quarters idle) and run every
 * activation row over each group (22 MiB of quantized rows per group at 1024 rows, from L3).
 * Groups of 16 rows and more, and rows in passes of ~1 MiB, same VM and script, best us, M =
 * 1 / 16 / 64 / 1024, before -> after: Q4_K 64 rows 32955 -> 17867, 1024 rows 867296 ->
 * 290293; Q8_0 7237 / 27378 / 85457 / 1395729 -> 3527 / 6177 / 23629 / 372927; Q6_K 1730 /
 * 8309 / 33019 / 656538 -> 1481 / 6765 / 26668 / 418423; Q4_0 1813 / 9211 / 38251 / 621711 ->
 * 1236 / 5037 / 20494 / 316080; Q5_K 1620 / 9485 / 31721 / 882125 -> 1550 / 5133 / 17737 /
 * 292979. At W [8960, 1536] within +-5% but at 1024 rows (5-15% faster).
 *
 * Error codes: 1 bad type or sizes; 2 an id out of range (dequantize_rows, nothing written);
 * 3 out of memory.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RS_Q_AVX2 1
#else
#define RS_Q_AVX2 0
#endif
/* 512-bit tiles (AVX512-BW + VNNI): twice the integer products per instruction, and VNNI's
 * vpdpwssd folds the scale's multiply-add into one instruction; the same integer lanes and
 * float sequence as the AVX2 tiles (bit for bit). -DRS_Q_NO_AVX512 builds the AVX2 tiles only
 * (tests compare the two, benchmarks A/B them). */
#if RS_Q_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) \
    && defined(__AVX512VNNI__) && !defined(RS_Q_NO_AVX512)
#define RS_Q_AVX512 1
#else
#define RS_Q_AVX512 0
#endif

/* AMX-INT8 (Intel Xeons from Sapphire Rapids on): the AVX-512 tiles below can take their
 * integer dot products from tile instructions instead of vpdpbusd (amx_int8 section). GCC 11
 * has the intrinsics; the functions carry a target attribute, so any AVX-512 build has them
 * and runs them only where the CPU and Linux allow. */
#if RS_Q_AVX512 && defined(__x86_64__) && defined(__GNUC__) && __GNUC__ >= 11
#define RS_Q_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define RS_Q_AMX 0
#endif

#define AI static inline __attribute__((always_inline))

enum {
    T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13,
    T_Q6_K = 14
};
#ifndef TILE_M
#define TILE_M 8
#endif
/* activation rows per K-quant tile: their weight decode is shared by more rows where the
 * 512-bit tiles keep only one row's sums in registers at a time */
#ifndef TILE_MK
#if RS_Q_AVX512
#define TILE_MK 16
#else
#define TILE_MK TILE_M
#endif
#endif
#define TILE_MAX (TILE_MK > TILE_M ? TILE_MK : TILE_M)
/* the AVX-512 transposed K-quant tiles (`*_t16_avx512`): taken for tiles of KT16_MIN_ROWS
 * rows and more, up to KT16_ROWS rows per tile (their weight transposition is shared by all) */
#ifndef KT16_MIN_ROWS
#define KT16_MIN_ROWS 8
#endif
/* the 512-bit Q4_0/Q4_1/Q8_0 tiles' integer dot of a block in two vpdpbusd chains, added at
 * the end (exact): one chain of 8 waited on its latency (avx512_bf16 VM, packed Q4_1 [3072,
 * 576], 5 / 16 / 256 rows: 44.8 / 129.8 / 1880 -> 39.9 / 120.4 / 1827 us); 1 builds one */
#ifndef Q32_CHAINS
#define Q32_CHAINS 2
#endif
#ifndef JB_ROUND
#define JB_ROUND 16 /* rs_quant_linear's weight groups are a multiple of this many rows */
#endif
#ifndef QMC_BYTES
#define QMC_BYTES (1 << 20) /* quantized activation bytes per pass (rs_quant_linear) */
#endif
#ifndef KT16_ROWS
#define KT16_ROWS 64
#endif
#define Y_ROWS (KT16_ROWS > TILE_MAX ? KT16_ROWS : TILE_MAX)

/* ---- scalar helpers ----------------------------------------------------------------- */

static inline float fp16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu,
                   man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0) {
        float f = (float)man * 0x1p-24f; /* zero or subnormal: exact */
        return sign ? -f : f;
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float bf16_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* a float the compiler must materialize: keeps `a * b` from being fused into a following add
 * (the build uses -ffp-contract=fast; dequantization must round the product as numpy does) */
static inline float opaque(float p) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    __asm__("" : "+x"(p));
#elif defined(__GNUC__) && defined(__aarch64__)
    __asm__("" : "+w"(p));
#else
    volatile float v = p;
    p = v;
#endif
    return p;
}

/* Q4_K/Q5_K: the 6-bit scale and min of sub-block j (ggml's get_scale_min_k4) */
static inline void k4_scale_min(const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    /* bytewise, in 32-bit words: sc[j] = q[j] & 63, mn[j] = q[j + 4] & 63 (j < 4);
     * sc[j + 4] = (q[j + 8] & 15) | (q[j] >> 6) << 4, mn[j + 4] = q[j + 8] >> 4 | (q[j + 4] >> 6) << 4 */
    uint32_t a0, a1, a2, u;
    memcpy(&a0, q, 4);
    memcpy(&a1, q + 4, 4);
    memcpy(&a2, q + 8, 4);
    u = a0 & 0x3F3F3F3Fu;
    memcpy(sc, &u, 4);
    u = a1 & 0x3F3F3F3Fu;
    memcpy(mn, &u, 4);
    u = (a2 & 0x0F0F0F0Fu) | (((a0 >> 6) & 0x03030303u) << 4);
    memcpy(sc + 4, &u, 4);
    u = ((a2 >> 4) & 0x0F0F0F0Fu) | (((a1 >> 6) & 0x03030303u) << 4);
    memcpy(mn + 4, &u, 4);
}

static inline float hsum4_ref(const float *a) { return (a[0] + a[2]) + (a[1] + a[3]); }
static inline float hsum8_ref(const float *a) {
    float t[4];
    for (int i = 0; i < 4; ++i) t[i] = a[i] + a[i + 4];
    return hsum4_ref(t);
}

/* ---- activation quantization (shared by every path) ---------------------------------- */

/* four consecutive 32-value blocks of an activation row (a row is ceil(nb / 4) groups, the
 * blocks past nb all zero) */
typedef struct {
    int8_t q[4][32];
    float d[4];
    float s[4];    /* d * sum(q) (Q4_1/Q5_1's min term) */
    int32_t o[4];  /* -8 * sum(q[k]) (Q4_0's offset; Q5_0 adds it twice) */
} xq32_t;

typedef struct {
    int8_t q[256];
    int16_t bs16[16]; /* sums of each 16 q */
    int16_t bs32[8];  /* sums of each 32 q */
    float d;
    int32_t pad[3];
} xqk_t;

/* amax of n floats (exact in any order). The scalar loop's `a > m ? a : m` skips NaNs; so
 * does `_mm256_max_ps(a, m)`, which returns its second operand unless the first is greater,
 * and its four chains keep the scalar loop's one max dependency (4 cycles an element, most of
 * a prefill's activation quantization) off the critical path. */
static inline float absmax(const float *x, int n) {
    float m = 0.0f;
    int i = 0;
#if RS_Q_AVX2
    if (n >= 32) {
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 m0 = _mm256_setzero_ps(), m1 = m0, m2 = m0, m3 = m0;
        for (; i + 32 <= n; i += 32) {
            m0 = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), m0);
            m1 = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i + 8)), m1);
            m2 = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i + 16)), m2);
            m3 = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i + 24)), m3);
        }
        /* the chains hold no NaN: their max in any order is exact */
        m0 = _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m0), _mm256_extractf128_ps(m0, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        m = _mm_cvtss_f32(h);
    }
#endif
    for (; i < n; ++i) {
        float a = fabsf(x[i]);
        m = a > m ? a : m;
    }
    return m;
}

/* sum of 16 int8 at q (exact) */
static inline int sum16_i8(const int8_t *q) {
#if RS_Q_AVX2
    /* q + 128 as unsigned bytes: psadbw adds each 8 of them against zero */
    const __m128i u = _mm_xor_si128(_mm_loadu_si128((const __m128i *)q), _mm_set1_epi8(-128));
    const __m128i s = _mm_sad_epu8(u, _mm_setzero_si128());
    return _mm_cvtsi128_si32(s) + _mm_extract_epi16(s, 4) - 16 * 128;
#else
    int s = 0;
    for (int i = 0; i < 16; ++i) s += q[i];
    return s;
#endif
}

/* q[i] = nearest-even(x[i] * id) for n values (|x * id| <= 127 by construction) */
static inline void round_block(const float *x, int n, float id, int8_t *q) {
#if RS_Q_AVX2
    const __m256 vid = _mm256_set1_ps(id);
    for (int i = 0; i < n; i += 32) {
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), vid));
        __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), vid));
        __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 16), vid));
        __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 24), vid));
        __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
        __m256i v = _mm256_packs_epi16(ab, cd);
        /* packs interleave 128-bit halves: restore the order */
        v = _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + i), v);
    }
#else
    for (int i = 0; i < n; ++i) q[i] = (int8_t)(int)nearbyintf(x[i] * id);
#endif
}

/* row of K values (float32 or bf16) as float32 blocks of `bs` at block b */
static inline const float *x_block(int xdt, const void *x, int64_t off, int bs, float *tmp) {
    if (xdt == 0) return (const float *)x + off;
    const uint16_t *s = (const uint16_t *)x + off;
    for (int i = 0; i < bs; ++i) tmp[i] = bf16_f32(s[i]);
    return tmp;
}

static void quantize_row_32(int xdt, const void *x, int64_t off, int64_t nb, xq32_t *out) {
    float tmp[32];
    if (nb % 4) memset(out + nb / 4, 0, sizeof *out);
    for (int64_t b = 0; b < nb; ++b) {
        xq32_t *g = out + b / 4;
        const int k = (int)(b % 4);
        const float *v = x_block(xdt, x, off + b * 32, 32, tmp);
        const float amax = absmax(v, 32);
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        round_block(v, 32, id, g->q[k]);
        const int lo = sum16_i8(g->q[k]), hi = sum16_i8(g->q[k] + 16);
        g->d[k] = amax / 127.0f;
        g->s[k] = g->d[k] * (float)(lo + hi);
        g->o[k] = -8 * (lo + hi);
    }
}

static void quantize_row_k(int xdt, const void *x, int64_t off, int64_t nb, xqk_t *out) {
    float tmp[256];
    for (int64_t b = 0; b < nb; ++b) {
        const float *v = x_block(xdt, x, off + b * 256, 256, tmp);
        const float amax = absmax(v, 256);
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        round_block(v, 256, id, out[b].q);
        for (int g = 0; g < 16; ++g) out[b].bs16[g] = (int16_t)sum16_i8(out[b].q + 16 * g);
        for (int g = 0; g < 8; ++g)
            out[b].bs32[g] = (int16_t)(out[b].bs16[2 * g] + out[b].bs16[2 * g + 1]);
        out[b].d = amax / 127.0f;
        memset(out[b].pad, 0, sizeof out[b].pad);
    }
}

/* ---- portable tiles: one output per activation row, the lane contract spelled out ------ */

/* y[c * R + r] = output of weight row c (at w + c * ws) for activation row r (at xq + r * xs),
 * c < C, r < R; nb blocks per row. The driver passes a whole group of weight rows (C <= 256)
 * and a tile of R <= TILE_M activation rows. */
typedef void (*tile_fn)(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                        int64_t nb, int R, float *y);

/* acc[l] = fma(s, lane[l], acc[l]) */
static inline void lanes_fma(float *acc, float s, const int32_t *lane, int n) {
    for (int l = 0; l < n; ++l) acc[l] = fmaf(s, (float)lane[l], acc[l]);
}

/* the 32-value block types by their `type` argument below: 0 Q4_0, 1 Q8_0, 2 Q4_1, 3 Q5_0,
 * 4 Q5_1. Block bytes; offset of qs (the nibbles or Q8_0's int8; Q5's qh are the 4 bytes
 * before it); whether the block has a min (d * q + m); the multiple of xq32_t.c that is the
 * offset (q - 8: 1, q - 16: 2, none: 0) */
#define Q32_BYTES(type) ((type) == 0 ? 18 : (type) == 1 ? 34 : (type) == 2 ? 20 : (type) == 3 ? 22 : 24)
#define Q32_QS(type) ((type) <= 1 ? 2 : (type) == 2 ? 4 : (type) == 3 ? 6 : 8)
#define Q32_MIN(type) ((type) == 2 || (type) == 4)
#define Q32_OFF(type) ((type) == 0 ? 1 : (type) == 3 ? 2 : 0)
/* where rs_quant_pack16's block of a 16-row group keeps the 16 fp16 scales: after the values
 * (16 rows' 16 or 32 bytes) and Q5's 16 qh words */
#define P16_QSB(type) ((type) == 1 ? 512 : (type) >= 3 ? 320 : 256)

/* Q4_0 (type 0), Q8_0 (1), Q4_1 (2), Q5_0 (3), Q5_1 (4) under the per-block contract: per
 * block one exact integer dot (Q4_0's -8 and Q5_0's -16 included) and one FMA; the min term
 * of Q4_1 and Q5_1 its own FMA chain */
static inline void q32b_ref(const uint8_t *w0, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                            int64_t nb, int R, float *y, int type) {
    const int bb = Q32_BYTES(type), qo = Q32_QS(type);
    for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) {
        const uint8_t *w = w0 + c * ws;
        const xq32_t *x = (const xq32_t *)(xq + r * xs);
        float acc = 0.0f, accm = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = w + b * bb;
            const xq32_t *g = x + b / 4;
            const int k = (int)(b % 4);
            int32_t dot = Q32_OFF(type) * g->o[k];
            uint32_t qh = 0;
            if (type >= 3) memcpy(&qh, blk + qo - 4, 4);
            if (type == 1) {
                /* read as int8 through an int8 pointer: GCC 12's vectorizer took
                 * `(int8_t)u8 * s8` for an unsigned x signed dot product (vpdpbusd) and
                 * dropped the cast (wrong sums at -O2 -march with AVX512-VNNI) */
                const int8_t *qs = (const int8_t *)(blk + 2);
                for (int e = 0; e < 32; ++e) dot += qs[e] * g->q[k][e];
            } else {
                for (int e = 0; e < 16; ++e) {
                    const int lo = (blk[qo + e] & 15) | (int)((qh >> e) & 1u) << 4;
                    const int hi = (blk[qo + e] >> 4) | (int)((qh >> (16 + e)) & 1u) << 4;
                    dot += lo * g->q[k][e] + hi * g->q[k][16 + e];
                }
            }
            acc = fmaf(fp16_to_f32(blk) * g->d[k], (float)dot, acc);
            if (Q32_MIN(type)) accm = fmaf(fp16_to_f32(blk + 2), g->s[k], accm);
        }
        y[c * R + r] = Q32_MIN(type) ? acc + accm : acc;
    }
}

static void q4_0_ref(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                     int64_t nb, int R, float *y) {
    q32b_ref(w, ws, C, xq, xs, nb, R, y, 0);
}

static void q8_0_ref(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                     int64_t nb, int R, float *y) {
    q32b_ref(w, ws, C, xq, xs, nb, R, y, 1);
}

static void q4_1_ref(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                     int64_t nb, int R, float *y) {
    q32b_ref(w, ws, C, xq, xs, nb, R, y, 2);
}

static void q5_0_ref(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                     int64_t nb, int R, float *y) {
    q32b_ref(w, ws, C, xq, xs, nb, R, y, 3);
}

static void q5_1_ref(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                     int64_t nb, int R, float *y) {
    q32b_ref(w, ws, C, xq, xs, nb, R, y, 4);
}

/* Q4_K (hbit = 0) and Q5_K (hbit = 1): per super-block the exact integer sums (scales
 * applied), one float FMA each (the K-quant contract) */
static inline void qk45_ref(const uint8_t *w0, int64_t ws, int C, const uint8_t *xq,
                            int64_t xs, int64_t nb, int R, float *y, int hbit) {
    const int bb = hbit ? 176 : 144;
    for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) {
        const uint8_t *w = w0 + c * ws;
        const xqk_t *x = (const xqk_t *)(xq + r * xs);
        float acc = 0.0f, accm = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = w + b * bb;
            const uint8_t *qh = blk + 16, *qs = blk + (hbit ? 48 : 16);
            uint8_t sc[8], mn[8];
            k4_scale_min(blk + 4, sc, mn);
            int32_t isum = 0, msum = 0;
            for (int s = 0; s < 8; ++s) {
                for (int e = 0; e < 32; ++e) {
                    const uint8_t byte = qs[32 * (s / 2) + e];
                    int q = (s & 1) ? byte >> 4 : byte & 15;
                    if (hbit) q |= ((qh[e] >> s) & 1) << 4;
                    isum += sc[s] * (q * x[b].q[32 * s + e]);
                }
                msum += mn[s] * x[b].bs32[s];
            }
            acc = fmaf(fp16_to_f32(blk) * x[b].d, (float)isum, acc);
            accm = fmaf(fp16_to_f32(blk + 2) * x[b].d, (float)msum, accm);
        }
        y[c * R + r] = acc - accm;
    }
}

static void q4_k_ref(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                     int64_t nb, int R, float *y) {
    qk45_ref(w, ws, C, xq, xs, nb, R, y, 0);
}

static void q5_k_ref(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                     int64_t nb, int R, float *y) {
    qk45_ref(w, ws, C, xq, xs, nb, R, y, 1);
}

/* Q6_K's 6-bit value of element 32g + e (g < 8, e < 32) */
static inline int q6_value(const uint8_t *blk, int g, int e) {
    const int h = g / 4, c = g % 4;
    const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
    const uint8_t lo = ql[(c & 1) * 32 + e];
    return ((c & 2) ? lo >> 4 : lo & 15) | (((qh[e] >> (2 * c)) & 3) << 4);
}

static void q6_k_ref(const uint8_t *w0, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                     int64_t nb, int R, float *y) {
    for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) {
        const uint8_t *w = w0 + c * ws;
        const xqk_t *x = (const xqk_t *)(xq + r * xs);
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = w + b * 210;
            const int8_t *sc = (const int8_t *)(blk + 192);
            int32_t isum = 0;
            for (int g = 0; g < 8; ++g)
                for (int e = 0; e < 32; ++e)
                    isum += sc[(32 * g + e) / 16] * (q6_value(blk, g, e) * x[b].q[32 * g + e]);
            for (int k = 0; k < 16; ++k) isum -= 32 * (sc[k] * x[b].bs16[k]);
            acc = fmaf(fp16_to_f32(blk + 208) * x[b].d, (float)isum, acc);
        }
        y[c * R + r] = acc;
    }
}

/* bytes of a packed Q4_K group's super-block (16 rows' 144), and of its parts: the qs as 32
 * vectors of transposed dwords, the 12 scale bytes as 3, then the fp16 d and dmin of the 16
 * rows (rs_quant_pack16). Q5_K's (16 rows' 176) has its qh as 8 more vectors after the
 * scales, then the d and dmin. */
#define PK4_BLOCK (16 * 144)
#define PK4_SCALES (32 * 64)
#define PK4_D (PK4_SCALES + 3 * 64)
#define PK5_QH PK4_D
#define PK5_D (PK5_QH + 8 * 64)
/* bytes of a packed Q6_K group's super-block (16 rows' 210) and of its parts: ql as 32
 * vectors of transposed dwords, qh as 16, the 16 int8 scales as 4, then the 16 rows' fp16 d
 * (rs_quant_pack16) */
#define PK6_BLOCK (16 * 210)
#define PK6_QH (32 * 64)
#define PK6_SCALES (48 * 64)
#define PK6_D (52 * 64)
/* an int32 read from any byte address (activation bytes as one broadcast operand) */
typedef int32_t i32u __attribute__((may_alias, aligned(1)));

/* ggml's get_scale_min_k4 on a vector of outputs at once (P, S: the intrinsics' width, _mm256
 * and si256 or _mm512 and si512; T the vector type): from a packed or transposed Q4_K / Q5_K
 * header h (h[1..3] lane c = output c's 12 scale bytes), bytes s of sc[s / 4] and mn[s / 4]
 * are the six-bit scale and min of sub-block s, and mnp[k] holds mins 2k and 2k + 1 as an
 * int16 pair; m6, m4, m2, mb are the masks 0x3F, 0x0F, 0x03 per byte and 0xFF per dword */
#define K4_SCALES_MINS(P, S, T, h, sc, mn, mnp)                                               \
    do {                                                                                     \
        sc[0] = P##_and_##S(h[1], m6);                                                       \
        sc[1] = P##_or_##S(P##_and_##S(h[3], m4),                                            \
                           P##_slli_epi32(P##_and_##S(P##_srli_epi32(h[1], 6), m2), 4));     \
        mn[0] = P##_and_##S(h[2], m6);                                                       \
        mn[1] = P##_or_##S(P##_and_##S(P##_srli_epi32(h[3], 4), m4),                         \
                           P##_slli_epi32(P##_and_##S(P##_srli_epi32(h[2], 6), m2), 4));     \
        for (int k_ = 0; k_ < 4; ++k_) {                                                     \
            const T v_ = P##_srli_epi32(mn[k_ / 2], 16 * (k_ % 2));                          \
            mnp[k_] = P##_or_##S(P##_and_##S(v_, mb),                                        \
                                 P##_slli_epi32(P##_and_##S(P##_srli_epi32(v_, 8), mb), 16)); \
        }                                                                                    \
    } while (0)

/* ---- AVX2 tiles: R activation rows share each weight block's decode ------------------- */
#if RS_Q_AVX2
/* bytes ahead of the weight block in use that each row's stream asks the cache for: a decode
 * streams the weights from DRAM, and the hardware prefetcher alone leaves ~1/3 of the time in
 * stalls at M = 1 (measured: Q4_0 [8960, 1536], one thread, 1.35 -> 0.9 ms) */
#ifndef QPF
#define QPF 4096
#endif
/* the AVX2 Q6_K column tile's requests go into L2 (held to AVX2 on the Zen 5 kind, [8960, 1536]
 * rows, best us at 1 / 4 / 16 rows: into L1 542 / 620 / 1795, into L2 399 / 653 / 1931; the
 * one-row calls are the decode steps, where Q6_K holds a Q4_K_M file's LM head) */
#ifndef Q6COL_HINT
#define Q6COL_HINT _MM_HINT_T1
#endif

/* pshufb selectors: 16-bit scale s of a [sc0 .. sc7] vector into every 16-bit lane */
static const uint8_t k4_sel[8][32] __attribute__((aligned(32))) = {
#define SEL(s) {2*s, 2*s+1, 2*s, 2*s+1, 2*s, 2*s+1, 2*s, 2*s+1, 2*s, 2*s+1, 2*s, 2*s+1, 2*s, 2*s+1, \
                2*s, 2*s+1, 2*s, 2*s+1, 2*s, 2*s+1, 2*s, 2*s+1, 2*s, 2*s+1, 2*s, 2*s+1, 2*s, 2*s+1, \
                2*s, 2*s+1, 2*s, 2*s+1}
    SEL(0), SEL(1), SEL(2), SEL(3), SEL(4), SEL(5), SEL(6), SEL(7)
#undef SEL
};

/* bytes ahead of a K-quant weight block that its tile asks the cache for: the tiles walk 8
 * weight rows in lock step, so the same block KPF_GROUPS groups of 8 rows on, plus QPF */
#ifndef KPF_GROUPS
#define KPF_GROUPS 1
#endif
#define KPF(ws) ((ws) * 8 * KPF_GROUPS + QPF)

/* ---- K-quant column tiles: 8 weight rows (outputs) at a time, super-block by super-block.
 * Each weight block is decoded once for the R activation rows and each (row, output)'s
 * integer lanes go to a scratch tile; then per row the 8 outputs' lanes are summed into one
 * vector (lane c: output c), so the scales' product, the conversion and the FMA run once per
 * 8 outputs (the K-quant contract: one exact integer per super-block and output). */
typedef struct {
    int32_t lanes[TILE_MK][8][16] __attribute__((aligned(64))); /* AVX2 uses 8 of the 16 */
    int32_t mins[4][8];    /* mins[k][c]: output c's mins 2k and 2k + 1 as an int16 pair */
    uint16_t dh[8], mh[8]; /* the outputs' fp16 d and dmin (0 for absent outputs) */
    float acc[TILE_MK][8], accm[TILE_MK][8];
} kcols_t;

/* a column group of nc <= 8 outputs starts: sums zero, absent outputs' lanes and scales 0 */
AI void kcols_begin(kcols_t *t, const int R, int nc) {
    memset(t->acc, 0, sizeof t->acc);
    memset(t->accm, 0, sizeof t->accm);
    for (int c = nc; c < 8; ++c) {
        for (int r = 0; r < R; ++r) memset(t->lanes[r][c], 0, sizeof t->lanes[r][c]);
        for (int k = 0; k < 4; ++k) t->mins[k][c] = 0;
        t->dh[c] = t->mh[c] = 0;
    }
}

/* Q4_K/Q5_K's 8 six-bit scales (sc) and mins (mn) as bytes of a uint64 (ggml's
 * get_scale_min_k4 for all 8 at once); records output c's d, dmin and mins */
AI uint64_t k4_scales(kcols_t *t, int c, const uint8_t *blk) {
    uint32_t a0, a1, a2;
    memcpy(&a0, blk + 4, 4);
    memcpy(&a1, blk + 8, 4);
    memcpy(&a2, blk + 12, 4);
    const uint64_t sc = (a0 & 0x3F3F3F3Fu)
                        | (uint64_t)((a2 & 0x0F0F0F0Fu) | (((a0 >> 6) & 0x03030303u) << 4)) << 32;
    const uint64_t mn = (a1 & 0x3F3F3F3Fu)
                        | (uint64_t)(((a2 >> 4) & 0x0F0F0F0Fu) | (((a1 >> 6) & 0x03030303u) << 4)) << 32;
    for (int k = 0; k < 4; ++k)
        t->mins[k][c] = (int32_t)((mn >> (16 * k)) & 0xFF) | (int32_t)((mn >> (16 * k + 8)) & 0xFF) << 16;
    memcpy(&t->dh[c], blk, 2);
    memcpy(&t->mh[c], blk + 2, 2);
    return sc;
}

/* [sum of a[c]'s 8 int32, c < 8]: a tree of horizontal adds (exact) */
AI __m256i sum8x8(const __m256i *a) {
    const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
    const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                            _mm256_permute2x128_si256(u0, u1, 0x31));
}

/* after a super-block b of the group: per row, the 8 outputs' integers, one FMA (and the
 * mins' one, `mins`) into the row's float sums; `wide`: lanes hold 16 int32 (AVX-512) */
AI void kcols_fma(kcols_t *t, const uint8_t *xq, int64_t xs, int64_t b, const int R,
                  const int mins, const int wide) {
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t->dh));
    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t->mh));
    __m256i mv[4];
    if (mins)
        for (int k = 0; k < 4; ++k) mv[k] = _mm256_loadu_si256((const __m256i *)t->mins[k]);
    for (int r = 0; r < R; ++r) {
        const xqk_t *x = (const xqk_t *)(xq + r * xs) + b;
        __m256i a[8];
        for (int c = 0; c < 8; ++c) {
            a[c] = _mm256_load_si256((const __m256i *)t->lanes[r][c]);
            if (wide)
                a[c] = _mm256_add_epi32(a[c], _mm256_load_si256((const __m256i *)(t->lanes[r][c] + 8)));
        }
        const __m256 dx = _mm256_broadcast_ss(&x->d);
        _mm256_storeu_ps(t->acc[r], _mm256_fmadd_ps(_mm256_mul_ps(dw, dx),
                                                    _mm256_cvtepi32_ps(sum8x8(a)),
                                                    _mm256_loadu_ps(t->acc[r])));
        if (mins) {
            int32_t bp[4];
            memcpy(bp, x->bs32, sizeof bp);
            __m256i ms = _mm256_madd_epi16(mv[0], _mm256_set1_epi32(bp[0]));
            for (int k = 1; k < 4; ++k)
                ms = _mm256_add_epi32(ms, _mm256_madd_epi16(mv[k], _mm256_set1_epi32(bp[k])));
            _mm256_storeu_ps(t->accm[r], _mm256_fmadd_ps(_mm256_mul_ps(mw, dx),
                                                         _mm256_cvtepi32_ps(ms),
                                                         _mm256_loadu_ps(t->accm[r])));
        }
    }
}

/* y[c * R + r] = acc - accm for the group's nc outputs */
AI void kcols_end(const kcols_t *t, float *y, const int R, int nc) {
    for (int r = 0; r < R; ++r) {
        float v[8];
        _mm256_storeu_ps(v, _mm256_sub_ps(_mm256_loadu_ps(t->acc[r]), _mm256_loadu_ps(t->accm[r])));
        for (int c = 0; c < nc; ++c) y[c * R + r] = v[c];
    }
}

/* Q4_K (hbit = 0) and Q5_K (hbit = 1), C weight rows x R activation rows. Each 64-value pair
 * of sub-blocks is decoded once and its two 16-bit-scale products added into each row's
 * integer lanes. */
AI void qk45_cols_avx2(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                       int64_t nb, float *y, const int R, const int hbit) {
    const int bb = hbit ? 176 : 144;
    const __m256i m4 = _mm256_set1_epi8(0x0F), b4 = _mm256_set1_epi8(0x10);
    kcols_t t;
    const int64_t kpf = KPF(ws);
    for (int c0 = 0; c0 < C; c0 += 8) {
        const int nc = C - c0 < 8 ? C - c0 : 8;
        kcols_begin(&t, R, nc);
        for (int64_t b = 0; b < nb; ++b) {
            for (int c = 0; c < nc; ++c) {
                const uint8_t *blk = w + (c0 + c) * ws + b * bb;
                for (int o = 0; o < bb; o += 64) _mm_prefetch((const char *)(blk + kpf + o), _MM_HINT_T0);
                const uint8_t *qs = blk + (hbit ? 48 : 16);
                const uint64_t sc = k4_scales(&t, c, blk);
                const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
                __m256i hbj = hbit ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
                __m256i isum[TILE_M];
                for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
                for (int j = 0; j < 4; ++j) {
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
                    __m256i w0 = _mm256_and_si256(q, m4);
                    __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                    if (hbit) { /* bits 2j, 2j + 1 of hb, at bits 0 and 1 of hbj, to bit 4 */
                        w0 = _mm256_or_si256(w0, _mm256_and_si256(_mm256_slli_epi16(hbj, 4), b4));
                        w1 = _mm256_or_si256(w1, _mm256_and_si256(_mm256_slli_epi16(hbj, 3), b4));
                        hbj = _mm256_srli_epi16(hbj, 2);
                    }
                    const __m256i v0 = _mm256_shuffle_epi8(sc16, _mm256_load_si256((const __m256i *)k4_sel[2 * j]));
                    const __m256i v1 = _mm256_shuffle_epi8(sc16, _mm256_load_si256((const __m256i *)k4_sel[2 * j + 1]));
                    for (int r = 0; r < R; ++r) {
                        const int8_t *xr = ((const xqk_t *)(xq + r * xs) + b)->q + 64 * j;
                        const __m256i p0 = _mm256_madd_epi16(
                            _mm256_maddubs_epi16(w0, _mm256_loadu_si256((const __m256i *)xr)), v0);
                        const __m256i p1 = _mm256_madd_epi16(
                            _mm256_maddubs_epi16(w1, _mm256_loadu_si256((const __m256i *)(xr + 32))), v1);
                        isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(p0, p1));
                    }
                }
                for (int r = 0; r < R; ++r) _mm256_store_si256((__m256i *)t.lanes[r][c], isum[r]);
            }
            kcols_fma(&t, xq, xs, b, R, 1, 0);
        }
        kcols_end(&t, y + c0 * R, R, nc);
    }
}

/* vpshufb selectors of 32-value group g (mod 4) of a half: int16 scale 2g into every lane of
 * the low 128 bits, 2g + 1 into the high ones */
static const uint8_t k6_sel[4][32] __attribute__((aligned(32))) = {
#define SEL6(a, b) {2*a, 2*a+1, 2*a, 2*a+1, 2*a, 2*a+1, 2*a, 2*a+1, 2*a, 2*a+1, 2*a, 2*a+1, \
                    2*a, 2*a+1, 2*a, 2*a+1, 2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1, \
                    2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1}
    SEL6(0, 1), SEL6(2, 3), SEL6(4, 5), SEL6(6, 7)
#undef SEL6
};

/* Q6_K, C weight rows x R activation rows: each 32-value group decoded once (low nibble | two
 * high bits << 4), its two 16-value scales taken with one in-lane byte shuffle from the 16
 * scales widened once per super-block (a shuffle and a widening per group had cost one
 * shuffle-port uop more per group and output; held to AVX2 on the Intel avx512_bf16 VM,
 * `benchmarks/quant_kernel_variants_ab.py --march haswell`, best us, two runs in one process
 * each, the builds in both orders: [3584, 18944] at 1 / 16 / 64 rows 2004, 1634 / 12793,
 * 11907 / 49744, 48970 -> 1881, 1435 / 11387, 11175 / 42197, 41159; [8960, 1536] at 16 / 64
 * rows 2517, 3789 / 10028, 13672 -> 2223, 3412 / 9458, 12093); the -32 offset subtracted
 * from the lanes in integers */
AI void q6k_cols_avx2(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                      int64_t nb, float *y, const int R) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    kcols_t t;
    const int64_t kpf = KPF(ws);
    for (int c0 = 0; c0 < C; c0 += 8) {
        const int nc = C - c0 < 8 ? C - c0 : 8;
        kcols_begin(&t, R, nc);
        for (int64_t b = 0; b < nb; ++b) {
            for (int c = 0; c < nc; ++c) {
                const uint8_t *blk = w + (c0 + c) * ws + b * 210;
                for (int o = 0; o < 210; o += 64) _mm_prefetch((const char *)(blk + kpf + o), Q6COL_HINT);
                memcpy(&t.dh[c], blk + 208, 2);
                const __m128i sc8 = _mm_loadu_si128((const __m128i *)(blk + 192));
                const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
                /* [sc0 .. sc7 | sc0 .. sc7] and [sc8 .. sc15 | sc8 .. sc15] as int16 */
                const __m256i scl = _mm256_permute2x128_si256(sc16, sc16, 0x00);
                const __m256i sch = _mm256_permute2x128_si256(sc16, sc16, 0x11);
                __m256i isum[TILE_M];
                for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
                for (int h = 0; h < 2; ++h) {
                    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
                    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
                    const __m256i hh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                    for (int cc = 0; cc < 4; ++cc) {
                        const __m256i l = cc & 1 ? l1 : l0;
                        const __m256i lo = _mm256_and_si256(cc & 2 ? _mm256_srli_epi16(l, 4) : l, m4);
                        const __m256i hs = cc == 0 ? _mm256_slli_epi16(hh, 4)
                                         : cc == 1 ? _mm256_slli_epi16(hh, 2)
                                         : cc == 2 ? hh : _mm256_srli_epi16(hh, 2);
                        const __m256i wv = _mm256_or_si256(lo, _mm256_and_si256(hs, m30));
                        const int g = 4 * h + cc;
                        const __m256i sv = _mm256_shuffle_epi8(
                            g < 4 ? scl : sch, _mm256_load_si256((const __m256i *)k6_sel[g % 4]));
                        for (int r = 0; r < R; ++r) {
                            const int8_t *xr = ((const xqk_t *)(xq + r * xs) + b)->q + 32 * g;
                            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(
                                _mm256_maddubs_epi16(wv, _mm256_loadu_si256((const __m256i *)xr)), sv));
                        }
                    }
                }
                for (int r = 0; r < R; ++r) {
                    const xqk_t *x = (const xqk_t *)(xq + r * xs) + b;
                    const __m256i off = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)x->bs16));
                    _mm256_store_si256((__m256i *)t.lanes[r][c],
                                       _mm256_sub_epi32(isum[r], _mm256_slli_epi32(off, 5)));
                }
            }
            kcols_fma(&t, xq, xs, b, R, 0, 0);
        }
        kcols_end(&t, y + c0 * R, R, nc);
    }
}

/* ---- Q4_K and Q5_K held packed (rs_quant_pack16), AVX2: a 16-row group read as two 8-output
 * halves, half h at bytes 32h..32h+31 of each 64-byte vector, as q32p_cols_avx2 reads Q4_0.
 * Lane c of a half's vector holds 4 consecutive values of output c, so a sub-block's 8
 * vectors decode once per super-block with no transposes and each row's products go to 8
 * outputs' lanes at once. The integers (a sub-block's dot times its integer scale, summed
 * over the super-block) and the float steps are the other tiles', so the bits are too.
 * vpmaddubsw's int16 pair sums of 4-bit values times int8 stay within int16 over a whole
 * sub-block (8 x 3840), of 5-bit values over half of one (4 x 7936), and one vpmaddwd with the
 * sub-block's scale in both int16 halves of each lane gives the scaled int32 lane sums. Held
 * to AVX2 on the Zen 5 kind (`benchmarks/quant_kernel_variants_ab.py --march haswell`, [8960,
 * 1536], best us at 1 / 4 / 16 / 64 rows): Q4_K rows 346 / 478 / 1593 / 6451, packed 342 /
 * 504 / 1270 / 4342 (before the L2 prefetch below); Q5_K rows 567-731 / 769-775 / 2397-2455 /
 * 10268-10722, packed 561-578 / 760-761 / 1859-1871 / 6483-6513. A Q6_K tile of this form
 * measured 1.2-1.4x slower than its column tile at one row (632-706 against 512-530 us), the
 * decode steps where Q6_K holds a Q4_K_M file's LM head, so Q6_K stays rows on AVX2. Written
 * again on the Intel avx512_bf16 VM held to AVX2 (two dwords of a 16-value sub-block summed in
 * int16, one vpmaddwd with the scale in both halves, both halves of a group per super-block,
 * its prefetches spread over the super-block, two groups per pass), in one process against
 * the column tile, best us: [3584, 18944] at 1 / 4 / 16 / 64 rows 2042 / 4047 / 10206 /
 * 40336 rows, 3341 / 4971 / 7874 / 27930 packed; [1536, 8960] 359 / 638 / 2087 / 8245 rows,
 * 444 / 641 / 1623 / 5683 packed. So 1.3-1.45x at 16-64 rows and 1.2-1.6x slower at one.
 * At one row the packed tile waits on the weights (in one run 1 and 4 rows took the same
 * time; four groups per pass, i.e. four streams per thread, or prefetching farther gained
 * under 10%), while the column tile, which reads 8 rows' streams at once, read them faster. */

/* the int32 lanes' low 16 bits in both halves: the scale as vpmaddwd's int16 pair */
AI __m256i pair16_avx2(__m256i v) {
    const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
    return _mm256_or_si256(lo, _mm256_slli_epi32(lo, 16));
}

/* acc (8 outputs) = fma(d_w * d_x, (float)isum, acc): a super-block's one float step */
AI void kp16_fma_avx2(float *acc, __m256 dw, float dx, __m256i isum) {
    _mm256_storeu_ps(acc, _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(isum),
                                          _mm256_loadu_ps(acc)));
}

/* into which cache the packed Q4_K / Q5_K AVX2 tile asks for the lines two super-blocks ahead
 * of the one in use: L2, as the AVX-512 tile does. Held to AVX2 on the Zen 5
 * kind ([8960, 1536] packed, best us at 1 / 4 / 16 / 64 rows): QPF (4096 bytes) into L1 423 /
 * 621 / 1221 / 4089, this 293 / 390 / 1039 / 3881; farther into L1 (9216, 18432) no faster */
#ifndef K4P_HINT
#define K4P_HINT _MM_HINT_T1
#endif
/* row r's sums of a 32-value sub-block: its 8 transposed dwords v[k] against the row's
 * activation bytes xo .. xo + 31 broadcast 4 at a time, in int16 for `run` products at a time
 * (8 for 4-bit values, 4 for 5-bit), scaled by sc2 (the scales as int16 pairs) into is[r] */
AI void kp16_isums_avx2(const __m256i *v, const int run, __m256i sc2, int xo, const uint8_t *xq,
                        int64_t xs, int64_t b, int R, __m256i *is) {
    for (int r = 0; r < R; ++r) {
        const i32u *x = (const i32u *)(((const xqk_t *)(xq + r * xs) + b)->q + xo);
        __m256i t = is[r];
        for (int k0 = 0; k0 < 8; k0 += run) {
            __m256i s16 = _mm256_maddubs_epi16(v[k0], _mm256_set1_epi32(x[k0]));
            for (int k = k0 + 1; k < k0 + run; ++k)
                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(v[k], _mm256_set1_epi32(x[k])));
            t = _mm256_add_epi32(t, _mm256_madd_epi16(s16, sc2));
        }
        is[r] = t;
    }
}

/* k5_bit4[t][n]: bit t of the nibble n, at bit 4 (vpshufb's table, in both 128-bit lanes) */
#define B4N(t) ((0 >> t) & 1) << 4, ((1 >> t) & 1) << 4, ((2 >> t) & 1) << 4, ((3 >> t) & 1) << 4, \
    ((4 >> t) & 1) << 4, ((5 >> t) & 1) << 4, ((6 >> t) & 1) << 4, ((7 >> t) & 1) << 4,          \
    ((8 >> t) & 1) << 4, ((9 >> t) & 1) << 4, ((10 >> t) & 1) << 4, ((11 >> t) & 1) << 4,       \
    ((12 >> t) & 1) << 4, ((13 >> t) & 1) << 4, ((14 >> t) & 1) << 4, ((15 >> t) & 1) << 4
static const uint8_t k5_bit4[4][32] __attribute__((aligned(32))) = {
    {B4N(0), B4N(0)}, {B4N(1), B4N(1)}, {B4N(2), B4N(2)}, {B4N(3), B4N(3)}};
#undef B4N

/* one super-block (packed at pk) of half h of a 16-row group against R activation rows:
 * Q4_K (hbit = 0) or Q5_K (hbit = 1), into the half's 8 outputs' acc and accm */
AI void qk45_p16_half_avx2(const uint8_t *pk, const int h, const uint8_t *xq, int64_t xs, int64_t b,
                           int R, float (*acc)[8], float (*accm)[8], const int hbit) {
    const int64_t pkd = hbit ? PK5_D : PK4_D;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m6 = _mm256_set1_epi8(0x3F);
    const __m256i m2 = _mm256_set1_epi8(0x03), mb = _mm256_set1_epi32(0xFF);
    __m256i is[KT16_ROWS];
    __m256i hd[4];
    for (int m = 1; m < 4; ++m) hd[m] = _mm256_loadu_si256((const __m256i *)(pk + PK4_SCALES + 64 * (m - 1) + 32 * h));
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pk + pkd + 16 * h)));
    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pk + pkd + 32 + 16 * h)));
    __m256i sc[2], mn[2], mnp[4], sc2[8];
    K4_SCALES_MINS(_mm256, si256, __m256i, hd, sc, mn, mnp);
    for (int s = 0; s < 8; ++s) /* sub-block s's scale as an int16 pair */
        sc2[s] = pair16_avx2(_mm256_and_si256(_mm256_srli_epi32(sc[s / 4], 8 * (s % 4)), mb));
    for (int r = 0; r < R; ++r) is[r] = _mm256_setzero_si256();
    /* Q5_K: each qh vector's nibbles, the indices of the fifth-bit lookups below */
    uint8_t qidx[2][8][32] __attribute__((aligned(32)));
    if (hbit)
        for (int k = 0; k < 8; ++k) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(pk + PK5_QH + 64 * k + 32 * h));
            _mm256_store_si256((__m256i *)qidx[0][k], _mm256_and_si256(qh, m4));
            _mm256_store_si256((__m256i *)qidx[1][k], _mm256_and_si256(_mm256_srli_epi16(qh, 4), m4));
        }
    /* sub-block s = 2 j + e: the low (e = 0) or high nibbles of qs dwords 8 j .. 8 j + 7,
     * against activation bytes 32 s .. 32 s + 31 (a loop over s measured faster than
     * one over the pairs, and than the block unrolled) */
    for (int s = 0; s < 8; ++s) {
        const int j = s / 2;
        __m256i v[8];
        const __m256i lut = _mm256_load_si256((const __m256i *)k5_bit4[s % 4]);
        for (int k = 0; k < 8; ++k) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(pk + 64 * (8 * j + k) + 32 * h));
            v[k] = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(q, 4) : q, m4);
            if (hbit) /* bit s of each qh byte to bit 4: one byte lookup on its nibble */
                v[k] = _mm256_or_si256(v[k], _mm256_shuffle_epi8(lut, _mm256_load_si256((const __m256i *)qidx[s / 4][k])));
        }
        kp16_isums_avx2(v, hbit ? 4 : 8, sc2[s], 32 * s, xq, xs, b, R, is);
    }
    for (int r = 0; r < R; ++r) {
        const xqk_t *x = (const xqk_t *)(xq + r * xs) + b;
        const i32u *bp = (const i32u *)x->bs32;
        __m256i ms = _mm256_madd_epi16(mnp[0], _mm256_set1_epi32(bp[0]));
        for (int k = 1; k < 4; ++k) ms = _mm256_add_epi32(ms, _mm256_madd_epi16(mnp[k], _mm256_set1_epi32(bp[k])));
        kp16_fma_avx2(acc[r], dw, x->d, is[r]);
        kp16_fma_avx2(accm[r], mw, x->d, ms);
    }
}

/* Q4_K (hbit = 0) and Q5_K (hbit = 1) packed, C weight rows x R activation rows (R up to
 * KT16_ROWS). Both halves of a group take each super-block in turn: the second half reads
 * the lines the first has just brought into L1. Each half had walked the whole group, the
 * second from L2 after the first waited on the memory, so the halves' work never overlapped
 * the stream (held to AVX2 on the Zen 5 kind, `quant_kernel_variants_ab.py --march haswell
 * --packed`, best us at 1 / 4 / 16 rows, the builds alternated in one process: Q4_K [3584,
 * 18944] 1481 / 1937 / 4916 -> 1152 / 1532 / 4835, [8960, 1536] 271 / 364 / 1031 -> 209 /
 * 331 / 1009; Q5_K [3584, 18944] 2056 / 2479 / 5734 -> 1746 / 2009 / 5537). The bits are
 * the same: every output's sums run in the same order. */
AI void qk45_p16_avx2(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                      int64_t nb, int R, float *y, const int hbit) {
    const int64_t pkb = 16 * (int64_t)(hbit ? 176 : 144);
    /* Q4_K asks two super-blocks ahead, Q5_K four (held to AVX2, [8960, 1536] at one row,
     * with the qh lookup below: 406-417 -> 372-387 us; Q4_K four ahead: 277-297 -> 269-287,
     * 383 -> 398-407 at four rows) */
    const int64_t ahead = (hbit ? 4 : 2) * pkb;
    float acc[2][KT16_ROWS][8], accm[2][KT16_ROWS][8];
    for (int g0 = 0; g0 < C; g0 += 16) {
        const int nh = C - g0 > 8 ? 2 : 1;
        const uint8_t *g = w + g0 * ws; /* the 16-row group's packed blocks */
        for (int h = 0; h < nh; ++h) {
            memset(acc[h], 0, (size_t)R * sizeof acc[0][0]);
            memset(accm[h], 0, (size_t)R * sizeof accm[0][0]);
        }
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *pk = g + b * pkb;
            for (int64_t l = 0; l < pkb; l += 64) _mm_prefetch((const char *)(pk + ahead + l), K4P_HINT);
            for (int h = 0; h < nh; ++h) qk45_p16_half_avx2(pk, h, xq, xs, b, R, acc[h], accm[h], hbit);
        }
        for (int h = 0; h < nh; ++h) {
            const int c0 = g0 + 8 * h, nc = C - c0 < 8 ? C - c0 : 8;
            for (int r = 0; r < R; ++r)
                for (int c = 0; c < nc; ++c) y[(c0 + c) * R + r] = acc[h][r][c] - accm[h][r][c];
        }
    }
}

/* ---- Q4_0 / Q8_0 / Q4_1 column tiles: 8 (AVX2) or 16 (AVX-512) weight rows at a time,
 * block by block, the weight values transposed so that one int32 lane holds 4 consecutive
 * values of one output: a dot product instruction with 4 activation values broadcast then
 * adds into every output's sum at once, and the block's scale, conversion and FMA run once
 * for all the outputs (the per-block contract of q32b_ref). */

/* absent outputs of a group read this block: zero values and scales */
static const uint8_t zero_block[64] __attribute__((aligned(64)));

/* per 128 bits: o[j] element m = a[m]'s element j (four 4 x 4 transposes of dwords) */
AI void tr4x4_256(const __m256i *a, __m256i *o) {
    const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpackhi_epi32(a[0], a[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(a[2], a[3]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
    o[0] = _mm256_unpacklo_epi64(t0, t2);
    o[1] = _mm256_unpackhi_epi64(t0, t2);
    o[2] = _mm256_unpacklo_epi64(t1, t3);
    o[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* the low 16 bits of each int32 lane, in order */
AI __m128i low16(__m256i v) {
    const __m256i packed = _mm256_shuffle_epi8(v, _mm256_setr_epi8(
        0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
        0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1));
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

/* one 32-value block b of an 8-output group against R activation rows: T[q] lane c holds
 * output c's values 4q..4q+3 (Q8_0's signed), dw / mw its 8 scales / mins; the block's float
 * steps are the per-block contract's (q32b_ref) */
AI void q32b_rows_avx2(const __m256i *T, __m256 dw, __m256 mw, const uint8_t *xq, int64_t xs,
                       int64_t b, float (*acc)[8], float (*accm)[8], const int R, const int type) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int k = (int)(b % 4);
    if (type == 1 && R > 1) {
        /* Q8_0 takes four integer steps per 32 products (sign, vpmaddubsw, vpmaddwd, add)
         * where the 4-bit types take two, so its tiles are bound by those steps: the value
         * vectors outer and the rows inner, each row's sum in a register, keep |w| and w in
         * two registers where holding all eight pairs spilled (held to AVX2 on the Zen 5
         * kind, [8960, 1536] 4 / 16 / 64 rows: 812-822 / 2352-2408 / 9116-9184 us ->
         * 746-763 / 2089-2165 / 7914-7921; one row keeps the loop below, 541-545 us
         * against 630-691 this way) */
        __m256i dot[TILE_MK];
        for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
        for (int q = 0; q < 8; ++q) {
            const __m256i a = _mm256_sign_epi8(T[q], T[q]);
            for (int r = 0; r < R; ++r) {
                const xq32_t *g = (const xq32_t *)(xq + r * xs) + b / 4;
                int32_t x4;
                memcpy(&x4, g->q[k] + 4 * q, sizeof x4);
                const __m256i xv = _mm256_set1_epi32(x4);
                dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(
                    a, _mm256_sign_epi8(xv, T[q])), ones));
            }
        }
        for (int r = 0; r < R; ++r) {
            const xq32_t *g = (const xq32_t *)(xq + r * xs) + b / 4;
            _mm256_storeu_ps(acc[r], _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(g->d[k])),
                                                     _mm256_cvtepi32_ps(dot[r]), _mm256_loadu_ps(acc[r])));
        }
        return;
    }
    __m256i A[8];
    if (type == 1)
        for (int q = 0; q < 8; ++q) A[q] = _mm256_sign_epi8(T[q], T[q]);
    for (int r = 0; r < R; ++r) {
        const xq32_t *g = (const xq32_t *)(xq + r * xs) + b / 4;
        int32_t xi[8];
        memcpy(xi, g->q[k], sizeof xi);
        __m256i dot;
        if (type == 1) {
            dot = _mm256_setzero_si256();
            for (int q = 0; q < 8; ++q)
                dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(
                    A[q], _mm256_sign_epi8(_mm256_set1_epi32(xi[q]), T[q])), ones));
        } else if (type < 3) {
            /* eight products of 4-bit values and int8 stay within int16 (8 * 3810) */
            __m256i s16 = _mm256_maddubs_epi16(T[0], _mm256_set1_epi32(xi[0]));
            for (int q = 1; q < 8; ++q)
                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(T[q], _mm256_set1_epi32(xi[q])));
            dot = _mm256_madd_epi16(s16, ones);
        } else {
            /* 5-bit values: four pairs' products stay within int16 (4 * 7874) */
            __m256i s16[2];
            for (int h = 0; h < 2; ++h) {
                s16[h] = _mm256_maddubs_epi16(T[4 * h], _mm256_set1_epi32(xi[4 * h]));
                for (int q = 4 * h + 1; q < 4 * h + 4; ++q)
                    s16[h] = _mm256_add_epi16(s16[h], _mm256_maddubs_epi16(T[q], _mm256_set1_epi32(xi[q])));
            }
            dot = _mm256_add_epi32(_mm256_madd_epi16(s16[0], ones), _mm256_madd_epi16(s16[1], ones));
        }
        if (Q32_OFF(type)) dot = _mm256_add_epi32(dot, _mm256_set1_epi32(Q32_OFF(type) * g->o[k]));
        _mm256_storeu_ps(acc[r], _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(g->d[k])),
                                                 _mm256_cvtepi32_ps(dot), _mm256_loadu_ps(acc[r])));
        if (Q32_MIN(type))
            _mm256_storeu_ps(accm[r], _mm256_fmadd_ps(mw, _mm256_set1_ps(g->s[k]),
                                                      _mm256_loadu_ps(accm[r])));
    }
}

/* y[(c0 + c) * R + r] for a group's nc outputs */
AI void q32b_store_avx2(float (*acc)[8], float (*accm)[8], float *y, int c0, int nc,
                        const int R, const int type) {
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < nc; ++c)
            y[(c0 + c) * R + r] = Q32_MIN(type) ? acc[r][c] + accm[r][c] : acc[r][c];
}

/* Q5_0/Q5_1's fifth bits of T[q] (values 4q..4q+3 of each output) from each lane's qh as the
 * block stores it (bit e: value e): nibble q of the lane, bit m moved to bit 4 of byte m (a
 * multiply by 2^4 + 2^11 + 2^18 + 2^25 puts bit m at 8m + 4 and no other product there) */
#define Q5_SPREAD 0x02040810
AI __m256i q5_bits_avx2(__m256i qh, int q) {
    const __m256i nib = _mm256_and_si256(_mm256_srli_epi32(qh, 4 * q), _mm256_set1_epi32(15));
    return _mm256_and_si256(_mm256_mullo_epi32(nib, _mm256_set1_epi32(Q5_SPREAD)),
                            _mm256_set1_epi8(0x10));
}

/* the same from rs_quant_pack16's qh lanes (byte m, bit j: value 4j + m), one shift */
AI __m256i q5p_bits_avx2(__m256i qh, int q) {
    return _mm256_and_si256(q <= 4 ? _mm256_slli_epi32(qh, 4 - q) : _mm256_srli_epi32(qh, q - 4),
                            _mm256_set1_epi8(0x10));
}

/* type 0 Q4_0, 1 Q8_0, 2 Q4_1, 3 Q5_0, 4 Q5_1; C weight rows x R activation rows */
AI void q32b_cols_avx2(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                       int64_t nb, float *y, const int R, const int type) {
    const int bb = Q32_BYTES(type), qo = Q32_QS(type);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    float acc[TILE_MK][8], accm[TILE_MK][8];
    /* the group's rows are walked in lock step: the same block of the next group's */
    const int64_t pf = 8 * KPF_GROUPS * ws;
    const __m256i offs = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                            _mm256_set1_epi32((int)ws));
    for (int c0 = 0; c0 < C; c0 += 8) {
        const int nc = C - c0 < 8 ? C - c0 : 8;
        const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(nc),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        memset(acc, 0, sizeof acc);
        memset(accm, 0, sizeof accm);
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *bp[8];
            for (int c = 0; c < 8; ++c) {
                bp[c] = c < nc ? w + (c0 + c) * ws + b * bb : zero_block;
                if (c < nc) _mm_prefetch((const char *)(bp[c] + pf), _MM_HINT_T0);
            }
            /* the 8 blocks' fp16 d (and m) gathered as dwords and narrowed in registers (16-bit
             * stores read back as one vector would stall store forwarding every block) */
            const uint8_t *base = w + c0 * ws + b * bb;
            const __m256i dd = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)base, offs,
                                                           live, 1);
            const __m256i md = Q32_MIN(type) ? _mm256_mask_i32gather_epi32(_mm256_setzero_si256(),
                                                                            (const int *)(base + 2), offs, live, 1)
                                             : dd;
            const __m256i qh = type >= 3 ? _mm256_mask_i32gather_epi32(_mm256_setzero_si256(),
                                                                        (const int *)(base + qo - 4), offs, live, 1)
                                         : dd;
            __m256i T[8], a[4];
            if (type == 1) {
                for (int h = 0; h < 2; ++h) {
                    for (int m = 0; m < 4; ++m)
                        a[m] = _mm256_loadu2_m128i((const __m128i *)(bp[m + 4] + 2 + 16 * h),
                                                   (const __m128i *)(bp[m] + 2 + 16 * h));
                    tr4x4_256(a, T + 4 * h);
                }
            } else {
                __m256i raw[4];
                for (int m = 0; m < 4; ++m)
                    a[m] = _mm256_loadu2_m128i((const __m128i *)(bp[m + 4] + qo),
                                               (const __m128i *)(bp[m] + qo));
                tr4x4_256(a, raw);
                for (int j = 0; j < 4; ++j) {
                    T[j] = _mm256_and_si256(raw[j], m4);
                    T[j + 4] = _mm256_and_si256(_mm256_srli_epi16(raw[j], 4), m4);
                }
                if (type >= 3)
                    for (int q = 0; q < 8; ++q) T[q] = _mm256_or_si256(T[q], q5_bits_avx2(qh, q));
            }
            q32b_rows_avx2(T, _mm256_cvtph_ps(low16(dd)), _mm256_cvtph_ps(low16(md)), xq, xs, b,
                           acc, accm, R, type);
        }
        q32b_store_avx2(acc, accm, y, c0, nc, R, type);
    }
}

/* q32b_cols_avx2's block on rs_quant_pack16's layout: a 16-row group is two 8-output halves,
 * half h at bytes 32h..32h+31 of each 64-byte value vector and at scales 8h..8h+7 (Q8_0's
 * values stored + 128 are flipped back to signed) */
AI void q32p_block_avx2(const uint8_t *p, const int h, const int qsb, const uint8_t *xq, int64_t xs,
                       int64_t b, float (*acc)[8], float (*accm)[8], const int R, const int type) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x80);
    __m256i T[8];
    if (type == 1) {
        for (int q = 0; q < 8; ++q)
            T[q] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 64 * q + 32 * h)), flip);
    } else {
        for (int j = 0; j < 4; ++j) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(p + 64 * j + 32 * h));
            T[j] = _mm256_and_si256(raw, m4);
            T[j + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        }
        if (type >= 3) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 256 + 32 * h));
            for (int q = 0; q < 8; ++q) T[q] = _mm256_or_si256(T[q], q5p_bits_avx2(qh, q));
        }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + qsb + 16 * h)));
    const __m256 mw = Q32_MIN(type) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + qsb + 32 + 16 * h)))
                                    : dw;
    q32b_rows_avx2(T, dw, mw, xq, xs, b, acc, accm, R, type);
}

/* a group's two halves per block, as the packed Q4_K tile takes them (held to AVX2 on the
 * Zen 5 kind, best us at 1 / 4 / 16 rows, each half walking the whole group -> both per
 * block: [8960, 1536] Q4_0 417 / 531 / 1769 -> 262 / 470 / 1741, Q4_1 350 / 619 / 1939 ->
 * 298 / 543 / 1967, Q8_0 566 / 924 / 2106 -> 470 / 784 / 1985; [1536, 8960] Q4_1 316 / 589 /
 * 1903 -> 258 / 533 / 1902) */
AI void q32p_cols_avx2(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                       int64_t nb, float *y, const int R, const int type) {
    const int64_t gb = 16 * (int64_t)Q32_BYTES(type);
    const int qsb = P16_QSB(type);
    float acc[2][TILE_MK][8], accm[2][TILE_MK][8];
    for (int g0 = 0; g0 < C; g0 += 16) {
        const int nh = C - g0 > 8 ? 2 : 1;
        const uint8_t *g = w + g0 * ws;
        for (int h = 0; h < nh; ++h) { /* the R rows in use, as the packed Q4_K tile does */
            memset(acc[h], 0, (size_t)R * sizeof acc[0][0]);
            memset(accm[h], 0, (size_t)R * sizeof accm[0][0]);
        }
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *p = g + b * gb;
            for (int64_t l = 0; l < gb; l += 64) _mm_prefetch((const char *)(p + QPF + l), _MM_HINT_T0);
            for (int h = 0; h < nh; ++h) q32p_block_avx2(p, h, qsb, xq, xs, b, acc[h], accm[h], R, type);
        }
        for (int h = 0; h < nh; ++h) {
            const int c0 = g0 + 8 * h, nc = C - c0 < 8 ? C - c0 : 8;
            q32b_store_avx2(acc[h], accm[h], y, c0, nc, R, type);
        }
    }
}

/* the K-quant tiles loop over the C weight rows themselves (8 at a time) */
#if TILE_MK > 8
#define ONCE_9_16(call)                                                                      \
    case 16: call(16); break;                                                                \
    case 15: call(15); break;                                                                \
    case 14: call(14); break;                                                                \
    case 13: call(13); break;                                                                \
    case 12: call(12); break;                                                                \
    case 11: call(11); break;                                                                \
    case 10: call(10); break;                                                                \
    case 9: call(9); break;
#else
#define ONCE_9_16(call)
#endif
#if TILE_MK > 4
#define ONCE_5_8(call)                                                                       \
    case 8: call(8); break;                                                                  \
    case 7: call(7); break;                                                                  \
    case 6: call(6); break;                                                                  \
    case 5: call(5); break;
#else
#define ONCE_5_8(call)
#endif
#define BY_ROWS_ONCE(call)                                                                   \
    switch (R) {                                                                             \
    ONCE_9_16(call)                                                                          \
    ONCE_5_8(call)                                                                           \
    case 4: call(4); break;                                                                  \
    case 3: call(3); break;                                                                  \
    case 2: call(2); break;                                                                  \
    default: call(1); break;                                                                 \
    }
#define COL_TILE(name, call)                                                                 \
    static void name(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,     \
                     int64_t nb, int R, float *y) {                                          \
        BY_ROWS_ONCE(call)                                                                   \
    }
#define Q4_0_B(r) q32b_cols_avx2(w, ws, C, xq, xs, nb, y, r, 0)
#define Q8_0_B(r) q32b_cols_avx2(w, ws, C, xq, xs, nb, y, r, 1)
#define Q4_1_B(r) q32b_cols_avx2(w, ws, C, xq, xs, nb, y, r, 2)
#define Q5_0_B(r) q32b_cols_avx2(w, ws, C, xq, xs, nb, y, r, 3)
#define Q5_1_B(r) q32b_cols_avx2(w, ws, C, xq, xs, nb, y, r, 4)
#define Q4_K_T(r) qk45_cols_avx2(w, ws, C, xq, xs, nb, y, r, 0)
#define Q5_K_T(r) qk45_cols_avx2(w, ws, C, xq, xs, nb, y, r, 1)
#define Q6_K_T(r) q6k_cols_avx2(w, ws, C, xq, xs, nb, y, r)
#if !RS_Q_AVX512
COL_TILE(q4_0_avx2, Q4_0_B)
COL_TILE(q8_0_avx2, Q8_0_B)
COL_TILE(q4_1_avx2, Q4_1_B)
#define Q4_0_P(r) q32p_cols_avx2(w, ws, C, xq, xs, nb, y, r, 0)
#define Q8_0_P(r) q32p_cols_avx2(w, ws, C, xq, xs, nb, y, r, 1)
#define Q4_1_P(r) q32p_cols_avx2(w, ws, C, xq, xs, nb, y, r, 2)
#define Q5_0_P(r) q32p_cols_avx2(w, ws, C, xq, xs, nb, y, r, 3)
#define Q5_1_P(r) q32p_cols_avx2(w, ws, C, xq, xs, nb, y, r, 4)
COL_TILE(q4_0_p16_avx2, Q4_0_P)
COL_TILE(q8_0_p16_avx2, Q8_0_P)
COL_TILE(q4_1_p16_avx2, Q4_1_P)
COL_TILE(q5_0_p16_avx2, Q5_0_P)
COL_TILE(q5_1_p16_avx2, Q5_1_P)
COL_TILE(q5_0_avx2, Q5_0_B)
COL_TILE(q5_1_avx2, Q5_1_B)
COL_TILE(q4_k_avx2, Q4_K_T)
COL_TILE(q5_k_avx2, Q5_K_T)
COL_TILE(q6_k_avx2, Q6_K_T)
static void q4_k_p16_avx2(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                          int64_t nb, int R, float *y) {
    qk45_p16_avx2(w, ws, C, xq, xs, nb, R, y, 0);
}
static void q5_k_p16_avx2(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                          int64_t nb, int R, float *y) {
    qk45_p16_avx2(w, ws, C, xq, xs, nb, R, y, 1);
}
#endif

#if RS_Q_AVX512
/* zmm [sub-block 2j's 16-bit scale x 16 | sub-block 2j + 1's x 16] from [sc0 .. sc7] in every
 * 128 bits: in-lane byte selectors */
static const uint8_t k4_sel512[4][64] __attribute__((aligned(64))) = {
#define SEL2(a, b) {2*a, 2*a+1, 2*a, 2*a+1, 2*a, 2*a+1, 2*a, 2*a+1, 2*a, 2*a+1, 2*a, 2*a+1, \
                    2*a, 2*a+1, 2*a, 2*a+1, 2*a, 2*a+1, 2*a, 2*a+1, 2*a, 2*a+1, 2*a, 2*a+1, \
                    2*a, 2*a+1, 2*a, 2*a+1, 2*a, 2*a+1, 2*a, 2*a+1, \
                    2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1, \
                    2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1, \
                    2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1, 2*b, 2*b+1}
    SEL2(0, 1), SEL2(2, 3), SEL2(4, 5), SEL2(6, 7)
#undef SEL2
};

/* qk45_cols_avx2 with each 64-value pair of sub-blocks in one zmm: [low nibbles (sub-block
 * 2j) | high nibbles (2j + 1)], maddubs then vpdpwssd with [sc 2j | sc 2j + 1]; a row's 16
 * lanes are stored whole (kcols_fma adds their halves) */
AI void qk45_cols_avx512(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                         int64_t nb, float *y, const int R, const int hbit) {
    const int bb = hbit ? 176 : 144;
    const __m512i m4 = _mm512_set1_epi8(0x0F), b4 = _mm512_set1_epi8(0x10);
    const __m512i nib = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
    const __m512i hsh = _mm512_setr_epi64(4, 4, 4, 4, 3, 3, 3, 3);
    kcols_t t;
    const int64_t kpf = KPF(ws);
    for (int c0 = 0; c0 < C; c0 += 8) {
        const int nc = C - c0 < 8 ? C - c0 : 8;
        kcols_begin(&t, R, nc);
        for (int64_t b = 0; b < nb; ++b) {
            for (int c = 0; c < nc; ++c) {
                const uint8_t *blk = w + (c0 + c) * ws + b * bb;
                for (int o = 0; o < bb; o += 64) _mm_prefetch((const char *)(blk + kpf + o), _MM_HINT_T0);
                const uint8_t *qs = blk + (hbit ? 48 : 16);
                const uint64_t sc = k4_scales(&t, c, blk);
                const __m512i sc16 = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
                __m512i hbj = hbit ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)))
                                   : _mm512_setzero_si512();
                __m512i wv[4], sv[4];
                for (int j = 0; j < 4; ++j) {
                    const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * j)));
                    wv[j] = _mm512_and_si512(_mm512_srlv_epi64(q, nib), m4);
                    if (hbit) { /* bits 2j, 2j + 1 of hb, at bits 0 and 1 of hbj, to bit 4 */
                        wv[j] = _mm512_or_si512(wv[j], _mm512_and_si512(_mm512_sllv_epi64(hbj, hsh), b4));
                        hbj = _mm512_srli_epi16(hbj, 2);
                    }
                    sv[j] = _mm512_shuffle_epi8(sc16, _mm512_load_si512((const __m512i *)k4_sel512[j]));
                }
                for (int r = 0; r < R; ++r) {
                    const int8_t *xr = ((const xqk_t *)(xq + r * xs) + b)->q;
                    __m512i is = _mm512_setzero_si512();
                    for (int j = 0; j < 4; ++j)
                        is = _mm512_dpwssd_epi32(
                            is, _mm512_maddubs_epi16(wv[j], _mm512_loadu_si512((const void *)(xr + 64 * j))), sv[j]);
                    _mm512_store_si512((__m512i *)t.lanes[r][c], is);
                }
            }
            kcols_fma(&t, xq, xs, b, R, 1, 1);
        }
        kcols_end(&t, y + c0 * R, R, nc);
    }
}

/* Q6_K: groups 2p and 2p + 1 of a half side by side in one zmm (their low bits are the 64
 * contiguous bytes of ql, low nibbles for p = 0, high for p = 1) */
AI void q6k_cols_avx512(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                        int64_t nb, float *y, const int R) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i sh0 = _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2);
    const __m512i sh1 = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
    kcols_t t;
    const int64_t kpf = KPF(ws);
    for (int c0 = 0; c0 < C; c0 += 8) {
        const int nc = C - c0 < 8 ? C - c0 : 8;
        kcols_begin(&t, R, nc);
        for (int64_t b = 0; b < nb; ++b) {
            for (int c = 0; c < nc; ++c) {
                const uint8_t *blk = w + (c0 + c) * ws + b * 210;
                for (int o = 0; o < 210; o += 64) _mm_prefetch((const char *)(blk + kpf + o), _MM_HINT_T0);
                memcpy(&t.dh[c], blk + 208, 2);
                const __m128i sc8 = _mm_loadu_si128((const __m128i *)(blk + 192));
                const __m256i sc8y = _mm256_broadcastsi128_si256(sc8);
                __m512i wv[4], sv[4];
                for (int h = 0; h < 2; ++h) {
                    const __m512i l = _mm512_loadu_si512((const void *)(blk + 64 * h));
                    const __m512i hh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)));
                    for (int p = 0; p < 2; ++p) {
                        const __m512i lo = _mm512_and_si512(p ? _mm512_srli_epi16(l, 4) : l, m4);
                        const __m512i hs = p ? _mm512_srlv_epi64(hh, sh1) : _mm512_sllv_epi64(hh, sh0);
                        wv[2 * h + p] = _mm512_or_si512(lo, _mm512_and_si512(hs, m30));
                        const int g = 4 * h + 2 * p;
                        /* int16 scales: sc[2g] x 8, sc[2g + 1] x 8, sc[2g + 2] x 8, sc[2g + 3] x 8 */
                        sv[2 * h + p] = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(
                            sc8y, _mm256_set_epi64x(0x0101010101010101ll * (2 * g + 3),
                                                    0x0101010101010101ll * (2 * g + 2),
                                                    0x0101010101010101ll * (2 * g + 1),
                                                    0x0101010101010101ll * (2 * g))));
                    }
                }
                const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
                for (int r = 0; r < R; ++r) {
                    const xqk_t *x = (const xqk_t *)(xq + r * xs) + b;
                    __m512i is = _mm512_setzero_si512();
                    for (int i = 0; i < 4; ++i) /* group pair i: groups 2i, 2i + 1 */
                        is = _mm512_dpwssd_epi32(
                            is, _mm512_maddubs_epi16(wv[i], _mm512_loadu_si512((const void *)(x->q + 64 * i))), sv[i]);
                    const __m256i off = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)x->bs16));
                    _mm512_store_si512((__m512i *)t.lanes[r][c],
                                       _mm512_sub_epi32(is, _mm512_zextsi256_si512(_mm256_slli_epi32(off, 5))));
                }
            }
            kcols_fma(&t, xq, xs, b, R, 0, 1);
        }
        kcols_end(&t, y + c0 * R, R, nc);
    }
}

/* q32b_cols_avx2 with 16 outputs per zmm and vpdpbusd (4 products per lane in one
 * instruction); Q8_0's int8 weights are shifted to unsigned (w + 128, a sign-bit flip) and the
 * shift's 128 * sum(x) = -16 * o taken off the start of each block's sum */
AI void tr4x4_512(const __m512i *a, __m512i *o) {
    const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
    o[0] = _mm512_unpacklo_epi64(t0, t2);
    o[1] = _mm512_unpackhi_epi64(t0, t2);
    o[2] = _mm512_unpacklo_epi64(t1, t3);
    o[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* [16 bytes at p[m], p[m + 4], p[m + 8], p[m + 12]] */
AI __m512i load4x128(const uint8_t *const *p, int m, int off) {
    __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p[m] + off)));
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(p[m + 4] + off)), 1);
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(p[m + 8] + off)), 2);
    return _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(p[m + 12] + off)), 3);
}


/* ---- AMX-INT8 dot products --------------------------------------------------------------
 * The transposed tiles hold 16 outputs' weights as vectors of dwords, vector k lane n =
 * output n's values 4k .. 4k + 3: exactly an AMX B tile row (TDPBSUD's "VNNI" form). An
 * activation row's quantized values are an A tile row, 16 rows at the row stride. One
 * TDPBSUD then gives the 16 x 16 exact integer dots of a (sub-)block, which the tiles scale
 * and sum as the vpdpbusd path does: the same integers and float steps, so the same bits.
 *   dots(c, a, as, b, ns, nd): for s < ns, m < 16, n < 16
 *     c[256 s + 16 m + n] = sum over j < 4 nd of (int8) a[m * as + 4 nd s + j]
 *                                               * (uint8) b[64 (nd s + j / 4) + 4 n + j % 4]
 *   nd = 8: 32-value (sub-)blocks (Q4_0 .. Q8_0, Q4_K/Q5_K); nd = 4: Q6_K's 16 values.
 * amxq_dots_emu is that definition in plain C (Intel's pseudo-code for TDPBSUD; integer, so
 * exactly the hardware's results): it runs the AMX tiles' loops on any AVX-512 CPU (tests). */
typedef void (*dots_fn)(int32_t *c, const int8_t *a, int64_t as, const uint8_t *b, int ns,
                        int nd);

static void amxq_dots_emu(int32_t *c, const int8_t *a, int64_t as, const uint8_t *b, int ns,
                          int nd) {
    for (int s = 0; s < ns; ++s)
        for (int m = 0; m < 16; ++m)
            for (int n = 0; n < 16; ++n) {
                int32_t acc = 0;
                for (int j = 0; j < 4 * nd; ++j)
                    acc += (int32_t)a[m * as + 4 * nd * s + j]
                           * (int32_t)b[64 * (nd * s + j / 4) + 4 * n + j % 4];
                c[256 * s + 16 * m + n] = acc;
            }
}

/* rows at and above which rs_quant_linear takes the AMX tiles (16: one full A tile). Not yet
 * measured on an AMX CPU: a first guess, to be set by `bench quant-kernels` there */
#ifndef AMXQ_MIN_ROWS
#define AMXQ_MIN_ROWS 16
#endif

#if RS_Q_AMX
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* tmm0, tmm5: C (16 x 16 int32); tmm1/tmm2: A (16 rows x 32 bytes) and B (8 rows x 64 bytes)
 * of a 32-value block; tmm3/tmm4: A (16 x 16) and B (4 x 64) of Q6_K's 16 values */
__attribute__((target("amx-tile"))) static void amxq_config(void) {
    struct {
        uint8_t palette_id, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    const int colsb[6] = {64, 32, 64, 16, 64, 64}, rows[6] = {16, 16, 8, 16, 4, 16};
    for (int t = 0; t < 6; ++t) {
        cfg.colsb[t] = (uint16_t)colsb[t];
        cfg.rows[t] = (uint8_t)rows[t];
    }
    _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) static void amxq_release(void) { _tile_release(); }

/* amxq_dots_emu's contract on the tile unit (amxq_config loaded in this thread); two C
 * tiles in turn, so a sub-block's store overlaps the next one's product */
/* sub-block s's dots into C tile tc, through A tile ta and B tile tb (tile numbers are
 * immediates: the 32- and 16-value shapes have tiles of their own) */
#define AMXQ_DOT(tc, ta, tb, s)                                                              \
    do {                                                                                     \
        _tile_zero(tc);                                                                      \
        _tile_loadd(ta, a + 4 * nd * (s), as);                                               \
        _tile_loadd(tb, b + 64 * nd * (s), 64);                                              \
        _tile_dpbsud(tc, ta, tb);                                                            \
    } while (0)

__attribute__((target("amx-tile,amx-int8"))) static void amxq_dots_hw(
        int32_t *c, const int8_t *a, int64_t as, const uint8_t *b, int ns, int nd) {
    for (int s = 0; s < ns; s += 2) {
        const int two = s + 1 < ns;
        if (nd == 8) {
            AMXQ_DOT(0, 1, 2, s);
            if (two) AMXQ_DOT(5, 1, 2, s + 1);
        } else {
            AMXQ_DOT(0, 3, 4, s);
            if (two) AMXQ_DOT(5, 3, 4, s + 1);
        }
        _tile_stored(0, c + 256 * s, 64);
        if (two) _tile_stored(5, c + 256 * (s + 1), 64);
    }
}

/* 1 where the tile unit runs amxq_dots_hw: CPUID's AMX-TILE and AMX-INT8, Linux granted
 * the tile state (arch_prctl(ARCH_REQ_XCOMP_PERM); without it the first tile instruction
 * raises SIGILL), and on a fixed probe the hardware gives amxq_dots_emu's integers for
 * both block shapes and an odd row stride (else a kernel bug: the vpdpbusd tiles serve) */
static int amxq_probe(void) {
    unsigned ea, eb, ec, ed;
    if (!__get_cpuid_count(7, 0, &ea, &eb, &ec, &ed)) return 0;
    if (!((ed >> 24) & 1) || !((ed >> 25) & 1)) return 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
    enum { AS = 300 };
    static int8_t a[16 * AS];
    static uint8_t b[16 * 256] __attribute__((aligned(64)));
    static int32_t hw[16 * 256] __attribute__((aligned(64))), emu[16 * 256];
    uint32_t v = 12345u;
    for (int i = 0; i < 16 * AS; ++i) a[i] = (int8_t)((v = v * 1103515245u + 12345u) >> 24);
    for (int i = 0; i < 16 * 256; ++i) b[i] = (uint8_t)((v = v * 1103515245u + 12345u) >> 24);
    int ok = 1;
    for (int nd = 4; nd <= 8; nd += 4) {
        const int ns = nd == 8 ? 8 : 16;
        amxq_config();
        amxq_dots_hw(hw, a, AS, b, ns, nd);
        amxq_release();
        amxq_dots_emu(emu, a, AS, b, ns, nd);
        ok &= memcmp(hw, emu, sizeof hw) == 0;
    }
    return ok;
}
#endif


/* one 32-value block b of a 16-output group against R activation rows: T[q] lane c holds
 * output c's values 4q..4q+3 (Q8_0's shifted to unsigned), dw / mw its 16 scales / mins;
 * the block's float steps are the per-block contract's (q32b_ref). The sums are vectors
 * indexed by the compile-time row, so they stay in registers */
/* what a block's dot starts from: Q4_0's -8 sum(x), Q5_0's -16 sum(x), and for Q8_0 (values
 * stored + 128) -128 sum(x) */
AI __m512i q32b_offset(const xq32_t *g, int k, const int type) {
    return type == 1 ? _mm512_set1_epi32(16 * g->o[k])
         : Q32_OFF(type) ? _mm512_set1_epi32(Q32_OFF(type) * g->o[k]) : _mm512_setzero_si512();
}

/* a block's float steps for one activation row, given its exact integer dots */
AI void q32b_step(__m512i dot, __m512 dw, __m512 mw, const xq32_t *g, int k, __m512 *acc,
                  __m512 *accm, const int type) {
    *acc = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(g->d[k])), _mm512_cvtepi32_ps(dot), *acc);
    if (Q32_MIN(type)) *accm = _mm512_fmadd_ps(mw, _mm512_set1_ps(g->s[k]), *accm);
}

AI void q32b_rows_avx512(const __m512i *T, __m512 dw, __m512 mw, const uint8_t *xq, int64_t xs,
                         int64_t b, __m512 *acc, __m512 *accm, const int R, const int type) {
    const int k = (int)(b % 4);
    for (int r = 0; r < R; ++r) {
        const xq32_t *g = (const xq32_t *)(xq + r * xs) + b / 4;
        const i32u *xi = (const i32u *)g->q[k];
        __m512i dot = q32b_offset(g, k, type);
#if Q32_CHAINS == 2
        __m512i dot1 = _mm512_setzero_si512();
        for (int q = 0; q < 8; q += 2) {
            dot = _mm512_dpbusd_epi32(dot, T[q], _mm512_set1_epi32(xi[q]));
            dot1 = _mm512_dpbusd_epi32(dot1, T[q + 1], _mm512_set1_epi32(xi[q + 1]));
        }
        dot = _mm512_add_epi32(dot, dot1);
#else
        for (int q = 0; q < 8; ++q)
            dot = _mm512_dpbusd_epi32(dot, T[q], _mm512_set1_epi32(xi[q]));
#endif
        q32b_step(dot, dw, mw, g, k, &acc[r], &accm[r], type);
    }
}

/* y[(c0 + c) * R + r] for a group's nc outputs */
AI void q32b_store_avx512(const __m512 *acc, const __m512 *accm, float *y, int c0, int nc,
                          const int R, const int type) {
    for (int r = 0; r < R; ++r) {
        float a[16], m[16];
        _mm512_storeu_ps(a, acc[r]);
        _mm512_storeu_ps(m, accm[r]);
        for (int c = 0; c < nc; ++c) y[(c0 + c) * R + r] = Q32_MIN(type) ? a[c] + m[c] : a[c];
    }
}

/* q5_bits_avx2 and q5p_bits_avx2 for 16 outputs */
AI __m512i q5_bits_avx512(__m512i qh, int q) {
    const __m512i nib = _mm512_and_si512(_mm512_srli_epi32(qh, 4 * q), _mm512_set1_epi32(15));
    return _mm512_and_si512(_mm512_mullo_epi32(nib, _mm512_set1_epi32(Q5_SPREAD)),
                            _mm512_set1_epi8(0x10));
}
AI __m512i q5p_bits_avx512(__m512i qh, int q) {
    return _mm512_and_si512(q <= 4 ? _mm512_slli_epi32(qh, 4 - q) : _mm512_srli_epi32(qh, q - 4),
                            _mm512_set1_epi8(0x10));
}

AI void q32b_cols_avx512(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                         int64_t nb, float *y, const int R, const int type) {
    const int bb = Q32_BYTES(type), qo = Q32_QS(type);
    const __m512i m4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[TILE_MK], accm[TILE_MK];
    const int64_t pf = 16 * KPF_GROUPS * ws;
    const __m512i offs = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                              12, 13, 14, 15),
                                            _mm512_set1_epi32((int)ws));
    for (int c0 = 0; c0 < C; c0 += 16) {
        const int nc = C - c0 < 16 ? C - c0 : 16;
        const __mmask16 live = (__mmask16)((1u << nc) - 1u);
        for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *bp[16];
            for (int c = 0; c < 16; ++c) {
                bp[c] = c < nc ? w + (c0 + c) * ws + b * bb : zero_block;
                if (c < nc) _mm_prefetch((const char *)(bp[c] + pf), _MM_HINT_T0);
            }
            const uint8_t *base = w + c0 * ws + b * bb;
            const __m512i dd = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offs, base, 1);
            const __m512i md = Q32_MIN(type) ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offs,
                                                                            base + 2, 1)
                                             : dd;
            const __m512i qh = type >= 3 ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offs,
                                                                        base + qo - 4, 1)
                                         : dd;
            __m512i T[8], a[4];
            if (type == 1) {
                for (int h = 0; h < 2; ++h) {
                    for (int m = 0; m < 4; ++m) a[m] = load4x128(bp, m, 2 + 16 * h);
                    tr4x4_512(a, T + 4 * h);
                }
                for (int q = 0; q < 8; ++q) T[q] = _mm512_xor_si512(T[q], flip);
            } else {
                __m512i raw[4];
                for (int m = 0; m < 4; ++m) a[m] = load4x128(bp, m, qo);
                tr4x4_512(a, raw);
                for (int j = 0; j < 4; ++j) {
                    T[j] = _mm512_and_si512(raw[j], m4);
                    T[j + 4] = _mm512_and_si512(_mm512_srli_epi16(raw[j], 4), m4);
                }
                if (type >= 3)
                    for (int q = 0; q < 8; ++q) T[q] = _mm512_or_si512(T[q], q5_bits_avx512(qh, q));
            }
            const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
            const __m512 mw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(md));
            q32b_rows_avx512(T, dw, mw, xq, xs, b, acc, accm, R, type);
        }
        q32b_store_avx512(acc, accm, y, c0, nc, R, type);
    }
}

/* a 16-output group's packed block p (gb bytes) as the tile's operands: T[q] lane c holds
 * output c's values 4q..4q+3 (Q5's fifth bits or-ed in), dw / mw the 16 scales / mins;
 * asks the cache for the block QPF bytes on */
AI void q32p_block_avx512(const uint8_t *p, int64_t gb, __m512i *T, __m512 *dw, __m512 *mw,
                          const int type) {
    const int qsb = P16_QSB(type);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int64_t l = 0; l < gb; l += 64) _mm_prefetch((const char *)(p + QPF + l), _MM_HINT_T0);
    if (type == 1) {
        for (int q = 0; q < 8; ++q) T[q] = _mm512_loadu_si512(p + 64 * q);
    } else {
        for (int j = 0; j < 4; ++j) {
            const __m512i raw = _mm512_loadu_si512(p + 64 * j);
            T[j] = _mm512_and_si512(raw, m4);
            T[j + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
        }
        if (type >= 3) {
            const __m512i qh = _mm512_loadu_si512(p + 256);
            for (int q = 0; q < 8; ++q) T[q] = _mm512_or_si512(T[q], q5p_bits_avx512(qh, q));
        }
    }
    *dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + qsb)));
    *mw = Q32_MIN(type) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + qsb + 32))) : *dw;
}

/* q32b_cols_avx512 on weights packed at load (rs_quant_pack16): each 16-output group's block
 * is already the tile's operands (P16_QS bytes of lane-ordered values, then 16 fp16 scales,
 * then Q4_1's 16 fp16 mins), so the per-block gathers, 128-bit inserts and transposes are
 * gone; the integers and float steps, so the bits, are the unpacked tile's */
AI void q32p_cols_avx512(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                         int64_t nb, float *y, const int R, const int type) {
    const int64_t gb = 16 * (int64_t)Q32_BYTES(type);
    __m512 acc[TILE_MK], accm[TILE_MK];
    for (int c0 = 0; c0 < C; c0 += 16) {
        const int nc = C - c0 < 16 ? C - c0 : 16;
        const uint8_t *g = w + c0 * ws; /* the group's nb packed blocks, back to back */
        for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *p = g + b * gb;
            __m512i T[8];
            __m512 dw, mw;
            q32p_block_avx512(p, gb, T, &dw, &mw, type);
            q32b_rows_avx512(T, dw, mw, xq, xs, b, acc, accm, R, type);
        }
        q32b_store_avx512(acc, accm, y, c0, nc, R, type);
    }
}

/* q32p_cols_avx512 with the integer dots from `dots` (AMX tiles or their emulation), 16
 * activation rows per TDPBSUD whatever R (<= 16: the driver pads the quantized rows to a
 * multiple of 16); the same integers and float steps, so the same bits */
AI void q32p_amx(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs, int64_t nb,
                 int R, float *y, dots_fn dots, const int type) {
    const int64_t gb = 16 * (int64_t)Q32_BYTES(type);
    __m512 acc[16], accm[16];
    int32_t c[256] __attribute__((aligned(64)));
    for (int c0 = 0; c0 < C; c0 += 16) {
        const int nc = C - c0 < 16 ? C - c0 : 16;
        const uint8_t *g = w + c0 * ws;
        for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *p = g + b * gb;
            __m512i T[8] __attribute__((aligned(64)));
            __m512 dw, mw;
            q32p_block_avx512(p, gb, T, &dw, &mw, type);
            const int k = (int)(b % 4);
            /* Q8_0's packed values are already the B tile (int8 + 128, as unsigned) */
            dots(c, ((const xq32_t *)xq + b / 4)->q[k], xs, type == 1 ? p : (const uint8_t *)T, 1, 8);
            for (int r = 0; r < R; ++r) {
                const xq32_t *gx = (const xq32_t *)(xq + r * xs) + b / 4;
                const __m512i dot = _mm512_add_epi32(q32b_offset(gx, k, type), _mm512_load_si512(c + 16 * r));
                q32b_step(dot, dw, mw, gx, k, &acc[r], &accm[r], type);
            }
        }
        q32b_store_avx512(acc, accm, y, c0, nc, R, type);
    }
}

#define Q4_0_B5(r) q32b_cols_avx512(w, ws, C, xq, xs, nb, y, r, 0)
#define Q8_0_B5(r) q32b_cols_avx512(w, ws, C, xq, xs, nb, y, r, 1)
#define Q4_1_B5(r) q32b_cols_avx512(w, ws, C, xq, xs, nb, y, r, 2)
COL_TILE(q4_0_avx512, Q4_0_B5)
COL_TILE(q8_0_avx512, Q8_0_B5)
COL_TILE(q4_1_avx512, Q4_1_B5)
#define Q5_0_B5(r) q32b_cols_avx512(w, ws, C, xq, xs, nb, y, r, 3)
#define Q5_1_B5(r) q32b_cols_avx512(w, ws, C, xq, xs, nb, y, r, 4)
COL_TILE(q5_0_avx512, Q5_0_B5)
COL_TILE(q5_1_avx512, Q5_1_B5)
#define Q4_0_P5(r) q32p_cols_avx512(w, ws, C, xq, xs, nb, y, r, 0)
#define Q8_0_P5(r) q32p_cols_avx512(w, ws, C, xq, xs, nb, y, r, 1)
#define Q4_1_P5(r) q32p_cols_avx512(w, ws, C, xq, xs, nb, y, r, 2)
COL_TILE(q4_0_p16_avx512, Q4_0_P5)
COL_TILE(q8_0_p16_avx512, Q8_0_P5)
COL_TILE(q4_1_p16_avx512, Q4_1_P5)
#define Q5_0_P5(r) q32p_cols_avx512(w, ws, C, xq, xs, nb, y, r, 3)
#define Q5_1_P5(r) q32p_cols_avx512(w, ws, C, xq, xs, nb, y, r, 4)
COL_TILE(q5_0_p16_avx512, Q5_0_P5)
COL_TILE(q5_1_p16_avx512, Q5_1_P5)
/* ---- K-quant transposed tiles: 16 outputs in the 16 int32 lanes of a zmm. The column tiles
 * above spend two instructions (maddubs, vpdpwssd) per 64 products of one output and then add
 * each output's lanes horizontally. Here a 16-output group's weight block is transposed once
 * per tile of rows (lane c: output c's 4 consecutive values of a sub-block), so that one
 * vpdpbusd against 4 broadcast activation values adds 64 products into 16 outputs' sub-block
 * sums at once, and one vpmulld applies the 16 outputs' sub-block scales. The integers (isum,
 * msum) are the same exact numbers as every other path's, and the float steps per super-block
 * and output are the K-quant contract's, so the bits are the column tiles'. The transposition
 * costs about as much as 4 rows' products, so the driver takes these tiles for tiles of
 * KT16_MIN_ROWS rows and more. */


/* absent outputs of a 16-output group read this super-block: zero values and scales */
static const uint8_t zero_kblock[256] __attribute__((aligned(64)));

/* r[i] element c = the input r[c]'s element i (a 16 x 16 int32 transpose) */
AI void tr16x16_512(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; ++i) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* the 16 outputs' super-block b (absent outputs: zeros), asking the cache for the same block
 * of the next 16 outputs */
AI void kt16_blocks(const uint8_t **p, const uint8_t *w, int64_t ws, int c0, int nc, int64_t b,
                    int bb) {
    for (int c = 0; c < 16; ++c) {
        p[c] = c < nc ? w + (c0 + c) * ws + b * bb : zero_kblock;
        if (c < nc)
            for (int o = 0; o < bb; o += 64) _mm_prefetch((const char *)(p[c] + 16 * ws + o), _MM_HINT_T0);
    }
}

/* sum over k < n of the int16 pairs p[k] (every output) dotted with row pair bp[k] (broadcast):
 * Q4_K's mins against bs32, Q6_K's scales against bs16 */
AI __m512i kt16_pair_dots(const __m512i *p, const int n, const i32u *bp) {
    __m512i s = _mm512_setzero_si512();
    for (int k = 0; k < n; ++k) s = _mm512_dpwssd_epi32(s, p[k], _mm512_set1_epi32(bp[k]));
    return s;
}

/* acc (16 outputs) = fma(d_w * d_x, (float)isum, acc): a super-block's one float step */
AI void kt16_fma(float *acc, __m512 dw, float dx, __m512i isum) {
    _mm512_store_ps(acc, _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(isum),
                                         _mm512_load_ps(acc)));
}

/* kt16_isums without `dots`: the values of ns sub-blocks of nd transposed dwords each
 * (wt[s * nd + k]) against every row's activation values from byte xo[s] of block b, the
 * products of sub-block s scaled by scs[s] and added into is[r] (set instead when `first`).
 * Integer sums, so the bits do not depend on the order; the packed tiles call it on a few
 * sub-blocks at a time so that their values stay in registers. Through kt16_isums' own loop
 * instead (a whole block's values stored into a 4 KiB array and loaded back, and the row sums
 * zeroed by a memset call per block), packed [8960, 1536], 2 threads, Ice Lake kind, best us
 * at M = 1 / 4 / 8 / 16 / 64, kt16_isums -> this (`benchmarks/quant_kernel_variants_ab.py
 * --packed`): Q4_K 447 / 603 / 850 / 1366 / 4494 -> 355 / 474 / 667 / 1180 / 4256 (one row
 * 17.3 -> 21.8 GB/s of weights, Q4_0's rate); Q6_K 702 / 935 / 1157 / 1722 / 5290 -> 623 /
 * 880 / 1036 / 1567 / 4659 */
AI void kt16_isums_regs(const __m512i *wt, const __m512i *scs, const int *xo, const int ns,
                        const int nd, const uint8_t *xq, int64_t xs, int64_t b, int R,
                        __m512i *is, const int first) {
    for (int r = 0; r < R; ++r) {
        const int8_t *xr = ((const xqk_t *)(xq + r * xs) + b)->q;
        __m512i t = first ? _mm512_setzero_si512() : is[r];
        for (int s = 0; s < ns; ++s) {
            const i32u *x = (const i32u *)(xr + xo[s]);
            __m512i p0 = _mm512_setzero_si512(), p1 = _mm512_setzero_si512();
            for (int k = 0; k < nd; k += 2) {
                p0 = _mm512_dpbusd_epi32(p0, wt[nd * s + k], _mm512_set1_epi32(x[k]));
                p1 = _mm512_dpbusd_epi32(p1, wt[nd * s + k + 1], _mm512_set1_epi32(x[k + 1]));
            }
            t = _mm512_add_epi32(t, _mm512_mullo_epi32(_mm512_add_epi32(p0, p1), scs[s]));
        }
        is[r] = t;
    }
}

/* is[r] += sum over ns sub-blocks s of scs[s] * (sub-block s's products for row r of block b),
 * the products nd transposed dwords wt[s * nd + k] against row r's activation values
 * nd * 4 * s + 4 k .. + 3 broadcast (rows of up to 16 at a time from the AMX `dots`, else
 * kt16_isums_regs over the whole block) */
AI void kt16_isums(const __m512i *wt, const __m512i *scs, const int ns, const int nd,
                   const uint8_t *xq, int64_t xs, int64_t b, int R, __m512i *is, dots_fn dots) {
    if (dots) { /* 16 rows' sub-block dots per call, scaled and summed here */
        int32_t c[16 * 256] __attribute__((aligned(64)));
        for (int r0 = 0; r0 < R; r0 += 16) {
            dots(c, ((const xqk_t *)(xq + r0 * xs) + b)->q, xs, (const uint8_t *)wt, ns, nd);
            for (int m = 0; m < 16 && r0 + m < R; ++m) {
                __m512i acc = _mm512_setzero_si512();
                for (int s = 0; s < ns; ++s)
                    acc = _mm512_add_epi32(acc, _mm512_mullo_epi32(_mm512_load_si512(c + 256 * s + 16 * m), scs[s]));
                is[r0 + m] = acc;
            }
        }
        return;
    }
    int xo[16];
    for (int s = 0; s < ns; ++s) xo[s] = 4 * nd * s;
    kt16_isums_regs(wt, scs, xo, ns, nd, xq, xs, b, R, is, 1);
}

/* bytes ahead of a packed Q4_K super-block that the tile asks the cache for, into L2 (T0's
 * requests into L1 read [3584, 18944] at one row in 1716 us, T1's in 1619 us) */
#ifndef PK4_PF
#define PK4_PF (2 * PK4_BLOCK)
#endif
#ifndef PK4_HINT
#define PK4_HINT _MM_HINT_T1
#endif

/* Q5_K's fifth bits of sub-block s (bit s of each qh byte) moved to bit 4 of every byte:
 * 16-bit shifts of at most 4 places keep bit 4 and bit 12 within their own bytes */
AI __m512i q5k_hbits(__m512i qh, const int s) {
    const __m512i hb = s <= 4 ? _mm512_slli_epi16(qh, 4 - s) : _mm512_srli_epi16(qh, s - 4);
    return _mm512_and_si512(hb, _mm512_set1_epi8(0x10));
}

/* Q4_K (hbit = 0) and Q5_K (hbit = 1), C weight rows x R activation rows, 16 outputs at a
 * time; `packed`: W in rs_quant_pack16's layout, the transposes done at load */
AI void qk45_t16_avx512(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                        int64_t nb, int R, float *y, const int hbit, const int packed,
                        dots_fn dots) {
    const int bb = hbit ? 176 : 144, qo = hbit ? 48 : 16;
    /* a packed group's super-block bytes, where its d sits, and how far ahead to prefetch */
    const int64_t pkb = 16 * bb, pkd = hbit ? PK5_D : PK4_D, pkpf = (int64_t)PK4_PF * bb / 144;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m6 = _mm512_set1_epi8(0x3F);
    const __m512i m2 = _mm512_set1_epi8(0x03), mb = _mm512_set1_epi32(0xFF);
    __m512i wt[8][8] __attribute__((aligned(64)));
    __m512i is[KT16_ROWS] __attribute__((aligned(64)));
    float acc[KT16_ROWS][16] __attribute__((aligned(64))), accm[KT16_ROWS][16] __attribute__((aligned(64)));
    for (int c0 = 0; c0 < C; c0 += 16) {
        const int nc = C - c0 < 16 ? C - c0 : 16;
        /* only the R rows in use: the whole arrays, 8 KiB per 16 outputs, had been 4.6% of
         * a one-row decode step of Qwen2.5-1.5B in Q4_K_M (Zen 5) */
        memset(acc, 0, (size_t)R * sizeof acc[0]);
        memset(accm, 0, (size_t)R * sizeof accm[0]);
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *p[16], *pk = w + c0 * ws + b * pkb;
            /* headers: h[0] = d | dmin << 16, h[1..3] the 12 scale bytes, lane c: output c */
            __m512i h[4];
            __m512 dw, mw;
            if (packed) {
                for (int l = 0; l < pkb; l += 64)
                    _mm_prefetch((const char *)(pk + pkpf + l), PK4_HINT);
                for (int m = 1; m < 4; ++m) h[m] = _mm512_loadu_si512((const void *)(pk + PK4_SCALES + 64 * (m - 1)));
                dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pk + pkd)));
                mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pk + pkd + 32)));
            } else {
                kt16_blocks(p, w, ws, c0, nc, b, bb);
                __m512i a[4];
                for (int m = 0; m < 4; ++m) a[m] = load4x128(p, m, 0);
                tr4x4_512(a, h);
                dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h[0]));
                mw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h[0], 16)));
            }
            __m512i sc[2], mn[2], mnp[4], scs[8];
            K4_SCALES_MINS(_mm512, si512, __m512i, h, sc, mn, mnp);
            for (int s = 0; s < 8; ++s)
                scs[s] = _mm512_and_si512(_mm512_srli_epi32(sc[s / 4], 8 * (s % 4)), mb);
            if (packed && !dots) {
                /* a sub-block pair at a time: its 8 qs dwords unpacked in registers into the
                 * low nibbles' sub-block 2 j and the high ones' 2 j + 1 (Q5_K: qh dword k, the
                 * fifth bits of values 4 k .. 4 k + 3 of every sub-block, or-ed in) */
                for (int j = 0; j < 4; ++j) {
                    __m512i v[16];
                    for (int k = 0; k < 8; ++k) {
                        const __m512i q = _mm512_loadu_si512((const void *)(pk + 64 * (8 * j + k)));
                        v[k] = _mm512_and_si512(q, m4);
                        v[8 + k] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
                        if (hbit) {
                            const __m512i qh = _mm512_loadu_si512((const void *)(pk + PK5_QH + 64 * k));
                            v[k] = _mm512_or_si512(v[k], q5k_hbits(qh, 2 * j));
                            v[8 + k] = _mm512_or_si512(v[8 + k], q5k_hbits(qh, 2 * j + 1));
                        }
                    }
                    const int xo[2] = {64 * j, 64 * j + 32};
                    kt16_isums_regs(v, scs + 2 * j, xo, 2, 8, xq, xs, b, R, is, j == 0);
                }
            } else {
                /* the 128 bytes of qs: dword D of every output (sub-block pair D / 8, values
                 * 4 (D % 8) ..), low nibbles sub-block 2 (D / 8), high ones 2 (D / 8) + 1 */
                for (int hh = 0; hh < 2; ++hh) {
                    __m512i q[16];
                    if (packed) {
                        for (int d = 0; d < 16; ++d) q[d] = _mm512_loadu_si512((const void *)(pk + 64 * (16 * hh + d)));
                    } else {
                        for (int c = 0; c < 16; ++c) q[c] = _mm512_loadu_si512((const void *)(p[c] + qo + 64 * hh));
                        tr16x16_512(q);
                    }
                    for (int d = 0; d < 16; ++d) {
                        const int D = 16 * hh + d, j = D / 8, k = D % 8;
                        wt[2 * j][k] = _mm512_and_si512(q[d], m4);
                        wt[2 * j + 1][k] = _mm512_and_si512(_mm512_srli_epi16(q[d], 4), m4);
                    }
                }
                if (hbit) { /* Q5_K: bit s of qh byte i is bit 4 of sub-block s's value i; qh dword k
                             * of every output holds values 4 k .. 4 k + 3's */
                    __m512i qh[16];
                    if (packed) {
                        for (int k = 0; k < 8; ++k) qh[k] = _mm512_loadu_si512((const void *)(pk + PK5_QH + 64 * k));
                    } else {
                        for (int c = 0; c < 16; ++c)
                            qh[c] = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(p[c] + 16)));
                        tr16x16_512(qh);
                    }
                    for (int sb = 0; sb < 8; ++sb)
                        for (int k = 0; k < 8; ++k) wt[sb][k] = _mm512_or_si512(wt[sb][k], q5k_hbits(qh[k], sb));
                }
                kt16_isums(&wt[0][0], scs, 8, 8, xq, xs, b, R, is, dots);
            }
            for (int r = 0; r < R; ++r) {
                const xqk_t *x = (const xqk_t *)(xq + r * xs) + b;
                kt16_fma(acc[r], dw, x->d, is[r]);
                kt16_fma(accm[r], mw, x->d, kt16_pair_dots(mnp, 4, (const i32u *)x->bs32));
            }
        }
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < nc; ++c) y[(c0 + c) * R + r] = acc[r][c] - accm[r][c];
    }
}


/* Q6_K packed at load, C weight rows x R activation rows, 16 outputs at a time: the 6-bit
 * values of 16 outputs decoded once per super-block from the transposed ql / qh dwords (no
 * transposes), each 16-value sub-block's 4 dwords of products scaled in kt16_isums_regs (kt16_isums
 * with AMX dots), and the
 * -32 offset taken off as 32 * sum(sc * bs16), exact integers as q6_k_ref's. The column tile
 * reads a row's block at a time and spends most of a one-row call rearranging it (Q6_K [8960,
 * 1536], one row: 19.1 GB/s of weight bytes against the packed Q4_K tile's 30.7, Zen 5) */
AI void q6_k_p16_t16(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                     int64_t nb, int R, float *y, dots_fn dots) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i lo16 = _mm512_set1_epi32(0xFFFF);
    __m512i wt[16][4] __attribute__((aligned(64)));
    __m512i is[KT16_ROWS] __attribute__((aligned(64)));
    float acc[KT16_ROWS][16] __attribute__((aligned(64)));
    for (int c0 = 0; c0 < C; c0 += 16) {
        const int nc = C - c0 < 16 ? C - c0 : 16;
        memset(acc, 0, (size_t)R * sizeof acc[0]);
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *pk = w + c0 * ws + b * PK6_BLOCK;
            for (int l = 0; l < PK6_BLOCK; l += 64)
                _mm_prefetch((const char *)(pk + 2 * PK6_BLOCK + l), PK4_HINT);
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pk + PK6_D)));
            /* scs[s]: sub-block s's scale of every output, int32; scp[k]: scales 2k, 2k + 1
             * as an int16 pair */
            __m512i scs[16], scp[8];
            for (int m = 0; m < 4; ++m) {
                const __m512i v = _mm512_loadu_si512((const void *)(pk + PK6_SCALES + 64 * m));
                for (int i = 0; i < 4; ++i)
                    scs[4 * m + i] = _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * i), 24);
            }
            for (int k = 0; k < 8; ++k)
                scp[k] = _mm512_or_si512(_mm512_and_si512(scs[2 * k], lo16), _mm512_slli_epi32(scs[2 * k + 1], 16));
            /* half hh, dword k of its 32 values per group: ql dwords 16 hh + k (groups 4 hh,
             * 4 hh + 2: low, high nibbles) and 16 hh + 8 + k (4 hh + 1, 4 hh + 3), two bits each
             * of qh dword 8 hh + k; group g's dword k is sub-block 2 g + k / 4's dword k % 4 */
            if (!dots) {
                /* a quarter of the block at a time: ql / qh dwords k = 4 kk .. 4 kk + 3 of half
                 * hh give sub-blocks 8 hh + kk + {0, 2, 4, 6} whole, decoded in registers */
                for (int hh = 0; hh < 2; ++hh)
                    for (int kk = 0; kk < 2; ++kk) {
                        __m512i v[16];
                        for (int i = 0; i < 4; ++i) {
                            const int k = 4 * kk + i;
                            const __m512i a = _mm512_loadu_si512((const void *)(pk + 64 * (16 * hh + k)));
                            const __m512i c = _mm512_loadu_si512((const void *)(pk + 64 * (16 * hh + 8 + k)));
                            const __m512i q = _mm512_loadu_si512((const void *)(pk + PK6_QH + 64 * (8 * hh + k)));
                            v[i] = _mm512_or_si512(_mm512_and_si512(a, m4), _mm512_and_si512(_mm512_slli_epi16(q, 4), m30));
                            v[4 + i] = _mm512_or_si512(_mm512_and_si512(c, m4), _mm512_and_si512(_mm512_slli_epi16(q, 2), m30));
                            v[8 + i] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), m4), _mm512_and_si512(q, m30));
                            v[12 + i] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(c, 4), m4),
                                                        _mm512_and_si512(_mm512_srli_epi16(q, 2), m30));
                        }
                        const int s0 = 8 * hh + kk;
                        const __m512i s4[4] = {scs[s0], scs[s0 + 2], scs[s0 + 4], scs[s0 + 6]};
                        const int xo[4] = {16 * s0, 16 * (s0 + 2), 16 * (s0 + 4), 16 * (s0 + 6)};
                        kt16_isums_regs(v, s4, xo, 4, 4, xq, xs, b, R, is, hh == 0 && kk == 0);
                    }
            } else {
                for (int hh = 0; hh < 2; ++hh)
                    for (int k = 0; k < 8; ++k) {
                        const __m512i a = _mm512_loadu_si512((const void *)(pk + 64 * (16 * hh + k)));
                        const __m512i c = _mm512_loadu_si512((const void *)(pk + 64 * (16 * hh + 8 + k)));
                        const __m512i q = _mm512_loadu_si512((const void *)(pk + PK6_QH + 64 * (8 * hh + k)));
                        __m512i *g = &wt[8 * hh + k / 4][k % 4];
                        g[0] = _mm512_or_si512(_mm512_and_si512(a, m4), _mm512_and_si512(_mm512_slli_epi16(q, 4), m30));
                        g[8] = _mm512_or_si512(_mm512_and_si512(c, m4), _mm512_and_si512(_mm512_slli_epi16(q, 2), m30));
                        g[16] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), m4), _mm512_and_si512(q, m30));
                        g[24] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(c, 4), m4),
                                                _mm512_and_si512(_mm512_srli_epi16(q, 2), m30));
                    }
                kt16_isums(&wt[0][0], scs, 16, 4, xq, xs, b, R, is, dots);
            }
            for (int r = 0; r < R; ++r) {
                const xqk_t *x = (const xqk_t *)(xq + r * xs) + b;
                const __m512i off = kt16_pair_dots(scp, 8, (const i32u *)x->bs16);
                kt16_fma(acc[r], dw, x->d, _mm512_sub_epi32(is[r], _mm512_slli_epi32(off, 5)));
            }
        }
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < nc; ++c) y[(c0 + c) * R + r] = acc[r][c];
    }
}

#define Q4_K_T5(r) qk45_cols_avx512(w, ws, C, xq, xs, nb, y, r, 0)
#define Q5_K_T5(r) qk45_cols_avx512(w, ws, C, xq, xs, nb, y, r, 1)
#define Q6_K_T5(r) q6k_cols_avx512(w, ws, C, xq, xs, nb, y, r)
/* COL_TILE, with tiles of KT16_MIN_ROWS rows and more through the transposed tiles */
#define T16_TILE(name, hbit, call)                                                           \
    static void name(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,     \
                     int64_t nb, int R, float *y) {                                          \
        if (R >= KT16_MIN_ROWS)                                                              \
            qk45_t16_avx512(w, ws, C, xq, xs, nb, R, y, hbit, 0, NULL);                      \
        else {                                                                               \
            BY_ROWS_ONCE(call)                                                               \
        }                                                                                    \
    }
T16_TILE(q4_k_avx512, 0, Q4_K_T5)
T16_TILE(q5_k_avx512, 1, Q5_K_T5)
/* Q4_K and Q5_K packed at load: the transposed tile from one row on (no transposes left to
 * share) */
static void q4_k_p16_avx512(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                            int64_t nb, int R, float *y) {
    qk45_t16_avx512(w, ws, C, xq, xs, nb, R, y, 0, 1, NULL);
}
static void q5_k_p16_avx512(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                            int64_t nb, int R, float *y) {
    qk45_t16_avx512(w, ws, C, xq, xs, nb, R, y, 1, 1, NULL);
}
static void q6_k_p16_avx512(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                            int64_t nb, int R, float *y) {
    q6_k_p16_t16(w, ws, C, xq, xs, nb, R, y, NULL);
}
COL_TILE(q6_k_avx512, Q6_K_T5)

/* the tiles with their integer dots from AMX tiles (or their emulation): the packed tiles
 * of Q4_0 .. Q8_0 and of the K-quants */
typedef void (*amx_tile_fn)(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                            int64_t nb, int R, float *y, dots_fn dots);
#define Q32_AMX(name, type)                                                                  \
    static void name(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,     \
                     int64_t nb, int R, float *y, dots_fn dots) {                            \
        q32p_amx(w, ws, C, xq, xs, nb, R, y, dots, type);                                    \
    }
Q32_AMX(q4_0_amx, 0)
Q32_AMX(q8_0_amx, 1)
Q32_AMX(q4_1_amx, 2)
Q32_AMX(q5_0_amx, 3)
Q32_AMX(q5_1_amx, 4)
static void q4_k_amx(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                     int64_t nb, int R, float *y, dots_fn dots) {
    qk45_t16_avx512(w, ws, C, xq, xs, nb, R, y, 0, 1, dots);
}
static void q5_k_amx(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                     int64_t nb, int R, float *y, dots_fn dots) {
    qk45_t16_avx512(w, ws, C, xq, xs, nb, R, y, 1, 1, dots);
}
static void q6_k_amx(const uint8_t *w, int64_t ws, int C, const uint8_t *xq, int64_t xs,
                     int64_t nb, int R, float *y, dots_fn dots) {
    q6_k_p16_t16(w, ws, C, xq, xs, nb, R, y, dots);
}
#endif
#endif

/* ---- drivers ------------------------------------------------------------------------- */

typedef struct {
    int block, bytes, kquant; /* values and bytes per weight block; Q8_K activations */
    tile_fn ref, fast;
    int t16; /* the fast tile takes KT16_ROWS rows at a time from KT16_MIN_ROWS rows on */
    tile_fn p16; /* the tile over rs_quant_pack16's layout, where this build has one */
#if RS_Q_AVX512
    /* the AVX-512 tile this type runs by default (over the packed layout where p16 is set,
     * else over the rows) with its integer dots from AMX tiles */
    amx_tile_fn amx;
#endif
} qtype_t;

static int qtype_info(int t, qtype_t *q) {
    switch (t) {
#if RS_Q_AVX2
#define FAST(f) f
#else
#define FAST(f) NULL
#endif
#if RS_Q_AVX512
#define FAST512(f) f##512
#define P16(t) t##_p16_avx512, t##_amx
#define P16K(t) t##_p16_avx512, t##_amx
#define P16K6(t) t##_p16_avx512, t##_amx
#else
#define FAST512(f) FAST(f##2)
#define P16(t) FAST(t##_p16_avx2)
#define P16K(t) FAST(t##_p16_avx2) /* Q4_K's and Q5_K's; Q6_K stays rows on AVX2 */
#define P16K6(t) NULL
#endif
    case T_Q4_0: *q = (qtype_t){32, 18, 0, q4_0_ref, FAST512(q4_0_avx), 0, P16(q4_0)}; return 0;
    case T_Q4_1: *q = (qtype_t){32, 20, 0, q4_1_ref, FAST512(q4_1_avx), 0, P16(q4_1)}; return 0;
    case T_Q5_0: *q = (qtype_t){32, 22, 0, q5_0_ref, FAST512(q5_0_avx), 0, P16(q5_0)}; return 0;
    case T_Q5_1: *q = (qtype_t){32, 24, 0, q5_1_ref, FAST512(q5_1_avx), 0, P16(q5_1)}; return 0;
    case T_Q8_0: *q = (qtype_t){32, 34, 0, q8_0_ref, FAST512(q8_0_avx), 0, P16(q8_0)}; return 0;
    case T_Q4_K: *q = (qtype_t){256, 144, 1, q4_k_ref, FAST512(q4_k_avx), RS_Q_AVX512, P16K(q4_k)}; return 0;
    case T_Q5_K: *q = (qtype_t){256, 176, 1, q5_k_ref, FAST512(q5_k_avx), RS_Q_AVX512, P16K(q5_k)}; return 0;
    case T_Q6_K: *q = (qtype_t){256, 210, 1, q6_k_ref, FAST512(q6_k_avx), 0, P16K6(q6_k)}; return 0;
#undef FAST
#undef FAST512
#undef P16
#undef P16K
#undef P16K6
    default: return 1;
    }
}

/* which tile code this build runs by default: 2 AVX-512 VNNI, 1 AVX2 (+FMA, F16C), 0
 * portable C */
int rs_quant_isa(void) { return RS_Q_AVX512 ? 2 : RS_Q_AVX2; }

#if RS_Q_AMX
static int amxq_state = -1; /* -1 not probed, 0 no, 1 yes */
#endif

/* 1 where rs_quant_linear takes its integer dot products from AMX tiles (amxq_probe), else
 * 0 */
int rs_quant_amx(void) {
#if RS_Q_AMX
    if (amxq_state < 0) amxq_state = amxq_probe();
    return amxq_state;
#else
    return 0;
#endif
}

/* ---- the 16-row packed layout (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K on AVX2 and AVX-512
 * builds; Q6_K on AVX-512) -----------------------------------------------------------------------
 * Rows in groups of 16 (the last padded with zero rows), each group's blocks back to back;
 * a group's block b is 16 * bytes-per-block bytes: first the values, QS / 4 vectors of 64
 * bytes where vector q holds at bytes 4c..4c+3 row c's quant bytes 4q..4q+3 (QS = 16 for the
 * 4- and 5-bit types, 32 for Q8_0, whose int8 values are stored + 128, as the tile uses them;
 * 128 for Q4_K's and Q5_K's qs, 208 for Q6_K's ql, qh and int8 scales), then (Q5) the 16
 * rows' qh words as one such vector, their bits reordered (q5_qh_order), or (Q4_K, Q5_K) the
 * 12 scale bytes as 3 such vectors and (Q5_K) its 32 qh bytes as 8 more, then the 16 rows'
 * fp16 scales, then Q4_1/Q5_1's 16 fp16 mins (Q4_K's and Q5_K's dmin). Same bytes per group
 * as the rows. */
#define RS_PACK16 0x100 /* a weight type's flag: W is in this layout */
/* rs_quant_linear hands each tile whole 16-row groups: its groups of rows start at multiples
 * of JB_ROUND */
_Static_assert(JB_ROUND % 16 == 0, "the packed layout needs weight groups of 16-row multiples");

/* where a type's row bytes go in its packed block: qs bytes (from row byte qo; Q4_K's and
 * Q5_K's 12 scale bytes from byte 4, Q5_K's qh from byte 16; Q5's qh word from qo - 4) become qs / 4 dword vectors, then the
 * fp16 fields (the scale, with ms the min) from row byte fo */
typedef struct {
    int qs, bb, qo, fo, ms, kq, q5;
    uint32_t shift; /* xor-ed into each dword (Q8_0's int8 values stored + 128) */
} pack16_t;

static int pack16_info(int wtype, pack16_t *f) {
    const int kq = wtype == T_Q4_K || wtype == T_Q5_K, q5 = wtype == T_Q5_0 || wtype == T_Q5_1;
    *f = (pack16_t){0, 0, 0, 0, wtype == T_Q4_1 || wtype == T_Q5_1 || kq, kq, q5,
                    wtype == T_Q8_0 ? 0x80808080u : 0};
    switch (wtype) {
    case T_Q6_K: /* ql, qh and the 16 int8 scales: every byte but the fp16 d, kept last */
        f->qs = 208, f->bb = 210, f->qo = 0, f->fo = 208;
        return 0;
    case T_Q4_K: /* its 12 scale bytes ride along as 3 more dword vectors */
        f->qs = 128 + 12, f->bb = 144, f->qo = 16;
        return 0;
    case T_Q5_K: /* the 12 scale bytes as Q4_K's, then the 32 qh bytes as 8 more vectors */
        f->qs = 128 + 12 + 32, f->bb = 176, f->qo = 48;
        return 0;
    case T_Q5_0:
    case T_Q5_1: /* the qh word rides along as one more vector */
        f->qs = 16 + 4, f->bb = wtype == T_Q5_0 ? 22 : 24, f->qo = f->bb - 16;
        return 0;
    case T_Q4_0:
    case T_Q4_1:
    case T_Q8_0:
        f->qs = wtype == T_Q8_0 ? 32 : 16;
        f->bb = wtype == T_Q4_0 ? 18 : wtype == T_Q4_1 ? 20 : 34;
        f->qo = f->bb - f->qs;
        return 0;
    default: return 1;
    }
}

/* a Q5 block's qh word (bit e: value e's fifth bit) in the packed layout's order, byte m bit
 * j: value 4j + m, so that the tile's vector j of values takes its fifth bits with one shift
 * (q5p_bits_*); inv 1 the inverse */
static uint32_t q5_qh_order(uint32_t v, int inv) {
    uint32_t o = 0;
    for (int e = 0; e < 32; ++e) {
        const int p = 8 * (e % 4) + e / 4;
        o |= ((v >> (inv ? p : e)) & 1u) << (inv ? e : p);
    }
    return o;
}

/* the row block's byte of packed dword vector q */
static inline int pack16_row_offset(const pack16_t *f, int q) {
    if (f->kq && q >= 35) return 16 + 4 * (q - 35); /* Q5_K's qh */
    return f->kq && q >= 32 ? 4 + 4 * (q - 32) : f->q5 && q == 4 ? f->qo - 4 : f->qo + 4 * q;
}

/* row c's block between a group's packed block p and the row's block: dir 0 into p, 1 out */
static void pack16_move(const pack16_t *f, uint8_t *p, int c, uint8_t *row, int dir) {
    for (int q = 0; q < f->qs / 4; ++q) {
        const int qh = f->q5 && q == 4;
        const int ro = pack16_row_offset(f, q);
        uint8_t *packed = p + 64 * q + 4 * c, *rows = row + ro;
        uint32_t v;
        memcpy(&v, dir ? packed : rows, 4);
        v = qh ? q5_qh_order(v, dir) : v ^ f->shift;
        memcpy(dir ? rows : packed, &v, 4);
    }
    for (int h = 0; h < 1 + f->ms; ++h) /* the scale, then the min */
        memcpy(dir ? row + f->fo + 2 * h : p + 16 * f->qs + 32 * h + 2 * c,
               dir ? p + 16 * f->qs + 32 * h + 2 * c : row + f->fo + 2 * h, 2);
}

/* pack16_move into p for nr rows of one group's block (row c's block at w + c * ws), a value
 * dword at a time across the rows: the same bytes, without pack16_move's per-dword offset
 * branches (it packed a 7B Q4_K_M's weights at 2.2-3.3 GB/s, most of a 5 s load step) */
static void pack16_block(const pack16_t *f, uint8_t *p, const uint8_t *w, int64_t ws, int nr) {
    for (int q = 0; q < f->qs / 4; ++q) {
        const int qh = f->q5 && q == 4;
        const uint8_t *src = w + pack16_row_offset(f, q);
        uint8_t *dst = p + 64 * q;
        for (int c = 0; c < nr; ++c) {
            uint32_t v;
            memcpy(&v, src + c * ws, 4);
            v = qh ? q5_qh_order(v, 0) : v ^ f->shift;
            memcpy(dst + 4 * c, &v, 4);
        }
    }
    for (int h = 0; h < 1 + f->ms; ++h)
        for (int c = 0; c < nr; ++c)
            memcpy(p + 16 * f->qs + 32 * h + 2 * c, w + c * ws + f->fo + 2 * h, 2);
}

/* whether this build runs W in the packed layout for wtype (rs_quant_linear's RS_PACK16) */
int rs_quant_has_pack16(int wtype) {
    qtype_t qt;
    return !qtype_info(wtype, &qt) && qt.p16 != NULL;
}

/* out (ceil(N / 16) * 16 rows' bytes) = W's N rows (nb blocks each) in the packed layout;
 * dir 1 the inverse (out: the N rows from the packed `w`). Groups split over num_threads.
 * Returns 1 for another type. */
int rs_quant_pack16(int wtype, const uint8_t *w, int64_t N, int64_t nb, uint8_t *out, int dir,
                    int num_threads) {
    pack16_t f;
    if (pack16_info(wtype, &f) || N < 0 || nb < 0) return 1;
    const int64_t ws = nb * f.bb, groups = (N + 15) / 16;
#pragma omp parallel for num_threads(num_threads > 0 ? num_threads : 1) schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        uint8_t *grp = (uint8_t *)(dir ? w : out) + g * 16 * ws;
        const int nr = N - g * 16 < 16 ? (int)(N - g * 16) : 16;
        if (dir == 0) {
            /* 16 rows fill every byte of a block; a last group's absent rows are zeros */
            if (nr < 16) memset(grp, 0, (size_t)(16 * ws));
            for (int64_t b = 0; b < nb; ++b)
                pack16_block(&f, grp + b * 16 * f.bb, w + g * 16 * ws + b * f.bb, ws, nr);
            continue;
        }
        for (int64_t b = 0; b < nb; ++b)
            for (int c = 0; c < 16 && g * 16 + c < N; ++c)
                pack16_move(&f, grp + b * 16 * f.bb, c,
                            (uint8_t *)(dir ? out : w) + (g * 16 + c) * ws + b * f.bb, dir);
    }
    return 0;
}

/* y[M, N] (row stride ldo, elements) = x[M, K] @ W^T, W = N rows of K / block blocks, or
 * (wtype | RS_PACK16) rs_quant_pack16's layout of them. xdt/odt: 0 float32, 1 bfloat16.
 * flags bit 0: use the portable tiles (tests; not for packed W); bit 1: no AMX tiles; bit 2:
 * the AMX tiles' loops on their scalar emulation, at every row count (tests, any AVX-512
 * build; 1 where the chosen tile has no AMX variant: the portable tiles, or a packable type
 * given as rows). Where rs_quant_amx, tiles of AMXQ_MIN_ROWS rows and more take their
 * integer dots from AMX tiles: the same integers, so the same bits. */
int rs_quant_linear(int wtype, const uint8_t *w, int64_t N, int64_t K, int xdt, const void *x,
                    int64_t M, int odt, void *out, int64_t ldo, int flags, int num_threads) {
    qtype_t qt;
    const int packed = (wtype & RS_PACK16) != 0;
    wtype &= ~RS_PACK16;
    if (qtype_info(wtype, &qt) || K <= 0 || K % qt.block || N < 0 || M < 0 || ldo < N
        || (unsigned)xdt > 1 || (unsigned)odt > 1 || (packed && (!qt.p16 || (flags & 1))))
        return 1;
    if (M == 0 || N == 0) return 0;
    const tile_fn tile = packed ? qt.p16 : (flags & 1) || !qt.fast ? qt.ref : qt.fast;
#if RS_Q_AVX512
    /* the AMX variant of the tile chosen above, if any */
    const amx_tile_fn amxt = qt.amx && tile != qt.ref && packed == (qt.p16 != NULL) ? qt.amx : NULL;
    const int emulate = (flags & 4) != 0;
    if (emulate && !amxt) return 1; /* no AMX variant of this tile to emulate */
    dots_fn dots = NULL;
    if (amxt && emulate)
        dots = amxq_dots_emu;
#if RS_Q_AMX
    else if (amxt && !(flags & 2) && M >= AMXQ_MIN_ROWS && rs_quant_amx())
        dots = amxq_dots_hw;
#endif
#else
    if (flags & 4) return 1;
#endif
    /* rows per tile (any count gives the same bits): the column tiles keep one row's sums
     * in registers at a time */
    int tm = TILE_MK;
    if ((tile == qt.fast && qt.t16 && M >= KT16_MIN_ROWS) || (packed && qt.kquant))
        tm = M >= KT16_MIN_ROWS ? KT16_ROWS : TILE_MK;
    const int64_t nb = K / qt.block, row_bytes = nb * qt.bytes;
    const int64_t xs = qt.kquant ? nb * (int64_t)sizeof(xqk_t) : (nb + 3) / 4 * (int64_t)sizeof(xq32_t);
    /* rows padded to a multiple of 16 with zeros: an AMX A tile reads 16 rows */
    const int64_t Mp = (M + 15) / 16 * 16;
    uint8_t *xq = aligned_alloc(64, (size_t)((Mp * xs + 63) / 64 * 64));
    if (!xq) return 3;
    memset(xq + M * xs, 0, (size_t)((Mp - M) * xs));
    const int nt = num_threads > 0 ? num_threads : 1;
#pragma omp parallel for num_threads(nt) if (M * K >= 65536) schedule(static)
    for (int64_t i = 0; i < M; ++i) {
        if (qt.kquant)
            quantize_row_k(xdt, x, i * K, nb, (xqk_t *)(xq + i * xs));
        else
            quantize_row_32(xdt, x, i * K, nb, (xq32_t *)(xq + i * xs));
    }
    /* groups of weight rows (~64 KiB) stay in L2 while every tile of activation rows passes;
     * a multiple of 16 rows: the tiles take 8 or 16 outputs at a time, and at K = 18944 64 KiB
     * made groups of 8 Q4_K rows (half of each transposed tile idle) or 4 Q8_0 rows (three
     * quarters). As many groups as a multiple of the threads, so the static schedule gives
     * each thread the same rows: at 2 threads an N = 576 projection had made 3 groups of 192,
     * one thread's share twice the other's (Q4_1 [576, 576] 1 / 5 / 64 rows 9.7 / 15.6 /
     * 135.6 -> 8.5 / 14.0 / 114.6 us; [960, 576] 256 rows 731 -> 636 us, avx512_bf16 VM) */
    int64_t jb = (64 * 1024) / row_bytes;
    if (jb < 1) jb = 1;
    if (jb > 256) jb = 256;
    int64_t ng = (N + jb - 1) / jb;
    ng = (ng + nt - 1) / nt * nt;
    jb = (N + ng - 1) / ng;
    jb = (jb + JB_ROUND - 1) / JB_ROUND * JB_ROUND;
    if (jb > 256) jb = 256;
    const int64_t groups = (N + jb - 1) / jb;
    /* activation rows per pass over the groups: ~1 MiB of quantized rows (whole tiles), so a
     * pass's rows stay in L2 while every group of the thread's share runs over them; a pass
     * over all M rows re-read them from L3 for every group (Qwen2.5-7B's down projection
     * [3584, 18944] in Q4_K, 1,024 rows: 22 MiB per group of 16) */
    int64_t mc = (int64_t)QMC_BYTES / xs / tm * tm;
    if (mc < tm) mc = tm;
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
        const int64_t m1 = m0 + mc < M ? m0 + mc : M;
#pragma omp parallel num_threads(nt) if (N * row_bytes * (M < 4 ? M : 4) >= 65536)
        {
#if RS_Q_AMX
        /* the tile configuration is per thread */
        if (dots == amxq_dots_hw) amxq_config();
#endif
#pragma omp for schedule(static)
        for (int64_t gi = 0; gi < groups; ++gi) {
            const int64_t j0 = gi * jb, j1 = j0 + jb < N ? j0 + jb : N;
            for (int64_t i0 = m0; i0 < m1; i0 += tm) {
                const int R = (int)(m1 - i0 < tm ? m1 - i0 : tm);
                /* the whole group in one call: y[c * R + r] */
                const int C = (int)(j1 - j0);
                float y[256 * Y_ROWS];
#if RS_Q_AVX512
                if (dots && (emulate || R >= AMXQ_MIN_ROWS))
                    amxt(w + j0 * row_bytes, row_bytes, C, xq + i0 * xs, xs, nb, R, y, dots);
                else
#endif
                    tile(w + j0 * row_bytes, row_bytes, C, xq + i0 * xs, xs, nb, R, y);
                for (int r = 0; r < R; ++r) {
                    const int64_t o = (i0 + r) * ldo + j0;
                    if (odt == 0)
                        for (int c = 0; c < C; ++c) ((float *)out)[o + c] = y[c * R + r];
                    else
                        for (int c = 0; c < C; ++c)
                            ((uint16_t *)out)[o + c] = f32_bf16(y[c * R + r]);
                }
            }
        }
#if RS_Q_AMX
        if (dots == amxq_dots_hw) amxq_release();
#endif
        }
    }
    free(xq);
    return 0;
}

/* one weight block as floats, with gguf-py's (numpy's) float32 arithmetic */
static void dequant_block(int t, const uint8_t *blk, float *v) {
    switch (t) {
    case T_Q4_0: {
        const float d = fp16_to_f32(blk);
        for (int i = 0; i < 16; ++i) {
            v[i] = d * (float)((blk[2 + i] & 15) - 8);
            v[i + 16] = d * (float)((blk[2 + i] >> 4) - 8);
        }
        break;
    }
    case T_Q4_1: {
        const float d = fp16_to_f32(blk), m = fp16_to_f32(blk + 2);
        for (int i = 0; i < 16; ++i) {
            v[i] = opaque(d * (float)(blk[4 + i] & 15)) + m;
            v[i + 16] = opaque(d * (float)(blk[4 + i] >> 4)) + m;
        }
        break;
    }
    case T_Q5_0:
    case T_Q5_1: {
        const int min = t == T_Q5_1, qo = min ? 8 : 6;
        const float d = fp16_to_f32(blk), m = min ? fp16_to_f32(blk + 2) : 0.0f;
        uint32_t qh;
        memcpy(&qh, blk + qo - 4, 4);
        for (int j = 0; j < 32; ++j) {
            const uint8_t byte = blk[qo + j % 16];
            const int q = (j < 16 ? byte & 15 : byte >> 4) | (int)((qh >> j) & 1u) << 4;
            /* gguf-py: d * (q - 16) for Q5_0; d * q + m, the product rounded first, for Q5_1 */
            v[j] = min ? opaque(d * (float)q) + m : d * (float)(q - 16);
        }
        break;
    }
    case T_Q8_0: {
        const float d = fp16_to_f32(blk);
        for (int i = 0; i < 32; ++i) v[i] = (float)(int8_t)blk[2 + i] * d;
        break;
    }
    case T_Q4_K:
    case T_Q5_K: {
        const int hbit = t == T_Q5_K;
        const float d = fp16_to_f32(blk), dmin = fp16_to_f32(blk + 2);
        const uint8_t *qh = blk + 16, *qs = blk + (hbit ? 48 : 16);
        uint8_t sc[8], mn[8];
        k4_scale_min(blk + 4, sc, mn);
        for (int s = 0; s < 8; ++s) {
            const float ds = d * (float)sc[s], dm = dmin * (float)mn[s];
            for (int e = 0; e < 32; ++e) {
                const uint8_t byte = qs[32 * (s / 2) + e];
                int q = (s & 1) ? byte >> 4 : byte & 15;
                if (hbit) q |= ((qh[e] >> s) & 1) << 4;
                v[32 * s + e] = opaque(ds * (float)q) - dm;
            }
        }
        break;
    }
    case T_Q6_K: {
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = fp16_to_f32(blk + 208);
        for (int g = 0; g < 8; ++g)
            for (int e = 0; e < 32; ++e) {
                const float ds = d * (float)sc[(32 * g + e) / 16];
                v[32 * g + e] = ds * (float)(q6_value(blk, g, e) - 32);
            }
        break;
    }
    }
}

/* out[T, K] (contiguous, odt 0 float32 / 1 bf16) = rows ids[T] of W [N, K], dequantized; W
 * rows as stored or (wtype | RS_PACK16) rs_quant_pack16's layout of them (a tied embedding
 * looked up in its LM head's packed blocks) */
int rs_quant_dequantize_rows(int wtype, const uint8_t *w, int64_t N, int64_t K,
                             const int64_t *ids, int64_t T, int odt, void *out,
                             int num_threads) {
    qtype_t qt;
    pack16_t f;
    const int packed = (wtype & RS_PACK16) != 0;
    wtype &= ~RS_PACK16;
    if (qtype_info(wtype, &qt) || K <= 0 || K % qt.block || N < 0 || T < 0 || (unsigned)odt > 1
        || (packed && pack16_info(wtype, &f)))
        return 1;
    for (int64_t t = 0; t < T; ++t)
        if (ids[t] < 0 || ids[t] >= N) return 2;
    const int64_t nb = K / qt.block, row_bytes = nb * qt.bytes;
    const int nt = num_threads > 0 ? num_threads : 1;
#pragma omp parallel for num_threads(nt) if (T * K >= 65536) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const uint8_t *row = w + ids[t] * row_bytes;
        float v[256];
        uint8_t blk[256];
        for (int64_t b = 0; b < nb; ++b) {
            if (packed) /* the row's block gathered from its group's packed block */
                pack16_move(&f, (uint8_t *)w + (ids[t] / 16 * 16 * nb + b * 16) * qt.bytes,
                            (int)(ids[t] % 16), blk, 1);
            dequant_block(wtype, packed ? blk : row + b * qt.bytes, v);
            const int64_t o = t * K + b * qt.block;
            if (odt == 0)
                memcpy((float *)out + o, v, sizeof(float) * (size_t)qt.block);
            else
                for (int i = 0; i < qt.block; ++i) ((uint16_t *)out)[o + i] = f32_bf16(v[i]);
        }
    }
    return 0;
}
