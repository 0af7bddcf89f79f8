# Decides JO_BUILD_CUDA and finds what _cuda links: the CUDA toolkit (nvcc,
# headers, static runtime) and cuBLASLt + NCCL from the nvidia-* wheels of the
# building Python (nvidia-cublas + nvidia-nccl-cu13; cu12: nvidia-cublas-cu12 +
# nvidia-nccl-cu12, docs/gpu.md).
set(JO_BUILD_CUDA OFF)
if(JAXOVERLAP_CUDA STREQUAL "OFF")
  return()
endif()
include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  if(JAXOVERLAP_CUDA STREQUAL "ON")
    message(FATAL_ERROR "jaxoverlap: JAXOVERLAP_CUDA=ON but no CUDA compiler (nvcc) was found")
  endif()
  message(STATUS "jaxoverlap: no nvcc: building without _cuda")
  return()
endif()

# The wheels: nvidia/nccl/{include,lib}, nvidia/cu13/{include,lib} (or cublas/ for cu12).
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c [=[
import os, sys
try:
    import nvidia
except ImportError:
    sys.exit("no 'nvidia' package (pip install nvidia-nccl-cu13 nvidia-cublas)")
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
  if(JAXOVERLAP_CUDA STREQUAL "ON")
    message(FATAL_ERROR "jaxoverlap: JAXOVERLAP_CUDA=ON but the NCCL/cuBLAS wheels are missing: ${_jo_err}")
  endif()
  string(STRIP "${_jo_err}" _jo_err)
  message(STATUS "jaxoverlap: nvcc found but not the NCCL/cuBLAS wheels, building without _cuda: ${_jo_err}")
  return()
endif()
list(GET _jo_wheels 0 _jo_nccl_root)
list(GET _jo_wheels 1 JO_CUBLAS_WHEEL_DIR)
list(GET _jo_wheels 2 _jo_cublas_root)
list(GET _jo_wheels 3 _jo_cublaslt_name)
set(JO_NCCL_INCLUDE_DIR "${_jo_nccl_root}/nccl/include")
set(JO_NCCL_LIBRARY "${_jo_nccl_root}/nccl/lib/libnccl.so.2")
set(JO_CUBLAS_INCLUDE_DIR "${_jo_cublas_root}/${JO_CUBLAS_WHEEL_DIR}/include")
set(JO_CUBLASLT_LIBRARY "${_jo_cublas_root}/${JO_CUBLAS_WHEEL_DIR}/lib/${_jo_cublaslt_name}")
set(JO_NVIDIA_WHEELS "nvidia/nccl,nvidia/${JO_CUBLAS_WHEEL_DIR}")

if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES "80;90a")
endif()
enable_language(CUDA)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
find_package(CUDAToolkit REQUIRED)
set(JO_BUILD_CUDA ON)
message(STATUS "jaxoverlap: building _cuda with CUDA ${CUDAToolkit_VERSION}, NCCL ${JO_NCCL_LIBRARY}, cuBLASLt ${JO_CUBLASLT_LIBRARY}")
