# Empty compiler generated dependencies file for _cuda.
# This may be replaced when dependencies are built.
