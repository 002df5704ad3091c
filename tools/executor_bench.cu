// northmk_executor_bench: does a second executor per SM hide a task's fixed parts?
//
// The megakernel runs one executor per SM, a CTA of 8 warps: a task stages its input, streams its
// weights through the tensor cores, writes its outputs and signals, and the SM streams nothing
// while it stages, writes, signals or waits (benchmarks/NOTES.md, session 22: 12-24% of a GEMV
// task is such fixed parts, and the SMs wait 13% of a batch-1 step). This bench runs one task mix
// both ways: one executor of 8 warps per SM, and two executors of 4 warps each (one warpgroup,
// its own named barrier and half of the shared memory) that take alternate tasks of the SM's
// list, so that one can stream while the other is in its fixed parts. Each task:
//   wait    thread 0 spins for --spin-ns (a dependency wait's stand-in), then the executor's barrier
//   stage   the B x K input from global memory (L2) into shared memory, in common.cuh's layout
//   gemv    (16-row tile, k part) items over the executor's warps (common.cuh's k_parts), each in
//           bursts of kSteps k32 steps of register loads (load_weight, the engine's load) and
//           mma.sync; the parts summed through shared memory
//   write   the tile's outputs to global memory
//   signal  the executor's barrier, then thread 0's release add on a counter
// The tasks are a batch-1 layer's GEMVs in their proportions (107 QKV tiles of 48 x 2048, 192
// gate/up tiles of 64 x 2048, 128 down tiles of 128 x 768, 128 o-proj tiles of 32 x 2048, the
// o-proj's 16 x 4096 split in K as a half-size executor would take it), `--layers` of them dealt
// round-robin to the SMs, each task's weights its own (>= 2 GiB in all: L2 holds none of them).
// The shared memory of every variant is the megakernel's 130 KB, so that L1 is the same size.
// One line per (batch, variant, spin): time, TB/s of weights, and the ratio to one executor at
// the same batch and spin. A sample of the tasks' outputs is checked against a CPU reference;
// exit code 1 on a mismatch.
//   northmk_executor_bench [--spin-ns N]... [--layers L]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_check.h"
#include "mk/common.cuh"

using namespace nmk::mk;

