// Dense GEMV for decode (1..8 rows): out[t, n] = sum_k x[t, k] * W[n, k], fp32 accumulation.
// W [N, K] row-major, bf16 or fp32; x [T, K] fp32 or bf16; out [T, N] fp32.
//
// Vector kernels (K % 8 == 0 for bf16, K % 4 == 0 for fp32, W 16-byte aligned):
// a block of GEMV_WARPS warps owns GEMV_WARPS * GEMV_RPW consecutive rows; each warp owns
// GEMV_RPW rows, each lane streams 16-byte pieces of them. x is staged in shared memory in
// chunks of GEMV_CH columns (all NT rows, zero-padded past T) and reused by every row.
// A lane accumulates its columns in ascending order; lanes meet in a butterfly. The order does
// not depend on NT or T, so a row's result is the same alone or in a batch (batch invariance).
#include "common.cuh"

#define GEMV_WARPS 4
#define GEMV_RPW 2
#define GEMV_CH 1024  // multiple of 256: the lane <-> column map does not depend on the chunking

template <int NT, int WBF16>
SRT_DEV void gemv_vec(const void* __restrict__ xv, int x_bf16, int T, const void* __restrict__ Wv,
                      float* __restrict__ out, int N, int K) {
  constexpr int EPV = WBF16 ? 8 : 4;             // elements per 16-byte vector
  constexpr int ITERS = GEMV_CH / (32 * EPV);    // vectors per lane per row per chunk
  constexpr int ES = WBF16 ? 2 : 4;              // bytes per weight
  __shared__ __align__(16) float xs[NT * GEMV_CH];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * GEMV_WARPS + warp) * GEMV_RPW;
  const char* Wb = (const char*)Wv;

  float acc[GEMV_RPW][NT];
#pragma unroll
  for (int r = 0; r < GEMV_RPW; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;

  for (int c0 = 0; c0 < K; c0 += GEMV_CH) {
    const int cw = min(GEMV_CH, K - c0);
    __syncthreads();
    for (int i = threadIdx.x; i < NT * GEMV_CH; i += blockDim.x) {
      const int t = i / GEMV_CH, c = i - t * GEMV_CH;
      float v = 0.0f;
      if (t < T && c < cw) {
        const long long off = (long long)t * K + c0 + c;
        v = x_bf16 ? bf16_to_f32(((const u16*)xv)[off]) : ((const float*)xv)[off];
      }
      xs[i] = v;
    }
    __syncthreads();

    u32x4 wv[GEMV_RPW][ITERS];
#pragma unroll
    for (int r = 0; r < GEMV_RPW; ++r) {
      const int row = row0 + r;
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        const int col = c0 + (it * 32 + lane) * EPV;
        if (row < N && col < K) wv[r][it] = ld_stream16(Wb + ((long long)row * K + col) * ES);
        else wv[r][it] = u32x4{0u, 0u, 0u, 0u};
      }
    }
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int cl = (it * 32 + lane) * EPV;
      if (c0 + cl < K) {
#pragma unroll
        for (int r = 0; r < GEMV_RPW; ++r) {
          float wf[EPV];
          if constexpr (WBF16) {
            const u32 q[4] = {wv[r][it].x, wv[r][it].y, wv[r][it].z, wv[r][it].w};
#pragma unroll
            for (int e = 0; e < 4; ++e) { wf[2 * e] = bf16lo(q[e]); wf[2 * e + 1] = bf16hi(q[e]); }
          } else {
            wf[0] = __uint_as_float(wv[r][it].x); wf[1] = __uint_as_float(wv[r][it].y);
            wf[2] = __uint_as_float(wv[r][it].z); wf[3] = __uint_as_float(wv[r][it].w);
          }
#pragma unroll
          for (int t = 0; t < NT; ++t) {
#pragma unroll
            for (int e = 0; e < EPV; e += 4) {
              const f32x4 xx = *(const f32x4*)&xs[t * GEMV_CH + cl + e];
              acc[r][t] = fmaf(wf[e + 0], xx.x, acc[r][t]);
              acc[r][t] = fmaf(wf[e + 1], xx.y, acc[r][t]);
              acc[r][t] = fmaf(wf[e + 2], xx.z, acc[r][t]);
              acc[r][t] = fmaf(wf[e + 3], xx.w, acc[r][t]);
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < GEMV_RPW; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float v = warp_sum(acc[r][t]);
      const int row = row0 + r;
      if (lane == ((r * NT + t) & 31) && row < N && t < T) out[(long long)t * N + row] = v;
    }
}

// T <= 2: no shared memory and no barriers. x (16-byte aligned rows) is read through L1
// (the whole warp reads the same x pieces, every warp of the SM reuses them); each lane keeps
// 2 rows x U 16-byte weight vectors in flight. The lane <-> column map and the per-lane
// accumulation order are exactly those of gemv_vec (c0 steps by GEMV_CH), so results are
// bit-identical across NT.
template <int NT, int WBF16>
SRT_DEV void gemv_l1(const void* __restrict__ xv, int x_bf16, int T, const void* __restrict__ Wv,
                     float* __restrict__ out, int N, int K) {
  constexpr int EPV = WBF16 ? 8 : 4;
  constexpr int U = GEMV_CH / (32 * EPV);
  constexpr int ES = WBF16 ? 2 : 4;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * GEMV_WARPS + warp) * GEMV_RPW;
  const char* Wb = (const char*)Wv;
  float acc[GEMV_RPW][NT];
#pragma unroll
  for (int r = 0; r < GEMV_RPW; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;
  for (int c0 = 0; c0 < K; c0 += GEMV_CH) {
    u32x4 wv[GEMV_RPW][U];
#pragma unroll
    for (int r = 0; r < GEMV_RPW; ++r) {
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
        for (int r = 0; r < GEMV_RPW; ++r) {
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
  for (int r = 0; r < GEMV_RPW; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float v = warp_sum(acc[r][t]);
      const int row = row0 + r;
      if (lane == ((r * NT + t) & 31) && row < N && t < T) out[(long long)t * N + row] = v;
    }
}

#define SRT_GEMV_L1_ENTRY(NAME, NT, WB)                                                               \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                       \
      NAME(const void* __restrict__ x, int x_bf16, int T, const void* __restrict__ W, float* __restrict__ out, \
           int N, int K) {                                                                            \
    gemv_l1<NT, WB>(x, x_bf16, T, W, out, N, K);                                                     \
  }

#define SRT_GEMV_ENTRY(NAME, NT, WB)                                                                  \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                       \
      NAME(const void* __restrict__ x, int x_bf16, int T, const void* __restrict__ W, float* __restrict__ out, \
           int N, int K) {                                                                            \
    gemv_vec<NT, WB>(x, x_bf16, T, W, out, N, K);                                                    \
  }

SRT_GEMV_L1_ENTRY(srt_gemv_bf16_t1, 1, 1)
SRT_GEMV_L1_ENTRY(srt_gemv_bf16_t2, 2, 1)
SRT_GEMV_ENTRY(srt_gemv_bf16_t4, 4, 1)
SRT_GEMV_ENTRY(srt_gemv_bf16_t8, 8, 1)
SRT_GEMV_L1_ENTRY(srt_gemv_f32_t1, 1, 0)
SRT_GEMV_L1_ENTRY(srt_gemv_f32_t2, 2, 0)
SRT_GEMV_ENTRY(srt_gemv_f32_t4, 4, 0)
SRT_GEMV_ENTRY(srt_gemv_f32_t8, 8, 0)

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
