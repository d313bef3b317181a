"""The package as a user installs it: ``python -m build`` makes a wheel that carries the few-bit
tables and the ``hf-actq`` command, and a fresh virtual environment imports it from the wheel
(not from this checkout)."""

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("dist")
    # --no-isolation: the build backend installed here (setuptools, in the test extra), as
    # nothing else can be downloaded by a test.
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    (found,) = out.glob("hf_actq-*.whl")
    return found


def test_the_wheel_carries_the_tables_and_the_command(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        commands = archive.read(entry_points).decode()
    assert "hf_actq/fewbit/tables.json" in names
    assert "hf_actq/kernels/triton_common.py" in names
    assert "hf-actq = hf_actq.__main__:main" in commands
    assert not [n for n in names if n.startswith(("tests/", "recipes/", "benchmarks/"))]


def test_a_fresh_environment_imports_the_wheel_and_reads_its_tables(wheel, tmp_path):
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=True)
    python = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", str(wheel)],
        check=True,
        capture_output=True,
    )
    # Dependencies (torch, transformers, ...) from this environment's site-packages, on
    # PYTHONPATH: a path entry's .pth files are not read, so this checkout's editable install
    # (a .pth and a finder there) stays out, and hf_actq comes from the wheel.
    check = "import hf_actq, hf_actq.fewbit.tables as t; print(hf_actq.__file__, len(t.shipped_tables()))"
    result = subprocess.run(
        [python, "-c", check],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]},
        check=True,
        capture_output=True,
        text=True,
    )
    where, tables = result.stdout.split()
    assert Path(where).is_relative_to(env_dir), where
    assert int(tables) > 0
