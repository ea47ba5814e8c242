// SPDX-License-Identifier: Apache-2.0
// OutputTensorName: the names the client's messages and lossctl's output files use.
#include "client/client_types.h"

#include <string>

#include "gtest/gtest.h"

namespace lossd {
namespace client {
namespace {

TEST(OutputTensorNameTest, NamesEveryOutputAndOnlyThose) {
  EXPECT_STREQ(OutputTensorName(OutputTensor::kLoss), "loss");
  EXPECT_STREQ(OutputTensorName(OutputTensor::kLse), "lse");
  EXPECT_STREQ(OutputTensorName(OutputTensor::kZLoss), "z_loss");
  EXPECT_STREQ(OutputTensorName(OutputTensor::kPredictions), "predictions");
  EXPECT_STREQ(OutputTensorName(OutputTensor::kDx), "dx");
  EXPECT_STREQ(OutputTensorName(OutputTensor::kDw), "dw");
  EXPECT_STREQ(OutputTensorName(OutputTensor::kDb), "db");
  EXPECT_STREQ(OutputTensorName(OutputTensor::kLogp), "logp");
  EXPECT_STREQ(OutputTensorName(OutputTensor::kEntropy), "entropy");
  EXPECT_STREQ(OutputTensorName(static_cast<OutputTensor>(15)), "unknown");
  EXPECT_STREQ(OutputTensorName(static_cast<OutputTensor>(25)), "unknown");
  EXPECT_STREQ(OutputTensorName(static_cast<OutputTensor>(-1)), "unknown");
}

}  // namespace
}  // namespace client
}  // namespace lossd
