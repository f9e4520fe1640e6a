// test_stage_registry.c - linked with one stage's kernels: its STAGE table says what the build
// read from the stage's folder (CMakeLists.txt): the folder's name, a backward pass where the
// folder has a backward.cu, sm_90a code where its sources include wgmma_ptx.cuh. The build
// defines FOLDER, HAS_BACKWARD_CU and INCLUDES_WGMMA for the stage it links. No GPU needed.
#include <string.h>

#include "attn.h"
#include "test_util.h"

int main(void) {
    EXPECT(strcmp(STAGE.name, FOLDER) == 0, "the STAGE table of stages/%s is named %s", FOLDER, STAGE.name);
    EXPECT((STAGE.backward != NULL) == HAS_BACKWARD_CU, "%s: a backward pass in the table (%d) but backward.cu %s",
           STAGE.name, STAGE.backward != NULL, HAS_BACKWARD_CU ? "present" : "absent");
    EXPECT((STAGE.backward_scratch_bytes != NULL) <= (STAGE.backward != NULL),
           "%s: backward scratch without a backward pass", STAGE.name);
    EXPECT(STAGE.needs_sm90a == INCLUDES_WGMMA, "%s: needs_sm90a is %d, but its sources %s wgmma_ptx.cuh",
           STAGE.name, STAGE.needs_sm90a, INCLUDES_WGMMA ? "include" : "do not include");
    return test_summary(STAGE.name);
}
