"""Builds the native extension `infinity._native` from native/*.cpp.

Only a C++17 compiler and the kernel's own headers are needed: io_uring and
kernel AIO are reached through raw system calls, never through liburing or
libaio. SIMD kernels are compiled with per-function target attributes and
chosen at run time, so one build runs on any x86-64 CPU.
"""

import glob
import os

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# Compile the sources in parallel (INFINITY_BUILD_JOBS, default: all cores).
ParallelCompile("INFINITY_BUILD_JOBS", default=0).install()

extra_compile_args = ["-O3", "-std=c++17", "-fvisibility=hidden", "-Wall", "-Wextra"]
extra_link_args: list[str] = ["-pthread"]
if os.environ.get("INFINITY_NATIVE_ASAN"):
    # AddressSanitizer build for the native tests: see tests/test_native_asan.py.
    extra_compile_args += ["-fsanitize=address", "-fno-omit-frame-pointer", "-O1", "-g"]
    extra_link_args += ["-fsanitize=address"]

native = Pybind11Extension(
    "infinity._native",
    sorted(glob.glob("native/*.cpp")),
    include_dirs=["native"],
    extra_compile_args=extra_compile_args,
    extra_link_args=extra_link_args,
    cxx_std=17,
)

setup(ext_modules=[native], cmdclass={"build_ext": build_ext})
