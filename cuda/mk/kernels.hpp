// Host-side handles of the megakernel, one per batch size. Each is compiled in its own
// translation unit (kernel_batch.cuh, from files the build writes), so the eight compile in
// parallel and each gets its own register allocation.
#pragma once

namespace nmk::mk {

const void *megakernel_b1();
const void *megakernel_b2();
const void *megakernel_b3();
const void *megakernel_b4();
const void *megakernel_b5();
const void *megakernel_b6();
const void *megakernel_b7();
const void *megakernel_b8();

// The kernel for `batch` rows (1..8), for cudaLaunchKernel and cudaFuncSetAttribute.
inline const void *megakernel_for(int batch) {
    static const void *(*const entries[])() = {megakernel_b1, megakernel_b2, megakernel_b3, megakernel_b4,
                                               megakernel_b5, megakernel_b6, megakernel_b7, megakernel_b8};
    return entries[batch - 1]();
}

}  // namespace nmk::mk
