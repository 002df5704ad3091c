// make_weight_map, make_kv_map: cuTensorMapEncodeTiled, looked up once through the CUDA runtime.
// Compiled by the host compiler in every build; empty without CUDA.
#if NORTHMK_HAS_CUDA
#include "tensor_map.hpp"

#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>

#include <stdexcept>
#include <string>

namespace nmk::mk {
namespace {

using EncodeTiled = PFN_cuTensorMapEncodeTiled_v12000;

EncodeTiled encode_tiled() {
    static const EncodeTiled fn = [] {
        void *p = nullptr;
        cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
        cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found);
#else
        cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &p, cudaEnableDefault, &found);
#endif
        if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || !p)
            throw std::runtime_error(std::string("cuTensorMapEncodeTiled not found: ") + cudaGetErrorString(e) +
                                     " (query result " + std::to_string(static_cast<int>(found)) + ")");
        return reinterpret_cast<EncodeTiled>(p);
    }();
    return fn;
}

// A bf16 map with 128-byte swizzle, L2 promotion 256 B and zeros past the end; `what` names it
// in the error.
template <int Rank>
TensorMap encode_bf16(void *base, const cuuint64_t (&dims)[Rank], const cuuint64_t (&strides)[Rank - 1],
                      const cuuint32_t (&box)[Rank], const std::string &what) {
    TensorMap map{};
    cuuint32_t element_strides[Rank];
    for (int i = 0; i < Rank; i++) element_strides[i] = 1;
    const CUresult r = encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, Rank, base, dims, strides, box,
                                      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        throw std::runtime_error("cuTensorMapEncodeTiled failed: CUresult " + std::to_string(static_cast<int>(r)) +
                                 " (" + what + ")");
    return map;
}

}  // namespace

TensorMap make_weight_map(const void *base, uint64_t rows, uint64_t K, uint32_t box_rows) {
    if (box_rows < 8 || box_rows > 256 || box_rows % 8)
        throw std::runtime_error("make_weight_map: box rows " + std::to_string(box_rows) +
                                 " not a multiple of 8 in [8, 256]");
    const cuuint64_t dims[2] = {K, rows};
    const cuuint64_t strides[1] = {K * 2};  // bytes between rows
    const cuuint32_t box[2] = {kTmaBoxCols, box_rows};
    return encode_bf16<2>(const_cast<void *>(base), dims, strides, box,
                          "rows " + std::to_string(rows) + ", K " + std::to_string(K) + ", box rows " +
                              std::to_string(box_rows));
}

TensorMap make_kv_map(void *base, uint64_t pages, uint32_t layers_in_group, uint32_t kv_heads, uint32_t page_size,
                      uint32_t head_dim) {
    // Strides by dimension (bytes): a key's row, a 64-dim half of it, the values after the keys
    // (kv_heads heads on), and the last dimension's unit, one head's keys of a (page, layer).
    const cuuint64_t row = (cuuint64_t)head_dim * 2, head = row * page_size;
    const cuuint64_t dims[5] = {64, page_size, head_dim / 64, 2, pages * layers_in_group * 2 * kv_heads};
    const cuuint64_t strides[4] = {row, 128, head * kv_heads, head};
    const cuuint32_t box[5] = {64, page_size, head_dim / 64, 2, 1};
    if (head_dim % 64)
        throw std::runtime_error("make_kv_map: head_dim " + std::to_string(head_dim) + " not a multiple of 64");
    return encode_bf16<5>(base, dims, strides, box,
                          "KV pages " + std::to_string(pages) + " x " + std::to_string(layers_in_group) +
                              " layers, " + std::to_string(kv_heads) + " kv heads, page " + std::to_string(page_size) +
                              ", head_dim " + std::to_string(head_dim));
}

}  // namespace nmk::mk
#endif
