file(REMOVE_RECURSE
  "CMakeFiles/jo_cuda_exec.dir/check.cc.o"
  "CMakeFiles/jo_cuda_exec.dir/check.cc.o.d"
  "CMakeFiles/jo_cuda_exec.dir/clique_state.cc.o"
  "CMakeFiles/jo_cuda_exec.dir/clique_state.cc.o.d"
  "CMakeFiles/jo_cuda_exec.dir/cuda_bootstrap.cc.o"
  "CMakeFiles/jo_cuda_exec.dir/cuda_bootstrap.cc.o.d"
  "CMakeFiles/jo_cuda_exec.dir/cuda_clique.cc.o"
  "CMakeFiles/jo_cuda_exec.dir/cuda_clique.cc.o.d"
  "CMakeFiles/jo_cuda_exec.dir/cuda_site.cc.o"
  "CMakeFiles/jo_cuda_exec.dir/cuda_site.cc.o.d"
  "CMakeFiles/jo_cuda_exec.dir/device_memory.cc.o"
  "CMakeFiles/jo_cuda_exec.dir/device_memory.cc.o.d"
  "CMakeFiles/jo_cuda_exec.dir/driver.cc.o"
  "CMakeFiles/jo_cuda_exec.dir/driver.cc.o.d"
  "CMakeFiles/jo_cuda_exec.dir/executor.cc.o"
  "CMakeFiles/jo_cuda_exec.dir/executor.cc.o.d"
  "CMakeFiles/jo_cuda_exec.dir/gemm.cc.o"
  "CMakeFiles/jo_cuda_exec.dir/gemm.cc.o.d"
  "CMakeFiles/jo_cuda_exec.dir/peer_handles.cc.o"
  "CMakeFiles/jo_cuda_exec.dir/peer_handles.cc.o.d"
  "CMakeFiles/jo_cuda_exec.dir/transport_multicast.cc.o"
  "CMakeFiles/jo_cuda_exec.dir/transport_multicast.cc.o.d"
  "CMakeFiles/jo_cuda_exec.dir/transport_nccl.cc.o"
  "CMakeFiles/jo_cuda_exec.dir/transport_nccl.cc.o.d"
  "CMakeFiles/jo_cuda_exec.dir/transport_p2p.cc.o"
  "CMakeFiles/jo_cuda_exec.dir/transport_p2p.cc.o.d"
  "CMakeFiles/jo_cuda_exec.dir/watchdog.cc.o"
  "CMakeFiles/jo_cuda_exec.dir/watchdog.cc.o.d"
  "libjo_cuda_exec.a"
  "libjo_cuda_exec.pdb"
)

# Per-language clean rules from dependency scanning.
foreach(lang CXX)
  include(CMakeFiles/jo_cuda_exec.dir/cmake_clean_${lang}.cmake OPTIONAL)
endforeach()
