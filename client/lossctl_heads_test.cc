// SPDX-License-Identifier: Apache-2.0
// lossctl's hosted-head commands (head create|step|export|import|info|list|drop) against the
// fake lossd; the other commands are in lossctl_test.cc.
#include <string>

#include "absl/strings/str_cat.h"
#include "client/host_tensor.h"
#include "client/npy.h"
#include "core/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/client/lossctl_test_fixture.h"

namespace lossd {
namespace client {
namespace {

using ::testing::HasSubstr;
using lossctl_testing::LossctlTest;
using lossctl_testing::RandomF32;
using lossctl_testing::Result;
using lossctl_testing::SameBytes;

TEST_F(LossctlTest, HeadLifecycle) {
  {
    absl::MutexLock lock(&fake_.mu);
    fake_.features = {"hosted_head", "list_state"};
  }
  Result r = Lossctl("head create --head=h1 --v=9 --h=4 --with_bias --lr=0.002 --amsgrad "
                     "--beta2=0.95 --compute_dtype=bf16");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("created         yes\n"));
  EXPECT_THAT(r.output, HasSubstr("shape           (9, 4) with bias\n"));
  EXPECT_THAT(r.output, HasSubstr("optimizer       adamw lr 0.002 betas (0.9, 0.95) eps 1e-08 "
                                  "weight_decay 0.01 amsgrad"));
  const v1::HeadHeader h = fake_.heads.last_create_header();
  EXPECT_EQ(h.w().dtype(), v1::DTYPE_FP32);  // random masters are fp32
  EXPECT_EQ(h.bias().shape(0), 9);
  EXPECT_EQ(h.optimizer().lr(), 0.002);
  EXPECT_TRUE(h.optimizer().amsgrad());
  EXPECT_FALSE(h.with_state());

  // compute --head learns V, H and the dtype from the head's info.
  r = Lossctl("compute --head=h1 --bt=3 --rank=1 --micro_batch=2 --want=dx");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("head        version 0, added to its step\n"));
  {
    absl::MutexLock lock(&fake_.mu);
    EXPECT_EQ(fake_.last_header.head(), "h1");
    EXPECT_EQ(fake_.last_header.rank(), 1u);
    EXPECT_EQ(fake_.last_header.micro_batch(), 2u);
    EXPECT_EQ(fake_.last_header.x().dtype(), v1::DTYPE_BF16);
    EXPECT_EQ(fake_.last_header.x().shape(1), 4);
  }
  r = Lossctl("compute --head=h1 --bt=3 --rank=1 --micro_batch=2 --want=dx");
  EXPECT_THAT(r.output, HasSubstr("not added: its (rank, micro_batch) was there"));

  r = Lossctl("head step --head=h1 --head_version=0 --lr=0.001 --clip_coef=0.5");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("version         1\n"));
  EXPECT_THAT(r.output, HasSubstr("applied         yes\n"));
  EXPECT_THAT(r.output, HasSubstr("contributions   1 (3 tokens)\n"));
  EXPECT_EQ(fake_.heads.last_step().lr(), 0.001);
  EXPECT_EQ(fake_.heads.last_step().clip_coef(), 0.5f);
  ExpectFails("head step --head=h1 --head_version=0",
              "lossctl head step: FAILED_PRECONDITION: head 'h1' is at version 1, not 0");

  r = Lossctl("head export --head=h1 --range_bytes=64 --out_dir=" + Path("exp"));
  ASSERT_EQ(r.code, 0) << r.output;
  // master, 3 states (amsgrad) of 36 + 9 fp32 values, the bf16 copies: 810 bytes.
  EXPECT_THAT(r.output, HasSubstr("over 13 range(s)"));
  HostTensor master = Read("exp/master_w.npy");
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(master.data()), master.num_bytes()),
            fake_.heads.Tensor("h1", v1::TENSOR_HEAD_MASTER_W));
  HostTensor copy = Read("exp/copy_bias.npy");
  HostTensor bias = Read("exp/master_bias.npy");
  ASSERT_EQ(copy.dtype(), DType::kBF16);
  ASSERT_EQ(copy.num_elements(), 9);
  for (int i = 0; i < 9; ++i) {
    EXPECT_EQ(copy.data_as<uint16_t>()[i], FloatToBf16(bias.data_as<float>()[i])) << i;
  }
  EXPECT_EQ(Read("exp/exp_avg_sq_w.npy").shape(), (std::vector<int64_t>{9, 4}));

  ASSERT_EQ(Lossctl("head drop --head=h1").code, 0);
  ExpectFails("head info --head=h1",
              "lossctl head info: NOT_FOUND: head 'h1' not found on this server");
  r = Lossctl("head import --in_dir=" + Path("exp"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("version         1\n"));
  EXPECT_EQ(fake_.heads.Tensor("h1", v1::TENSOR_HEAD_MASTER_W),
            std::string(reinterpret_cast<const char*>(master.data()), master.num_bytes()));
  EXPECT_EQ(fake_.heads.last_create_header().optimizer().beta2(), 0.95);
  EXPECT_EQ(fake_.heads.last_create_header().optimizer_step(), 1);
  ASSERT_EQ(Lossctl("head import --head=h2 --in_dir=" + Path("exp")).code, 0);
  r = Lossctl("head info --head=h2 --json");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, ::testing::StartsWith("{\"command\": \"head info\", \"ok\": true, "
                                              "\"name\": \"h2\", "));
  EXPECT_THAT(r.output, HasSubstr("\"version\": 1, \"optimizer_step\": 1, "));
  r = Lossctl("head list");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, ::testing::ContainsRegex("\nh1 +1 +[0-9]+ +[-0-9.]+ +0 -\n"));
  EXPECT_THAT(r.output, ::testing::ContainsRegex("\nh2 +1 "));
  r = Lossctl("list");
  EXPECT_THAT(r.output, ::testing::ContainsRegex("head +h1 +[0-9]+ +[-0-9.]+ 0 \\(version 1\\)"));
}