namespace {

constexpr int kXStride = 2048;  // the input: [8][kXStride] bf16, the widest K of the mix
constexpr int kExecSmem = in_bytes(kXStride) + kMaxGemvItems * 128 * (int)sizeof(float);
constexpr int kSmem = kSmemBytes;  // the batch-1 megakernel's, whose GEMV mix this bench runs
static_assert(2 * kExecSmem <= kSmem, "two executors' scratch fits");

struct Task {
    uint64_t w;     // element offset of the tile's weights in the pool (tiled layout, rows x K)
    int rows, K;    // rows: a multiple of 16; K: a multiple of 32, at most kXStride
    uint64_t out;   // float offset of its outputs, [rows][8]
};

struct Args {
    const Task *tasks;
    int ntasks, batch;
    const bf16 *pool, *x;
    float *out;
    uint32_t *counters;  // one per CTA
    long long spin_cycles;
};

__device__ __forceinline__ void exec_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// kExecs executors of 256 / kExecs threads per CTA; executor e takes the CTA's tasks e, e + kExecs, ...
template <int kExecs, int kSteps>
__global__ void __launch_bounds__(kThreads, 1) exec_kernel(const __grid_constant__ Args a) {
    constexpr int kExecThreads = kThreads / kExecs, kExecWarps = kExecThreads / 32;
    extern __shared__ __align__(1024) char smem[];
    const int e = threadIdx.x / kExecThreads, tid = threadIdx.x % kExecThreads, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3, bar = 1 + e;
    bf16 *in = reinterpret_cast<bf16 *>(smem + e * kExecSmem);
    float *red = reinterpret_cast<float *>(smem + e * kExecSmem + in_bytes(kXStride));
    const uint32_t lane_addr = in_lane_addr(smem_u32(in));
#pragma unroll 1
    for (int j = e;; j += kExecs) {
        const int i = blockIdx.x + j * gridDim.x;
        if (i >= a.ntasks) break;
        const Task t = a.tasks[i];
        if (a.spin_cycles && tid == 0) {
            const long long t0 = clock64();
            while (clock64() - t0 < a.spin_cycles) {
            }
        }
        exec_barrier(bar, kExecThreads);  // also: every thread is done with the last task's scratch
        const int chunks = t.K / 8;
#pragma unroll 1
        for (int c = tid; c < a.batch * chunks; c += kExecThreads) {
            const int n = c / chunks, cc = c - n * chunks;
            store_in_chunk(in, n, cc, load_l2(reinterpret_cast<const uint4 *>(a.x + n * kXStride) + cc));
        }
        exec_barrier(bar, kExecThreads);
        const int tiles = t.rows / 16, steps = t.K / 32;
        const int ks = k_parts(tiles, 1, kExecWarps, steps);
#pragma unroll 1
        for (int u = warp; u < tiles * ks; u += kExecWarps) {
            const int tile = u / ks, part = u % ks;
            const int ka = steps * part / ks * 32, kb = steps * (part + 1) / ks * 32;
            const bf16 *lo = a.pool + t.w + (size_t)tile * 16 * t.K + 8 * lane, *hi = lo + 256;
            float acc[2][4] = {};
            int k = ka;
#pragma unroll 1
            for (; k + 32 * kSteps <= kb; k += 32 * kSteps) {
                uint4 wl[kSteps], wh[kSteps];
#pragma unroll
                for (int s = 0; s < kSteps; s++) {
                    wl[s] = load_weight<true>(lo + 16 * (k + 32 * s));
                    wh[s] = load_weight<true>(hi + 16 * (k + 32 * s));
                }
#pragma unroll
                for (int s = 0; s < kSteps; s++) mma_k32(acc[s % 2], wl[s], wh[s], load_in_k32(lane_addr, k + 32 * s));
            }
#pragma unroll 1
            for (; k < kb; k += 32) {
                const uint4 l = load_weight<true>(lo + 16 * k), h = load_weight<true>(hi + 16 * k);
                mma_k32(acc[0], l, h, load_in_k32(lane_addr, k));
            }
            float *dst = red + u * 128;
            *reinterpret_cast<float2 *>(dst + g * 8 + 2 * t4) = make_float2(acc[0][0] + acc[1][0], acc[0][1] + acc[1][1]);
            *reinterpret_cast<float2 *>(dst + (g + 8) * 8 + 2 * t4) =
                make_float2(acc[0][2] + acc[1][2], acc[0][3] + acc[1][3]);
        }
        exec_barrier(bar, kExecThreads);
#pragma unroll 1
        for (int o = tid; o < tiles * 128; o += kExecThreads) {
            const float *src = red + o / 128 * ks * 128 + o % 128;
            float s = 0.f;
            for (int part = 0; part < ks; part++) s += src[part * 128];
            a.out[t.out + o] = s;
        }
        exec_barrier(bar, kExecThreads);
        if (tid == 0) red_release(a.counters + blockIdx.x, 1u);
    }
}

__global__ void fill_random(bf16 *p, size_t n, uint32_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ static_cast<uint32_t>(i >> 32) * 0x85EBCA77u ^ seed;
        h ^= h >> 15, h *= 0x2C1B3C6Du, h ^= h >> 12, h *= 0x297A2D39u, h ^= h >> 15;
        p[i] = __float2bfloat16((static_cast<float>(h & 0xffff) / 32768.f - 1.f) * 0.05f);
    }
}

