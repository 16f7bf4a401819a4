// Declarations of the host entry points bound in bindings.cpp.
#pragma once
#include <torch/extension.h>

namespace mpzero {
void fill_scalar(at::Tensor t, double value);
}  // namespace mpzero
