"""``pb_utils.Tensor`` and the dtype helpers."""
from __future__ import annotations

from typing import Any

import ctypes

import numpy as np

from tritonpy.shm import cuda
from tritonpy.shm.dtypes import BFLOAT16

from ._pberrors import TritonModelException

TRITON_STRING_TO_NUMPY: dict[str, Any] = {
    "TYPE_BOOL": bool,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}
# ModelConfig DataType enum values, which is what Triton's helpers speak.
_CODE_TO_NUMPY: dict[int, Any] = {
    1: np.bool_, 2: np.uint8, 3: np.uint16, 4: np.uint32, 5: np.uint64, 6: np.int8,
    7: np.int16, 8: np.int32, 9: np.int64, 10: np.float16, 11: np.float32, 12: np.float64,
    13: np.object_,
}
_BF16 = 14  # TYPE_BF16: numpy has none; ml_dtypes.bfloat16 stands in (as in tritonclient)
if BFLOAT16 is not None:
    _CODE_TO_NUMPY[_BF16] = BFLOAT16.type
    TRITON_STRING_TO_NUMPY["TYPE_BF16"] = BFLOAT16.type
_NUMPY_TO_CODE = {np.dtype(v): k for k, v in _CODE_TO_NUMPY.items()}


def triton_to_numpy_type(data_type: int) -> Any:
    """numpy type for a ModelConfig DataType value (13, TYPE_STRING, is np.object_)."""
    return _CODE_TO_NUMPY.get(data_type)


def numpy_to_triton_type(data_type: Any) -> int | None:
    """ModelConfig DataType value for a numpy dtype or type (bytes_ is TYPE_STRING); None for
    anything else, None itself included (``np.dtype(None)`` would be float64)."""
    code = _NUMPY_TO_CODE.get(data_type) if isinstance(data_type, np.dtype) else None
    if code is not None or data_type is None:
        return code
    try:
        dt = np.dtype(data_type)
    except TypeError:
        return None
    if dt.kind == "S":
        return 13
    return _NUMPY_TO_CODE.get(dt)


def triton_string_to_numpy(triton_type_string: str) -> Any:
    return TRITON_STRING_TO_NUMPY[triton_type_string]


