
# Consider dependencies only in project.
set(CMAKE_DEPENDS_IN_PROJECT_ONLY OFF)

# The set of languages for which implicit dependencies are needed:
set(CMAKE_DEPENDS_LANGUAGES
  )

# The set of dependency files which are needed:
set(CMAKE_DEPENDS_DEPENDENCY_FILES
  "/work/wt11/cpp/python/cuda_fake_module.cc" "cpp/cuda/CMakeFiles/_cuda_fake.dir/__/python/cuda_fake_module.cc.o" "gcc" "cpp/cuda/CMakeFiles/_cuda_fake.dir/__/python/cuda_fake_module.cc.o.d"
  "/work/wt11/cpp/cuda/fake/fake_kernels.cc" "cpp/cuda/CMakeFiles/_cuda_fake.dir/fake/fake_kernels.cc.o" "gcc" "cpp/cuda/CMakeFiles/_cuda_fake.dir/fake/fake_kernels.cc.o.d"
  "/work/wt11/cpp/cuda/fake/fake_runtime.cc" "cpp/cuda/CMakeFiles/_cuda_fake.dir/fake/fake_runtime.cc.o" "gcc" "cpp/cuda/CMakeFiles/_cuda_fake.dir/fake/fake_runtime.cc.o.d"
  "/work/wt11/cpp/cuda/kernels_common.cc" "cpp/cuda/CMakeFiles/_cuda_fake.dir/kernels_common.cc.o" "gcc" "cpp/cuda/CMakeFiles/_cuda_fake.dir/kernels_common.cc.o.d"
  )

# Targets to which this target links.
set(CMAKE_TARGET_LINKED_INFO_FILES
  "/work/wt11/build-dev/cpp/CMakeFiles/nanobind-static.dir/DependInfo.cmake"
  "/work/wt11/build-dev/cpp/cuda/CMakeFiles/jo_cuda_exec.dir/DependInfo.cmake"
  "/work/wt11/build-dev/cpp/CMakeFiles/jo_core.dir/DependInfo.cmake"
  )

# Fortran module output directory.
set(CMAKE_Fortran_TARGET_MODULE_DIR "")
