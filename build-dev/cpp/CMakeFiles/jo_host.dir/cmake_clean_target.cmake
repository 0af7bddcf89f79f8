file(REMOVE_RECURSE
  "libjo_host.a"
)
