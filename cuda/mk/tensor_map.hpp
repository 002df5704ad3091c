// TMA descriptors: the KV pages attention reads, and the weight matrices the TMA + wgmma GEMV
// (tma_gemv.cuh, the GEMV benchmark's) streams.
// Host code, CUDA builds only; it calls the driver through the runtime's entry-point lookup,
// so the library links no libcuda and still loads where no driver exists.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace nmk::mk {

// One TMA box: 64 columns (128 bytes, the width of the 128-byte swizzle) by kTmaBoxRows rows.
// 16 rows is the smallest GEMV row segment, so a box never pulls in rows a tile does not use.
constexpr int kTmaBoxCols = 64;
constexpr int kTmaBoxRows = 16;
constexpr int kTmaBoxBytes = kTmaBoxCols * kTmaBoxRows * 2;

// A CUtensorMap: 128 bytes, read by the TMA unit from global memory at a 64-byte aligned address
// (the CUDA 13 headers align the type to 128).
using TensorMap = CUtensorMap;
static_assert(sizeof(TensorMap) == 128 && alignof(TensorMap) >= 64, "CUtensorMap layout");

// The map of a bf16 row-major [rows, K] matrix at `base` (K % 8 == 0, base 16-byte aligned):
// 2-D {K, rows}, box {kTmaBoxCols, box_rows}, 128-byte swizzle, rows past the end read as zero,
// L2 promotion 256 B. box_rows: a multiple of 8 in [8, 256]; the GEMV ring's 16 by default, its
// BoxRows for a tall map. Throws std::runtime_error when the driver refuses it.
TensorMap make_weight_map(const void *base, uint64_t rows, uint64_t K, uint32_t box_rows = kTmaBoxRows);

// The map of one KV group's pages, [pages, layers_in_group, 2, kv_heads, page_size, head_dim]
// bf16 at `base`, as attention reads them: one box a (page, layer, kv head), its keys and its
// values (32 KB at head_dim 128, one TMA copy). 5-D {64 dims, page_size keys, head_dim / 64
// halves, 2 (keys, values), pages * layers_in_group * 2 kv_heads}, so that coordinates
// (0, 0, 0, 0, (page * layers_in_group + slot) * 2 kv_heads + head) name it; in shared memory it
// lands as 2 * head_dim / 64 slabs of page_size 128-byte rows (keys' dims [0, 64), [64, 128),
// then the values'), with the 128-byte swizzle (row key's 16-byte chunk c lands at chunk
// c ^ (key % 8)). Throws std::runtime_error when the driver refuses it.
TensorMap make_kv_map(void *base, uint64_t pages, uint32_t layers_in_group, uint32_t kv_heads, uint32_t page_size,
                      uint32_t head_dim);

}  // namespace nmk::mk
