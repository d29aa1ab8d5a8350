// NVFP4 routed-expert FFN for decode, reading experts straight from their device slots.
//
// One launch covers up to SRT_MOE_MAXP (row t, expert) pairs of one layer; the slot pointers
// travel by value in a __grid_constant__ table (no host->device copy per step). A pair's rows
// of h and y are named in the table (dst), so the host may launch resident experts first and
// experts still in flight after their copy events, with the same result bits.
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
  int dst[SRT_MOE_MAXP];  // which row of h (and later y) each pair writes
};

struct DownTable {
  u64 packed[SRT_MOE_MAXP], scales[SRT_MOE_MAXP], global[SRT_MOE_MAXP];
  int dst[SRT_MOE_MAXP];  // which row of h each pair reads and of y it writes
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
// z [*, Dl] fp32; h [*, I] fp32: pair p writes row dst[p].
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
  float* hp = h + (long long)tab.dst[p] * I;
  if (lane == 0) hp[r0] = situ(acc[0] * gg[r0], acc[2] * ug[r0], beta, beta_inf, lbeta, has_lin);
  if (lane == 1 && r0 + 1 < I) hp[r0 + 1] = situ(acc[1] * gg[r1], acc[3] * ug[r1], beta, beta_inf, lbeta, has_lin);
}

// grid (ceil(Dl / (MOE_WARPS*4)), P), block MOE_WARPS*32, dynamic smem I*4 bytes.
// h [*, I] fp32; y [*, Dl] fp32: pair p reads h row dst[p] and writes y row dst[p].
extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    srt_nvfp4_down(const __grid_constant__ DownTable tab, const float* __restrict__ h, float* __restrict__ y, int Dl,
                   int I) {
  extern __shared__ f32x4 smem_dn[];
  float* xs = (float*)smem_dn;
  const int p = blockIdx.y;
  stage_row(xs, h + (long long)tab.dst[p] * I, I);
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
    if (lane == s && r0 + s < Dl) y[(long long)tab.dst[p] * Dl + r0 + s] = v * dg[rr[s]];
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

// ============================ tensor-core path (mma.sync, sm_80+) ============================
//
// Same math, but the 16-row x 16-k products run on tensor cores. Per warp: two 16-row tiles
// (gate and up rows r0..r0+15, or down rows r0..r0+31) share the activation operand B.
//  * A (weights): lane (g = lane/4, c = lane%4) streams 16 bytes (32 elements = 2 scale groups)
//    of rows g and g+8 per 128-column block; each nibble pair is decoded in registers to fp16
//    (e2m1 * 2^-14, exact) and multiplied by its E4M3 block scale in fp16 (exact: the product
//    has <= 6 significant bits and lies on the fp16 grid down to 2^-24).
//  * B (activation): x * 2^s (s a power of two putting max|x| in [2^14, 2^15)) split exactly
//    enough into fp16 hi + lo (|x - hi - lo| <= 2^-22 |x|); column 0 = hi, column 1 = lo.
//  * The k order inside a 128-column block is a fixed permutation shared by A and B. Each block
//    is summed on the tensor cores (8 k-steps from zero), then added to fp32 registers in block
//    order (round to nearest), so the result is deterministic and does not depend on T.
// Shared memory: xh, xl [in/32 chunks][20] u32 (16 fp16 pairs per chunk, padded).

#define MMA_XSTRIDE 20

// Stage x (n floats, n % 32 == 0) as prescaled fp16 hi/lo pairs; returns 2^(14 - s), the
// factor that undoes the prescale and the decode's 2^-14.
SRT_DEV float stage_x_f16(u32* xh, u32* xl, const float* __restrict__ x, int n, float* red) {
  float m = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, fabsf(x[i]));
  m = block_max(m, red);
  int e = 0;
  if (m > 0.0f) frexpf(m, &e);  // m < 2^e
  const int s = max(-100, min(100, 15 - e));
  const float up = ldexpf(1.0f, s);
  const int nch = n >> 5;
  for (int idx = threadIdx.x; idx < nch * 16; idx += blockDim.x) {
    const int ch = idx >> 4, r = idx & 15, w = r >> 2, j = r & 3;
    const int e0 = ch * 32 + w * 8 + j;  // pair (e0, e0 + 4): the order e2m1_pair decodes
    const float a = x[e0] * up, b = x[e0 + 4] * up;
    const u32 hh = f2h2(a, b);
    float ah, bh;
    h2_to_f32(hh, ah, bh);
    xh[ch * MMA_XSTRIDE + r] = hh;
    xl[ch * MMA_XSTRIDE + r] = f2h2(a - ah, b - bh);
  }
  __syncthreads();
  return ldexpf(1.0f, 14 - s);
}

