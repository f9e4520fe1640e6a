// harness.c - the one main() every stage links: command line, inputs, check, timing, CSV, .npy.
//
// A stage provides `STAGE` (attn.h); this file does everything around its forward pass (and its
// backward pass, with --backward), the same way for every stage, so numbers are comparable.
//
// Exit codes: 0 ok, 1 check failed or CUDA error, 2 bad command line or input file,
// 3 shape not supported by this stage (or too large for this GPU), 77 no CUDA device (CTest skip).
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "attn.h"
#include "check.h"
#include "gpu_spin.h"
#include "cuda_check.h"
#include "half.h"
#include "npy.h"
#include "omp_compat.h"
#include "stage_check.h"

#ifndef FLASH_STAGES_GIT_COMMIT
#define FLASH_STAGES_GIT_COMMIT "unknown"
#endif

// An ablation build (stages/<stage>/ablations.txt) links common/ablation_name.c, which defines its
// name; everywhere else the weak declaration leaves it NULL. The program calls itself
// <stage>.<ablation> in its messages and CSV rows, so an ablation never passes for the stage.
extern const char *const flash_stages_ablation __attribute__((weak));
static char program_name[256];

static void set_program_name(void) {
    const char *ablation = &flash_stages_ablation ? flash_stages_ablation : NULL;
    snprintf(program_name, sizeof program_name, "%s%s%s", STAGE.name, ablation ? "." : "", ablation ? ablation : "");
}

enum { EXIT_CHECK_FAILED = 1, EXIT_USAGE = 2, EXIT_UNSUPPORTED = 3, EXIT_NO_GPU = 77 };

// Timing stops early once this many seconds have been timed and at least MIN_TIMED_RUNS ran, so
// the slow early stages finish the benchmark sweep in minutes; the CSV records the run count.
#define TIME_BUDGET_S 2.0
#define MIN_TIMED_RUNS 5
// The GPU spins this many cycles (~1 ms at the H100's clock) after the flush and before each timed
// run: the same pause plots/peers.py gives PyTorch's backends, whose host dispatch needs it.
// plots/cuda_timing.py reads these constants and the --warmup and --iters defaults from this file.
#define SPIN_CYCLES 2000000LL

// host[] and the .npy files share this order; dO is an input of the backward pass.
enum { T_Q, T_K, T_V, T_O, T_DO, T_DQ, T_DK, T_DV, N_TENSORS };
static const char *TENSOR_NAMES[N_TENSORS] = {"q", "k", "v", "o", "do", "dq", "dk", "dv"};
// attn_dtype's names, for --dtype, the CSV and the report line.
static const char *DTYPE_NAMES[2] = {"fp16", "bf16"};

typedef struct {
    attn_shape shape;
    int bench, backward;
    int seq_major;  // --layout bshd: the device tensors are [B, S, H, D], read through strides
    int iters, warmup;
    unsigned long long seed;
    // The generated inputs are N(mean, std^2), per tensor (T_Q, T_K, T_V and T_DO).
    double mean[T_DO + 1], std[T_DO + 1];
    int outliers;  // --outliers: Q, K and V with 0.1% large entries (FlashAttention-3's FP8 experiment)
    const char *csv_path, *load_dir, *save_dir;
} options;

// --mean and --std bound their values so that every generated input is a finite fp16 (at most
// about 1600 in size; fp16 reaches 65504).
#define INPUT_MEAN_MAX 1000.0
#define INPUT_STD_MAX 100.0

static void usage(FILE *out) {
    fprintf(out,
            "usage: %s [options]\n"
            "  stage %s: %s\n"
            "\n"
            "  --batch B      batch size (default 1)\n"
            "  --heads H      heads (default 8)\n"
            "  --seq S        sequence length, any S >= 1 (default 512)\n"
            "  --dim D        head dimension (default 64)\n"
            "  --causal       causal mask: query i attends to keys 0..i\n"
            "  --kv-heads N   heads of K and V, a divisor of H (grouped-query attention; default H)\n"
            "  --kv-seq N     keys per head (a KV cache, cross-attention; default S); with --causal,\n"
            "                 aligned bottom-right: query i sees keys 0..i + N - S, and N >= S\n"
            "  --layout L     the device tensors' memory order: bhsd ([B, H, S, D], the default) or\n"
            "                 bshd ([B, S, H, D], handed to the kernels as strides), for the stages\n"
            "                 whose kernels read strides\n"
            "  --dtype T      element type of the tensors: fp16 (the default) or bf16, for the stages\n"
            "                 whose kernels take it; the check's unit roundoff follows (2^-11, 2^-8)\n"
            "  --check        run once and compare with the float64 CPU reference (the default)\n"
            "  --bench        check, then time: median of --iters runs, L2 flushed before each\n"
            "  --backward     also run the backward pass (stages that have one) on a random dO and\n"
            "                 check dQ, dK, dV against float64; --bench then times the backward\n"
            "  --iters N      timed runs (default 30; fewer once %.0f s are timed, at least %d)\n"
            "  --warmup N     untimed runs before timing (default 3)\n"
            "  --seed N       seed of the random inputs, N(0,1) unless --mean or --std say (default 1)\n"
            "  --mean T=M     draw tensor T (q, k, v or do) with mean M: |M| <= %.0f. A large mean in\n"
            "                 k shifts each query row's scores by its own constant (k=30: by about\n"
            "                 +-10 to +-100), which softmax cancels; one in q shifts each key's scores\n"
            "  --std T=X      draw tensor T with standard deviation X: 0 < X <= %.0f (--std q=2.5\n"
            "                 --std k=2.5: scores six times as large)\n"
            "  --outliers     Q, K and V drawn from N(0,1) + N(0,100) Bernoulli(0.001): 0.1%% of the\n"
            "                 entries large (the FP8 accuracy experiment of FlashAttention-3's paper)\n"
            "  --csv FILE     append one result row to FILE (with --bench)\n"
            "  --load DIR     read DIR/q.npy, k.npy, v.npy (fp16 [B,H,S,D]; and do.npy with --backward)\n"
            "                 instead of random inputs\n"
            "  --save DIR     write DIR/q.npy, k.npy, v.npy, o.npy (and do, dq, dk, dv) after the run\n"
            "  --help         this text\n"
            "\n"
            "exit codes: 0 ok, 1 check failed or CUDA error, 2 bad arguments, 3 unsupported shape,\n"
            "77 no CUDA device\n",
            program_name, program_name, STAGE.idea, TIME_BUDGET_S, MIN_TIMED_RUNS, INPUT_MEAN_MAX,
            INPUT_STD_MAX);
}

