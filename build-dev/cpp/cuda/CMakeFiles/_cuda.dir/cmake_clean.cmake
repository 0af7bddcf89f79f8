file(REMOVE_RECURSE
  "CMakeFiles/_cuda.dir/__/python/cuda_module.cc.o"
  "CMakeFiles/_cuda.dir/__/python/cuda_module.cc.o.d"
  "CMakeFiles/_cuda.dir/ffi_handlers.cc.o"
  "CMakeFiles/_cuda.dir/ffi_handlers.cc.o.d"
  "_cuda.cpython-311-x86_64-linux-gnu.so"
  "_cuda.pdb"
)

# Per-language clean rules from dependency scanning.
foreach(lang CXX)
  include(CMakeFiles/_cuda.dir/cmake_clean_${lang}.cmake OPTIONAL)
endforeach()
