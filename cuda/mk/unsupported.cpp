// nmk_mk_* in builds without CUDA: every call says the megakernel is absent.
#include "internal.hpp"

#if !NORTHMK_HAS_CUDA
extern "C" {

NMK_API nmk_status nmk_mk_create(const nmk_mk_geometry *, const nmk_mk_weights *, nmk_mk **) {
    return nmk::fail(NMK_ERR_UNSUPPORTED, "nmk_mk_create: libnorthmk was built without CUDA");
}
NMK_API void nmk_mk_destroy(nmk_mk *) {}
NMK_API nmk_status nmk_mk_num_sms(const nmk_mk *, uint32_t *) {
    return nmk::fail(NMK_ERR_UNSUPPORTED, "nmk_mk_num_sms: libnorthmk was built without CUDA");
}
NMK_API nmk_status nmk_mk_debug_bytes(const nmk_mk *, uint64_t *) {
    return nmk::fail(NMK_ERR_UNSUPPORTED, "nmk_mk_debug_bytes: libnorthmk was built without CUDA");
}
NMK_API nmk_status nmk_mk_set_debug(nmk_mk *, void *, uint64_t) {
    return nmk::fail(NMK_ERR_UNSUPPORTED, "nmk_mk_set_debug: libnorthmk was built without CUDA");
}
NMK_API nmk_status nmk_mk_set_timing(nmk_mk *, uint64_t *, uint32_t) {
    return nmk::fail(NMK_ERR_UNSUPPORTED, "nmk_mk_set_timing: libnorthmk was built without CUDA");
}
NMK_API nmk_status nmk_mk_step(nmk_mk *, const nmk_mk_step_args *, void *) {
    return nmk::fail(NMK_ERR_UNSUPPORTED, "nmk_mk_step: libnorthmk was built without CUDA");
}
NMK_API nmk_status nmk_mk_prepare(nmk_mk *, uint32_t, int32_t) {
    return nmk::fail(NMK_ERR_UNSUPPORTED, "nmk_mk_prepare: libnorthmk was built without CUDA");
}

}  // extern "C"
#endif
