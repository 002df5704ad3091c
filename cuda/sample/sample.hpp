// GPU sampling (nmk_sample), host side shared by the CUDA and the no-CUDA builds.
#pragma once

#include "internal.hpp"

namespace nmk::sample {

// NMK_OK, or NMK_ERR_INVALID_ARGUMENT with the last error naming the bad argument (or row).
// Touches nothing CUDA: both builds check arguments before anything else.
nmk_status check_args(const float *logits, uint32_t rows, uint32_t vocab, const nmk_sample_row *params,
                      const int32_t *tokens);

}  // namespace nmk::sample
