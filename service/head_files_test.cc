// SPDX-License-Identifier: Apache-2.0
// Tests the drain's export of every hosted head to files and the import at start: a head
// comes back with its owner, its version and every byte of its state; a file that is cut
// short or not one of ours is refused (DATA_LOSS) and stays where it is; an unfinished export
// is removed at start.
#include "service/head_files.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"

namespace lossd {
namespace {

std::unique_ptr<Engine> NewEngine(const std::string& instance) {
  EngineOptions o;
  o.instance = instance;
  return std::make_unique<Engine>(NewCpuBackend(1), o);
}

std::string TempDir(const std::string& leaf) {
  const char* base = std::getenv("TEST_TMPDIR");
  const std::filesystem::path dir =
      std::filesystem::path(base != nullptr ? base : "/tmp") / leaf;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

// An AdamW head (V=123, H=31, bias) with random master, exp_avg and exp_avg_sq, owned by
// `owner`.
void MakeHead(Engine& e, const std::string& name, const std::string& owner, uint64_t seed) {
  HeadSpec spec;
  spec.name = name;
  spec.v = 123;
  spec.h = 31;
  spec.has_bias = true;
  spec.compute_dtype = DType::kBF16;
  spec.version = 5;
  spec.optimizer_step = 5;
  spec.with_state = true;
  auto c = e.heads().BeginCreate(spec, owner);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_NE(c->pending, nullptr);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.01f, 1.0f);  // exp_avg_sq must stay positive
  for (const auto& [tensor, bytes] : HeadStore::ImportTensors(spec)) {
    std::vector<float> data(bytes / 4);
    for (float& x : data) x = u(rng);
    ASSERT_TRUE(e.heads().WriteCreate(*c->pending, tensor, 0, data.data(), bytes).ok());
  }
  ASSERT_TRUE(e.heads().CommitCreate(std::move(c->pending)).ok());
}

// The head's whole export concatenation.
std::vector<uint8_t> ExportBytes(Engine& e, const std::string& name, const std::string& owner) {
  auto r = e.heads().Export(name, std::nullopt, 0, 0, owner);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return {};
  return std::vector<uint8_t>(r->data.get(), r->data.get() + (r->end - r->begin));
}

TEST(HeadFilesTest, FileNamesEscapeWhatAPathCannotHold) {
  EXPECT_EQ(HeadFilePath("/d", "run:7/head%x"), "/d/run%3A7%2Fhead%25x.lossd-head");
}

TEST(HeadFilesTest, EveryHeadComesBackWithItsOwnerAndItsBytes) {
  const std::string dir = TempDir("heads");
  std::vector<uint8_t> a, b;
  {
    auto before = NewEngine("one");
    MakeHead(*before, "run/a", "p1", 1);
    MakeHead(*before, "b", "", 2);
    a = ExportBytes(*before, "run/a", "p1");
    b = ExportBytes(*before, "b", "");
    // Windows smaller than a tensor: the file is the same.
    ASSERT_TRUE(ExportHeadToFile(*before, "run/a", "p1", dir + "/small.lossd-head", 1000).ok());
    const HeadFilesReport r = ExportHeadsToDir(*before, dir);
    EXPECT_EQ(r.done, 2);
    EXPECT_EQ(r.failed, 0);
  }
  std::ifstream small(dir + "/small.lossd-head", std::ios::binary), whole(
      HeadFilePath(dir, "run/a"), std::ios::binary);
  const std::string small_bytes((std::istreambuf_iterator<char>(small)), {});
  const std::string whole_bytes((std::istreambuf_iterator<char>(whole)), {});
  EXPECT_EQ(small_bytes, whole_bytes);
  std::filesystem::remove(dir + "/small.lossd-head");

  auto after = NewEngine("two");
  const HeadFilesReport r = ImportHeadsFromDir(*after, dir);
  EXPECT_EQ(r.done, 2);
  EXPECT_EQ(r.failed, 0);
  EXPECT_TRUE(std::filesystem::is_empty(dir)) << "imported files are deleted";
  auto info = after->heads().Info("run/a", "p1");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->version, 5u);
  EXPECT_EQ(info->optimizer_step, 5);
  EXPECT_EQ(after->heads().Info("run/a", "p2").status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ExportBytes(*after, "run/a", "p1"), a);
  EXPECT_EQ(ExportBytes(*after, "b", ""), b);
}

// After a restart with --head_export_dir, a call naming the instance before the restart is
// told that its head is here (imported at its version), not to import it; a caller that
// does not own the head learns nothing of it.
TEST(HeadFilesTest, ACallNamingTheInstanceBeforeTheRestartIsToldTheHeadIsHere) {
  const std::string dir = TempDir("restarted");
  {
    auto before = NewEngine("one");
    MakeHead(*before, "run/a", "p1", 1);
    ASSERT_EQ(ExportHeadsToDir(*before, dir).done, 1);
  }
  auto after = NewEngine("two");
  ASSERT_EQ(ImportHeadsFromDir(*after, dir).done, 1);
  const absl::Status s =
      after->heads().CheckInstance("run/a", "one", "StepRequest.head_instance", "p1");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  for (const std::string want :
       {"StepRequest.head_instance 'one' is not this server (instance 'two')",
        "head 'run/a' is here: this server imported it as it started, from the export "
        "instance 'one' wrote as it stopped (--head_export_dir), at version 5",
        "call HeadInfo (head_info) for its instance and version, and name instance 'two'"}) {
    EXPECT_NE(std::string(s.message()).find(want), std::string::npos) << want << "\n" << s;
  }
  const absl::Status other =
      after->heads().CheckInstance("run/a", "one", "StepRequest.head_instance", "p2");
  EXPECT_NE(std::string(other.message()).find("create or import the head here"),
            std::string::npos)
      << other;
}

TEST(HeadFilesTest, BrokenFilesAreRefusedAndKept) {
  const std::string dir = TempDir("broken");
  {
    auto before = NewEngine("one");
    MakeHead(*before, "cut", "", 3);
    ASSERT_TRUE(ExportHeadToFile(*before, "cut", "", HeadFilePath(dir, "cut")).ok());
  }
  const std::string cut = HeadFilePath(dir, "cut");
  std::filesystem::resize_file(cut, std::filesystem::file_size(cut) - 10);
  std::ofstream(HeadFilePath(dir, "junk"), std::ios::binary) << "not a head at all";
  auto after = NewEngine("two");
  std::string name;
  const absl::Status s = ImportHeadFromFile(*after, cut, &name);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("(a file cut short, or not written whole)"), std::string::npos)
      << s;
  const absl::Status j = ImportHeadFromFile(*after, HeadFilePath(dir, "junk"), &name);
  EXPECT_EQ(j.code(), absl::StatusCode::kDataLoss) << j;
  EXPECT_NE(j.message().find("is not an exported head"), std::string::npos) << j;
  const HeadFilesReport r = ImportHeadsFromDir(*after, dir);
  EXPECT_EQ(r.done, 0);
  EXPECT_EQ(r.failed, 2);
  EXPECT_TRUE(std::filesystem::exists(cut));
  EXPECT_TRUE(std::filesystem::exists(HeadFilePath(dir, "junk")));
  EXPECT_EQ(after->heads().count(), 0u) << "a cut-off import leaves no head";
}

