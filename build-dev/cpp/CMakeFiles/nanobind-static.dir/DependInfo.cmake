
# Consider dependencies only in project.
set(CMAKE_DEPENDS_IN_PROJECT_ONLY OFF)

# The set of languages for which implicit dependencies are needed:
set(CMAKE_DEPENDS_LANGUAGES
  )

# The set of dependency files which are needed:
set(CMAKE_DEPENDS_DEPENDENCY_FILES
  "/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/common.cpp" "cpp/CMakeFiles/nanobind-static.dir/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/common.cpp.o" "gcc" "cpp/CMakeFiles/nanobind-static.dir/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/common.cpp.o.d"
  "/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/error.cpp" "cpp/CMakeFiles/nanobind-static.dir/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/error.cpp.o" "gcc" "cpp/CMakeFiles/nanobind-static.dir/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/error.cpp.o.d"
  "/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/implicit.cpp" "cpp/CMakeFiles/nanobind-static.dir/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/implicit.cpp.o" "gcc" "cpp/CMakeFiles/nanobind-static.dir/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/implicit.cpp.o.d"
  "/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/nb_datetime.cpp" "cpp/CMakeFiles/nanobind-static.dir/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/nb_datetime.cpp.o" "gcc" "cpp/CMakeFiles/nanobind-static.dir/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/nb_datetime.cpp.o.d"
  "/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/nb_enum.cpp" "cpp/CMakeFiles/nanobind-static.dir/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/nb_enum.cpp.o" "gcc" "cpp/CMakeFiles/nanobind-static.dir/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/nb_enum.cpp.o.d"
  "/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/nb_func.cpp" "cpp/CMakeFiles/nanobind-static.dir/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/nb_func.cpp.o" "gcc" "cpp/CMakeFiles/nanobind-static.dir/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/nb_func.cpp.o.d"
  "/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/nb_internals.cpp" "cpp/CMakeFiles/nanobind-static.dir/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/nb_internals.cpp.o" "gcc" "cpp/CMakeFiles/nanobind-static.dir/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/nb_internals.cpp.o.d"
  "/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/nb_ndarray.cpp" "cpp/CMakeFiles/nanobind-static.dir/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/nb_ndarray.cpp.o" "gcc" "cpp/CMakeFiles/nanobind-static.dir/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/nb_ndarray.cpp.o.d"
  "/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/nb_static_property.cpp" "cpp/CMakeFiles/nanobind-static.dir/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/nb_static_property.cpp.o" "gcc" "cpp/CMakeFiles/nanobind-static.dir/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/nb_static_property.cpp.o.d"
  "/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/nb_type.cpp" "cpp/CMakeFiles/nanobind-static.dir/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/nb_type.cpp.o" "gcc" "cpp/CMakeFiles/nanobind-static.dir/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/nb_type.cpp.o.d"
  "/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/trampoline.cpp" "cpp/CMakeFiles/nanobind-static.dir/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/trampoline.cpp.o" "gcc" "cpp/CMakeFiles/nanobind-static.dir/work/main/.venv-py311/lib/python3.11/site-packages/nanobind/src/trampoline.cpp.o.d"
  )

# Targets to which this target links.
set(CMAKE_TARGET_LINKED_INFO_FILES
  )

# Fortran module output directory.
set(CMAKE_Fortran_TARGET_MODULE_DIR "")
