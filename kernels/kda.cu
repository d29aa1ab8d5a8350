// KDA recurrent decode step (gated delta rule), one token per row, in place on the fp32 state.
// q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; state S [T, H, K, V]; out o [T, H, V].
//   S <- diag(exp g) S;  u = v - S^T k;  S <- S + (beta k) u^T;  o = S^T q  (updated state)
// grid (ceil(V/32), H, T), one warp per block; lane = one column v of S, held in registers
// (K <= SRT_KDA_MAXK). Sums over k run in ascending k.
#include "common.cuh"

#ifndef SRT_KDA_MAXK
#error "SRT_KDA_MAXK is passed by the host (-DSRT_KDA_MAXK=..., streamrt/backends/kernel_defines.py)"
#endif

extern "C" __global__ void __launch_bounds__(32)
    srt_kda_step(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                 const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ state,
                 float* __restrict__ out, int H, int K, int V) {
  pdl_begin();
  __shared__ float sq[SRT_KDA_MAXK], sk[SRT_KDA_MAXK], sdecay[SRT_KDA_MAXK], sbk[SRT_KDA_MAXK];
  const long long th = (long long)blockIdx.z * H + blockIdx.y;  // (t, h)
  const int lane = threadIdx.x;
  const float b = beta[th];
  for (int i = lane; i < K; i += 32) {
    const float kk = k[th * K + i];
    sq[i] = q[th * K + i];
    sk[i] = kk;
    sdecay[i] = expf(g[th * K + i]);
    sbk[i] = b * kk;
  }
  __syncwarp();
  const int col = blockIdx.x * 32 + lane;
  if (col >= V) return;
  float* S = state + th * (long long)K * V + col;
  float s[SRT_KDA_MAXK];
#pragma unroll
  for (int i = 0; i < SRT_KDA_MAXK; ++i)
    if (i < K) s[i] = S[(long long)i * V];
  float pred = 0.0f;
#pragma unroll
  for (int i = 0; i < SRT_KDA_MAXK; ++i)
    if (i < K) {
      s[i] *= sdecay[i];
      pred = fmaf(s[i], sk[i], pred);
    }
  const float u = v[th * V + col] - pred;
  float o = 0.0f;
#pragma unroll
  for (int i = 0; i < SRT_KDA_MAXK; ++i)
    if (i < K) {
      s[i] += sbk[i] * u;
      o = fmaf(s[i], sq[i], o);
      S[(long long)i * V] = s[i];
    }
  out[th * V + col] = o;
}
