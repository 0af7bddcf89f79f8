file(REMOVE_RECURSE
  "CMakeFiles/jo_cuda_kernels.dir/kernels.cu.o"
  "CMakeFiles/jo_cuda_kernels.dir/kernels.cu.o.d"
  "CMakeFiles/jo_cuda_kernels.dir/kernels_common.cc.o"
  "CMakeFiles/jo_cuda_kernels.dir/kernels_common.cc.o.d"
  "libjo_cuda_kernels.a"
  "libjo_cuda_kernels.pdb"
)

# Per-language clean rules from dependency scanning.
foreach(lang CUDA CXX)
  include(CMakeFiles/jo_cuda_kernels.dir/cmake_clean_${lang}.cmake OPTIONAL)
endforeach()