TEST_F(LossctlTest, HeadCreateFromState) {
  {
    absl::MutexLock lock(&fake_.mu);
    fake_.features = {"hosted_head"};
  }
  HostTensor w = RandomF32({7, 3}, 5);
  HostTensor momentum = RandomF32({7, 3}, 6);
  ASSERT_EQ(std::system(("mkdir -p " + Path("state")).c_str()), 0);
  ASSERT_TRUE(WriteNpy(Path("w.npy"), w).ok());
  ASSERT_TRUE(WriteNpy(Path("state/exp_avg_w.npy"), momentum).ok());
  Result r = Lossctl(absl::StrCat("head create --head=s --w=", Path("w.npy"),
                                  " --optimizer=sgd --momentum=0.9 --nesterov --weight_decay=0.1",
                                  " --compute_dtype=fp16 --optimizer_step=3 --head_version=3",
                                  " --state_dir=", Path("state")));
  ASSERT_EQ(r.code, 0) << r.output;
  const v1::HeadHeader h = fake_.heads.last_create_header();
  EXPECT_EQ(h.optimizer().kind(), v1::OPTIMIZER_SGD);
  EXPECT_EQ(h.optimizer().weight_decay(), 0.1);
  EXPECT_TRUE(h.optimizer().nesterov());
  EXPECT_EQ(h.compute_dtype(), v1::DTYPE_FP16);
  EXPECT_EQ(h.version(), 3u);
  EXPECT_TRUE(h.with_state());
  EXPECT_EQ(fake_.heads.Tensor("s", v1::TENSOR_HEAD_EXP_AVG_W),
            std::string(reinterpret_cast<const char*>(momentum.data()), momentum.num_bytes()));
  EXPECT_EQ(fake_.heads.Tensor("s", v1::TENSOR_HEAD_MASTER_W),
            std::string(reinterpret_cast<const char*>(w.data()), w.num_bytes()));
}

