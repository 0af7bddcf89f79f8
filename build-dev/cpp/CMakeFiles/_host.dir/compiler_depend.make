# Empty compiler generated dependencies file for _host.
# This may be replaced when dependencies are built.
