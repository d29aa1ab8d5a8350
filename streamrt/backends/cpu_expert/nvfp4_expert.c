/* One routed expert in NVFP4 on the host CPU: out = down(SiTU-GLU(gate z, up z)) for m rows.

   Weights are read where they lie (a file mapping or a pool buffer): packed E2M1 nibbles
   [out, in/2] (low nibble = even element), E4M3 scale bytes [out, in/16], fp32 global per row.
   No dequantised copy exists; each 16-element block is decoded in registers and used at once.

   Arithmetic (the same bits on every path and every thread count): a weight row's dot with a
   row of x runs in 16 lanes, lane l taking elements l, 16 + l, 32 + l, ... with one fused
   multiply-add each (the weight e2m1 * e4m3 is exact in fp32), then the lanes are summed in a
   fixed tree (l + 8, l + 4, l + 2, l + 1) and the sum is multiplied by the row's global scale.
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
#define MAX_ROWS 8 /* rows per pass over a weight row: their accumulators stay in registers */
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SRT_PATH "avx2"
#define MAX_ROWS 4
#else
#define SRT_PATH "portable"
#define MAX_ROWS 4
#endif

#define BLOCK 16

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
static float E4M3[256];

/* E4M3 (fn) byte -> float: bias 7, subnormals at exponent 0, 0x7F / 0xFF NaN, no Inf. */
__attribute__((constructor)) static void build_e4m3(void) {
    for (int b = 0; b < 256; b++) {
        int e = (b >> 3) & 15, m = b & 7;
        float mag = e == 0 ? ldexpf((float)m, -9) : ldexpf(8.0f + m, e - 10);
        if (e == 15 && m == 7) mag = NAN;
        E4M3[b] = (b & 0x80) ? -mag : mag;
    }
}

const char *srt_cpu_expert_path(void) { return SRT_PATH; }

/* The fixed reduction of 16 lanes. */
static inline float lane_sum(float *a) {
    for (int w = 8; w >= 1; w >>= 1)
        for (int l = 0; l < w; l++) a[l] += a[l + w];
    return a[0];
}

/* sums[r] = sum_k W[k] * x[r][k] over one weight row (nblk blocks of 16), for NR rows of x. */
static inline __attribute__((always_inline)) void dot_rows(const uint8_t *wp, const uint8_t *ws, int64_t nblk,
                                                          const float *x, int64_t ldx, int NR, float *sums) {
    float lanes[BLOCK];
#if defined(__AVX512F__)
    const __m512 lut = _mm512_loadu_ps(E2M1);
    const __m128i low = _mm_set1_epi8(0x0F);
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblk; b++) {
        __m128i raw = _mm_loadl_epi64((const __m128i *)(wp + 8 * b));
        __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(raw, low), _mm_and_si128(_mm_srli_epi16(raw, 4), low));
        __m512 w = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(nib), lut), _mm512_set1_ps(E4M3[ws[b]]));
        for (int r = 0; r < NR; r++) acc[r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + r * ldx + BLOCK * b), acc[r]);
    }
    for (int r = 0; r < NR; r++) {
        _mm512_storeu_ps(lanes, acc[r]);
        sums[r] = lane_sum(lanes);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 mag = _mm256_loadu_ps(E2M1); /* codes 0..7; bit 3 is the sign */
    const __m128i low = _mm_set1_epi8(0x0F);
    __m256 acc0[MAX_ROWS], acc1[MAX_ROWS];
    for (int r = 0; r < NR; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblk; b++) {
        __m128i raw = _mm_loadl_epi64((const __m128i *)(wp + 8 * b));
        __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(raw, low), _mm_and_si128(_mm_srli_epi16(raw, 4), low));
        __m256i c0 = _mm256_cvtepu8_epi32(nib), c1 = _mm256_cvtepu8_epi32(_mm_srli_si128(nib, 8));
        __m256 s = _mm256_set1_ps(E4M3[ws[b]]);
        __m256 w0 = _mm256_xor_ps(_mm256_permutevar8x32_ps(mag, c0),
                                  _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(c0, 3), 31)));
        __m256 w1 = _mm256_xor_ps(_mm256_permutevar8x32_ps(mag, c1),
                                  _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(c1, 3), 31)));
        w0 = _mm256_mul_ps(w0, s);
        w1 = _mm256_mul_ps(w1, s);
        for (int r = 0; r < NR; r++) {
            const float *xr = x + r * ldx + BLOCK * b;
            acc0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc0[r]);
            acc1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc1[r]);
        }
    }
    for (int r = 0; r < NR; r++) {
        _mm256_storeu_ps(lanes, acc0[r]);
        _mm256_storeu_ps(lanes + 8, acc1[r]);
        sums[r] = lane_sum(lanes);
    }
