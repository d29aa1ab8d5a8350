// NVFP4 routed-expert FFN for decode, reading experts straight from their device slots.
//
// One launch covers up to SRT_MOE_MAXP (row t, expert) pairs of one layer; the slot pointers
// travel by value in a __grid_constant__ table (no host->device copy per step), or, in a CUDA
// graph, in a table `srt_moe_tables` builds on the GPU from the routed ids (the *_dt entries).
// A pair's rows of h and y are named in the table (dst), so the host may launch resident experts
// first and experts still in flight after their copy events, with the same result bits.
//   1. srt_nvfp4_gateup: h[p, i] = situ_glu(gate_e[i, :] . z[t], up_e[i, :] . z[t])      [P, I]
//   2. srt_nvfp4_down:   y[p, d] = down_e[d, :] . h[p]                                      [P, Dl]
//   3. srt_moe_combine:  out[t, d] = sum_j (j ascending) w[t, j] * y[t*k + j, d]           [T, Dl]
// NVFP4 matrix [out, in]: packed u8 [out, in/2] (low nibble = even element, E2M1),
// scales u8 [out, in/16] (E4M3), global fp32 [out]. A row's dot product is
//   global[row] * sum_g e4m3(scale_g) * (sum_{i in g} e2m1_i * x_i)
// (exactly the dequantised dot in real arithmetic; fp32 rounding in a fixed order).
// Two implementations of steps 1-2: the tensor-core kernels (*_tc*, below; in % 128 == 0) and
// the CUDA-core kernels (fp32 FMA; in % 32 == 0). In the CUDA-core kernels each warp owns 4 row
// streams; each lane reads 16 bytes (32 weights = 2 scale groups) of each stream per step, the
// activation comes from shared memory and is reused by the 4 streams.
#include "common.cuh"

#ifndef SRT_MOE_MAXP
#error "SRT_MOE_MAXP is passed by the host (-DSRT_MOE_MAXP=..., streamrt/backends/kernel_defines.py)"
#endif
#ifndef MOE_WARPS
#error "MOE_WARPS is passed by the host (-DMOE_WARPS=..., streamrt/backends/kernel_defines.py)"
#endif

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
SRT_DEV void gateup_cc(const GateUpTable& tab, const float* __restrict__ z, float* __restrict__ h, int I, int Dl,
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
SRT_DEV void down_cc(const DownTable& tab, const float* __restrict__ h, float* __restrict__ y, int Dl, int I,
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
// one table per 64 pairs; CUDA graphs replay these with tables rebuilt on the GPU).
extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    srt_nvfp4_gateup(const __grid_constant__ GateUpTable tab, const float* __restrict__ z, float* __restrict__ h,
                     int I, int Dl, float beta, int beta_inf, float lbeta, int has_lin) {
  extern __shared__ f32x4 smem_gu[];
  gateup_cc(tab, z, h, I, Dl, beta, beta_inf, lbeta, has_lin, (float*)smem_gu);
}
extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)
    srt_nvfp4_gateup_dt(const GateUpTable* __restrict__ tab, const float* __restrict__ z, float* __restrict__ h,
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
    srt_nvfp4_down_dt(const DownTable* __restrict__ tab, const float* __restrict__ h, float* __restrict__ y, int Dl,
                      int I) {
  extern __shared__ f32x4 smem_dn_dt[];
  down_cc(*tab, h, y, Dl, I, (float*)smem_dn_dt);
}

// The tables of P = T*k pairs in device memory, from the routed ids [T, k] and a layer's pointer
// table experts [E, SRT_EXPERT_COLS] (u64: gate packed / scales / global, up ..., down ...;
// ExpertPointers' order, backends/expert_pointers.py). Pair p = t*k + j reads z row t and writes
// h / y row p; the pairs are ordered by (expert, p), as the host orders them (a batch's pairs of
// one expert adjacent; a pair's bits do not depend on its place). Pair p's place
// r = #{q : (e_q, q) < (e_p, p)} is entry r % 64 of table r / 64.
// grid ceil(P / 256), block 256.
#ifndef SRT_EXPERT_COLS
#error "SRT_EXPERT_COLS is passed by the host (-DSRT_EXPERT_COLS=..., streamrt/backends/kernel_defines.py)"
#endif
extern "C" __global__ void srt_moe_tables(const long long* __restrict__ ids, const u64* __restrict__ experts, int P,
                                          int k, GateUpTable* __restrict__ gtab, DownTable* __restrict__ dtab) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= P) return;
  const long long ep = ids[p];
  int r = 0;
  for (int q = 0; q < P; ++q) {
    const long long eq = ids[q];
    r += eq < ep || (eq == ep && q < p);
  }
  const int c = r / SRT_MOE_MAXP, i = r - c * SRT_MOE_MAXP;
  const u64* e = experts + ep * SRT_EXPERT_COLS;
  GateUpTable& g = gtab[c];
  DownTable& d = dtab[c];
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
// Same math; the 16-row x 16-k products run on tensor cores. Per warp: two 16-row tiles (gate
// and up rows r0..r0+15, or down rows r0..r0+31) share the activation operand B.
//  * A (weights): lane (g = lane/4, c = lane%4) takes 16 bytes (32 elements = 2 scale groups)
//    of rows g and g+8 per 128-column block, decoded in registers to fp16 (e2m1 * 2^-14, exact;
//    e2m1x8_h2). The k order inside a word is the decoder's; B is staged in the same order.
//  * B (activation): x * 2^s (s a power of two putting max|x| in [2^14, 2^15)) split exactly
//    enough into fp16 hi + lo (|x - hi - lo| <= 2^-22 |x|).
//  * Block scales stay out of the operands. An mma's 16 k values come from the chunks of the
//    4 lanes c = 0..3 of a row group (4 values each, all in one 16-element scale group of that
//    lane's chunk). Column n = 2c + h of B carries x (h = 0: hi, 1: lo) only for the k values
//    of lane c and zero elsewhere, so D[row][2c + h] is lane c's group partial, unscaled. Four
//    mma steps from zero cover a group; lane (g, c) holds exactly its own groups' columns and
//    applies its own E4M3 scales in fp32: acc += (d_hi + d_lo) * scale, in block order. The 4
//    lanes of a row are summed at the end (xor 1, then xor 2). Fixed order throughout: the bits
//    do not depend on T, the block shape or the pipeline depth.
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
//    weight stages. A down block then waits for its own pair only: each gate+up block adds one
//    to ready[pair] when its rows of h are written, so the first experts' down work runs while
//    the last experts' gate+up does (0.78 -> 0.81 of the copy rate). The sum waits for the down
//    grid and zeroes the counts for the next call.
// Requires in % 128 == 0 and 8-byte aligned scale rows; other shapes use the CUDA-core kernels.
// Shared memory: xh, xl [in/32 chunks][20] u32 (16 fp16 pairs per chunk, padded; in * 5
// bytes), then per warp S * KBS * (TC_WBYTES + TC_SBYTES) bytes of ring.

#define MMA_XSTRIDE 20

// 16-byte load from L2, past L1: x may have been written during this launch by another grid's
// blocks (the down kernel starting on a pair's gate+up count), which L1 does not see.
SRT_DEV f32x4 ld_cg4(const f32x4* p) {
  f32x4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p) : "memory");
  return v;
}