static void die_usage(const char *fmt, const char *arg) {
    fprintf(stderr, "%s: ", program_name);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n\n");
    usage(stderr);
    exit(EXIT_USAGE);
}

static long long parse_integer(const char *flag, const char *text, long long min, long long max) {
    if (!text) die_usage("%s needs a value", flag);
    char *end;
    errno = 0;
    long long value = strtoll(text, &end, 10);
    if (errno || end == text || *end != '\0' || value < min || value > max) {
        fprintf(stderr, "%s: %s must be an integer in [%lld, %lld], got '%s'\n\n", program_name, flag,
                min, max, text);
        usage(stderr);
        exit(EXIT_USAGE);
    }
    return value;
}

// --mean and --std: "T=X" for an input tensor T (q, k, v or do) and a number X in [min, max],
// stored in values[T].
static void parse_tensor_value(const char *flag, const char *text, double min, double max, double values[]) {
    if (!text) die_usage("%s needs a value", flag);
    for (int t = T_Q; t <= T_DO; t++) {
        const size_t n = strlen(TENSOR_NAMES[t]);
        if (t == T_O || strncmp(text, TENSOR_NAMES[t], n) != 0 || text[n] != '=') continue;
        char *end;
        errno = 0;
        const double value = strtod(text + n + 1, &end);
        if (errno || end == text + n + 1 || *end != '\0' || !(value >= min && value <= max)) break;
        values[t] = value;
        return;
    }
    fprintf(stderr, "%s: %s takes T=X with T one of q, k, v, do and X a number in [%g, %g], got '%s'\n\n",
            program_name, flag, min, max, text);
    usage(stderr);
    exit(EXIT_USAGE);
}

static int parse_dtype(const char *text) {
    for (int t = 0; t < 2; t++)
        if (text && !strcmp(text, DTYPE_NAMES[t])) return t;
    fprintf(stderr, "%s: --dtype takes fp16 or bf16, got '%s'\n\n", program_name, text ? text : "(nothing)");
    usage(stderr);
    exit(EXIT_USAGE);
}

static int parse_layout(const char *text) {
    if (text && !strcmp(text, "bhsd")) return 0;
    if (text && !strcmp(text, "bshd")) return 1;
    die_usage("--layout must be bhsd or bshd, got '%s'", text ? text : "");
    return 0;
}

