# Empty dependencies file for jo_host.
# This may be replaced when dependencies are built.