// A drain killed during an export leaves its temporary file: the next start deletes it (it
// can never be imported) and imports the whole files beside it.
TEST(HeadFilesTest, UnfinishedExportsAreRemovedAtStart) {
  const std::string dir = TempDir("unfinished");
  {
    auto before = NewEngine("one");
    MakeHead(*before, "whole", "", 4);
    ASSERT_TRUE(ExportHeadToFile(*before, "whole", "", HeadFilePath(dir, "whole")).ok());
  }
  const std::string tmp = HeadFilePath(dir, "killed") + ".tmp";
  std::ofstream(tmp, std::ios::binary) << "LOSSDHEAD1\n a drain killed here";
  const std::string other = (std::filesystem::path(dir) / "notes.tmp").string();
  std::ofstream(other) << "not ours";
  auto after = NewEngine("two");
  const HeadFilesReport r = ImportHeadsFromDir(*after, dir);
  EXPECT_EQ(r.done, 1);
  EXPECT_EQ(r.failed, 0);
  EXPECT_EQ(r.removed, 1);
  EXPECT_FALSE(std::filesystem::exists(tmp));
  EXPECT_TRUE(std::filesystem::exists(other)) << "only our own temporary files go";
  EXPECT_EQ(after->heads().count(), 1u);
}

}  // namespace
}  // namespace lossd
