"""An installed cuflash (not only an editable checkout) ships its kernel sources."""
import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_wheel_ships_kernels_emulator_runtime_and_cpu_kernel(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(ROOT)], check=True)
    (wheel,) = tmp_path.glob("cuflash-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    needed = [p.relative_to(ROOT).as_posix()
              for folder in ("cuflash/kernels", "cuflash/emulator/runtime",
                             "cuflash/backends/numpy_backend/native")
              for p in (ROOT / folder).iterdir() if p.suffix in (".cu", ".cuh", ".h", ".cpp")]
    assert needed and not [p for p in needed if p not in shipped]
