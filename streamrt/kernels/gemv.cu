// Dense GEMV for decode (1..8 rows): out[t, n] = sum_k x[t, k] * W[n, k], fp32 accumulation.
// W [N, K] row-major, bf16 or fp32; x [T, K] fp32 or bf16; out [T, N] fp32.
//
// Vector kernels (K % 8 == 0 for bf16, K % 4 == 0 for fp32, W 16-byte aligned): a block of
// GEMV_WARPS warps owns GEMV_WARPS * RPW consecutive rows; each warp owns RPW rows, each lane
// streams 16-byte pieces of them (a warp reads 512 contiguous bytes of a row per load).
// No shared memory and no barriers: x (16-byte aligned rows) is read through L1 (the whole warp
// reads the same x pieces, every warp of the SM reuses them); each lane keeps RPW rows x U
// 16-byte weight vectors in flight. A lane accumulates its columns in ascending order (chunks
// of GEMV_CH columns); lanes meet in a butterfly. The order depends neither on NT, T nor RPW,
// so a row's result is the same alone or in a batch, whichever variant runs (batch invariance).
#include "common.cuh"

#define GEMV_WARPS 4
#define GEMV_CH 1024  // multiple of 256: the lane <-> column map does not depend on the chunking

// RPW (rows per warp) sets the grid: N / (4 * RPW) blocks; the host picks it so the last wave is
// not a long tail (see GEMV_VARIANTS in backends/nvrtc.py).
template <int NT, int WBF16, int RPW>
SRT_DEV void gemv_l1(const void* __restrict__ xv, int x_bf16, int T, const void* __restrict__ Wv,
                     float* __restrict__ out, int N, int K) {
  constexpr int EPV = WBF16 ? 8 : 4;
  constexpr int U = GEMV_CH / (32 * EPV);
  constexpr int ES = WBF16 ? 2 : 4;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * GEMV_WARPS + warp) * RPW;
  const char* Wb = (const char*)Wv;
  float acc[RPW][NT];
#pragma unroll
  for (int r = 0; r < RPW; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;
  for (int c0 = 0; c0 < K; c0 += GEMV_CH) {
    u32x4 wv[RPW][U];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const int row = min(row0 + r, N - 1);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int col = c0 + (u * 32 + lane) * EPV;
        wv[r][u] = col < K ? ld_stream16(Wb + ((long long)row * K + col) * ES) : u32x4{0u, 0u, 0u, 0u};
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int col = c0 + (u * 32 + lane) * EPV;
      if (col < K) {
        float xx[NT][EPV];
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const int tt = min(t, T - 1);
          if (x_bf16) {
#pragma unroll
            for (int e = 0; e < EPV; ++e) xx[t][e] = bf16_to_f32(((const u16*)xv)[(long long)tt * K + col + e]);
          } else {
#pragma unroll
            for (int e = 0; e < EPV; e += 4) {
              const f32x4 v = *(const f32x4*)((const float*)xv + (long long)tt * K + col + e);
              xx[t][e] = v.x; xx[t][e + 1] = v.y; xx[t][e + 2] = v.z; xx[t][e + 3] = v.w;
            }
          }
        }
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
          float wf[EPV];
          if constexpr (WBF16) {
            const u32 q[4] = {wv[r][u].x, wv[r][u].y, wv[r][u].z, wv[r][u].w};
#pragma unroll
            for (int e = 0; e < 4; ++e) { wf[2 * e] = bf16lo(q[e]); wf[2 * e + 1] = bf16hi(q[e]); }
          } else {
            wf[0] = __uint_as_float(wv[r][u].x); wf[1] = __uint_as_float(wv[r][u].y);
            wf[2] = __uint_as_float(wv[r][u].z); wf[3] = __uint_as_float(wv[r][u].w);
          }
#pragma unroll
          for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int e = 0; e < EPV; ++e) acc[r][t] = fmaf(wf[e], xx[t][e], acc[r][t]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float v = warp_sum(acc[r][t]);
      const int row = row0 + r;
      if (lane == ((r * NT + t) & 31) && row < N && t < T) out[(long long)t * N + row] = v;
    }
}

#define SRT_GEMV_L1_ENTRY(NAME, NT, WB, RPW)                                                          \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                       \
      NAME(const void* __restrict__ x, int x_bf16, int T, const void* __restrict__ W, float* __restrict__ out, \
           int N, int K) {                                                                            \
    gemv_l1<NT, WB, RPW>(x, x_bf16, T, W, out, N, K);                                                \
  }

// srt_gemv_<w dtype>_t<NT>_r<RPW>. Every variant gives the same bits for a row.
SRT_GEMV_L1_ENTRY(srt_gemv_bf16_t1_r1, 1, 1, 1)
SRT_GEMV_L1_ENTRY(srt_gemv_bf16_t1_r2, 1, 1, 2)
SRT_GEMV_L1_ENTRY(srt_gemv_bf16_t1_r4, 1, 1, 4)
SRT_GEMV_L1_ENTRY(srt_gemv_bf16_t2_r2, 2, 1, 2)
SRT_GEMV_L1_ENTRY(srt_gemv_bf16_t2_r4, 2, 1, 4)
SRT_GEMV_L1_ENTRY(srt_gemv_bf16_t4_r2, 4, 1, 2)
SRT_GEMV_L1_ENTRY(srt_gemv_bf16_t4_r4, 4, 1, 4)
SRT_GEMV_L1_ENTRY(srt_gemv_bf16_t8_r2, 8, 1, 2)
SRT_GEMV_L1_ENTRY(srt_gemv_bf16_t8_r4, 8, 1, 4)
SRT_GEMV_L1_ENTRY(srt_gemv_f32_t1_r2, 1, 0, 2)
SRT_GEMV_L1_ENTRY(srt_gemv_f32_t2_r2, 2, 0, 2)
SRT_GEMV_L1_ENTRY(srt_gemv_f32_t4_r2, 4, 0, 2)
SRT_GEMV_L1_ENTRY(srt_gemv_f32_t8_r2, 8, 0, 2)

// Fallback for any K / alignment: one warp per row, scalar loads, T <= 8.
extern "C" __global__ void srt_gemv_scalar(const void* __restrict__ x, int x_bf16, int T, const void* __restrict__ W,
                                           int w_bf16, float* __restrict__ out, int N, int K) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.x * (blockDim.x >> 5) + warp;
  if (row >= N) return;  // whole warp leaves together
  float acc[8];
#pragma unroll
  for (int t = 0; t < 8; ++t) acc[t] = 0.0f;
  for (int c = lane; c < K; c += 32) {
    const float w = ldw(W, (long long)row * K + c, w_bf16);
#pragma unroll
    for (int t = 0; t < 8; ++t)
      if (t < T) acc[t] = fmaf(w, ldw(x, (long long)t * K + c, x_bf16), acc[t]);
  }
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    const float v = warp_sum(acc[t]);
    if (lane == 0 && t < T) out[(long long)t * N + row] = v;
  }
}
