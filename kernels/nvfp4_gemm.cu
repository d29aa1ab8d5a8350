// The conversions around the grouped prefill expert GEMMs (streamrt/backends/nvfp4_gemm.py):
// the GEMMs themselves are cuBLAS's (fp16 in, fp32 accumulate and out); these feed them and
// take their outputs. Rows are fp16 at a power-of-two row scale s = 2^ceil(log2(max |row|))
// (1 for a zero row), so |row / s| <= 1: either one fp16 row, fp16(row / s) ("single"), or two,
// hi = fp16(row / s) and lo = fp16(row / s - hi) ("split": about 22 significant bits). A buffer
// of n split rows holds the n hi rows first, then the n lo rows; a GEMM output of such a buffer
// is summed hi + lo in fp32.
//   1. srt_nvfp4_to_f16:  one or two NVFP4 matrices of one width -> fp16, stacked by rows,
//      = e2m1 * e4m3 exactly (at most 6 significant bits, 2^-10 .. 2688); global scales stay out.
//   2. srt_f16_rows:      x [n, cols] fp32 -> rows fp16 and the row scales [n].
//   3. srt_situ_f16_rows: an expert's gate|up GEMM output -> SiTU-GLU -> the down GEMM's fp16
//      rows and their row scales.
//   4. srt_scatter_rows:  the down GEMM output * row scale * global scale -> y at the pairs' rows.
#include "common.cuh"

SRT_DEV u16 f2h(float v) {
  u16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}

SRT_DEV float h2f(u16 h) {
  float r;
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
  return r;
}

// The row scale of a row whose max |element| is m: 2^ceil(log2 m), 1 for m = 0.
SRT_DEV float pow2_scale(float m) {
  int e;
  const float fr = frexpf(m, &e);  // m = fr * 2^e, fr in [0.5, 1)
  return m > 0.0f ? ldexpf(1.0f, fr == 0.5f ? e - 1 : e) : 1.0f;
}

// Element i of row r as fp16 row(s): v = x / s (|v| <= 1), hi at rows[r], lo at rows[n + r].
SRT_DEV void put_f16(u16* __restrict__ rows, long long r, long long n, int cols, int i, float v, int split) {
  const u16 h = f2h(v);
  rows[r * cols + i] = h;
  if (split) rows[(n + r) * cols + i] = f2h(v - h2f(h));
}

// One thread per word of `packed` (8 elements, inside one 16-element scale group). Words
// [0, words0) are matrix 0's, [words0, words) matrix 1's (its rows follow matrix 0's in `out`).
extern "C" __global__ void srt_nvfp4_to_f16(const u32* __restrict__ packed0, const u8* __restrict__ scales0,
                                            const u32* __restrict__ packed1, const u8* __restrict__ scales1,
                                            u32x4* __restrict__ out, int words0, int words, int words_per_row) {
  for (int w = blockIdx.x * blockDim.x + threadIdx.x; w < words; w += gridDim.x * blockDim.x) {
    const bool second = w >= words0;
    const int v = second ? w - words0 : w;
    const int row = v / words_per_row, c = v - row * words_per_row;
    const u8* sc = second ? scales1 : scales0;
    // e2m1x8 gives e2m1 * 2^-14; the 2^14 goes into the scale (a power of two: exact)
    const float s = e4m3_to_f32(sc[(long long)row * (words_per_row >> 1) + (c >> 1)]) * SRT_E2M1_UNSCALE;
    float f[8];
    e2m1x8((second ? packed1 : packed0)[v], f);
    out[w] = u32x4{f2h2(f[0] * s, f[1] * s), f2h2(f[2] * s, f[3] * s), f2h2(f[4] * s, f[5] * s),
                   f2h2(f[6] * s, f[7] * s)};
  }
}

// One block per row.
extern "C" __global__ void srt_f16_rows(const float* __restrict__ x, u16* __restrict__ rows, float* __restrict__ scale,
                                        int n, int cols, int split) {
  __shared__ float red[32];
  const int r = blockIdx.x;
  const float* xr = x + (long long)r * cols;
  float m = 0.0f;
  for (int i = threadIdx.x; i < cols; i += blockDim.x) m = fmaxf(m, fabsf(xr[i]));
  const float s = pow2_scale(block_max(m, red));
  const float inv = 1.0f / s;  // exact: a power of two
  for (int i = threadIdx.x; i < cols; i += blockDim.x) put_f16(rows, r, n, cols, i, xr[i] * inv, split);
  if (threadIdx.x == 0) scale[r] = s;
}

// One block per row r of an expert's m pairs; dynamic shared memory: inter floats.
//   gu [m or 2m (split: hi then lo), 2 * inter] fp32: the gate|up GEMM of the pairs' rows;
//   gate = gu[:, :inter] summed over halves * xscale[r] * gate_glob, up likewise with up_glob;
//   h = situ(gate, up) -> rows [m or 2m, inter] fp16 and hscale[r] (srt_f16_rows' rounding).
extern "C" __global__ void srt_situ_f16_rows(const float* __restrict__ gu, const float* __restrict__ xscale,
                                             const float* __restrict__ gate_glob, const float* __restrict__ up_glob,
                                             u16* __restrict__ rows, float* __restrict__ hscale, int m, int inter,
                                             int split, float beta, int beta_inf, float lbeta, int has_lin) {
  extern __shared__ float hs[];
  __shared__ float red[32];
  const int r = blockIdx.x;
  const float* g0 = gu + (long long)r * 2 * inter;
  const float* g1 = gu + ((long long)m + r) * 2 * inter;
  const float xs = xscale[r];
  float mx = 0.0f;
  for (int i = threadIdx.x; i < inter; i += blockDim.x) {
    const float g = (split ? g0[i] + g1[i] : g0[i]) * xs * gate_glob[i];
    const float u = (split ? g0[inter + i] + g1[inter + i] : g0[inter + i]) * xs * up_glob[i];
    const float h = situ(g, u, beta, beta_inf, lbeta, has_lin);
    hs[i] = h;
    mx = fmaxf(mx, fabsf(h));
  }
  const float s = pow2_scale(block_max(mx, red));  // block_max syncs: hs is complete
  const float inv = 1.0f / s;
  for (int i = threadIdx.x; i < inter; i += blockDim.x) put_f16(rows, r, m, inter, i, hs[i] * inv, split);
  if (threadIdx.x == 0) hscale[r] = s;
}

// One block per row r of an expert's m pairs: y[pairs[r]] = d[r] (+ d[m + r]) * hscale[r] * glob.
extern "C" __global__ void srt_scatter_rows(const float* __restrict__ d, const float* __restrict__ hscale,
                                            const float* __restrict__ glob, const long long* __restrict__ pairs,
                                            float* __restrict__ y, int m, int cols, int split) {
  const int r = blockIdx.x;
  const float* d0 = d + (long long)r * cols;
  const float* d1 = d + ((long long)m + r) * cols;
  float* yr = y + pairs[r] * cols;
  const float s = hscale[r];
  for (int i = threadIdx.x; i < cols; i += blockDim.x) yr[i] = (split ? d0[i] + d1[i] : d0[i]) * s * glob[i];
}
