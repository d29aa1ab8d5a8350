// Row-wise decode ops: RMSNorm, sigmoid-gated RMSNorm, LayerNorm (w + b), L2 norm, the AttnRes
// depth mix (one block per row, grid.x = rows; fixed-order block reductions, common.cuh), and
// the elementwise ones: SiTU-GLU, the sigmoid gate, KDA's gates, the short causal conv step, and
// the decode's cache append.
#include "common.cuh"

// out[r, :] = (x * rsqrt(mean(x^2) + eps)) * w          x [rows, D] at r * x_rs (a view may
// skip columns between rows), out [rows, D]; w [D]
extern "C" __global__ void srt_rmsnorm(const float* __restrict__ x, long long x_rs, const void* __restrict__ w,
                                       int w_bf16, float* __restrict__ out, int D, float eps) {
  pdl_begin();
  __shared__ float red[32];
  const long long r = blockIdx.x;
  const float* xr = x + r * x_rs;
  float s = 0.0f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) s = fmaf(xr[i], xr[i], s);
  s = block_sum(s, red);
  const float inv = 1.0f / sqrtf(s / (float)D + eps);
  for (int i = threadIdx.x; i < D; i += blockDim.x) out[r * D + i] = (xr[i] * inv) * ldw(w, i, w_bf16);
}

// KDA output norm, per (t, h) row of V: (o * rsqrt(mean(o^2) + eps)) * w * sigmoid(gate).
extern "C" __global__ void srt_gated_rmsnorm(const float* __restrict__ o, const float* __restrict__ gate,
                                             const void* __restrict__ w, int w_bf16, float* __restrict__ out,
                                             int V, float eps) {
  pdl_begin();
  __shared__ float red[32];
  const long long r = blockIdx.x;
  const float* orow = o + r * V;
  float s = 0.0f;
  for (int i = threadIdx.x; i < V; i += blockDim.x) s = fmaf(orow[i], orow[i], s);
  s = block_sum(s, red);
  const float inv = 1.0f / sqrtf(s / (float)V + eps);
  for (int i = threadIdx.x; i < V; i += blockDim.x)
    out[r * V + i] = ((orow[i] * inv) * ldw(w, i, w_bf16)) * sigmoidf_(gate[r * V + i]);
}

// LayerNorm with weight and bias over the last dim (biased variance, two passes).
extern "C" __global__ void srt_layernorm(const float* __restrict__ x, const void* __restrict__ w,
                                         const void* __restrict__ b, int wb_bf16, float* __restrict__ out, int D,
                                         float eps) {
  pdl_begin();
  __shared__ float red[32];
  const long long r = blockIdx.x;
  const float* xr = x + r * D;
  float s = 0.0f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) s += xr[i];
  const float mu = block_sum(s, red) / (float)D;
  float q = 0.0f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    const float c = xr[i] - mu;
    q = fmaf(c, c, q);
  }
  const float inv = 1.0f / sqrtf(block_sum(q, red) / (float)D + eps);
  for (int i = threadIdx.x; i < D; i += blockDim.x)
    out[r * D + i] = (xr[i] - mu) * inv * ldw(w, i, wb_bf16) + ldw(b, i, wb_bf16);
}

// (x * rsqrt(sum(x^2) + eps)) * scale over the last dim (scale: KDA's q takes K^-0.5 here).
extern "C" __global__ void srt_l2norm(const float* __restrict__ x, float* __restrict__ out, int D, float eps,
                                      float scale) {
  pdl_begin();
  __shared__ float red[32];
  const long long r = blockIdx.x;
  const float* xr = x + r * D;
  float s = 0.0f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) s = fmaf(xr[i], xr[i], s);
  const float inv = 1.0f / sqrtf(block_sum(s, red) + eps);
  for (int i = threadIdx.x; i < D; i += blockDim.x) out[r * D + i] = __fmul_rn(xr[i] * inv, scale);
}