static options parse_options(int argc, char **argv) {
    options opt = {.shape = {.batch = 1, .heads = 8, .seq = 512, .dim = 64, .causal = 0},
                   .iters = 30,
                   .warmup = 3,
                   .seed = 1,
                   .mean = {0, 0, 0, 0, 0},
                   .std = {1, 1, 1, 1, 1}};
    int shaped = 0;  // --mean, --std or --outliers given
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *next = i + 1 < argc ? argv[i + 1] : NULL;
        // B, H and S are limited together: at most INT_MAX elements per tensor (shape_refusal).
        if (!strcmp(a, "--batch")) opt.shape.batch = (int)parse_integer(a, next, 1, INT_MAX), i++;
        else if (!strcmp(a, "--heads")) opt.shape.heads = (int)parse_integer(a, next, 1, INT_MAX), i++;
        else if (!strcmp(a, "--seq")) opt.shape.seq = (int)parse_integer(a, next, 1, INT_MAX), i++;
        else if (!strcmp(a, "--dim")) opt.shape.dim = (int)parse_integer(a, next, 1, 1024), i++;
        else if (!strcmp(a, "--iters")) opt.iters = (int)parse_integer(a, next, 1, 100000), i++;
        else if (!strcmp(a, "--warmup")) opt.warmup = (int)parse_integer(a, next, 0, 100000), i++;
        else if (!strcmp(a, "--seed")) opt.seed = (unsigned long long)parse_integer(a, next, 0, LLONG_MAX), i++;
        else if (!strcmp(a, "--mean")) parse_tensor_value(a, next, -INPUT_MEAN_MAX, INPUT_MEAN_MAX, opt.mean), shaped = 1, i++;
        else if (!strcmp(a, "--std")) parse_tensor_value(a, next, 0x1p-24, INPUT_STD_MAX, opt.std), shaped = 1, i++;
        else if (!strcmp(a, "--causal")) opt.shape.causal = 1;
        else if (!strcmp(a, "--outliers")) opt.outliers = 1, shaped = 1;
        else if (!strcmp(a, "--dtype")) opt.shape.dtype = parse_dtype(next), i++;
        else if (!strcmp(a, "--layout")) opt.seq_major = parse_layout(next), i++;
        else if (!strcmp(a, "--kv-heads")) opt.shape.kv_heads = (int)parse_integer(a, next, 1, INT_MAX), i++;
        else if (!strcmp(a, "--kv-seq")) opt.shape.kv_seq = (int)parse_integer(a, next, 1, INT_MAX), i++;
        else if (!strcmp(a, "--check")) { /* the default: every run is checked */ }
        else if (!strcmp(a, "--bench")) opt.bench = 1;
        else if (!strcmp(a, "--backward")) opt.backward = 1;
        else if (!strcmp(a, "--csv") || !strcmp(a, "--load") || !strcmp(a, "--save")) {
            if (!next) die_usage("%s needs a value", a);
            if (!strcmp(a, "--csv")) opt.csv_path = next;
            else if (!strcmp(a, "--load")) opt.load_dir = next;
            else opt.save_dir = next;
            i++;
        } else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            exit(0);
        } else {
            die_usage("unknown argument '%s'", a);
        }
    }
    if (opt.csv_path && !opt.bench) die_usage("%s needs --bench (it records timings)", "--csv");
    if (shaped && opt.load_dir)
        die_usage("%s reads its inputs; --mean, --std and --outliers shape generated ones only", "--load");
    if (attn_kv_differs(&opt.shape) && (opt.load_dir || opt.save_dir || opt.csv_path))
        die_usage("%s takes Q, K and V of one shape; leave out --kv-heads and --kv-seq",
                  opt.load_dir ? "--load" : opt.save_dir ? "--save" : "--csv");
    if (opt.seq_major && opt.csv_path)
        die_usage("%s records [B, H, S, D] runs only; leave out --layout bshd", "--csv");
    if (opt.shape.dtype != ATTN_FP16 && (opt.load_dir || opt.save_dir))
        die_usage("%s reads and writes fp16 .npy files (NumPy has no bf16); leave out --dtype bf16",
                  opt.load_dir ? "--load" : "--save");
    return opt;
}

// ---------------------------------------------------------------------------------------------
// Inputs: N(mean, std^2) (by default N(0, 1)) by Box-Muller from a counter-based hash, so element
// i of a tensor is the same for a given seed whatever the thread count; then rounded to the dtype.

static uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// N(mean, std^2) by Box-Muller from the bits of one hash: element i's value depends on the seed,
// the tensor and i alone.
static double normal_of(uint64_t bits) {
    double u1 = ((double)(bits >> 40) + 1.0) / 16777217.0;         // (0, 1]
    double u2 = (double)(bits & 0xffffffull) / 16777216.0;          // [0, 1)
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

// With `outliers`, an element also gets N(0, 100) (standard deviation 10) with probability 0.001.
static void fill_normal(uint16_t *dst, size_t n, int dtype, uint64_t seed, uint64_t tensor, double mean, double std,
                        int outliers) {
    const uint64_t key = splitmix64(seed ^ splitmix64(tensor));
    OMP_PARALLEL_FOR
    for (long long i = 0; i < (long long)n; i++) {
        double x = mean + std * normal_of(splitmix64(key + (uint64_t)i));
        if (outliers) {
            const uint64_t extra = splitmix64(~key + (uint64_t)i);
            if ((double)(extra >> 11) / 9007199254740992.0 < 0.001) x += 10.0 * normal_of(splitmix64(extra));
        }
        dst[i] = float_to_elem((float)x, dtype);
    }
}

static void widen(const uint16_t *src, float *dst, size_t n, int dtype) {
    OMP_PARALLEL_FOR
    for (long long i = 0; i < (long long)n; i++) dst[i] = elem_to_float(src[i], dtype);
}

static void *xmalloc(size_t bytes) {
    void *p = malloc(bytes);
    if (!p) {
        fprintf(stderr, "%s: out of host memory (%zu bytes)\n", program_name, bytes);
        exit(EXIT_CHECK_FAILED);
    }
    return p;
}

static void load_inputs(const char *dir, int backward, attn_shape *shape, uint16_t *host[]) {
    int first[4];
    for (int t = 0; t <= T_DO; t++) {
        if (t == T_O || (t == T_DO && !backward)) continue;
        char path[4096], error[4352];
        int dims[4];
        snprintf(path, sizeof path, "%s/%s.npy", dir, TENSOR_NAMES[t]);
        if (npy_read_f16_4d(path, dims, &host[t], error, sizeof error) != 0) {
            fprintf(stderr, "%s: --load: %s\n", program_name, error);
            exit(EXIT_USAGE);
        }
        if (t == 0) memcpy(first, dims, sizeof first);
        else if (memcmp(first, dims, sizeof first) != 0) {
            fprintf(stderr, "%s: --load: %s has shape [%d,%d,%d,%d] but q.npy has [%d,%d,%d,%d]\n",
                    program_name, path, dims[0], dims[1], dims[2], dims[3], first[0], first[1],
                    first[2], first[3]);
            exit(EXIT_USAGE);
        }
        // A NaN or Inf input makes the reference NaN too; refuse it here rather than blame the kernel.
        const attn_shape dims_shape = {.batch = dims[0], .heads = dims[1], .seq = dims[2], .dim = dims[3]};
        if (check_inputs_finite(&dims_shape, host[t], path, error, sizeof error) != 0) {
            fprintf(stderr, "%s: --load: %s\n", program_name, error);
            exit(EXIT_USAGE);
        }
    }
    if (first[3] > 1024) {
        fprintf(stderr, "%s: --load: shape [%d,%d,%d,%d] is out of range (D <= 1024)\n",
                program_name, first[0], first[1], first[2], first[3]);
        exit(EXIT_USAGE);
    }
    shape->batch = first[0], shape->heads = first[1], shape->seq = first[2], shape->dim = first[3];
}

// --layout bshd: the device holds each tensor as [B, S, H, D], the kernels read it through
// strides, and the host's copies (inputs, reference, checks) stay [B, H, S, D].
static int tensor_is_kv(int t) { return t == T_K || t == T_V || t == T_DK || t == T_DV; }

static attn_strides seq_major_strides(const attn_shape *s, int t) {
    const long long H = tensor_is_kv(t) ? attn_kv_heads(s) : s->heads, S = tensor_is_kv(t) ? attn_kv_seq(s) : s->seq;
    const attn_strides st = {S * H * s->dim, s->dim, H * s->dim};
    return st;
}

// dst = src with its head and row axes swapped: [B, H, S, D] to [B, S, H, D] (to_seq_major), or back.
static void swap_heads_and_rows(uint16_t *dst, const uint16_t *src, const attn_shape *s, int t, int to_seq_major) {
    const size_t H = tensor_is_kv(t) ? attn_kv_heads(s) : s->heads, S = tensor_is_kv(t) ? attn_kv_seq(s) : s->seq;
    const size_t D = s->dim;
    for (size_t b = 0; b < (size_t)s->batch; b++)
        for (size_t h = 0; h < H; h++)
            for (size_t r = 0; r < S; r++) {
                const size_t bhsd = ((b * H + h) * S + r) * D, bshd = ((b * S + r) * H + h) * D;
                memcpy(dst + (to_seq_major ? bshd : bhsd), src + (to_seq_major ? bhsd : bshd), D * sizeof(uint16_t));
            }
}

// Tensor t's host copy to the device and back, in the run's layout.
static void upload(void *device, const uint16_t *host, size_t n, const attn_shape *s, int t, int seq_major) {
    if (!seq_major) {
        CUDA_CHECK(cudaMemcpy(device, host, 2 * n, cudaMemcpyHostToDevice));
        return;
    }
    uint16_t *swapped = xmalloc(2 * n);
    swap_heads_and_rows(swapped, host, s, t, 1);
    CUDA_CHECK(cudaMemcpy(device, swapped, 2 * n, cudaMemcpyHostToDevice));
    free(swapped);
}

static void download(uint16_t *host, const void *device, size_t n, const attn_shape *s, int t, int seq_major) {
    if (!seq_major) {
        CUDA_CHECK(cudaMemcpy(host, device, 2 * n, cudaMemcpyDeviceToHost));
        return;
    }
    uint16_t *swapped = xmalloc(2 * n);
    CUDA_CHECK(cudaMemcpy(swapped, device, 2 * n, cudaMemcpyDeviceToHost));
    swap_heads_and_rows(host, swapped, s, t, 0);
    free(swapped);
}

static void save_tensors(const char *dir, const attn_shape *s, uint16_t *const host[], int count) {
    const int dims[4] = {s->batch, s->heads, s->seq, s->dim};
    for (int t = 0; t < count; t++) {
        char path[4096], error[4352];
        snprintf(path, sizeof path, "%s/%s.npy", dir, TENSOR_NAMES[t]);
        if (npy_write_f16_4d(path, dims, host[t], error, sizeof error) != 0) {
            fprintf(stderr, "%s: --save: %s\n", program_name, error);
            exit(EXIT_USAGE);
        }
    }
    printf("saved %s in %s\n", count > T_O + 1 ? "q, k, v, o, do, dq, dk, dv (.npy)" : "q, k, v, o (.npy)", dir);
}

// ---------------------------------------------------------------------------------------------
// Running and timing.

typedef cudaError_t (*attn_pass)(const attn_shape *shape, const attn_tensors *t, cudaStream_t stream);

static void run_pass(attn_pass pass, const attn_shape *shape, const attn_tensors *t, cudaStream_t stream) {
    cudaError_t err = pass(shape, t, stream);
    if (err != cudaSuccess) {
        fprintf(stderr, "%s: launch failed: %s\n", program_name, cudaGetErrorString(err));
        exit(EXIT_CHECK_FAILED);
    }
}

static int compare_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

typedef struct {
    double median_us, min_us, max_us;
    int runs;
} timing;

// How many of the `n` bytes at device address `device` differ from `host`.
static size_t bytes_changed(const unsigned char *host, const void *device, size_t n) {
    unsigned char *now = xmalloc(n);
    CUDA_CHECK(cudaMemcpy(now, device, n, cudaMemcpyDeviceToHost));
    size_t changed = 0;
    for (size_t i = 0; i < n; i++) changed += now[i] != host[i];
    free(now);
    return changed;
}

// Times `pass` (the forward, or the backward after one forward has filled O and the workspace).
static timing time_pass(attn_pass pass, const options *opt, const attn_tensors *t,
                        const struct cudaDeviceProp *prop, cudaStream_t stream) {
    // Writing a buffer twice the L2's size before each run evicts Q, K, V and O from L2, so every
    // run reads its inputs from HBM, as it would inside a model.
    size_t flush_bytes = 2 * (size_t)prop->l2CacheSize;
    void *flush;
    CUDA_CHECK(cudaMalloc(&flush, flush_bytes));
    cudaEvent_t start, stop;
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));

    float elapsed_ms, timed_ms = 0.0f;
    for (int i = 0; i < opt->warmup && timed_ms < 1000.0f * TIME_BUDGET_S / 4; i++) {
        CUDA_CHECK(cudaEventRecord(start, stream));
        run_pass(pass, &opt->shape, t, stream);
        CUDA_CHECK(cudaEventRecord(stop, stream));
        CUDA_CHECK(cudaEventSynchronize(stop));
        CUDA_CHECK(cudaEventElapsedTime(&elapsed_ms, start, stop));
        timed_ms += elapsed_ms;
    }

    float *samples_ms = xmalloc(sizeof(float) * (size_t)opt->iters);
    int runs = 0;
    timed_ms = 0.0f;
    while (runs < opt->iters && (runs < MIN_TIMED_RUNS || timed_ms < 1000.0f * TIME_BUDGET_S)) {
        CUDA_CHECK(cudaMemsetAsync(flush, runs & 0xff, flush_bytes, stream));
        CUDA_CHECK(gpu_spin(stream, SPIN_CYCLES));
        CUDA_CHECK(cudaEventRecord(start, stream));
        run_pass(pass, &opt->shape, t, stream);
        CUDA_CHECK(cudaEventRecord(stop, stream));
        CUDA_CHECK(cudaEventSynchronize(stop));
        CUDA_CHECK(cudaEventElapsedTime(&samples_ms[runs], start, stop));
        timed_ms += samples_ms[runs++];
    }
    CUDA_CHECK(cudaGetLastError());

    qsort(samples_ms, (size_t)runs, sizeof(float), compare_float);
    double median = runs % 2 ? samples_ms[runs / 2]
                             : 0.5 * (samples_ms[runs / 2 - 1] + samples_ms[runs / 2]);
    timing result = {1e3 * median, 1e3 * samples_ms[0], 1e3 * samples_ms[runs - 1], runs};
    free(samples_ms);
    CUDA_CHECK(cudaEventDestroy(start));
    CUDA_CHECK(cudaEventDestroy(stop));
    CUDA_CHECK(cudaFree(flush));
    return result;
}

