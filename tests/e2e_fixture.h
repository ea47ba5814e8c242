// What the end-to-end tests share (test-only): the small odd-shaped problem they all start
// from, the check that a server still serves after a refusal, and E2eTest, one in-process
// server per test binary for the tests that need no limit of their own. It never configures
// limits: a test that checks one starts its own Harness.
#ifndef LOSSD_TESTS_E2E_FIXTURE_H_
#define LOSSD_TESTS_E2E_FIXTURE_H_

#include <cstdint>

#include "gtest/gtest.h"
#include "testing/server_harness.h"
#include "testing/test_util.h"

namespace lossd {

// BT=47, H=31, V=123 (nothing a multiple of 8), a tenth of the targets ignored.
RandomProblemSpec SmallSpec(DType dtype = DType::kBF16, uint64_t seed = 1);

// A valid request succeeds: used after every refusal to show the server keeps serving.
void ExpectServes(testing_harness::Harness& h);

class E2eTest : public ::testing::Test {
 protected:
  // Shared by the derived suites too (SetUpTestSuite runs once per suite).
  static void SetUpTestSuite() {
    if (h_ == nullptr) h_ = new testing_harness::Harness();
  }
  static testing_harness::Harness* h_;
};

}  // namespace lossd

#endif  // LOSSD_TESTS_E2E_FIXTURE_H_
