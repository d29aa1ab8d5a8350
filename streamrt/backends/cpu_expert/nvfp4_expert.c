/* One routed expert in NVFP4 on the host CPU: out = down(SiTU-GLU(gate z, up z)) for m rows.

   Weights are read where they lie (a file mapping or a pool buffer): packed E2M1 nibbles
   [out, in/2] (low nibble = even element), E4M3 scale bytes [out, in/16], fp32 global per row.
   No dequantised copy exists; each 16-element block is decoded in registers and used at once.

   Arithmetic (the same bits on every path and every thread count): a weight row's dot with a
   row of x runs in 16 lanes, one element of each 16-block per lane (lane_of) with one fused
   multiply-add each (the weight e2m1 * e4m3 is exact in fp32, read from a 16-entry table per
   scale byte), block b into accumulator b % 4; the four accumulators are added (0 + 1) + (2 + 3),
   the lanes in a fixed tree (l + 8, l + 4, l + 2, l + 1), and the sum is multiplied by the row's
   global scale.
   AVX-512 holds the 16 lanes in one register, AVX2 in two, the portable path in an array; an
   output element is computed by one thread, so the thread count changes nothing either.
   Build with -ffp-contract=off: no contraction the source does not spell out.

   Threads: OpenMP over output rows (the gate/up rows, then the down rows). */

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
#define SRT_PATH "avx512"
#define MAX_ROWS 4 /* rows per pass over a weight row: their accumulators stay in registers */
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SRT_PATH "avx2"
#define MAX_ROWS 2
#else
#define SRT_PATH "portable"
#define MAX_ROWS 4
#endif

#define BLOCK 16
#define MIN_WORK (1 << 20) /* weight x row products per thread, at least */

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
static float E4M3[256];
/* SCALED[s][c] = E2M1[c] * E4M3[s], exact in fp32: a block's 16 possible weights, one load per block */
static float SCALED[256][16] __attribute__((aligned(64)));

/* E4M3 (fn) byte -> float: bias 7, subnormals at exponent 0, 0x7F / 0xFF NaN, no Inf. */
__attribute__((constructor)) static void build_e4m3(void) {
    for (int b = 0; b < 256; b++) {
        int e = (b >> 3) & 15, m = b & 7;
        float mag = e == 0 ? ldexpf((float)m, -9) : ldexpf(8.0f + m, e - 10);
        if (e == 15 && m == 7) mag = NAN;
        E4M3[b] = (b & 0x80) ? -mag : mag;
    }
    for (int b = 0; b < 256; b++)
        for (int c = 0; c < 16; c++) SCALED[b][c] = E2M1[c] * E4M3[b];
}

const char *srt_cpu_expert_path(void) { return SRT_PATH; }

