// NVFP4 routed-expert FFN for decode, reading experts straight from their device slots.
//
// One launch covers up to MOE_MAXP (row t, expert) pairs of one layer whose slot pointers
// travel by value in a __grid_constant__ table (no host->device copy per step), or, in a CUDA
// graph, up to MOE_MAXP_DT pairs in a table `srt_moe_tables` builds on the GPU from the
// routed ids (the *_dt entries).
// A pair's rows of h and y are named in the table (dst), so the host may launch resident experts
// first and experts still in flight after their copy events, with the same result bits.
//   1. srt_nvfp4_gateup: h[p, i] = situ_glu(gate_e[i, :] . z[t], up_e[i, :] . z[t])      [P, I]
//   2. srt_nvfp4_down:   y[p, d] = down_e[d, :] . h[p]                                      [P, Dl]
//   3. srt_moe_combine:  out[t, d] = sum_j (j ascending) w[t, j] * y[t*k + j, d]           [T, Dl]
// NVFP4 matrix [out, in]: packed u8 [out, in/2] (low nibble = even element, E2M1),
// scales u8 [out, in/16] (E4M3), global fp32 [out]. A row's dot product is
//   global[row] * sum_g e4m3(scale_g) * (sum_{i in g} e2m1_i * x_i)
// (exactly the dequantised dot in real arithmetic; fp32 rounding in a fixed order).
// Two implementations of steps 1-2: the tensor-core kernels (*_tc2x2 below up to 8 rows of one
// expert a block, *_st2x1 from rows staged once per call; in % 128 == 0) and the CUDA-core
// kernels (fp32 FMA; in % 32 == 0). In the CUDA-core kernels each warp owns 4 row
// streams; each lane reads 16 bytes (32 weights = 2 scale groups) of each stream per step, the
// activation comes from shared memory and is reused by the 4 streams.
#include "common.cuh"

#ifndef MOE_MAXP
#error "MOE_MAXP is passed by the host (-DMOE_MAXP=..., streamrt/backends/kernel_defines.py)"
#endif
#ifndef MOE_WARPS
#error "MOE_WARPS is passed by the host (-DMOE_WARPS=..., streamrt/backends/kernel_defines.py)"
#endif

#ifndef MOE_MAXP_DT
#error "MOE_MAXP_DT is passed by the host (-DMOE_MAXP_DT=..., streamrt/backends/kernel_defines.py)"
#endif

// The pointer tables of up to N pairs: by value N = MOE_MAXP (a launch's parameters are
// small), in device memory N = MOE_MAXP_DT (a whole batch's pairs in one launch, so a block
// can take up to TC_TOKENS rows of one expert from anywhere in the batch).
template <int N>
struct GateUpTableN {
  u64 gate_packed[N], gate_scales[N], gate_global[N];
  u64 up_packed[N], up_scales[N], up_global[N];
  int row[N];  // which row of z each pair reads
  int dst[N];  // which row of h (and later y) each pair writes
};

template <int N>
struct DownTableN {
  u64 packed[N], scales[N], global[N];
  int dst[N];  // which row of h each pair reads and of y it writes
};

typedef GateUpTableN<MOE_MAXP> GateUpTable;
typedef DownTableN<MOE_MAXP> DownTable;
typedef GateUpTableN<MOE_MAXP_DT> GateUpTableDt;
typedef DownTableN<MOE_MAXP_DT> DownTableDt;

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
template <class Tab>
SRT_DEV void gateup_cc(const Tab& tab, const float* __restrict__ z, float* __restrict__ h, int I, int Dl,
                       float beta, int beta_inf, float lbeta, int has_lin, float* xs) {
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
template <class Tab>
SRT_DEV void down_cc(const Tab& tab, const float* __restrict__ h, float* __restrict__ y, int Dl, int I,
                     float* xs) {
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

// Entry points: the table by value (the host's), or in device memory (`srt_moe_tables`' output,
// one table per MOE_MAXP_DT pairs; CUDA graphs replay these with tables rebuilt on the GPU).
extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    srt_nvfp4_gateup(const __grid_constant__ GateUpTable tab, const float* __restrict__ z, float* __restrict__ h,
                     int I, int Dl, float beta, int beta_inf, float lbeta, int has_lin) {
  extern __shared__ f32x4 smem_gu[];
  gateup_cc(tab, z, h, I, Dl, beta, beta_inf, lbeta, has_lin, (float*)smem_gu);
}
extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    srt_nvfp4_gateup_dt(const GateUpTableDt* __restrict__ tab, const float* __restrict__ z, float* __restrict__ h,
                        int I, int Dl, float beta, int beta_inf, float lbeta, int has_lin) {
  extern __shared__ f32x4 smem_gu_dt[];
  gateup_cc(*tab, z, h, I, Dl, beta, beta_inf, lbeta, has_lin, (float*)smem_gu_dt);
}
extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    srt_nvfp4_down(const __grid_constant__ DownTable tab, const float* __restrict__ h, float* __restrict__ y, int Dl,
                   int I) {
  extern __shared__ f32x4 smem_dn[];
  down_cc(tab, h, y, Dl, I, (float*)smem_dn);
}
extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    srt_nvfp4_down_dt(const DownTableDt* __restrict__ tab, const float* __restrict__ h, float* __restrict__ y, int Dl,
                      int I) {
  extern __shared__ f32x4 smem_dn_dt[];
  down_cc(*tab, h, y, Dl, I, (float*)smem_dn_dt);
}

// The tables of P = T*k pairs in device memory, from the routed ids [T, k] and a layer's pointer
// table experts [E, EXPERT_COLS] (u64: gate packed / scales / global, up ..., down ...;
// ExpertPointers' order, backends/expert_pointers.py). Pair p = t*k + j reads z row t and writes
// h / y row p; the pairs are ordered by (expert, p), as the host orders them (a batch's pairs of
// one expert adjacent; a pair's bits do not depend on its place). Pair p's place
// r = #{q : (e_q, q) < (e_p, p)} is entry r % MOE_MAXP_DT of table r / MOE_MAXP_DT.
// With `groups`, each table's list of groups follows (moe_groups).
#ifndef EXPERT_COLS
#error "EXPERT_COLS is passed by the host (-DEXPERT_COLS=..., streamrt/backends/kernel_defines.py)"
#endif
#if MOE_MAXP_DT > 1024
#error "MOE_MAXP_DT > 1024: srt_moe_tables scans a table's entries a thread each"
#endif

// Inclusive max and exclusive sum over the block, in thread order (`red`: 32 ints of shared memory).
SRT_DEV int block_scan_max(int v, int* red) {
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(SRT_FULL, v, o);
    if (l >= o) v = max(v, u);
  }
  __syncthreads();
  if (l == 31) red[w] = v;
  __syncthreads();
  for (int i = 0; i < w && i < nw; ++i) v = max(v, red[i]);
  return v;
}

SRT_DEV int block_scan_sum(int v, int* red, int& total) {
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = (blockDim.x + 31) >> 5;
  int s = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(SRT_FULL, s, o);
    if (l >= o) s += u;
  }
  __syncthreads();
  if (l == 31) red[w] = s;
  __syncthreads();
  total = 0;
  for (int i = 0; i < nw; ++i) {
    if (i < w) s += red[i];
    total += red[i];
  }
  return s - v;
}

// The groups of one table (n entries): each expert's run of entries cut into groups of up to
// cap, in place order. out: their count G, then each group's first entry, then n (group g's
// size is out[2 + g] - out[1 + g]). The staged FFN blocks take one group each (blockIdx.y), so
// their grid holds as many groups as there can be, not one block row per pair.
SRT_DEV void moe_groups(const u64* key, int n, int cap, int* __restrict__ out, int* red) {
  const int i = threadIdx.x;
  const bool in = i < n;
  const bool starts = in && (i == 0 || key[i - 1] != key[i]);  // a new expert's run
  const int first = block_scan_max(starts ? i : 0, red);
  const bool leads = in && (i - first) % cap == 0;
  int count;
  const int g = block_scan_sum(leads, red, count);
  if (leads) out[1 + g] = i;
  if (i == 0) {
    out[0] = count;
    out[1 + count] = n;
  }
}

