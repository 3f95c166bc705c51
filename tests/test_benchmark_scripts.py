"""The GPU-only benchmark scripts (benchmarks/) do not run in CI; at least they must parse, so that a device call is
never spent on a syntax error."""

import pathlib
import py_compile
import subprocess

import pytest

BENCHMARKS = pathlib.Path(__file__).parents[1] / "benchmarks"


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.py")), ids=lambda p: p.name)
def test_python_scripts_compile(path, tmp_path):
    py_compile.compile(str(path), cfile=str(tmp_path / "x.pyc"), doraise=True)


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.sh")), ids=lambda p: p.name)
def test_shell_scripts_parse(path):
    subprocess.run(["bash", "-n", str(path)], check=True)
