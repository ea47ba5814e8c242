// SPDX-License-Identifier: Apache-2.0
#include "tests/soak/soak_problems.h"

#include <chrono>
#include <cstring>
#include <fstream>

namespace lossd {
namespace soak {

using testing_harness::ComputeReply;

const char* CodeName(grpc::StatusCode c) {
  switch (c) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    default: return "OTHER";
  }
}

uint64_t RssBytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

std::vector<RandomProblemSpec> ProblemSpecs() {
  std::vector<RandomProblemSpec> v;
  // a is also uploaded by handle and accumulated.
  RandomProblemSpec a = ShapeSpec(64, 64, 1000, DType::kBF16);
  a.bias = true;
  a.ignore_fraction = 0.1;
  a.seed = 101;
  v.push_back(a);
  RandomProblemSpec b = ShapeSpec(48, 32, 777, DType::kF16);
  b.bias = true;
  b.options.reduction = Reduction::kSum;
  b.options.label_smoothing = 0.1f;
  b.options.softcap = 30.0f;
  b.seed = 102;
  v.push_back(b);
  RandomProblemSpec c = ShapeSpec(33, 40, 500, DType::kF32);
  c.bias = true;
  c.class_weights = true;
  c.grad_output = true;
  c.options.reduction = Reduction::kNone;
  c.options.z_loss_scale = 1e-3f;
  c.ignore_fraction = 0.2;
  c.seed = 103;
  v.push_back(c);
  RandomProblemSpec d = ShapeSpec(128, 64, 2000, DType::kBF16);
  d.target_dtype = DType::kI32;
  d.class_weights = true;
  d.options.chunk_rows = 37;
  d.seed = 104;
  v.push_back(d);
  return v;
}

bool SameReply(const ComputeReply& a, const ComputeReply& b) {
  const float la = a.summary.loss(), lb = b.summary.loss();
  return std::memcmp(&la, &lb, 4) == 0 && a.summary.tokens() == b.summary.tokens() &&
         a.tensors == b.tensors;
}

Fetched Fetch(v1::Loss::Stub& stub, const std::string& name, bool reset, double deadline) {
  Fetched f;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(deadline * 1000)));
  v1::FetchGradientsRequest req;
  req.set_accumulator(name);
  req.set_reset(reset);
  auto reader = stub.FetchGradients(&ctx, req);
  v1::FetchGradientsResponse m;
  while (reader->Read(&m)) {
    if (m.has_header()) {
      f.header = m.header();
      f.dw.assign(f.header.dw().shape(0) * f.header.dw().shape(1) * 4, 0xFF);
      if (f.header.has_db()) f.db.assign(f.header.db().shape(0) * 4, 0xFF);
      continue;
    }
    auto& dst = m.part().tensor() == v1::TENSOR_DW ? f.dw : f.db;
    if (m.part().offset() + m.part().data().size() <= dst.size()) {
      std::memcpy(dst.data() + m.part().offset(), m.part().data().data(),
                  m.part().data().size());
    }
  }
  f.status = reader->Finish();
  return f;
}

}  // namespace soak
}  // namespace lossd