class Tensor:
    """A named tensor: ``Tensor(name, numpy_array)``; data stays where it is (zero copy)."""

    # _shm: what the transport keeps of this tensor's shm copy (see TensorTransport.encode):
    # a BLS input sent again and again is copied into shared memory at most twice.
    __slots__ = ("_name", "_arr", "_dtype", "_shm")

    def __init__(self, name: str, numpy_array: Any, triton_dtype: int | None = None) -> None:
        if type(name) is not str:
            name = _tensor_name(name)
        if not name:
            raise TritonModelException("Tensor name cannot be an empty string.")  # Triton's
        # As Triton's (measured): a numpy array only, not a list, a scalar or a numpy scalar
        # (a model that passed one here would fail there), nor a masked array.
        if not isinstance(numpy_array, np.ndarray):
            raise TypeError(f"tensor '{name}': numpy_array must be a numpy.ndarray, got "
                            f"{type(numpy_array).__name__} (np.asarray() makes one)")
        if isinstance(numpy_array, np.ma.MaskedArray):
            raise TypeError(f"tensor '{name}': numpy_array is a masked array, whose masked "
                            "values would go as they are (.filled() makes a plain array)")
        arr = numpy_array
        if arr.dtype.kind in ("U", "V") and arr.dtype != BFLOAT16:
            raise _unsupported(name, arr.dtype)
        if not arr.flags.c_contiguous:
            # As Triton's: a strided view (a slice, a transpose) is copied here, so later
            # writes into the array it views do not reach this tensor.
            arr = arr.copy(order="C")
        if triton_dtype is not None:
            want = triton_to_numpy_type(triton_dtype)
            if want is None:
                raise TritonModelException(f"unknown Triton data type {triton_dtype}")
            if arr.dtype != np.dtype(want):
                arr = arr.view(want)
        code = numpy_to_triton_type(arr.dtype)
        if code is None:
            raise _unsupported(name, arr.dtype)
        self._name = name
        self._arr = arr
        self._dtype = code
        self._shm: Any = None

    @classmethod
    def _wrap(cls, name: str, arr: np.ndarray) -> Tensor:
        """A tensor over an array the runtime decoded (its dtype is known good): no checks."""
        t = cls.__new__(cls)
        t._name = name
        t._arr = arr
        code = _NUMPY_TO_CODE.get(arr.dtype)
        t._dtype = code if code is not None else 13  # object arrays: BYTES
        t._shm = None
        return t

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        if type(self._arr) is not np.ndarray and not self.is_cpu():
            raise TritonModelException("Tensor is stored in GPU and cannot be converted to "
                                       "NumPy.")  # Triton's words
        if self._dtype == _BF16:
            raise TritonModelException(  # Triton's words: BF16 goes through DLPack
                "Tensor dtype is BF16 and cannot be converted to NumPy. Use to_dlpack() and "
                "from_dlpack() instead.")
        return self._arr

    def shape(self) -> list[int]:
        return list(self._arr.shape)

    def triton_dtype(self) -> int:
        return self._dtype

    def is_cpu(self) -> bool:
        return not hasattr(self._arr, "__cuda_array_interface__")

    def to_cpu(self) -> Tensor:
        """This tensor in host memory: itself when it is there, else a copy of a GPU tensor
        (no torch or CuPy code needed in the model)."""
        if self.is_cpu():
            return self
        return Tensor._wrap(self._name, cuda.to_host(self._arr))

    def to_dlpack(self) -> Any:
        """A DLPack capsule of the data (CPU or GPU; BYTES tensors have no DLPack form)."""
        if self._dtype == 13:
            raise TritonModelException(_NO_DLPACK_STRINGS)
        if self._dtype == _BF16:
            return _bf16_capsule(self._arr)
        return _export(self._arr)

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        if self._dtype == 13:
            raise TritonModelException(_NO_DLPACK_STRINGS)
        if self._dtype == _BF16:
            return _bf16_capsule(self._arr, **kwargs)
        return _export(self._arr, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._arr.__dlpack_device__()

    @staticmethod
    def from_dlpack(name: str, dlpack_tensor: Any) -> Tensor:
        """A Tensor from any object with ``__dlpack__`` (or a DLPack capsule), zero copy."""
        name = _tensor_name(name)
        # Triton raises TritonModelException for both of these (a model may catch it).
        if not name:
            raise TritonModelException("Tensor name cannot be an empty string.")
        capsule = type(dlpack_tensor).__name__ == "PyCapsule"
        if not capsule and not (hasattr(dlpack_tensor, "__dlpack__")
                                and hasattr(dlpack_tensor, "__dlpack_device__")):
            raise TritonModelException(
                f"Tensor '{name}': from_dlpack was given a {type(dlpack_tensor).__name__}. "
                "Provided tensor is not supported. Tensor must be a DLPack capsule or have "
                "`__dlpack__` and `__dlpack_device__` attributes")
        if isinstance(dlpack_tensor, Tensor) and not dlpack_tensor.is_cpu():
            return Tensor._wrap(name, dlpack_tensor._arr)  # the same device memory
        if not capsule:
            dev = dlpack_tensor.__dlpack_device__()
            if int(dev[0]) == cuda.KDL_CUDA:
                return Tensor._wrap(name, _cupy_from_dlpack(dlpack_tensor))
            if int(dev[0]) != 1:  # kDLCPU
                raise TritonModelException(
                    f"Tensor '{name}': DLPack device type {int(dev[0])} is not supported; "
                    "tensors must be in CPU (1) or CUDA (2) memory")
            try:
                return Tensor(name, np.from_dlpack(dlpack_tensor))
            except (BufferError, RuntimeError):
                if BFLOAT16 is None:
                    raise
                # Perhaps BF16 (a torch.bfloat16 tensor), which numpy does not import.
                return Tensor(name, _from_bf16_capsule(dlpack_tensor.__dlpack__()))
        # A bare capsule (torch.utils.dlpack.to_dlpack): numpy takes a CPU one, CuPy the rest.
        if BFLOAT16 is not None and _is_bf16_capsule(dlpack_tensor):
            return Tensor(name, _from_bf16_capsule(dlpack_tensor))
        try:
            arr = np.from_dlpack(_CpuCapsule(dlpack_tensor))
        except (BufferError, RuntimeError, TypeError, ValueError):
            return Tensor._wrap(name, _cupy_from_dlpack(dlpack_tensor))
        return Tensor(name, _writable(arr))

    def __repr__(self) -> str:
        where = "" if self.is_cpu() else ", GPU"
        return (f"Tensor({self._name!r}, shape={list(self._arr.shape)}, "
                f"dtype={self._arr.dtype}{where})")


# Triton's words, exactly: its QA (L0_backend_python's dlpack test) compares them whole.
_NO_DLPACK_STRINGS = "DLPack does not have support for string tensors."


def _unsupported(name: str, dtype: np.dtype) -> TritonModelException:
    """Triton's error for an array whose dtype no tensor can hold (a str_ array, a big-endian
    one, complex, datetime, a record); its words first, as a model may match on them."""
    if dtype.kind == "U":
        why = "text goes as an np.object_ array of str or bytes"
    elif not dtype.isnative:
        why = "not in native byte order: .astype(a.dtype.newbyteorder('=')) makes it so"
    else:
        why = "it has no Triton data type"
    return TritonModelException(
        f"NumPy dtype is not supported. (tensor '{name}': dtype {dtype.str}, {why})")


def _tensor_name(name: Any) -> str:
    """A tensor's name: a str, or bytes taken as UTF-8 (as Triton's std::string takes them)."""
    if isinstance(name, bytes):
        try:
            return name.decode("utf-8")
        except UnicodeDecodeError:
            raise TritonModelException(f"tensor name {name!r} is not UTF-8 text") from None
    if not isinstance(name, str):
        raise TypeError(f"tensor name must be a str, got {type(name).__name__}")
    return name


def _export(arr: Any, **kwargs: Any) -> Any:
    """``arr.__dlpack__(**kwargs)``; a read-only numpy array (``np.frombuffer`` of bytes, a
    broadcast) is exported as a copy when the consumer cannot be told it is read-only (an
    unversioned capsule, as ``torch.utils.dlpack.from_dlpack`` takes), where numpy refuses."""
    try:
        return arr.__dlpack__(**kwargs)
    except BufferError:
        if type(arr) is not np.ndarray or arr.flags.writeable:
            raise
        return arr.copy().__dlpack__(**kwargs)


def _writable(arr: np.ndarray) -> np.ndarray:
    """A writable alias of an array numpy imported read-only from an unversioned DLPack capsule
    (it cannot tell whether the producer allows writes; Triton's import allows them, as
    torch's does). The alias keeps ``arr``, and through it the capsule's deleter, alive."""
    if arr.flags.writeable or arr.size == 0:
        return arr
    lo, hi = np.lib.array_utils.byte_bounds(arr)
    memory: Any = type("_DLPackMemory", (ctypes.c_char * (hi - lo),), {})
    keeper = memory.from_address(lo)
    keeper.array = arr
    return np.ndarray(arr.shape, arr.dtype, buffer=keeper, offset=arr.ctypes.data - lo,
                      strides=arr.strides)


class _CpuCapsule:
    """A bare DLPack capsule of CPU memory, in the form ``np.from_dlpack`` takes."""

    __slots__ = ("cap",)

    def __init__(self, cap: Any) -> None:
        self.cap = cap

    def __dlpack__(self, stream: Any = None, **kw: Any) -> Any:
        return self.cap

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU


# -- BF16 through DLPack -------------------------------------------------------------------
# numpy neither exports nor imports DLPack's bfloat16 (kDLBfloat, 16 bits). A BF16 tensor is
# exported as numpy's capsule of its uint16 view with the DLTensor's dtype rewritten, and a
# bfloat16 capsule (torch.utils.dlpack.to_dlpack of a torch.bfloat16 tensor) imported the other
# way round. Only the three bytes of the dtype change; numpy's deleter keeps ownership right.
_KDL_UINT, _KDL_BFLOAT = 1, 4
_GET_NAME = ctypes.pythonapi.PyCapsule_GetName
_GET_NAME.restype = ctypes.c_char_p
_GET_NAME.argtypes = [ctypes.py_object]
_GET_POINTER = ctypes.pythonapi.PyCapsule_GetPointer
_GET_POINTER.restype = ctypes.c_void_p
_GET_POINTER.argtypes = [ctypes.py_object, ctypes.c_char_p]
# Where DLTensor.dtype (uint8 code, uint8 bits, uint16 lanes) lies in the capsule's struct:
# DLManagedTensor starts with its DLTensor (data, device, ndim: 20 bytes); the versioned
# struct has its version, manager_ctx, deleter and flags (32 bytes) before the DLTensor.
_DTYPE_OFFSET = {b"dltensor": 20, b"dltensor_versioned": 32 + 20}


def _dtype_field(capsule: Any) -> Any:
    name = _GET_NAME(capsule)
    offset = _DTYPE_OFFSET.get(name)
    if offset is None:
        raise TritonModelException(f"not a DLPack capsule that can be read (named {name!r})")
    return (ctypes.c_uint8 * 2).from_address(_GET_POINTER(capsule, name) + offset)


def _is_bf16_capsule(capsule: Any) -> bool:
    try:
        code, bits = _dtype_field(capsule)
    except (TritonModelException, ValueError):
        return False
    return bool(code == _KDL_BFLOAT and bits == 16)


def _bf16_capsule(arr: Any, **kwargs: Any) -> Any:
    if type(arr) is not np.ndarray:
        raise TritonModelException("BF16 tensors in GPU memory have no DLPack form here")
    capsule = arr.view(np.uint16).__dlpack__(**kwargs)
    field = _dtype_field(capsule)
    field[0], field[1] = _KDL_BFLOAT, 16
    return capsule


def _from_bf16_capsule(capsule: Any) -> np.ndarray:
    field = _dtype_field(capsule)
    if (field[0], field[1]) != (_KDL_BFLOAT, 16):
        raise TritonModelException("DLPack tensor of an unsupported data type")
    field[0] = _KDL_UINT  # then numpy takes it (and its ownership) as uint16
    return np.from_dlpack(_CpuCapsule(capsule)).view(BFLOAT16)


def _cupy_from_dlpack(obj: Any) -> Any:
    """A CuPy array over a CUDA DLPack tensor (or capsule), zero copy."""
    try:
        cp = cuda.cupy()
    except Exception as exc:
        raise TritonModelException(f"GPU tensors need CuPy: {exc}") from None
    if isinstance(obj, cp.ndarray):
        return obj
    try:
        return cp.from_dlpack(obj)
    except TypeError:  # a bare capsule, on a CuPy whose from_dlpack wants __dlpack__
        legacy = getattr(cp, "fromDlpack", None)
        if legacy is None or type(obj).__name__ != "PyCapsule":
            raise
        return legacy(obj)
