# Decides JO_BUILD_CUDA and finds what _cuda links: the CUDA toolkit (nvcc,
# headers, static runtime) and cuBLASLt + NCCL from the nvidia-* wheels of the
# building Python (nvidia-cublas + nvidia-nccl-cu13; cu12: nvidia-cublas-cu12 +
# nvidia-nccl-cu12, docs/gpu.md). Under pip's build isolation the wheels come from
# the build backend (build_backend/jaxoverlap_backend.py), which adds them to the
# build requirements when it finds nvcc as check_language(CUDA) does.
#
# JO_CUDA_STATUS says in one line what happened: printed here, and recorded in
# jaxoverlap/_build_config.py for jo.info() and the first GPU fallback's warning.
# In AUTO mode a missing piece is that line, never an error.
set(JO_BUILD_CUDA OFF)
string(TOUPPER "${JAXOVERLAP_CUDA}" _jo_cuda)
if(_jo_cuda MATCHES "^(ON|1|TRUE|YES)$")
  set(_jo_cuda ON)
elseif(_jo_cuda MATCHES "^(OFF|0|FALSE|NO)$")
  set(_jo_cuda OFF)
elseif(NOT _jo_cuda STREQUAL "AUTO")
  message(FATAL_ERROR "jaxoverlap: JAXOVERLAP_CUDA=${JAXOVERLAP_CUDA}: use AUTO, ON or OFF")
endif()

# Not building _cuda: an error when it was asked for (ON), else the one line.
macro(jo_cuda_skip reason)
  if(_jo_cuda STREQUAL "ON")
    message(FATAL_ERROR "jaxoverlap: JAXOVERLAP_CUDA=ON but ${reason}")
  endif()
  set(JO_CUDA_STATUS "not built: ${reason}")
  message(STATUS "jaxoverlap: CUDA extension (_cuda) not built: ${reason}")
  return()
endmacro()

if(_jo_cuda STREQUAL "OFF")
  set(JO_CUDA_STATUS "not built: the build was asked not to (JAXOVERLAP_CUDA=OFF)")
  message(STATUS "jaxoverlap: CUDA extension (_cuda) not built: JAXOVERLAP_CUDA=OFF")
  return()
endif()
include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  jo_cuda_skip("no CUDA compiler: nvcc is not on PATH (nor named by CUDACXX) where this was built")
endif()

# The wheels: nvidia/nccl/{include,lib}, nvidia/cu13/{include,lib} (or cublas/ for cu12).
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c [=[
import os, sys
try:
    import nvidia
except ImportError:
    sys.exit("no 'nvidia' package")
roots = [os.path.join(p) for p in nvidia.__path__]
def find(rel):
    for r in roots:
        if os.path.exists(os.path.join(r, rel)):
            return r
    return ""
nccl = find("nccl/include/nccl.h")
cublas_dir = next((d for d in ("cu13", "cublas", "cu12") if find(d + "/include/cublasLt.h")), "")
if not nccl or not cublas_dir:
    sys.exit("nccl.h or cublasLt.h not found under " + ";".join(roots))
cb = find(cublas_dir + "/include/cublasLt.h")
lt = [f for f in os.listdir(os.path.join(cb, cublas_dir, "lib")) if f.startswith("libcublasLt.so.")]
print(";".join([nccl, cublas_dir, cb, sorted(lt)[0] if lt else ""]), end="")
]=]
  OUTPUT_VARIABLE _jo_wheels RESULT_VARIABLE _jo_rc ERROR_VARIABLE _jo_err)
if(NOT _jo_rc EQUAL 0)
  string(STRIP "${_jo_err}" _jo_err)
  string(REGEX REPLACE "[\r\n]+" " " _jo_err "${_jo_err}")
  jo_cuda_skip("nvcc was found but not the NCCL/cuBLAS wheels in the building Python: ${_jo_err} (pip's isolated build brings them; before a --no-build-isolation build: pip install nvidia-nccl-cu13 nvidia-cublas)")
endif()
list(GET _jo_wheels 0 _jo_nccl_root)
list(GET _jo_wheels 1 JO_CUBLAS_WHEEL_DIR)
list(GET _jo_wheels 2 _jo_cublas_root)
list(GET _jo_wheels 3 _jo_cublaslt_name)
# The headers are compiled through links in the build tree, not from site-packages: every
# Python's build then names them by the same path relative to its build directory, so a
# compiler cache (the Makefile runs ccache) reuses one Python's objects for another's.
set(_jo_headers "${CMAKE_BINARY_DIR}/wheel_headers")
file(MAKE_DIRECTORY "${_jo_headers}")
file(CREATE_LINK "${_jo_nccl_root}/nccl/include" "${_jo_headers}/nccl" SYMBOLIC)
file(CREATE_LINK "${_jo_cublas_root}/${JO_CUBLAS_WHEEL_DIR}/include" "${_jo_headers}/cublas"
  SYMBOLIC)
set(JO_NCCL_INCLUDE_DIR "${_jo_headers}/nccl")
set(JO_NCCL_LIBRARY "${_jo_nccl_root}/nccl/lib/libnccl.so.2")
set(JO_CUBLAS_INCLUDE_DIR "${_jo_headers}/cublas")
set(JO_CUBLASLT_LIBRARY "${_jo_cublas_root}/${JO_CUBLAS_WHEEL_DIR}/lib/${_jo_cublaslt_name}")
set(JO_NVIDIA_WHEELS "nvidia/nccl,nvidia/${JO_CUBLAS_WHEEL_DIR}")

