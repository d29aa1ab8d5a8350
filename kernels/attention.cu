// MLA absorbed decode attention (split over positions, then a fixed-order merge), the
// Lightning Indexer scores and the absorbed projections (w_uk, w_uv), every query row of a
// batch in one launch.
#include "common.cuh"

#ifndef MLA_CHUNK  // positions per split
#error "MLA_CHUNK is passed by the host (-DMLA_CHUNK=..., streamrt/backends/kernel_defines.py)"
#endif
#ifndef MLA_HG  // heads per block
#error "MLA_HG is passed by the host (-DMLA_HG=..., streamrt/backends/kernel_defines.py)"
#endif
#ifndef MLA_THREADS
#error "MLA_THREADS is passed by the host (-DMLA_THREADS=..., streamrt/backends/kernel_defines.py)"
#endif

SRT_DEV float ldc(const void* p, long long i, int bf16) { return ldw(p, i, bf16); }

// Query row b = blockIdx.z, all heads; each row reads only its own slices, in the same order
// whatever the number of rows (batch-invariant). Positions pos_j = select[b, j] (or j when
// select is null), j < m. q_lat [B, H, R], q_rot [B, H, Dr] at b * rot_rs + h * rot_hs (a view of
// q_b_proj's output), c [B, n, R], kr [B, n, Dr] (fp32 or bf16: cache_bf16). Split s covers j in [64 s, 64 s + 64); for each head h of the block:
//   score_j = (q_lat[h] . c[pos_j] + q_rot[h] . kr[pos_j]) * scale
//   m_s = max_j score_j;  p_j = exp(score_j - m_s);  l_s = sum_j p_j;  acc_s = sum_j p_j c[pos_j]
// part_acc [B, S, H, R], part_ml [B, S, H, 2]. grid (S, ceil(H / MLA_HG), B), block MLA_THREADS,
// dynamic smem MLA_HG * (R + Dr) * 4 bytes. m_dev [B] (CUDA graphs: the cache lengths live on the
// device): when given, j < min(m, m_dev[b]) and the grid is sized for m; splits past it do nothing.
extern "C" __global__ void __launch_bounds__(MLA_THREADS)
    srt_mla_partial(const float* __restrict__ q_lat, const float* __restrict__ q_rot, const void* __restrict__ c,
                    const void* __restrict__ kr, int n, int cache_bf16, const long long* __restrict__ select, int m,
                    const int* __restrict__ m_dev, int H, int R, int Dr, long long rot_rs, long long rot_hs, float scale,
                    float* __restrict__ part_acc, float* __restrict__ part_ml) {
  pdl_begin();
  extern __shared__ float qs[];  // [MLA_HG][R + Dr]
  __shared__ float sp[MLA_HG][MLA_CHUNK];
  __shared__ long long pos[MLA_CHUNK];
  const int row = blockIdx.z;
  q_lat += (long long)row * H * R;
  q_rot += row * rot_rs;
  const long long c0 = (long long)row * n * R, kr0 = (long long)row * n * Dr;
  if (select != nullptr) select += (long long)row * m;
  part_acc += (long long)row * gridDim.x * H * R;
  part_ml += (long long)row * gridDim.x * H * 2;
  if (m_dev != nullptr) m = min(m, m_dev[row]);
  const int split = blockIdx.x, hg0 = blockIdx.y * MLA_HG;
  const int nh = min(MLA_HG, H - hg0);
  const int j0 = split * MLA_CHUNK, cnt = min(MLA_CHUNK, m - j0);
  if (cnt <= 0) return;
  const int QW = R + Dr;
  for (int i = threadIdx.x; i < MLA_HG * QW; i += blockDim.x) {
    const int h = i / QW, d = i - h * QW;
    float v = 0.0f;
    if (h < nh) v = d < R ? q_lat[(long long)(hg0 + h) * R + d] : q_rot[(hg0 + h) * rot_hs + (d - R)];
    qs[i] = v;
  }
  for (int j = threadIdx.x; j < cnt; j += blockDim.x) pos[j] = select ? select[j0 + j] : (long long)(j0 + j);
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  for (int j = warp; j < cnt; j += nw) {
    const long long pj = pos[j];
    float a[MLA_HG];
#pragma unroll
    for (int h = 0; h < MLA_HG; ++h) a[h] = 0.0f;
    for (int d = lane; d < R; d += 32) {
      const float cv = ldc(c, c0 + pj * R + d, cache_bf16);
#pragma unroll
      for (int h = 0; h < MLA_HG; ++h) a[h] = fmaf(qs[h * QW + d], cv, a[h]);
    }
    for (int d = lane; d < Dr; d += 32) {
      const float kv = ldc(kr, kr0 + pj * Dr + d, cache_bf16);
#pragma unroll
      for (int h = 0; h < MLA_HG; ++h) a[h] = fmaf(qs[h * QW + R + d], kv, a[h]);
    }
#pragma unroll
    for (int h = 0; h < MLA_HG; ++h) {
      const float v = warp_sum(a[h]);
      if (lane == h) sp[h][j] = v * scale;
    }
  }
  __syncthreads();
  if (threadIdx.x < nh) {
    const int h = threadIdx.x;
    float mx = sp[h][0];
    for (int j = 1; j < cnt; ++j) mx = fmaxf(mx, sp[h][j]);
    float l = 0.0f;
    for (int j = 0; j < cnt; ++j) {
      const float p = expf(sp[h][j] - mx);
      sp[h][j] = p;
      l += p;
    }
    part_ml[((long long)split * H + hg0 + h) * 2] = mx;
    part_ml[((long long)split * H + hg0 + h) * 2 + 1] = l;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < R; d += blockDim.x) {
    float acc[MLA_HG];
#pragma unroll
    for (int h = 0; h < MLA_HG; ++h) acc[h] = 0.0f;
    for (int j = 0; j < cnt; ++j) {
      const float cv = ldc(c, c0 + pos[j] * R + d, cache_bf16);
#pragma unroll
      for (int h = 0; h < MLA_HG; ++h) acc[h] = fmaf(sp[h][j], cv, acc[h]);
    }
#pragma unroll
    for (int h = 0; h < MLA_HG; ++h)
      if (h < nh) part_acc[((long long)split * H + hg0 + h) * R + d] = acc[h];
  }
}

