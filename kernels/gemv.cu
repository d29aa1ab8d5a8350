// Dense GEMV for decode (1..8 rows): out[t, n] = sum_k x[t, k] * W[n, k], fp32 accumulation.
// W [N, K] row-major, bf16 or fp32; x [T, K] fp32 or bf16; out [T, N] fp32.
// bf16 W runs on tensor cores (gemv_tc, the second half of this file; sm_80+). fp32 W, and
// bf16 W before sm_80, run the CUDA-core kernels (gemv_l1) below.
//
// CUDA-core kernels (K % 8 == 0 for bf16, K % 4 == 0 for fp32, W 16-byte aligned): a block of
// GEMV_WARPS warps owns GEMV_WARPS * RPW consecutive rows; each warp owns RPW rows, each lane
// streams 16-byte pieces of them (a warp reads 512 contiguous bytes of a row per load).
// No shared memory and no barriers: x (16-byte aligned rows) is read through L1 (the whole warp
// reads the same x pieces, every warp of the SM reuses them); each lane keeps RPW rows x U
// 16-byte weight vectors in flight. A lane accumulates its columns in ascending order (chunks
// of GEMV_CH columns); lanes meet in a butterfly. The order depends neither on NT, T nor RPW,
// so a row's result is the same alone or in a batch, whichever variant runs (batch invariance).
#include "common.cuh"

#ifndef GEMV_WARPS
#error "GEMV_WARPS is passed by the host (-DGEMV_WARPS=..., streamrt/backends/kernel_defines.py)"
#endif
#define GEMV_CH 1024  // multiple of 256: the lane <-> column map does not depend on the chunking

// RPW (rows per warp) sets the grid: N / (4 * RPW) blocks; at T=1 the host picks it so the last
// wave is not a long tail (backends/gemv_plan.py).
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

// srt_gemv_<w dtype>_t<NT>_r<RPW>: the variants backends/gemv_plan.py picks. Every variant gives
// the same bits for a row.
SRT_GEMV_L1_ENTRY(srt_gemv_bf16_t1_r1, 1, 1, 1)
SRT_GEMV_L1_ENTRY(srt_gemv_bf16_t1_r2, 1, 1, 2)
SRT_GEMV_L1_ENTRY(srt_gemv_bf16_t1_r4, 1, 1, 4)
SRT_GEMV_L1_ENTRY(srt_gemv_bf16_t2_r2, 2, 1, 2)
SRT_GEMV_L1_ENTRY(srt_gemv_bf16_t4_r2, 4, 1, 2)
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

// ================= bf16 weights on tensor cores (mma.sync m16n8k16, sm_80+) =================
//
// out[t, n] = sum_k x[t, k] * W[n, k] for T rows of x (fp32 or bf16), W bf16 [N, K], 8 rows per
// block (one launch for any T: a row's block computes what it would alone).
// The CUDA-core kernels above read x through L1 once per weight vector and token (T = 8: four
// bytes of x per byte of weights); here the tensor core applies each x value to 16 rows.
//  * A block owns 32 rows of W (two 16-row mma tiles) and splits K among its KS warps (KS set by
//    the host from N and K only): warp w takes the 128-column stages [w*nst/KS, (w+1)*nst/KS).
//    The 8 columns of the mma's B operand are the 8 token rows (columns >= T are zero).
//  * x fp32 is split exactly into three bf16 pieces (hi = its top 8 significant bits, mid = the
//    next 8, lo = the rest); bf16 x is one piece. Products are exact, so the only rounding is
//    the accumulation: inside a stage 4 chains per tile (k-step kk mod 4) accumulate from zero
//    on the tensor core, then (c0 + c1) + (c2 + c3) is added to fp32 registers in stage order;
//    the KS warps' sums are added in warp order. So no long chain accumulates inside the mma,
//    and the bits depend on neither T nor the pipeline depth: a row's result is the same alone
//    or in a batch (batch invariance).
//  * Weights and x travel global -> shared by cp.async through a ring of NS stages per warp
//    (32 rows x 128 columns of W = 8 KB; T rows x 128 columns of x), NS - 1 in flight while one
//    is computed; each copy instruction covers 256 contiguous bytes of two rows. 16-byte chunks
//    are swizzled by row, so the copies, ldmatrix (A, and B for bf16 x) and the 8-byte x reads
//    are free of bank conflicts.
//  * Why this shape (H200, profiling/RESULTS.md): the copy pipeline alone, without the math,
//    runs at 0.97 of the copy rate; a first version (one 16-row tile per warp over all of K, x
//    split per 16 rows, one mma chain per stage) issued ~550 instructions per 4 KB stage and
//    ran at 0.50-0.58 whatever the pipeline depth: too few warps per SM to issue that. Two
//    tiles per warp (x split once per 32 rows), ldmatrix operands (no register shuffling) and
//    2-8 warps per block over K (the host's gemv_tc_split) give 0.83-0.91.
// Requires K % 8 == 0, W and x 16-byte aligned (rows too: K % 8 == 0 does it).

