file(REMOVE_RECURSE
  "CMakeFiles/jo_host.dir/host/blas.cc.o"
  "CMakeFiles/jo_host.dir/host/blas.cc.o.d"
  "CMakeFiles/jo_host.dir/host/executor.cc.o"
  "CMakeFiles/jo_host.dir/host/executor.cc.o.d"
  "CMakeFiles/jo_host.dir/host/fd_share.cc.o"
  "CMakeFiles/jo_host.dir/host/fd_share.cc.o.d"
  "CMakeFiles/jo_host.dir/host/ffi_handlers.cc.o"
  "CMakeFiles/jo_host.dir/host/ffi_handlers.cc.o.d"
  "CMakeFiles/jo_host.dir/host/host_clique.cc.o"
  "CMakeFiles/jo_host.dir/host/host_clique.cc.o.d"
  "CMakeFiles/jo_host.dir/host/host_site.cc.o"
  "CMakeFiles/jo_host.dir/host/host_site.cc.o.d"
  "CMakeFiles/jo_host.dir/host/shm.cc.o"
  "CMakeFiles/jo_host.dir/host/shm.cc.o.d"
  "CMakeFiles/jo_host.dir/host/shm_clique.cc.o"
  "CMakeFiles/jo_host.dir/host/shm_clique.cc.o.d"
  "CMakeFiles/jo_host.dir/host/shm_domain.cc.o"
  "CMakeFiles/jo_host.dir/host/shm_domain.cc.o.d"
  "CMakeFiles/jo_host.dir/host/workers.cc.o"
  "CMakeFiles/jo_host.dir/host/workers.cc.o.d"
  "libjo_host.a"
  "libjo_host.pdb"
)

# Per-language clean rules from dependency scanning.
foreach(lang CXX)
  include(CMakeFiles/jo_host.dir/cmake_clean_${lang}.cmake OPTIONAL)
endforeach()