// A head group: create and import name it (members, this member, id) and info shows it, with
// the member each rank's Computes and Steps go to.
TEST_F(LossctlTest, HeadGroupIsSentAndShown) {
  {
    absl::MutexLock lock(&fake_.mu);
    fake_.features = {"hosted_head", "list_state"};
  }
  Result r = Lossctl("head create --head=g --v=5 --h=3 --group_members=10.0.0.1:7,10.0.0.2:7,"
                     "10.0.0.3:7 --group_member=1 --group_id=job-17");
  ASSERT_EQ(r.code, 0) << r.output;
  v1::HeadHeader h = fake_.heads.last_create_header();
  ASSERT_EQ(h.group().members_size(), 3);
  EXPECT_EQ(h.group().members(2), "10.0.0.3:7");
  EXPECT_EQ(h.group().member(), 1u);
  EXPECT_EQ(h.group().id(), "job-17");
  EXPECT_THAT(r.output, HasSubstr("group           member 1 of 3, id job-17; rank r's Computes "
                                  "and Steps go to member r % 3:\n"));
  EXPECT_THAT(r.output, HasSubstr("                1 10.0.0.2:7 (this server)\n"));
  r = Lossctl("head info --head=g --json");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("\"group\": [\"10.0.0.1:7\", \"10.0.0.2:7\", \"10.0.0.3:7\"], "
                                  "\"group_member\": 1, \"group_id\": \"job-17\""));
  // One server's head shows no group.
  ASSERT_EQ(Lossctl("head create --head=one --v=5 --h=3").code, 0);
  r = Lossctl("head info --head=one");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("group")));
  EXPECT_FALSE(fake_.heads.last_create_header().has_group());
  // With --world_size, each member's ranks (r % 3) beside it.
  r = Lossctl("head info --head=g --world_size=5");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("                0 10.0.0.1:7, ranks 0, 3\n"
                                  "                1 10.0.0.2:7 (this server), ranks 1, 4\n"
                                  "                2 10.0.0.3:7, rank 2\n"));
  r = Lossctl("head info --head=g --world_size=2 --json");
  EXPECT_THAT(r.output, HasSubstr("\"rank_members\": [\"10.0.0.1:7\", \"10.0.0.2:7\"]"));
  r = Lossctl("head info --head=g --world_size=2");
  EXPECT_THAT(r.output, HasSubstr("                2 10.0.0.3:7, no rank\n"));
  // The list shows each head's group (this member of it), "-" for one server's.
  r = Lossctl("head list");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, ::testing::ContainsRegex("\ng +0 +[0-9]+ +[-0-9.]+ +0 member 1 of 3, "
                                                 "id job-17\n"));
  EXPECT_THAT(r.output, ::testing::ContainsRegex("\none +0 +[0-9]+ +[-0-9.]+ +0 -\n"));
  r = Lossctl("head list --json");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("\"contributions\": 0, \"group\": [\"10.0.0.1:7\", "
                                  "\"10.0.0.2:7\", \"10.0.0.3:7\"], \"group_member\": 1, "
                                  "\"group_id\": \"job-17\"}"));
  // An import into a new group.
  ASSERT_EQ(Lossctl("head export --head=g --out_dir=" + Path("g")).code, 0);
  ASSERT_EQ(Lossctl("head drop --head=g").code, 0);
  r = Lossctl("head import --in_dir=" + Path("g") + " --group_members=10.0.0.1:7,10.0.0.3:7 "
              "--group_id=job-18");
  ASSERT_EQ(r.code, 0) << r.output;
  h = fake_.heads.last_create_header();
  ASSERT_EQ(h.group().members_size(), 2);
  EXPECT_EQ(h.group().member(), 0u);
  EXPECT_EQ(h.group().id(), "job-18");
  EXPECT_TRUE(h.with_state());
  EXPECT_THAT(r.output, HasSubstr("member 0 of 2, id job-18"));

  ExpectFails("head create --head=x --v=3 --h=2 --group_members=a:1,b:2 --group_member=2 "
              "--group_id=i", "--group_member must be < 2 (the --group_members given), got 2");
  ExpectFails("head create --head=x --v=3 --h=2 --group_members=a:1,b:2",
              "--group_members needs --group_id");
  ExpectFails("head create --head=x --v=3 --h=2 --group_id=i",
              "--group_member and --group_id name a head group: give its --group_members too");
}

TEST_F(LossctlTest, HeadUsageErrors) {
  {
    absl::MutexLock lock(&fake_.mu);
    fake_.features = {"hosted_head"};
  }
  Result r;
  ExpectFails("head create --v=3 --h=2", "head create needs --head");
  ExpectFails("head frob", "unknown head command 'frob': create, step, export, import");
  ExpectFails("head export --head=h", "head export needs --out_dir");
  ExpectFails("head export --head=h --out_dir=/tmp/x --range_bytes=0", "--range_bytes must be > 0");
  ExpectFails("head import", "head import needs --in_dir");
  ExpectFails("head import --in_dir=" + Path("none"), "(written last by head export");
  ExpectFails("head step --head=h --phase=half",
              "--phase must be full, reduce or apply, got 'half'");
  ExpectFails("head create --head=x --v=3 --h=2 --optimizer=adam",
              "--optimizer must be adamw or sgd, got 'adam'");
  ExpectFails("head create --head=x --v=3 --h=2 --compute_dtype=int32",
              "--compute_dtype must be bf16, fp16 or fp32, got 'int32'");
  ExpectFails("head create --head=x --v=3 --h=2 --state_dir=" + Path("none"),
              "NOT_FOUND");
  ExpectFails("head step --head=h --clip_coef=0.5 --max_norm=1",
              "INVALID_ARGUMENT: give clip_coef (0.5) or max_norm (1), not both");
  ExpectFails("compute --head=h --v=3 --h=2 --bt=2 --with_bias",
              "--head is the weight and the accumulator: give it without --w");
  ASSERT_EQ(std::system(("mkdir -p " + Path("bad") + " && printf 'name h\\nv 3\\n' > " +
                         Path("bad/head.txt")).c_str()), 0);
  ExpectFails("head import --in_dir=" + Path("bad"), "head.txt has no 'h'");
  r = Lossctl("head");
  EXPECT_EQ(r.code, 2) << r.output;  // usage
  EXPECT_THAT(r.output, HasSubstr("head create "));
  absl::MutexLock lock(&fake_.mu);
  EXPECT_TRUE(fake_.peers.empty());  // none of these reached the server's Compute or Info
}


}  // namespace
}  // namespace client
}  // namespace lossd
