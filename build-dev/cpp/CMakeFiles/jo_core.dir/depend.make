# Empty dependencies file for jo_core.
# This may be replaced when dependencies are built.
