// Exact top-k with the K3.1 tie rule, and the MoE router's top-k.
#include "common.cuh"

// Order-preserving map fp32 -> u32 (larger float -> larger key); -0 is folded onto +0 so that
// equality matches float ==.
SRT_DEV u32 fkey(float f) {
  u32 u = __float_as_uint(f);
  if ((u << 1) == 0u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

SRT_DEV u32 lanemask_lt() {
  u32 m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// One row of scores per block (grid = rows), 1 <= k <= n.
// 1. Radix select (4 passes of 8 bits, integer histograms) finds the threshold key v = the
//    k-th largest, and `need` = how many of the positions equal to v are taken.
// 2. One ascending sweep compacts: positions with key > v in ascending order into out[0..],
//    positions with key == v in ascending order into out[k - need ..] until `need` are out.
// Deterministic: integer counts, block scans in warp order.
// n_dev [rows] (CUDA graphs: the lengths live on the device): when given, row r holds
// min(n, n_dev[r]) scores (n stays the row stride); if that is at most k, out[0..count) = 0, 1, ... ascending
// (every position, in the order the unselected attention reads them).
#ifndef TOPK_THREADS
#error "TOPK_THREADS is passed by the host (-DTOPK_THREADS=..., streamrt/backends/kernel_defines.py)"
#endif
extern "C" __global__ void __launch_bounds__(TOPK_THREADS)
    srt_select_topk(const float* __restrict__ scores, long long* __restrict__ out, int n, int k,
                    const int* __restrict__ n_dev) {
  pdl_begin();
  __shared__ u32 hist[256];
  __shared__ u32 sh_prefix, sh_need;
  __shared__ u32 wg[32], we[32];
  const float* s = scores + (long long)blockIdx.x * n;
  long long* o = out + (long long)blockIdx.x * k;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
  if (n_dev != nullptr) {
    n = min(n, n_dev[blockIdx.x]);
    if (n <= k) {
      for (int i = tid; i < n; i += blockDim.x) o[i] = i;
      return;
    }
  }

  u32 prefix = 0u, mask = 0u, need = (u32)k;
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0u;
    __syncthreads();
    for (int i = tid; i < n; i += blockDim.x) {
      const u32 key = fkey(s[i]);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (warp == 0) {
      // lane l owns bins 255-8l .. 248-8l (descending); scan lanes in descending-bin order
      u32 cnt = 0u;
#pragma unroll
      for (int i = 0; i < 8; ++i) cnt += hist[255 - 8 * lane - i];
      u32 incl = cnt;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const u32 t = __shfl_up_sync(SRT_FULL, incl, off);
        if (lane >= off) incl += t;
      }
      const u32 ball = __ballot_sync(SRT_FULL, incl >= need);
      const int first = __ffs(ball) - 1;  // exists: the total over the prefix group is >= need
      if (lane == first) {
        u32 cum = incl - cnt;
        for (int i = 0; i < 8; ++i) {
          const u32 b = 255u - 8u * lane - i;
          if (cum + hist[b] >= need) {
            sh_prefix = prefix | (b << shift);
            sh_need = need - cum;
            break;
          }
          cum += hist[b];
        }
      }
    }
    __syncthreads();
    prefix = sh_prefix;
    need = sh_need;
    mask |= 255u << shift;
    __syncthreads();
  }
  const u32 thr = prefix;
  const u32 n_gt = (u32)k - need;
  u32 base_g = 0u, base_e = 0u;
  for (int tile = 0; tile < n; tile += blockDim.x) {
    const int i = tile + tid;
    const u32 key = i < n ? fkey(s[i]) : 0u;
    const bool gt = i < n && key > thr, eq = i < n && key == thr;
    const u32 bg = __ballot_sync(SRT_FULL, gt), be = __ballot_sync(SRT_FULL, eq);
    if (lane == 0) {
      wg[warp] = __popc(bg);
      we[warp] = __popc(be);
    }
    __syncthreads();
    u32 og = 0u, oe = 0u, tg = 0u, te = 0u;
    for (int w = 0; w < nw; ++w) {
      if (w < warp) {
        og += wg[w];
        oe += we[w];
      }
      tg += wg[w];
      te += we[w];
    }
    if (gt) o[base_g + og + __popc(bg & lanemask_lt())] = i;
    if (eq) {
      const u32 r = base_e + oe + __popc(be & lanemask_lt());
      if (r < need) o[n_gt + r] = i;
    }
    base_g += tg;
    base_e += te;
    __syncthreads();
    if (base_g >= n_gt && base_e >= need) break;  // uniform: every thread holds the same totals
  }
}

// MoE router top-k for one row per block (grid = T), block ROUTER_THREADS, dynamic smem
// router_smem_bytes(E) (nvrtc_moe.py). logits [T, E] fp32 (x . w_gate);
// s = sigmoid(logit); choice = s + bias; ids = the k largest choices in descending order
// (ties: lower expert id first); w_j = s[ids_j]; if renorm && k > 1: w_j /= (sum_j w_j + 1e-20)
// (sum in j order); w_j *= scale.
// The keys (fkey of the choice) are cut into chunks of 32. If there are at least k chunks, the
// k-th largest chunk maximum tau bounds the k-th largest key from below (k chunks hold a key
// >= tau), so the top k are among the candidates, the keys >= tau, and every other key is below
// them: ranking the candidates among themselves gives their global ranks. A candidate's rank is
// how many candidates beat it (a warp counts 32 at a time); the keys' total order (ties by id)
// makes the ranks a permutation, even for NaN logits, whatever order the candidates were listed in.
// At E = 896, k = 16 a few dozen candidates are ranked instead of 896 keys.
#ifndef ROUTER_THREADS
#error "ROUTER_THREADS is passed by the host (-DROUTER_THREADS=..., streamrt/backends/kernel_defines.py)"
#endif

extern "C" __global__ void __launch_bounds__(ROUTER_THREADS)
    srt_router_topk(const float* __restrict__ logits, const void* __restrict__ bias, int bias_bf16,
                    long long* __restrict__ ids, float* __restrict__ wts, int E, int k, int renorm, float scale) {
  pdl_begin();
  extern __shared__ float rsm[];
  const int C = (E + 31) >> 5;       // chunks of 32 keys
  float* sig = rsm;                  // [E]
  u32* key = (u32*)(rsm + E);        // [E]
  int* cand = (int*)(key + E);       // [E] candidate expert ids, in no particular order
  u32* cmax = (u32*)(cand + E);      // [C]
  __shared__ float wsel[256];
  __shared__ u32 sh_tau;
  __shared__ int sh_n;
  const long long t = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (threadIdx.x == 0) {
    sh_tau = 0u;  // fewer than k chunks: every key is a candidate
    sh_n = 0;
  }
  for (int c = warp; c < C; c += nw) {
    const int i = c * 32 + lane;
    u32 ki = 0u;  // the smallest key: a chunk's padding never raises its maximum
    if (i < E) {
      const float sg = sigmoidf_(logits[t * E + i]);
      sig[i] = sg;
      ki = fkey(sg + ldw(bias, i, bias_bf16));
      key[i] = ki;
    }
    const u32 m = __reduce_max_sync(SRT_FULL, ki);
    if (lane == 0) cmax[c] = m;
  }
  __syncthreads();
  if (warp == 0 && C >= k) {
    for (int c = lane; c < C; c += 32) {
      const u32 mc = cmax[c];
      int rank = 0;
      for (int d = 0; d < C; ++d) rank += (cmax[d] > mc || (cmax[d] == mc && d < c));
      if (rank == k - 1) sh_tau = mc;  // one chunk has that rank: the ranks are a permutation
    }
  }
  __syncthreads();
  const u32 tau = sh_tau;
  for (int i = threadIdx.x; i < E; i += blockDim.x)
    if (key[i] >= tau) cand[atomicAdd(&sh_n, 1)] = i;
  __syncthreads();
  const int n = sh_n;  // >= k
  for (int ci = warp; ci < n; ci += nw) {
    const int i = cand[ci];
    const u32 ki = key[i];
    int rank = 0;  // the same in every lane: the loop's exit is the warp's
    for (int j0 = 0; j0 < n && rank < k; j0 += 32) {
      const int jj = j0 + lane;
      const int j = jj < n ? cand[jj] : 0;
      const u32 kj = key[j];
      rank += __popc(__ballot_sync(SRT_FULL, jj < n && (kj > ki || (kj == ki && j < i))));
    }
    if (lane == 0 && rank < k) {
      ids[t * k + rank] = i;
      wsel[rank] = sig[i];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += wsel[j];
    for (int j = 0; j < k; ++j) {
      float w = wsel[j];
      if (renorm && k > 1) w = w / (sum + 1e-20f);
      wts[t * k + j] = w * scale;
    }
  }
}
