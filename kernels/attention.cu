// MLA absorbed decode attention (split over positions, then a fixed-order merge) and the
// Lightning Indexer scores.
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

// One query row, all heads. Positions pos_j = select[j] (or j when select is null), j < m.
// q_lat [H, R], q_rot [H, Dr], c [n, R], kr [n, Dr] (fp32 or bf16: cache_bf16).
// Split s covers j in [64 s, 64 s + 64); for each head h of the block:
//   score_j = (q_lat[h] . c[pos_j] + q_rot[h] . kr[pos_j]) * scale
//   m_s = max_j score_j;  p_j = exp(score_j - m_s);  l_s = sum_j p_j;  acc_s = sum_j p_j c[pos_j]
// part_acc [S, H, R], part_ml [S, H, 2]. grid (S, ceil(H / MLA_HG)), block MLA_THREADS,
// dynamic smem MLA_HG * (R + Dr) * 4 bytes. m_dev (CUDA graphs: the cache length lives on the
// device): when given, j < min(m, *m_dev) and the grid is sized for m; splits past it do nothing.
extern "C" __global__ void __launch_bounds__(MLA_THREADS)
    srt_mla_partial(const float* __restrict__ q_lat, const float* __restrict__ q_rot, const void* __restrict__ c,
                    const void* __restrict__ kr, int cache_bf16, const long long* __restrict__ select, int m,
                    const int* __restrict__ m_dev, int H, int R, int Dr, float scale, float* __restrict__ part_acc,
                    float* __restrict__ part_ml) {
  extern __shared__ float qs[];  // [MLA_HG][R + Dr]
  __shared__ float sp[MLA_HG][MLA_CHUNK];
  __shared__ long long pos[MLA_CHUNK];
  if (m_dev != nullptr) m = min(m, *m_dev);
  const int split = blockIdx.x, hg0 = blockIdx.y * MLA_HG;
  const int nh = min(MLA_HG, H - hg0);
  const int j0 = split * MLA_CHUNK, cnt = min(MLA_CHUNK, m - j0);
  if (cnt <= 0) return;
  const int QW = R + Dr;
  for (int i = threadIdx.x; i < MLA_HG * QW; i += blockDim.x) {
    const int h = i / QW, d = i - h * QW;
    float v = 0.0f;
    if (h < nh) v = d < R ? q_lat[(long long)(hg0 + h) * R + d] : q_rot[(long long)(hg0 + h) * Dr + (d - R)];
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
      const float cv = ldc(c, pj * R + d, cache_bf16);
#pragma unroll
      for (int h = 0; h < MLA_HG; ++h) a[h] = fmaf(qs[h * QW + d], cv, a[h]);
    }
    for (int d = lane; d < Dr; d += 32) {
      const float kv = ldc(kr, pj * Dr + d, cache_bf16);
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
      const float cv = ldc(c, pos[j] * R + d, cache_bf16);
#pragma unroll
      for (int h = 0; h < MLA_HG; ++h) acc[h] = fmaf(sp[h][j], cv, acc[h]);
    }
#pragma unroll
    for (int h = 0; h < MLA_HG; ++h)
      if (h < nh) part_acc[((long long)split * H + hg0 + h) * R + d] = acc[h];
  }
}

// Merge the splits in ascending split order: M = max_s m_s, L = sum_s l_s e^(m_s - M),
// out[h, d] = sum_s acc_s[h, d] e^(m_s - M) / L. grid H, block 256. m_dev: as srt_mla_partial's
// (S is then the splits of min(m, *m_dev) positions).
extern "C" __global__ void srt_mla_combine(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                           float* __restrict__ out, int S, int H, int R, int m,
                                           const int* __restrict__ m_dev) {
  if (m_dev != nullptr) S = (min(m, *m_dev) + MLA_CHUNK - 1) / MLA_CHUNK;
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

// Lightning Indexer, one query: I[s] = sum_h w[h] * relu(q[h] . k[s]).
// q [Hi, Di], w [Hi] fp32; k [n, Di] fp32 or bf16. One warp per position: the key row is staged
// in shared memory, lane h computes head h's dot (d ascending), heads meet in a butterfly.
// grid ceil(n / (IDX_WARPS*IDX_PPW)), block IDX_WARPS*32, dynamic smem (Hi*(Di+1) + IDX_WARPS*Di)*4.
// n_dev: when given, only s < min(n, *n_dev) are scored (the grid is sized for n).
#ifndef IDX_WARPS
#error "IDX_WARPS is passed by the host (-DIDX_WARPS=..., streamrt/backends/kernel_defines.py)"
#endif
#ifndef IDX_PPW
#error "IDX_PPW is passed by the host (-DIDX_PPW=..., streamrt/backends/kernel_defines.py)"
#endif
extern "C" __global__ void __launch_bounds__(IDX_WARPS * 32)
    srt_indexer_scores(const float* __restrict__ q, const float* __restrict__ w, const void* __restrict__ kc,
                       int kc_bf16, float* __restrict__ out, int n, const int* __restrict__ n_dev, int Hi,
                       int Di) {
  extern __shared__ float ism[];
  if (n_dev != nullptr) n = min(n, *n_dev);
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
    for (int d = lane; d < Di; d += 32) kw[d] = ldw(kc, s * Di + d, kc_bf16);
    __syncwarp();
    float v = 0.0f;
    for (int h = lane; h < Hi; h += 32) {
      const float* qh = qs + h * (Di + 1);
      float dot = 0.0f;
      for (int d = 0; d < Di; ++d) dot = fmaf(qh[d], kw[d], dot);
      v = fmaf(w[h], fmaxf(dot, 0.0f), v);
    }
    v = warp_sum(v);
    if (lane == 0) out[s] = v;
    __syncwarp();
  }
}
