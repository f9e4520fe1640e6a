"""The stages' launchers, through ctypes: one ``libflash_stages_<stage>.so`` per stage, built by the
project's CMake from the same objects as the stage's program, each exporting the ``attn_stage STAGE``
table of ``common/attn.h``. No second implementation: the harness and PyTorch call the same C."""

import ctypes
import os
import pathlib
import sysconfig


class Shape(ctypes.Structure):
    """``attn_shape``: one attention problem, tensors ``[batch, heads, seq, dim]``."""

    _fields_ = [(name, ctypes.c_int) for name in ("batch", "heads", "seq", "dim", "causal", "dtype", "kv_heads",
                                                  "kv_seq")]


class Strides(ctypes.Structure):
    """``attn_strides``: where a tensor's rows lie, in elements (all three 0: contiguous [B, H, S, D])."""

    _fields_ = [(name, ctypes.c_longlong) for name in ("batch", "head", "row")]


class Tensors(ctypes.Structure):
    """``attn_tensors``, field for field: device pointers (NULL where unused), then each tensor's
    strides (all zero: contiguous)."""

    _fields_ = ([(name, ctypes.c_void_p)
                 for name in ("q", "k", "v", "o", "workspace", "d_o", "dq", "dk", "dv", "backward_scratch",
                              "forward_scratch")]
                + [(name + "_strides", Strides) for name in ("q", "k", "v", "o", "d_o", "dq", "dk", "dv")])


_UNSUPPORTED = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.POINTER(Shape))
_BYTES = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.POINTER(Shape))
_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Shape), ctypes.POINTER(Tensors), ctypes.c_void_p)


class _StageTable(ctypes.Structure):
    """``attn_stage``, field for field."""

    _fields_ = [
        ("name", ctypes.c_char_p),
        ("idea", ctypes.c_char_p),
        ("unsupported", _UNSUPPORTED),
        ("workspace_bytes", _BYTES),
        ("shared_bytes", _BYTES),
        ("forward", _LAUNCH),
        ("backward", _LAUNCH),
        ("backward_scratch_bytes", _BYTES),
        ("forward_scratch_bytes", _BYTES),
        ("needs_sm90a", ctypes.c_int),
        ("runs_bf16", ctypes.c_int),
        ("runs_gqa", ctypes.c_int),
        ("runs_strided", ctypes.c_int),
        ("runs_kv_seq", ctypes.c_int),
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
    """The library's attn_stage, attn_tensors and attn_shape are as large as their mirrors here: a
    struct that gained a field on one side only would otherwise be misread, pointers taken for
    sizes or K/V lengths for heads."""
    mirrors = (ctypes.sizeof(_StageTable), ctypes.sizeof(Tensors), ctypes.sizeof(Shape))
    try:
        sizes = tuple((ctypes.c_size_t * 3).in_dll(lib, "flash_stages_struct_sizes"))
    except ValueError:  # the symbol is missing: a library built before the sizes were exported
        sizes = None
    if sizes != mirrors:
        raise RuntimeError(f"flash_stages: {path} does not match flash_stages/_library.py (attn_stage, attn_tensors, "
                           f"attn_shape: {sizes or 'unknown'} bytes in the library, {mirrors} in the mirror); rebuild the "
                           f"libraries from this source tree, or update the mirror of common/attn.h")


class Stage:
    """One stage's library: its table and the helpers its CUDA runtime answers."""

    def __init__(self, path):
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        _check_mirror(self._lib, path)
        self._table = _StageTable.in_dll(self._lib, "STAGE")
        self.name = self._table.name.decode()
        self.idea = self._table.idea.decode()
        self.has_backward = bool(self._table.backward)
        self.needs_sm90a = bool(self._table.needs_sm90a)
        self.runs_bf16 = bool(self._table.runs_bf16)
        self.runs_gqa = bool(self._table.runs_gqa)
        self.runs_strided = bool(self._table.runs_strided)
        self.runs_kv_seq = bool(self._table.runs_kv_seq)
        # The launchers, read out of the table once: each read of a function field builds a new
        # ctypes object, and a training step launches many times.
        self._forward, self._backward = self._table.forward, self._table.backward
        lib = self._lib
        lib.flash_stages_set_device.argtypes, lib.flash_stages_set_device.restype = [ctypes.c_int], ctypes.c_int
        lib.flash_stages_error_string.argtypes, lib.flash_stages_error_string.restype = [ctypes.c_int], ctypes.c_char_p
        lib.flash_stages_refusal.argtypes = [ctypes.POINTER(Shape), ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        lib.flash_stages_refusal.restype = ctypes.c_int

    def workspace_bytes(self, shape):
        """Bytes the forward writes and the backward reads (the row log-sum-exp)."""
        return int(self._table.workspace_bytes(ctypes.byref(shape)))

    def backward_scratch_bytes(self, shape):
        """Bytes the backward needs for itself (0 where the stage has none)."""
        return self._optional_bytes(self._table.backward_scratch_bytes, shape)

    def forward_scratch_bytes(self, shape):
        """Bytes the forward needs for itself during the call (0 where the stage has none)."""
        return self._optional_bytes(self._table.forward_scratch_bytes, shape)

    @staticmethod
    def _optional_bytes(size_function, shape):
        # A size function the stage leaves NULL (a stage without that scratch) means 0 bytes.
        return int(size_function(ctypes.byref(shape))) if size_function else 0

    def why_not(self, shape, device_index):
        """None when this stage runs `shape` on the device, else the sentence the harness prints: the
        library decides, with the harness's own check (common/stage_check.c)."""
        message = ctypes.create_string_buffer(512)
        if self._lib.flash_stages_refusal(ctypes.byref(shape), device_index, message, len(message)):
            return message.value.decode()
        return None

    def forward(self, shape, tensors, device_index, stream):
        self._launch(self._forward, "forward", shape, tensors, device_index, stream)

    def backward(self, shape, tensors, device_index, stream):
        self._launch(self._backward, "backward", shape, tensors, device_index, stream)

    def _set_device(self, device_index):
        # The library has its own CUDA runtime, with its own current device.
        error = self._lib.flash_stages_set_device(device_index)
        if error:
            raise RuntimeError(f"{self.name}: cannot select CUDA device {device_index}: "
                               f"{self._lib.flash_stages_error_string(error).decode()}")

    def _launch(self, launcher, direction, shape, tensors, device_index, stream):
        self._set_device(device_index)
        error = launcher(ctypes.byref(shape), ctypes.byref(tensors), ctypes.c_void_p(stream))
        if error:
            raise RuntimeError(f"{self.name}: {direction} launch failed: "
                               f"{self._lib.flash_stages_error_string(error).decode()}")


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