// One row per measurement; the header is written when the file is new or empty. The peer script
// (plots/peers.py) writes the same columns.
#define CSV_HEADER \
    "gpu,stage,batch,heads,seq,dim,causal,direction,median_us,tflops,gbps,max_abs_err,runs,commit,min_us,max_us,dtype\n"

static void append_csv(const char *path, const char *gpu, const attn_shape *s, const char *direction,
                       const timing *tm, double tflops, double gbps, double max_abs_err) {
    FILE *f = fopen(path, "a");
    if (!f) {
        fprintf(stderr, "%s: cannot append to %s: %s\n", program_name, path, strerror(errno));
        exit(EXIT_USAGE);
    }
    fseek(f, 0, SEEK_END);
    if (ftell(f) == 0) fputs(CSV_HEADER, f);
    const char *commit = getenv("FLASH_STAGES_COMMIT");
    fprintf(f, "%s,%s,%d,%d,%d,%d,%d,%s,%.3f,%.3f,%.1f,%.3e,%d,%s,%.3f,%.3f,%s\n", gpu, program_name, s->batch,
            s->heads, s->seq, s->dim, s->causal, direction, tm->median_us, tflops, gbps, max_abs_err, tm->runs,
            commit && *commit ? commit : FLASH_STAGES_GIT_COMMIT, tm->min_us, tm->max_us, DTYPE_NAMES[s->dtype]);
    fclose(f);
}

