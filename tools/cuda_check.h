// CHECK(call): a CUDA runtime call that must succeed, else file:line, the call and the error on
// stderr and exit status 2. For the tools' stand-alone benchmarks (gemv_bench, executor_bench).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK(call)                                                                                     \
    do {                                                                                                \
        cudaError_t e_ = (call);                                                                        \
        if (e_ != cudaSuccess) {                                                                        \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            std::exit(2);                                                                               \
        }                                                                                               \
    } while (0)