// grid 1, block a multiple of 32 up to 1024; with groups (MOE_MAXP_DT + 2 ints per table)
// MOE_MAXP_DT, as the groups' scan takes a table's entries a thread each. The key is read
// without __restrict__: this kernel writes it (a non-coherent load could miss that).
extern "C" __global__ void __launch_bounds__(MOE_MAXP_DT)
    srt_moe_tables(const long long* __restrict__ ids, const u64* __restrict__ experts, int P, int k,
                   GateUpTableDt* __restrict__ gtab, DownTableDt* __restrict__ dtab, int cap, int* __restrict__ groups) {
  __shared__ long long keys[MOE_MAXP_DT];  // (expert, pair) of a tile of pairs
  __shared__ int red[32];
  for (int p0 = 0; p0 < P; p0 += blockDim.x) {  // the same trip count in every thread (barriers)
    const int p = p0 + threadIdx.x;
    const long long kp = p < P ? (ids[p] << 32) | p : 0;
    int r = 0;
    for (int q0 = 0; q0 < P; q0 += MOE_MAXP_DT) {
      const int m = min(MOE_MAXP_DT, P - q0);
      __syncthreads();  // the tile before is read
      for (int j = threadIdx.x; j < m; j += blockDim.x) keys[j] = (ids[q0 + j] << 32) | (q0 + j);
      __syncthreads();
      if (p < P)
        for (int j = 0; j < m; ++j) r += keys[j] < kp;
    }
    if (p >= P) continue;
    const long long ep = kp >> 32;
    const int c = r / MOE_MAXP_DT, i = r - c * MOE_MAXP_DT;
    const u64* e = experts + ep * EXPERT_COLS;
    GateUpTableDt& g = gtab[c];
    DownTableDt& d = dtab[c];
    g.gate_packed[i] = e[0];
    g.gate_scales[i] = e[1];
    g.gate_global[i] = e[2];
    g.up_packed[i] = e[3];
    g.up_scales[i] = e[4];
    g.up_global[i] = e[5];
    g.row[i] = p / k;
    g.dst[i] = p;
    d.packed[i] = e[6];
    d.scales[i] = e[7];
    d.global[i] = e[8];
    d.dst[i] = p;
  }
  if (groups == nullptr) return;
  __syncthreads();  // every table entry is written (and visible to the block)
  for (int c = 0; c * MOE_MAXP_DT < P; ++c)
    moe_groups(gtab[c].gate_packed, min(MOE_MAXP_DT, P - c * MOE_MAXP_DT), cap,
               groups + c * (MOE_MAXP_DT + 2), red);
}

// out[t, d] = w[t,0]*y[t*k, d] + w[t,1]*y[t*k+1, d] + ... (left to right, each product rounded).
// ready (tensor-core path): the gate+up blocks done per pair, zeroed here for the next call.
extern "C" __global__ void srt_moe_combine(const float* __restrict__ y, const float* __restrict__ w,
                                           float* __restrict__ out, int T, int k, int Dl, int* ready) {
  pdl_launch_dependents();  // a programmatic launch after this one may queue its weight copies now
  pdl_wait();  // y is the down kernel's output
  const long long n = (long long)T * Dl;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const long long t = i / Dl, d = i - t * Dl;
    float acc = 0.0f;
    for (int j0 = 0; j0 < k; j0 += 16) {  // 16 loads in flight, then their products in order
      float v[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) v[j] = j0 + j < k ? y[(t * k + j0 + j) * Dl + d] : 0.0f;
#pragma unroll
      for (int j = 0; j < 16; ++j)
        if (j0 + j < k) {
          const float pj = __fmul_rn(w[t * k + j0 + j], v[j]);
          acc = j0 + j == 0 ? pj : __fadd_rn(acc, pj);
        }
    }
    out[i] = acc;
    if (ready != nullptr && i < T * k) ready[i] = 0;
  }
}

// ============================ tensor-core path (mma.sync, sm_89+) ============================
//
// Same math; the products run on tensor cores, and one block takes up to TC_TOKENS pairs of one
// expert (its rows of z, or of h), so a batch reads and decodes each expert's weights once per
// group of rows instead of once per row. Per warp: two 16-row tiles (gate and up rows
// r0..r0+15, or down rows r0..r0+31) share the activation operand B.
//  * A (weights): lane (g = lane/4, c = lane%4) takes 16 bytes (32 elements = 2 scale groups)
//    of rows g and g+8 per 128-column block, decoded in registers to fp16 (e2m1 * 2^-14, exact;
//    e2m1x8_h2) and multiplied by the element's E4M3 block scale in fp16, also exact (a product
//    of a 2-bit and a 4-bit significand, a multiple of 2^-24 below 0.17). The k order inside a
//    word is the decoder's; B is staged in the same order.
//  * B (activation): x * 2^s per row (s a power of two putting max|x| in [2^14, 2^15)) split
//    exactly enough into fp16 hi + lo (|x - hi - lo| <= 2^-22 |x|). Column n = 2j + h of B is
//    row j of a set of four rows of the group (h = 0: hi, 1: lo), so the tensor core sums a
//    whole weight row against each column in fp32, in a fixed order (two chains, tc_rows):
//    D[r][2j] + D[r][2j+1] is row j's dot product, unscaled. Lane (g, c) ends holding rows
//    j = c (and 4 + c) of its tile rows g and g+8. A column's sum does not depend on the other
//    columns: a row's bits do not depend on the rows beside it, T, the block shape or the
//    pipeline depth.
//  * Weights and scales travel global -> shared by cp.async through a ring of S stages per
//    warp, KBS 128-column blocks of the warp's 32 rows per stage, so S - 1 stages are in flight
//    while one is decoded, without holding them in registers.
//  * The copies are laid out for the memory system, not for the mma: 8 * KBS consecutive lanes
//    copy KBS * 64 contiguous bytes of one row (whole 128-byte lines; loading straight into the
//    mma layout requests 64-byte pieces of 16 rows at once and measured 0.50-0.54 of the copy
//    rate against 0.67 for this). In shared memory each row's 16-byte chunks are swizzled
//    (tc_swizzle), so both the copies and the mma-layout reads are free of bank conflicts.
//    With 16-byte aligned scale rows a stage's scales of one row (KBS = 2) are one copy.
//  * All three kernels are launched programmatically (sm_90+): gate+up queues its first weight
//    stages while the kernel before it ends and reads z after pdl_wait(); once its blocks are
//    past that, down blocks may take the slots its last wave leaves free and queue their first
//    weight stages. A down block then waits for its own group only: each gate+up block adds one
//    to ready[the group's first pair] when its rows of h are written, so the first experts' down
//    work runs while the last experts' gate+up does (0.78 -> 0.81 of the copy rate). The sum
//    waits for the down grid and zeroes the counts for the next call.
// Requires in % 128 == 0 and 8-byte aligned scale rows; other shapes use the CUDA-core kernels.
// Shared memory: per row of the group (up to `cap`) xh, xl [in/32 chunks][20] u32 (16 fp16
// pairs per chunk, padded; tc_xwords each), then per warp S * KBS * (TC_WBYTES + TC_SBYTES)
// bytes of ring.

