set(CMAKE_CUDA_COMPILER "/usr/local/bin/nvcc")
set(CMAKE_CUDA_HOST_COMPILER "")
