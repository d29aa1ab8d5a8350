// The two conversions of the grouped prefill expert GEMM (streamrt/backends/nvfp4_gemm.py):
// the GEMM itself is cuBLAS's (fp16 in, fp32 accumulate and out); these feed it.
//   1. srt_nvfp4_to_f16: an NVFP4 matrix [out, in] -> fp16 [out, in] = e2m1 * e4m3, exactly
//      (at most 6 significant bits, magnitudes 2^-10 .. 2688); the global scale stays out.
//   2. srt_f16_halves:   x [n, cols] fp32 -> hi, lo fp16 [2n, cols] (hi rows first) and the row
//      scale s = 2^ceil(log2(max |x_row|)) (1 for a zero row): hi = fp16(x / s),
//      lo = fp16(x / s - hi), so hi + lo holds about 22 significant bits of x / s.
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

// One thread per word of `packed` (8 elements, inside one 16-element scale group).
extern "C" __global__ void srt_nvfp4_to_f16(const u32* __restrict__ packed, const u8* __restrict__ scales,
                                            u32x4* __restrict__ out, int words, int words_per_row) {
  for (int w = blockIdx.x * blockDim.x + threadIdx.x; w < words; w += gridDim.x * blockDim.x) {
    const int row = w / words_per_row, c = w - row * words_per_row;
    // e2m1x8 gives e2m1 * 2^-14; the 2^14 goes into the scale (a power of two: exact)
    const float s = e4m3_to_f32(scales[(long long)row * (words_per_row >> 1) + (c >> 1)]) * SRT_E2M1_UNSCALE;
    float f[8];
    e2m1x8(packed[w], f);
    out[w] = u32x4{f2h2(f[0] * s, f[1] * s), f2h2(f[2] * s, f[3] * s), f2h2(f[4] * s, f[5] * s),
                   f2h2(f[6] * s, f[7] * s)};
  }
}

// One block per row.
extern "C" __global__ void srt_f16_halves(const float* __restrict__ x, u16* __restrict__ halves,
                                          float* __restrict__ scale, int n, int cols) {
  __shared__ float red[32];
  const int r = blockIdx.x;
  const float* xr = x + (long long)r * cols;
  float m = 0.0f;
  for (int i = threadIdx.x; i < cols; i += blockDim.x) m = fmaxf(m, fabsf(xr[i]));
  m = block_max(m, red);
  int e;
  const float fr = frexpf(m, &e);  // m = fr * 2^e, fr in [0.5, 1)
  const float s = m > 0.0f ? ldexpf(1.0f, fr == 0.5f ? e - 1 : e) : 1.0f;
  const float inv = 1.0f / s;  // exact: a power of two
  u16* hi = halves + (long long)r * cols;
  u16* lo = halves + ((long long)n + r) * cols;
  for (int i = threadIdx.x; i < cols; i += blockDim.x) {
    const float v = xr[i] * inv;
    const u16 h = f2h(v);
    hi[i] = h;
    lo[i] = f2h(v - h2f(h));
  }
  if (threadIdx.x == 0) scale[r] = s;
}