#ifndef TC_TOKENS  // the most pairs of one expert one block takes
#error "TC_TOKENS is passed by the host (-DTC_TOKENS=..., streamrt/backends/kernel_defines.py)"
#elif TC_TOKENS > 8
#error "TC_TOKENS > 8: the mma's 8 columns hold 4 rows (hi, lo), tc_rows two sets of them"
#endif
#ifndef TC_XSTRIDE  // u32 words of one staged 32-element chunk (16 fp16 pairs, padded)
#error "TC_XSTRIDE is passed by the host (-DTC_XSTRIDE=..., streamrt/backends/kernel_defines.py)"
#endif

// u32 words of one staged hi (or lo) row, a multiple of 16 and not of 32: the 8 lanes of one
// phase of a B load read a row's hi and lo arrays at the same chunks, in different banks.
SRT_DEV int tc_xwords(int in) {
  const int w = (in >> 5) * TC_XSTRIDE;
  return w + ((w & 31) == 0 ? 16 : 0);
}

// 16-byte load from L2, past L1: x may have been written during this launch by another grid's
// blocks (the down kernel starting on a group's gate+up count), which L1 does not see.
SRT_DEV f32x4 ld_cg4(const f32x4* p) {
  f32x4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p) : "memory");
  return v;
}

// Eight elements (a, b) of a row, scaled by `up`, as the B operand holds them: fp16 pairs
// (0, 2), (1, 3), (4, 6), (5, 7) (the order e2m1x8_h2 decodes), hi in hh and lo in ll.
SRT_DEV void stage_words(f32x4 a, f32x4 b, float up, u32x4& hh, u32x4& ll) {
  const float lo[4] = {a.x * up, a.y * up, b.x * up, b.y * up};
  const float hi[4] = {a.z * up, a.w * up, b.z * up, b.w * up};
  u32 h[4], l[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    h[j] = f2h2(lo[j], hi[j]);
    float ah, bh;
    h2_to_f32(h[j], ah, bh);
    l[j] = f2h2(lo[j] - ah, hi[j] - bh);
  }
  hh = u32x4{h[0], h[1], h[2], h[3]};
  ll = u32x4{l[0], l[1], l[2], l[3]};
}

// One item (chunk ch, word w) of the staged activation: elements ch*32 + w*8 + 0..7 (a, b),
// scaled by `up`, -> 4 u32 of xh and of xl at [ch][w*4 .. w*4+3].
SRT_DEV void stage_item(u32* xh, u32* xl, int it, f32x4 a, f32x4 b, float up) {
  const int off = (it >> 2) * TC_XSTRIDE + (it & 3) * 4;
  stage_words(a, b, up, *(u32x4*)(xh + off), *(u32x4*)(xl + off));
}

SRT_DEV float absmax4(f32x4 v) { return fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))); }

// v[j] for a j known only at run time, without an indexed array (which would sit in local memory).
SRT_DEV float pick(const float v[TC_TOKENS], int j) {
  float r = v[0];
#pragma unroll
  for (int i = 1; i < TC_TOKENS; ++i) r = j == i ? v[i] : r;
  return r;
}

// Items i + u * nt (u < 4; 8 elements each, of row iu / items) of rows x + idx[j] * in, all four
// loads in flight, into a[u], b[u] (zeros from `total` on); each row's running max|x| into m.
template <int R>
SRT_DEV void load_items_max(const float* __restrict__ x, const int* idx, int in, int items, int total, int i, int nt,
                            f32x4 a[4], f32x4 b[4], float m[R]) {
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int iu = i + u * nt, j = iu / items;
    const bool in_range = iu < total;
    const f32x4* x4 = (const f32x4*)(x + (long long)idx[in_range ? j : 0] * in) + (iu - j * items) * 2;
    a[u] = in_range ? ld_cg4(x4) : f32x4{0.0f, 0.0f, 0.0f, 0.0f};
    b[u] = in_range ? ld_cg4(x4 + 1) : f32x4{0.0f, 0.0f, 0.0f, 0.0f};
  }
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int j = (i + u * nt) / items;
    const float v = fmaxf(absmax4(a[u]), absmax4(b[u]));
#pragma unroll
    for (int jj = 0; jj < R; ++jj) m[jj] = jj == j ? fmaxf(m[jj], v) : m[jj];
  }
}

// A row's prescale from its max|x| m: up = 2^s puts m in [2^14, 2^15), unscale = 2^(14 - s).
SRT_DEV void prescale_of(float m, float& up, float& unscale) {
  int e = 0;
  if (m > 0.0f) frexpf(m, &e);  // m < 2^e
  const int s = max(-100, min(100, 15 - e));
  up = ldexpf(1.0f, s);
  unscale = ldexpf(1.0f, 14 - s);
}

// Every row's max over the block from the threads' running maxima m (per warp, then across the
// warps; red: 32 * R floats), and its prescale: up[j] = 2^s_j puts max|x_j| in [2^14, 2^15),
// unscale[j] = 2^(14 - s_j). Every thread gets every row's (nt: the block's threads).
template <int R>
SRT_DEV void row_prescales(float m[R], float* red, float up[R], float unscale[R], int nt) {
  const int nw = (nt + 31) >> 5, w = threadIdx.x >> 5;
#pragma unroll
  for (int j = 0; j < R; ++j) m[j] = warp_max(m[j]);
  if ((threadIdx.x & 31) == 0)
#pragma unroll
    for (int j = 0; j < R; ++j) red[j * 32 + w] = m[j];
  __syncthreads();
#pragma unroll
  for (int j = 0; j < R; ++j) {
    float mj = red[j * 32];
    for (int v = 1; v < nw; ++v) mj = fmaxf(mj, red[j * 32 + v]);
    prescale_of(mj, up[j], unscale[j]);
  }
}

// Stage rows x + idx[j] * in (j < n <= TC_TOKENS; in % 32 == 0, 16-byte aligned) as prescaled
// fp16 hi/lo pairs: row j's hi at xs + 2j * tc_xwords(in), its lo one array on. unscale[j] is
// 2^(14 - s_j), the factor that undoes row j's prescale and the decode's 2^-14. Every block of a
// launch stages its own copy before its rows can start, and the down kernel's blocks do it
// while the memory system is loaded: up to 4 items per thread are read once, all loads in
// flight, and kept in registers for the conversion; more rows take a second read.
SRT_DEV void stage_rows_f16(u32* xs, const float* __restrict__ x, const int* idx, int n, int in, float* red,
                            float unscale[TC_TOKENS]) {
  const int items = in >> 3, total = n * items, nt = blockDim.x, words = tc_xwords(in);
  const bool held = total <= 4 * nt;
  f32x4 a[4], b[4];
  float m[TC_TOKENS], up[TC_TOKENS];
#pragma unroll
  for (int j = 0; j < TC_TOKENS; ++j) m[j] = 0.0f;
  for (int i = threadIdx.x; i < total; i += 4 * nt) load_items_max<TC_TOKENS>(x, idx, in, items, total, i, nt, a, b, m);
  row_prescales<TC_TOKENS>(m, red, up, unscale, nt);
  if (held) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int iu = threadIdx.x + u * nt, j = iu / items;
      if (iu < total) stage_item(xs + 2 * j * words, xs + (2 * j + 1) * words, iu - j * items, a[u], b[u], pick(up, j));
    }
  } else {
    for (int iu = threadIdx.x; iu < total; iu += nt) {
      const int j = iu / items, it = iu - j * items;
      const f32x4* x4 = (const f32x4*)(x + (long long)idx[j] * in) + it * 2;
      stage_item(xs + 2 * j * words, xs + (2 * j + 1) * words, it, ld_cg4(x4), ld_cg4(x4 + 1), pick(up, j));
    }
  }
  __syncthreads();
}

