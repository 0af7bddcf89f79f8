file(REMOVE_RECURSE
  "libjo_core.a"
)
