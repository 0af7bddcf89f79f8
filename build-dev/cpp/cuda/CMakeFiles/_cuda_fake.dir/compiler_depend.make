# Empty compiler generated dependencies file for _cuda_fake.
# This may be replaced when dependencies are built.
