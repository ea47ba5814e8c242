// SPDX-License-Identifier: Apache-2.0
// What the soak's clients share and check with (test-only): the valid problems they draw
// from, each with its requests and its checked answer, bit-for-bit comparison of replies, a
// whole FetchGradients, status code names and this process's RSS. Never runs load itself.
#ifndef LOSSD_TESTS_SOAK_SOAK_PROBLEMS_H_
#define LOSSD_TESTS_SOAK_SOAK_PROBLEMS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "lossd/v1/lossd.grpc.pb.h"
#include "testing/server_harness.h"
#include "testing/test_util.h"

namespace lossd {
namespace soak {

// The status code's name as the report counts it ("OTHER" for codes the soak never expects).
const char* CodeName(grpc::StatusCode c);

// VmRSS of this process in bytes (0 when unreadable).
uint64_t RssBytes();

// The valid problems the clients draw from: every dtype and reduction, bias, class weights,
// label smoothing, softcap, z-loss, int32 targets, a forced chunk size.
std::vector<RandomProblemSpec> ProblemSpecs();

struct Problem {
  std::unique_ptr<RandomProblem> rp;
  v1::ComputeHeader header;
  std::vector<v1::ComputeRequest> parts;
  // The same request overlapped (header.overlap, X last): must give the same bits.
  v1::ComputeHeader overlap_header;
  std::vector<v1::ComputeRequest> overlap_parts;
  // Checked against the reference once; every later OK must equal it.
  testing_harness::ComputeReply golden;
};

// The same loss bits, token count and output tensors.
bool SameReply(const testing_harness::ComputeReply& a, const testing_harness::ComputeReply& b);

struct Fetched {
  grpc::Status status;
  v1::GradientsHeader header;
  std::vector<uint8_t> dw, db;
};

// One whole FetchGradients of accumulator `name` within `deadline` seconds; dW and db
// poisoned (0xFF) where no part arrived.
Fetched Fetch(v1::Loss::Stub& stub, const std::string& name, bool reset, double deadline);

}  // namespace soak
}  // namespace lossd

#endif  // LOSSD_TESTS_SOAK_SOAK_PROBLEMS_H_
