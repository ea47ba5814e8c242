// SPDX-License-Identifier: Apache-2.0
// lossctl compute --kind=distill from the teacher's top-k (--teacher_topk_ids,
// --teacher_topk_logp, --topk_tail) against the fake lossd: what reaches the header and the
// wire, and what is refused; the other commands are in lossctl_test.cc.
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/host_tensor.h"
#include "client/npy.h"
#include "core/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.pb.h"
#include "testing/client/lossctl_test_fixture.h"

namespace lossd {
namespace client {
namespace {

using lossctl_testing::LossctlTest;
using lossctl_testing::RandomF32;
using lossctl_testing::Result;

TEST_F(LossctlTest, DistillTopkTravelsWithoutATeacherHead) {
  HostTensor ids = HostTensor::Owned(DType::kI32, {5, 3});
  for (int64_t i = 0; i < ids.num_elements(); ++i) {
    ids.mutable_data_as<int32_t>()[i] = static_cast<int32_t>((i * 7) % 9);
  }
  const HostTensor logp = RandomF32({5, 3}, 61);
  ASSERT_TRUE(WriteNpy(Path("ids.npy"), ids).ok());
  ASSERT_TRUE(WriteNpy(Path("logp.npy"), logp).ok());
  const std::string topk =
      absl::StrCat(" --teacher_topk_ids=", Path("ids.npy"), " --teacher_topk_logp=",
                   Path("logp.npy"));
  Result r = Lossctl("compute --kind=distill --bt=5 --h=4 --v=9 --topk_tail=renormalize" + topk);
  ASSERT_EQ(r.code, 0) << r.output;
  {
    absl::MutexLock lock(&fake_.mu);
    const v1::ComputeHeader& h = fake_.last_header;
    EXPECT_EQ(h.kind(), v1::LOSS_KIND_DISTILL);
    EXPECT_EQ(h.distill().topk_tail(), v1::TOPK_TAIL_RENORMALIZE);
    EXPECT_EQ(h.teacher_topk_ids().dtype(), v1::DTYPE_INT32);
    EXPECT_EQ(h.teacher_topk_ids().shape(1), 3);
    EXPECT_EQ(h.teacher_topk_logp().dtype(), v1::DTYPE_FP32);
    EXPECT_FALSE(h.has_teacher_x() || h.has_teacher_w());  // no random teacher head beside
    EXPECT_EQ(0, std::memcmp(fake_.last_data[v1::TENSOR_TEACHER_TOPK_IDS].data(), ids.data(),
                             ids.num_bytes()));
    EXPECT_EQ(0, std::memcmp(fake_.last_data[v1::TENSOR_TEACHER_TOPK_LOGP].data(), logp.data(),
                             logp.num_bytes()));
  }
  r = Lossctl("compute --kind=distill --bt=5 --h=4 --v=9" + topk);
  ASSERT_EQ(r.code, 0) << r.output;
  {
    absl::MutexLock lock(&fake_.mu);
    EXPECT_EQ(fake_.last_header.distill().topk_tail(), v1::TOPK_TAIL_BUCKET);
  }
  ExpectFails("compute --kind=distill --bt=5 --h=4 --v=9 --teacher_topk_ids=" + Path("ids.npy"),
              "a top-k teacher takes both --teacher_topk_ids and --teacher_topk_logp");
  ExpectFails("compute --kind=distill --bt=5 --h=4 --v=9 --topk_tail=all" + topk,
              "--topk_tail must be one of bucket, renormalize, none, got 'all'");
  ExpectFails("compute --kind=logprob --bt=5 --h=4 --v=9" + topk,
              "--kind=logprob does not take --teacher_topk_ids (distill), --teacher_topk_logp "
              "(distill)");
}

}  // namespace
}  // namespace client
}  // namespace lossd
