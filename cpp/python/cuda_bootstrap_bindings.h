// The trace-time half of multi-process GPU cliques (cpp/cuda/clique/cuda_bootstrap.h),
// bound identically in _cuda and in the test-only _cuda_fake: jaxoverlap/_executors/bootstrap.py
// makes the NCCL unique id in the process of rank 0, moves it through the
// jax.distributed store (bootstrap.broadcast_bytes) and registers it here.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "cuda/clique/cuda_bootstrap.h"
#include "python/py_exchange.h"

namespace jo::python {

inline void BindCudaBootstrap(nanobind::module_& m) {
  namespace nb = nanobind;
  m.def(
      "nccl_unique_id",
      [] {
        std::string id;
        const Status status = cuda::NewNcclUniqueId(&id);
        if (!status.ok()) throw std::runtime_error(status.message());
        return nb::bytes(id.data(), id.size());
      },
      "ncclGetUniqueId as bytes (made by the process of rank 0 of a clique spanning processes).");
  m.def(
      "set_nccl_id",
      [](int64_t clique_key, int64_t group, int64_t process, nb::bytes id) {
        const Status status =
            cuda::RegisterNcclId(clique_key, group, process, std::string(id.c_str(), id.size()));
        if (!status.ok()) throw std::invalid_argument(status.message());
      },
      nb::arg("clique_key"), nb::arg("group"), nb::arg("process"), nb::arg("id"),
      "Registers the NCCL unique id of clique (clique_key, group) for `process`.");
  m.def(
      "set_exchange",
      [](int64_t clique_key, int64_t group, int64_t process, nb::object exchange) {
        const Status status = cuda::RegisterExchange(
            clique_key, group, process, std::make_shared<PyExchange>(std::move(exchange)));
        if (!status.ok()) throw std::invalid_argument(status.message());
      },
      nb::arg("clique_key"), nb::arg("group"), nb::arg("process"), nb::arg("exchange"),
      "Registers the clique's exchange (a bootstrap.StoreExchange) for `process`: p2p cliques "
      "spanning processes allgather their CUDA IPC handles through it at the first execution.");
  m.def("_forget_nccl_ids", &cuda::ForgetNcclIds, "Tests only: forget every id and exchange.");
}

}  // namespace jo::python