// The pairs of this block: entries p .. p + n - 1 of a table ordered by expert (srt_moe_tables,
// the host's packer), so that an expert's pairs are adjacent and `key` (one of its pointers) is
// equal along them. Each expert's run is cut into groups of `cap`; the block of a group's first
// entry takes the group, every other block returns 0 and exits.
SRT_DEV int group_size(const u64* key, int p, int np, int cap) {
  const u64 e = key[p];
  int first = p;
  while (first > 0 && key[first - 1] == e) --first;
  if ((p - first) % cap) return 0;
  int n = 1;
  while (n < cap && p + n < np && key[p + n] == e) ++n;
  return n;
}

// The group a staged block takes (blockIdx.y): entry g of srt_moe_tables' list `groups` (the
// device tables' kernels), or, without one (the host's tables), the group pair blockIdx.y leads,
// if it leads one. Its size (0: no group, the block has nothing to do) and its first entry.
SRT_DEV int block_group_size(const u64* key, const int* groups, int cap) {
  if (groups == nullptr) return group_size(key, blockIdx.y, gridDim.y, cap);
  const int g = blockIdx.y;
  return g < groups[0] ? groups[2 + g] - groups[1 + g] : 0;
}
SRT_DEV int block_group_first(const int* groups) { return groups != nullptr ? groups[1 + blockIdx.y] : blockIdx.y; }

// The entry that leads p's group when the expert's run is cut into groups of `cap`.
SRT_DEV int group_lead(const u64* key, int p, int cap) {
  const u64 e = key[p];
  int first = p;
  while (first > 0 && key[first - 1] == e) --first;
  return p - (p - first) % cap;
}

#ifndef TC_WBYTES  // one 128-column block of 32 rows: weights
#error "TC_WBYTES is passed by the host (-DTC_WBYTES=..., streamrt/backends/kernel_defines.py)"
#endif
#ifndef TC_SBYTES  // ... and its E4M3 scales
#error "TC_SBYTES is passed by the host (-DTC_SBYTES=..., streamrt/backends/kernel_defines.py)"
#endif

// Two E4M3 bytes (low byte first) -> an fp16 pair, exact (sm_89+ conversion).
SRT_DEV u32 e4m3x2_h2(u32 v) {
  u32 h;
  asm("{\n\t.reg .b16 s;\n\tcvt.u16.u32 s, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, s;\n\t}" : "=r"(h) : "r"(v));
  return h;
}

// A warp's 32 rows: 4 slots of 8 rows (slot q = rows row0[q] .. row0[q] + 7 of matrix q, clamped
// to nrows - 1); the two tiles of the mma are slots (0, 1) and (2, 3).
struct TcRows {
  const u8* pk[4];
  const u8* sc[4];
  int row0[4];
  int nrows;
  long long rb, sb;  // bytes per row: packed, scales
  int nkb;           // 128-column blocks per row
  int sc16;          // scale rows 16-byte aligned: a stage's scales of a row (KBS = 2) in one copy
};

// Whether every scale row of these matrices starts 16-byte aligned.
SRT_DEV int scales_aligned16(const u8* a, const u8* b, long long sb) {
  return sb % 16 == 0 && (((unsigned long long)a | (unsigned long long)b) & 15) == 0;
}

// Where chunk j of row r (r & 7 = gg) sits within the row in shared memory. With KBS = 1 a
// row is 64 bytes and rows g, g+1 already fall in different bank halves.
template <int KBS>
SRT_DEV int tc_swizzle(int j, int gg) {
  return KBS >= 2 ? j ^ ((gg & 1) << 2) : j;
}

// Queue stage st (blocks st*KBS + 0..KBS-1; those from nkb on zero-filled) into ring slot st % S.
template <int S, int KBS>
SRT_DEV void tc_issue(int st, const TcRows& R, u32 wbuf, u32 sbuf) {
  const int lane = threadIdx.x & 31, kb0 = st * KBS, nkb = R.nkb;
  if (kb0 < nkb) {
    const u32 wst = wbuf + (st % S) * KBS * TC_WBYTES, sst = sbuf + (st % S) * KBS * TC_SBYTES;
#pragma unroll
    for (int it = 0; it < 4 * KBS; ++it) {  // row r: 4 * KBS chunks, copied by as many consecutive lanes
      const int r = it * (8 / KBS) + lane / (4 * KBS), j = lane % (4 * KBS), q = r >> 3, gg = r & 7;
      const int row = min(R.row0[q] + gg, R.nrows - 1), ok = kb0 + (j >> 2) < nkb;
      cp_async16(wst + r * (KBS * 64) + (tc_swizzle<KBS>(j, gg) << 4), R.pk[q] + row * R.rb + (ok ? (kb0 * 4 + j) * 16 : 0),
                 ok ? 16 : 0);
    }
    if (KBS == 2 && R.sc16) {  // scales: lane = row (slot lane / 8), both blocks in one 16-byte copy
      const int q = lane >> 3, gg = lane & 7;  // selects, not an indexed array (which would sit in local memory)
      const int r0 = q == 0 ? R.row0[0] : q == 1 ? R.row0[1] : q == 2 ? R.row0[2] : R.row0[3];
      const u8* sc = q == 0 ? R.sc[0] : q == 1 ? R.sc[1] : q == 2 ? R.sc[2] : R.sc[3];
      cp_async16(sst + lane * 16, sc + min(r0 + gg, R.nrows - 1) * R.sb + kb0 * 8, min(2, nkb - kb0) * 8);
    } else {
#pragma unroll
      for (int q = 0; q < 4; ++q)  // scales: 8 rows x KBS blocks of 8 bytes per slot
        if (lane < 8 * KBS) {
          const int gg = lane / KBS, u = lane % KBS, row = min(R.row0[q] + gg, R.nrows - 1), ok = kb0 + u < nkb;
          cp_async8(sst + ((q * 8 + gg) * KBS + u) * 8, R.sc[q] + row * R.sb + (ok ? (kb0 + u) * 8 : 0), ok ? 8 : 0);
        }
    }
  }
  cp_async_commit();  // an empty group past the end keeps the wait count uniform
}

// 8 E2M1 nibbles (low nibble first) -> 4 fp16 pairs (e0, e2), (e1, e3), (e4, e6), (e5, e7), each
// value e2m1 * 2^-14 exactly. An E2M1 nibble s|e1 e0|m is the E5M2 byte s|0 0 e1 e0|m 0, which is
// the high byte of the fp16 with the same bits: 7 logic ops make the E5M2 bytes of the even and
// of the odd elements, 4 byte permutes place them (11 ops per 8 values; shifting each pair into
// place takes 15).
SRT_DEV void e2m1x8_h2(u32 q, u32 out[4]) {
  const u32 ev = ((q << 1) & 0x0e0e0e0eu) | ((q << 4) & 0x80808080u);
  const u32 od = ((q >> 3) & 0x0e0e0e0eu) | (q & 0x80808080u);
  out[0] = __byte_perm(ev, 0u, 0x1404);
  out[1] = __byte_perm(od, 0u, 0x1404);
  out[2] = __byte_perm(ev, 0u, 0x3424);
  out[3] = __byte_perm(od, 0u, 0x3424);
}

