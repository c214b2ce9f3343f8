"""CpuConfig: every setting of the NumPy backend, in one frozen dataclass.

Tile sizes were measured on a 2-core Xeon (AVX-512, 2 MB L2 per core), float32,
B=1, H=8, N=2048, d=64 (benchmarks/bench_cpu.py). A 1024 × 256 float32 score tile
is 1 MB and stays in L2 from Q Kᵀ through exp to P̃ V. Forward CPU time per call,
two workers, medians of 31 interleaved runs: 1024×256 198 ms, 2048×256 203 ms,
512×512 210 ms; earlier, one worker: 256×512 +12%, 128×512 +40% over 512×512.
Causal: 512-row tiles (two heads per task) 3% faster than 1024 and 256 rows
(medians of 41 runs); 128 or 256 keys equal. On a 2-core Zen 3 (AVX2, 512 KB L2),
256–2048 rows × 128–2048 keys were all within the machine's noise (±5%) of 1024 × 256.
"""
import dataclasses
from dataclasses import dataclass, field

from .expbase import ExpBase, fastest_base, numpy_dispatch
from .native import CHOICES as NATIVE_CHOICES
from .pool import usable_cores


@dataclass(frozen=True)
class CpuConfig:
    """How the NumPy backend tiles, schedules and computes. `CpuConfig()` is this
    machine's default; change one setting with `dataclasses.replace(config, rows=...)`."""

    rows: int = 1024
    """Rows of a forward score tile (G query heads × Br rows): longer tiles reuse each
    K/V tile more, until rows × block_n floats no longer fit in L2."""
    causal_rows: int = 512
    """The same for causal forwards: shorter tiles leave a smaller diagonal triangle
    per tile, at more tiles' fixed cost."""
    block_n: int = 256
    """Bc, keys per forward K/V tile: wider tiles make fewer NumPy calls per row, at
    a bigger score tile."""
    bwd_rows: int = 256
    """Rows of a backward tile: half the forward's, as two tiles (P, dP) are alive at once."""
    bwd_block_n: int = 512
    """Keys per backward K/V tile: wider tiles mean fewer passes over Q, dO and dQ,
    at bigger tiles."""
    tile_budget: int = 1 << 27
    """Bytes × d of one forward step's score tile over a task's heads (heads × rows ×
    keys × itemsize × d, itemsize that of the accumulation dtype): more heads per task
    make fewer, bigger NumPy calls, which pays where a score carries little work (small
    d); a bigger tile leaves the cache, which costs where it carries much (large d,
    float64). The default takes two heads of 1024 × 256 float32 scores at d = 64, one at
    d = 128 or in float64 (four and two of 512-row causal tiles). On a 2-core Zen 5
    (1 MB L2 per core), interleaved medians of 31 paired ratios to PyTorch: two heads
    against one at d = 64, float32, 0.996–1.003× against 1.040–1.045× at N = 1024,
    0.951 against 0.965 at 2048, causal (four against two) 0.872 against 0.936 at 1024,
    0.889 against 0.920 at 2048; but 0.938–0.950 against 0.920–0.938 at d = 128,
    N = 2048–4096, and 0.952 / 0.872 against 0.937 / 0.854 in float64 at N = 1024 / 2048."""
    bwd_tile_budget: int = 1 << 17
    """The same for each of the backward's two tiles."""
    diag_keys: int = 128
    """Keys per strip of the causal triangle a forward Q tile's diagonal crosses: narrower
    strips compute fewer hidden scores (at N = 2048, 53% of N² against 62.5% for whole
    512-wide triangles) but make more, smaller NumPy calls (64 and 256 measured no
    better than 128; key strips 2–3% less CPU than row strips)."""
    bwd_diag: int = 256
    """The same for the backward's K/V tiles (56% of N² at N = 2048); 128 measured
    slower: more, smaller steps of 5 matmuls each, each NumPy call a GIL hand-over."""
    workers: int = field(default_factory=usable_cores)
    """Threads a call's tasks run on (the calling thread and workers − 1 pool threads):
    one per usable core; more only take turns on the cores and hand the GIL over more
    often. The results depend on the inputs and this count only."""
    native: str = "auto"
    """Plain forwards and backwards in float32 or 16-bit run the compiled kernels
    (`native`): "auto" their widest build this CPU runs ("avx512", else "avx2"), or one
    by name; where they cannot run (that instruction set missing, no C++ compiler) and
    with "off", the NumPy tiles below, which float64, the variants and FA1 always use.
    benchmarks/README.md times both."""
    frozen_max: bool = True
    """Forward tiles try a frozen reference max first (3 passes per step instead of 5),
    falling back to the running max per tile; False runs the running max everywhere."""
    max_sample: int = 16
    """Keys whose row max becomes the frozen reference: more keys bring it nearer the
    true max (fewer tiles fall back) at a bigger per-call prologue matmul. On a Zen 5
    (N = 1024–2048, d = 64, interleaved medians) 16 keys took 1.2–1.4% less time than
    64 (causal 3.7%: the prologue is a bigger share of half the work), and scores
    spread 3× or 30× wider fell back no more often (the same time to 0.4%)."""
    base: ExpBase = field(default_factory=lambda: fastest_base(*numpy_dispatch()))
    """Base of the exponential (BASE_2: exp2, BASE_E: exp): whichever NumPy vectorises
    on this CPU; results agree to rounding."""
    softmax_block: int = 1 << 16
    """Elements of x per online_softmax block: bigger blocks make fewer NumPy calls and
    take more scratch memory."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "base":
                if not isinstance(value, ExpBase):
                    raise TypeError(f"CpuConfig.base must be BASE_2 or BASE_E "
                                    f"(cuflash.backends.numpy_backend.expbase); got {value!r}")
            elif f.name == "frozen_max":
                if not isinstance(value, bool):
                    raise TypeError(f"CpuConfig.frozen_max must be a bool; got {value!r}")
            elif f.name == "native":
                if not isinstance(value, str):
                    raise TypeError(f"CpuConfig.native must be a str; got {value!r}")
                if value not in NATIVE_CHOICES:
                    raise ValueError(f"CpuConfig.native must be one of {NATIVE_CHOICES}; "
                                     f"got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"CpuConfig.{f.name} must be an int; got {value!r}")
            elif value < 1:
                raise ValueError(f"CpuConfig.{f.name} must be at least 1; got {value}")


DEFAULT_CONFIG = CpuConfig()
