// GPU test of the pinned staging copies: host -> device -> host round trips of sizes around
// the slot size, the destination poisoned first, compared byte for byte.
#include "kernels/cuda/pinned_staging.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace lossd {
namespace cuda {
namespace {

TEST(PinnedStagingTest, RoundTripsEverySize) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "no GPU";
  auto staging = PinnedStaging::Create();
  ASSERT_TRUE(staging.ok()) << staging.status();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const size_t slot = PinnedStaging::kSlotBytes;
  std::mt19937_64 rng(7);
  for (size_t size : {size_t{0}, size_t{1}, size_t{1000}, slot - 1, slot, slot + 1,
                      3 * slot + 12345}) {
    std::vector<uint8_t> src(size), back(size, 0xFF);
    for (auto& b : src) b = static_cast<uint8_t>(rng());
    void* dev = nullptr;
    ASSERT_EQ(cudaMalloc(&dev, size + 1), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(dev, 0xAB, size + 1, stream), cudaSuccess);
    const std::vector<uint8_t> expected = src;
    ASSERT_TRUE((*staging)->Upload(dev, src.data(), size, stream).ok());
    // The source may change once Upload returns: the device must still get the old bytes.
    for (auto& b : src) b = static_cast<uint8_t>(~b);
    ASSERT_TRUE((*staging)->Download(back.data(), dev, size, stream).ok());
    EXPECT_EQ(std::memcmp(expected.data(), back.data(), size), 0) << "size " << size;
    uint8_t guard = 0;
    ASSERT_EQ(cudaMemcpy(&guard, static_cast<char*>(dev) + size, 1, cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(guard, 0xAB) << "wrote past the end, size " << size;
    cudaFree(dev);
  }
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace cuda
}  // namespace lossd
