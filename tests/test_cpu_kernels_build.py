"""The native engine's C kernels as a C file: built warning-free, shipped, and not in Python.

The kernels' numerics are tested in test_rollout_native_fast.py and test_rollout_sampler.py.
"""

from __future__ import annotations

import fnmatch
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


needs_compiler = pytest.mark.skipif(
    cpu_kernels._compiler() is None, reason="no C compiler here: nothing to build"
)
# The smallest shared library: whether the compiler takes a flag set at all.
PROBE = "int polyrl_probe(void) { return 0; }\n"
# The kernels' source with a syntax error appended (the real file is never touched).
BROKEN = "\nint polyrl_broken(void) { return 0 }\n"


def check_build(cc: str, flags: list[str], source: str, tmp_path: Path) -> None:
    """Fail unless ``source`` builds warning-free with ``flags``; skip if ``cc`` lacks them.

    The loader skips a flag set that does not compile (``-fopenmp`` without an OpenMP
    runtime), but a source that fails where a trivial file builds is broken, not unsupported.
    """
    try:
        cpu_kernels._build(cc, flags, tmp_path / "werror.so", source, werror=True)
    except cpu_kernels.KernelBuildError as strict:
        try:
            cpu_kernels._build(cc, flags, tmp_path / "probe.so", PROBE)
        except cpu_kernels.KernelBuildError:
            pytest.skip(f"{cc} cannot build with {' '.join(flags)} here (the loader skips it too)")
        try:
            cpu_kernels._build(cc, flags, tmp_path / "plain.so", source)
        except cpu_kernels.KernelBuildError as exc:
            pytest.fail(f"the kernels do not compile:\n{exc}")
        pytest.fail(f"the kernels build with warnings:\n{strict}")
    assert (tmp_path / "werror.so").stat().st_size > 0


@needs_compiler
@pytest.mark.parametrize("flags", BUILDS)
def test_kernels_compile_without_warnings(flags, tmp_path):
    check_build(cpu_kernels._compiler(), flags, cpu_kernels._source(), tmp_path)


@needs_compiler
def test_a_kernel_source_that_does_not_compile_fails_the_kernel_tests(
    monkeypatch, tmp_path, request
):
    # A syntax error fails the build for every flag set; the engine then falls back to torch,
    # so the kernel tests must fail rather than skip on `not available()`.
    cc = cpu_kernels._compiler()
    broken = cpu_kernels._source() + BROKEN
    with pytest.raises(pytest.fail.Exception, match="do not compile"):
        check_build(cc, list(cpu_kernels._FLAG_SETS[-1]), broken, tmp_path)
    monkeypatch.setenv("POLYRL_KERNEL_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernels, "_source", lambda: broken)
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_why", None)
    assert not cpu_kernels.available()
    assert "polyrl_broken" in cpu_kernels.unavailable_reason()
    # What the kernel tests in test_rollout_native_fast.py and test_rollout_sampler.py use.
    with pytest.raises(pytest.fail.Exception, match="(?s)compiler exists.*polyrl_broken"):
        request.getfixturevalue("native_kernels")


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
    monkeypatch.setattr(cpu_kernels, "_why", None)
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: "cc")
    assert not cpu_kernels.available()
    assert "source is missing" in cpu_kernels.unavailable_reason()
