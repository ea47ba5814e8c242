// SPDX-License-Identifier: Apache-2.0
#include "engine/weight_cache.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"

namespace lossd {
namespace {

std::shared_ptr<WeightEntry> Entry(Backend& b, uint64_t bytes) {
  auto e = std::make_shared<WeightEntry>();
  e->dtype = DType::kF32;
  e->v = static_cast<int64_t>(bytes / 4);
  e->h = 1;
  e->w = std::move(*b.Allocate(bytes));
  return e;
}

TEST(WeightCacheTest, LeastRecentlyUsedIsEvictedFirstAndSaysSo) {
  auto backend = NewCpuBackend(1);
  WeightCache cache(300, "inst");
  ASSERT_TRUE(cache.Reserve(100).ok());
  const std::string a = cache.Insert(Entry(*backend, 100));
  ASSERT_TRUE(cache.Reserve(100).ok());
  const std::string b = cache.Insert(Entry(*backend, 100));
  ASSERT_TRUE(cache.Reserve(100).ok());
  const std::string c = cache.Insert(Entry(*backend, 100));
  ASSERT_TRUE(cache.Get(a).ok());  // a is now the most recent; b the least
  ASSERT_TRUE(cache.Reserve(100).ok());
  const std::string d = cache.Insert(Entry(*backend, 100));
  EXPECT_TRUE(cache.Get(a).ok());
  EXPECT_TRUE(cache.Get(c).ok());
  EXPECT_TRUE(cache.Get(d).ok());
  auto gone = cache.Get(b);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(gone.status().message().find("was evicted"), std::string::npos) << gone.status();
  EXPECT_EQ(cache.bytes(), 300u);
  EXPECT_EQ(cache.evictions(), 1u);
  EXPECT_EQ(cache.misses(), 1u);
}

// An entry in use is evicted by the handle count (--max_weight_handles), which frees no bytes
// and so passes over nothing; its request still reads its weights, and its bytes stay charged
// until the request lets go.
TEST(WeightCacheTest, AnEntryInUseOutlivesItsEviction) {
  auto backend = NewCpuBackend(1);
  WeightCache cache(200, "inst", /*max_entries=*/1);
  ASSERT_TRUE(cache.Reserve(100).ok());
  const std::string a = cache.Insert(Entry(*backend, 100));
  auto held = cache.Get(a);
  ASSERT_TRUE(held.ok());
  static_cast<float*>((*held)->w->data())[0] = 42.0f;
  ASSERT_TRUE(cache.Reserve(100).ok());
  const std::string b = cache.Insert(Entry(*backend, 100));  // evicts a
  const absl::Status gone = cache.Get(a).status();
  EXPECT_NE(gone.message().find("was evicted"), std::string::npos) << gone;
  EXPECT_EQ(cache.evictions(), 1u);
  EXPECT_EQ(static_cast<const float*>((*held)->w->data())[0], 42.0f);
  EXPECT_EQ(cache.bytes(), 200u);
  *held = nullptr;  // the request ends
  EXPECT_EQ(cache.bytes(), 100u);
  EXPECT_TRUE(cache.Get(b).ok());
}

TEST(WeightCacheTest, TooLargeForTheBudgetIsResourceExhausted) {
  WeightCache cache(100, "inst");
  absl::Status s = cache.Reserve(101);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("budget of 100 bytes"), std::string::npos) << s;
}

// An upload refused because uploads in progress hold the room evicts nothing: evicting could
// not have made room for it.
TEST(WeightCacheTest, AnUploadThatCannotFitBesideUploadsInProgressEvictsNothing) {
  auto backend = NewCpuBackend(1);
  WeightCache cache(100, "inst");
  ASSERT_TRUE(cache.Reserve(30).ok());
  const std::string a = cache.Insert(Entry(*backend, 30));
  ASSERT_TRUE(cache.Reserve(60).ok());  // an upload in progress
  absl::Status s = cache.Reserve(50);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("60 of its 100 bytes (--weight_cache_bytes) are taken by uploads "
                             "in progress"),
            std::string::npos)
      << s;
  EXPECT_TRUE(cache.Get(a).ok()) << "the refused upload evicted a cached entry";
  EXPECT_EQ(cache.evictions(), 0u);
  // One that fits once `a` goes still evicts it.
  ASSERT_TRUE(cache.Reserve(40).ok());
  EXPECT_FALSE(cache.Get(a).ok());
  EXPECT_EQ(cache.evictions(), 1u);
}