// Elementwise SiTU-GLU over n elements (grid-stride).
extern "C" __global__ void srt_situ_glu(const float* __restrict__ gate, const float* __restrict__ up,
                                        float* __restrict__ out, long long n, float beta, int beta_inf,
                                        float lbeta, int has_lin) {
  pdl_begin();
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    out[i] = situ(gate[i], up[i], beta, beta_inf, lbeta, has_lin);
}

// out[i] = x[i] * (1 / (1 + exp(-gate[i]))) over n elements (MLA's output gate).
extern "C" __global__ void srt_sigmoid_mul(const float* __restrict__ x, const float* __restrict__ gate,
                                           float* __restrict__ out, long long n) {
  pdl_begin();
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    out[i] = __fmul_rn(x[i], __frcp_rn(__fadd_rn(expf(-gate[i]), 1.0f)));
}

// KDA's gates of N rows, one thread per (n, h, k) element of g (and the (n, h) ones of beta):
//   g[n, h, k] = lb * sigmoid(exp(a_log[h]) * (f[n, h, k] + dt_bias[h * K + k]));  beta[n, h] = sigmoid(b[n, h])
// with sigmoid(x) = 1 / (exp(-x) + 1), each step rounded as the torch definition (ops.kda_gate).
extern "C" __global__ void srt_kda_gates(const float* __restrict__ f, const float* __restrict__ b,
                                         const void* __restrict__ a_log, int a_bf16, const void* __restrict__ dt_bias,
                                         int dt_bf16, float* __restrict__ g, float* __restrict__ beta, int N, int H,
                                         int K, float lb) {
  pdl_begin();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // = (n * H + h) * K + k
  if (i >= (long long)N * H * K) return;
  const int hk = (int)(i % ((long long)H * K)), h = hk / K;
  const float u = __fadd_rn(f[i], ldw(dt_bias, hk, dt_bf16));
  const float t = __fmul_rn(expf(ldw(a_log, h, a_bf16)), u);
  g[i] = __fmul_rn(lb, __frcp_rn(__fadd_rn(expf(-t), 1.0f)));
  if (hk % K == 0) {
    const long long nh = i / K;
    beta[nh] = __frcp_rn(__fadd_rn(expf(-b[nh]), 1.0f));
  }
}

// Depthwise causal conv of one element i = t * P + p, one token: state[t, p, :] <- roll left,
// state[t, p, W-1] = z[i] (in place); returns SiLU(sum_j state[t, p, j] * w[p, j]), j ascending.
SRT_DEV float conv_step(const float* __restrict__ z, float* __restrict__ state, const void* __restrict__ w,
                        int w_bf16, long long i, long long p, int W) {
  float* s = state + i * W;
  float acc = 0.0f;
  for (int j = 0; j < W; ++j) {
    const float v = (j + 1 < W) ? s[j + 1] : z[i];
    s[j] = v;
    acc = fmaf(v, ldw(w, p * W + j, w_bf16), acc);
  }
  return acc * sigmoidf_(acc);
}

// The short causal conv step, one thread per (t, p) (conv_step).
extern "C" __global__ void srt_short_conv_step(const float* __restrict__ z, float* __restrict__ state,
                                               const void* __restrict__ w, int w_bf16, float* __restrict__ out,
                                               int T, int P, int W) {
  pdl_begin();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // = t * P + p
  if (i >= (long long)T * P) return;
  out[i] = conv_step(z, state, w, w_bf16, i, i % P, W);
}

// KDA's decode conv step for q, k and v at once, then the L2 norms of q and k (per head of K):
// blockIdx.y = 0 (q), 1 (k), 2 (v); block per (t, h), block_threads(K, 512) threads (srt_l2norm's
// block for a row of K, so the norms are its bits). Each element is conv_step (state [T, P, W]
// rolled in place, P = H * K); q then * q_scale as srt_l2norm's scale.
struct KdaConvTab {
  u64 z[3], state[3], w[3], out[3];
  int w_bf16[3];
};

