// Device helpers shared by the tasks: loads, reductions, the bf16 row-dot of the GEMVs.
#pragma once

#include "config.cuh"

namespace nmk::mk {

// Weights stream through once per step: skip L1.
__device__ __forceinline__ uint4 load_weight(const bf16 *p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Step scratch and KV are written by other SMs during the step: read them from L2.
__device__ __forceinline__ float load_l2(const float *p) { return __ldcg(p); }
__device__ __forceinline__ uint4 load_l2(const uint4 *p) { return __ldcg(p); }
__device__ __forceinline__ int32_t load_l2(const int32_t *p) { return __ldcg(p); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

__device__ __forceinline__ void unpack8(uint4 v, float out[8]) {
    const __nv_bfloat162 *p = reinterpret_cast<const __nv_bfloat162 *>(&v);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 f = __bfloat1622float2(p[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

// Copies rows x K bf16 (K % 8 == 0) from global scratch (src_stride elements apart) into
// shared memory (K apart).
__device__ __forceinline__ void stage_bf16(bf16 *dst, const bf16 *src, int rows, int K, int src_stride) {
    int chunks = K / 8;
    for (int i = threadIdx.x; i < rows * chunks; i += kThreads) {
        int r = i / chunks, c = i % chunks;
        reinterpret_cast<uint4 *>(dst + r * K)[c] = load_l2(reinterpret_cast<const uint4 *>(src + r * src_stride) + c);
    }
}

// acc[r][b] = w[r][:] . in[b, :] for R weight rows, summed over the warp. in: shared, [B][K].
// Each lane keeps R x kLoadsInFlight 16-byte weight loads in flight before it computes:
// a GEMV task is bound by how many bytes one SM has outstanding.
constexpr int kLoadsInFlight = 4;

template <int B, int R>
__device__ __forceinline__ void rows_dot(const bf16 *const w[R], const bf16 *in, int K, float acc[R][B]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int b = 0; b < B; b++) acc[r][b] = 0.f;
    for (int k0 = lane * 8; k0 < K; k0 += 256 * kLoadsInFlight) {
        uint4 wv[R][kLoadsInFlight];
#pragma unroll
        for (int c = 0; c < kLoadsInFlight; c++)
#pragma unroll
            for (int r = 0; r < R; r++)
                wv[r][c] = k0 + c * 256 < K ? load_weight(w[r] + k0 + c * 256) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int c = 0; c < kLoadsInFlight; c++) {
            const int k = k0 + c * 256;
            if (k >= K) break;
#pragma unroll
            for (int b = 0; b < B; b++) {
                float v[8];
                unpack8(*reinterpret_cast<const uint4 *>(in + b * K + k), v);
#pragma unroll
                for (int r = 0; r < R; r++) {
                    float wf[8];
                    unpack8(wv[r][c], wf);
#pragma unroll
                    for (int i = 0; i < 8; i++) acc[r][b] = fmaf(wf[i], v[i], acc[r][b]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int b = 0; b < B; b++) acc[r][b] = warp_sum(acc[r][b]);
}

// out(r, acc[B]) for each row r in [0, n) of W (rows `stride` elements apart) dotted with
// in: shared [B][K]; each warp takes two rows at a time.
template <int B, class Out>
__device__ __forceinline__ void gemv_rows(const bf16 *W, size_t stride, int n, const bf16 *in, int K, Out out) {
    for (int r = 2 * (threadIdx.x >> 5); r < n; r += 2 * kWarps) {
        const int r2 = min(r + 1, n - 1);
        const bf16 *w[2] = {W + (size_t)r * stride, W + (size_t)r2 * stride};
        float acc[2][B];
        rows_dot<B, 2>(w, in, K, acc);
        out(r, acc[0]);
        if (r2 != r) out(r2, acc[1]);
    }
}

__device__ __forceinline__ float block_sum(float v, float *scratch) {
    v = warp_sum(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; w++) total += scratch[w];
    return total;
}

// Physical page of row b's position pos in a KV group.
__device__ __forceinline__ int kv_page(const Params &p, int group, int b, int pos) {
    int page = load_l2(p.tables[group] + (size_t)b * p.table_cols + pos / kPage);
    if (page < 0) __trap();  // the host guarantees a page for every position it sends
    return page;
}


}  // namespace nmk::mk
