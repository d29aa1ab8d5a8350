// NVFP4 routed-expert FFN for decode, reading experts straight from their device slots.
//
// One launch covers up to SRT_MOE_MAXP (row t, expert) pairs of one layer; the slot pointers
// travel by value in a __grid_constant__ table (no host->device copy per step).
//   1. srt_nvfp4_gateup: h[p, i] = situ_glu(gate_e[i, :] . z[t], up_e[i, :] . z[t])      [P, I]
//   2. srt_nvfp4_down:   y[p, d] = down_e[d, :] . h[p]                                      [P, Dl]
//   3. srt_moe_combine:  out[t, d] = sum_j (j ascending) w[t, j] * y[t*k + j, d]           [T, Dl]
// NVFP4 matrix [out, in]: packed u8 [out, in/2] (low nibble = even element, E2M1),
// scales u8 [out, in/16] (E4M3), global fp32 [out]. A row's dot product is
//   global[row] * sum_g e4m3(scale_g) * (sum_{i in g} e2m1_i * x_i)
// (exactly the dequantised dot in real arithmetic; fp32 rounding in a fixed order).
// Each warp owns 4 row streams; each lane reads 16 bytes (32 weights = 2 scale groups) of each
// stream per step, the activation comes from shared memory and is reused by the 4 streams.
// Requires in % 32 == 0.
#include "common.cuh"

#define SRT_MOE_MAXP 64
#define MOE_WARPS 8

struct GateUpTable {
  u64 gate_packed[SRT_MOE_MAXP], gate_scales[SRT_MOE_MAXP], gate_global[SRT_MOE_MAXP];
  u64 up_packed[SRT_MOE_MAXP], up_scales[SRT_MOE_MAXP], up_global[SRT_MOE_MAXP];
  int row[SRT_MOE_MAXP];  // which row of z each pair reads
};

struct DownTable {
  u64 packed[SRT_MOE_MAXP], scales[SRT_MOE_MAXP], global[SRT_MOE_MAXP];
};

// Dot products of 4 NVFP4 row streams with x (shared memory, `in` floats) for this lane's
// chunks; returns per-lane partials in acc[4] (caller reduces across the warp).
SRT_DEV void nvfp4_rows4(const u8* const pk[4], const u8* const sc[4], const float* __restrict__ xs, int in,
                         float acc[4]) {
  const int lane = threadIdx.x & 31;
  const int nch = in >> 5;  // 16-byte chunks per row
#pragma unroll
  for (int s = 0; s < 4; ++s) acc[s] = 0.0f;
  for (int c = lane; c < nch; c += 64) {
    const bool two = c + 32 < nch;
    u32x4 w[2][4];
    u32 sv[2][4];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      w[0][s] = ld_stream16(pk[s] + (long long)c * 16);
      sv[0][s] = *(const u16*)(sc[s] + (long long)c * 2);
      if (two) {
        w[1][s] = ld_stream16(pk[s] + (long long)(c + 32) * 16);
        sv[1][s] = *(const u16*)(sc[s] + (long long)(c + 32) * 2);
      } else {
        w[1][s] = u32x4{0u, 0u, 0u, 0u};
        sv[1][s] = 0u;
      }
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      if (u == 1 && !two) break;
      const int cc = c + 32 * u;
      float x[32];
#pragma unroll
      for (int e = 0; e < 32; e += 4) {
        const f32x4 v = *(const f32x4*)&xs[cc * 32 + e];
        x[e] = v.x; x[e + 1] = v.y; x[e + 2] = v.z; x[e + 3] = v.w;
      }
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const u32 q[4] = {w[u][s].x, w[u][s].y, w[u][s].z, w[u][s].w};
        float g[2] = {0.0f, 0.0f};
#pragma unroll
        for (int word = 0; word < 4; ++word) {
          float f[8];
          e2m1x8(q[word], f);
#pragma unroll
          for (int e = 0; e < 8; ++e) g[word >> 1] = fmaf(f[e], x[word * 8 + e], g[word >> 1]);
        }
        acc[s] = fmaf(g[0], e4m3_to_f32(sv[u][s] & 0xffu) * SRT_E2M1_UNSCALE, acc[s]);
        acc[s] = fmaf(g[1], e4m3_to_f32(sv[u][s] >> 8) * SRT_E2M1_UNSCALE, acc[s]);
      }
    }
  }
}

SRT_DEV void stage_row(float* xs, const float* __restrict__ x, int n) {
  const f32x4* x4 = (const f32x4*)x;
  f32x4* s4 = (f32x4*)xs;
  for (int i = threadIdx.x; i < (n >> 2); i += blockDim.x) s4[i] = x4[i];
  __syncthreads();
}

