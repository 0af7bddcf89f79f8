
# Consider dependencies only in project.
set(CMAKE_DEPENDS_IN_PROJECT_ONLY OFF)

# The set of languages for which implicit dependencies are needed:
set(CMAKE_DEPENDS_LANGUAGES
  )

# The set of dependency files which are needed:
set(CMAKE_DEPENDS_DEPENDENCY_FILES
  "/work/wt11/cpp/host/blas.cc" "cpp/CMakeFiles/jo_host.dir/host/blas.cc.o" "gcc" "cpp/CMakeFiles/jo_host.dir/host/blas.cc.o.d"
  "/work/wt11/cpp/host/executor.cc" "cpp/CMakeFiles/jo_host.dir/host/executor.cc.o" "gcc" "cpp/CMakeFiles/jo_host.dir/host/executor.cc.o.d"
  "/work/wt11/cpp/host/fd_share.cc" "cpp/CMakeFiles/jo_host.dir/host/fd_share.cc.o" "gcc" "cpp/CMakeFiles/jo_host.dir/host/fd_share.cc.o.d"
  "/work/wt11/cpp/host/ffi_handlers.cc" "cpp/CMakeFiles/jo_host.dir/host/ffi_handlers.cc.o" "gcc" "cpp/CMakeFiles/jo_host.dir/host/ffi_handlers.cc.o.d"
  "/work/wt11/cpp/host/host_clique.cc" "cpp/CMakeFiles/jo_host.dir/host/host_clique.cc.o" "gcc" "cpp/CMakeFiles/jo_host.dir/host/host_clique.cc.o.d"
  "/work/wt11/cpp/host/host_site.cc" "cpp/CMakeFiles/jo_host.dir/host/host_site.cc.o" "gcc" "cpp/CMakeFiles/jo_host.dir/host/host_site.cc.o.d"
  "/work/wt11/cpp/host/shm.cc" "cpp/CMakeFiles/jo_host.dir/host/shm.cc.o" "gcc" "cpp/CMakeFiles/jo_host.dir/host/shm.cc.o.d"
  "/work/wt11/cpp/host/shm_clique.cc" "cpp/CMakeFiles/jo_host.dir/host/shm_clique.cc.o" "gcc" "cpp/CMakeFiles/jo_host.dir/host/shm_clique.cc.o.d"
  "/work/wt11/cpp/host/shm_domain.cc" "cpp/CMakeFiles/jo_host.dir/host/shm_domain.cc.o" "gcc" "cpp/CMakeFiles/jo_host.dir/host/shm_domain.cc.o.d"
  "/work/wt11/cpp/host/workers.cc" "cpp/CMakeFiles/jo_host.dir/host/workers.cc.o" "gcc" "cpp/CMakeFiles/jo_host.dir/host/workers.cc.o.d"
  )

# Targets to which this target links.
set(CMAKE_TARGET_LINKED_INFO_FILES
  "/work/wt11/build-dev/cpp/CMakeFiles/jo_core.dir/DependInfo.cmake"
  )

# Fortran module output directory.
set(CMAKE_Fortran_TARGET_MODULE_DIR "")