SRT_DEV u32 scale_h2(u32 byte) {
  const float v = e4m3_to_f32(byte);
  return f2h2(v, v);
}

// One warp: two 16-row NVFP4 tiles (row pointers for rows g and g+8 of each tile) against
// the staged x. acc[t][0..3] = this lane's mma accumulators (c == 0 lanes hold the results).
SRT_DEV void nvfp4_mma_2tiles(const u8* const wp[2][2], const u8* const sp[2][2], const u32* xh, const u32* xl,
                              int in, float acc[2][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int nch = in >> 5;
  const u32* xsrc = g == 0 ? xh : xl;
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[t][j] = 0.0f;
  for (int kb0 = 0; kb0 * 4 < nch; kb0 += 2) {
    u32x4 w[2][2][2];  // [kblock][tile][row g / g+8]
    u32 sv[2][2][2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int ch = (kb0 + u) * 4 + c;
      const bool ok = ch < nch;
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          w[u][t][r] = ok ? ld_stream16(wp[t][r] + (long long)ch * 16) : u32x4{0u, 0u, 0u, 0u};
          sv[u][t][r] = ok ? (u32) * (const u16*)(sp[t][r] + (long long)ch * 2) : 0u;
        }
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int ch = (kb0 + u) * 4 + c;
      if ((kb0 + u) * 4 >= nch) break;  // warp-uniform
      u32 bq[16];
      if (g < 2 && ch < nch) {
        const u32x4* src = (const u32x4*)(xsrc + ch * MMA_XSTRIDE);
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const u32x4 b = src[v];
          bq[4 * v] = b.x; bq[4 * v + 1] = b.y; bq[4 * v + 2] = b.z; bq[4 * v + 3] = b.w;
        }
      } else {
#pragma unroll
        for (int v = 0; v < 16; ++v) bq[v] = 0u;
      }
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const u32 s0lo = scale_h2(sv[u][t][0] & 0xffu), s0hi = scale_h2(sv[u][t][0] >> 8);
        const u32 s1lo = scale_h2(sv[u][t][1] & 0xffu), s1hi = scale_h2(sv[u][t][1] >> 8);
        const u32 q0[4] = {w[u][t][0].x, w[u][t][0].y, w[u][t][0].z, w[u][t][0].w};
        const u32 q1[4] = {w[u][t][1].x, w[u][t][1].y, w[u][t][1].z, w[u][t][1].w};
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int wi = i >> 1, shA = (i & 1) ? 4 : 12, shB = (i & 1) ? 0 : 8;
          const u32 sg0 = i < 4 ? s0lo : s0hi, sg1 = i < 4 ? s1lo : s1hi;
          const u32 a0 = hmul2(e2m1_pair(q0[wi], shA), sg0);
          const u32 a1 = hmul2(e2m1_pair(q1[wi], shA), sg1);
          const u32 a2 = hmul2(e2m1_pair(q0[wi], shB), sg0);
          const u32 a3 = hmul2(e2m1_pair(q1[wi], shB), sg1);
          mma16816(d, a0, a1, a2, a3, bq[2 * i], bq[2 * i + 1]);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[t][j] += d[j];
      }
    }
  }
}

