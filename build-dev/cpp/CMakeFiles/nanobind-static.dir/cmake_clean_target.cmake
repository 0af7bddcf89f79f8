file(REMOVE_RECURSE
  "libnanobind-static.a"
)
