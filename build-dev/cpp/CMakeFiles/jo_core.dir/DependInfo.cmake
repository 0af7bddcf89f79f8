
# Consider dependencies only in project.
set(CMAKE_DEPENDS_IN_PROJECT_ONLY OFF)

# The set of languages for which implicit dependencies are needed:
set(CMAKE_DEPENDS_LANGUAGES
  )

# The set of dependency files which are needed:
set(CMAKE_DEPENDS_DEPENDENCY_FILES
  "/work/wt11/cpp/core/build.cc" "cpp/CMakeFiles/jo_core.dir/core/build.cc.o" "gcc" "cpp/CMakeFiles/jo_core.dir/core/build.cc.o.d"
  "/work/wt11/cpp/core/build_ag.cc" "cpp/CMakeFiles/jo_core.dir/core/build_ag.cc.o" "gcc" "cpp/CMakeFiles/jo_core.dir/core/build_ag.cc.o.d"
  "/work/wt11/cpp/core/build_rs.cc" "cpp/CMakeFiles/jo_core.dir/core/build_rs.cc.o" "gcc" "cpp/CMakeFiles/jo_core.dir/core/build_rs.cc.o.d"
  "/work/wt11/cpp/core/call.cc" "cpp/CMakeFiles/jo_core.dir/core/call.cc.o" "gcc" "cpp/CMakeFiles/jo_core.dir/core/call.cc.o.d"
  "/work/wt11/cpp/core/check_program.cc" "cpp/CMakeFiles/jo_core.dir/core/check_program.cc.o" "gcc" "cpp/CMakeFiles/jo_core.dir/core/check_program.cc.o.d"
  "/work/wt11/cpp/core/clique.cc" "cpp/CMakeFiles/jo_core.dir/core/clique.cc.o" "gcc" "cpp/CMakeFiles/jo_core.dir/core/clique.cc.o.d"
  "/work/wt11/cpp/core/convert.cc" "cpp/CMakeFiles/jo_core.dir/core/convert.cc.o" "gcc" "cpp/CMakeFiles/jo_core.dir/core/convert.cc.o.d"
  "/work/wt11/cpp/core/log.cc" "cpp/CMakeFiles/jo_core.dir/core/log.cc.o" "gcc" "cpp/CMakeFiles/jo_core.dir/core/log.cc.o.d"
  "/work/wt11/cpp/core/program.cc" "cpp/CMakeFiles/jo_core.dir/core/program.cc.o" "gcc" "cpp/CMakeFiles/jo_core.dir/core/program.cc.o.d"
  "/work/wt11/cpp/core/status.cc" "cpp/CMakeFiles/jo_core.dir/core/status.cc.o" "gcc" "cpp/CMakeFiles/jo_core.dir/core/status.cc.o.d"
  )

# Targets to which this target links.
set(CMAKE_TARGET_LINKED_INFO_FILES
  )

# Fortran module output directory.
set(CMAKE_Fortran_TARGET_MODULE_DIR "")
