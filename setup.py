"""Build mpzero: its CPU Adam ``mpzero._cpu`` always, and its CUDA extension ``mpzero._C``
when a CUDA toolchain is there.

``mpzero._cpu`` (``csrc/cpu_adam.cpp``) is a plain CPython extension with no torch headers
(about a second to compile); it is optional: without a C++ compiler the install goes on
and ``mpzero.kernels`` uses the PyTorch paths (``python -m mpzero.info`` says which).
``MPZERO_BUILD_CUDA``: ``auto`` (default) builds the extension when torch is a
CUDA build and ``nvcc`` is found; ``1`` requires it (clear error otherwise);
``0`` installs pure Python. ``TORCH_CUDA_ARCH_LIST`` is respected (default 9.0).
"""

import glob
import os
import shutil
import sys
import time

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def _log(msg: str) -> None:
    print(f"[mpzero setup] {msg}", file=sys.stderr, flush=True)


def _cuda_wanted() -> tuple[bool, str]:
    mode = os.environ.get("MPZERO_BUILD_CUDA", "auto").strip().lower()
    if mode not in ("0", "1", "auto"):
        raise SystemExit(f"MPZERO_BUILD_CUDA must be 0, 1 or auto, got {mode!r}")
    if mode == "0":
        return False, "MPZERO_BUILD_CUDA=0"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError as e:  # pragma: no cover - build isolation without torch
        reason = f"torch is not importable in the build environment ({e})"
        if mode == "1":
            raise SystemExit(
                f"MPZERO_BUILD_CUDA=1 but {reason}; use --no-build-isolation"
            ) from e
        return False, reason
    problems = []
    if torch.version.cuda is None:
        problems.append(f"torch {torch.__version__} is not a CUDA build")
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        problems.append("no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)")
    if problems:
        if mode == "1":
            raise SystemExit("MPZERO_BUILD_CUDA=1 but " + "; ".join(problems))
        return False, "; ".join(problems)
    return True, f"torch {torch.__version__} (CUDA {torch.version.cuda}), CUDA_HOME={CUDA_HOME}"


def _nvidia_wheel_dirs() -> tuple[list[str], list[str]]:
    """Headers/libs of the nvidia-* wheels next to torch (cuBLAS/cuSPARSE headers that
    ATen/cuda/CUDAContext.h includes may be missing from a minimal toolkit)."""
    import torch

    site = os.path.dirname(os.path.dirname(torch.__file__))
    inc, lib = [], []
    for root in sorted(glob.glob(os.path.join(site, "nvidia", "*"))):
        if os.path.isdir(os.path.join(root, "include")):
            inc.append(os.path.join(root, "include"))
        if os.path.isdir(os.path.join(root, "lib")):
            lib.append(os.path.join(root, "lib"))
    return inc, lib


def _cublaslt_link_args(lib_dirs: list[str]) -> list[str]:
    """Link arguments for cuBLASLt (csrc/gemm_gelu.cpp): ``-lcublasLt`` where an
    unversioned ``libcublasLt.so`` is found, else the versioned library by path (pip's
    nvidia-cublas wheel ships only ``libcublasLt.so.<major>``; its soname is what torch
    itself loads, so the extension shares torch's copy at run time)."""
    from torch.utils.cpp_extension import CUDA_HOME

    dirs = [*lib_dirs, *(os.path.join(CUDA_HOME, d) for d in ("lib64", "lib") if CUDA_HOME)]
    for d in dirs:
        if os.path.exists(os.path.join(d, "libcublasLt.so")):
            return [f"-L{d}", "-lcublasLt"]
    for d in dirs:
        found = sorted(glob.glob(os.path.join(d, "libcublasLt.so.*")), key=len)
        if found:
            return [found[0]]
    raise SystemExit("mpzero._C needs cuBLASLt: no libcublasLt.so found in "
                     + ", ".join(dirs))


CPU_SOURCES = [os.path.join("csrc", "cpu_adam.cpp")]


def _cpu_extension() -> Extension:
    """``mpzero._cpu``: the CPU Adam. ``-ffp-contract=off`` keeps every multiply and add
    rounded on its own (bit-identical to the reference; GCC would fuse them by default),
    ``-fno-math-errno`` lets ``sqrtf`` vectorize (no result changes); no ``-march``: the
    source carries its own AVX2/AVX-512 clones, picked at load time."""
    if sys.platform == "win32":
        flags, link = ["/O2", "/fp:precise"], []
    else:
        flags = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-math-errno", "-pthread"]
        link = ["-pthread"]
    return Extension("mpzero._cpu", sources=CPU_SOURCES, extra_compile_args=flags,
                     extra_link_args=link, optional=True)


def _timed(base):
    """``base`` (a build_ext) logging each extension's build time."""

    class TimedBuild(base):
        def build_extension(self, ext):
            t0 = time.time()
            super().build_extension(ext)
            _log(f"{ext.name} built in {time.time() - t0:.1f} s")

    return TimedBuild


def _extensions():
    cpu = _cpu_extension()
    build, why = _cuda_wanted()
    if not build:
        _log(f"building mpzero._cpu, no mpzero._C: {why}")
        return [cpu], {"build_ext": _timed(build_ext)}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    found = glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "*.cu"))
    sources = sorted(s for s in found if s not in CPU_SOURCES)
    inc, lib = _nvidia_wheel_dirs()
    _log(f"building mpzero._C for arch {os.environ['TORCH_CUDA_ARCH_LIST']}: {why}")
    _log(f"sources: {', '.join(sources)}")
    ext = CUDAExtension(
        name="mpzero._C",
        sources=sources,
        include_dirs=[os.path.join(HERE, "csrc"), *inc],
        library_dirs=lib,
        extra_compile_args={
            "cxx": ["-O3", "-std=c++20"],
            # The launch constants are compiled in (csrc/multi_tensor_apply_config.h);
            # variants are built by bench/sweep_launch.py, not here.
            "nvcc": ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"],
        },
        # nccl_allocator.cpp: dlopen/dlsym (libc itself on glibc>=2.34); gemm_gelu.cpp: cuBLASLt
        extra_link_args=["-ldl", *_cublaslt_link_args(lib)],
    )

    return [cpu, ext], {"build_ext": _timed(BuildExtension)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
