// Megakernel configuration and the device-side view of one step (Params).
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "northmk.h"
#include "tensor_map.hpp"

namespace nmk::mk {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kHeadDim = 128;        // attention kernels hold head_dim / 32 values per lane
constexpr int kMaxGroup = 8;         // query heads per kv head
constexpr int kMaxTopK = 8;
constexpr int kPage = 64;           // tokens per KV page (config.PAGE_SIZE)
constexpr int kMaxK = 4096;         // widest GEMV input (q width, intermediate sizes)
constexpr int kMaxLayers = 128;     // the layer table travels in the kernel's parameters (Params::layers)
// Attention's KV pages in flight per SM (op_attention.cuh), by the kernel's batch size: 4 from
// batch 2 on, where attention's splits are longer (batch 8 +0.9% in session 30, batch 2 +0.3%
// in session 31); 3 at batch 1, where the larger shared memory's smaller L1 costs the GEMVs more
// than attention gains (-0.7% in session 31, -1.0% in session 51; benchmarks/NOTES.md).
__host__ __device__ constexpr int attn_slots(int batch) { return batch >= 2 ? 4 : 3; }
// A task's shared-memory scratch (common.cuh): the widest GEMV's, or attention's ring and state.
__host__ __device__ constexpr int task_smem_bytes(int batch) { return attn_slots(batch) > 3 ? 136 * 1024 : 123 * 1024; }
// The kernel's dynamic shared memory: a task's scratch, then what a CTA keeps (Kept, Routing).
__host__ __device__ constexpr int smem_bytes(int batch) { return task_smem_bytes(batch) + 7 * 1024; }
// The batch size of the kernel a translation unit compiles (kernel_batch.cuh); 1 for the
// tools' benches, which run the batch-1 layout.
#ifdef NMK_MK_BATCH
constexpr int kBuildBatch = NMK_MK_BATCH;
#else
constexpr int kBuildBatch = 1;
#endif
constexpr int kSmemBytes = smem_bytes(kBuildBatch);
static_assert(kHeadDim == 128 && kThreads == 256, "the attention and GEMV tiles assume these");
// A GEMV input's 32-wide k blocks in shared memory (common.cuh, store_in_chunk), kInBlockBytes apart.
constexpr int kInBlockBytes = 4 * 128 + 16;
__host__ __device__ constexpr int in_bytes(int K) { return K / 32 * kInBlockBytes; }
// Words of a slot table: the expert slots of the largest batch (a launch of any batch zeroes the
// whole spare table, so that it is clear for a launch of any other).
__host__ __device__ constexpr int slot_table_words(int top_k, int num_experts) {
    return NMK_MK_MAX_BATCH * top_k < num_experts ? NMK_MK_MAX_BATCH * top_k : num_experts;
}
// Words of a launch's routing table: the slot words, then the largest batch's router words.
__host__ __device__ constexpr int route_table_words(int top_k, int num_experts) {
    return slot_table_words(top_k, num_experts) + NMK_MK_MAX_BATCH * num_experts;
}
static_assert(NMK_MK_MAX_BATCH == 8, "GEMV inputs are the n = 8 columns of m16n8k16 tensor-core tiles");

// Loops that run once per task or once per weight burst carry `#pragma unroll 1`: every SM
// runs every opcode's code in turn, so the kernel's size is its instruction cache's load (at
// batch 8 its SASS went from 590 to 415 KB and the step got 3% faster; benchmarks/NOTES.md).
//
// Register arrays that a task fills under a condition start zeroed: ptxas treats a register
// read on a path that never wrote it as live from the kernel's entry, and in a persistent
// kernel that holds it across every task of the step (uninitialized load buffers in attention
// and NORM held ~140 registers this way and pushed the kernel to 255 with spills).

struct Layer {
    const bf16 *norm, *qkv, *o, *gate_up, *down, *router, *experts_gate_up, *experts_down;
    bf16 *kv;                  // this layer's slot of its group's pages: add page * page_stride
    int64_t page_stride;       // elements per page of the group
    int32_t group;
    int32_t kv_slot, kv_layers;  // its slot in the group's pages, and the group's layers (kv_map's coordinates)
    uint8_t dense, sliding, rope;
};

struct Params {
    TensorMap kv_map[NMK_KV_MAX_GROUPS];  // each KV group's pages as attention reads them (make_kv_map)
    // geometry
    int hidden, num_layers, num_heads, num_kv_heads, num_experts, top_k, moe_inter, dense_inter, vocab;
    int sliding_window;
    float rope_theta, norm_eps, logit_scale;
    nmk_plan plan;
    // weights
    const bf16 *embed, *final_norm;
    // step inputs and outputs
    const int32_t *tokens;
    int32_t positions[NMK_MK_MAX_BATCH];  // by value: read from the parameter bank, no load from memory
    const int32_t *tables[NMK_KV_MAX_GROUPS];
    int table_cols;
    float *logits;
    int32_t *next_tokens;
    // scratch (B = NMK_MK_MAX_BATCH rows each)
    // [3, B, H] the residual stream: the input of layer l (l = num_layers: of the final norm)
    // at resid_of(l), as fp32 sums. Layer 0's NORM tiles write the embedding there; layer l's
    // o-proj tiles add x + attn (rounded to bf16) into l + 1's and zero l + 2's, its DOWN tiles add
    // the weighted expert outputs; its readers round each sum to bf16 (the reference's residual).
    float *resid;
    bf16 *normed_image;      // the layer's normed input as a GEMV image (in_bytes(H), in_offset): the
                             // routing ROUTER tile writes it, sparse GATE_UP tasks stage it by one bulk copy
    uint32_t *attn_ticket; // [B, kv_heads] finished splits; the last one merges and rezeroes
    float *q;          // [B, Q] rotated queries
    float *part;       // [B, kv_heads, MAX_SPLITS, group, head_dim + 2]: acc, max, sum
    bf16 *attn;        // [B, Q] as o-proj's GEMV input in shared memory (in_bytes(Q), in_offset)
    // The launch's routing table (route_table_words): each mlp slot's word (common.cuh's slot_word:
    // its expert, -1 unused, the rows that picked it, layer + 1), then router_words
    int32_t *slot_expert;
    // [B_max, E] the router's logits as words (layer + 1) << 16 | bf16 bits (common.cuh's logit_word)
    uint32_t *router_words;
    int32_t *spare_slot_expert;  // the previous launch's table, which this one zeroes (the next one's)
    bf16 *act;             // [slots] DOWN's GEMV input images, in_bytes(max(I, D)) each (op_mlp's act_image)
    float *lm_best;        // [B, lm_tiles]
    int32_t *lm_best_index;
    // schedule
    const nmk_task *tasks;
    const uint32_t *sm_offsets;     // SM s runs its list tasks[sm_offsets[s] .. sm_offsets[s + 1])
    const uint32_t *queue_offsets;  // queue q: tasks[queue_offsets[q] .. queue_offsets[q + 1])
    uint32_t *counters;    // [num_counters + num_queues]: the counters, then the queues' claim heads
    uint32_t *spare_counters;  // the same of the schedule's previous launch, which this one zeroes (megakernel.cu)
    // debug capture (nmk_mk_set_debug), null when off
    float *debug;              // [num_layers + 1, NMK_MK_DEBUG_STAGES, B, H]
    int32_t *debug_experts;    // [num_layers, B, top_k]
    // task timing (nmk_mk_set_timing), null when off: per task of the array (lists, then
    // queues), globaltimer ns when its wait began, its run began and it ended, and
    // op | layer << 8 | sm << 16
    uint64_t *timing;          // [timing_capacity, 4]
    uint32_t timing_capacity;
    // Every task reads its layer's entry first. In the parameters it comes through the constant
    // cache, which the acquiring polls and tickets do not invalidate; from global memory it cost
    // an L2 round trip at the start of most tasks (each acquire invalidates L1).
    Layer layers[kMaxLayers];  // [num_layers]
};
// Kernel parameters of Hopper may take up to 32764 bytes (CUDA 12.1 on).
static_assert(sizeof(Params) <= 32764, "the kernel's parameters are too large");

}  // namespace nmk::mk
