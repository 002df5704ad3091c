// Helpers every libnorthmk translation unit uses at the C ABI boundary.
//
// Inside the library, code is ordinary C++ (exceptions allowed). Every extern "C" entry
// point wraps its body in nmk::guard(), which turns a C++ exception into a status plus a
// thread-local message; failures detected directly return nmk::fail(status, fmt, ...).
#pragma once

#include <cstdarg>
#include <cstddef>
#include <new>
#include <stdexcept>
#include <string>

#include "northmk.h"

namespace nmk {

// Sets the calling thread's last-error message (printf-style) and returns `status`.
nmk_status fail(nmk_status status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

// Sets the last-error message verbatim.
void set_last_error(const std::string &message);

// Thrown inside the library to leave with a specific status; guard() converts it.
struct Error : std::runtime_error {
    nmk_status status;
    Error(nmk_status s, const std::string &message) : std::runtime_error(message), status(s) {}
};

// Runs body() (returning nmk_status) and converts any exception escaping it:
// nmk::Error -> its status, std::bad_alloc -> NMK_ERR_OUT_OF_MEMORY, others -> INTERNAL.
template <class Body>
nmk_status guard(const char *where, Body &&body) noexcept {
    try {
        return body();
    } catch (const Error &e) {
        return fail(e.status, "%s: %s", where, e.what());
    } catch (const std::bad_alloc &) {
        return fail(NMK_ERR_OUT_OF_MEMORY, "%s: out of host memory", where);
    } catch (const std::exception &e) {
        return fail(NMK_ERR_INTERNAL, "%s: internal error: %s", where, e.what());
    } catch (...) {
        return fail(NMK_ERR_INTERNAL, "%s: internal error (unknown exception)", where);
    }
}

}  // namespace nmk

// Returns NMK_ERR_INVALID_ARGUMENT with a message from the enclosing function when cond fails.
#define NMK_REQUIRE(cond, ...)                                                  \
    do {                                                                        \
        if (!(cond)) return ::nmk::fail(NMK_ERR_INVALID_ARGUMENT, __VA_ARGS__); \
    } while (0)
