"""The aggregation kernel (``src/p2ptrain/aggregate/native/kernel.c``), compiled into the
package when a wheel is built, so a machine that installs the wheel needs no C compiler.

The library is a plain C shared object loaded with ctypes (it defines no Python module): it
is named ``_kernel.so`` (``_kernel.dll`` on Windows) beside the source, and carries the
SHA-256 of the source it was compiled from, which the loader checks
(``p2ptrain.store.kernel_build``). The build is optional: where it fails (no compiler for an
editable install, an unsupported platform) the package installs without it and compiles the
kernel on first use when it can, or aggregates on the torch path (same bits, slower).
Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNEL = "p2ptrain.aggregate.native._kernel"
SOURCE = "src/p2ptrain/aggregate/native/kernel.c"
#: Never -ffast-math or FMA contraction: each float operation must round exactly once (the
#: same flags as the compile-on-first-use path, p2ptrain.store.kernel_build._FLAGS).
FLAGS = ["-O3", "-std=c99", "-ffp-contract=off", "-fno-fast-math"]


class BuildKernel(build_ext):
    """Names the kernel as the plain library it is, and exports no Python entry point."""

    def get_ext_filename(self, fullname: str) -> str:
        # called with the dotted name, or with its last part alone (distutils' inplace path)
        if fullname in (KERNEL, KERNEL.rpartition(".")[2]):
            suffix = ".dll" if sys.platform == "win32" else ".so"
            return os.path.join(*fullname.split(".")) + suffix
        return str(super().get_ext_filename(fullname))

    def get_export_symbols(self, ext: Extension) -> list[str]:
        if ext.name == KERNEL:
            return list(ext.export_symbols or [])
        return list(super().get_export_symbols(ext))


digest = hashlib.sha256((Path(__file__).resolve().parent / SOURCE).read_bytes()).hexdigest()

setup(
    ext_modules=[
        Extension(
            KERNEL,
            sources=[SOURCE],
            extra_compile_args=[*FLAGS, f'-DP2P_SOURCE_HASH="{digest}"'],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildKernel},
)
