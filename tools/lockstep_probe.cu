// northmk_lockstep_probe: does a GEMV phase whose CTAs start together stream slower than one
// whose CTAs start apart?
//
// In the megakernel's profiles, layer 0's o-proj (128 tiles started within 0.2 us) ran 7.3 us a
// tile and layer 1's QKV (107 tiles started together) 10.3 us, against ~4.2 and ~7.1 us in the
// later layers, whose tiles start over a few microseconds (benchmarks/NOTES.md, session 48).
// This probe streams one tile a CTA in the GEMV's pattern (the tiled layout: 8 warps, each its
// own contiguous piece of the tile, bursts of 8 k steps = 8 KB a warp in flight, streaming
// loads), every CTA released at one globaltimer instant or at staggered ones, and prints the
// phase's span (first start to last end) and bandwidth for:
//   lock      tiles at a power-of-two stride (o-proj: 128 KB; QKV: 192 KB in 3 bands of 64 KB)
//   pad       the same tiles at a stride 1 KB longer (DRAM addresses decorrelated across CTAs)
//   rotate    each CTA's warps take their bursts starting at a CTA-dependent burst
//   stagger   CTA i released (i % 8) * --stagger-ns later
//   hotin     lock, and every CTA also reads the same 64 KB "input" (o-proj's input image)
//   inter     lock, the warps' bursts side by side: each round of bursts reads 64 KB of the tile
//             contiguously (one stream a CTA, not eight)
//   contig    lock, each warp's bursts one contiguous piece of the tile (eight streams a CTA)
// (QKV's tiles read as inter already: a warp's piece of each band is one burst.)
// Every region is read once: each repetition takes a fresh part of a buffer many times the L2.
//   northmk_lockstep_probe [--ctas N] [--reps R] [--stagger-ns NS]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda_check.h"
#include "mk/common.cuh"

namespace {

using nmk::mk::global_ns;
using nmk::mk::load_weight;
constexpr int kThreads = nmk::mk::kThreads, kWarps = kThreads / 32;
constexpr int kBurst = 8;                // k steps a burst (kStepsInFlight)
constexpr size_t kBurstBytes = 8192;     // a warp's burst: 8 steps x (lo + hi) x 512 B

struct Shape {
    const char *name;
    size_t bands, band_bytes;  // a tile: `bands` bands; warp w reads piece w of every band
};

struct Args {
    const char *base;      // this repetition's region
    size_t tile_stride;    // bytes from one CTA's tile to the next
    Shape shape;
    int rotate;            // warps start at burst (cta + warp) % bursts
    int order;             // 0: the shape's pieces; 1: inter; 2: contig
    uint64_t *release;     // [0]: the instant CTAs go (CTA 0 sets it)
    uint32_t stagger_ns;   // CTA i goes (i % 8) * stagger_ns after it
    const char *hot;       // every CTA also reads these 64 KB first, or null
    uint64_t *times;       // [ctas][2]: start, end
    uint32_t *sink;
};

__global__ void __launch_bounds__(kThreads, 1) probe(Args a) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) {
        if (blockIdx.x == 0) atomicExch(reinterpret_cast<unsigned long long *>(a.release), global_ns() + 20000);
        uint64_t go;
        while ((go = *reinterpret_cast<volatile uint64_t *>(a.release)) == 0) {
        }
        go += (uint64_t)(blockIdx.x % 8) * a.stagger_ns;
        while (global_ns() < go) {
        }
    }
    __syncthreads();
    const uint64_t t0 = global_ns();
    uint32_t x = 0;
    if (a.hot) {  // 64 KB: 16 B a thread per step, 16 steps, loads first
        uint4 v[16];
#pragma unroll
        for (int i = 0; i < 16; i++) v[i] = __ldcg(reinterpret_cast<const uint4 *>(a.hot) + i * kThreads + threadIdx.x);
#pragma unroll
        for (int i = 0; i < 16; i++) x ^= v[i].x ^ v[i].w;
    }
    const char *tile = a.base + blockIdx.x * a.tile_stride;
    const size_t piece = a.shape.band_bytes / kWarps;  // a warp's piece of a band
    const int per_band = (int)(piece / kBurstBytes), bursts = (int)a.shape.bands * per_band;
    const int first = a.rotate ? (blockIdx.x + warp) % bursts : 0;
