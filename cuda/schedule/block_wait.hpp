// Which tasks wait on their input's block counters (task semantics v0.6, include/northmk.h):
// the readers of a layer's input x_l, QKV, ROUTER and a dense layer's GATE_UP, and LM_HEAD of
// the last layer's output; and which of the tasks that wait do it inside their run, not before
// it. The rules' one copy: the schedule's builder and checker (block_waiter), the kernel
// (vm.cuh) and, through nmk_schedule_wait_spans and nmk_schedule_waits_in_run, the Python
// interpreter and replay tools read them here.
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

// Whether a task of a step of `batch` rows that waits (`waits`: it has a counter) waits for it
// inside its run: up to NMK_MK_POST_SCALED_MAX_BATCH rows the QKV and ROUTER tiles, each chunk of
// their input once its block's counter is complete (the kernel's gemv_normed); a sparse layer's
// GATE_UP, which polls the routing's slot table itself (op_mlp's slot_expert_of); an attention
// split, which loads its page numbers before it waits for QKV (op_attention's run_attention).
// Their start stamp comes before the wait. dense() as for waits_on_blocks.
template <class Dense>
NMK_HOST_DEVICE inline bool waits_in_run(int op, int batch, bool waits, Dense dense) {
    if (!waits) return false;
    if (op == NMK_OP_GATE_UP) return !dense();
    if (op == NMK_OP_ATTN) return true;
    return batch <= NMK_MK_POST_SCALED_MAX_BATCH && (op == NMK_OP_QKV || op == NMK_OP_ROUTER);
}

}  // namespace nmk::schedule
