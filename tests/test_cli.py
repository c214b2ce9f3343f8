"""The command line's `info`: what it reports about this machine's backends."""
import dataclasses

from cuflash import cli
from cuflash.backends import numpy_backend as nb
from cuflash.backends.numpy_backend.expbase import BASE_2, BASE_E


def test_info_names_the_cpu_backends_exponential(capsys, monkeypatch):
    for base, workers in ((BASE_2, 3), (BASE_E, 5)):
        config = dataclasses.replace(nb.BACKEND.config, base=base, workers=workers)
        monkeypatch.setattr(nb, "BACKEND", nb.NumpyBackend(config))
        assert cli.main(["info"]) == 0
        out = capsys.readouterr().out
        numpy_line = next(line for line in out.splitlines() if line.strip().startswith("numpy"))
        assert f"exponentials in base {base.name}:" in numpy_line
        assert f"{workers} workers" in numpy_line


def test_info_lists_each_archs_plans_with_occupancy(capsys, monkeypatch):
    """Without a GPU, info shows what every gate arch would run and why, with the
    occupancy from the gate's registers (here 128 for every kernel)."""
    from cuflash import compile_gate, tiling
    monkeypatch.setattr(compile_gate, "cached_registers",
                        lambda arch: {name: 128 for name in tiling.every_plan()})
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    sm80 = out[out.index("  sm_80 (A100)"):out.index("  sm_86")]
    first = sm80.splitlines()[1:3]
    # 128 threads × 128 registers = 16384 of 65536; 48 KB + 1 KB reserve fits 3× in 164 KB
    assert "flash_fwd_tc_kernel<__half, 64, 128, 64, 4, 2>" in first[0]
    assert "3 blocks, 12 warps per SM" in first[0]
    assert "tensor cores" in first[1]
    sm70 = out[out.index("  sm_70 (Tesla V100"):out.index("  sm_75")]
    assert "SIMT: float16 tensor cores need sm_75" in sm70
    assert "Blackwell" in out