// One item (chunk ch, word w) of the staged activation: elements ch*32 + w*8 + 0..7 (a, b),
// scaled by `up`, -> 4 u32 of xh and of xl at [ch][w*4 .. w*4+3].
SRT_DEV void stage_item(u32* xh, u32* xl, int it, f32x4 a, f32x4 b, float up) {
  // pairs (0, 2), (1, 3), (4, 6), (5, 7) of the word's 8 elements: the order e2m1x8_h2 decodes
  const float lo[4] = {a.x * up, a.y * up, b.x * up, b.y * up};
  const float hi[4] = {a.z * up, a.w * up, b.z * up, b.w * up};
  u32 hh[4], ll[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    hh[j] = f2h2(lo[j], hi[j]);
    float ah, bh;
    h2_to_f32(hh[j], ah, bh);
    ll[j] = f2h2(lo[j] - ah, hi[j] - bh);
  }
  const int off = (it >> 2) * MMA_XSTRIDE + (it & 3) * 4;
  *(u32x4*)(xh + off) = u32x4{hh[0], hh[1], hh[2], hh[3]};
  *(u32x4*)(xl + off) = u32x4{ll[0], ll[1], ll[2], ll[3]};
}

SRT_DEV float absmax4(f32x4 v) { return fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))); }

// Stage x (n floats, n % 32 == 0, 16-byte aligned) as prescaled fp16 hi/lo pairs; returns
// 2^(14 - s), the factor that undoes the prescale and the decode's 2^-14. Every block of a launch
// stages its own copy before its rows can start, and the down kernel's blocks do it while the
// memory system is loaded: up to 4 items per thread are read once, all loads in flight, and
// kept in registers for the conversion; longer x takes a second read.
SRT_DEV float stage_x_f16(u32* xh, u32* xl, const float* __restrict__ x, int n, float* red) {
  const f32x4* x4 = (const f32x4*)x;
  const int items = n >> 3, nt = blockDim.x;
  const bool held = items <= 4 * nt;
  f32x4 a[4], b[4];
  float m = 0.0f;
  for (int i = threadIdx.x; i < items; i += 4 * nt) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const bool in = i + u * nt < items;
      a[u] = in ? ld_cg4(x4 + (i + u * nt) * 2) : f32x4{0.0f, 0.0f, 0.0f, 0.0f};
      b[u] = in ? ld_cg4(x4 + (i + u * nt) * 2 + 1) : f32x4{0.0f, 0.0f, 0.0f, 0.0f};
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) m = fmaxf(m, fmaxf(absmax4(a[u]), absmax4(b[u])));
  }
  m = block_max(m, red);
  int e = 0;
  if (m > 0.0f) frexpf(m, &e);  // m < 2^e
  const int s = max(-100, min(100, 15 - e));
  const float up = ldexpf(1.0f, s);
  if (held) {
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (threadIdx.x + u * nt < items) stage_item(xh, xl, threadIdx.x + u * nt, a[u], b[u], up);
  } else {
    for (int it = threadIdx.x; it < items; it += nt) stage_item(xh, xl, it, ld_cg4(x4 + it * 2), ld_cg4(x4 + it * 2 + 1), up);
  }
  __syncthreads();
  return ldexpf(1.0f, 14 - s);
}

