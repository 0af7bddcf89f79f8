
# Consider dependencies only in project.
set(CMAKE_DEPENDS_IN_PROJECT_ONLY OFF)

# The set of languages for which implicit dependencies are needed:
set(CMAKE_DEPENDS_LANGUAGES
  )

# The set of dependency files which are needed:
set(CMAKE_DEPENDS_DEPENDENCY_FILES
  "/work/wt11/cpp/python/testing_module.cc" "cpp/CMakeFiles/jaxoverlap_testing.dir/python/testing_module.cc.o" "gcc" "cpp/CMakeFiles/jaxoverlap_testing.dir/python/testing_module.cc.o.d"
  )

# Targets to which this target links.
set(CMAKE_TARGET_LINKED_INFO_FILES
  "/work/wt11/build-dev/cpp/CMakeFiles/nanobind-static.dir/DependInfo.cmake"
  "/work/wt11/build-dev/cpp/CMakeFiles/jo_host.dir/DependInfo.cmake"
  "/work/wt11/build-dev/cpp/CMakeFiles/jo_core.dir/DependInfo.cmake"
  )

# Fortran module output directory.
set(CMAKE_Fortran_TARGET_MODULE_DIR "")