extern "C" __global__ void srt_kda_conv_step(const __grid_constant__ KdaConvTab tab, int H, int K, int W, float eps,
                                             float q_scale) {
  pdl_begin();
  __shared__ float red[32];
  const int which = blockIdx.y, t = blockIdx.x / H, h = blockIdx.x - t * H;
  const long long P = (long long)H * K, row = (long long)t * P + (long long)h * K;
  const float* z = (const float*)tab.z[which];
  float* state = (float*)tab.state[which];
  float* out = (float*)tab.out[which];
  float ss = 0.0f;
  for (int kk = threadIdx.x; kk < K; kk += blockDim.x) {
    const long long i = row + kk;
    const float y = conv_step(z, state, (const void*)tab.w[which], tab.w_bf16[which], i, (long long)h * K + kk, W);
    out[i] = y;
    ss = fmaf(y, y, ss);
  }
  if (which == 2) return;  // v: the conv only (the whole block)
  const float inv = 1.0f / sqrtf(block_sum(ss, red) + eps);
  const float scale = which == 0 ? q_scale : 1.0f;
  for (int kk = threadIdx.x; kk < K; kk += blockDim.x) out[row + kk] = __fmul_rn(out[row + kk] * inv, scale);  // own writes
}

// AttnRes over row t of S sources: source s < S is row t of the [T, D] fp32 tensor at src.v[s]
// (the completed blocks, then the in-block partial sum); wq[d] = norm_w[d] * proj_w[d] (fp32).
// logit_s = rsqrt(mean(V_s^2) + eps) * sum_d V_s[d] wq[d]; p = softmax_s(logit);
// out[t, :] = sum_s p_s V_s (s ascending). A decode row is ~10 sources of a few thousand floats:
// one block per row leaves that short read to one SM, so both passes split d into
// ATTNRES_SLICE-wide slices, one block each (flat grid t * slices + slice), in two kernels:
//   srt_attnres_stats: per (row, source, slice) the sums of V^2 and of V * wq;
//   srt_attnres_apply: every block of a row reduces those sums in one fixed order (the same
//   logits and bits in each), then mixes its slice.
// The order of every sum depends on d and S only: a row's bits do not depend on T.
#ifndef ATTNRES_MAXS
#error "ATTNRES_MAXS is passed by the host (-DATTNRES_MAXS=..., streamrt/backends/kernel_defines.py)"
#endif
#ifndef ATTNRES_SLICE
#error "ATTNRES_SLICE is passed by the host (-DATTNRES_SLICE=..., streamrt/backends/kernel_defines.py)"
#endif
#if ATTNRES_SLICE % 32 != 0 || ATTNRES_SLICE > 1024
#error "ATTNRES_SLICE is a block's threads: a multiple of 32, at most 1024"
#endif
#define ATTNRES_LANE (ATTNRES_SLICE / 32)  // elements of a slice per lane
struct AttnResSources {
  u64 v[ATTNRES_MAXS];
};