#else
    float acc[MAX_ROWS][BLOCK];
    memset(acc, 0, sizeof acc);
    for (int64_t b = 0; b < nblk; b++) {
        float s = E4M3[ws[b]], w[BLOCK];
        for (int j = 0; j < BLOCK / 2; j++) {
            uint8_t v = wp[8 * b + j];
            w[2 * j] = E2M1[v & 15] * s;
            w[2 * j + 1] = E2M1[v >> 4] * s;
        }
        for (int r = 0; r < NR; r++)
            for (int l = 0; l < BLOCK; l++) acc[r][l] = fmaf(w[l], x[r * ldx + BLOCK * b + l], acc[r][l]);
    }
    for (int r = 0; r < NR; r++) {
        memcpy(lanes, acc[r], sizeof lanes);
        sums[r] = lane_sum(lanes);
    }
#endif
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
            SRT_CASE(1) SRT_CASE(2) SRT_CASE(3) SRT_CASE(4)
#if MAX_ROWS == 8
            SRT_CASE(5) SRT_CASE(6) SRT_CASE(7) SRT_CASE(8)
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

/* z [m, dl] -> out [m, dl]; h [m, inter] is the caller's scratch. gate / up [inter, dl], down [dl, inter].
   lin_beta <= 0: no linear clamp. threads <= 0: the OpenMP default. Returns 0. */
int srt_cpu_expert_ffn(const float *z, int64_t m, int64_t dl, int64_t inter, const uint8_t *gp, const uint8_t *gs,
                       const float *gg, const uint8_t *up, const uint8_t *us, const float *ug, const uint8_t *dp,
                       const uint8_t *ds, const float *dg, float beta, float lin_beta, float *h, float *out,
                       int threads) {
    const int64_t kb1 = dl / BLOCK, kb2 = inter / BLOCK;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads > 0 ? threads : omp_get_max_threads())
#endif
    {
        float gsum[MAX_ROWS], usum[MAX_ROWS], dsum[MAX_ROWS];
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t i = 0; i < inter; i++) {
            for (int64_t r0 = 0; r0 < m; r0 += MAX_ROWS) {
                int64_t nr = m - r0 < MAX_ROWS ? m - r0 : MAX_ROWS;
                row_dots(gp + i * (dl / 2), gs + i * kb1, kb1, z + r0 * dl, dl, nr, gsum);
                row_dots(up + i * (dl / 2), us + i * kb1, kb1, z + r0 * dl, dl, nr, usum);
                for (int64_t r = 0; r < nr; r++)
                    h[(r0 + r) * inter + i] = situ_glu(gsum[r] * gg[i], usum[r] * ug[i], beta, lin_beta);
            }
        }
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t d = 0; d < dl; d++) {
            for (int64_t r0 = 0; r0 < m; r0 += MAX_ROWS) {
                int64_t nr = m - r0 < MAX_ROWS ? m - r0 : MAX_ROWS;
                row_dots(dp + d * (inter / 2), ds + d * kb2, kb2, h + r0 * inter, inter, nr, dsum);
                for (int64_t r = 0; r < nr; r++) out[(r0 + r) * dl + d] = dsum[r] * dg[d];
            }
        }
    }
    (void)threads;
    return 0;
}
