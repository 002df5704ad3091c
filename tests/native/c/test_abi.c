/* Status strings, the last-error message, versions and NULL handling. */
#include <string.h>

#include "check.h"

int main(void) {
    char buf[256];
    nmk_kv_pool *pool = NULL;
    nmk_kv_pool_params params = nmk_kv_pool_default_params();

    CHECK(nmk_abi_version() == NMK_ABI_VERSION);
    CHECK(strlen(nmk_version()) > 0);
    CHECK(nmk_has_cuda() == 0 || nmk_has_cuda() == 1);
    CHECK(strcmp(nmk_status_string(NMK_OK), "NMK_OK") == 0);
    CHECK(strcmp(nmk_status_string(NMK_ERR_NO_SPACE), "NMK_ERR_NO_SPACE") == 0);
    CHECK(strcmp(nmk_status_string(NMK_ERR_INTERNAL), "NMK_ERR_INTERNAL") == 0);
    CHECK(strcmp(nmk_status_string(12345), "NMK_UNKNOWN_STATUS") == 0);

    /* Invalid arguments are reported with a message naming the problem. */
    CHECK_STATUS(nmk_kv_pool_create(NULL, &pool), NMK_ERR_INVALID_ARGUMENT);
    params.num_groups = 0;
    CHECK_STATUS(nmk_kv_pool_create(&params, &pool), NMK_ERR_INVALID_ARGUMENT);
    CHECK(pool == NULL);
    CHECK(nmk_last_error(buf, sizeof buf) > 0);
    CHECK(strstr(buf, "num_groups") != NULL);

    /* Truncation: returns the full length, writes size - 1 bytes and a NUL. */
    {
        size_t full = nmk_last_error(NULL, 0);
        char small[5];
        CHECK(nmk_last_error(small, sizeof small) == full);
        CHECK(strlen(small) == 4);
        CHECK(strncmp(small, buf, 4) == 0);
    }

    /* A successful call leaves the message unchanged. */
    params = nmk_kv_pool_default_params();
    CHECK_OK(nmk_kv_pool_create(&params, &pool));
    CHECK(strstr(buf, "num_groups") != NULL);
    {
        char again[256];
        nmk_last_error(again, sizeof again);
        CHECK(strcmp(again, buf) == 0);
    }

    /* destroy accepts NULL; calls on a NULL handle fail cleanly. */
    nmk_kv_pool_destroy(pool);
    nmk_kv_pool_destroy(NULL);
    nmk_loop_destroy(NULL);
    CHECK(nmk_loop_fd(NULL) == -1);
    CHECK(nmk_loop_park_message(NULL, buf, sizeof buf) == 0 && buf[0] == '\0');
    CHECK_STATUS(nmk_kv_seq_free(NULL, 1), NMK_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(nmk_loop_resume(NULL), NMK_ERR_INVALID_ARGUMENT);
    {
        nmk_loop_params lp = nmk_loop_default_params();
        CHECK(lp.max_rows == 8 && lp.ring_capacity >= lp.max_rows && lp.step == NULL);
    }
    {  /* the schedule's wait spans: NULL refused unless there is nothing to fill */
        nmk_task task;
        uint32_t span = 7;
        memset(&task, 0, sizeof task);
        CHECK_STATUS(nmk_schedule_wait_spans(NULL, &task, 1, &span), NMK_ERR_INVALID_ARGUMENT);
        CHECK(nmk_last_error(buf, sizeof buf) > 0 && strstr(buf, "nmk_schedule_wait_spans") != NULL);
        CHECK(span == 7);
    }
    {  /* which tasks wait inside their run: a NULL geometry refused, even with nothing to fill */
        nmk_task task;
        uint8_t inside = 7;
        memset(&task, 0, sizeof task);
        CHECK_STATUS(nmk_schedule_waits_in_run(NULL, 1, &task, 1, &inside), NMK_ERR_INVALID_ARGUMENT);
        CHECK(nmk_last_error(buf, sizeof buf) > 0 && strstr(buf, "nmk_schedule_waits_in_run") != NULL);
        CHECK_STATUS(nmk_schedule_waits_in_run(NULL, 1, NULL, 0, NULL), NMK_ERR_INVALID_ARGUMENT);
        CHECK(inside == 7);
    }
    puts("test_abi: ok");
    return 0;
}