static void report_timing(const options *opt, const char *gpu, const char *direction, const timing *tm,
                          double flops, double bytes, double max_abs_err) {
    const double seconds = tm->median_us * 1e-6;
    const double tflops = flops / seconds * 1e-12, gbps = bytes / seconds * 1e-9;
    printf("time%s: median %.1f us over %d runs (min %.1f, max %.1f): %.2f TFLOP/s, %.0f GB/s\n",
           strcmp(direction, "fwd") ? " (backward)" : "", tm->median_us, tm->runs, tm->min_us,
           tm->max_us, tflops, gbps);
    if (opt->csv_path) append_csv(opt->csv_path, gpu, &opt->shape, direction, tm, tflops, gbps, max_abs_err);
}

// Refusals that need no GPU: a backward the stage lacks, a shape or layout it cannot run (after
// --load has set the shape). Returns the exit status, or 0 to go on.
static int refuse_before_device(options *opt, uint16_t *host[]) {
    if (opt->backward && !STAGE.backward) {
        fprintf(stderr, "%s: --backward: this stage has a forward pass only (a stage with a backward.cu has both)\n",
                program_name);
        return EXIT_UNSUPPORTED;
    }
    if (opt->load_dir) load_inputs(opt->load_dir, opt->backward, &opt->shape, host);
    char refusal[512];
    if (shape_refusal(&STAGE, program_name, &opt->shape, refusal, sizeof refusal)) {
        fprintf(stderr, "%s\n", refusal);
        return EXIT_UNSUPPORTED;
    }
    if (opt->seq_major && !STAGE.runs_strided) {
        fprintf(stderr, "%s: this stage's kernels read contiguous [B, H, S, D] tensors only; leave out --layout bshd\n",
                program_name);
        return EXIT_UNSUPPORTED;
    }
    return 0;
}

// The GPU: none (skipped, 77), another generation than the stage's code (skipped, 77, not failed),
// or less shared memory per block than the stage asks for (a sentence, as for an unsupported
// shape, 3). Fills `prop` and the GPU's name as the CSV writes it. Returns the exit status, or 0.
static int find_gpu(const attn_shape *shape, struct cudaDeviceProp *prop, char gpu[], size_t gpu_size) {
    int devices = 0;
    cudaError_t device_err = cudaGetDeviceCount(&devices);
    if (device_err != cudaSuccess || devices == 0) {
        printf("SKIPPED: no CUDA device (%s)\n",
               device_err != cudaSuccess ? cudaGetErrorString(device_err) : "none found");
        return EXIT_NO_GPU;
    }
    CUDA_CHECK(cudaGetDeviceProperties(prop, 0));
    char refusal[512];
    const gpu_info gpu_here = {prop->name, prop->major, prop->minor, prop->sharedMemPerBlockOptin};
    switch (gpu_refusal(&STAGE, program_name, shape, &gpu_here, refusal, sizeof refusal)) {
    case REFUSED_GPU: printf("SKIPPED: %s\n", refusal); return EXIT_NO_GPU;
    case REFUSED_SHAPE: fprintf(stderr, "%s\n", refusal); return EXIT_UNSUPPORTED;
    default: break;
    }
    snprintf(gpu, gpu_size, "%s", prop->name);
    for (char *c = gpu; *c; c++)
        if (*c == ',') *c = ' ';  // keep the CSV parseable
    return 0;
}

// The run's first line: program, GPU, shape, type and what is run.
static void print_run(const options *opt, const char *gpu) {
    const attn_shape *shape = &opt->shape;
    char kv[64] = "";
    if (attn_kv_differs(shape)) snprintf(kv, sizeof kv, " H_kv=%d S_kv=%d", attn_kv_heads(shape), attn_kv_seq(shape));
    char fp8[96] = "";
    if (shape->fp8)
        snprintf(fp8, sizeof fp8, " (e4m3 products: %s%s)",
                 shape->fp8 & ATTN_FP8_BLOCK_SCALES ? "a scale per 128 rows" : "one scale per tensor",
                 shape->fp8 & ATTN_FP8_HADAMARD ? ", Q and K rotated" : "");
    printf("%s on %s: B=%d H=%d S=%d D=%d%s %s%s %s%s%s\n", program_name, gpu, shape->batch, shape->heads,
           shape->seq, shape->dim, kv, DTYPE_NAMES[shape->dtype], fp8, shape->causal ? "causal" : "non-causal",
           opt->backward ? ", forward and backward" : "", opt->outliers ? ", inputs with outliers" : "");
}

// The run's tensors: host copies (fp16 or bf16 bits, in TENSOR_NAMES order, and float copies of
// the inputs for the reference), device buffers, and the stage's own device memory.
typedef struct {
    int n_tensors;               // q, k, v, o, and for the backward do, dq, dk, dv
    size_t elems[N_TENSORS];     // Q, O, dO and dQ are [B, H, S, D]; K, V, dK and dV [B, H_kv, S_kv, D]
    uint16_t *host[N_TENSORS];
    float *f32[N_TENSORS];
    void *dev_ptr[N_TENSORS];
    attn_tensors dev;
    size_t workspace;            // what the forward leaves the backward (or its own temporaries)
    size_t scratch;              // the backward's own scratch
    size_t forward_scratch;
} buffers;

