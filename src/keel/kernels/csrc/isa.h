// The ISA level the operators dispatch on: set once from keel.platform's probe (keel.kernels), and
// by tests that run every level the machine has.
#pragma once

#include "kernels.h"

namespace keel {

Isa current_isa();
int64_t set_kernel_isa(int64_t level);

}  // namespace keel
