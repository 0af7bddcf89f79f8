
# Consider dependencies only in project.
set(CMAKE_DEPENDS_IN_PROJECT_ONLY OFF)

# The set of languages for which implicit dependencies are needed:
set(CMAKE_DEPENDS_LANGUAGES
  )

# The set of dependency files which are needed:
set(CMAKE_DEPENDS_DEPENDENCY_FILES
  "/work/wt11/cpp/cuda/check.cc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/check.cc.o" "gcc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/check.cc.o.d"
  "/work/wt11/cpp/cuda/clique_state.cc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/clique_state.cc.o" "gcc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/clique_state.cc.o.d"
  "/work/wt11/cpp/cuda/cuda_bootstrap.cc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/cuda_bootstrap.cc.o" "gcc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/cuda_bootstrap.cc.o.d"
  "/work/wt11/cpp/cuda/cuda_clique.cc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/cuda_clique.cc.o" "gcc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/cuda_clique.cc.o.d"
  "/work/wt11/cpp/cuda/cuda_site.cc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/cuda_site.cc.o" "gcc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/cuda_site.cc.o.d"
  "/work/wt11/cpp/cuda/device_memory.cc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/device_memory.cc.o" "gcc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/device_memory.cc.o.d"
  "/work/wt11/cpp/cuda/driver.cc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/driver.cc.o" "gcc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/driver.cc.o.d"
  "/work/wt11/cpp/cuda/executor.cc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/executor.cc.o" "gcc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/executor.cc.o.d"
  "/work/wt11/cpp/cuda/gemm.cc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/gemm.cc.o" "gcc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/gemm.cc.o.d"
  "/work/wt11/cpp/cuda/peer_handles.cc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/peer_handles.cc.o" "gcc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/peer_handles.cc.o.d"
  "/work/wt11/cpp/cuda/transport_multicast.cc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/transport_multicast.cc.o" "gcc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/transport_multicast.cc.o.d"
  "/work/wt11/cpp/cuda/transport_nccl.cc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/transport_nccl.cc.o" "gcc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/transport_nccl.cc.o.d"
  "/work/wt11/cpp/cuda/transport_p2p.cc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/transport_p2p.cc.o" "gcc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/transport_p2p.cc.o.d"
  "/work/wt11/cpp/cuda/watchdog.cc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/watchdog.cc.o" "gcc" "cpp/cuda/CMakeFiles/jo_cuda_exec.dir/watchdog.cc.o.d"
  )

# Targets to which this target links.
set(CMAKE_TARGET_LINKED_INFO_FILES
  "/work/wt11/build-dev/cpp/CMakeFiles/jo_core.dir/DependInfo.cmake"
  )

# Fortran module output directory.
set(CMAKE_Fortran_TARGET_MODULE_DIR "")
