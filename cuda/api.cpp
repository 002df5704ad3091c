// Status strings, the thread-local last error, versions.
#include <cstdio>
#include <cstring>

#include "internal.hpp"

namespace {
thread_local std::string last_error;
}

namespace nmk {

void set_last_error(const std::string &message) { last_error = message; }

nmk_status fail(nmk_status status, const char *fmt, ...) {
    char buf[1024];
    va_list args;
    va_start(args, fmt);
    std::vsnprintf(buf, sizeof buf, fmt, args);
    va_end(args);
    last_error = buf;
    return status;
}

}  // namespace nmk

extern "C" {

NMK_API const char *nmk_status_string(int status) {
    switch (status) {
        case NMK_OK: return "NMK_OK";
        case NMK_ERR_INVALID_ARGUMENT: return "NMK_ERR_INVALID_ARGUMENT";
        case NMK_ERR_NO_SPACE: return "NMK_ERR_NO_SPACE";
        case NMK_ERR_NOT_FOUND: return "NMK_ERR_NOT_FOUND";
        case NMK_ERR_BAD_STATE: return "NMK_ERR_BAD_STATE";
        case NMK_ERR_UNSUPPORTED: return "NMK_ERR_UNSUPPORTED";
        case NMK_ERR_CUDA: return "NMK_ERR_CUDA";
        case NMK_ERR_STEP_FAILED: return "NMK_ERR_STEP_FAILED";
        case NMK_ERR_OUT_OF_MEMORY: return "NMK_ERR_OUT_OF_MEMORY";
        case NMK_ERR_INTERNAL: return "NMK_ERR_INTERNAL";
    }
    return "NMK_UNKNOWN_STATUS";
}

NMK_API size_t nmk_last_error(char *buf, size_t size) {
    if (buf && size) {
        size_t n = last_error.size() < size - 1 ? last_error.size() : size - 1;
        std::memcpy(buf, last_error.data(), n);
        buf[n] = '\0';
    }
    return last_error.size();
}

NMK_API const char *nmk_version(void) { return NORTHMK_VERSION; }

NMK_API uint32_t nmk_abi_version(void) { return NMK_ABI_VERSION; }

NMK_API int nmk_has_cuda(void) { return NORTHMK_HAS_CUDA; }

}  // extern "C"
