/* A kernel timeline for measuring (issue 12): a CUDA injection library (CUDA_INJECTION64_PATH)
 * that records every kernel's GPU start and end through CUPTI's activity API and writes them at
 * exit as CSV (CUPTI_TRACE_OUT, default /tmp/cupti-trace.csv): name, start_ns, end_ns, grid,
 * block, stream. Unlike `bench`'s event profile it adds no stream operation between launches,
 * so programmatic dependent launches still overlap; kernels/tools/timeline.py attributes the
 * time between consecutive completions to each kernel. Not part of the product (CI builds
 * nothing here); kernels/tools/build-cupti-trace.sh builds it against CUPTI's wheel headers. */
#include <cupti_activity.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BUF_SIZE (8u << 20)
static FILE *out;

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = (uint8_t *)aligned_alloc(8, BUF_SIZE);
    *size = *buffer ? BUF_SIZE : 0;
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                                      size_t valid) {
    (void)ctx;
    (void)stream;
    (void)size;
    CUpti_Activity *rec = NULL;
    while (out && cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
            const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)rec;
            fprintf(out, "%s,%llu,%llu,%u,%u,%u,%u,%u\n", k->name ? k->name : "?",
                    (unsigned long long)k->start, (unsigned long long)k->end, k->gridX, k->gridY,
                    k->gridZ, k->blockX, k->streamId);
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)rec;
            fprintf(out, "memcpy%u,%llu,%llu,%llu,0,0,0,%u\n", (unsigned)m->copyKind,
                    (unsigned long long)m->start, (unsigned long long)m->end,
                    (unsigned long long)m->bytes, m->streamId);
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
            const CUpti_ActivityMemset4 *m = (const CUpti_ActivityMemset4 *)rec;
            fprintf(out, "memset,%llu,%llu,%llu,0,0,0,%u\n", (unsigned long long)m->start,
                    (unsigned long long)m->end, (unsigned long long)m->bytes, m->streamId);
        }
    }
    free(buffer);
}

static void finish(void) {
    cuptiActivityFlushAll(1);
    if (out) {
        fclose(out);
        out = NULL;
    }
}

int InitializeInjection(void) {
    const char *path = getenv("CUPTI_TRACE_OUT");
    out = fopen(path ? path : "/tmp/cupti-trace.csv", "w");
    if (!out)
        return 0;
    fprintf(out, "name,start,end,gx,gy,gz,bx,stream\n");
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS)
        return 0;
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
    atexit(finish);
    return 1;
}
