// nmk_sample in builds without CUDA: arguments are checked, then the call says CUDA is absent.
#include "sample/sample.hpp"

#if !NORTHMK_HAS_CUDA
extern "C" {

NMK_API nmk_status nmk_sample(const float *logits, uint32_t rows, uint32_t vocab, const nmk_sample_row *params,
                              int32_t *tokens, float *, void *) {
    nmk_status status = nmk::sample::check_args(logits, rows, vocab, params, tokens);
    if (status != NMK_OK) return status;
    return nmk::fail(NMK_ERR_UNSUPPORTED, "nmk_sample: libnorthmk was built without CUDA");
}

}  // extern "C"
#endif