// Merge the splits in ascending split order: M = max_s m_s, L = sum_s l_s e^(m_s - M),
// out[b, h, d] = sum_s acc_s[h, d] e^(m_s - M) / L. grid (H, B), block 256. m_dev: as
// srt_mla_partial's (row b then merges the splits of min(m, m_dev[b]) positions).
extern "C" __global__ void srt_mla_combine(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                           float* __restrict__ out, int S, int H, int R, int m,
                                           const int* __restrict__ m_dev) {
  pdl_begin();
  const int row = blockIdx.y;
  part_acc += (long long)row * S * H * R;
  part_ml += (long long)row * S * H * 2;
  out += (long long)row * H * R;
  if (m_dev != nullptr) S = (min(m, m_dev[row]) + MLA_CHUNK - 1) / MLA_CHUNK;
  const int h = blockIdx.x;
  float M = part_ml[(long long)h * 2];
  for (int s = 1; s < S; ++s) M = fmaxf(M, part_ml[((long long)s * H + h) * 2]);
  float L = 0.0f;
  for (int s = 0; s < S; ++s) L += part_ml[((long long)s * H + h) * 2 + 1] * expf(part_ml[((long long)s * H + h) * 2] - M);
  const float invL = 1.0f / L;
  for (int d = threadIdx.x; d < R; d += blockDim.x) {
    float acc = 0.0f;
    for (int s = 0; s < S; ++s)
      acc = fmaf(part_acc[((long long)s * H + h) * R + d], expf(part_ml[((long long)s * H + h) * 2] - M), acc);
    out[(long long)h * R + d] = acc * invL;
  }
}

