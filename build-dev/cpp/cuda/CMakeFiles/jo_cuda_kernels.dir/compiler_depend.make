# Empty compiler generated dependencies file for jo_cuda_kernels.
# This may be replaced when dependencies are built.
