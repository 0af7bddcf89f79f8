file(REMOVE_RECURSE
  "CMakeFiles/_cuda_fake.dir/__/python/cuda_fake_module.cc.o"
  "CMakeFiles/_cuda_fake.dir/__/python/cuda_fake_module.cc.o.d"
  "CMakeFiles/_cuda_fake.dir/fake/fake_kernels.cc.o"
  "CMakeFiles/_cuda_fake.dir/fake/fake_kernels.cc.o.d"
  "CMakeFiles/_cuda_fake.dir/fake/fake_runtime.cc.o"
  "CMakeFiles/_cuda_fake.dir/fake/fake_runtime.cc.o.d"
  "CMakeFiles/_cuda_fake.dir/kernels_common.cc.o"
  "CMakeFiles/_cuda_fake.dir/kernels_common.cc.o.d"
  "_cuda_fake.cpython-311-x86_64-linux-gnu.so"
  "_cuda_fake.pdb"
)

# Per-language clean rules from dependency scanning.
foreach(lang CXX)
  include(CMakeFiles/_cuda_fake.dir/cmake_clean_${lang}.cmake OPTIONAL)
endforeach()
