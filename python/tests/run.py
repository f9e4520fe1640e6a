"""CTest's entry to the PyTorch op's tests: pytest over python/tests, against the build tree's
libraries (FLASH_STAGES_LIB_DIR). Exits 77 (CTest: skipped) where PyTorch, pytest or a CUDA GPU
is missing, so that a machine without them never counts the tests as passed."""

import pathlib
import sys

CHOOSE = ("CTest runs the first interpreter with PyTorch that CMake found (tests/CMakeLists.txt); configure with "
          "-DFLASH_STAGES_PYTHON=/path/to/python to choose one")
try:
    import torch
except ImportError:
    print(f"SKIPPED: PyTorch is not installed for {sys.executable}. {CHOOSE}")
    sys.exit(77)
try:
    import pytest
except ImportError:
    print(f"SKIPPED: pytest is not installed for {sys.executable}. {CHOOSE}")
    sys.exit(77)
if not torch.cuda.is_available():
    print("SKIPPED: no CUDA GPU")
    sys.exit(77)

here = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(here.parent))  # the flash_stages package of this source tree
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", str(here), *sys.argv[1:]]))
