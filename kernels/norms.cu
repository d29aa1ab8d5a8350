// Row-wise decode ops: RMSNorm, sigmoid-gated RMSNorm, LayerNorm (w + b), L2 norm, the AttnRes
// depth mix (one block per row, grid.x = rows; fixed-order block reductions, common.cuh), and
// the elementwise ones: SiTU-GLU, the sigmoid gate, KDA's gates, the short causal conv step, and
// the decode's cache append.
#include "common.cuh"

// out[r, :] = (x * rsqrt(mean(x^2) + eps)) * w          x, out [rows, D]; w [D]
extern "C" __global__ void srt_rmsnorm(const float* __restrict__ x, const void* __restrict__ w, int w_bf16,
                                       float* __restrict__ out, int D, float eps) {
  pdl_begin();
  __shared__ float red[32];
  const long long r = blockIdx.x;
  const float* xr = x + r * D;
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

// AttnRes, one block per row t. Source s < S is row t of the [T, D] fp32 tensor at src.v[s]
// (the completed blocks, then the in-block partial sum). wq[d] = norm_w[d] * proj_w[d] (fp32).
// logit_s = sum_d (V_s[d] * rsqrt(mean(V_s^2) + eps)) * wq[d];
// p = softmax_s(logit); out[t, :] = sum_s p_s V_s (s ascending).
// With out_w: then out[t, :] = rmsnorm(out[t, :]) * out_w (srt_rmsnorm's arithmetic and order,
// the same block size: the bits of the two kernels one after the other).
// Up to ATTNRES_GROUP sources share each pass over d and each pair of block reductions
// (block_sum_n): the loads of a group are in flight together, and S sources cost two
// reductions per group, not two per source. Each source's sums keep block_sum's order.
#ifndef SRT_ATTNRES_MAXS
#error "SRT_ATTNRES_MAXS is passed by the host (-DSRT_ATTNRES_MAXS=..., streamrt/backends/kernel_defines.py)"
#endif
#define ATTNRES_GROUP 16
struct AttnResSources {
  u64 v[SRT_ATTNRES_MAXS];
};

extern "C" __global__ void srt_attnres_mix(const __grid_constant__ AttnResSources src, int S,
                                           const void* __restrict__ norm_w, int norm_bf16,
                                           const void* __restrict__ proj_w, int proj_bf16, float* __restrict__ out,
                                           int D, float eps, const void* __restrict__ out_w, int out_bf16,
                                           float out_eps) {
  pdl_begin();
  __shared__ float red[32 * ATTNRES_GROUP];
  __shared__ float logit[SRT_ATTNRES_MAXS];
  __shared__ float prob[SRT_ATTNRES_MAXS];
  const long long t = blockIdx.x;
  for (int s0 = 0; s0 < S; s0 += ATTNRES_GROUP) {
    const int n = min(ATTNRES_GROUP, S - s0);
    const float* v[ATTNRES_GROUP];
    float ss[ATTNRES_GROUP], dq[ATTNRES_GROUP];
#pragma unroll
    for (int j = 0; j < ATTNRES_GROUP; ++j) {
      v[j] = j < n ? (const float*)src.v[s0 + j] + t * D : nullptr;
      ss[j] = 0.0f;
      dq[j] = 0.0f;
    }
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
#pragma unroll
      for (int j = 0; j < ATTNRES_GROUP; ++j)
        if (j < n) ss[j] = fmaf(v[j][i], v[j][i], ss[j]);
    }
    block_sum_n(ss, n, red);
#pragma unroll
    for (int j = 0; j < ATTNRES_GROUP; ++j) ss[j] = 1.0f / sqrtf(ss[j] / (float)D + eps);  // now inv
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
      const float wq = __fmul_rn(ldw(norm_w, i, norm_bf16), ldw(proj_w, i, proj_bf16));
#pragma unroll
      for (int j = 0; j < ATTNRES_GROUP; ++j)
        if (j < n) dq[j] = fmaf(v[j][i] * ss[j], wq, dq[j]);
    }
    block_sum_n(dq, n, red);
    if (threadIdx.x == 0)
      for (int j = 0; j < n; ++j) logit[s0 + j] = dq[j];
  }
  __syncthreads();
  float m = logit[0];
  for (int s = 1; s < S; ++s) m = fmaxf(m, logit[s]);
  float l = 0.0f;
  for (int s = 0; s < S; ++s) l += expf(logit[s] - m);
  for (int s = threadIdx.x; s < S; s += blockDim.x) prob[s] = expf(logit[s] - m) / l;
  __syncthreads();
  float* o = out + t * (long long)D;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    float acc = 0.0f;
    for (int s = 0; s < S; ++s) acc = fmaf(prob[s], ((const float*)src.v[s])[t * D + i], acc);
    o[i] = acc;
    ss = fmaf(acc, acc, ss);
  }
  if (out_w == nullptr) return;
  ss = block_sum(ss, red);
  const float inv = 1.0f / sqrtf(ss / (float)D + out_eps);
  for (int i = threadIdx.x; i < D; i += blockDim.x) o[i] = (o[i] * inv) * ldw(out_w, i, out_bf16);  // own writes
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
