file(REMOVE_RECURSE
  "CMakeFiles/jo_core.dir/core/build.cc.o"
  "CMakeFiles/jo_core.dir/core/build.cc.o.d"
  "CMakeFiles/jo_core.dir/core/build_ag.cc.o"
  "CMakeFiles/jo_core.dir/core/build_ag.cc.o.d"
  "CMakeFiles/jo_core.dir/core/build_rs.cc.o"
  "CMakeFiles/jo_core.dir/core/build_rs.cc.o.d"
  "CMakeFiles/jo_core.dir/core/call.cc.o"
  "CMakeFiles/jo_core.dir/core/call.cc.o.d"
  "CMakeFiles/jo_core.dir/core/check_program.cc.o"
  "CMakeFiles/jo_core.dir/core/check_program.cc.o.d"
  "CMakeFiles/jo_core.dir/core/clique.cc.o"
  "CMakeFiles/jo_core.dir/core/clique.cc.o.d"
  "CMakeFiles/jo_core.dir/core/convert.cc.o"
  "CMakeFiles/jo_core.dir/core/convert.cc.o.d"
  "CMakeFiles/jo_core.dir/core/log.cc.o"
  "CMakeFiles/jo_core.dir/core/log.cc.o.d"
  "CMakeFiles/jo_core.dir/core/program.cc.o"
  "CMakeFiles/jo_core.dir/core/program.cc.o.d"
  "CMakeFiles/jo_core.dir/core/status.cc.o"
  "CMakeFiles/jo_core.dir/core/status.cc.o.d"
  "libjo_core.a"
  "libjo_core.pdb"
)

# Per-language clean rules from dependency scanning.
foreach(lang CXX)
  include(CMakeFiles/jo_core.dir/cmake_clean_${lang}.cmake OPTIONAL)
endforeach()
