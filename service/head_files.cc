// SPDX-License-Identifier: Apache-2.0
#include "service/head_files.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/notification.h"
#include "core/status_macros.h"
#include "lossd/v1/lossd.pb.h"
#include "service/head_wire.h"
#include "service/log.h"

namespace lossd {
namespace {

constexpr char kMagic[] = "LOSSDHEAD1\n";
constexpr size_t kMagicBytes = sizeof(kMagic) - 1;
constexpr char kSuffix[] = ".lossd-head";
// The largest owner or header a file may hold: both are small (a principal, shapes and an
// optimizer's scalars); a larger length means the file is not one of ours.
constexpr uint32_t kMaxRecordBytes = 1u << 20;
// Bytes read and written to the head at a time on import (whole fp32 and bf16 elements).
constexpr uint64_t kImportChunkBytes = 16ull << 20;

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

absl::Status IoError(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, " failed"));
}

absl::Status WriteAll(std::FILE* f, const void* data, size_t n, const std::string& path) {
  if (n != 0 && std::fwrite(data, 1, n, f) != n) return IoError("writing", path);
  return absl::OkStatus();
}

absl::Status WriteRecord(std::FILE* f, const std::string& bytes, const std::string& path) {
  const uint32_t n = static_cast<uint32_t>(bytes.size());
  const uint8_t len[4] = {static_cast<uint8_t>(n), static_cast<uint8_t>(n >> 8),
                          static_cast<uint8_t>(n >> 16), static_cast<uint8_t>(n >> 24)};
  LOSSD_RETURN_IF_ERROR(WriteAll(f, len, 4, path));
  return WriteAll(f, bytes.data(), bytes.size(), path);
}

absl::StatusOr<std::string> ReadRecord(std::FILE* f, const std::string& path,
                                       const char* what) {
  uint8_t len[4];
  if (std::fread(len, 1, 4, f) != 4) {
    return absl::DataLossError(absl::StrCat(path, " ends before its ", what));
  }
  const uint32_t n = len[0] | (len[1] << 8) | (len[2] << 16) | (uint32_t{len[3]} << 24);
  if (n > kMaxRecordBytes) {
    return absl::DataLossError(absl::StrCat(path, ": its ", what, " claims ", n, " bytes"));
  }
  std::string bytes(n, '\0');
  if (n != 0 && std::fread(bytes.data(), 1, n, f) != n) {
    return absl::DataLossError(absl::StrCat(path, " ends inside its ", what));
  }
  return bytes;
}

// Export(name, version, begin, end) on the executor (after the Computes and steps queued
// before it, as ExportHead copies), waited for here.
absl::StatusOr<HeadExportRange> ExportOnExecutor(Engine& engine, const std::string& name,
                                                 std::optional<uint64_t> version,
                                                 uint64_t begin, uint64_t end,
                                                 const std::string& owner,
                                                 HeadExportScope scope) {
  absl::StatusOr<HeadExportRange> r = absl::UnknownError("not run");
  absl::Notification done;
  engine.Submit([&] {
    r = engine.heads().Export(name, version, begin, end, owner, scope);
    done.Notify();
  });
  done.WaitForNotification();
  return r;
}

// Writes the header of the export `first` (its first window) begins. A member's part names
// its group (members, this member, id) and lists each tensor as its (slice) fp32 slice.
absl::Status WriteHeader(std::FILE* f, const HeadExportRange& first, uint64_t total,
                         const std::string& owner, const std::string& path,
                         const std::string& instance, HeadExportScope scope) {
  v1::ExportHeader h;
  *h.mutable_head() = HeadHeaderToWire(HeadStore::SpecOf(first.head));
  const bool part = scope == HeadExportScope::kMemberPart;
  if (part) {
    v1::HeadGroupSpec* g = h.mutable_head()->mutable_group();
    for (const std::string& m : first.head.group.members) g->add_members(m);
    g->set_member(first.head.group.member);
    g->set_id(first.head.group.id);
  }
  for (const auto& [tensor, bytes] : first.tensors) {
    h.add_tensors(HeadTensorToWire(tensor));
    if (part) {
      v1::TensorSpec* spec = h.add_specs();
      spec->set_dtype(v1::DTYPE_FP32);
      spec->add_shape(static_cast<int64_t>(bytes / 4));
    } else {
      *h.add_specs() = HeadTensorSpec(tensor, first.head.v, first.head.h, first.head.dtype);
    }
  }
  h.set_range_begin(0);
  h.set_range_end(total);
  h.set_instance(instance);
  LOSSD_RETURN_IF_ERROR(WriteAll(f, kMagic, kMagicBytes, path));
  LOSSD_RETURN_IF_ERROR(WriteRecord(f, owner, path));
  return WriteRecord(f, h.SerializeAsString(), path);
}

