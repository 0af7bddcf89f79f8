# Empty compiler generated dependencies file for jo_cuda_exec.
# This may be replaced when dependencies are built.
