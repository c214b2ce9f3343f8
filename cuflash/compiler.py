"""How cuflash's CUDA sources are compiled, in one place.

The run-time path (CuPy's RawModule on a GPU, or the CPU emulator) and the compile
gate (`python -m cuflash check-kernels`) build their option lists here, so the gate
compiles exactly what CuPy will.
"""
import functools
import os
import pathlib

KERNEL_DIR = pathlib.Path(__file__).resolve().parent / "kernels"

# The architectures the compile gate proves every specialization for.
GATE_ARCHS = ("sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90")


@functools.cache
def cuda_include_dir():
    """The CUDA headers (cuda_fp16.h, cuda_bf16.h): the PyPI wheel's, else CUDA_PATH's."""
    try:
        import nvidia.cuda_runtime
        for base in nvidia.cuda_runtime.__path__:
            inc = pathlib.Path(base) / "include"
            if (inc / "cuda_fp16.h").exists():
                return str(inc)
    except ImportError:
        pass
    for root in (os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (pathlib.Path(root) / "include" / "cuda_fp16.h").exists():
            return str(pathlib.Path(root) / "include")
    return None


def nvrtc_options(arch=None):
    """NVRTC options for every cuflash kernel; `arch` ("sm_80") only for the gate.

    CuPy's RawModule adds the architecture of the current device itself.
    """
    options = ["--std=c++17", f"-I{KERNEL_DIR}"]
    inc = cuda_include_dir()
    if inc is not None:
        options.append(f"-I{inc}")
    if arch is not None:
        options.append(f"-arch={arch}")
    return tuple(options)


@functools.cache
def read_source(filename):
    """The text of one kernel source file in cuflash/kernels/."""
    return (KERNEL_DIR / filename).read_text()
