#!/usr/bin/env python3
"""Measure the GPU's practical ceilings that the lessons compare against, through PyTorch:

- device-to-device copy bandwidth (bytes read + bytes written), 4 GiB;
- fp16 matrix product on the tensor cores (fp32 accumulation), 8192^3, through cuBLAS;
- fp32 matrix product on the CUDA cores (TF32 off), 8192^3: the ceiling for scalar fp32 stages.

Random inputs, CUDA events, warm-up, median of 20 runs. Writes CSV rows gpu,ceiling,value,unit,commit.
"""
import argparse
import os
import sys

from cuda_timing import median_ms, torch_on_gpu


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--csv", required=True)
    args = parser.parse_args()
    torch = torch_on_gpu("ceilings", "skipped")
    if torch is None:
        return 0
    gpu = torch.cuda.get_device_properties(0).name.replace(",", " ")
    commit = os.environ.get("FLASH_STAGES_COMMIT", "unknown")
    rows = []

    n = 1 << 31  # 2 Gi fp16 elements = 4 GiB
    src = torch.randn(n, device="cuda", dtype=torch.float16)
    dst = torch.empty_like(src)
    ms, _ = median_ms(lambda: dst.copy_(src), iters=20, min_runs=20)
    rows.append(("copy_bandwidth", 2 * src.numel() * 2 / (ms * 1e-3) / 1e9, "GB/s"))
    del src, dst

    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.float16)
    b = torch.randn(m, m, device="cuda", dtype=torch.float16)
    ms, _ = median_ms(lambda: a @ b, iters=20, min_runs=20)
    rows.append(("fp16_tensor_core_matmul", 2 * m**3 / (ms * 1e-3) / 1e12, "TFLOP/s"))

    torch.backends.cuda.matmul.allow_tf32 = False
    a, b = a.float(), b.float()
    ms, _ = median_ms(lambda: a @ b, iters=10, min_runs=10)
    rows.append(("fp32_simt_matmul", 2 * m**3 / (ms * 1e-3) / 1e12, "TFLOP/s"))

    new_file = not os.path.exists(args.csv) or os.path.getsize(args.csv) == 0
    with open(args.csv, "a") as f:
        if new_file:
            f.write("gpu,ceiling,value,unit,commit\n")
        for name, value, unit in rows:
            print(f"ceilings: {name:<25} {value:8.1f} {unit}")
            f.write(f"{gpu},{name},{value:.1f},{unit},{commit}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
