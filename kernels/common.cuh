// streamrt kernels: shared device helpers. Plain CUDA C++, no torch, no CUDA headers needed.
//
// Conventions for every kernel in this folder:
//   * raw pointers + sizes, `extern "C"` entry points (no name mangling);
//   * activations fp32; weights fp32 or bf16 (a runtime flag `*_bf16` says which);
//   * reductions in a fixed order: per-thread sequential sums, then an xor-butterfly across the
//     warp (every lane ends with the bit-identical value), then warp partials summed in warp
//     order. No float atomics anywhere, so every result is bit-reproducible run to run.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define SRT_DEV __device__ __forceinline__
#define SRT_FULL 0xffffffffu

// ---- 16-byte vectors (own types: no CUDA headers needed) ----------------------------------

struct __align__(16) u32x4 { u32 x, y, z, w; };
struct __align__(16) f32x4 { float x, y, z, w; };

// Streaming 16-byte load of read-only data (weights): read-only path, no L1 allocation.
SRT_DEV u32x4 ld_stream16(const void* p) {
  u32x4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

// ---- programmatic dependent launch (sm_90+; no-ops on older archs and in plain launches) ---
//
// A kernel launched with the programmatic-serialization attribute may start while the kernel
// before it in the stream still runs: until pdl_wait() returns (that kernel has finished and its
// writes are visible) it may only read what that kernel does not write (weights). A kernel lets
// the next one start early by pdl_launch_dependents(): once every one of its blocks has called it
// (or exited), the next kernel's blocks may take free SM slots. In a plain launch pdl_wait()
// returns at once.
SRT_DEV void pdl_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
SRT_DEV void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// First thing in a kernel that the host launches programmatically (every decode kernel): the
// next kernel may take free SM slots at once, and this one reads and writes nothing until the
// kernel before it is done (so any chain of such launches keeps stream order for data).
SRT_DEV void pdl_begin() {
  pdl_launch_dependents();
  pdl_wait();
}

// ---- conversions ---------------------------------------------------------------------------

SRT_DEV float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }
SRT_DEV float bf16lo(u32 w) { return __uint_as_float(w << 16); }
SRT_DEV float bf16hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }

// Element i of a weight vector that is fp32 (is_bf16 = 0) or bf16 (is_bf16 = 1).
SRT_DEV float ldw(const void* p, long long i, int is_bf16) {
  return is_bf16 ? bf16_to_f32(((const u16*)p)[i]) : ((const float*)p)[i];
}

// E4M3 (fn) byte -> fp32, exact. 0x7f / 0xff are NaN; exponent 0 is subnormal (m * 2^-9).
SRT_DEV float e4m3_to_f32(u32 b) {
  u32 mag = b & 0x7fu;
  float v;
  if (mag >= 8u) v = __uint_as_float((mag << 20) + (120u << 23));  // (1 + m/8) * 2^(e-7)
  else v = (float)mag * 0.001953125f;                            // m * 2^-9
  if (mag == 0x7fu) v = __uint_as_float(0x7fc00000u);
  return (b & 0x80u) ? -v : v;
}

// Two fp16 values packed in a u32 -> two floats (exact).
SRT_DEV void h2_to_f32(u32 h, float& lo, float& hi) {
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
      : "=f"(lo), "=f"(hi)
      : "r"(h));
}

// Eight E2M1 nibbles of one little-endian word (nibble e = element e; low nibble = even
// element) -> f[e] = e2m1(nibble e) * 2^-14, exactly. Decoded in registers by bit placement
// into fp16 (sign -> bit 15, exponent|mantissa -> bits 11..9), two elements per 32-bit word.
// Callers fold the 2^14 into the block scale (a power of two: exact).
SRT_DEV void e2m1x8(u32 q, float f[8]) {
  u32 t = q;
  h2_to_f32((t & 0x80008000u) | ((t >> 3) & 0x0e000e00u), f[3], f[7]);
  t = q << 4;
  h2_to_f32((t & 0x80008000u) | ((t >> 3) & 0x0e000e00u), f[2], f[6]);
  t = q << 8;
  h2_to_f32((t & 0x80008000u) | ((t >> 3) & 0x0e000e00u), f[1], f[5]);
  t = q << 12;
  h2_to_f32((t & 0x80008000u) | ((t >> 3) & 0x0e000e00u), f[0], f[4]);
}
#define SRT_E2M1_UNSCALE 16384.0f  // 2^14

