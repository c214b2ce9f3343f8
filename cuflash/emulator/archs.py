"""The GPUs the emulator can stand for: per compute capability, the resource limits a tile
plan needs and the tensor-core arithmetic that ``mma.sync`` follows.

Limits: CUDA C++ Programming Guide, "Compute Capabilities", table "Technical Specifications
per Compute Capability" (shared memory per block opt-in = ``cudaDevAttrMaxSharedMemoryPerBlockOptin``,
per SM = ``cudaDevAttrMaxSharedMemoryPerMultiprocessor``, 1 KB of it reserved per block on
8.x/9.0), and the SM count of the named product (NVIDIA data sheets: V100 SXM2 80, T4 40,
A100 108, A10 72, L4 58, H100 SXM5 132, B200 148, RTX 5090 170).

Tensor-core arithmetic (measured; Khattak & Mikaitis, "Accurate models of NVIDIA tensor
cores", arXiv 2512.07004, and the captures in tests/data/tensor-core): products are exact;
within a block of ``block_k`` products plus the accumulator every term is aligned to the
largest exponent (floored at ``min_exponent``), keeps ``23 + extra_bits`` fraction bits below
it, truncated; the sum is exact, then truncated to fp32; blocks chain through the accumulator.
sm_75 uses the V100 parameters (the captures are V100's); its exponent floor is not measured.
sm_100 and sm_120 run the mma.sync kernels with Hopper's parameters: an assumption, as no
capture of theirs exists.

``sm_90a`` is the H100 with its architecture-specific features (``wgmma``, ``setmaxnreg``),
which PTX for plain ``sm_90`` may not use. Its ``wgmma`` sums follow the ``mma.sync`` model of
sm_90: an assumption until a capture of ``wgmma`` exists (``tools/capture_tensor_cores.py``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_ARCH = "sm_80"


@dataclass(frozen=True)
class GpuLimits:
    """What one SM and one block may use (bytes, counts)."""
    gpu: str                           # the product whose figures these are
    sm_count: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    registers_per_sm: int              # 32-bit registers
    max_registers_per_thread: int
    shared_per_block: int              # without opting in
    shared_per_block_optin: int        # the most a kernel may raise max_dynamic_shared_size_bytes to
    shared_per_sm: int
    shared_reserved_per_block: int     # taken from shared_per_sm by every resident block


@dataclass(frozen=True)
class TensorCoreArithmetic:
    """How mma.sync sums (see the module docstring); block sizes in products."""
    block_k_f16: int                   # .f16 and .bf16 operands
    block_k_tf32: int
    extra_bits: int
    min_exponent: int


@dataclass(frozen=True)
class Arch:
    name: str                          # "sm_80"
    cuda_arch: int                     # __CUDA_ARCH__, 800
    limits: GpuLimits
    mma: TensorCoreArithmetic | None   # None: no mma.sync of the emulated kind (sm_70)
    specific: bool = False             # the "a" target: architecture-specific features on

    @property
    def feature_macro(self) -> str | None:
        """The macro NVRTC defines for an "a" target (__CUDA_ARCH_FEAT_SM90_ALL)."""
        return f"__CUDA_ARCH_FEAT_SM{self.cuda_arch // 10}_ALL" if self.specific else None


_KIB = 1024
_V100_MMA = TensorCoreArithmetic(block_k_f16=4, block_k_tf32=4, extra_bits=0, min_exponent=-132)
_AMPERE_MMA = TensorCoreArithmetic(block_k_f16=8, block_k_tf32=4, extra_bits=1, min_exponent=-132)
_HOPPER_MMA = TensorCoreArithmetic(block_k_f16=16, block_k_tf32=8, extra_bits=2, min_exponent=-133)

_H100 = GpuLimits("H100 SXM5", 132, 2048, 32, 65536, 255, 48 * _KIB, 227 * _KIB, 228 * _KIB, _KIB)

ARCHS = {a.name: a for a in (
    Arch("sm_70", 700, GpuLimits("Tesla V100 SXM2", 80, 2048, 32, 65536, 255, 48 * _KIB, 96 * _KIB, 96 * _KIB, 0),
         None),
    Arch("sm_75", 750, GpuLimits("Tesla T4", 40, 1024, 16, 65536, 255, 48 * _KIB, 64 * _KIB, 64 * _KIB, 0),
         _V100_MMA),
    Arch("sm_80", 800, GpuLimits("A100", 108, 2048, 32, 65536, 255, 48 * _KIB, 163 * _KIB, 164 * _KIB, _KIB),
         _AMPERE_MMA),
    Arch("sm_86", 860, GpuLimits("A10", 72, 1536, 16, 65536, 255, 48 * _KIB, 99 * _KIB, 100 * _KIB, _KIB),
         _AMPERE_MMA),
    Arch("sm_89", 890, GpuLimits("L4", 58, 1536, 24, 65536, 255, 48 * _KIB, 99 * _KIB, 100 * _KIB, _KIB),
         _AMPERE_MMA),
    Arch("sm_90", 900, _H100, _HOPPER_MMA),
    Arch("sm_90a", 900, _H100, _HOPPER_MMA, specific=True),
    Arch("sm_100", 1000, GpuLimits("B200", 148, 2048, 32, 65536, 255, 48 * _KIB, 227 * _KIB, 228 * _KIB, _KIB),
         _HOPPER_MMA),
    Arch("sm_120", 1200, GpuLimits("GeForce RTX 5090", 170, 1536, 32, 65536, 255, 48 * _KIB, 99 * _KIB, 100 * _KIB,
                                   _KIB),
         _HOPPER_MMA),
)}


def get_arch(name: str | None = None) -> Arch:
    """The Arch called `name` ("sm_80", also "80", "sm80"); None: $CUFLASH_EMULATOR_ARCH, else sm_80."""
    if name is None:
        name = os.environ.get("CUFLASH_EMULATOR_ARCH", "").strip() or DEFAULT_ARCH
    key = str(name).strip().lower().replace("compute_", "sm_")
    if not key.startswith("sm"):
        key = "sm_" + key
    key = "sm_" + key[2:].lstrip("_")
    if key not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {name!r}")
    return ARCHS[key]


def gpu_limits(name: str | None = None) -> GpuLimits:
    """The resource limits of the GPU the emulator stands for when it emulates `name`."""
    return get_arch(name).limits
