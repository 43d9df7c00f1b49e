"""Builds moe_kernels._C: the C++ CPU kernels always, the CUDA kernels when asked or possible.

Environment:
  MOE_KERNELS_CUDA=1        build the CUDA kernels; a failure is an error, never a silent skip.
  MOE_KERNELS_CUDA=0        never build them.
  (unset)                   build them when torch is a CUDA build and a CUDA toolkit is found.
  MOE_KERNELS_CUDA_ARCHS    compute capabilities, default "80;90".
  DEBUG=1                   -O0 -g instead of -O3.
  MAX_JOBS                  parallel compile jobs (honoured by torch's ninja build).
"""

import glob
import os
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def _want_cuda():
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    flag = os.environ.get("MOE_KERNELS_CUDA", "")
    if flag == "0":
        return False, "disabled by MOE_KERNELS_CUDA=0"
    possible = torch.version.cuda is not None and CUDA_HOME is not None
    if flag == "1":
        if not possible:
            sys.exit(
                "MOE_KERNELS_CUDA=1 but the CUDA kernels cannot be built: "
                f"torch.version.cuda={torch.version.cuda}, CUDA_HOME={CUDA_HOME}"
            )
        return True, "forced by MOE_KERNELS_CUDA=1"
    if possible:
        return True, f"torch {torch.__version__} is a CUDA build and CUDA_HOME={CUDA_HOME}"
    return False, f"torch {torch.__version__} is not a CUDA build (or no CUDA toolkit was found)"


def extensions():
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    debug = os.environ.get("DEBUG", "0") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    cxx = opt + ["-std=c++20", "-fopenmp"]
    include_dirs = [os.path.join(ROOT, "csrc", "include")]
    sources = _rel([os.path.join(ROOT, "csrc", "ops.cpp")] + glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp")))

    cuda, why = _want_cuda()
    if not cuda:
        print(f"moe_kernels: building the C++ CPU kernels only ({why})")
        return [
            CppExtension(
                "moe_kernels._C",
                sources,
                include_dirs=include_dirs,
                extra_compile_args={"cxx": cxx},
                extra_link_args=["-fopenmp"],
                py_limited_api=True,
            )
        ]
    archs = os.environ.get("MOE_KERNELS_CUDA_ARCHS", "80;90").split(";")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a]
    sources += _rel(
        [os.path.join(ROOT, "csrc", "cuda_ops.cpp")] + glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu"))
    )
    print(f"moe_kernels: building the C++ CPU kernels and the CUDA kernels for sm {archs} ({why})")
    return [
        CUDAExtension(
            "moe_kernels._C",
            sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx + ["-DMOE_KERNELS_CUDA"], "nvcc": opt + ["-std=c++20"] + gencode},
            extra_link_args=["-fopenmp"],
            py_limited_api=True,
        )
    ]


def main():
    from torch.utils.cpp_extension import BuildExtension

    setup(
        name="moe_kernels",
        version="0.1.0",
        packages=find_packages(include=["moe_kernels", "moe_kernels.*"]),
        ext_modules=extensions(),
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
        options={"bdist_wheel": {"py_limited_api": "cp39"}},
        python_requires=">=3.10",
    )


if __name__ == "__main__":
    main()