// ---- fp16 helpers for the tensor-core path -------------------------------------------------

// Pack two floats as fp16x2 (round to nearest even): lo in bits 0..15.
SRT_DEV u32 f2h2(float lo, float hi) {
  u32 r;
  asm("{\n\t.reg .b16 l, h;\n\tcvt.rn.f16.f32 l, %1;\n\tcvt.rn.f16.f32 h, %2;\n\tmov.b32 %0, {l, h};\n\t}"
      : "=r"(r)
      : "f"(lo), "f"(hi));
  return r;
}

// D += A(16x16, row) * B(16x8, col), fp16 inputs, fp32 accumulators (sm_80+).
SRT_DEV void mma16816(float d[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ---- asynchronous copies and bf16 mma (sm_80+) -------------------------------------------

SRT_DEV u32 smem_addr(const void* p) {
  u32 a;
  asm("{\n\t.reg .u64 t;\n\tcvta.to.shared.u64 t, %1;\n\tcvt.u32.u64 %0, t;\n\t}" : "=r"(a) : "l"(p));
  return a;
}
// Copy `bytes` (0 or the full size: 0 zero-fills) from global to shared, asynchronously.
SRT_DEV void cp_async16(u32 dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
// The same, allocating in L1 (data that other warps of the SM read soon after).
SRT_DEV void cp_async16_ca(u32 dst, const void* src, int bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
SRT_DEV void cp_async8(u32 dst, const void* src, int bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
SRT_DEV void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
SRT_DEV void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// D += A(16x16, row) * B(16x8, col), bf16 inputs, fp32 accumulators (sm_80+).
SRT_DEV void mma16816_bf16(float d[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ---- math ----------------------------------------------------------------------------------

SRT_DEV float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

// SiTU-GLU of one element: beta*tanh(g/beta)*sigmoid(g) * (lbeta*tanh(u/lbeta) or u).
// beta_inf: SiLU gate (the beta -> inf limit).
SRT_DEV float situ(float g, float u, float beta, int beta_inf, float lbeta, int has_lin) {
  float ga = beta_inf ? g * sigmoidf_(g) : beta * tanhf(g / beta) * sigmoidf_(g);
  float ua = has_lin ? lbeta * tanhf(u / lbeta) : u;
  return ga * ua;
}

// ---- reductions (deterministic) ------------------------------------------------------------

SRT_DEV float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(SRT_FULL, v, o);
  return v;
}

SRT_DEV float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(SRT_FULL, v, o));
  return v;
}

// Sum over the block; every thread gets the same value. `red` holds >= 32 floats of shared
// memory. Safe to call repeatedly with the same `red`.
SRT_DEV float block_sum(float v, float* red) {
  const int nw = (blockDim.x + 31) >> 5, w = threadIdx.x >> 5, l = threadIdx.x & 31;
  v = warp_sum(v);
  __syncthreads();
  if (l == 0) red[w] = v;
  __syncthreads();
  float t = 0.0f;
  for (int i = 0; i < nw; ++i) t += red[i];
  return t;
}

SRT_DEV float block_max(float v, float* red) {
  const int nw = (blockDim.x + 31) >> 5, w = threadIdx.x >> 5, l = threadIdx.x & 31;
  v = warp_max(v);
  __syncthreads();
  if (l == 0) red[w] = v;
  __syncthreads();
  float t = red[0];
  for (int i = 1; i < nw; ++i) t = fmaxf(t, red[i]);
  return t;
}
