// The megakernel of one batch size, NMK_MK_BATCH: the build compiles this once per size from
// a generated two-line .cu file (CMakeLists.txt), and kernels.hpp names the results.
#pragma once

#include "mk/kernels.hpp"
#include "mk/vm.cuh"

#ifndef NMK_MK_BATCH
#error "define NMK_MK_BATCH (1..8) before including kernel_batch.cuh"
#endif

#define NMK_MK_ENTRY_(b) megakernel_b##b
#define NMK_MK_ENTRY(b) NMK_MK_ENTRY_(b)

namespace nmk::mk {

const void *NMK_MK_ENTRY(NMK_MK_BATCH)() { return reinterpret_cast<const void *>(&megakernel<NMK_MK_BATCH>); }

}  // namespace nmk::mk
