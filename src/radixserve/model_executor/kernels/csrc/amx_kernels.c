/* radixserve's bfloat16 GEMM on Intel AMX: y[M, N] = x[M, K] @ W[N, K]^T, float32 sums,
 * bfloat16 out, with one reduction order per output for every M (one row included), every
 * tile position and every thread split. So a row's bits never depend on the batch: decode rows,
 * speculative verify rows and prefill rows agree. oneDNN's AMX GEMM does not promise that (it
 * picks its K blocking by M: other bits from M = 2 or 33 rows up, measured on the AMX kind).
 *
 * Layout (written once at load by rs_amx_pack_bf16): W padded to Np = N rounded up to 64 and
 * Kp = K rounded up to 32 with zeros, stored as panels of 64 outputs; a panel holds, per block
 * of 32 K values, four B tiles of 16 outputs each in AMX's pair-interleaved ("VNNI") form:
 * tile row r, column c holds W[n0 + c][k0 + 2r] and W[n0 + c][k0 + 2r + 1]:
 *   packed[((panel * KB + kb) * 4 + nt) * 512 + r * 32 + c * 2 + j]
 * Per output the sum runs over the K blocks in order, one TDPBF16PS each (16 pairs, the
 * instruction's own fixed order), in a float32 tile accumulator.
 *
 * The tile instructions need the process to have asked Linux for the tile state first
 * (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); rs_amx_available does. Where the CPU
 * lacks AMX, or flags bit 0 asks for it (tests), the same loops run on a scalar emulation of the
 * tile instructions (Intel's pseudo-code for TDPBF16PS: per pair, two float32 products added in
 * order), which checks the layout and the blocking on any CPU; its bits are the emulation's,
 * not the hardware's. The functions with tile instructions carry a target attribute, so the
 * library builds with -march=native on every kind. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__x86_64__) && defined(__GNUC__) && __GNUC__ >= 11
#define RS_AMX_BUILD 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define RS_AMX_BUILD 0
#endif

#define AMX_TK 32   /* K values per tile (16 pairs) */
#define AMX_TN 16   /* outputs per B tile */
#define AMX_TM 16   /* rows per A tile */
#define AMX_NT 4    /* B tiles per panel: 64 outputs */
#define AMX_PANEL (AMX_TN * AMX_NT)
#define AMX_TILE_ELEMS (AMX_TK / 2 * AMX_TN * 2) /* 512 bf16, 1 KiB */

static inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

static inline float bf16_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* bytes of W's packed form */
int64_t rs_amx_packed_bytes(int64_t N, int64_t K) {
    return round_up(N, AMX_PANEL) * round_up(K, AMX_TK) * 2;
}

/* W [N, K] bf16 (row stride K) into the packed layout above; out holds rs_amx_packed_bytes */
int rs_amx_pack_bf16(const uint16_t *w, int64_t N, int64_t K, uint16_t *out) {
    if (N <= 0 || K <= 0) return 1;
    const int64_t Np = round_up(N, AMX_PANEL), Kp = round_up(K, AMX_TK), KB = Kp / AMX_TK;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < Np; ++n) {
        const int64_t panel = n / AMX_PANEL, nt = (n % AMX_PANEL) / AMX_TN, c = n % AMX_TN;
        for (int64_t k = 0; k < Kp; ++k) {
            const int64_t kb = k / AMX_TK, r = (k % AMX_TK) / 2, j = k % 2;
            out[((panel * KB + kb) * AMX_NT + nt) * AMX_TILE_ELEMS + r * 32 + c * 2 + j] =
                n < N && k < K ? w[n * K + k] : 0;
        }
    }
    return 0;
}

/* ---- the tile instructions' scalar emulation (the same data layout and order) ---- */
/* c[16][16] += a rows (16 x 32 bf16, row stride lda elements) . b tile (16 x 32, VNNI) */
static void emu_dpbf16(float *c, const uint16_t *a, int64_t lda, const uint16_t *b) {
    for (int m = 0; m < AMX_TM; ++m)
        for (int n = 0; n < AMX_TN; ++n) {
            float acc = c[m * AMX_TN + n];
            for (int k = 0; k < AMX_TK / 2; ++k) {
                acc += bf16_f32(a[m * lda + 2 * k]) * bf16_f32(b[k * 32 + 2 * n]);
                acc += bf16_f32(a[m * lda + 2 * k + 1]) * bf16_f32(b[k * 32 + 2 * n + 1]);
            }
            c[m * AMX_TN + n] = acc;
        }
}

/* ---- AMX ---- */
#if RS_AMX_BUILD
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;

static int amx_state = -1; /* -1 unknown, 0 no, 1 yes */

