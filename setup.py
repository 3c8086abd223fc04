"""setuptools' build (pyproject.toml holds the metadata) with one step added: the C++ CPU kernels are compiled at
install time, so that a new user's first `LLM()` loads them instead of compiling them for ~20 s (issue 37).

After build_py, `kernels_pallas/cpu/library.py`'s `build_prebuilt` compiles the library into
`kernels_pallas/cpu/prebuilt/` of the wheel (or of the source tree, for an editable install), named by the same key
the run time computes (sources, flags, compiler, jaxlib's version, the CPU: `-march=native`). The run time loads it
only when its own key matches; otherwise it builds into the user's cache as before (a wheel installed on another
CPU, jaxlib upgraded since the install, an edited source).

Never fails the install: without jax in the build environment (build isolation brings it, see [build-system] in
pyproject.toml), without a compiler, or on a compile error, it says why and the kernels build on first use instead.
CBJAX_INSTALL_KERNELS=off skips the step.
"""

import importlib.util
import os
import pathlib
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = pathlib.Path(__file__).resolve().parent
PREBUILT = pathlib.Path("kernels_pallas", "cpu", "prebuilt")
SKIP_VAR = "CBJAX_INSTALL_KERNELS"


def _say(message: str) -> None:
    print(f"cbjax: {message}", file=sys.stderr, flush=True)


def _kernel_library():
    """kernels_pallas/cpu/library.py loaded by its path: the package's __init__ files stay unimported (they need
    the project's runtime dependencies, which a build environment lacks)."""
    spec = importlib.util.spec_from_file_location("_cbjax_install_kernels", ROOT / "kernels_pallas/cpu/library.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithKernels(build_py):
    """build_py, then the C++ kernels into the package (see the module docstring)."""

    def run(self):
        super().run()
        if os.environ.get(SKIP_VAR, "").lower() in ("off", "0", "no"):
            _say(f"{SKIP_VAR}=off: the C++ CPU kernels will build on first use")
            return
        # An editable install runs the package from the source tree, so the library goes there.
        target = (ROOT if getattr(self, "editable_mode", False) else pathlib.Path(self.build_lib)) / PREBUILT
        try:
            library = _kernel_library()
        except ImportError as e:
            _say(f"no prebuilt C++ CPU kernels ({e}: jax is not in the build environment); they build on first use")
            return
        try:
            path = library.build_prebuilt(target)
        except Exception as e:  # a failed compile must not fail the install: the run time builds (or falls back)
            _say(f"no prebuilt C++ CPU kernels ({' '.join(str(e).split())}); they build on first use")
            return
        # The source tree's copy is a build output: keep it out of git (the folder ignores itself).
        (target / ".gitignore").write_text("*\n")
        _say(f"built the C++ CPU kernels into {path}")


class BinaryDistribution(Distribution):
    """The wheel carries a compiled library: tag it for this platform, not py3-none-any."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=BinaryDistribution)
