"""areal_libra: pip install -e . builds each csrc/*.cpp as areal_libra._<name> when a C++ compiler is
present; without one (or if a build fails) the pure-Python fallbacks are used, with identical results."""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - no compiler is a supported configuration
            print(f"areal_libra: C++ extensions not built ({e}); using the Python fallback")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            print(f"areal_libra: extension {ext.name} not built ({e}); using the Python fallback")


def extensions():
    try:
        from pybind11.setup_helpers import Pybind11Extension
    except ImportError:
        print("areal_libra: pybind11 missing; C++ extensions skipped")
        return []
    return [
        Pybind11Extension(f"areal_libra._{src.stem}", [str(src)], cxx_std=17, extra_compile_args=["-O3"])
        for src in sorted(Path("csrc").glob("*.cpp"))
    ]


setup(
    name="areal_libra",
    version="0.1.0",
    description="Libra resource management (planner, C-MLFQ, elastic hybrid pool) on AReaL 1.0.4",
    packages=find_packages(include=["areal_libra", "areal_libra.*"]),
    package_data={"areal_libra": ["presets/*.yaml"]},
    python_requires=">=3.11",
    ext_modules=extensions(),
    cmdclass={"build_ext": OptionalBuildExt},
)
