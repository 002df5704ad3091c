/* Assertions for the C tests: a failed check prints where and why, then exits 1. */
#ifndef NMK_TEST_CHECK_H
#define NMK_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#include "northmk.h"

#define CHECK(cond)                                                        \
    do {                                                                   \
        if (!(cond)) {                                                     \
            fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
            exit(1);                                                       \
        }                                                                  \
    } while (0)

/* The call must return `expected`; on mismatch prints the library's last error. */
#define CHECK_STATUS(call, expected)                                       \
    do {                                                                   \
        nmk_status got_ = (call);                                          \
        if (got_ != (expected)) {                                          \
            char msg_[512];                                                \
            nmk_last_error(msg_, sizeof msg_);                             \
            fprintf(stderr, "%s:%d: %s returned %s, expected %s (%s)\n", __FILE__, __LINE__, #call, \
                    nmk_status_string(got_), nmk_status_string(expected), msg_); \
            exit(1);                                                       \
        }                                                                  \
    } while (0)

#define CHECK_OK(call) CHECK_STATUS(call, NMK_OK)

#endif