// block ATTNRES_SLICE threads: warp w takes sources w, w + warps, ...; lane l elements l + 32 j
// of the slice.
// stats[((t * S + s) * slices + slice) * 2 + {0, 1}] = (sum V^2, sum V wq) over the slice.
extern "C" __global__ void srt_attnres_stats(const __grid_constant__ AttnResSources src, int S,
                                             const void* __restrict__ norm_w, int norm_bf16,
                                             const void* __restrict__ proj_w, int proj_bf16,
                                             float* __restrict__ stats, int D) {
  pdl_begin();
  const int slices = (D + ATTNRES_SLICE - 1) / ATTNRES_SLICE;
  const long long t = blockIdx.x / slices;
  const int slice = blockIdx.x % slices, l = threadIdx.x & 31, d0 = slice * ATTNRES_SLICE + l;
  float wq[ATTNRES_LANE];
#pragma unroll
  for (int j = 0; j < ATTNRES_LANE; ++j) {
    const int d = d0 + 32 * j;
    wq[j] = d < D ? __fmul_rn(ldw(norm_w, d, norm_bf16), ldw(proj_w, d, proj_bf16)) : 0.0f;
  }
  for (int s = threadIdx.x >> 5; s < S; s += blockDim.x >> 5) {
    const float* v = (const float*)src.v[s] + t * D;
    float x[ATTNRES_LANE];
#pragma unroll
    for (int j = 0; j < ATTNRES_LANE; ++j) x[j] = d0 + 32 * j < D ? v[d0 + 32 * j] : 0.0f;  // all in flight
    float ss = 0.0f, dot = 0.0f;
#pragma unroll
    for (int j = 0; j < ATTNRES_LANE; ++j) {
      ss = fmaf(x[j], x[j], ss);
      dot = fmaf(x[j], wq[j], dot);
    }
    ss = warp_sum(ss);
    dot = warp_sum(dot);
    if (l == 0) {
      float* st = stats + ((t * S + s) * slices + slice) * 2;
      st[0] = ss;
      st[1] = dot;
    }
  }
}

// block ATTNRES_SLICE threads, one element of the slice each (the grid of srt_attnres_stats).
extern "C" __global__ void srt_attnres_apply(const __grid_constant__ AttnResSources src, int S,
                                             const float* __restrict__ stats, float* __restrict__ out, int D,
                                             float eps) {
  pdl_begin();
  __shared__ float logit[ATTNRES_MAXS];
  __shared__ float prob[ATTNRES_MAXS];
  const int slices = (D + ATTNRES_SLICE - 1) / ATTNRES_SLICE;
  const long long t = blockIdx.x / slices;
  const int l = threadIdx.x & 31, d = (blockIdx.x % slices) * ATTNRES_SLICE + threadIdx.x;
  for (int s = threadIdx.x >> 5; s < S; s += blockDim.x >> 5) {
    const float* st = stats + (t * S + s) * slices * 2;
    float ss = 0.0f, dot = 0.0f;
    for (int i = l; i < slices; i += 32) {
      ss += st[2 * i];
      dot += st[2 * i + 1];
    }
    ss = warp_sum(ss);
    dot = warp_sum(dot);
    if (l == 0) logit[s] = dot * (1.0f / sqrtf(ss / (float)D + eps));
  }
  __syncthreads();
  float m = logit[0];
  for (int s = 1; s < S; ++s) m = fmaxf(m, logit[s]);
  float sum = 0.0f;
  for (int s = 0; s < S; ++s) sum += expf(logit[s] - m);
  for (int s = threadIdx.x; s < S; s += blockDim.x) prob[s] = expf(logit[s] - m) / sum;
  __syncthreads();
  if (d >= D) return;
  float acc = 0.0f;
  for (int s = 0; s < S; ++s) acc = fmaf(prob[s], ((const float*)src.v[s])[t * D + d], acc);
  out[t * (long long)D + d] = acc;
}

// The decode's cache append: for up to 4 (dst [B, cap, W_i], src [B, W_i] with row stride
// stride_i) fp32 pairs, dst_i[b, len[b], :] = src_i[b, :]. grid (B, pairs), block 256.
struct CacheAppend {
  u64 dst[4], src[4];
  int width[4], stride[4];
};

extern "C" __global__ void srt_cache_append(const __grid_constant__ CacheAppend tab, const int* __restrict__ len,
                                            int cap) {
  pdl_begin();
  const int b = blockIdx.x, i = blockIdx.y, W = tab.width[i];
  float* d = (float*)tab.dst[i] + ((long long)b * cap + len[b]) * W;
  const float* s = (const float*)tab.src[i] + (long long)b * tab.stride[i];
  for (int j = threadIdx.x; j < W; j += blockDim.x) d[j] = s[j];
}
