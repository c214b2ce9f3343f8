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