// Sizes every tensor, refuses a run that would not fit in device memory (3), fills the inputs not
// loaded with random values, and allocates and uploads. Returns the exit status, or 0.
static int allocate_buffers(const options *opt, const struct cudaDeviceProp *prop, buffers *b) {
    const attn_shape *shape = &opt->shape;
    b->n_tensors = opt->backward ? N_TENSORS : T_O + 1;
    const size_t n = attn_elems(shape), n_kv = attn_kv_elems(shape);
    for (int t = 0; t < N_TENSORS; t++) b->elems[t] = tensor_is_kv(t) ? n_kv : n;
    b->workspace = STAGE.workspace_bytes(shape);
    b->scratch = opt->backward && STAGE.backward_scratch_bytes ? STAGE.backward_scratch_bytes(shape) : 0;
    b->forward_scratch = STAGE.forward_scratch_bytes ? STAGE.forward_scratch_bytes(shape) : 0;
    size_t free_bytes, total_bytes;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    double tensor_bytes = 0.0;
    for (int t = 0; t < b->n_tensors; t++) tensor_bytes += 2.0 * b->elems[t];
    const double need = tensor_bytes + b->workspace + b->scratch + b->forward_scratch + 2.0 * prop->l2CacheSize;
    if (need > 0.9 * free_bytes) {
        fprintf(stderr, "%s: skipped: needs %.1f GiB of device memory, %.1f GiB free\n", program_name,
                need / 1073741824.0, free_bytes / 1073741824.0);
        return EXIT_UNSUPPORTED;
    }
    for (int t = 0; t < b->n_tensors; t++) {
        if (b->host[t]) continue;  // loaded
        b->host[t] = xmalloc(2 * b->elems[t]);
        if (t <= T_V || t == T_DO)
            fill_normal(b->host[t], b->elems[t], shape->dtype, opt->seed, (uint64_t)t, opt->mean[t], opt->std[t],
                        opt->outliers && t <= T_V);
    }
    for (int t = 0; t < b->n_tensors; t++) {
        CUDA_CHECK(cudaMalloc(&b->dev_ptr[t], 2 * b->elems[t]));
        if (t <= T_V || t == T_DO) upload(b->dev_ptr[t], b->host[t], b->elems[t], shape, t, opt->seq_major);
    }
    attn_tensors *dev = &b->dev;
    dev->q = b->dev_ptr[T_Q], dev->k = b->dev_ptr[T_K], dev->v = b->dev_ptr[T_V], dev->o = b->dev_ptr[T_O];
    dev->d_o = b->dev_ptr[T_DO], dev->dq = b->dev_ptr[T_DQ], dev->dk = b->dev_ptr[T_DK], dev->dv = b->dev_ptr[T_DV];
    if (opt->seq_major) {
        attn_strides *strides[N_TENSORS] = {&dev->q_strides,   &dev->k_strides,  &dev->v_strides,  &dev->o_strides,
                                            &dev->d_o_strides, &dev->dq_strides, &dev->dk_strides, &dev->dv_strides};
        for (int t = 0; t < N_TENSORS; t++) *strides[t] = seq_major_strides(shape, t);
    }
    if (b->workspace) CUDA_CHECK(cudaMalloc(&dev->workspace, b->workspace));
    if (b->scratch) CUDA_CHECK(cudaMalloc(&dev->backward_scratch, b->scratch));
    if (b->forward_scratch) CUDA_CHECK(cudaMalloc(&dev->forward_scratch, b->forward_scratch));
    for (int t = 0; t < b->n_tensors; t++) {
        if (t > T_V && t != T_DO) continue;
        b->f32[t] = xmalloc(b->elems[t] * sizeof(float));
        widen(b->host[t], b->f32[t], b->elems[t], shape->dtype);
    }
    return 0;
}