static int amx_probe(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const int tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
    if (!tile || !bf16) return 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

__attribute__((target("amx-tile,amx-bf16"))) static void amx_panel(
        const uint16_t *xa, int64_t Kp, const uint16_t *wp, int64_t KB, float *cbuf) {
    /* tiles 0-3: the panel's four 16 x 16 float32 accumulators; 4: A; 5: B */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < KB; ++kb) {
        const uint16_t *b = wp + kb * AMX_NT * AMX_TILE_ELEMS;
        _tile_loadd(4, xa + kb * AMX_TK, Kp * 2);
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, b + AMX_TILE_ELEMS, 64);
        _tile_dpbf16ps(1, 4, 5);
        _tile_loadd(5, b + 2 * AMX_TILE_ELEMS, 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(5, b + 3 * AMX_TILE_ELEMS, 64);
        _tile_dpbf16ps(3, 4, 5);
    }
    /* cbuf [16][64] float32: the four accumulators side by side */
    _tile_stored(0, cbuf, AMX_PANEL * 4);
    _tile_stored(1, cbuf + 16, AMX_PANEL * 4);
    _tile_stored(2, cbuf + 32, AMX_PANEL * 4);
    _tile_stored(3, cbuf + 48, AMX_PANEL * 4);
}

__attribute__((target("amx-tile"))) static void amx_config(void) {
    tile_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 6; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) static void amx_release(void) { _tile_release(); }
#else
static int amx_state = 0;
static int amx_probe(void) { return 0; }
#endif

/* 1 where the tile path runs here (CPU with AMX-TILE and AMX-BF16, Linux granted the tile
 * state, a build with the intrinsics), else 0 */
int rs_amx_available(void) {
    if (amx_state < 0) amx_state = amx_probe();
    return amx_state;
}

/* y [M, N] bf16 (row stride ldy) = x [M, K] bf16 (row stride K) @ W^T, W packed by
 * rs_amx_pack_bf16. flags bit 0: the scalar emulation even where AMX runs (tests).
 * Returns 0; 1 bad sizes; 3 out of memory. */
int rs_amx_linear_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *packed,
                       int64_t N, uint16_t *y, int64_t ldy, int flags, int num_threads) {
    if (M < 0 || N <= 0 || K <= 0 || ldy < N) return 1;
    if (M == 0) return 0;
    const int emulate = (flags & 1) || !rs_amx_available();
    const int64_t Kp = round_up(K, AMX_TK), KB = Kp / AMX_TK;
    const int64_t panels = round_up(N, AMX_PANEL) / AMX_PANEL, tiles = (M + AMX_TM - 1) / AMX_TM;
    /* the rows once, in 16-row tiles padded with zeros to Kp columns and 16 rows */
    uint16_t *xa = aligned_alloc(64, (size_t)(tiles * AMX_TM * Kp * 2 + 63) / 64 * 64);
    if (xa == NULL) return 3;
    for (int64_t m = 0; m < tiles * AMX_TM; ++m) {
        uint16_t *row = xa + m * Kp;
        if (m < M) {
            memcpy(row, x + m * K, (size_t)K * 2);
            memset(row + K, 0, (size_t)(Kp - K) * 2);
        } else {
            memset(row, 0, (size_t)Kp * 2);
        }
    }
    const int nt = num_threads > 0 ? num_threads : 1;
    const int64_t work = panels * tiles;
#pragma omp parallel num_threads(nt) if (work > 1)
    {
        float cbuf[AMX_TM * AMX_PANEL];
        const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
        const int64_t w0 = work * t / n, w1 = work * (t + 1) / n;
#if RS_AMX_BUILD
        if (!emulate && w1 > w0) amx_config();
#endif
        for (int64_t wi = w0; wi < w1; ++wi) {
            const int64_t panel = wi / tiles, tile = wi % tiles;
            const uint16_t *xt = xa + tile * AMX_TM * Kp;
            const uint16_t *wp = packed + panel * KB * AMX_NT * AMX_TILE_ELEMS;
#if RS_AMX_BUILD
            if (!emulate) {
                amx_panel(xt, Kp, wp, KB, cbuf);
            } else
#endif
            {
                float acc[AMX_NT][AMX_TM * AMX_TN];
                memset(acc, 0, sizeof acc);
                for (int64_t kb = 0; kb < KB; ++kb)
                    for (int u = 0; u < AMX_NT; ++u)
                        emu_dpbf16(acc[u], xt + kb * AMX_TK, Kp,
                                   wp + (kb * AMX_NT + u) * AMX_TILE_ELEMS);
                for (int m = 0; m < AMX_TM; ++m)
                    for (int u = 0; u < AMX_NT; ++u)
                        memcpy(cbuf + m * AMX_PANEL + u * AMX_TN, acc[u] + m * AMX_TN,
                               AMX_TN * sizeof(float));
            }
            const int64_t r1 = M - tile * AMX_TM < AMX_TM ? M - tile * AMX_TM : AMX_TM;
            const int64_t c0 = panel * AMX_PANEL, c1 = c0 + AMX_PANEL < N ? c0 + AMX_PANEL : N;
            for (int64_t r = 0; r < r1; ++r) {
                uint16_t *yr = y + (tile * AMX_TM + r) * ldy;
                for (int64_t col = c0; col < c1; ++col)
                    yr[col] = f32_bf16_rne(cbuf[r * AMX_PANEL + col - c0]);
            }
        }
#if RS_AMX_BUILD
        if (!emulate && w1 > w0) amx_release();
#endif
    }
    free(xa);
    return 0;
}