# CUTLASS's C++ headers (the fused GEMM, cpp/cuda/fused/fused_gemm_kernel.cuh) from the
# nvidia-cutlass wheel: a build-only requirement, pinned here and where it is installed
# (build_backend/jaxoverlap_backend.py CUTLASS_WHEEL, the Makefile's CUDA_BUILD_PKGS_ON).
# Found without importing the package (its Python side needs cuda-python; the build does not).
set(JO_CUTLASS_VERSION 4.2.0)
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c [=[
import importlib.util, os, sys
spec = importlib.util.find_spec("cutlass_library")
roots = list(spec.submodule_search_locations or []) if spec else []
found = [os.path.join(r, "source", "include") for r in roots
         if os.path.exists(os.path.join(r, "source", "include", "cutlass", "version.h"))]
if not found:
    sys.exit("no cutlass_library/source/include/cutlass/version.h")
print(found[0], end="")
]=]
  OUTPUT_VARIABLE JO_CUTLASS_INCLUDE_DIR RESULT_VARIABLE _jo_rc ERROR_VARIABLE _jo_err)
set(_jo_cutlass_fix "pip install --no-deps nvidia-cutlass==${JO_CUTLASS_VERSION}.0")
if(NOT _jo_rc EQUAL 0)
  string(STRIP "${_jo_err}" _jo_err)
  jo_cuda_skip("nvcc and the NCCL/cuBLAS wheels were found but not CUTLASS's headers in the building Python (${_jo_err}; pip's isolated build brings them; before a --no-build-isolation build: ${_jo_cutlass_fix})")
endif()
file(STRINGS "${JO_CUTLASS_INCLUDE_DIR}/cutlass/version.h" _jo_cutlass_defines
  REGEX "^#define CUTLASS_(MAJOR|MINOR|PATCH) ")
string(REGEX REPLACE ".*CUTLASS_MAJOR ([0-9]+).*CUTLASS_MINOR ([0-9]+).*CUTLASS_PATCH ([0-9]+).*"
  "\\1.\\2.\\3" _jo_cutlass_found "${_jo_cutlass_defines}")
if(NOT _jo_cutlass_found STREQUAL JO_CUTLASS_VERSION)
  jo_cuda_skip("CUTLASS ${_jo_cutlass_found} was found (${JO_CUTLASS_INCLUDE_DIR}) but the fused GEMM is built against ${JO_CUTLASS_VERSION}: ${_jo_cutlass_fix}")
endif()
# Through a link in the build tree too, as the NCCL/cuBLAS headers: the fused GEMM's objects
# are the slowest of the build, and the compiler cache reuses them across Pythons.
file(CREATE_LINK "${JO_CUTLASS_INCLUDE_DIR}" "${_jo_headers}/cutlass" SYMBOLIC)
set(JO_CUTLASS_INCLUDE_DIR "${_jo_headers}/cutlass")

# enable_language(CUDA) needs a default; every kernel target sets its own
# architectures (cpp/cuda/CMakeLists.txt: JO_ADD_KERNEL_ARCHS, JO_MULTIMEM_KERNEL_ARCHS).
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES "80-real;90")
endif()
enable_language(CUDA)
# nvcc's system include directories as "-isystem <dir>", as for the C++ compiler, not CMake's
# default for nvcc, "-isystem=<dir>", whose path the compiler cache's base_dir does not rewrite:
# the header links of the build tree (wheel_headers/, under each Python's build directory) are
# then relative, and the two CI legs' builds of one kernel object (the fused GEMM's) are one
# cache entry, compiled once per run.
set(CMAKE_INCLUDE_SYSTEM_FLAG_CUDA "-isystem ")
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
find_package(CUDAToolkit REQUIRED)
# The cu13 wheels (nvidia/cu13) go with nvcc 13, the cu12 ones (nvidia/cublas) with nvcc 12.
string(REGEX MATCH "^[0-9]+" _jo_nvcc_major "${CUDAToolkit_VERSION}")
if(JO_CUBLAS_WHEEL_DIR STREQUAL "cu13")
  set(_jo_wheel_major 13)
else()
  set(_jo_wheel_major 12)
endif()
if(NOT _jo_nvcc_major STREQUAL _jo_wheel_major)
  jo_cuda_skip("nvcc is CUDA ${CUDAToolkit_VERSION} but the cuBLAS wheel is for CUDA ${_jo_wheel_major} (nvidia/${JO_CUBLAS_WHEEL_DIR}); install the wheels of nvcc's major")
endif()
set(JO_BUILD_CUDA ON)
set(JO_CUDA_STATUS "built with CUDA ${CUDAToolkit_VERSION} (kernels: sm_80, sm_90 and compute_90 PTX; fused GEMM: sm_90a)")
message(STATUS "jaxoverlap: CUDA extension (_cuda) built with CUDA ${CUDAToolkit_VERSION}, NCCL ${JO_NCCL_LIBRARY}, cuBLASLt ${JO_CUBLASLT_LIBRARY}, CUTLASS ${_jo_cutlass_found} headers")
