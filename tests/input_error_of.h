// The tests' way to check a refused input: runs f, expects peftplan's InputError, and returns its
// message (empty, with a test failure, when f does not throw one).
#pragma once

#include <string>

#include <gtest/gtest.h>

#include "peftplan/common/error.h"

namespace peftplan::testing {

template <typename F>
std::string input_error_of(F&& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected InputError";
  return {};
}

}  // namespace peftplan::testing
