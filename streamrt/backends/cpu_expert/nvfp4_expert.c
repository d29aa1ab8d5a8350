/* One routed expert in NVFP4 on the host CPU: out = down(SiTU-GLU(gate z, up z)) for m rows.

   Weights are read where they lie (a file mapping or a pool buffer): packed E2M1 nibbles
   [out, in/2] (low nibble = even element), E4M3 scale bytes [out, in/16], fp32 global per row.
   No dequantised copy exists; each 16-element block is decoded in registers and used at once.

   Arithmetic (the same bits on every path, every tiling and every thread count): a weight row's
   dot with a row of x runs in 16 lanes, one element of each 16-block per lane (lane_of), each
   lane one chain of fused multiply-adds over the blocks in order (the weight e2m1 * e4m3 is
   exact in fp32, read from a 16-entry table per scale byte); the lanes are then added in a fixed
   tree (l + 8, l + 4, l + 2, l + 1) and the sum is multiplied by the row's global scale.
   AVX-512 holds the 16 lanes in one register, AVX2 in two, the portable path in an array. Build
   with -ffp-contract=off: no contraction the source does not spell out.

   Speed: a tile of weight rows (gate and up rows side by side) meets a tile of x rows, so each
   block is decoded once for all the tile's x rows and each x block loaded once for all its
   weight rows; the independent chains of the tile hide the multiply-add latency. The first pass
   over a weight tile prefetches the next tile's bytes, which also crosses the 4 KiB pages the
   hardware prefetcher stops at.

   Threads: OpenMP; the work is cut into groups of 16 output columns (a cache line of h or out,
   so no two threads write one line), each thread a contiguous run of them weighed by rows; one
   barrier between the gate/up pass and the down pass. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
#define SRT_PATH "avx512"
#define RT_MAX 5 /* x rows in a tile: their accumulators and x blocks stay in the 32 registers */
#define WT_FOR(rt) 4 /* weight rows in a tile; 8 spilled their pointers to the stack */
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SRT_PATH "avx2"
#define RT_MAX 2 /* 16 registers of 8 lanes: a tile's accumulators take two each */
#define WT_FOR(rt) ((rt) <= 1 ? 4 : 2)
#else
#define SRT_PATH "portable"
#define RT_MAX 4
#define WT_FOR(rt) ((rt) <= 2 ? 4 : 2)
#endif

#define BLOCK 16
#define GROUP 16              /* output columns a unit of work: one 64-byte line of fp32 */
#define MIN_WORK (1 << 20)    /* weight x row products per thread, at least */
#define PF_BLOCKS 8           /* blocks between prefetches of one weight row: 64 bytes of nibbles */

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
/* SCALED[s][c] = E2M1[c] * E4M3(s), exact in fp32: a block's 16 possible weights, one load per block */
static float SCALED[256][16] __attribute__((aligned(64)));

/* E4M3 (fn) byte -> float: bias 7, subnormals at exponent 0, 0x7F / 0xFF NaN, no Inf. */
__attribute__((constructor)) static void build_scaled(void) {
    for (int b = 0; b < 256; b++) {
        int e = (b >> 3) & 15, m = b & 7;
        float mag = e == 0 ? ldexpf((float)m, -9) : ldexpf(8.0f + m, e - 10);
        if (e == 15 && m == 7) mag = NAN;
        for (int c = 0; c < 16; c++) SCALED[b][c] = E2M1[c] * ((b & 0x80) ? -mag : mag);
    }
}

const char *srt_cpu_expert_path(void) { return SRT_PATH; }

/* Lane order: a block's 64-bit word of 16 nibbles is broadcast to every 64-bit lane and 64-bit lane k
   shifted right by 4k bits, so 32-bit lane 2k holds element k and lane 2k + 1 element k + 8 in its
   low nibble: no shuffle to unpack. x is stored in the same order (lane_of), once per call. */
