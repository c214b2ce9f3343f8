"""The command line's `info`: what it reports about this machine's backends."""
from cuflash import cli
from cuflash.backends import numpy_backend as nb


def test_info_names_the_cpu_backends_exponential(capsys, monkeypatch):
    for base in (nb.BASE_2, nb.BASE_E):
        monkeypatch.setattr(nb, "BASE", base)
        assert cli.main(["info"]) == 0
        out = capsys.readouterr().out
        numpy_line = next(line for line in out.splitlines() if line.strip().startswith("numpy"))
        assert f"exponentials in base {base.name}:" in numpy_line
        assert f"{nb._n_workers()} workers" in numpy_line
