// SPDX-License-Identifier: Apache-2.0
// A rolling restart without losing hosted heads (--head_export_dir): on drain every head is
// exported to a file of its own, and at start every file found is imported for its owner and
// deleted once imported. Goes through the engine's HeadStore (Export; BeginCreate, WriteCreate,
// CommitCreate) as ExportHead and CreateHead do; never holds more than one window of a head
// in memory, and never deletes a file whose head is not here.
//
// The file: the magic "LOSSDHEAD1" and a newline; the owner (a principal, owner.h) as a
// little-endian uint32 length and its bytes; the ExportHeader (lossd.v1) of the whole
// concatenation as a uint32 length and its serialized bytes; then the concatenation itself
// (its tensors in the header's order, as ExportHead streams them). Written to a temporary
// name and renamed, so a file under the final name is whole.
#ifndef LOSSD_SERVICE_HEAD_FILES_H_
#define LOSSD_SERVICE_HEAD_FILES_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/engine.h"

namespace lossd {

// The file a head is exported to, in `dir`: its name with '/', ':' and '%' escaped as %2F,
// %3A and %25, and ".lossd-head" appended.
std::string HeadFilePath(const std::string& dir, const std::string& head);

// The file member `member` of a group of `size` writes its part of head `head` to, in `dir`:
// HeadFilePath's name with ".member-<member>-of-<size>" before ".lossd-head".
std::string GroupPartPath(const std::string& dir, const std::string& head, uint32_t member,
                          uint32_t size);

// Exports head `name` (owned by `owner`) at its current version to `path`, a window of
// `window_bytes` at a time, each copied on the engine's executor. kMemberPart: a group
// member's part (its slices of the master and the state; the header names the group and
// lists each tensor as a (slice) fp32 vector).
absl::Status ExportHeadToFile(Engine& engine, const std::string& name, const std::string& owner,
                              const std::string& path, uint64_t window_bytes = 64ull << 20,
                              HeadExportScope scope = HeadExportScope::kWhole);

// Imports the head in `path` for the owner the file names; sets *name. A head already here
// at the same version is OK (nothing changes). Never deletes the file. A group member's part
// is never imported (FAILED_PRECONDITION saying what it is and what to do with it).
absl::Status ImportHeadFromFile(Engine& engine, const std::string& path, std::string* name);

struct HeadFilesReport {
  int done = 0;
  int failed = 0;
  int removed = 0;  // import: unfinished exports (*.lossd-head.tmp) deleted
};

// Every head, each to HeadFilePath(dir, name) (a group's head: this member's part, to
// GroupPartPath); logs each, and each failure (the head is then lost with the process).
// Creates `dir` where it is missing.
HeadFilesReport ExportHeadsToDir(Engine& engine, const std::string& dir);

// Every *.lossd-head file in `dir`, each imported, logged and deleted once imported (a file
// that fails stays, and is logged with the reason). Every *.lossd-head.tmp (an export a killed
// drain left unfinished) is deleted and logged. A missing `dir` imports nothing.
HeadFilesReport ImportHeadsFromDir(Engine& engine, const std::string& dir);

}  // namespace lossd

#endif  // LOSSD_SERVICE_HEAD_FILES_H_