// a * b per fp16 half, rounded to nearest (exact for the scaled weights).
SRT_DEV u32 hmul2(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// acc[t][s]: tile t's sums for rows 4s..4s+3 of the group (n rows, staged at xs; s < SETS,
// SETS = ceil(n / 4)), over the whole row: [0] / [1] row g hi / lo of group row 4s + c, [2] / [3]
// row g + 8. Each word's two mmas feed two accumulators (one chain would put the mma latency
// between every pair), added at the end: the same order for every n, so a row's bits do not
// depend on SETS.
template <int S, int KBS, int SETS>
SRT_DEV void tc_rows(const TcRows& R, const u32* xs, int words, int n, const u8* wring, const u8* sring,
                     float acc[2][2][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int nst = (R.nkb + KBS - 1) / KBS;
  const u32 wbuf = smem_addr(wring), sbuf = smem_addr(sring);
  // B column g: row 4s + g/2 of the group, hi (g even) or lo; rows from n on are zero
  const u32* bsrc[SETS];
  bool bval[SETS];
#pragma unroll
  for (int s = 0; s < SETS; ++s) {
    const int j = 4 * s + (g >> 1);
    bval[s] = j < n;
    bsrc[s] = xs + (2 * j + (g & 1)) * words + c * TC_XSTRIDE;
  }
  float part[2][SETS][2][4];  // [tile][set][first / second mma of a word][fragment]
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int s = 0; s < SETS; ++s)
#pragma unroll
      for (int i = 0; i < 8; ++i) part[t][s][i >> 2][i & 3] = 0.0f;
  for (int st = 0; st < nst; ++st) {
    tc_issue<S, KBS>(st + S - 1, R, wbuf, sbuf);
    cp_async_wait<S - 1>();
    __syncwarp();
    const u8* wst = wring + (st % S) * KBS * TC_WBYTES;
    const u8* sst = sring + (st % S) * KBS * TC_SBYTES;
#pragma unroll
    for (int u = 0; u < KBS; ++u) {
      const int kb = st * KBS + u;
      if (kb >= R.nkb) break;  // warp-uniform
      u32x4 w[4];
      u32 sc[4][2];  // slot q's two scales of this lane's chunk, each in both fp16 halves
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        w[q] = *(const u32x4*)(wst + (q * 8 + g) * (KBS * 64) + (tc_swizzle<KBS>(u * 4 + c, g) << 4));
        const u32 h = e4m3x2_h2(*(const u16*)(sst + ((q * 8 + g) * KBS + u) * 8 + 2 * c));
        sc[q][0] = __byte_perm(h, 0u, 0x1010);
        sc[q][1] = __byte_perm(h, 0u, 0x3232);
      }
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const u32 q0[4] = {w[2 * t].x, w[2 * t].y, w[2 * t].z, w[2 * t].w};
        const u32 q1[4] = {w[2 * t + 1].x, w[2 * t + 1].y, w[2 * t + 1].z, w[2 * t + 1].w};
#pragma unroll
        for (int wi = 0; wi < 4; ++wi) {  // word wi: elements 0-3 then 4-7 of rows g (q0) and g + 8 (q1)
          u32 a0[4], a1[4];
          e2m1x8_h2(q0[wi], a0);
          e2m1x8_h2(q1[wi], a1);
#pragma unroll
          for (int e = 0; e < 4; ++e) {  // words 0-1 are the chunk's first scale group, 2-3 its second
            a0[e] = hmul2(a0[e], sc[2 * t][wi >> 1]);
            a1[e] = hmul2(a1[e], sc[2 * t + 1][wi >> 1]);
          }
#pragma unroll
          for (int s = 0; s < SETS; ++s) {  // B word wi of this lane's column (read per use: fewer live registers)
            const u32x4 b = bval[s] ? *(const u32x4*)(bsrc[s] + kb * 4 * TC_XSTRIDE + 4 * wi) : u32x4{0u, 0u, 0u, 0u};
            mma16816(part[t][s][0], a0[0], a1[0], a0[1], a1[1], b.x, b.y);
            mma16816(part[t][s][1], a0[2], a1[2], a0[3], a1[3], b.z, b.w);
          }
        }
      }
    }
    __syncwarp();  // every lane has read ring slot st % S before a later tc_issue refills it
  }
  cp_async_wait<0>();
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int s = 0; s < SETS; ++s)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][s][i] = part[t][s][0][i] + part[t][s][1][i];
}

// Both instances of tc_rows: rows 0-3 (one B operand per mma) or 0-7 of the group.
template <int S, int KBS>
SRT_DEV void tc_group(const TcRows& R, const u32* xs, int words, int n, const u8* wring, const u8* sring,
                      float acc[2][2][4]) {
  if (n > 4) tc_rows<S, KBS, 2>(R, xs, words, n, wring, sring, acc);
  else tc_rows<S, KBS, 1>(R, xs, words, n, wring, sring, acc);
}

// A tensor-core warp's rows of entry p's expert: gate rows r0..r0+15 (tile 0) and the same up rows
// (tile 1), or down rows r0..r0+31.
template <class Tab>
SRT_DEV TcRows gateup_rows(const Tab& tab, int p, int r0, int I, int Dl) {
  const u8 *gp = (const u8*)tab.gate_packed[p], *gs = (const u8*)tab.gate_scales[p];
  const u8 *upk = (const u8*)tab.up_packed[p], *us = (const u8*)tab.up_scales[p];
  return {{gp, gp, upk, upk}, {gs, gs, us, us}, {r0, r0 + 8, r0, r0 + 8}, I, Dl >> 1, Dl >> 4, Dl >> 7,
          scales_aligned16(gs, us, Dl >> 4)};
}
template <class Tab>
SRT_DEV TcRows down_rows(const Tab& tab, int p, int r0, int Dl, int I) {
  const u8 *dp = (const u8*)tab.packed[p], *ds = (const u8*)tab.scales[p];
  return {{dp, dp, dp, dp}, {ds, ds, ds, ds}, {r0, r0 + 8, r0 + 16, r0 + 24}, Dl, I >> 1, I >> 4, I >> 7,
          scales_aligned16(ds, ds, I >> 4)};
}

// grid (ceil(I / (16 * warps)), pairs), block warps*32, smem cap * 8 * tc_xwords(Dl) + warps * S *
// KBS * (TC_WBYTES + TC_SBYTES). A block takes the group of up to cap pairs its entry leads
// (group_size). With `ready`, each block counts itself done in ready[dst[its first pair]] once
// its rows of h are written (the down kernel waits for its group's count, not for this grid).
template <int S, int KBS, class Tab>
SRT_DEV void gateup_tc(const Tab& tab, const float* __restrict__ z, float* __restrict__ h, int I, int Dl,
                       float beta, int beta_inf, float lbeta, int has_lin, int* ready, int cap, u8* smem, float* red) {
  const int p = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int n = group_size(tab.gate_packed, p, gridDim.y, cap);
  if (n == 0) return;
  const int words = tc_xwords(Dl);
  u32* xs = (u32*)smem;
  const u8* wring = smem + cap * 8 * words + warp * S * KBS * (TC_WBYTES + TC_SBYTES);
  const u8* sring = wring + S * KBS * TC_WBYTES;
  const int r0 = (blockIdx.x * (blockDim.x >> 5) + warp) * 16;
  const TcRows R = gateup_rows(tab, p, r0, I, Dl);
  if (r0 < I)  // weights do not depend on x: start the pipeline before staging it
    for (int st = 0; st < S - 1; ++st) tc_issue<S, KBS>(st, R, smem_addr(wring), smem_addr(sring));
  pdl_wait();  // z may be the kernel before's output (when this one is launched programmatically)
  // The down kernel's blocks may now take SM slots this grid's last wave leaves free. Not before
  // pdl_wait(): they read `ready`, which the kernel before (the last call's sum) zeroes.
  pdl_launch_dependents();
  float unscale[TC_TOKENS];
  float acc[2][2][4];
  stage_rows_f16(xs, z, &tab.row[p], n, Dl, red, unscale);
  if (r0 < I) {
    tc_group<S, KBS>(R, xs, words, n, wring, sring, acc);
    const int ra = min(r0 + g, I - 1), rc = min(r0 + g + 8, I - 1);
    const float* gg = (const float*)tab.gate_global[p];
    const float* ug = (const float*)tab.up_global[p];
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int j = 4 * s + c;
      if (j >= n) break;
      const float u = pick(unscale, j);
      const float* gt = acc[0][s];  // tile 0: gate rows, tile 1: up rows
      const float* ut = acc[1][s];
      float* hp = h + (long long)tab.dst[p + j] * I;
      if (r0 + g < I)
        hp[r0 + g] = situ((gt[0] + gt[1]) * u * gg[ra], (ut[0] + ut[1]) * u * ug[ra], beta, beta_inf, lbeta, has_lin);
      if (r0 + g + 8 < I)
        hp[r0 + g + 8] = situ((gt[2] + gt[3]) * u * gg[rc], (ut[2] + ut[3]) * u * ug[rc], beta, beta_inf, lbeta, has_lin);
    }
  }
  if (ready != nullptr) {
    __syncthreads();  // every warp's rows of h are written
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(&ready[tab.dst[p]], 1);
    }
  }
}

