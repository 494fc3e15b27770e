"""Load a built library with ctypes and call its launch functions."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from ..abi import ABI_VERSION, VARIANT_FAULT_SYMBOL, Entry, ctypes_struct
from ..spec import VariantSpec
from .errors import KernelError

_ERR_LEN = 1024


class Module:
    """A loaded kernel module: ``module.launch("merge_state", stream, **fields)``."""

    def __init__(self, spec: VariantSpec, path: Path, entries: tuple[Entry, ...]) -> None:
        self.spec = spec
        self.path = Path(path)
        self._lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_LOCAL)
        check_library(path, spec.uri, ())  # this module, of this ABI (the same handle: no second load)
        self._functions: dict[str, tuple[ctypes._CFuncPtr, type[ctypes.Structure], frozenset[str]]] = {}
        for entry in entries:
            function = getattr(self._lib, entry.symbol)
            struct = ctypes_struct(entry)
            function.argtypes = [ctypes.POINTER(struct), ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
            function.restype = ctypes.c_int
            self._functions[entry.name] = (function, struct, frozenset(f.name for f in entry.fields))
        self._err = ctypes.create_string_buffer(_ERR_LEN)  # written only when a launch fails
        # A JITATTN_DEBUG=1 build of a custom variant records out-of-bounds parameter reads; read it after each call.
        try:
            self._fault = getattr(self._lib, VARIANT_FAULT_SYMBOL)
            self._fault.argtypes = [ctypes.c_char_p, ctypes.c_int]
            self._fault.restype = ctypes.c_int
        except AttributeError:
            self._fault = None

    @property
    def entry_names(self) -> tuple[str, ...]:
        return tuple(self._functions)

    def params(self, entry: str, **values: int | float | None) -> ctypes.Structure:
        """A params struct for ``entry`` filled from ``values`` (every field, no more)."""
        _, struct, names = self._functions[entry]
        if set(values) != names:
            missing, extra = sorted(names - set(values)), sorted(set(values) - names)
            raise TypeError(f"{self.spec.uri}:{entry}: missing params {missing}, unexpected params {extra}")
        return struct(**values)

    def call(self, entry: str, params: ctypes.Structure, stream: int | None = None) -> None:
        """Call ``entry`` with a filled params struct; a non-zero return raises KernelError."""
        function = self._functions[entry][0]
        rc = function(ctypes.byref(params), stream, self._err, _ERR_LEN)
        if rc == 0 and self._fault is not None and self._fault(self._err, _ERR_LEN):
            raise KernelError(f"{self.spec.kernel_name} ({entry}): {self._err.value.decode(errors='replace')} "
                              "(reported by the JITATTN_DEBUG=1 bounds checks)")
        if rc != 0:
            message = self._err.value.decode(errors="replace") or f"error code {rc}"
            raise KernelError(f"{self.spec.kernel_name} ({entry}): {message}")

    def bind(self, entry: str, params: ctypes.Structure):
        """``call(entry, params, stream)`` as a function of the stream alone (for the per-layer hot path)."""
        function = self._functions[entry][0]
        reference, err, name = ctypes.byref(params), self._err, f"{self.spec.kernel_name} ({entry})"

        fault = self._fault

        def call(stream: int | None) -> None:
            if function(reference, stream, err, _ERR_LEN):
                raise KernelError(f"{name}: {err.value.decode(errors='replace') or 'launch failed'}")
            if fault is not None and fault(err, _ERR_LEN):
                raise KernelError(f"{name}: {err.value.decode(errors='replace')} "
                                  "(reported by the JITATTN_DEBUG=1 bounds checks)")

        return call

    def launch(self, entry: str, stream: int | None = None, **values: int | float | None) -> None:
        """Fill the params struct from ``values`` (every field, no more) and call ``entry``."""
        self.call(entry, self.params(entry, **values), stream)

    def __repr__(self) -> str:
        return f"Module({self.spec.uri!r}, {str(self.path)!r})"


class OtherAbiVersion(RuntimeError):
    """The library was built by a jitattn of another ABI version (a cache that two versions share)."""


OTHER_VERSION = "another jitattn version's"  # how library_problem's answer for such a library begins


# What loading a library that cannot be this module raises (dlopen, a missing symbol, another ABI or module).
LOAD_ERRORS = (OSError, AttributeError, RuntimeError)


def library_problem(path: Path, uri: str) -> str | None:
    """Why the library at ``path`` is not a loadable module of ``uri`` here (it does not load: built against other
    libraries or damaged; another ABI version; another module), or None."""
    try:
        check_library(path, uri, ())
    except OtherAbiVersion as exc:
        return f"{OTHER_VERSION}: {exc}"
    except LOAD_ERRORS as exc:
        return f"its library does not load here: {exc}"
    return None


def check_library(path: Path, uri: str, entries: tuple[Entry, ...]) -> None:
    """Raise unless the library at ``path`` loads, has our ABI version and exports every entry."""
    lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_LOCAL)
    lib.jitattn_abi_version.restype = ctypes.c_int
    lib.jitattn_module_uri.restype = ctypes.c_char_p
    version = lib.jitattn_abi_version()
    if version != ABI_VERSION:
        raise OtherAbiVersion(f"{path}: ABI version {version}, expected {ABI_VERSION}")
    found_uri = lib.jitattn_module_uri().decode()
    if found_uri != uri:
        raise RuntimeError(f"{path}: module uri {found_uri!r}, expected {uri!r}")
    for entry in entries:
        getattr(lib, entry.symbol)  # AttributeError names the missing symbol
