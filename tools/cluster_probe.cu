// northmk_cluster_probe: what thread-block clusters would give the megakernel's dependency chain.
//
// 1. Occupancy: how many clusters of 1, 2, 4 and 8 CTAs of the megakernel's shape (kThreads
//    threads, each batch size's dynamic shared memory) are resident at once (a persistent kernel
//    needs one CTA on every SM).
// 2. Round trips: one CTA hands a flag to another and waits for the answer, `--iters` times,
//    (a) through global memory (st.release.gpu / ld.acquire.gpu, the counters' path: a line in L2),
//    the pair in one cluster or in two, and (b) through the other CTA's shared memory in the same
//    cluster (st.release.cluster to its distributed shared memory, ld.acquire.cluster of its own);
//    each with the other CTAs idle and with them streaming a buffer several times the L2 from DRAM
//    (8 KB of loads in flight a warp, as the GEMVs' bursts): the load under which the chain's round
//    trips ran ~3-4 us in the megakernel (benchmarks/NOTES.md, session 45).
// Prints one line per measurement; `--stream-mb` sets the streamed buffer.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cuda_check.h"
#include "mk/common.cuh"

namespace {

using nmk::mk::global_ns;
using nmk::mk::load_acquire;
using nmk::mk::st_release;
constexpr int kThreads = nmk::mk::kThreads;

// Shared memory of a CTA of the cluster (shared::cluster addresses, from mapa).
__device__ __forceinline__ uint32_t ld_acquire_cluster(uint32_t addr) {
    uint32_t v;
    asm volatile("ld.acquire.cluster.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_cluster(uint32_t addr, uint32_t v) {
    asm volatile("st.release.cluster.shared::cluster.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t cluster_addr(const void *local, uint32_t rank) {
    uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(local)), r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    return r;
}
__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// Every thread of the cluster's CTAs (the non-aligned form: threads may arrive from divergent paths).
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}

struct Args {
    uint32_t *flags;        // [2] global ping and pong
    const uint4 *stream;    // the streamed buffer, or null: nothing streams
    size_t stream_vec;      // its uint4 count
    volatile uint32_t *stop;
    unsigned long long *sink;
    uint64_t *result;       // [0] ns of the iterations, [1] iterations done, [2] bytes the others streamed
    int iters;
    int via_cluster;        // 1: through the peer's shared memory (the pair: cluster 0's CTAs 0 and 1)
    int peer;               // the pair's second CTA (1, or the grid's last: another cluster)
};

// CTAs 0 and a.peer play ping-pong (thread 0 of each); every other CTA streams `stream` (if
// any) until the pair is done.
__global__ void __launch_bounds__(kThreads, 1) probe(Args a) {
    extern __shared__ __align__(16) uint32_t smem[];
    const bool pair = blockIdx.x == 0 || blockIdx.x == (unsigned)a.peer;
    if (threadIdx.x == 0) smem[0] = 0;
    cluster_sync();  // the flags are zero before anyone writes a peer's
    if (pair) {
        if (threadIdx.x == 0) {
            const uint32_t me = blockIdx.x == 0 ? 0 : 1;
            uint64_t t0 = global_ns();
            for (int i = 1; i <= a.iters; i++) {
                if (a.via_cluster) {
                    const uint32_t mine = cluster_addr(smem, cluster_rank()), peer = cluster_addr(smem, cluster_rank() ^ 1);
                    if (me == 0) {
                        st_release_cluster(peer, i);
                        while (ld_acquire_cluster(mine) != (uint32_t)i) {}
                    } else {
                        while (ld_acquire_cluster(mine) != (uint32_t)i) {}
                        st_release_cluster(peer, i);
                    }
                } else {
                    if (me == 0) {
                        st_release(a.flags, i);
                        while (load_acquire(a.flags + 1) != (uint32_t)i) {}
                    } else {
                        while (load_acquire(a.flags) != (uint32_t)i) {}
                        st_release(a.flags + 1, i);
                    }
                }
            }
            if (me == 0) {
                a.result[0] = global_ns() - t0, a.result[1] = a.iters;
                __threadfence();
                *a.stop = 1;
            }
        }
    } else if (a.stream) {
        // Eight 16-byte loads in flight a thread (8 KB a warp), over the CTA's stride of the buffer.
        unsigned long long acc = 0, passes = 0;
        const size_t per_pass = (size_t)gridDim.x * kThreads * 8;
        size_t i = (size_t)blockIdx.x * kThreads * 8 + threadIdx.x;
        while (!*a.stop) {
            const uint4 *base = a.stream + i % (a.stream_vec - 8 * kThreads);
            uint4 v[8];
#pragma unroll
            for (int j = 0; j < 8; j++)
                asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];"
                             : "=r"(v[j].x), "=r"(v[j].y), "=r"(v[j].z), "=r"(v[j].w)
                             : "l"(base + j * kThreads));
#pragma unroll
            for (int j = 0; j < 8; j++) acc += v[j].x ^ v[j].w;
            i += per_pass;
            passes++;
        }
        if (acc == 0x1234567) a.sink[0] = acc;  // keeps the loads
        atomicAdd(reinterpret_cast<unsigned long long *>(a.result + 2), passes * 8 * sizeof(uint4));
    }
    cluster_sync();  // no CTA leaves while a peer may still write its shared memory
}

