// Argument checks of nmk_sample, the same in every build.
#include <cfloat>
#include <cmath>

#include "sample/sample.hpp"

namespace nmk::sample {

nmk_status check_args(const float *logits, uint32_t rows, uint32_t vocab, const nmk_sample_row *params,
                      const int32_t *tokens) {
    NMK_REQUIRE(logits && params && tokens, "nmk_sample: NULL argument (logits, params and tokens are required)");
    NMK_REQUIRE(rows >= 1 && rows <= NMK_SAMPLE_MAX_ROWS, "nmk_sample: rows must be in [1, %d], got %u",
                NMK_SAMPLE_MAX_ROWS, rows);
    NMK_REQUIRE(vocab >= 1 && vocab <= NMK_SAMPLE_MAX_VOCAB, "nmk_sample: vocab must be in [1, %d], got %u",
                NMK_SAMPLE_MAX_VOCAB, vocab);
    for (uint32_t r = 0; r < rows; r++) {
        const nmk_sample_row &p = params[r];
        NMK_REQUIRE(std::isfinite(p.temperature) && (p.temperature <= 0.0f || p.temperature >= FLT_MIN),
                    "nmk_sample: row %u: temperature must be <= 0 (greedy) or in [%g, inf), got %g", r,
                    (double)FLT_MIN, (double)p.temperature);
        NMK_REQUIRE(p.top_p > 0.0f && p.top_p <= 1.0f, "nmk_sample: row %u: top_p must be in (0, 1], got %g", r,
                    (double)p.top_p);
        NMK_REQUIRE(p.min_p >= 0.0f && p.min_p <= 1.0f, "nmk_sample: row %u: min_p must be in [0, 1], got %g", r,
                    (double)p.min_p);
    }
    return NMK_OK;
}

}  // namespace nmk::sample
