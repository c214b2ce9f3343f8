"""One loaded emulator library: its kernels' parameter lists, its shared-memory variables and
the source line of a code address in it."""
from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

from . import _elf
from ._abi import ErrorRecord, ParamKind, Runtime
from ._errors import EmulatorError


class Library:
    """All name expressions of one (source, options, mode), loaded with ctypes."""

    def __init__(self, path: Path, names: list, checked: bool):
        self.path = path
        self.names = names
        self.checked = checked
        self.runtime = Runtime(ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL))
        self.launch_lock = threading.Lock()   # the runtime's launch state is per library
        if self.runtime.error_record_size() != ctypes.sizeof(ErrorRecord):
            raise EmulatorError(f"emulator library {path}: its error record does not match cuflash/emulator/_abi.py")
        syms = _elf.tls_symbols(path)
        anchor, dyn = syms.get("__emu_tls_anchor"), syms.get("__emu_dyn_smem")
        if anchor is None or dyn is None:
            raise EmulatorError(f"emulator library {path} lacks runtime symbols")
        static_shared = []   # (TLS offset, size, mangled name)
        dynamic = []         # the extern __shared__ names bound to the dynamic buffer
        for name, (offset, size) in syms.items():
            if "__emu_" in name or name.startswith(("_ZTH", "_ZTW")):   # runtime state, TLS init/wrapper
                continue
            if offset == dyn[0]:
                dynamic.append(name)
            elif size > 0:
                static_shared.append((offset, size, name))
        readable = _elf.demangle([s[2] for s in static_shared] + dynamic)
        self.static_shared = [(o, s, readable.get(n, n)) for o, s, n in static_shared]
        self.dynamic_names = [readable.get(n, n) for n in dynamic]
        pairs = (ctypes.c_int64 * (2 * max(1, len(static_shared))))()
        for i, (o, s, _) in enumerate(static_shared):
            pairs[2 * i], pairs[2 * i + 1] = o, s
        stack_kb = int(os.environ.get("CUFLASH_EMULATOR_STACK_KB", "0") or 0)
        n = self.runtime.init(anchor[0], len(static_shared), pairs, stack_kb)
        if n != len(names):
            raise EmulatorError(f"emulator library {path}: expected {len(names)} kernels, found {n}")
        self.params = [self._params(k) for k in range(n)]

    def _params(self, k: int) -> list:
        """[(size in bytes, ParamKind)] of kernel `k`'s parameters."""
        name, count, table = ctypes.c_char_p(), ctypes.c_int(), ctypes.POINTER(ctypes.c_int)()
        self.runtime.kernel_info(k, ctypes.byref(name), ctypes.byref(count), ctypes.byref(table))
        m = count.value
        return [(table[i], ParamKind(table[m + i])) for i in range(m)]

    def where(self, pc: int) -> str:
        """'file:line (in function)' of a module-relative return address."""
        if not pc:
            return "unknown location"
        r = _elf.addr2line(self.path, [pc])[0]
        if not r or r[1].startswith("??"):
            return f"pc +{pc:#x} in {self.path.name}"
        fn, loc = r
        return f"{loc} (in {fn})"

    def call_site(self, pc: int) -> str:
        """'file:line (in f), inlined at file:line (in g), ...' of a return address; '' without debug info."""
        return ", inlined at ".join(f"{loc} (in {fn})" for fn, loc in _elf.inline_chain(self.path, pc))

    def shared_name(self, dynamic: bool, offset: int) -> str:
        """The shared variable at `offset` (into the dynamic buffer, or into the TLS block)."""
        if dynamic:
            names = ", ".join(self.dynamic_names) or "dynamic shared memory"
            return f"extern __shared__ {names} (dynamic shared memory) at byte offset {offset}"
        for o, s, n in self.static_shared:
            if o <= offset < o + s:
                return f"__shared__ {n} at byte offset {offset - o} (of {s})"
        return f"static shared memory at TLS offset {offset}"
