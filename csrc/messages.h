// Numbers in error messages go through std::to_string, never an ostream.
//
// TORCH_CHECK formats mixed arguments with an ostringstream. With torch 2.11.0+cu130's
// wheel, `ostream << integer` inside this extension crashed the process
// (segmentation fault, 2026-12-04) instead of raising, while string-only messages were
// fine. Every number in a message of this extension is therefore wrapped in num().
#pragma once
#include <string>
#include <type_traits>

namespace mpzero {
template <class T>
std::string num(T x) {
  static_assert(std::is_arithmetic_v<T>, "num() formats numbers");
  return std::to_string(x);
}
}  // namespace mpzero