// grid (ceil(I / (16 * warps)), P), block warps*32, dynamic smem (Dl/32)*MMA_XSTRIDE*8 bytes.
extern "C" __global__ void __launch_bounds__(256)
    srt_nvfp4_gateup_mma(const __grid_constant__ GateUpTable tab, const float* __restrict__ z, float* __restrict__ h,
                         int I, int Dl, float beta, int beta_inf, float lbeta, int has_lin) {
  extern __shared__ u32x4 smem_gm[];
  __shared__ float red[32];
  u32* xh = (u32*)smem_gm;
  u32* xl = xh + (Dl >> 5) * MMA_XSTRIDE;
  const int p = blockIdx.y;
  const float unscale = stage_x_f16(xh, xl, z + (long long)tab.row[p] * Dl, Dl, red);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const int r0 = (blockIdx.x * (blockDim.x >> 5) + warp) * 16;
  if (r0 >= I) return;
  const long long rb = Dl >> 1, sb = Dl >> 4;
  const int ra = min(r0 + g, I - 1), rc = min(r0 + g + 8, I - 1);
  const u8* gp = (const u8*)tab.gate_packed[p];
  const u8* gs = (const u8*)tab.gate_scales[p];
  const u8* upk = (const u8*)tab.up_packed[p];
  const u8* us = (const u8*)tab.up_scales[p];
  const u8* const wp[2][2] = {{gp + ra * rb, gp + rc * rb}, {upk + ra * rb, upk + rc * rb}};
  const u8* const sp[2][2] = {{gs + ra * sb, gs + rc * sb}, {us + ra * sb, us + rc * sb}};
  float acc[2][4];
  nvfp4_mma_2tiles(wp, sp, xh, xl, Dl, acc);
  if ((lane & 3) == 0) {
    const float* gg = (const float*)tab.gate_global[p];
    const float* ug = (const float*)tab.up_global[p];
    float* hp = h + (long long)tab.dst[p] * I;
    if (r0 + g < I)
      hp[r0 + g] = situ((acc[0][0] + acc[0][1]) * unscale * gg[ra],
                                          (acc[1][0] + acc[1][1]) * unscale * ug[ra], beta, beta_inf, lbeta, has_lin);
    if (r0 + g + 8 < I)
      hp[r0 + g + 8] = situ((acc[0][2] + acc[0][3]) * unscale * gg[rc],
                                              (acc[1][2] + acc[1][3]) * unscale * ug[rc], beta, beta_inf, lbeta, has_lin);
  }
}

// grid (ceil(Dl / (32 * warps)), P), block warps*32, dynamic smem (I/32)*MMA_XSTRIDE*8 bytes.
extern "C" __global__ void __launch_bounds__(256)
    srt_nvfp4_down_mma(const __grid_constant__ DownTable tab, const float* __restrict__ h, float* __restrict__ y,
                       int Dl, int I) {
  extern __shared__ u32x4 smem_dm[];
  __shared__ float red[32];
  u32* xh = (u32*)smem_dm;
  u32* xl = xh + (I >> 5) * MMA_XSTRIDE;
  const int p = blockIdx.y;
  const float unscale = stage_x_f16(xh, xl, h + (long long)tab.dst[p] * I, I, red);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const int r0 = (blockIdx.x * (blockDim.x >> 5) + warp) * 32;
  if (r0 >= Dl) return;
  const long long rb = I >> 1, sb = I >> 4;
  int rr[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) rr[q] = min(r0 + g + 8 * q, Dl - 1);  // tile 0: g, g+8; tile 1: g+16, g+24
  const u8* dp = (const u8*)tab.packed[p];
  const u8* ds = (const u8*)tab.scales[p];
  const u8* const wp[2][2] = {{dp + rr[0] * rb, dp + rr[1] * rb}, {dp + rr[2] * rb, dp + rr[3] * rb}};
  const u8* const sp[2][2] = {{ds + rr[0] * sb, ds + rr[1] * sb}, {ds + rr[2] * sb, ds + rr[3] * sb}};
  float acc[2][4];
  nvfp4_mma_2tiles(wp, sp, xh, xl, I, acc);
  if ((lane & 3) == 0) {
    const float* dg = (const float*)tab.global[p];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int row = r0 + g + 8 * q;
      const float v = (acc[q >> 1][(q & 1) * 2] + acc[q >> 1][(q & 1) * 2 + 1]) * unscale * dg[rr[q]];
      if (row < Dl) y[(long long)tab.dst[p] * Dl + row] = v;
    }
  }
}

