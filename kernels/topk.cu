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

// MoE router top-k for one row per block (grid = T), block ROUTER_THREADS,
// dynamic smem E * 8 bytes. logits [T, E] fp32 (x . w_gate);
// s = sigmoid(logit); choice = s + bias; ids = the k largest choices in descending order
// (ties: lower expert id first); w_j = s[ids_j]; if renorm && k > 1: w_j /= (sum_j w_j + 1e-20)
// (sum in j order); w_j *= scale.
// Each expert finds its own rank (how many keys beat it, fkey) in one pass, so a block needs
// two barriers, not two per selected expert; the keys' total order makes the ranks a permutation
// even for NaN logits. ROUTER_THREADS is a multiple of 32.
#ifndef ROUTER_THREADS
#error "ROUTER_THREADS is passed by the host (-DROUTER_THREADS=..., streamrt/backends/kernel_defines.py)"
#endif

extern "C" __global__ void __launch_bounds__(ROUTER_THREADS)
    srt_router_topk(const float* __restrict__ logits, const void* __restrict__ bias, int bias_bf16,
                    long long* __restrict__ ids, float* __restrict__ wts, int E, int k, int renorm, float scale) {
  pdl_begin();
  extern __shared__ float rsm[];
  float* sig = rsm;                  // [E]
  u32* key = (u32*)(rsm + E);        // [E]
  __shared__ float wsel[256];
  const long long t = blockIdx.x;
  for (int i = threadIdx.x; i < E; i += blockDim.x) {
    const float sg = sigmoidf_(logits[t * E + i]);
    sig[i] = sg;
    key[i] = fkey(sg + ldw(bias, i, bias_bf16));
  }
  __syncthreads();
  // a warp per expert, its lanes over 32 keys at a time: a top expert's scan of all E keys is
  // E / 32 steps (one thread per expert took E steps, ~150 us a row at E = 896 on an H200)
  const int lane = threadIdx.x & 31;
  for (int i = threadIdx.x >> 5; i < E; i += blockDim.x >> 5) {
    const u32 ki = key[i];
    int rank = 0;  // the same in every lane: the loop's exit is the warp's
    for (int j0 = 0; j0 < E && rank < k; j0 += 32) {
      const int j = j0 + lane;
      const u32 kj = j < E ? key[j] : 0u;
      rank += __popc(__ballot_sync(SRT_FULL, j < E && (kj > ki || (kj == ki && j < i))));
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