// Wait until *flag >= target (the flag is written by blocks of another grid that is running).
SRT_DEV void wait_count(const int* flag, int target) {
  if (threadIdx.x == 0) {
    int v;
    for (;;) {
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
      if (v >= target) break;
      __nanosleep(32);
    }
  }
  __syncthreads();
}

// grid (ceil(Dl / (32 * warps)), pairs), block warps*32, smem cap * 8 * tc_xwords(I) + warps * S *
// KBS * (TC_WBYTES + TC_SBYTES); the groups are cut as gate+up's are (the same table order),
// gate+up's of up to cap_gu pairs (a multiple of cap: each of its groups holds whole down groups).
// With `ready`, a block starts on its group once ready[dst[the first pair of the gate+up group
// holding it]] reaches `target` (every gate+up block of that group is done) instead of waiting
// for the whole gate+up grid: the down work of the first experts fills the slots the gate+up
// grid's last wave leaves free.
template <int S, int KBS, class Tab>
SRT_DEV void down_tc(const Tab& tab, const float* __restrict__ h, float* __restrict__ y, int Dl, int I,
                     const int* ready, int target, int cap, int cap_gu, u8* smem, float* red) {
  const int p = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int n = group_size(tab.packed, p, gridDim.y, cap);
  if (n == 0) return;
  const int words = tc_xwords(I);
  u32* xs = (u32*)smem;
  const u8* wring = smem + cap * 8 * words + warp * S * KBS * (TC_WBYTES + TC_SBYTES);
  const u8* sring = wring + S * KBS * TC_WBYTES;
  const int r0 = (blockIdx.x * (blockDim.x >> 5) + warp) * 32;
  const TcRows R = down_rows(tab, p, r0, Dl, I);
  pdl_launch_dependents();
  if (r0 < Dl)
    for (int st = 0; st < S - 1; ++st) tc_issue<S, KBS>(st, R, smem_addr(wring), smem_addr(sring));
  if (ready != nullptr) wait_count(ready + tab.dst[group_lead(tab.packed, p, cap_gu)], target);
  else pdl_wait();  // h is the gate+up kernel's output (launched programmatically, this block may be early)
  float unscale[TC_TOKENS];
  float acc[2][2][4];
  stage_rows_f16(xs, h, &tab.dst[p], n, I, red, unscale);
  if (r0 < Dl) {
    tc_group<S, KBS>(R, xs, words, n, wring, sring, acc);
    const float* dg = (const float*)tab.global[p];
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int j = 4 * s + c;
      if (j >= n) break;
      const float u = pick(unscale, j);
      float* yp = y + (long long)tab.dst[p + j] * Dl;
#pragma unroll
      for (int q = 0; q < 4; ++q) {  // slot q: tile q / 2, its rows g (q even) or g + 8
        const int row = r0 + g + 8 * q;
        const float* d = acc[q >> 1][s] + 2 * (q & 1);
        if (row < Dl) yp[row] = (d[0] + d[1]) * u * dg[row];
      }
    }
  }
  if (ready != nullptr) pdl_wait();  // end no earlier than the gate+up grid: the sum waits on this grid only
}