// The forward's check: poison O, run once, compare every element it should have written. The
// forward's scratch is poisoned too: a forward must not count on finding it zero.
static check_result check_forward_pass(const options *opt, buffers *b, cudaStream_t stream) {
    const attn_shape *shape = &opt->shape;
    CUDA_CHECK(cudaMemsetAsync(b->dev.o, 0xff, 2 * b->elems[T_O], stream));  // every element becomes HALF_POISON
    if (b->forward_scratch)
        CUDA_CHECK(cudaMemsetAsync(b->dev.forward_scratch, 0xff, b->forward_scratch, stream));
    run_pass(STAGE.forward, shape, &b->dev, stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    download(b->host[T_O], b->dev.o, b->elems[T_O], shape, T_O, opt->seq_major);
    check_result result = check_output(shape, b->f32[T_Q], b->f32[T_K], b->f32[T_V], b->host[T_O]);
    check_print(shape, &result);
    return result;
}

// The backward's check: poison the gradients and the scratch (a backward must not read scratch it
// has not written), run it once on the forward's O and workspace, compare; and the workspace must
// come back as the forward left it. Returns whether it passed.
static int check_backward_pass(const options *opt, buffers *b, cudaStream_t stream, check_bwd_result *result) {
    const attn_shape *shape = &opt->shape;
    for (int t = T_DQ; t <= T_DV; t++) CUDA_CHECK(cudaMemsetAsync(b->dev_ptr[t], 0xff, 2 * b->elems[t], stream));
    if (b->scratch) CUDA_CHECK(cudaMemsetAsync(b->dev.backward_scratch, 0xff, b->scratch, stream));
    // The workspace as the forward left it: the backward only reads it (attn.h), and PyTorch
    // hands the same workspace to every backward of one forward.
    unsigned char *forward_workspace = b->workspace ? xmalloc(b->workspace) : NULL;
    if (b->workspace)
        CUDA_CHECK(cudaMemcpy(forward_workspace, b->dev.workspace, b->workspace, cudaMemcpyDeviceToHost));
    run_pass(STAGE.backward, shape, &b->dev, stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    for (int t = T_DQ; t <= T_DV; t++) download(b->host[t], b->dev_ptr[t], b->elems[t], shape, t, opt->seq_major);
    const uint16_t *grads[3] = {b->host[T_DQ], b->host[T_DK], b->host[T_DV]};
    *result = check_backward(shape, b->f32[T_Q], b->f32[T_K], b->f32[T_V], b->f32[T_DO], grads);
    check_print_backward(shape, result);
    int passed = check_bwd_passed(result);
    if (b->workspace) {
        const size_t changed = bytes_changed(forward_workspace, b->dev.workspace, b->workspace);
        if (changed) {
            printf("check workspace: FAIL: the backward changed %zu of the %zu bytes the forward left it\n", changed,
                   b->workspace);
            passed = 0;
        }
        free(forward_workspace);
    }
    return passed;
}

// Times the pass that was checked and reports it (and appends it to --csv).
static void bench(const options *opt, const buffers *b, const struct cudaDeviceProp *prop, const char *gpu,
                  const check_result *fwd, const check_bwd_result *bwd, cudaStream_t stream) {
    const attn_shape *shape = &opt->shape;
    const double bytes = 2.0 * b->elems[T_Q], kv_bytes = 2.0 * b->elems[T_K];
    if (!opt->backward) {
        const timing tm = time_pass(STAGE.forward, opt, &b->dev, prop, stream);
        // Compulsory traffic only: Q, K, V read once and O written once.
        report_timing(opt, gpu, "fwd", &tm, attn_forward_flops(shape), 2.0 * bytes + 2.0 * kv_bytes,
                      fwd->max_abs_err);
    } else {
        const timing tm = time_pass(STAGE.backward, opt, &b->dev, prop, stream);
        const double worst = fmax(bwd->dq.max_abs_err, fmax(bwd->dk.max_abs_err, bwd->dv.max_abs_err));
        // Compulsory traffic: Q, K, V, O, dO read once; dQ, dK, dV written once.
        report_timing(opt, gpu, "bwd", &tm, attn_backward_flops(shape), 4.0 * bytes + 4.0 * kv_bytes, worst);
    }
}

static void free_buffers(buffers *b) {
    for (int t = 0; t < N_TENSORS; t++) {
        if (b->dev_ptr[t]) CUDA_CHECK(cudaFree(b->dev_ptr[t]));
        free(b->f32[t]);
        free(b->host[t]);
    }
    if (b->dev.workspace) CUDA_CHECK(cudaFree(b->dev.workspace));
    if (b->dev.backward_scratch) CUDA_CHECK(cudaFree(b->dev.backward_scratch));
    if (b->dev.forward_scratch) CUDA_CHECK(cudaFree(b->dev.forward_scratch));
}

// The program: refuse what cannot run, check the forward (and the backward) against the float64
// reference, and only then time the pass.
int main(int argc, char **argv) {
    set_program_name();
    options opt = parse_options(argc, argv);
    opt.shape.fp8 = STAGE.fp8;  // the checker's rule follows the stage's FP8 method
    buffers b = {0};
    int status = refuse_before_device(&opt, b.host);
    struct cudaDeviceProp prop;
    char gpu[sizeof prop.name];
    if (!status) status = find_gpu(&opt.shape, &prop, gpu, sizeof gpu);
    if (status) return status;
    print_run(&opt, gpu);
    if ((status = allocate_buffers(&opt, &prop, &b))) return status;
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreate(&stream));

    const check_result fwd = check_forward_pass(&opt, &b, stream);
    int passed = check_passed(&fwd);
    check_bwd_result bwd = {0};
    if (opt.backward && passed) passed = check_backward_pass(&opt, &b, stream, &bwd);
    if (opt.save_dir) save_tensors(opt.save_dir, &opt.shape, b.host, b.n_tensors);
    if (opt.bench && passed) bench(&opt, &b, &prop, gpu, &fwd, &bwd, stream);

    free_buffers(&b);
    CUDA_CHECK(cudaStreamDestroy(stream));
    return passed ? 0 : EXIT_CHECK_FAILED;
}