TEST(WeightCacheTest, HandlesNameTheirInstance) {
  auto backend = NewCpuBackend(1);
  WeightCache cache(100, "abc");
  ASSERT_TRUE(cache.Reserve(10).ok());
  EXPECT_EQ(cache.Insert(Entry(*backend, 8)).rfind("w-abc-", 0), 0u);
  auto other = cache.Get("w-0123abcd-1");
  EXPECT_EQ(other.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(other.status().message().find("belongs to another server instance (this one is "
                                          "'abc'"),
            std::string::npos)
      << other.status();
}

// A made-up handle that only starts like one of lossd's is unknown: "another server
// instance" would send its user looking for a restart that never happened.
TEST(WeightCacheTest, AMadeUpHandleIsUnknownNotAnotherInstance) {
  WeightCache cache(100, "0123abcd");
  for (const char* made_up : {"w-xyz-1", "w-elsewhere-1", "w-", "w-0123abcd", "w-89abcdef-01",
                              "w-89abcdef-x", "w-89ABCDEF-1"}) {
    const absl::Status s = cache.Get(made_up).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << made_up;
    EXPECT_EQ(s.message().find("another server instance"), std::string::npos) << s;
    EXPECT_NE(s.message().find(absl::StrCat("weight handle '", made_up,
                                            "' not found: this server never issued it (its "
                                            "handles are 'w-0123abcd-<n>'")),
              std::string::npos)
        << s;
  }
}

}  // namespace
}  // namespace lossd

namespace lossd {
namespace {

TEST(WeightCacheTest, TheHandleCountIsLimitedLeastRecentlyUsedFirst) {
  auto backend = NewCpuBackend(1);
  WeightCache cache(1000, "inst", /*max_entries=*/2);
  ASSERT_TRUE(cache.Reserve(8).ok());
  const std::string a = cache.Insert(Entry(*backend, 8));
  ASSERT_TRUE(cache.Reserve(8).ok());
  const std::string b = cache.Insert(Entry(*backend, 8));
  ASSERT_TRUE(cache.Reserve(8).ok());
  const std::string c = cache.Insert(Entry(*backend, 8));
  EXPECT_EQ(cache.count(), 2u);
  const absl::Status gone = cache.Get(a).status();
  EXPECT_NE(gone.message().find("was evicted"), std::string::npos) << gone;
  EXPECT_NE(gone.message().find("2 handles, --max_weight_handles"), std::string::npos) << gone;
  EXPECT_TRUE(cache.Get(b).ok());
  EXPECT_TRUE(cache.Get(c).ok());
}

}  // namespace
}  // namespace lossd

namespace lossd {
namespace {

// A long-running server retires handles without end: the reason is kept for the last
// kRetiredKept of them, and an older handle of this instance is still told apart from one it
// never issued.
TEST(WeightCacheTest, RetiredHandlesAreRememberedWithinABound) {
  auto backend = NewCpuBackend(1);
  WeightCache cache(8, "inst");
  std::vector<std::string> handles;
  for (size_t i = 0; i < WeightCache::kRetiredKept + 3; ++i) {
    ASSERT_TRUE(cache.Reserve(8).ok());  // evicts the one before
    handles.push_back(cache.Insert(Entry(*backend, 8)));
  }
  ASSERT_TRUE(cache.Drop(handles.back()).ok());
  EXPECT_EQ(cache.evictions(), WeightCache::kRetiredKept + 2);
  // kRetiredKept + 3 retired: the first three are past the bound.
  for (size_t i : {size_t{0}, size_t{2}}) {
    const absl::Status s = cache.Get(handles[i]).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
    EXPECT_NE(s.message().find("is no longer held (evicted or dropped"), std::string::npos) << s;
  }
  const absl::Status kept = cache.Get(handles[3]).status();
  EXPECT_NE(kept.message().find("was evicted"), std::string::npos) << kept;
  const absl::Status dropped = cache.Get(handles.back()).status();
  EXPECT_NE(dropped.message().find("was dropped"), std::string::npos) << dropped;
  // Never issued by this instance: a number past the last, and no number at all.
  const std::string past = absl::StrCat("w-inst-", handles.size() + 1);
  for (const std::string& h : {past, std::string("w-inst-x"), std::string("w-inst-0"),
                               std::string("w-inst-05"), std::string("w-inst-+5")}) {
    const absl::Status s = cache.Get(h).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
    EXPECT_NE(s.message().find("not found"), std::string::npos) << s;
  }
}

}  // namespace
}  // namespace lossd

