// test_stage_buffers.c - linked with one stage's kernels: the device memory its STAGE table asks
// for. The workspace lives from the forward to the backward (in PyTorch it is saved with the
// graph), so a stage with a backward pass keeps there only what the backward reads, the row
// log-sum-exp: one float per row, not stage 08's B*H*S*D float dQ, which only the backward needs
// and asks for as backward scratch, with delta. A forward-only stage asks for no backward scratch.
// No GPU needed: the size functions are host code.
#include <stdio.h>

#include "attn.h"
#include "test_util.h"

int main(void) {
    for (int dim = 64; dim <= 128; dim += 64)
        for (int causal = 0; causal <= 1; causal++) {
            const attn_shape shape = {.batch = 3, .heads = 5, .seq = 1000, .dim = dim, .causal = causal};
            const size_t rows = (size_t)shape.batch * shape.heads * shape.seq;
            const size_t scratch = STAGE.backward_scratch_bytes ? STAGE.backward_scratch_bytes(&shape) : 0;
            if (!STAGE.backward) {
                EXPECT(scratch == 0, "%s has no backward pass but asks for %zu bytes of backward scratch",
                       STAGE.name, scratch);
                continue;
            }
            const size_t workspace = STAGE.workspace_bytes(&shape);
            EXPECT(workspace == sizeof(float) * rows,
                   "%s's workspace is %zu bytes at D=%d; the log-sum-exp alone is %zu (one float per row)",
                   STAGE.name, workspace, dim, sizeof(float) * rows);
            EXPECT(scratch >= sizeof(float) * rows, "%s's backward scratch is %zu bytes at D=%d, less than delta's %zu",
                   STAGE.name, scratch, dim, sizeof(float) * rows);
        }
    return test_summary(STAGE.name);
}
