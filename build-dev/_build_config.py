"""Written by the build (CMakeLists.txt): what it made of the CUDA extension."""

CUDA_EXTENSION = "built with CUDA 13.0.88 for sm_80 and sm_90a"