static inline int64_t lane_of(int64_t e) {
    int64_t b = e & ~(int64_t)(BLOCK - 1), j = e & (BLOCK - 1);
    return b + (j < 8 ? 2 * j : 2 * (j - 8) + 1);
}

/* A vector of the 16 lanes of one block: one zmm, two ymm, or an array. */
#define INL static inline __attribute__((always_inline))
#if defined(__AVX512F__)
typedef __m512 v16;
INL v16 v_zero(void) { return _mm512_setzero_ps(); }
INL v16 v_load(const float *x) { return _mm512_loadu_ps(x); }
INL v16 v_fma(v16 w, v16 x, v16 acc) { return _mm512_fmadd_ps(w, x, acc); }
INL __m128 sum8(__m256 s8) { /* the tree from lanes l + 4 on, on 8 lanes already added to l + 8 */
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_add_ss(s2, _mm_movehdup_ps(s2));
}
INL float v_sum(v16 a) {
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    return _mm_cvtss_f32(sum8(_mm256_add_ps(_mm512_castps512_ps256(a), hi)));
}
INL v16 v_decode(const uint8_t *word, const float *lut) { /* vpermps reads the low 4 bits of each index */
    const __m512i shift = _mm512_set_epi64(28, 24, 20, 16, 12, 8, 4, 0);
    uint64_t q;
    memcpy(&q, word, 8);
    __m512i idx = _mm512_srlv_epi64(_mm512_set1_epi64((long long)q), shift);
    return _mm512_permutexvar_ps(idx, _mm512_load_ps(lut));
}
#elif defined(__AVX2__) && defined(__FMA__)
typedef struct { __m256 a, b; } v16;
INL v16 v_zero(void) { return (v16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
INL v16 v_load(const float *x) { return (v16){_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)}; }
INL v16 v_fma(v16 w, v16 x, v16 acc) { return (v16){_mm256_fmadd_ps(w.a, x.a, acc.a), _mm256_fmadd_ps(w.b, x.b, acc.b)}; }
INL float v_sum(v16 v) { /* the tree: l + 8, l + 4, l + 2, l + 1 */
    __m256 s8 = _mm256_add_ps(v.a, v.b);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
INL __m256 decode8(__m256i c, __m256 pos) { /* codes 0..7 by the low 3 bits; bit 3 flips the sign */
    __m256i sign = _mm256_and_si256(_mm256_slli_epi32(c, 28), _mm256_set1_epi32((int)0x80000000u));
    return _mm256_xor_ps(_mm256_permutevar8x32_ps(pos, c), _mm256_castsi256_ps(sign));
}
INL v16 v_decode(const uint8_t *word, const float *lut) {
    uint64_t w;
    memcpy(&w, word, 8);
    __m256i q = _mm256_set1_epi64x((long long)w);
    __m256 pos = _mm256_load_ps(lut);
    return (v16){decode8(_mm256_srlv_epi64(q, _mm256_set_epi64x(12, 8, 4, 0)), pos),
                 decode8(_mm256_srlv_epi64(q, _mm256_set_epi64x(28, 24, 20, 16)), pos)};
}
#else
typedef struct { float l[BLOCK]; } v16;
INL v16 v_zero(void) { v16 v; memset(&v, 0, sizeof v); return v; }
INL v16 v_load(const float *x) { v16 v; memcpy(v.l, x, sizeof v.l); return v; }
INL v16 v_fma(v16 w, v16 x, v16 acc) {
    for (int l = 0; l < BLOCK; l++) acc.l[l] = fmaf(w.l[l], x.l[l], acc.l[l]);
    return acc;
}
INL float v_sum(v16 v) { /* the tree: l + 8, l + 4, l + 2, l + 1 */
    for (int w = 8; w >= 1; w >>= 1)
        for (int l = 0; l < w; l++) v.l[l] += v.l[l + w];
    return v.l[0];
}
INL v16 v_decode(const uint8_t *word, const float *lut) { /* lane 2k: nibble k; lane 2k + 1: nibble k + 8 */
    uint64_t w;
    memcpy(&w, word, 8);
    v16 v;
    for (int k = 0; k < 8; k++) {
        v.l[2 * k] = lut[(w >> (4 * k)) & 15];
        v.l[2 * k + 1] = lut[(w >> (4 * k + 32)) & 15];
    }
    return v;
}
#endif

/* A tile's weight rows: nibbles and scale bytes of each, and how far ahead the bytes to
   prefetch lie (0: none; else the same row of the next tile, `pf` bytes of nibbles and `pfs`
   scale bytes on). */
typedef struct {
    const uint8_t *p[4], *s[4];
    ptrdiff_t pf, pfs;
} wtile;

/* One step of the tile: block b of every weight row against block b of every x row. */
#define SRT_BLOCK(b, WT, RT)                                                                                  \
    do {                                                                                                      \
        v16 xv[RT];                                                                                           \
        for (int r = 0; r < RT; r++) xv[r] = v_load(x + r * ldx + BLOCK * (b));                               \
        for (int w = 0; w < WT; w++) {                                                                        \
            v16 wv = v_decode(t->p[w] + 8 * (b), SCALED[t->s[w][b]]);                                         \
            for (int r = 0; r < RT; r++) acc[w][r] = v_fma(wv, xv[r], acc[w][r]);                             \
        }                                                                                                     \
    } while (0)

/* tile_WT_RT: sums[w * RT + r] = the dot of weight row w with x row r over nblk blocks (x in lane
   order, rows ldx apart), WT x RT chains over the blocks in order. WT and RT are constants in
   each copy, so the loops unroll and the accumulators live in registers. */
#define SRT_TILE(WT, RT)                                                                                      \
    static void tile_##WT##_##RT(const wtile *t, const float *x, int64_t ldx, int64_t nblk, float *sums) {    \
        v16 acc[WT][RT];                                                                                      \
        for (int w = 0; w < WT; w++)                                                                          \
            for (int r = 0; r < RT; r++) acc[w][r] = v_zero();                                                \
        int64_t b = 0;                                                                                        \
        for (; b + PF_BLOCKS <= nblk; b += PF_BLOCKS) {                                                       \
            if (t->pf)                                                                                        \
                for (int w = 0; w < WT; w++) {                                                                \
                    __builtin_prefetch(t->p[w] + 8 * b + t->pf, 0, 3);                                        \
                    if (b % 64 == 0) __builtin_prefetch(t->s[w] + b + t->pfs, 0, 3);                          \
                }                                                                                             \
            for (int k = 0; k < PF_BLOCKS; k++) SRT_BLOCK(b + k, WT, RT);                                     \
        }                                                                                                     \
        for (; b < nblk; b++) SRT_BLOCK(b, WT, RT);                                                           \
        for (int w = 0; w < WT; w++)                                                                          \
            for (int r = 0; r < RT; r++) sums[w * RT + r] = v_sum(acc[w][r]);                                 \
    }
/* One copy per (weight rows, x rows) a path uses. */
#if RT_MAX == 5
#define SRT_TILES(W) SRT_TILE(W, 1) SRT_TILE(W, 2) SRT_TILE(W, 3) SRT_TILE(W, 4) SRT_TILE(W, 5)
#else
#define SRT_TILES(W) SRT_TILE(W, 1) SRT_TILE(W, 2) SRT_TILE(W, 3) SRT_TILE(W, 4)
#endif
SRT_TILES(2)
SRT_TILES(4)
#undef SRT_BLOCK

typedef void (*tile_fn)(const wtile *, const float *, int64_t, int64_t, float *);

static tile_fn pick_tile(int wt, int rt) {
#if RT_MAX == 5
#define SRT_ROW(W) {tile_##W##_1, tile_##W##_2, tile_##W##_3, tile_##W##_4, tile_##W##_5}
#else
#define SRT_ROW(W) {tile_##W##_1, tile_##W##_2, tile_##W##_3, tile_##W##_4}
#endif
    static const tile_fn table[2][RT_MAX == 5 ? 5 : 4] = {SRT_ROW(2), SRT_ROW(4)};
    return table[wt == 4][rt - 1];
}

/* SiTU-GLU: beta tanh(g / beta) sigmoid(g) * (lin_beta tanh(u / lin_beta) or u); beta = inf: SiLU. */
static inline float situ_glu(float g, float u, float beta, float lin_beta) {
    float sig = 1.0f / (expf(-g) + 1.0f);
    float ga = isinf(beta) ? g * sig : beta * tanhf(g / beta) * sig;
    float ua = lin_beta > 0.0f ? lin_beta * tanhf(u / lin_beta) : u;
    return ga * ua;
}

/* One expert's work in a batch: its rows z [m, dl], scratch zl [m, dl] (z in lane order) and h [m, inter]
   (the GLU's output, lane order), out [m, dl]; gate / up [inter, dl] and down [dl, inter] as
   (packed, scales, global) each. */
typedef struct {
    const uint8_t *packed[3], *scales[3];
    const float *global[3];
    const float *z;
    float *zl, *h, *out;
    int64_t m;
} srt_expert_job;

/* The x rows of a job in tiles of at most RT_MAX, as even as they come; the weight tile suits the
   largest. */
static int row_tiles(int64_t m, int *wt) {
    int nt = (int)((m + RT_MAX - 1) / RT_MAX);
    *wt = WT_FOR((int)((m + nt - 1) / nt));
    return nt;
}

/* The rows of the next x tile: the rows left shared as evenly as the tiles left allow. */
static inline int64_t tile_rows(int64_t left, int64_t tiles_left) { return (left + tiles_left - 1) / tiles_left; }

/* Columns i0 .. i0 + GROUP - 1 of the gate/up pass: h[r][i] for every row r. Weight tiles hold
   gate and up rows in pairs. */
static void glu_group(const srt_expert_job *j, int64_t i0, int64_t dl, int64_t inter, float beta, float lin_beta) {
    const int64_t kb = dl / BLOCK, rowb = dl / 2;
    int wt, ntiles = row_tiles(j->m, &wt);
    const int pairs = wt / 2;
    float sums[4 * RT_MAX];
    for (int64_t i = i0; i < i0 + GROUP; i += pairs) {
        wtile t = {.pf = pairs * rowb, .pfs = pairs * kb};
        for (int q = 0; q < pairs; q++)
            for (int g = 0; g < 2; g++) {
                t.p[2 * q + g] = j->packed[g] + (i + q) * rowb;
                t.s[2 * q + g] = j->scales[g] + (i + q) * kb;
            }
        for (int64_t tile = 0, r0 = 0; tile < ntiles; tile++) {
            int64_t rt = tile_rows(j->m - r0, ntiles - tile);
            pick_tile(wt, (int)rt)(&t, j->zl + r0 * dl, dl, kb, sums);
            t.pf = t.pfs = 0; /* the first pass fetched them */
            for (int q = 0; q < pairs; q++)
                for (int64_t r = 0; r < rt; r++)
                    j->h[(r0 + r) * inter + lane_of(i + q)] =
                        situ_glu(sums[2 * q * rt + r] * j->global[0][i + q],
                                 sums[(2 * q + 1) * rt + r] * j->global[1][i + q], beta, lin_beta);
            r0 += rt;
        }
    }
}

/* Rows d0 .. d0 + GROUP - 1 of the down pass: out[r][d] for every row r. */
static void down_group(const srt_expert_job *j, int64_t d0, int64_t dl, int64_t inter) {
    const int64_t kb = inter / BLOCK, rowb = inter / 2;
    int wt, ntiles = row_tiles(j->m, &wt);
    float sums[4 * RT_MAX];
    for (int64_t d = d0; d < d0 + GROUP; d += wt) {
        wtile t = {.pf = wt * rowb, .pfs = wt * kb};
        for (int w = 0; w < wt; w++) {
            t.p[w] = j->packed[2] + (d + w) * rowb;
            t.s[w] = j->scales[2] + (d + w) * kb;
        }
        for (int64_t tile = 0, r0 = 0; tile < ntiles; tile++) {
            int64_t rt = tile_rows(j->m - r0, ntiles - tile);
            pick_tile(wt, (int)rt)(&t, j->h + r0 * inter, inter, kb, sums);
            t.pf = t.pfs = 0;
            for (int w = 0; w < wt; w++)
                for (int64_t r = 0; r < rt; r++)
                    j->out[(r0 + r) * dl + d + w] = sums[w * rt + r] * j->global[2][d + w];
            r0 += rt;
        }
    }
}

/* A group's cost: its bytes (worth two rows of multiply-adds) and its rows; none without rows. */
static inline int64_t unit_weight(int64_t m) { return m > 0 ? 2 + m : 0; }

/* The groups of one pass (`per` groups an expert) a thread takes: a contiguous run, the runs
   weighed by the experts' rows plus a share for reading the bytes, so threads finish together. */
static void thread_run(const srt_expert_job *jobs, int64_t n, int64_t per, int tid, int nt, int64_t *lo, int64_t *hi) {
    int64_t total = 0;
    for (int64_t k = 0; k < n; k++) total += per * unit_weight(jobs[k].m);
    int64_t from = total * tid / nt, to = total * (tid + 1) / nt, at = 0;
    *lo = *hi = n * per;
    for (int64_t k = 0; k < n; k++) {
        int64_t w = unit_weight(jobs[k].m);
        for (int64_t g = 0; g < per; g++, at += w) {
            if (at >= from && *lo == n * per) *lo = k * per + g;
            if (at >= to) { *hi = k * per + g; return; }
        }
    }
}

/* A job's x rows in lane order (lane_of), once per call. */
static void z_to_lanes(const srt_expert_job *j, int64_t dl) {
    for (int64_t r = 0; r < j->m; r++)
        for (int64_t e = 0; e < dl; e++) j->zl[r * dl + lane_of(e)] = j->z[r * dl + e];
}

/* n experts of one layer (same dl, inter) in one parallel region: the team forks once per call and
   meets at one barrier between the passes. lin_beta <= 0: no clamp on up. threads <= 0: the OpenMP
   default. An output element's bits do not depend on the batch, its order or the threads. Returns 0. */
int srt_cpu_experts_ffn(const srt_expert_job *jobs, int64_t n, int64_t dl, int64_t inter, float beta, float lin_beta,
                        int threads) {
    int64_t rows = 0;
    for (int64_t k = 0; k < n; k++) {
        rows += jobs[k].m;
        z_to_lanes(jobs + k, dl);
    }
#ifdef _OPENMP
    /* a thread per MIN_WORK products at most: a small batch is not worth waking a team for */
    int64_t cap = 3 * dl * inter * rows / MIN_WORK;
    int nt = threads > 0 ? threads : omp_get_max_threads();
    if (nt > cap) nt = cap > 1 ? (int)cap : 1;
#pragma omp parallel num_threads(nt)
#endif
    {
        int tid = 0, team = 1;
#ifdef _OPENMP
        tid = omp_get_thread_num();
        team = omp_get_num_threads();
#endif
        int64_t lo, hi, per = inter / GROUP;
        thread_run(jobs, n, per, tid, team, &lo, &hi);
        for (int64_t u = lo; u < hi; u++)
            if (jobs[u / per].m > 0) glu_group(jobs + u / per, (u % per) * GROUP, dl, inter, beta, lin_beta);
#ifdef _OPENMP
#pragma omp barrier
#endif
        per = dl / GROUP;
        thread_run(jobs, n, per, tid, team, &lo, &hi);
        for (int64_t u = lo; u < hi; u++)
            if (jobs[u / per].m > 0) down_group(jobs + u / per, (u % per) * GROUP, dl, inter);
    }
    (void)threads;
    return 0;
}