#ifndef GEMV_TC_COLS
#error "GEMV_TC_COLS is passed by the host (-DGEMV_TC_COLS=..., streamrt/backends/kernel_defines.py)"
#endif
#ifndef GEMV_TC_ROWS
#error "GEMV_TC_ROWS is passed by the host (-DGEMV_TC_ROWS=..., streamrt/backends/kernel_defines.py)"
#endif
#ifndef GEMV_TC_PREFETCH
#error "GEMV_TC_PREFETCH is passed by the host (-DGEMV_TC_PREFETCH=..., streamrt/backends/kernel_defines.py)"
#endif
#define GEMV_TC_WBYTES (GEMV_TC_ROWS * GEMV_TC_COLS * 2)

// Shared-memory bytes of one stage of a warp's ring (x rows: T).
SRT_DEV int gtc_stage_bytes(int T, int x_bf16) { return GEMV_TC_WBYTES + T * GEMV_TC_COLS * (x_bf16 ? 2 : 4); }

SRT_DEV void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr)
               : "memory");
}

// D = A * B (accumulators start from zero).
SRT_DEV void mma16816_bf16_z(float d[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.0f));
}

// Two fp32 values -> their three bf16 pieces, packed in pairs (first value in the low half).
SRT_DEV void split3_bf16x2(float a, float b, u32& hi, u32& mid, u32& lo) {
  const u32 ua = __float_as_uint(a), ub = __float_as_uint(b);
  hi = __byte_perm(ua, ub, 0x7632);
  const float ra = a - __uint_as_float(ua & 0xffff0000u), rb = b - __uint_as_float(ub & 0xffff0000u);
  const u32 va = __float_as_uint(ra), vb = __float_as_uint(rb);
  mid = __byte_perm(va, vb, 0x7632);
  const float la = ra - __uint_as_float(va & 0xffff0000u), lb = rb - __uint_as_float(vb & 0xffff0000u);
  lo = __byte_perm(__float_as_uint(la), __float_as_uint(lb), 0x7632);  // <= 8 significant bits: exact
}

// Up to GEMV_TC_MATS matrices that share x and K, one launch: matrix m's 32-row blocks are row
// blocks block0[m] .. block0[m + 1] - 1 of the grid. Each output may take up to two addends of
// its shape ([T, N_m] fp32, 0: none), added in order after the sum: out = (acc + add0) + add1
// (a residual added by the epilogue, the bits of the separate adds).
#ifndef GEMV_TC_MATS
#error "GEMV_TC_MATS is passed by the host (-DGEMV_TC_MATS=..., streamrt/backends/kernel_defines.py)"
#endif
struct GemvMats {
  u64 w[GEMV_TC_MATS], out[GEMV_TC_MATS], add0[GEMV_TC_MATS], add1[GEMV_TC_MATS];
  int n[GEMV_TC_MATS];
  int block0[GEMV_TC_MATS + 1];
  int m;
};