// grid (ceil(I / (MOE_WARPS*2)), P), block MOE_WARPS*32, dynamic smem Dl*4 bytes.
// z [*, Dl] fp32; h [P, I] fp32 (this launch's pairs).
extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    srt_nvfp4_gateup(const __grid_constant__ GateUpTable tab, const float* __restrict__ z, float* __restrict__ h,
                     int I, int Dl, float beta, int beta_inf, float lbeta, int has_lin) {
  extern __shared__ f32x4 smem_gu[];
  float* xs = (float*)smem_gu;
  const int p = blockIdx.y;
  stage_row(xs, z + (long long)tab.row[p] * Dl, Dl);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r0 = (blockIdx.x * MOE_WARPS + warp) * 2;
  if (r0 >= I) return;
  const int r1 = min(r0 + 1, I - 1);
  const long long rb = Dl >> 1, sb = Dl >> 4;
  const u8* gp = (const u8*)tab.gate_packed[p];
  const u8* gs = (const u8*)tab.gate_scales[p];
  const u8* up = (const u8*)tab.up_packed[p];
  const u8* us = (const u8*)tab.up_scales[p];
  const u8* const pk[4] = {gp + r0 * rb, gp + r1 * rb, up + r0 * rb, up + r1 * rb};
  const u8* const sc[4] = {gs + r0 * sb, gs + r1 * sb, us + r0 * sb, us + r1 * sb};
  float acc[4];
  nvfp4_rows4(pk, sc, xs, Dl, acc);
#pragma unroll
  for (int s = 0; s < 4; ++s) acc[s] = warp_sum(acc[s]);
  const float* gg = (const float*)tab.gate_global[p];
  const float* ug = (const float*)tab.up_global[p];
  if (lane == 0) h[(long long)p * I + r0] = situ(acc[0] * gg[r0], acc[2] * ug[r0], beta, beta_inf, lbeta, has_lin);
  if (lane == 1 && r0 + 1 < I)
    h[(long long)p * I + r0 + 1] = situ(acc[1] * gg[r1], acc[3] * ug[r1], beta, beta_inf, lbeta, has_lin);
}

// grid (ceil(Dl / (MOE_WARPS*4)), P), block MOE_WARPS*32, dynamic smem I*4 bytes.
// h [P, I] fp32; y [P, Dl] fp32.
extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    srt_nvfp4_down(const __grid_constant__ DownTable tab, const float* __restrict__ h, float* __restrict__ y, int Dl,
                   int I) {
  extern __shared__ f32x4 smem_dn[];
  float* xs = (float*)smem_dn;
  const int p = blockIdx.y;
  stage_row(xs, h + (long long)p * I, I);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r0 = (blockIdx.x * MOE_WARPS + warp) * 4;
  if (r0 >= Dl) return;
  const long long rb = I >> 1, sb = I >> 4;
  const u8* dp = (const u8*)tab.packed[p];
  const u8* ds = (const u8*)tab.scales[p];
  int rr[4];
#pragma unroll
  for (int s = 0; s < 4; ++s) rr[s] = min(r0 + s, Dl - 1);
  const u8* const pk[4] = {dp + rr[0] * rb, dp + rr[1] * rb, dp + rr[2] * rb, dp + rr[3] * rb};
  const u8* const sc[4] = {ds + rr[0] * sb, ds + rr[1] * sb, ds + rr[2] * sb, ds + rr[3] * sb};
  float acc[4];
  nvfp4_rows4(pk, sc, xs, I, acc);
  const float* dg = (const float*)tab.global[p];
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const float v = warp_sum(acc[s]);
    if (lane == s && r0 + s < Dl) y[(long long)p * Dl + r0 + s] = v * dg[rr[s]];
  }
}

// out[t, d] = w[t,0]*y[t*k, d] + w[t,1]*y[t*k+1, d] + ... (left to right, each product rounded).
extern "C" __global__ void srt_moe_combine(const float* __restrict__ y, const float* __restrict__ w,
                                           float* __restrict__ out, int T, int k, int Dl) {
  const long long n = (long long)T * Dl;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const long long t = i / Dl, d = i - t * Dl;
    float acc = __fmul_rn(w[t * k], y[(t * k) * Dl + d]);
    for (int j = 1; j < k; ++j) acc = __fadd_rn(acc, __fmul_rn(w[t * k + j], y[(t * k + j) * Dl + d]));
    out[i] = acc;
  }
}
