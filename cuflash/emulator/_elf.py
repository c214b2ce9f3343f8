"""What binutils tell about a built object or library: its thread-local symbols (the
``__shared__`` variables), demangled names, and the source line of a code address."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from ._errors import EmulatorError


def _tls_rows(path: Path, *, check: bool) -> list:
    """(value, size, ndx, name) of every TLS symbol in `readelf -sW path`."""
    out = subprocess.run(["readelf", "-sW", str(path)], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise EmulatorError(f"readelf failed on {path}: {out.stderr}")
    rows = []
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 8 and parts[3] == "TLS":
            size = int(parts[2], 0) if parts[2].isdigit() else int(parts[2], 16)
            rows.append((int(parts[1], 16), size, parts[6], parts[7].split("@")[0]))
    return rows


def tls_symbols(path: Path) -> dict:
    """{name: (offset in the TLS block, size)} of the thread-local symbols `path` defines."""
    return {name: (value, size) for value, size, ndx, name in _tls_rows(path, check=True) if ndx != "UND"}


def undefined_tls(obj: Path) -> list:
    """Thread-local symbols `obj` uses but does not define: its ``extern __shared__`` arrays."""
    return [name for _, _, ndx, name in _tls_rows(obj, check=False) if ndx == "UND" and "__emu_" not in name]


def demangle(names: list) -> dict:
    """{mangled: readable} (empty where c++filt is missing)."""
    if not names or shutil.which("c++filt") is None:
        return {}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {}


def addr2line(path: Path, pcs: list) -> list:
    """(function, file:line) of module-relative return addresses (None where unknown)."""
    if shutil.which("addr2line") is None:
        return [None] * len(pcs)
    res = []
    for pc in pcs:
        if not pc:
            res.append(None)
            continue
        # -i prints the inlining chain innermost first; the first pair is the access itself.
        # pc is a return address: pc - 1 lies inside the call instruction.
        out = subprocess.run(["addr2line", "-C", "-i", "-f", "-e", str(path), hex(pc - 1)],
                             capture_output=True, text=True).stdout.splitlines()
        res.append((out[0], re.sub(r" \(discriminator \d+\)", "", out[1])) if len(out) >= 2 else None)
    return res


def inline_chain(path: Path, pc: int) -> list:
    """[(function, file:line)] of a module-relative return address, the access first and then
    each call site it was inlined into (empty where unknown)."""
    if not pc or shutil.which("addr2line") is None:
        return []
    out = subprocess.run(["addr2line", "-C", "-i", "-f", "-e", str(path), hex(pc - 1)],
                         capture_output=True, text=True).stdout.splitlines()
    pairs = [(out[i], re.sub(r" \(discriminator \d+\)", "", out[i + 1])) for i in range(0, len(out) - 1, 2)]
    return [p for p in pairs if re.fullmatch(r"[^?].*:\d+", p[1])]