template <int XBF16, int NS>
SRT_DEV void gemv_tc(const GemvMats& mats, const void* __restrict__ xv, int T, int K, int ks) {
#if __CUDA_ARCH__ >= 800
  extern __shared__ __align__(128) unsigned char gtc_smem[];
  constexpr int NP = XBF16 ? 1 : 3;   // pieces of x
  constexpr int XE = XBF16 ? 2 : 4;   // bytes per x element
  constexpr int XRB = GEMV_TC_COLS * XE;  // bytes of one token's row in a stage
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
  // T > 8 rows: block b takes token group b % groups (rows 8 (b % groups) ..) of row block
  // b / groups; a row block's groups are neighbours, so the second reads W from L2
  const int groups = (T + 7) / 8, tg = blockIdx.x % groups, rb = blockIdx.x / groups;
  int mat = 0;  // the matrix of row block rb
  while (mat + 1 < mats.m && rb >= mats.block0[mat + 1]) ++mat;
  const int N = mats.n[mat], row0 = (rb - mats.block0[mat]) * GEMV_TC_ROWS;
  const u16* __restrict__ W = (const u16*)mats.w[mat];
  const long long t_off = (long long)tg * 8 * N;
  float* __restrict__ out = (float*)mats.out[mat] + t_off;
  const float* add0 = mats.add0[mat] ? (const float*)mats.add0[mat] + t_off : nullptr;
  const float* add1 = mats.add1[mat] ? (const float*)mats.add1[mat] + t_off : nullptr;
  xv = (const char*)xv + (long long)tg * 8 * K * XE;
  T = min(8, T - tg * 8);
  const int nst = (K + GEMV_TC_COLS - 1) / GEMV_TC_COLS;
  const int s0 = warp * nst / ks, s1 = (warp + 1) * nst / ks;
  const int sbytes = gtc_stage_bytes(T, XBF16);
  const u32 ring = smem_addr(gtc_smem) + warp * NS * sbytes;
  const char* Wb = (const char*)W;
  const char* Xb = (const char*)xv;
  const long long wrow = (long long)K * 2, xrow = (long long)K * XE;

  // Launched programmatically, this block may start while the kernel before still runs: it pulls
  // its warp's first GEMV_TC_PREFETCH stages of W into L2 (one bulk prefetch per row; weights are
  // not that kernel's output), then waits. The ring's copies below find those bytes in L2, so
  // the previous kernel's tail and this launch's ramp overlap the weight stream.
#if __CUDA_ARCH__ >= 900
  if (s0 < s1) {
    const int c0 = s0 * GEMV_TC_COLS, c1 = min(min(s1, s0 + GEMV_TC_PREFETCH) * GEMV_TC_COLS, K);
    for (int r = lane; r < GEMV_TC_ROWS && row0 + r < N; r += 32)
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(Wb + (row0 + r) * wrow + c0 * 2),
                   "r"((c1 - c0) * 2)
                   : "memory");
  }
#endif
  pdl_begin();

  auto issue = [&](int s) {
    if (s < s1) {
      const u32 dst = ring + ((s - s0) % NS) * sbytes;
      const int c = lane & 15, col = s * GEMV_TC_COLS + c * 8;
      const bool ok = col < K;  // K % 8 == 0: a 16-byte chunk is all in or all out
#pragma unroll
      for (int i = 0; i < GEMV_TC_ROWS / 2; ++i) {  // rows 2i, 2i + 1: 16 lanes x 16 bytes each
        const int r = 2 * i + (lane >> 4);
        const long long row = min(row0 + r, N - 1);
        cp_async16(dst + r * 256 + ((c ^ (r & 7)) << 4), Wb + row * wrow + (ok ? col * 2 : 0), ok ? 16 : 0);
      }
      const u32 xdst = dst + GEMV_TC_WBYTES;
      if (XBF16) {  // 16 chunks per token row, two rows per instruction
        for (int t = lane >> 4; t < T; t += 2)
          cp_async16_ca(xdst + t * XRB + ((c ^ (t & 7)) << 4), Xb + t * xrow + (ok ? col * 2 : 0), ok ? 16 : 0);
      } else {  // 32 chunks per token row, one row per instruction
        const int xcol = s * GEMV_TC_COLS + lane * 4;
        const bool xok = xcol < K;
        for (int t = 0; t < T; ++t)
          cp_async16_ca(xdst + t * XRB + ((lane ^ ((t & 3) << 1)) << 4), Xb + t * xrow + (xok ? xcol * 4 : 0), xok ? 16 : 0);
      }
    }
    cp_async_commit();  // an empty group past the end keeps the wait count uniform
  };

