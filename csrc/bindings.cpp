// pybind11 entry point of mpzero._C. Each kernel family registers itself here.
#include <torch/extension.h>

#include "mpzero.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mpzero CUDA kernels";
  m.def("fill_scalar", &mpzero::fill_scalar, "Fill a CUDA tensor with a value (build-path smoke test)");
}