// Entry points of one pipeline shape (stages S, blocks per stage KBS): srt_nvfp4_{gateup,down}_tc<S>x<KBS>;
// *_dt: the same kernels reading their table from device memory (srt_moe_tables).
#define SRT_TC_ENTRY(GU_NAME, DN_NAME, GU_DT, DN_DT, S, KBS)                                                        \
  extern "C" __global__ void __launch_bounds__(512, 1)                                                              \
      GU_NAME(const __grid_constant__ GateUpTable tab, const float* __restrict__ z, float* __restrict__ h, int I,   \
              int Dl, float beta, int beta_inf, float lbeta, int has_lin, int* ready, int cap) {                    \
    extern __shared__ u32x4 smem_##GU_NAME[];                                                                       \
    __shared__ float red[32 * TC_TOKENS];                                                                           \
    gateup_tc<S, KBS>(tab, z, h, I, Dl, beta, beta_inf, lbeta, has_lin, ready, cap,                                 \
                                 (u8*)smem_##GU_NAME, red);                                                         \
  }                                                                                                                 \
  extern "C" __global__ void __launch_bounds__(512, 1)                                                              \
      DN_NAME(const __grid_constant__ DownTable tab, const float* __restrict__ h, float* __restrict__ y, int Dl,    \
              int I, const int* ready, int target, int cap, int cap_gu) {                                           \
    extern __shared__ u32x4 smem_##DN_NAME[];                                                                       \
    __shared__ float red[32 * TC_TOKENS];                                                                           \
    down_tc<S, KBS>(tab, h, y, Dl, I, ready, target, cap, cap_gu, (u8*)smem_##DN_NAME, red);                        \
  }                                                                                                                 \
  extern "C" __global__ void __launch_bounds__(512, 1)                                                              \
      GU_DT(const GateUpTableDt* __restrict__ tab, const float* __restrict__ z, float* __restrict__ h, int I, int Dl,\
            float beta, int beta_inf, float lbeta, int has_lin, int* ready, int cap) {                              \
    extern __shared__ u32x4 smem_##GU_DT[];                                                                         \
    __shared__ float red[32 * TC_TOKENS];                                                                           \
    gateup_tc<S, KBS>(*tab, z, h, I, Dl, beta, beta_inf, lbeta, has_lin, ready, cap,                                \
                                 (u8*)smem_##GU_DT, red);                                                           \
  }                                                                                                                 \
  extern "C" __global__ void __launch_bounds__(512, 1)                                                              \
      DN_DT(const DownTableDt* __restrict__ tab, const float* __restrict__ h, float* __restrict__ y, int Dl, int I, \
            const int* ready, int target, int cap, int cap_gu) {                                                    \
    extern __shared__ u32x4 smem_##DN_DT[];                                                                         \
    __shared__ float red[32 * TC_TOKENS];                                                                           \
    down_tc<S, KBS>(*tab, h, y, Dl, I, ready, target, cap, cap_gu, (u8*)smem_##DN_DT, red);                         \
  }

SRT_TC_ENTRY(srt_nvfp4_gateup_tc2x2, srt_nvfp4_down_tc2x2, srt_nvfp4_gateup_tc2x2_dt, srt_nvfp4_down_tc2x2_dt, 2, 2)

// ---- batch blocks: each row of z, then of h, staged once per call, in global memory ----
//
// The blocks above stage their rows' activation in shared memory, each block its own copy:
// 8 rows of 3584 columns take 144 KB, so one block fits an SM and its warps wait at the
// staging barrier. Here srt_moe_stage_rows stages every row of z (and, after
// the gate+up grid, of h) once per call (the same prescale and hi/lo words, so the same bits),
// and a block of up to 16 pairs of one expert (the host's `cap`) reads its B operand from there through L1,
// which its warps share. Shared memory holds only the weight rings, no barrier stops the warps,
// and 16 rows share one decode of the weights. The two tiles of a warp share each B load.
// A staged row is `in` u32 words: per 128-column block kb, per word wi, hi then lo, per chunk c
// of the block 4 words: [kb][wi][hi, lo][c][4]. So the 8 lanes that read one row's hi and lo of
// word wi read 128 contiguous bytes (a quarter of a warp's load, one row). Row R is zeros: the B
// of the group rows past n.

// grid R + 1, block 256. Row r < R of x [R, in] (fp32, in % 128 == 0) -> xs + r * in (its
// prescaled hi / lo words) and unscale[r] (2^(14 - s), as stage_rows_f16's); row R -> zeros.
extern "C" __global__ void __launch_bounds__(256) srt_moe_stage_rows(const float* __restrict__ x, int R, int in,
                                                                   u32* __restrict__ xs, float* __restrict__ unscale) {
  __shared__ float red[32];
  pdl_launch_dependents();  // the gate+up blocks may queue their first weight stages now
  pdl_wait();               // x is the kernel before's output
  const int r = blockIdx.x, n4 = in >> 2;
  u32x4* dst = (u32x4*)(xs + (long long)r * in);
  if (r == R) {
    for (int i = threadIdx.x; i < n4; i += blockDim.x) dst[i] = u32x4{0u, 0u, 0u, 0u};
    return;
  }
  const f32x4* x4 = (const f32x4*)(x + (long long)r * in);
  float m = 0.0f;
  for (int i = threadIdx.x; i < n4; i += blockDim.x) m = fmaxf(m, absmax4(x4[i]));
  float up, un;
  prescale_of(block_max(m, red), up, un);
  if (threadIdx.x == 0) unscale[r] = un;
  for (int it = threadIdx.x; it < in >> 3; it += blockDim.x) {  // item: chunk ch = it / 4, word it % 4
    const int ch = it >> 2, wi = it & 3, q = (ch >> 2) * 32 + wi * 8 + (ch & 3);  // in u32x4
    stage_words(x4[2 * it], x4[2 * it + 1], up, dst[q], dst[q + 4]);
  }
}

// 16 bytes through the read-only path (L1): the staged rows, written by the kernel before.
SRT_DEV u32x4 ld_nc16(const u32x4* p) {
  const uint4 v = __ldg((const uint4*)p);
  return u32x4{v.x, v.y, v.z, v.w};
}

// tc_rows with B from the staged rows xs (rows[j]: group row j's staged row, zero_row past n):
// the same mma into the same accumulators in the same order, so the same bits.
template <int S, int KBS, int SETS>
SRT_DEV void tc_rows_staged(const TcRows& R, const u32* __restrict__ xs, const int* rows, int n, int zero_row, int in,
                            const u8* wring, const u8* sring, float acc[2][4][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int nst = (R.nkb + KBS - 1) / KBS;
  const u32 wbuf = smem_addr(wring), sbuf = smem_addr(sring);
  const u32x4* bsrc[SETS];  // B column g: row 4s + g/2 of the group, hi (g even) or lo
#pragma unroll
  for (int s = 0; s < SETS; ++s) {
    const int j = 4 * s + (g >> 1);
    bsrc[s] = (const u32x4*)(xs + (long long)(j < n ? rows[j] : zero_row) * in) + (g & 1) * 4 + c;
  }
  float part[2][SETS][2][4];  // [tile][set][first / second mma of a word][fragment]
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int s = 0; s < SETS; ++s)
#pragma unroll
      for (int i = 0; i < 8; ++i) part[t][s][i >> 2][i & 3] = 0.0f;
  for (int st = 0; st < nst; ++st) {
    tc_issue<S, KBS>(st + S - 1, R, wbuf, sbuf);
    cp_async_wait<S - 1>();
    __syncwarp();
    const u8* wst = wring + (st % S) * KBS * TC_WBYTES;
    const u8* sst = sring + (st % S) * KBS * TC_SBYTES;
#pragma unroll
    for (int u = 0; u < KBS; ++u) {
      const int kb = st * KBS + u;
      if (kb >= R.nkb) break;  // warp-uniform
      const u32* w[4];  // slot q's 16 bytes of this lane's chunk, read a word at a time (fewer live registers)
      u32 sc[4][2];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        w[q] = (const u32*)(wst + (q * 8 + g) * (KBS * 64) + (tc_swizzle<KBS>(u * 4 + c, g) << 4));
        const u32 h = e4m3x2_h2(*(const u16*)(sst + ((q * 8 + g) * KBS + u) * 8 + 2 * c));
        sc[q][0] = __byte_perm(h, 0u, 0x1010);
        sc[q][1] = __byte_perm(h, 0u, 0x3232);
      }
#pragma unroll
      for (int wi = 0; wi < 4; ++wi) {
        u32 a[4][4];  // slot q's word wi, decoded and scaled
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          e2m1x8_h2(w[q][wi], a[q]);
#pragma unroll
          for (int e = 0; e < 4; ++e) a[q][e] = hmul2(a[q][e], sc[q][wi >> 1]);
        }
#pragma unroll
        for (int s = 0; s < SETS; ++s) {
          const u32x4 b = ld_nc16(bsrc[s] + kb * 32 + wi * 8);
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            mma16816(part[t][s][0], a[2 * t][0], a[2 * t + 1][0], a[2 * t][1], a[2 * t + 1][1], b.x, b.y);
            mma16816(part[t][s][1], a[2 * t][2], a[2 * t + 1][2], a[2 * t][3], a[2 * t + 1][3], b.z, b.w);
          }
        }
      }
    }
    __syncwarp();  // every lane has read ring slot st % S before a later tc_issue refills it
  }
  cp_async_wait<0>();
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int s = 0; s < SETS; ++s)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][s][i] = part[t][s][0][i] + part[t][s][1][i];
}

// tc_rows_staged over a group of n rows: as many sets of four rows as it has.
template <int S, int KBS>
SRT_DEV void tc_group_staged(const TcRows& R, const u32* __restrict__ xs, const int* rows, int n, int zero_row, int in,
                             const u8* wring, const u8* sring, float acc[2][4][4]) {
  if (n > 12) tc_rows_staged<S, KBS, 4>(R, xs, rows, n, zero_row, in, wring, sring, acc);
  else if (n > 8) tc_rows_staged<S, KBS, 3>(R, xs, rows, n, zero_row, in, wring, sring, acc);
  else if (n > 4) tc_rows_staged<S, KBS, 2>(R, xs, rows, n, zero_row, in, wring, sring, acc);
  else tc_rows_staged<S, KBS, 1>(R, xs, rows, n, zero_row, in, wring, sring, acc);
}

