file(REMOVE_RECURSE
  "CMakeFiles/jaxoverlap_testing.dir/python/testing_module.cc.o"
  "CMakeFiles/jaxoverlap_testing.dir/python/testing_module.cc.o.d"
  "jaxoverlap_testing.cpython-311-x86_64-linux-gnu.so"
  "jaxoverlap_testing.pdb"
)

# Per-language clean rules from dependency scanning.
foreach(lang CXX)
  include(CMakeFiles/jaxoverlap_testing.dir/cmake_clean_${lang}.cmake OPTIONAL)
endforeach()
