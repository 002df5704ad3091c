// Which tasks wait on their input's block counters (task semantics v0.6, include/northmk.h):
// the readers of a layer's input x_l, QKV, ROUTER and a dense layer's GATE_UP, and LM_HEAD of
// the last layer's output. The rule's one copy: the schedule's builder and checker
// (block_waiter), the kernel (vm.cuh) and, through nmk_schedule_wait_spans, the Python
// interpreter and replay tools read it here.
#pragma once

#include "northmk.h"

#if defined(__CUDACC__)
#define NMK_HOST_DEVICE __host__ __device__
#else
#define NMK_HOST_DEVICE
#endif

namespace nmk::schedule {

// dense(): whether the task's layer has the dense MLP, asked only of a GATE_UP task (an LM_HEAD
// task's layer is past the layer table).
template <class Dense>
NMK_HOST_DEVICE inline bool waits_on_blocks(int op, Dense dense) {
    return op == NMK_OP_QKV || op == NMK_OP_ROUTER || op == NMK_OP_LM_HEAD || (op == NMK_OP_GATE_UP && dense());
}

}  // namespace nmk::schedule