namespace lossd {
namespace {

// A dropped entry that a running request still holds keeps its memory, so its bytes stay
// charged to --weight_cache_bytes until the last holder lets go: an upload that fits only in
// its place is refused until then, and evicts nothing meanwhile.
TEST(WeightCacheTest, ADroppedEntryStillInUseKeepsItsBytesCharged) {
  auto backend = NewCpuBackend(1);
  WeightCache cache(100, "inst");
  ASSERT_TRUE(cache.Reserve(50).ok());
  const std::string a = cache.Insert(Entry(*backend, 50));
  auto got = cache.Get(a);
  ASSERT_TRUE(got.ok()) << got.status();
  std::shared_ptr<const WeightEntry> held = std::move(*got);  // as a running Compute holds it
  ASSERT_TRUE(cache.Drop(a).ok());
  EXPECT_EQ(cache.count(), 0u);    // no longer served
  EXPECT_EQ(cache.bytes(), 50u);   // but its memory is still held
  ASSERT_TRUE(cache.Reserve(30).ok());
  const std::string b = cache.Insert(Entry(*backend, 30));
  EXPECT_EQ(cache.bytes(), 80u);

  // 50 held by the dropped entry + 60 > 100: evicting b could not make room.
  const absl::Status s = cache.Reserve(60);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("weights of 60 bytes do not fit in the weight cache: 0 of its 100 "
                             "bytes (--weight_cache_bytes) are taken by uploads in progress, and "
                             "50 by weights that running requests use"),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("50 of those bytes are of handles already evicted or dropped"),
            std::string::npos)
      << s;
  EXPECT_TRUE(cache.Get(b).ok()) << "the refused upload evicted a cached entry";
  EXPECT_EQ(cache.evictions(), 0u);

  held.reset();  // the request ends: the memory is freed, and its bytes come back
  EXPECT_EQ(cache.bytes(), 30u);
  ASSERT_TRUE(cache.Reserve(60).ok());
  EXPECT_TRUE(cache.Get(b).ok()) << "60 fit beside b once the dropped entry was freed";
  EXPECT_EQ(cache.evictions(), 0u);
}

// Evicting an entry that a running request holds frees nothing until the request ends, so an
// upload evicts, least recently used first, only entries that no request holds.
TEST(WeightCacheTest, AnUploadEvictsOnlyEntriesNoRunningRequestHolds) {
  auto backend = NewCpuBackend(1);
  WeightCache cache(100, "inst");
  ASSERT_TRUE(cache.Reserve(50).ok());
  const std::string a = cache.Insert(Entry(*backend, 50));
  ASSERT_TRUE(cache.Reserve(50).ok());
  const std::string b = cache.Insert(Entry(*backend, 50));
  auto held = cache.Get(a);  // a running Compute holds a...
  ASSERT_TRUE(held.ok()) << held.status();
  ASSERT_TRUE(cache.Get(b).ok());  // ...and b is used after it: a is the least recent

  // 50 held by a + 60 > 100: refused before evicting b, which could not make room.
  const absl::Status s = cache.Reserve(60);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("0 of its 100 bytes (--weight_cache_bytes) are taken by uploads "
                             "in progress, and 50 by weights that running requests use"),
            std::string::npos)
      << s;
  EXPECT_EQ(s.message().find("evicted or dropped"), std::string::npos) << s;
  EXPECT_TRUE(cache.Get(b).ok()) << "the refused upload evicted a cached entry";
  EXPECT_EQ(cache.evictions(), 0u);

  ASSERT_TRUE(cache.Reserve(50).ok());  // evicts b, not the less recent a
  EXPECT_TRUE(cache.Get(a).ok()) << "evicted an entry in use, which freed nothing";
  const absl::Status gone = cache.Get(b).status();
  EXPECT_NE(gone.message().find("was evicted"), std::string::npos) << gone;
  EXPECT_EQ(cache.evictions(), 1u);
  EXPECT_EQ(cache.bytes(), 50u);
}

// The accounting outlives the cache: an entry let go after the cache is gone is safe.
TEST(WeightCacheTest, AnEntryMayOutliveItsCache) {
  auto backend = NewCpuBackend(1);
  std::shared_ptr<const WeightEntry> held;
  {
    WeightCache cache(100, "inst");
    ASSERT_TRUE(cache.Reserve(50).ok());
    auto got = cache.Get(cache.Insert(Entry(*backend, 50)));
    ASSERT_TRUE(got.ok()) << got.status();
    held = std::move(*got);
  }
  EXPECT_EQ(held->w->size(), 50u);
  held.reset();
}

}  // namespace
}  // namespace lossd