#pragma unroll 1
    for (int j = 0; j < bursts; j++) {
        const int b = (first + j) % bursts;
        const char *p = a.order == 1   ? tile + (b * kWarps + warp) * kBurstBytes
                        : a.order == 2 ? tile + (warp * bursts + b) * kBurstBytes
                                       : tile + (b / per_band) * a.shape.band_bytes + warp * piece + (b % per_band) * kBurstBytes;
        const nmk::mk::bf16 *lo = reinterpret_cast<const nmk::mk::bf16 *>(p) + 8 * lane;
        uint4 wl[kBurst], wh[kBurst];
#pragma unroll
        for (int i = 0; i < kBurst; i++) {
            wl[i] = load_weight<true>(lo + 512 * i);
            wh[i] = load_weight<true>(lo + 512 * i + 256);
        }
#pragma unroll
        for (int i = 0; i < kBurst; i++) x ^= wl[i].x ^ wh[i].y;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        a.times[2 * blockIdx.x] = t0, a.times[2 * blockIdx.x + 1] = global_ns();
        if (x == 0x9e3779b9u) *a.sink = x;  // keeps the loads
    }
}

}  // namespace

int main(int argc, char **argv) {
    int ctas = 128, reps = 20;
    uint32_t stagger_ns = 500;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--ctas") && i + 1 < argc) ctas = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--stagger-ns") && i + 1 < argc) stagger_ns = (uint32_t)atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--ctas N] [--reps R] [--stagger-ns NS]\n", argv[0]);
            return 2;
        }
    }
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    if (ctas < 1 || ctas > prop.multiProcessorCount || reps < 1) {
        fprintf(stderr, "--ctas must be 1..%d and --reps >= 1\n", prop.multiProcessorCount);
        return 2;
    }
    const size_t buf_bytes = (size_t)8 << 30;
    char *buf, *hot;
    uint64_t *release, *times;
    uint32_t *sink;
    CHECK(cudaMalloc(&buf, buf_bytes));
    CHECK(cudaMemset(buf, 1, buf_bytes));
    CHECK(cudaMalloc(&hot, 65536));
    CHECK(cudaMemset(hot, 2, 65536));
    CHECK(cudaMalloc(&release, sizeof(uint64_t)));
    CHECK(cudaMalloc(&times, 2 * sizeof(uint64_t) * ctas));
    CHECK(cudaMalloc(&sink, sizeof(uint32_t)));
    const Shape shapes[] = {{"oproj", 1, 131072}, {"qkv", 3, 65536}};
    struct Mode {
        const char *name;
        size_t pad;
        int rotate, stagger, hot, order;
    } modes[] = {{"lock", 0, 0, 0, 0, 0},    {"pad", 1024, 0, 0, 0, 0}, {"rotate", 0, 1, 0, 0, 0},
                 {"stagger", 0, 0, 1, 0, 0}, {"hotin", 0, 0, 0, 1, 0}, {"inter", 0, 0, 0, 0, 1},
                 {"contig", 0, 0, 0, 0, 2}};
    printf("%s: %d SMs, %d CTAs, %d repetitions each, stagger %u ns\n", prop.name, prop.multiProcessorCount, ctas, reps,
           stagger_ns);
    size_t cursor = 0;
    std::vector<uint64_t> h(2 * ctas);
    for (const Shape &s : shapes) {
        const size_t tile = s.bands * s.band_bytes;
        for (int round = 0; round < 2; round++) {  // every mode twice, interleaved
            for (const Mode &m : modes) {
                std::vector<double> span, sum;
                for (int r = 0; r < reps; r++) {
                    const size_t stride = tile + m.pad, need = stride * ctas;
                    if (cursor + need > buf_bytes) cursor = 0;
                    Args a{buf + cursor, stride, s, m.rotate, m.order, release, m.stagger ? stagger_ns : 0u,
                           m.hot ? hot : nullptr, times, sink};
                    cursor += (need + 4095) / 4096 * 4096;
                    CHECK(cudaMemset(release, 0, sizeof(uint64_t)));
                    probe<<<ctas, kThreads>>>(a);
                    CHECK(cudaGetLastError());
                    CHECK(cudaDeviceSynchronize());
                    CHECK(cudaMemcpy(h.data(), times, h.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
                    uint64_t lo = UINT64_MAX, hi = 0;
                    double tot = 0;
                    for (int c = 0; c < ctas; c++) {
                        lo = std::min(lo, h[2 * c]), hi = std::max(hi, h[2 * c + 1]);
                        tot += (double)(h[2 * c + 1] - h[2 * c]);
                    }
                    span.push_back((double)(hi - lo) / 1e3);
                    sum.push_back(tot / ctas / 1e3);
                }
                std::sort(span.begin(), span.end());
                std::sort(sum.begin(), sum.end());
                const double med = span[reps / 2], bytes = (double)tile * ctas;
                printf("%-6s %-8s round %d: span %6.2f us (p10 %6.2f, p90 %6.2f), a CTA's run %6.2f us, %6.0f GB/s, %5.1f GB/s a CTA\n",
                       s.name, m.name, round, med, span[reps / 10], span[reps * 9 / 10], sum[reps / 2],
                       bytes / med / 1e3, (double)tile / sum[reps / 2] / 1e3);
            }
        }
    }
    return 0;
}
