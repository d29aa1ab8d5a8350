// KDA recurrent decode step (gated delta rule), one token per row, in place on the fp32 state.
// q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; state S [T, H, K, V]; out o [T, H, V].
//   S <- diag(exp g) S;  u = v - S^T k;  S <- S + (beta k) u^T;  o = S^T q  (updated state)
// grid (ceil(V/32), H, T), KDA_WARPS warps per block: lane = one column v of S, warp w its rows
// [w K / KDA_WARPS, (w + 1) K / KDA_WARPS), held in registers (K <= KDA_MAXK). Each sum over
// k runs in ascending k inside a warp's rows, then the warps' sums in warp order. One warp per
// column took ~16 us a step at any H on an H200 (its K loads of a column one after another):
// 1.2 ms for a decode step's 69 KDA layers.
#include "common.cuh"

#ifndef KDA_MAXK
#error "KDA_MAXK is passed by the host (-DKDA_MAXK=..., streamrt/backends/kernel_defines.py)"
#endif
#ifndef KDA_WARPS
#error "KDA_WARPS is passed by the host (-DKDA_WARPS=..., streamrt/backends/kernel_defines.py)"
#endif
#define KDA_ROWS ((KDA_MAXK + KDA_WARPS - 1) / KDA_WARPS)  // the most rows of S a warp holds

extern "C" __global__ void __launch_bounds__(32 * KDA_WARPS)
    srt_kda_step(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                 const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ state,
                 float* __restrict__ out, int H, int K, int V) {
  pdl_begin();
  __shared__ float sq[KDA_MAXK], sk[KDA_MAXK], sdecay[KDA_MAXK], sbk[KDA_MAXK];
  __shared__ float part[KDA_WARPS][32];
  const long long th = (long long)blockIdx.z * H + blockIdx.y;  // (t, h)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float b = beta[th];
  for (int i = threadIdx.x; i < K; i += blockDim.x) {
    const float kk = k[th * K + i];
    sq[i] = q[th * K + i];
    sk[i] = kk;
    sdecay[i] = expf(g[th * K + i]);
    sbk[i] = b * kk;
  }
  __syncthreads();
  const int col = blockIdx.x * 32 + lane, i0 = warp * K / KDA_WARPS, n = (warp + 1) * K / KDA_WARPS - i0;
  const bool live = col < V;  // no early exit: the warps meet at two barriers
  float* S = state + th * (long long)K * V + (live ? col : 0);
  float s[KDA_ROWS];
#pragma unroll
  for (int r = 0; r < KDA_ROWS; ++r) s[r] = r < n && live ? S[(long long)(i0 + r) * V] : 0.0f;
  float pred = 0.0f;
#pragma unroll
  for (int r = 0; r < KDA_ROWS; ++r)
    if (r < n) {
      s[r] *= sdecay[i0 + r];
      pred = fmaf(s[r], sk[i0 + r], pred);
    }
  part[warp][lane] = pred;
  __syncthreads();
  pred = part[0][lane];
#pragma unroll
  for (int w = 1; w < KDA_WARPS; ++w) pred += part[w][lane];
  const float u = (live ? v[th * V + col] : 0.0f) - pred;
  float o = 0.0f;
#pragma unroll
  for (int r = 0; r < KDA_ROWS; ++r)
    if (r < n) {
      s[r] += sbk[i0 + r] * u;
      o = fmaf(s[r], sq[i0 + r], o);
      if (live) S[(long long)(i0 + r) * V] = s[r];
    }
  __syncthreads();  // every warp has read part[.][lane] for pred
  part[warp][lane] = o;
  __syncthreads();
  if (warp == 0 && live) {
    o = part[0][lane];
#pragma unroll
    for (int w = 1; w < KDA_WARPS; ++w) o += part[w][lane];
    out[th * V + col] = o;
  }
}