/* The fixed reduction of 16 lanes. */
static inline float lane_sum(float *a) {
    for (int w = 8; w >= 1; w >>= 1)
        for (int l = 0; l < w; l++) a[l] += a[l + w];
    return a[0];
}

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
INL v16 v_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
INL v16 v_fma(v16 w, const float *x, v16 acc) { return _mm512_fmadd_ps(w, _mm512_loadu_ps(x), acc); }
INL void v_store(float *p, v16 a) { _mm512_storeu_ps(p, a); }
INL v16 v_decode(uint64_t word, const float *lut) { /* vpermps reads the low 4 bits of each index */
    const __m512i shift = _mm512_set_epi64(28, 24, 20, 16, 12, 8, 4, 0);
    __m512i idx = _mm512_srlv_epi64(_mm512_set1_epi64((long long)word), shift);
    return _mm512_permutexvar_ps(idx, _mm512_load_ps(lut));
}
#elif defined(__AVX2__) && defined(__FMA__)
typedef struct { __m256 a, b; } v16;
INL v16 v_zero(void) { return (v16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
INL v16 v_add(v16 x, v16 y) { return (v16){_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
INL v16 v_fma(v16 w, const float *x, v16 acc) {
    return (v16){_mm256_fmadd_ps(w.a, _mm256_loadu_ps(x), acc.a), _mm256_fmadd_ps(w.b, _mm256_loadu_ps(x + 8), acc.b)};
}
INL void v_store(float *p, v16 v) { _mm256_storeu_ps(p, v.a); _mm256_storeu_ps(p + 8, v.b); }
INL __m256 decode8(__m256i c, __m256 pos) { /* codes 0..7 by the low 3 bits; bit 3 flips the sign */
    __m256i sign = _mm256_and_si256(_mm256_slli_epi32(c, 28), _mm256_set1_epi32((int)0x80000000u));
    return _mm256_xor_ps(_mm256_permutevar8x32_ps(pos, c), _mm256_castsi256_ps(sign));
}
INL v16 v_decode(uint64_t word, const float *lut) {
    __m256i q = _mm256_set1_epi64x((long long)word);
    __m256 pos = _mm256_load_ps(lut);
    return (v16){decode8(_mm256_srlv_epi64(q, _mm256_set_epi64x(12, 8, 4, 0)), pos),
                 decode8(_mm256_srlv_epi64(q, _mm256_set_epi64x(28, 24, 20, 16)), pos)};
}
#else
typedef struct { float l[BLOCK]; } v16;
INL v16 v_zero(void) { v16 v; memset(&v, 0, sizeof v); return v; }
INL v16 v_add(v16 x, v16 y) { for (int l = 0; l < BLOCK; l++) x.l[l] += y.l[l]; return x; }
INL v16 v_fma(v16 w, const float *x, v16 acc) {
    for (int l = 0; l < BLOCK; l++) acc.l[l] = fmaf(w.l[l], x[l], acc.l[l]);
    return acc;
}
INL void v_store(float *p, v16 v) { memcpy(p, v.l, sizeof v.l); }
INL v16 v_decode(uint64_t word, const float *lut) { /* lane 2k: nibble k; lane 2k + 1: nibble k + 8 */
    v16 v;
    for (int k = 0; k < 8; k++) {
        v.l[2 * k] = lut[(word >> (4 * k)) & 15];
        v.l[2 * k + 1] = lut[(word >> (4 * k + 32)) & 15];
    }
    return v;
}
#endif

/* sums[r] = sum_k W[k] * x[r][k] over one weight row (nblk blocks of 16), for NR rows of x (lane
   order). Block b goes to accumulator b % PHASES (independent chains hide the FMA latency); the
   phases are added (0 + 1) + (2 + 3), then the lanes in the fixed tree. */
#define PHASES 4
INL void dot_rows(const uint8_t *wp, const uint8_t *ws, int64_t nblk, const float *x, int64_t ldx, int NR,
                  float *sums) {
    v16 acc[MAX_ROWS][PHASES];
    float lanes[BLOCK];
    for (int r = 0; r < NR; r++)
        for (int p = 0; p < PHASES; p++) acc[r][p] = v_zero();
#define SRT_STEP(bb, p)                                                            \
    do {                                                                           \
        uint64_t word;                                                             \
        memcpy(&word, wp + 8 * (bb), 8);                                           \
        v16 w = v_decode(word, SCALED[ws[bb]]);                                    \
        for (int r = 0; r < NR; r++) acc[r][p] = v_fma(w, x + r * ldx + BLOCK * (bb), acc[r][p]); \
    } while (0)
    int64_t b = 0;
    for (; b + PHASES <= nblk; b += PHASES) {
        SRT_STEP(b, 0);
        SRT_STEP(b + 1, 1);
        SRT_STEP(b + 2, 2);
        SRT_STEP(b + 3, 3);
    }
    for (; b < nblk; b++) SRT_STEP(b, b % PHASES);
#undef SRT_STEP
    for (int r = 0; r < NR; r++) {
        v_store(lanes, v_add(v_add(acc[r][0], acc[r][1]), v_add(acc[r][2], acc[r][3])));
        sums[r] = lane_sum(lanes);
    }
}

/* sums[r] for m rows of x, MAX_ROWS at a time; each count its own specialised copy of dot_rows. */
static void row_dots(const uint8_t *wp, const uint8_t *ws, int64_t nblk, const float *x, int64_t ldx, int64_t m,
                     float *sums) {
    for (int64_t r0 = 0; r0 < m; r0 += MAX_ROWS) {
        int64_t nr = m - r0 < MAX_ROWS ? m - r0 : MAX_ROWS;
        const float *xr = x + r0 * ldx;
        switch (nr) {
#define SRT_CASE(n) \
    case n: dot_rows(wp, ws, nblk, xr, ldx, n, sums + r0); break;
            SRT_CASE(1) SRT_CASE(2)
#if MAX_ROWS == 4
            SRT_CASE(3) SRT_CASE(4)
#endif
#undef SRT_CASE
        }
    }
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

/* The gate / up rows of one job: h[r][i] for every row r. */
static void glu_row(const srt_expert_job *j, int64_t i, int64_t dl, int64_t inter, float beta, float lin_beta) {
    float gsum[MAX_ROWS], usum[MAX_ROWS];
    const int64_t kb = dl / BLOCK, at = lane_of(i);
    for (int64_t r0 = 0; r0 < j->m; r0 += MAX_ROWS) {
        int64_t nr = j->m - r0 < MAX_ROWS ? j->m - r0 : MAX_ROWS;
        row_dots(j->packed[0] + i * (dl / 2), j->scales[0] + i * kb, kb, j->zl + r0 * dl, dl, nr, gsum);
        row_dots(j->packed[1] + i * (dl / 2), j->scales[1] + i * kb, kb, j->zl + r0 * dl, dl, nr, usum);
        for (int64_t r = 0; r < nr; r++)
            j->h[(r0 + r) * inter + at] =
                situ_glu(gsum[r] * j->global[0][i], usum[r] * j->global[1][i], beta, lin_beta);
    }
}

/* The down row d of one job: out[r][d] for every row r. */
static void down_row(const srt_expert_job *j, int64_t d, int64_t dl, int64_t inter) {
    float dsum[MAX_ROWS];
    const int64_t kb = inter / BLOCK;
    for (int64_t r0 = 0; r0 < j->m; r0 += MAX_ROWS) {
        int64_t nr = j->m - r0 < MAX_ROWS ? j->m - r0 : MAX_ROWS;
        row_dots(j->packed[2] + d * (inter / 2), j->scales[2] + d * kb, kb, j->h + r0 * inter, inter, nr, dsum);
        for (int64_t r = 0; r < nr; r++) j->out[(r0 + r) * dl + d] = dsum[r] * j->global[2][d];
    }
}

/* n experts of one layer (same dl, inter) in one parallel region: the team forks and meets at two
   barriers per call, not per expert. lin_beta <= 0: no clamp on up. threads <= 0: the OpenMP
   default. An output element's bits do not depend on the batch, its order or the threads. Returns 0. */
int srt_cpu_experts_ffn(const srt_expert_job *jobs, int64_t n, int64_t dl, int64_t inter, float beta, float lin_beta,
                        int threads) {
    int64_t rows = 0;
    for (int64_t k = 0; k < n; k++) {
        const srt_expert_job *j = jobs + k;
        rows += j->m;
        for (int64_t r = 0; r < j->m; r++)
            for (int64_t e = 0; e < dl; e++) j->zl[r * dl + lane_of(e)] = j->z[r * dl + e];
    }
#ifdef _OPENMP
    /* a thread per MIN_WORK products at most: a small batch is not worth waking a team for */
    int64_t cap = 3 * dl * inter * rows / MIN_WORK;
    int nt = threads > 0 ? threads : omp_get_max_threads();
    if (nt > cap) nt = cap > 1 ? (int)cap : 1;
#pragma omp parallel num_threads(nt)
#endif
    {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t t = 0; t < n * inter; t++) glu_row(jobs + t / inter, t % inter, dl, inter, beta, lin_beta);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t t = 0; t < n * dl; t++) down_row(jobs + t / dl, t % dl, dl, inter);
    }
    (void)threads;
    return 0;
}