#pragma unroll
  for (int s = 0; s < NS - 1; ++s) issue(s0 + s);
  float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
  const int mi = lane >> 3, rr = lane & 7;  // ldmatrix: this lane's matrix and row
  for (int s = s0; s < s1; ++s) {
    issue(s + NS - 1);
    cp_async_wait<NS - 1>();
    __syncwarp();
    const u32 st = ring + ((s - s0) % NS) * sbytes, xs = st + GEMV_TC_WBYTES;
    float d[2][4][4];
    u32 bnext[2] = {0u, 0u};  // bf16 x: B of the odd k-step, from the even step's ldmatrix
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      u32 a[2][4];
#pragma unroll
      for (int m = 0; m < 2; ++m) {  // matrices: rows 0-7 / 8-15 of the tile x k 0-7 / 8-15
        const int row = m * 16 + (mi & 1) * 8 + rr, ch = kk * 2 + (mi >> 1);
        ldsm_x4(st + row * 256 + ((ch ^ rr) << 4), a[m][0], a[m][1], a[m][2], a[m][3]);
      }
      u32 b[NP][2];
      if (XBF16) {
        if ((kk & 1) == 0) {  // one ldmatrix gives B of k-steps kk and kk + 1
          u32 r0, r1, r2, r3;
          const int t = min(rr, T - 1);  // rows >= T: a copy of a real row, for columns never stored
          ldsm_x4(xs + t * XRB + (((kk * 2 + mi) ^ t) << 4), r0, r1, r2, r3);
          b[0][0] = r0; b[0][1] = r1;
          bnext[0] = r2; bnext[1] = r3;
        } else {
          b[0][0] = bnext[0]; b[0][1] = bnext[1];
        }
      } else {
#pragma unroll
        for (int q = 0; q < NP; ++q) b[q][0] = b[q][1] = 0u;
        if (g < T) {
          const u32 xr = xs + g * XRB + (tig & 1) * 8;
          float2 lo, hi;
          asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(lo.x), "=f"(lo.y)
                       : "r"(xr + (((kk * 4 + (tig >> 1)) ^ ((g & 3) << 1)) << 4)) : "memory");
          asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(hi.x), "=f"(hi.y)
                       : "r"(xr + (((kk * 4 + 2 + (tig >> 1)) ^ ((g & 3) << 1)) << 4)) : "memory");
          split3_bf16x2(lo.x, lo.y, b[0][0], b[1 % NP][0], b[2 % NP][0]);
          split3_bf16x2(hi.x, hi.y, b[0][1], b[1 % NP][1], b[2 % NP][1]);
        }
      }
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int q = 0; q < NP; ++q) {
          if (kk < 4 && q == 0) mma16816_bf16_z(d[m][kk], a[m][0], a[m][1], a[m][2], a[m][3], b[q][0], b[q][1]);
          else mma16816_bf16(d[m][kk & 3], a[m][0], a[m][1], a[m][2], a[m][3], b[q][0], b[q][1]);
        }
    }
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][i] += (d[m][0][i] + d[m][1][i]) + (d[m][2][i] + d[m][3][i]);
    __syncwarp();  // every lane is done with this slot before a later issue() refills it
  }
  cp_async_wait<0>();
  // the KS warps' sums, added in warp order by warp 0
  float* red = (float*)(gtc_smem + ks * NS * sbytes);
  if (warp > 0) {
#pragma unroll
    for (int i = 0; i < 8; ++i) red[((warp - 1) * 8 + i) * 32 + lane] = acc[i >> 2][i & 3];
  }
  __syncthreads();
  if (warp > 0) return;
  for (int w = 1; w < ks; ++w)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i >> 2][i & 3] += red[((w - 1) * 8 + i) * 32 + lane];
  // acc[m]: (row g, token 2tig), (row g, 2tig + 1), (row g + 8, 2tig), (row g + 8, 2tig + 1) of tile m
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int t = 2 * tig + (i & 1), row = row0 + (i >> 2) * 16 + g + ((i >> 1) & 1) * 8;
    if (t < T && row < N) {
      const long long o = (long long)t * N + row;
      float v = acc[i >> 2][i & 3];
      if (add0) v = __fadd_rn(v, add0[o]);
      if (add1) v = __fadd_rn(v, add1[o]);
      out[o] = v;
    }
  }
#endif
}

#define SRT_GEMV_TC_ENTRY(NAME, XB, NS)                                                                   \
  extern "C" __global__ void __launch_bounds__(256)                                                       \
      NAME(const __grid_constant__ GemvMats mats, const void* __restrict__ x, int T, int K, int ks) {       \
    gemv_tc<XB, NS>(mats, x, T, K, ks);                                                                  \
  }

// srt_gemv_tc_x<x dtype>_s<stages>: a two-stage ring (it always fits), blocks of KS <= 8 warps.
SRT_GEMV_TC_ENTRY(srt_gemv_tc_xf32_s2, 0, 2)
SRT_GEMV_TC_ENTRY(srt_gemv_tc_xbf16_s2, 1, 2)
