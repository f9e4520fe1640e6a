// smem_limit.c - see smem_limit.h.
#include "smem_limit.h"

#include <stdio.h>

int smem_exceeds_limit(const char *stage, const attn_shape *shape, size_t needed, const char *gpu,
                       size_t allowed, char *message, size_t message_size) {
    if (needed <= allowed) return 0;
    snprintf(message, message_size, "%s: needs %zu bytes of shared memory per block at D=%d; %s allows %zu",
             stage, needed, shape->dim, gpu, allowed);
    return 1;
}
