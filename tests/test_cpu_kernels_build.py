"""The native engine's C kernels as a C file: built warning-free, shipped, and not in Python.

The kernels' numerics are tested in test_rollout_native_fast.py and test_rollout_sampler.py.
"""

from __future__ import annotations

import fnmatch
import logging
import platform
import tomllib
from pathlib import Path

import pytest

import polyrl
from polyrl.rollout.native import cpu_kernels

PACKAGE = Path(polyrl.__file__).parent
PYPROJECT = PACKAGE.parent / "pyproject.toml"

# Every flag set the loader tries, and AVX2 with FMA by name on x86-64: -march=native picks the
# AVX2 code only on a CPU that has it, and compiling it needs no such CPU.
BUILDS = [pytest.param(list(flags), id=" ".join(flags)) for flags in cpu_kernels._FLAG_SETS]
BUILDS.append(
    pytest.param(
        ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fno-math-errno"],
        id="avx2",
        marks=pytest.mark.skipif(
            platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 only"
        ),
    )
)


@pytest.mark.skipif(cpu_kernels._compiler() is None, reason="no C compiler here")
@pytest.mark.parametrize("flags", BUILDS)
def test_kernels_compile_without_warnings(flags, tmp_path, caplog):
    cc = cpu_kernels._compiler()
    source = cpu_kernels._source()
    with caplog.at_level(logging.DEBUG, logger=cpu_kernels.__name__):
        if cpu_kernels._build(cc, flags, tmp_path / "werror.so", source, werror=True):
            assert (tmp_path / "werror.so").stat().st_size > 0
            return
        if not cpu_kernels._build(cc, flags, tmp_path / "plain.so", source):
            pytest.skip(f"{cc} cannot build with {' '.join(flags)} here (the loader skips it too)")
    pytest.fail("the kernels build with warnings:\n" + caplog.text)


def test_no_c_source_in_python_files():
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if "#include <" in path.read_text(encoding="utf-8")
    ]
    assert offenders == []


def test_c_sources_are_package_data():
    sources = sorted(
        p for p in (PACKAGE / "rollout" / "native" / "csrc").iterdir() if p.suffix in (".c", ".h")
    )
    assert sources, "no C sources found"
    if not PYPROJECT.exists():
        pytest.skip("not a source checkout")
    patterns = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["tool"]["setuptools"][
        "package-data"
    ]["polyrl"]
    unshipped = [
        rel
        for rel in (p.relative_to(PACKAGE).as_posix() for p in sources)
        if not any(fnmatch.fnmatch(rel, pattern) for pattern in patterns)
    ]
    assert unshipped == []


def test_missing_source_disables_the_kernels(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_SOURCE_FILE", "csrc/no_such_file.c")
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: "cc")
    assert not cpu_kernels.available()