float bf16_to_float(bf16 v) {
    uint16_t bits;
    std::memcpy(&bits, &v, 2);
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

size_t tiled_at(int r, int c, int K) { return (size_t)(r & ~15) * K + (c >> 5) * 512 + (r & 15) * 32 + (c & 31); }

struct Variant {
    const char *name;
    const void *kernel;
    int execs;
};

}  // namespace

int main(int argc, char **argv) {
    std::vector<long long> spins_ns;
    int layers = 24;
    for (int i = 1; i < argc; i++) {
        std::string s = argv[i];
        if (s == "--spin-ns" && i + 1 < argc) spins_ns.push_back(std::atoll(argv[++i]));
        else if (s == "--layers" && i + 1 < argc) layers = std::atoi(argv[++i]);
        else {
            std::fprintf(stderr, "usage: %s [--spin-ns N]... [--layers L]\n", argv[0]);
            return 2;
        }
    }
    if (spins_ns.empty()) spins_ns = {0, 1000, 2000};
    if (layers < 1 || *std::min_element(spins_ns.begin(), spins_ns.end()) < 0) {
        std::fprintf(stderr, "--layers must be positive and --spin-ns at least 0\n");
        return 2;
    }
    int dev = 0, sms = 0, clock_khz = 0;
    CHECK(cudaGetDevice(&dev));
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
    cudaDeviceProp prop{};
    CHECK(cudaGetDeviceProperties(&prop, dev));

    // The layer's mix, dealt round-robin: task i runs on SM i % sms.
    struct Shape {
        int count, rows, K;
    };
    const Shape mix[] = {{107, 48, 2048}, {192, 64, 2048}, {128, 128, 768}, {128, 32, 2048}};
    std::vector<Task> tasks;
    uint64_t w = 0, out = 0, bytes = 0;
    for (int l = 0; l < layers; l++)
        for (const Shape &s : mix)
            for (int c = 0; c < s.count; c++) {
                tasks.push_back({w, s.rows, s.K, out});
                w += (uint64_t)s.rows * s.K, out += (uint64_t)s.rows * 8, bytes += (uint64_t)s.rows * s.K * 2;
            }
    const size_t pool_elems = w, out_elems = out;
    std::printf("device %s, %d SMs; %zu tasks, %.2f GB of weights a launch (each task its own)\n", prop.name, sms,
                tasks.size(), bytes / 1e9);

    bf16 *pool = nullptr, *x = nullptr;
    float *dout = nullptr;
    Task *dtasks = nullptr;
    uint32_t *counters = nullptr;
    CHECK(cudaMalloc(&pool, pool_elems * sizeof(bf16)));
    CHECK(cudaMalloc(&x, 8 * kXStride * sizeof(bf16)));
    CHECK(cudaMalloc(&dout, out_elems * sizeof(float)));
    CHECK(cudaMalloc(&dtasks, tasks.size() * sizeof(Task)));
    CHECK(cudaMalloc(&counters, sms * sizeof(uint32_t)));
    fill_random<<<4 * sms, 256>>>(pool, pool_elems, 1u);
    fill_random<<<4, 256>>>(x, 8 * kXStride, 2u);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(dtasks, tasks.data(), tasks.size() * sizeof(Task), cudaMemcpyHostToDevice));
    std::vector<bf16> hx(8 * kXStride);
    CHECK(cudaMemcpy(hx.data(), x, hx.size() * sizeof(bf16), cudaMemcpyDeviceToHost));

    const Variant variants[] = {
        {"1 x 8 warps, 8 steps", reinterpret_cast<const void *>(exec_kernel<1, 8>), 1},
        {"2 x 4 warps, 8 steps", reinterpret_cast<const void *>(exec_kernel<2, 8>), 2},
        {"2 x 4 warps, 16 steps", reinterpret_cast<const void *>(exec_kernel<2, 16>), 2},
    };
    for (const Variant &v : variants) {
        CHECK(cudaFuncSetAttribute(v.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
        cudaFuncAttributes fa{};
        CHECK(cudaFuncGetAttributes(&fa, v.kernel));
        std::printf("%-22s %d registers, %zu bytes of local memory\n", v.name, fa.numRegs, fa.localSizeBytes);
    }
    cudaEvent_t t0, t1;
    CHECK(cudaEventCreate(&t0));
    CHECK(cudaEventCreate(&t1));
    bool ok = true;
    std::printf("%5s %-22s %7s %9s %7s %8s\n", "batch", "variant", "spin_ns", "us", "TB/s", "vs 1x8");
    for (int batch : {1, 8}) {
        for (long long spin : spins_ns) {
            double base_us = 0;
            for (const Variant &v : variants) {
                Args a{dtasks, static_cast<int>(tasks.size()), batch, pool, x, dout, counters,
                       spin * clock_khz / 1000000};
                void *params[] = {&a};
                std::vector<float> times;
                for (int rep = 0; rep < 6; rep++) {
                    CHECK(cudaMemset(dout, 0, out_elems * sizeof(float)));
                    CHECK(cudaMemset(counters, 0, sms * sizeof(uint32_t)));
                    CHECK(cudaEventRecord(t0));
                    CHECK(cudaLaunchKernel(v.kernel, dim3(sms), dim3(kThreads), params, kSmem, nullptr));
                    CHECK(cudaEventRecord(t1));
                    CHECK(cudaEventSynchronize(t1));
                    float ms = 0;
                    CHECK(cudaEventElapsedTime(&ms, t0, t1));
                    if (rep) times.push_back(ms * 1000.f);  // the first is the warm-up
                }
                std::sort(times.begin(), times.end());
                const double us = times[times.size() / 2];
                if (v.execs == 1 && !base_us) base_us = us;
                std::printf("%5d %-22s %7lld %9.1f %7.2f %8.3f\n", batch, v.name, spin, us, bytes / us / 1e6,
                            base_us / us);
                // every task signalled once; a sample of outputs against the CPU
                std::vector<uint32_t> hc(sms);
                CHECK(cudaMemcpy(hc.data(), counters, sms * sizeof(uint32_t), cudaMemcpyDeviceToHost));
                for (int s = 0; s < sms; s++) {
                    const uint32_t want = static_cast<uint32_t>((tasks.size() - s + sms - 1) / sms);
                    if (hc[s] != want) {
                        std::printf("MISMATCH: SM %d signalled %u times, expected %u\n", s, hc[s], want);
                        ok = false;
                    }
                }
                for (size_t ti : {size_t(0), size_t(150), size_t(400), size_t(500), tasks.size() - 1}) {
                    const Task &tk = tasks[ti];
                    std::vector<bf16> hw((size_t)tk.rows * tk.K);
                    std::vector<float> ho((size_t)tk.rows * 8);
                    CHECK(cudaMemcpy(hw.data(), pool + tk.w, hw.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
                    CHECK(cudaMemcpy(ho.data(), dout + tk.out, ho.size() * sizeof(float), cudaMemcpyDeviceToHost));
                    for (int r = 0; r < tk.rows; r++)
                        for (int n = 0; n < batch; n++) {
                            double ref = 0, mag = 0;
                            for (int c = 0; c < tk.K; c++) {
                                const double p = (double)bf16_to_float(hw[tiled_at(r, c, tk.K)]) *
                                                 bf16_to_float(hx[(size_t)n * kXStride + c]);
                                ref += p, mag += std::fabs(p);
                            }
                            if (std::fabs(ho[(size_t)r * 8 + n] - ref) > 1e-3 * mag + 1e-6) {
                                if (ok)
                                    std::printf("MISMATCH: task %zu row %d batch row %d: %g against %g\n", ti, r, n,
                                                ho[(size_t)r * 8 + n], ref);
                                ok = false;
                            }
                        }
                }
            }
        }
    }
    std::printf(ok ? "all outputs checked\n" : "FAILED\n");
    return ok ? 0 : 1;
}
