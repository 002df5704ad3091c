// What compute-sanitizer racecheck makes of the bulk-copy ring's handshakes, on the smallest
// kernel that has them (the megakernel's attention ring uses the same helpers, common.cuh):
// a bulk copy lands in shared memory and completes a barrier every thread waits on; every
// thread releases the slot on a second barrier; thread 0 waits on that, fences, and refills
// the slot. Two rounds; the sums prove both copies landed. Built and run by tools/gpu_run.sh
// (SANITIZE=1), where a hazard reported here belongs to the tool's model, not the kernel:
//   cmake --build BUILD --target northmk_racecheck_probe
//   compute-sanitizer --tool racecheck BUILD/northmk_racecheck_probe
#include <cstdio>

#include "mk/common.cuh"

using namespace nmk::mk;

constexpr int kBytes = 16 * 1024, kWords = kBytes / 4;

__global__ void probe(const uint32_t *src, uint32_t *sums) {
    __shared__ alignas(128) uint32_t slot[kWords];
    __shared__ uint64_t full, empty;
    if (threadIdx.x == 0) {
        mbar_init(&full, 1), mbar_init(&empty, blockDim.x);
        mbar_init_fence();
        mbar_arrive_expect(&full, kBytes);
        bulk_load(slot, src, kBytes, &full);
    }
    __syncthreads();
    for (int round = 0; round < 2; round++) {
        mbar_wait(&full, round & 1);
        uint32_t sum = 0;
        for (int i = threadIdx.x; i < kWords; i += blockDim.x) sum += slot[i];
        atomicAdd(&sums[round], sum);
        mbar_arrive(&empty);  // this thread's reads of the slot are done
        if (threadIdx.x == 0 && round == 0) {
            mbar_wait(&empty, 0);
            fence_proxy_async_shared();
            mbar_arrive_expect(&full, kBytes);
            bulk_load(slot, src + kWords, kBytes, &full);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) mbar_inval(&full), mbar_inval(&empty);
}

int main() {
    uint32_t host[2 * kWords], *src = nullptr, *sums = nullptr, got[2] = {};
    uint32_t want[2] = {};
    for (int i = 0; i < 2 * kWords; i++) host[i] = i * 2654435761u >> 7, want[i / kWords] += host[i];
    cudaMalloc(&src, sizeof host), cudaMalloc(&sums, sizeof got);
    cudaMemcpy(src, host, sizeof host, cudaMemcpyHostToDevice), cudaMemset(sums, 0, sizeof got);
    probe<<<1, kThreads>>>(src, sums);
    cudaError_t e = cudaMemcpy(got, sums, sizeof got, cudaMemcpyDeviceToHost);
    const bool ok = e == cudaSuccess && got[0] == want[0] && got[1] == want[1];
    std::printf("racecheck probe: %s (sums %u %u, want %u %u)\n", ok ? "copies landed" : "FAILED", got[0], got[1],
                want[0], want[1]);
    return ok ? 0 : 1;
}
