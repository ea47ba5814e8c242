// SPDX-License-Identifier: Apache-2.0
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

// The harness's names, which every e2e test uses; this header is included by the e2e tests
// alone (tests/e2e_*_test.cc), so they are brought in once here.
using testing_harness::ComputeReply;
using testing_harness::Harness;
using testing_harness::HarnessOptions;
using testing_harness::HeaderFor;
using testing_harness::MetricValue;
using testing_harness::PartsFor;
using testing_harness::ReplyMatchesReference;
using testing_harness::RunCompute;

// BT=47, H=31, V=123 (nothing a multiple of 8), a tenth of the targets ignored.
RandomProblemSpec SmallSpec(DType dtype = DType::kBF16, uint64_t seed = 1);

// SmallSpec with W of (v, h): the same BT and ignored share, larger tensors.
RandomProblemSpec WideSpec(DType dtype, uint64_t seed, int64_t h, int64_t v);

// A valid request succeeds: used after every refusal to show the server keeps serving.
void ExpectServes(Harness& h);

// One server for every E2eTest, shared by the derived suites too.
class E2eTest : public testing_harness::SuiteHarness<E2eTest> {};

}  // namespace lossd

#endif  // LOSSD_TESTS_E2E_FIXTURE_H_