cudaLaunchConfig_t config(int ctas, int cluster, size_t smem, cudaLaunchAttribute *attr) {
    cudaLaunchConfig_t c{};
    c.gridDim = dim3(ctas), c.blockDim = dim3(kThreads), c.dynamicSmemBytes = smem;
    attr->id = cudaLaunchAttributeClusterDimension;
    attr->val.clusterDim.x = cluster, attr->val.clusterDim.y = 1, attr->val.clusterDim.z = 1;
    c.attrs = attr, c.numAttrs = 1;
    return c;
}

}  // namespace

int main(int argc, char **argv) {
    int iters = 2000;
    size_t stream_mb = 2048;
    for (int i = 1; i < argc; i++) {
        if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) iters = std::atoi(argv[++i]);
        else if (!std::strcmp(argv[i], "--stream-mb") && i + 1 < argc) stream_mb = std::strtoull(argv[++i], nullptr, 10);
        else {
            std::fprintf(stderr, "usage: %s [--iters N] [--stream-mb MB]\n", argv[0]);
            return 2;
        }
    }
    if (iters < 1 || stream_mb < 1) {
        std::fprintf(stderr, "%s: --iters and --stream-mb must be positive\n", argv[0]);
        return 2;
    }
    cudaDeviceProp prop{};
    CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("%s: %d SMs, %d MB of L2\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
    CHECK(cudaFuncSetAttribute(probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));

    // 1. occupancy at each batch size's shared memory
    for (int batch : {1, 2}) {
        const size_t smem = nmk::mk::smem_bytes(batch);
        CHECK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        for (int cluster : {1, 2, 4, 8}) {
            cudaLaunchAttribute attr;
            cudaLaunchConfig_t c = config(cluster * 16, cluster, smem, &attr);
            int n = 0;
            CHECK(cudaOccupancyMaxActiveClusters(&n, (void *)probe, &c));
            std::printf("occupancy: batch %d's %zu KB of shared memory, clusters of %d: %d resident (%d CTAs of %d SMs)\n",
                        batch, smem >> 10, cluster, n, n * cluster, prop.multiProcessorCount);
        }
    }

    // 2. round trips, idle and under a DRAM stream
    const size_t smem = nmk::mk::smem_bytes(1);
    CHECK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int resident2 = 0;
    {
        cudaLaunchAttribute attr;
        cudaLaunchConfig_t c = config(2, 2, smem, &attr);
        CHECK(cudaOccupancyMaxActiveClusters(&resident2, (void *)probe, &c));
    }
    const size_t stream_vec = (stream_mb << 20) / sizeof(uint4);
    uint4 *stream = nullptr;
    uint32_t *flags = nullptr, *stop = nullptr;
    unsigned long long *sink = nullptr;
    uint64_t *result = nullptr;
    CHECK(cudaMalloc(&stream, stream_vec * sizeof(uint4)));
    CHECK(cudaMemset(stream, 1, stream_vec * sizeof(uint4)));
    CHECK(cudaMalloc(&flags, 2 * sizeof(uint32_t)));
    CHECK(cudaMalloc(&stop, sizeof(uint32_t)));
    CHECK(cudaMalloc(&sink, sizeof(unsigned long long)));
    CHECK(cudaMalloc(&result, 3 * sizeof(uint64_t)));
    // (a pair through L2 in one cluster, through L2 across clusters, through shared memory) x (idle, loaded)
    for (int form = 0; form < 3; form++) {
        for (int loaded : {0, 1}) {
            const int via_cluster = form == 2, ctas = 2 * resident2;  // every pair resident: one CTA an SM, bar a few
            const int peer = form == 1 ? ctas - 1 : 1;
            for (int rep = 0; rep < 2; rep++) {  // the first launch warms up
                CHECK(cudaMemset(flags, 0, 2 * sizeof(uint32_t)));
                CHECK(cudaMemset(stop, 0, sizeof(uint32_t)));
                CHECK(cudaMemset(result, 0, 3 * sizeof(uint64_t)));
                Args a{flags, loaded ? stream : nullptr, stream_vec, stop, sink, result, iters, via_cluster, peer};
                cudaLaunchAttribute attr;
                cudaLaunchConfig_t c = config(ctas, 2, smem, &attr);
                CHECK(cudaLaunchKernelEx(&c, probe, a));
                CHECK(cudaDeviceSynchronize());
            }
            uint64_t r[3];
            CHECK(cudaMemcpy(r, result, sizeof(r), cudaMemcpyDeviceToHost));
            static const char *kForm[] = {"L2 (the pair in one cluster)", "L2 (the pair in two clusters)",
                                          "the peer's shared memory (cluster of 2)"};
            // the others' bytes over the pair's time: their stream's rate (they start and stop about with it)
            std::printf("round trip through %s, %s: %.3f us (%llu round trips, %d CTAs; %.2f TB/s streamed)\n",
                        kForm[form], loaded ? "the other CTAs streaming from DRAM" : "the other CTAs idle",
                        r[0] / 1e3 / (double)r[1], (unsigned long long)r[1], ctas, r[2] / (double)r[0] / 1e3);
        }
    }
    CHECK(cudaFree(stream));
    CHECK(cudaFree(flags));
    CHECK(cudaFree(stop));
    CHECK(cudaFree(sink));
    CHECK(cudaFree(result));
    return 0;
}