// The bytes of one tensor of an export, from its spec.
uint64_t SpecBytes(const v1::TensorSpec& s) {
  uint64_t n = s.dtype() == v1::DTYPE_FP32 ? 4 : 2;
  for (int64_t d : s.shape()) n *= static_cast<uint64_t>(d);
  return n;
}

}  // namespace

std::string HeadFilePath(const std::string& dir, const std::string& head) {
  const std::string file =
      absl::StrReplaceAll(head, {{"%", "%25"}, {"/", "%2F"}, {":", "%3A"}});
  return (std::filesystem::path(dir) / absl::StrCat(file, kSuffix)).string();
}

std::string GroupPartPath(const std::string& dir, const std::string& head, uint32_t member,
                          uint32_t size) {
  std::string path = HeadFilePath(dir, head);
  path.resize(path.size() - (sizeof(kSuffix) - 1));
  return absl::StrCat(path, ".member-", member, "-of-", size, kSuffix);
}

absl::Status ExportHeadToFile(Engine& engine, const std::string& name, const std::string& owner,
                              const std::string& path, uint64_t window_bytes,
                              HeadExportScope scope) {
  const std::string tmp = absl::StrCat(path, ".tmp");
  File f(std::fopen(tmp.c_str(), "wb"));
  if (f == nullptr) return IoError("creating", tmp);
  auto range = engine.heads().CheckExport(name, std::nullopt, 0, 0, owner, scope);
  absl::Status s = range.status();
  std::optional<uint64_t> version;
  for (uint64_t at = 0; s.ok() && at < range->second;) {
    const uint64_t end = std::min(range->second, at + window_bytes);
    auto r = ExportOnExecutor(engine, name, version, at, end, owner, scope);
    if (!r.ok()) {
      s = r.status();
      break;
    }
    if (!version.has_value()) {
      version = r->head.version;
      s = WriteHeader(f.get(), *r, range->second, owner, tmp, engine.options().instance,
                      scope);
    }
    if (s.ok()) s = WriteAll(f.get(), r->data.get(), r->end - r->begin, tmp);
    at = r->end;
  }
  if (s.ok() && std::fflush(f.get()) != 0) s = IoError("writing", tmp);
  f.reset();
  std::error_code ec;
  if (s.ok()) {
    std::filesystem::rename(tmp, path, ec);
    if (!ec) return absl::OkStatus();
    s = IoError("renaming", tmp);
  }
  std::filesystem::remove(tmp, ec);
  return s;
}

absl::Status ImportHeadFromFile(Engine& engine, const std::string& path, std::string* name) {
  File f(std::fopen(path.c_str(), "rb"));
  if (f == nullptr) return IoError("opening", path);
  char magic[kMagicBytes];
  if (std::fread(magic, 1, kMagicBytes, f.get()) != kMagicBytes ||
      std::string(magic, kMagicBytes) != kMagic) {
    return absl::DataLossError(absl::StrCat(path, " is not an exported head (no ", "magic)"));
  }
  auto owner = ReadRecord(f.get(), path, "owner");
  if (!owner.ok()) return owner.status();
  auto header_bytes = ReadRecord(f.get(), path, "header");
  if (!header_bytes.ok()) return header_bytes.status();
  v1::ExportHeader header;
  if (!header.ParseFromString(*header_bytes) || header.tensors_size() != header.specs_size()) {
    return absl::DataLossError(absl::StrCat(path, ": its header is not an ExportHeader"));
  }
  // The file must hold the whole concatenation its header describes, and nothing more: a
  // file cut short anywhere (the compute copy at its end included) is not imported.
  uint64_t total = 0;
  for (const v1::TensorSpec& t : header.specs()) total += SpecBytes(t);
  const long data_at = std::ftell(f.get());
  std::error_code ec;
  const uint64_t size = std::filesystem::file_size(path, ec);
  if (ec || data_at < 0 || total != header.range_end() ||
      size != static_cast<uint64_t>(data_at) + total) {
    return absl::DataLossError(absl::StrCat(
        path, " holds ", ec ? 0 : size, " bytes; its header describes ", data_at, " + ", total,
        " (a file cut short, or not written whole)"));
  }
  if (const v1::HeadGroupSpec& g = header.head().group(); g.members_size() > 1) {
    // A member never rejoins a group by itself, and its part is not a head.
    return absl::FailedPreconditionError(absl::StrCat(
        path, " is member ", g.member(), "'s part (of ", g.members_size(), ") of head '",
        header.head().name(), "' of group '", g.id(), "' at version ", header.head().version(),
        ", written as that member stopped: it is not imported by itself (a member never "
        "rejoins a group, and a part is not a head). Assemble the group's parts (Python: "
        "lossd.head_files.read_head_files) and import the head into a new group or one server"));
  }
  auto spec = HeadSpecFromWire(header.head(), "the file's header.head");
  if (!spec.ok()) return spec.status();
  *name = spec->name;
  spec->exported_by = header.instance();  // a call naming that instance learns it is here
  auto created = engine.heads().BeginCreate(*spec, *owner);
  if (!created.ok()) return created.status();
  if (created->existing.has_value()) return absl::OkStatus();  // the same head is here
  std::vector<uint8_t> chunk(kImportChunkBytes);
  const auto wanted = HeadStore::ImportTensors(*spec);
  for (int i = 0; i < header.tensors_size(); ++i) {
    const uint64_t bytes = SpecBytes(header.specs(i));
    auto tensor = HeadTensorFromWire(header.tensors(i), "the file's tensor");
    if (!tensor.ok()) return tensor.status();
    const bool imported = std::any_of(wanted.begin(), wanted.end(),
                                      [&](const auto& w) { return w.first == *tensor; });
    if (!imported) {  // the compute copy: made again from the master
      if (std::fseek(f.get(), static_cast<long>(bytes), SEEK_CUR) != 0) {
        return IoError("seeking in", path);
      }
      continue;
    }
    for (uint64_t at = 0; at < bytes;) {
      const uint64_t n = std::min<uint64_t>(kImportChunkBytes, bytes - at);
      if (std::fread(chunk.data(), 1, n, f.get()) != n) {
        return absl::DataLossError(absl::StrCat(path, " ends inside ",
                                                HeadTensorName(*tensor)));
      }
      LOSSD_RETURN_IF_ERROR(
          engine.heads().WriteCreate(*created->pending, *tensor, at, chunk.data(), n));
      at += n;
    }
  }
  auto summary = engine.heads().CommitCreate(std::move(created->pending));
  return summary.status();
}

