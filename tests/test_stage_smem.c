// test_stage_smem.c - linked with one stage's kernels: the stage's blocks fit the shared memory of
// every GPU the course names (101,376 bytes per block on sm_86 and sm_89; stages built for sm_90a
// only need the H100's 232,448), and the harness's guard fires, with its sentence, when a GPU
// allows less than the stage asks for. No GPU needed: shared_bytes() is host code.
#include <stdio.h>
#include <string.h>

#include "attn.h"
#include "smem_limit.h"
#include "test_util.h"

int main(void) {
    const size_t limit = STAGE.needs_sm90a ? 232448 : 101376;
    for (int dim = 64; dim <= 128; dim += 64)
        for (int causal = 0; causal <= 1; causal++) {
            const attn_shape shape = {.batch = 3, .heads = 5, .seq = 1000, .dim = dim, .causal = causal};
            const size_t needed = STAGE.shared_bytes(&shape);
            EXPECT(needed <= limit, "%s asks for %zu bytes per block at D=%d, more than %zu", STAGE.name,
                   needed, dim, limit);
            char message[512] = "";
            EXPECT(!smem_exceeds_limit(STAGE.name, &shape, needed, "GPU", limit, message, sizeof message),
                   "the guard fires although %zu <= %zu", needed, limit);
            if (needed == 0) continue;
            // A fake GPU with one byte too few.
            EXPECT(smem_exceeds_limit(STAGE.name, &shape, needed, "Fake GPU", needed - 1, message, sizeof message),
                   "the guard does not fire for %zu bytes against a limit of %zu", needed, needed - 1);
            char expected[512];
            snprintf(expected, sizeof expected, "%s: needs %zu bytes of shared memory per block at D=%d; Fake GPU allows %zu",
                     STAGE.name, needed, dim, needed - 1);
            EXPECT(strcmp(message, expected) == 0, "message '%s', want '%s'", message, expected);
        }
    return test_summary(STAGE.name);
}
