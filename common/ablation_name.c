// ablation_name.c - linked into an ablation build only (CMakeLists.txt, from the stage's
// ablations.txt), compiled with -DABLATION_NAME="<name>": the harness then calls the program
// <stage>.<name> in its messages and CSV rows.
extern const char *const flash_stages_ablation;
const char *const flash_stages_ablation = ABLATION_NAME;
