file(REMOVE_RECURSE
  "CMakeFiles/_host.dir/python/host_module.cc.o"
  "CMakeFiles/_host.dir/python/host_module.cc.o.d"
  "_host.cpython-311-x86_64-linux-gnu.so"
  "_host.pdb"
)

# Per-language clean rules from dependency scanning.
foreach(lang CXX)
  include(CMakeFiles/_host.dir/cmake_clean_${lang}.cmake OPTIONAL)
endforeach()
