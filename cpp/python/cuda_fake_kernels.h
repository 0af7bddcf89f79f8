// jaxoverlap._cuda_fake: the bindings of the kernel tests (cuda_fake_kernels.cc).
#pragma once

#include <nanobind/nanobind.h>

namespace jo::python {

void BindFakeKernels(nanobind::module_& m);

}  // namespace jo::python
