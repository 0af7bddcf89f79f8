
# Consider dependencies only in project.
set(CMAKE_DEPENDS_IN_PROJECT_ONLY OFF)

# The set of languages for which implicit dependencies are needed:
set(CMAKE_DEPENDS_LANGUAGES
  )

# The set of dependency files which are needed:
set(CMAKE_DEPENDS_DEPENDENCY_FILES
  "/work/wt11/cpp/cuda/kernels.cu" "cpp/cuda/CMakeFiles/jo_cuda_kernels.dir/kernels.cu.o" "gcc" "cpp/cuda/CMakeFiles/jo_cuda_kernels.dir/kernels.cu.o.d"
  "/work/wt11/cpp/cuda/kernels_common.cc" "cpp/cuda/CMakeFiles/jo_cuda_kernels.dir/kernels_common.cc.o" "gcc" "cpp/cuda/CMakeFiles/jo_cuda_kernels.dir/kernels_common.cc.o.d"
  )

# Targets to which this target links.
set(CMAKE_TARGET_LINKED_INFO_FILES
  )

# Fortran module output directory.
set(CMAKE_Fortran_TARGET_MODULE_DIR "")