// Lightning Indexer, query row b = blockIdx.y: I[b, s] = sum_h (w[b, h] * w_scale) * relu(q[b, h] . k[b, s]).
// q [B, Hi, Di], w [B, Hi] fp32 (weights_proj's output; w_scale is the indexer's fixed scale); k [B, n, Di] fp32 or bf16; out [B, n]. One warp per position:
// the key row is staged in shared memory, lane h computes head h's dot (d ascending), heads
// meet in a butterfly. grid (ceil(n / (IDX_WARPS*IDX_PPW)), B), block IDX_WARPS*32, dynamic smem
// (Hi*(Di+1) + IDX_WARPS*Di)*4. n_dev [B]: when given, row b scores only s < min(n, n_dev[b])
// (the grid is sized for n).
#ifndef IDX_WARPS
#error "IDX_WARPS is passed by the host (-DIDX_WARPS=..., streamrt/backends/kernel_defines.py)"
#endif
#ifndef IDX_PPW
#error "IDX_PPW is passed by the host (-DIDX_PPW=..., streamrt/backends/kernel_defines.py)"
#endif
extern "C" __global__ void __launch_bounds__(IDX_WARPS * 32)
    srt_indexer_scores(const float* __restrict__ q, const float* __restrict__ w, const void* __restrict__ kc,
                       int kc_bf16, float* __restrict__ out, int n, const int* __restrict__ n_dev, int Hi,
                       int Di, float w_scale) {
  pdl_begin();
  extern __shared__ float ism[];
  const int row = blockIdx.y;
  q += (long long)row * Hi * Di;
  w += (long long)row * Hi;
  out += (long long)row * n;
  const long long k0 = (long long)row * n * Di;
  if (n_dev != nullptr) n = min(n, n_dev[row]);
  float* qs = ism;                        // [Hi][Di + 1] (padded: lanes read different rows)
  float* ks = ism + Hi * (Di + 1);        // [IDX_WARPS][Di]
  for (int i = threadIdx.x; i < Hi * Di; i += blockDim.x) {
    const int h = i / Di, d = i - h * Di;
    qs[h * (Di + 1) + d] = q[i];
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* kw = ks + warp * Di;
  for (int u = 0; u < IDX_PPW; ++u) {
    const long long s = ((long long)blockIdx.x * IDX_WARPS + warp) * IDX_PPW + u;
    if (s >= n) break;
    for (int d = lane; d < Di; d += 32) kw[d] = ldw(kc, k0 + s * Di + d, kc_bf16);
    __syncwarp();
    float v = 0.0f;
    for (int h = lane; h < Hi; h += 32) {
      const float* qh = qs + h * (Di + 1);
      float dot = 0.0f;
      for (int d = 0; d < Di; ++d) dot = fmaf(qh[d], kw[d], dot);
      v = fmaf(w[h] * w_scale, fmaxf(dot, 0.0f), v);  // w * w_scale rounded first, as the torch twin
    }
    v = warp_sum(v);
    if (lane == 0) out[s] = v;
    __syncwarp();
  }
}

// The absorbed projections of MLA decode, per head h, for rows b < B:
//   absorb: q_lat[b, h, r] = sum_d q[b, h, d] w_uk[h, d, r]   (w_uk [H, dn, R])
//   expand: o[b, h, v]     = sum_r w_uv[h, v, r] x[b, h, r]   (w_uv [H, dv, R])
// w: fp32 or bf16, element (h, i, r) at h * head_stride + i * R + r (a view of kv_b_proj).
// absorb's q[b, h, d] is at b * q_rs + h * q_hs + d (a view of q_b_proj's output).
// Each output is summed in a fixed order, the rows taken MLA_ROWS at a time, so a row's bits do
// not depend on B. absorb: warp w of 8 chains d = w, w + 8, ... for 32 columns r (a lane
// each), the 8 chains added in warp order; grid (ceil(R / 32), H), block 256. expand: a warp
// per output column v, r strided over the lanes, then a butterfly; grid (ceil(dv / 8), H),
// block 256.
#define MLA_ROWS 8
extern "C" __global__ void __launch_bounds__(256)
    srt_mla_absorb(const float* __restrict__ q, long long q_rs, long long q_hs, const void* __restrict__ w, int w_bf16,
                   long long head_stride, float* __restrict__ out, int B, int H, int dn, int R) {
  pdl_begin();
  __shared__ float part[8][MLA_ROWS][32];
  const int h = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = blockIdx.x * 32 + lane;
  const long long w0 = (long long)h * head_stride + min(r, R - 1);
  for (int b0 = 0; b0 < B; b0 += MLA_ROWS) {
    const int nb = min(MLA_ROWS, B - b0);
    float acc[MLA_ROWS];
#pragma unroll
    for (int i = 0; i < MLA_ROWS; ++i) acc[i] = 0.0f;
    for (int d = warp; d < dn; d += 8) {
      const float wv = ldw(w, w0 + (long long)d * R, w_bf16);
#pragma unroll
      for (int i = 0; i < MLA_ROWS; ++i)
        if (i < nb) acc[i] = fmaf(q[(b0 + i) * q_rs + h * q_hs + d], wv, acc[i]);
    }
#pragma unroll
    for (int i = 0; i < MLA_ROWS; ++i) part[warp][i][lane] = acc[i];
    __syncthreads();
    if (warp < nb && r < R) {  // warp i writes row b0 + i
      float t = part[0][warp][lane];
      for (int u = 1; u < 8; ++u) t += part[u][warp][lane];
      out[((long long)(b0 + warp) * H + h) * R + r] = t;
    }
    __syncthreads();
  }
}

extern "C" __global__ void __launch_bounds__(256)
    srt_mla_expand(const float* __restrict__ x, const void* __restrict__ w, int w_bf16, long long head_stride,
                   float* __restrict__ out, int B, int H, int dv, int R) {
  pdl_begin();
  const int h = blockIdx.y, lane = threadIdx.x & 31, v = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (v >= dv) return;
  const long long w0 = (long long)h * head_stride + (long long)v * R;
  for (int b0 = 0; b0 < B; b0 += MLA_ROWS) {
    const int nb = min(MLA_ROWS, B - b0);
    float acc[MLA_ROWS];
#pragma unroll
    for (int i = 0; i < MLA_ROWS; ++i) acc[i] = 0.0f;
    for (int r = lane; r < R; r += 32) {
      const float wv = ldw(w, w0 + r, w_bf16);
#pragma unroll
      for (int i = 0; i < MLA_ROWS; ++i)
        if (i < nb) acc[i] = fmaf(wv, x[((long long)(b0 + i) * H + h) * R + r], acc[i]);
    }
#pragma unroll
    for (int i = 0; i < MLA_ROWS; ++i) {
      const float t = warp_sum(acc[i]);
      if (lane == 0 && i < nb) out[((long long)(b0 + i) * H + h) * dv + v] = t;
    }
  }
}