// grid (ceil(I / (16 * warps)), pairs or at least groups[0]), block warps*32, smem warps * S * KBS
// * (TC_WBYTES + TC_SBYTES). xs / unscale: srt_moe_stage_rows' rows of z (zero_row: its zero
// row). A block takes a group of up to cap <= 16 pairs (block_group_size) and, with `ready`,
// counts itself done in ready[dst[its first pair]] (gateup_tc's contract).
template <int S, int KBS, class Tab>
SRT_DEV void gateup_staged(const Tab& tab, const u32* __restrict__ xs, const float* __restrict__ unscale, int zero_row,
                           float* __restrict__ h, int I, int Dl, float beta, int beta_inf, float lbeta, int has_lin,
                           int* ready, int cap, const int* groups, u8* smem) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int n = block_group_size(tab.gate_packed, groups, cap);
  if (n == 0) return;
  const u8* wring = smem + warp * S * KBS * (TC_WBYTES + TC_SBYTES);
  const u8* sring = wring + S * KBS * TC_WBYTES;
  const int r0 = (blockIdx.x * (blockDim.x >> 5) + warp) * 16;
  const TcRows R = gateup_rows(tab, block_group_first(groups), r0, I, Dl);
  if (r0 < I)  // weights do not depend on z: start the pipeline before the staged rows are ready
    for (int st = 0; st < S - 1; ++st) tc_issue<S, KBS>(st, R, smem_addr(wring), smem_addr(sring));
  pdl_wait();  // xs is the staging kernel's output
  pdl_launch_dependents();  // after pdl_wait(): the down blocks read `ready` (gateup_tc)
  if (r0 < I) {
    float acc[2][4][4];
    tc_group_staged<S, KBS>(R, xs, &tab.row[block_group_first(groups)], n, zero_row, Dl, wring, sring, acc);
    // the group's first entry and (from a list) size read again: held across the loop, they take
    // registers it needs
    const int p = block_group_first(groups), m = groups != nullptr ? block_group_size(tab.gate_packed, groups, cap) : n;
    const int* rows = &tab.row[p];
    const int ra = min(r0 + g, I - 1), rc = min(r0 + g + 8, I - 1);
    const float* gg = (const float*)tab.gate_global[p];
    const float* ug = (const float*)tab.up_global[p];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int j = 4 * s + c;
      if (j >= m) break;
      const float u = unscale[rows[j]];
      const float* gt = acc[0][s];  // tile 0: gate rows, tile 1: up rows
      const float* ut = acc[1][s];
      float* hp = h + (long long)tab.dst[p + j] * I;
      if (r0 + g < I)
        hp[r0 + g] = situ((gt[0] + gt[1]) * u * gg[ra], (ut[0] + ut[1]) * u * ug[ra], beta, beta_inf, lbeta, has_lin);
      if (r0 + g + 8 < I)
        hp[r0 + g + 8] = situ((gt[2] + gt[3]) * u * gg[rc], (ut[2] + ut[3]) * u * ug[rc], beta, beta_inf, lbeta, has_lin);
    }
  }
  if (ready != nullptr) {
    __syncthreads();  // every warp's rows of h are written
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(&ready[tab.dst[block_group_first(groups)]], 1);
    }
  }
}

// grid (ceil(Dl / (32 * warps)), as gate+up's), block warps*32, smem warps * S * KBS * (TC_WBYTES
// + TC_SBYTES). hs / unscale: srt_moe_stage_rows' rows of h (one per pair: dst; zero_row its zero
// row), staged after the whole gate+up grid. The groups are gate+up's (up to cap pairs).
template <int S, int KBS, class Tab>
SRT_DEV void down_staged(const Tab& tab, const u32* __restrict__ hs, const float* __restrict__ unscale, int zero_row,
                         float* __restrict__ y, int Dl, int I, int cap, const int* groups, u8* smem) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const int n = block_group_size(tab.packed, groups, cap);
  if (n == 0) return;
  const u8* wring = smem + warp * S * KBS * (TC_WBYTES + TC_SBYTES);
  const u8* sring = wring + S * KBS * TC_WBYTES;
  const int r0 = (blockIdx.x * (blockDim.x >> 5) + warp) * 32;
  const TcRows R = down_rows(tab, block_group_first(groups), r0, Dl, I);
  if (r0 < Dl)
    for (int st = 0; st < S - 1; ++st) tc_issue<S, KBS>(st, R, smem_addr(wring), smem_addr(sring));
  pdl_wait();  // hs is the staging kernel's output
  pdl_launch_dependents();
  if (r0 >= Dl) return;
  float acc[2][4][4];
  tc_group_staged<S, KBS>(R, hs, &tab.dst[block_group_first(groups)], n, zero_row, I, wring, sring, acc);
  const int p = block_group_first(groups), m = groups != nullptr ? block_group_size(tab.packed, groups, cap) : n;
  const int* rows = &tab.dst[p];
  const float* dg = (const float*)tab.global[p];
  const int c = lane & 3;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int j = 4 * s + c;
    if (j >= m) break;
    const float u = unscale[rows[j]];
    float* yp = y + (long long)rows[j] * Dl;
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // slot q: tile q / 2, its rows g (q even) or g + 8
      const int row = r0 + g + 8 * q;
      const float* d = acc[q >> 1][s] + 2 * (q & 1);
      if (row < Dl) yp[row] = (d[0] + d[1]) * u * dg[row];
    }
  }
}

#ifndef TC_STAGED_THREADS  // the most threads a staged gate+up block has (their registers: 65536 / it)
#error "TC_STAGED_THREADS is passed by the host (-DTC_STAGED_THREADS=..., streamrt/backends/kernel_defines.py)"
#endif
#ifndef TC_STAGED_DOWN_THREADS  // ... and a staged down block (four row slots a warp: more addresses live)
#error "TC_STAGED_DOWN_THREADS is passed by the host (-DTC_STAGED_DOWN_THREADS=..., streamrt/backends/kernel_defines.py)"
#endif

#define SRT_TCS_ENTRY(GU_NAME, GU_DT, DN_NAME, DN_DT, S, KBS)                                                                      \
  extern "C" __global__ void __launch_bounds__(TC_STAGED_THREADS, 1)                                              \
      GU_NAME(const __grid_constant__ GateUpTable tab, const u32* __restrict__ xs, const float* __restrict__ unscale, \
              int zero_row, float* __restrict__ h, int I, int Dl, float beta, int beta_inf, float lbeta, int has_lin, \
              int* ready, int cap) {                                                                               \
    extern __shared__ u32x4 smem_##GU_NAME[];                                                                      \
    gateup_staged<S, KBS>(tab, xs, unscale, zero_row, h, I, Dl, beta, beta_inf, lbeta, has_lin, ready, cap,       \
                          nullptr, (u8*)smem_##GU_NAME);                                                           \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(TC_STAGED_THREADS, 1)                                              \
      GU_DT(const GateUpTableDt* __restrict__ tab, const u32* __restrict__ xs, const float* __restrict__ unscale,   \
            int zero_row, float* __restrict__ h, int I, int Dl, float beta, int beta_inf, float lbeta, int has_lin,   \
            int* ready, int cap, const int* groups) {                                                             \
    extern __shared__ u32x4 smem_##GU_DT[];                                                                        \
    __builtin_assume(groups != nullptr); /* the device tables come with their list */                             \
    gateup_staged<S, KBS>(*tab, xs, unscale, zero_row, h, I, Dl, beta, beta_inf, lbeta, has_lin, ready, cap,      \
                          groups, (u8*)smem_##GU_DT);                                                              \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(TC_STAGED_DOWN_THREADS, 1)                                         \
      DN_NAME(const __grid_constant__ DownTable tab, const u32* __restrict__ hs, const float* __restrict__ unscale, \
              int zero_row, float* __restrict__ y, int Dl, int I, int cap) {                                       \
    extern __shared__ u32x4 smem_##DN_NAME[];                                                                      \
    down_staged<S, KBS>(tab, hs, unscale, zero_row, y, Dl, I, cap, nullptr, (u8*)smem_##DN_NAME);                  \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(TC_STAGED_DOWN_THREADS, 1)                                         \
      DN_DT(const DownTableDt* __restrict__ tab, const u32* __restrict__ hs, const float* __restrict__ unscale,     \
            int zero_row, float* __restrict__ y, int Dl, int I, int cap, const int* groups) {                      \
    extern __shared__ u32x4 smem_##DN_DT[];                                                                        \
    __builtin_assume(groups != nullptr);                                                                           \
    down_staged<S, KBS>(*tab, hs, unscale, zero_row, y, Dl, I, cap, groups, (u8*)smem_##DN_DT);                    \
  }

SRT_TCS_ENTRY(srt_nvfp4_gateup_st2x1, srt_nvfp4_gateup_st2x1_dt, srt_nvfp4_down_st2x1, srt_nvfp4_down_st2x1_dt, 2, 1)