#ifndef TC_WBYTES  // one 128-column block of 32 rows: weights
#error "TC_WBYTES is passed by the host (-DTC_WBYTES=..., streamrt/backends/kernel_defines.py)"
#endif
#ifndef TC_SBYTES  // ... and its E4M3 scales
#error "TC_SBYTES is passed by the host (-DTC_SBYTES=..., streamrt/backends/kernel_defines.py)"
#endif

// Two E4M3 bytes (low byte first) -> two floats, exact (sm_89+ conversion).
SRT_DEV void e4m3x2_to_f32(u32 v, float& lo, float& hi) {
  u32 h;
  asm("{\n\t.reg .b16 s;\n\tcvt.u16.u32 s, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, s;\n\t}" : "=r"(h) : "r"(v));
  h2_to_f32(h, lo, hi);
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

// acc[q]: slot q's row g (this lane's row of the slot), summed over the whole row.
template <int S, int KBS>
SRT_DEV void tc_rows(const TcRows& R, const u32* xh, const u32* xl, const u8* wring, const u8* sring, float acc[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int nst = (R.nkb + KBS - 1) / KBS;
  const u32 wbuf = smem_addr(wring), sbuf = smem_addr(sring);
  const bool holds_b = (g >> 1) == c;  // B column g = 2c + h belongs to this lane's chunk
  const u32* xsrc = (g & 1) ? xl : xh;
#pragma unroll
  for (int q = 0; q < 4; ++q) acc[q] = 0.0f;
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
      u32 sv[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        w[q] = *(const u32x4*)(wst + (q * 8 + g) * (KBS * 64) + (tc_swizzle<KBS>(u * 4 + c, g) << 4));
        sv[q] = *(const u16*)(sst + ((q * 8 + g) * KBS + u) * 8 + 2 * c);
      }
      u32 bq[16];
      if (holds_b) {
        const u32x4* src = (const u32x4*)(xsrc + (kb * 4 + c) * MMA_XSTRIDE);
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
        const u32 q0[4] = {w[2 * t].x, w[2 * t].y, w[2 * t].z, w[2 * t].w};
        const u32 q1[4] = {w[2 * t + 1].x, w[2 * t + 1].y, w[2 * t + 1].z, w[2 * t + 1].w};
        float dl[4] = {0.0f, 0.0f, 0.0f, 0.0f}, dh[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int wi = 0; wi < 4; ++wi) {  // word wi: elements 0-3 then 4-7 of rows g (q0) and g + 8 (q1)
          u32 a0[4], a1[4];
          e2m1x8_h2(q0[wi], a0);
          e2m1x8_h2(q1[wi], a1);
          mma16816(wi < 2 ? dl : dh, a0[0], a1[0], a0[1], a1[1], bq[4 * wi], bq[4 * wi + 1]);
          mma16816(wi < 2 ? dl : dh, a0[2], a1[2], a0[3], a1[3], bq[4 * wi + 2], bq[4 * wi + 3]);
        }
        float s0l, s0h, s1l, s1h;
        e4m3x2_to_f32(sv[2 * t], s0l, s0h);
        e4m3x2_to_f32(sv[2 * t + 1], s1l, s1h);
        acc[2 * t] = fmaf(dh[0] + dh[1], s0h, fmaf(dl[0] + dl[1], s0l, acc[2 * t]));
        acc[2 * t + 1] = fmaf(dh[2] + dh[3], s1h, fmaf(dl[2] + dl[3], s1l, acc[2 * t + 1]));
      }
    }
    __syncwarp();  // every lane has read ring slot st % S before a later tc_issue refills it
  }
  cp_async_wait<0>();
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    acc[q] += __shfl_xor_sync(SRT_FULL, acc[q], 1);
    acc[q] += __shfl_xor_sync(SRT_FULL, acc[q], 2);
  }
}

