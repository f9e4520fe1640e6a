"""The stage libraries and the operators over them. One ``libflash_stages_<stage>.so`` per stage,
built by the project's CMake from the same objects as the stage's program, exports the
``attn_stage STAGE`` table of ``common/attn.h``; ``csrc/op.cpp`` calls its launchers as the
operators ``flash_stages::forward`` and ``flash_stages::backward``. No second implementation: the
harness and PyTorch call the same C. Python reads each table's name and flags here, through ctypes."""

import ctypes
import hashlib
import os
import pathlib
import sysconfig


class _StageTable(ctypes.Structure):
    """``attn_stage``, field for field (its functions as plain pointers: csrc/op.cpp calls them)."""

    _fields_ = [
        ("name", ctypes.c_char_p),
        ("idea", ctypes.c_char_p),
        ("unsupported", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_void_p),
        ("shared_bytes", ctypes.c_void_p),
        ("forward", ctypes.c_void_p),
        ("backward", ctypes.c_void_p),
        ("backward_scratch_bytes", ctypes.c_void_p),
        ("forward_scratch_bytes", ctypes.c_void_p),
        ("needs_sm90a", ctypes.c_int),
        ("runs_bf16", ctypes.c_int),
        ("runs_gqa", ctypes.c_int),
        ("runs_strided", ctypes.c_int),
        ("runs_kv_seq", ctypes.c_int),
        ("fp8", ctypes.c_int),
    ]


def library_dirs():
    """Where the libraries are looked for, in order: $FLASH_STAGES_LIB_DIR, the installed package's
    lib/ (pip install .), flash_stages/lib/ in the environment's site-packages (where an
    editable install, pip install -e ., puts them while the package itself stays in the
    source tree), and the source tree's build/lib/ (the README's build)."""
    here = pathlib.Path(__file__).resolve().parent
    site = pathlib.Path(sysconfig.get_paths()["platlib"]) / "flash_stages" / "lib"
    dirs = list(dict.fromkeys([here / "lib", site, here.parents[1] / "build" / "lib"]))
    if os.environ.get("FLASH_STAGES_LIB_DIR"):
        dirs.insert(0, pathlib.Path(os.environ["FLASH_STAGES_LIB_DIR"]))
    return dirs


def _check_mirror(lib, path):
    """The library's attn_stage is as large as its mirror here: a struct that gained a field on one
    side only would otherwise be misread (csrc/op.cpp checks the other structs with attn.h itself)."""
    try:
        size = (ctypes.c_size_t * 3).in_dll(lib, "flash_stages_struct_sizes")[0]
    except ValueError:  # the symbol is missing: a library built before the sizes were exported
        size = None
    if size != ctypes.sizeof(_StageTable):
        raise RuntimeError(f"flash_stages: {path} does not match flash_stages/_library.py (attn_stage: {size or 'unknown'} "
                           f"bytes in the library, {ctypes.sizeof(_StageTable)} in the mirror); rebuild the libraries "
                           f"from this source tree, or update the mirror of common/attn.h")


class Stage:
    """One stage's library: its name, idea and flags (attn_stage)."""

    def __init__(self, path):
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        _check_mirror(self._lib, path)
        table = _StageTable.in_dll(self._lib, "STAGE")
        self.name = table.name.decode()
        self.idea = table.idea.decode()
        self.has_backward = bool(table.backward)
        self.needs_sm90a = bool(table.needs_sm90a)
        self.runs_bf16 = bool(table.runs_bf16)
        self.runs_gqa = bool(table.runs_gqa)
        self.runs_strided = bool(table.runs_strided)
        self.runs_kv_seq = bool(table.runs_kv_seq)
        self.fp8 = table.fp8  # ATTN_FP8 | ...: products in e4m3 (common/attn.h)


_stages = None


def load_stages():
    """Every stage library found, by name, in course order (the first directory that has any wins)."""
    global _stages
    if _stages is None:
        _stages = {}
        for directory in library_dirs():
            paths = sorted(directory.glob("libflash_stages_*.so"))
            if paths:
                for path in paths:
                    stage = Stage(path)
                    _stages[stage.name] = stage
                break
    return _stages


def load_operators():
    """Registers the operators flash_stages::forward and flash_stages::backward (csrc/op.cpp) and
    hands them every stage library found. torch.utils.cpp_extension builds op.cpp for this PyTorch
    the first time (some seconds; it needs a C++ compiler, ninja and the CUDA toolkit's headers, as
    the stage libraries did) and keeps the build under $TORCH_EXTENSIONS_DIR or
    ~/.cache/torch_extensions, where later imports find it."""
    from torch.utils import cpp_extension

    here = pathlib.Path(__file__).resolve().parent
    # attn.h: beside op.cpp in an installed package (CMakeLists.txt puts it there), in common/ in
    # the source tree.
    headers = next((d for d in (here / "csrc", here.parents[1] / "common") if (d / "attn.h").is_file()), None)
    if headers is None:
        raise ImportError(f"flash_stages: common/attn.h not found beside {here / 'csrc'} or in the source tree")
    # The build is redone when op.cpp or its arguments change; attn.h's hash among them makes a
    # change to the header count too.
    header_hash = hashlib.sha256((headers / "attn.h").read_bytes()).hexdigest()[:16]
    try:
        path = cpp_extension.load(name="flash_stages_op", sources=[str(here / "csrc" / "op.cpp")],
                                  extra_include_paths=[str(headers)],
                                  extra_cflags=["-O2", f"-DFLASH_STAGES_ATTN_H_HASH={header_hash}"], with_cuda=True,
                                  is_python_module=False)
    except Exception as error:
        raise ImportError(f"flash_stages: cannot build its operators ({here / 'csrc' / 'op.cpp'}), which needs a C++ "
                          f"compiler, ninja and the CUDA toolkit: {error}") from error
    operators = ctypes.CDLL(path)
    operators.flash_stages_op_add_stage.argtypes = [ctypes.c_char_p]
    operators.flash_stages_op_add_stage.restype = ctypes.c_char_p
    for stage in load_stages().values():
        error = operators.flash_stages_op_add_stage(str(stage.path).encode())
        if error:
            raise ImportError(f"flash_stages: {error.decode()}")