HeadFilesReport ExportHeadsToDir(Engine& engine, const std::string& dir) {
  HeadFilesReport report;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  for (const auto& [name, owner] : engine.heads().Owners()) {
    // A group's member writes what it holds, its part: the group's other members may be
    // gone or still serving, and a gather needs them all.
    auto info = engine.heads().Info(name, owner);
    const bool part = info.ok() && info->group.size() > 1;
    const std::string path =
        part ? GroupPartPath(dir, name, info->group.member, info->group.size())
             : HeadFilePath(dir, name);
    const absl::Status s =
        ExportHeadToFile(engine, name, owner, path, 64ull << 20,
                         part ? HeadExportScope::kMemberPart : HeadExportScope::kWhole);
    if (s.ok()) {
      ++report.done;
      Log(LogLevel::kInfo, "exported head", {{"head", name}, {"file", path}});
    } else {
      ++report.failed;
      Log(LogLevel::kError, "head not exported: it is lost with this process",
          {{"head", name}, {"file", path}, {"error", s.ToString()}});
    }
  }
  return report;
}

HeadFilesReport ImportHeadsFromDir(Engine& engine, const std::string& dir) {
  HeadFilesReport report;
  std::error_code ec;
  std::vector<std::string> paths, stale;
  const std::string tmp_suffix = absl::StrCat(kSuffix, ".tmp");
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string p = entry.path().string();
    if (!entry.is_regular_file()) continue;
    if (absl::EndsWith(p, kSuffix) && p.size() > sizeof(kSuffix) - 1) paths.push_back(p);
    if (absl::EndsWith(p, tmp_suffix)) stale.push_back(p);
  }
  // An export still under its temporary name never finished (the process was killed during
  // the drain): its head was lost then, and the file can only ever be a part of it. Nothing
  // exports into this folder while lossd starts (one instance a folder).
  std::sort(stale.begin(), stale.end());
  for (const std::string& path : stale) {
    std::filesystem::remove(path, ec);
    ++report.removed;
    Log(LogLevel::kWarning, "removed an export that never finished",
        {{"file", path}, {"deleted", ec ? ec.message() : "yes"}});
  }
  std::sort(paths.begin(), paths.end());  // a stable order in the log
  for (const std::string& path : paths) {
    std::string name;
    const absl::Status s = ImportHeadFromFile(engine, path, &name);
    if (!s.ok()) {
      ++report.failed;
      Log(LogLevel::kError, "head not imported; its file stays",
          {{"file", path}, {"error", s.ToString()}});
      continue;
    }
    ++report.done;
    std::filesystem::remove(path, ec);
    Log(LogLevel::kInfo, "imported head",
        {{"head", name}, {"file", path}, {"deleted", ec ? ec.message() : "yes"}});
  }
  return report;
}

}  // namespace lossd