// grid (ceil(I / (16 * warps)), P), block warps*32, smem Dl*5 + warps*S*KBS*(TC_WBYTES+TC_SBYTES).
// With `ready`, each block counts itself done in ready[dst[p]] once its rows of h are written
// (the down kernel waits for its pair's count, not for this whole grid).
template <int S, int KBS>
SRT_DEV void gateup_tc(const GateUpTable& tab, const float* __restrict__ z, float* __restrict__ h, int I, int Dl,
                       float beta, int beta_inf, float lbeta, int has_lin, int* ready, u8* smem, float* red) {
  const int p = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  u32* xh = (u32*)smem;
  u32* xl = xh + (Dl >> 5) * MMA_XSTRIDE;
  const u8* wring = smem + Dl * 5 + warp * S * KBS * (TC_WBYTES + TC_SBYTES);
  const u8* sring = wring + S * KBS * TC_WBYTES;
  const int r0 = (blockIdx.x * (blockDim.x >> 5) + warp) * 16;
  const u8 *gp = (const u8*)tab.gate_packed[p], *gs = (const u8*)tab.gate_scales[p];
  const u8 *upk = (const u8*)tab.up_packed[p], *us = (const u8*)tab.up_scales[p];
  const TcRows R = {{gp, gp, upk, upk}, {gs, gs, us, us}, {r0, r0 + 8, r0, r0 + 8}, I, Dl >> 1, Dl >> 4, Dl >> 7,
                    scales_aligned16(gs, us, Dl >> 4)};
  if (r0 < I)  // weights do not depend on x: start the pipeline before staging it
    for (int st = 0; st < S - 1; ++st) tc_issue<S, KBS>(st, R, smem_addr(wring), smem_addr(sring));
  pdl_wait();  // z may be the kernel before's output (when this one is launched programmatically)
  // The down kernel's blocks may now take SM slots this grid's last wave leaves free. Not before
  // pdl_wait(): they read `ready`, which the kernel before (the last call's sum) zeroes.
  pdl_launch_dependents();
  const float unscale = stage_x_f16(xh, xl, z + (long long)tab.row[p] * Dl, Dl, red);
  if (r0 < I) {
    float acc[4];
    tc_rows<S, KBS>(R, xh, xl, wring, sring, acc);
    if ((lane & 3) == 0) {
      const int ra = min(r0 + g, I - 1), rc = min(r0 + g + 8, I - 1);
      const float* gg = (const float*)tab.gate_global[p];
      const float* ug = (const float*)tab.up_global[p];
      float* hp = h + (long long)tab.dst[p] * I;
      if (r0 + g < I)
        hp[r0 + g] = situ(acc[0] * unscale * gg[ra], acc[2] * unscale * ug[ra], beta, beta_inf, lbeta, has_lin);
      if (r0 + g + 8 < I)
        hp[r0 + g + 8] = situ(acc[1] * unscale * gg[rc], acc[3] * unscale * ug[rc], beta, beta_inf, lbeta, has_lin);
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

// grid (ceil(Dl / (32 * warps)), P), block warps*32, smem I*5 + warps*S*KBS*(TC_WBYTES+TC_SBYTES).
// With `ready`, a block starts on its pair once ready[dst[p]] reaches `target` (every gate+up
// block of the pair is done) instead of waiting for the whole gate+up grid: the down work of the
// first experts fills the slots the gate+up grid's last wave leaves free.
template <int S, int KBS>
SRT_DEV void down_tc(const DownTable& tab, const float* __restrict__ h, float* __restrict__ y, int Dl, int I,
                     const int* ready, int target, u8* smem, float* red) {
  const int p = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  u32* xh = (u32*)smem;
  u32* xl = xh + (I >> 5) * MMA_XSTRIDE;
  const u8* wring = smem + I * 5 + warp * S * KBS * (TC_WBYTES + TC_SBYTES);
  const u8* sring = wring + S * KBS * TC_WBYTES;
  const int r0 = (blockIdx.x * (blockDim.x >> 5) + warp) * 32;
  const u8 *dp = (const u8*)tab.packed[p], *ds = (const u8*)tab.scales[p];
  const TcRows R = {{dp, dp, dp, dp}, {ds, ds, ds, ds}, {r0, r0 + 8, r0 + 16, r0 + 24}, Dl, I >> 1, I >> 4, I >> 7,
                    scales_aligned16(ds, ds, I >> 4)};
  pdl_launch_dependents();
  if (r0 < Dl)
    for (int st = 0; st < S - 1; ++st) tc_issue<S, KBS>(st, R, smem_addr(wring), smem_addr(sring));
  if (ready != nullptr) wait_count(ready + tab.dst[p], target);
  else pdl_wait();  // h is the gate+up kernel's output (launched programmatically, this block may be early)
  const float unscale = stage_x_f16(xh, xl, h + (long long)tab.dst[p] * I, I, red);
  if (r0 < Dl) {
    float acc[4];
    tc_rows<S, KBS>(R, xh, xl, wring, sring, acc);
    if ((lane & 3) == 0) {
      const float* dg = (const float*)tab.global[p];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int row = r0 + g + 8 * q;
        if (row < Dl) y[(long long)tab.dst[p] * Dl + row] = acc[q] * unscale * dg[row];
      }
    }
  }
  if (ready != nullptr) pdl_wait();  // end no earlier than the gate+up grid: the sum waits on this grid only
}

// Entry points per (stages S, blocks per stage KBS): the benchmark's variants; the backend picks one.
// *_dt: the same kernels reading their table from device memory (srt_moe_tables).
#define SRT_TC_ENTRY(GU_NAME, DN_NAME, GU_DT, DN_DT, S, KBS)                                                       \
  extern "C" __global__ void __launch_bounds__(512, 1)                                                              \
      GU_NAME(const __grid_constant__ GateUpTable tab, const float* __restrict__ z, float* __restrict__ h, int I,   \
              int Dl, float beta, int beta_inf, float lbeta, int has_lin, int* ready) {                            \
    extern __shared__ u32x4 smem_##GU_NAME[];                                                                      \
    __shared__ float red[32];                                                                                      \
    gateup_tc<S, KBS>(tab, z, h, I, Dl, beta, beta_inf, lbeta, has_lin, ready, (u8*)smem_##GU_NAME, red);          \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(512, 1)                                                              \
      DN_NAME(const __grid_constant__ DownTable tab, const float* __restrict__ h, float* __restrict__ y, int Dl,    \
              int I, const int* ready, int target) {                                                               \
    extern __shared__ u32x4 smem_##DN_NAME[];                                                                      \
    __shared__ float red[32];                                                                                      \
    down_tc<S, KBS>(tab, h, y, Dl, I, ready, target, (u8*)smem_##DN_NAME, red);                                    \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(512, 1)                                                              \
      GU_DT(const GateUpTable* __restrict__ tab, const float* __restrict__ z, float* __restrict__ h, int I, int Dl, \
            float beta, int beta_inf, float lbeta, int has_lin, int* ready) {                                      \
    extern __shared__ u32x4 smem_##GU_DT[];                                                                        \
    __shared__ float red[32];                                                                                      \
    gateup_tc<S, KBS>(*tab, z, h, I, Dl, beta, beta_inf, lbeta, has_lin, ready, (u8*)smem_##GU_DT, red);           \
  }                                                                                                                \
  extern "C" __global__ void __launch_bounds__(512, 1)                                                              \
      DN_DT(const DownTable* __restrict__ tab, const float* __restrict__ h, float* __restrict__ y, int Dl, int I,   \
            const int* ready, int target) {                                                                        \
    extern __shared__ u32x4 smem_##DN_DT[];                                                                        \
    __shared__ float red[32];                                                                                      \
    down_tc<S, KBS>(*tab, h, y, Dl, I, ready, target, (u8*)smem_##DN_DT, red);                                     \
  }

SRT_TC_ENTRY(srt_nvfp4_gateup_tc2x2, srt_nvfp4_down_tc2x2, srt_nvfp4_gateup_tc2x2_dt, srt_nvfp4_down_tc2x2_dt, 2, 2)
SRT_TC_ENTRY(srt_nvfp4_gateup_tc3x2, srt_nvfp4_down_tc3x2, srt_nvfp4_gateup_tc3x2_dt, srt_nvfp4_down_tc3x2_dt, 3, 2)
SRT_TC_ENTRY(srt_nvfp4_gateup_tc4x1, srt_nvfp4_down_tc4x1, srt_nvfp4_gateup_tc4x1_dt, srt_nvfp4_down_tc4x1_dt, 4, 1)
