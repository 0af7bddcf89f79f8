# Empty dependencies file for jaxoverlap_testing.
# This may be replaced when dependencies are built.
