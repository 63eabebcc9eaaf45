// The one way peftplan writes a file: the bytes go to a temporary name beside it
// ("<path>.tmp.<pid>"), are flushed to the disk (fsync), and the temporary is renamed over the
// path, so that a reader, a crash or a full disk never leaves half a file behind (rename(2) is
// atomic within a file system). Every writer of plan.json, profiles, measurements, checkpoints,
// adapters and reports goes through here.
// A folder (a checkpoint, a report) is written whole under a temporary name beside its target
// and put in place by replace_directory, so that the target is at every moment either the old
// folder or the new one.
// Deliberately not here: what goes in the files.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <system_error>

#include <fmt/format.h>

#include "peftplan/common/error.h"

namespace peftplan {

// A file written under its temporary name, not yet in place (stage_file / commit_file).
struct StagedFile {
  std::filesystem::path path;  // where it goes (a symbolic link to a file resolved)
  std::string tmp;             // where it is now; empty when written in place (a device, a pipe)
};

// Writes the pieces, in order, under the temporary name beside `path_given` (flushed to the disk).
// Throws InputError "<path>: <what went wrong>" (a missing folder, a folder in the file's place,
// no space, no permission); the temporary is removed. What is not a regular file is written to
// as it is, not replaced: a device or a pipe (`--trace /dev/null`, `/dev/stdout`, a FIFO) has no
// contents to keep whole, and renaming over it would put a file in its place (as root, over
// /dev/null itself). A symbolic link to a file is followed: the file it names is replaced, and
// the link stays.
inline StagedFile stage_file(const std::filesystem::path& path_given, std::span<const std::string_view> pieces) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path_given, ec);
  if (st.type() == fs::file_type::directory)
    throw InputError(fmt::format("{}: is a folder (give a file name)", path_given.string()));
  const bool in_place = fs::exists(st) && st.type() != fs::file_type::regular;
  StagedFile f;
  f.path = fs::is_symlink(path_given, ec) && st.type() == fs::file_type::regular ? fs::canonical(path_given, ec) : path_given;
  if (!in_place) f.tmp = fmt::format("{}.tmp.{}", f.path.string(), ::getpid());
  const std::string target = in_place ? f.path.string() : f.tmp;
  const int fd = ::open(target.c_str(), in_place ? O_WRONLY | O_CLOEXEC : O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    throw InputError(fmt::format("{}: cannot be written ({}; does the folder exist?)", f.path.string(), std::strerror(errno)));
  bool ok = true;
  for (std::string_view piece : pieces) {
    const char* c = piece.data();
    std::size_t left = piece.size();
    while (ok && left > 0) {
      const ssize_t w = ::write(fd, c, left);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) ok = false;
      else {
        c += w;
        left -= static_cast<std::size_t>(w);
      }
    }
  }
  ok = ok && (in_place || ::fsync(fd) == 0);  // a pipe or a terminal has nothing to sync
  const int err = errno;
  ok = ::close(fd) == 0 && ok;
  if (!ok) {
    if (!in_place) ::unlink(f.tmp.c_str());
    throw InputError(fmt::format("{}: could not be written completely ({})", f.path.string(), std::strerror(err)));
  }
  return f;
}

// Renames a staged file into place (nothing to do for one written in place).
inline void commit_file(const StagedFile& f) {
  if (f.tmp.empty()) return;
  std::error_code ec;
  std::filesystem::rename(f.tmp, f.path, ec);
  if (ec) {
    ::unlink(f.tmp.c_str());
    throw InputError(fmt::format("{}: cannot be renamed into place ({})", f.path.string(), ec.message()));
  }
}

// Removes a staged file that will not be committed.
inline void discard_file(const StagedFile& f) {
  if (!f.tmp.empty()) ::unlink(f.tmp.c_str());
}

// Writes the pieces, in order, as one file: staged, then renamed into place.
inline void write_file_atomic(const std::filesystem::path& path, std::span<const std::string_view> pieces) {
  commit_file(stage_file(path, pieces));
}

inline void write_file_atomic(const std::filesystem::path& path, std::initializer_list<std::string_view> pieces) {
  write_file_atomic(path, std::span<const std::string_view>(pieces.begin(), pieces.size()));
}

inline void write_text_atomic(const std::filesystem::path& path, std::string_view text) { write_file_atomic(path, {text}); }

// Makes the folder `dir` (and its parents) for outputs, or throws InputError "<what> <dir>: ..."
// (`what` names the flag or field): a file in its place, or a place no folder can be made
// (/proc, no permission). Made before work whose outputs go there, so that such a folder is bad
// input at the start, not an internal error at the end.
inline void make_folder(const std::filesystem::path& dir, std::string_view what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    throw InputError(fmt::format("{} {}: is a file, not a folder", what, dir.string()));
  fs::create_directories(dir, ec);
  if (ec) throw InputError(fmt::format("{} {}: the folder cannot be made ({})", what, dir.string(), ec.message()));
}

// Puts the finished folder `tmp` (beside `target`, on the same file system) in place of target:
// an existing target is first renamed aside, then tmp is renamed to target and the old one
// removed. Throws std::filesystem::filesystem_error; callers name their file or flag.
inline void replace_directory(const std::filesystem::path& tmp, const std::filesystem::path& target) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path old;
  if (fs::exists(target, ec)) {
    old = target.parent_path() / fmt::format(".{}.old.{}", target.filename().string(), ::getpid());
    fs::remove_all(old, ec);
    fs::rename(target, old);
  }
  fs::rename(tmp, target);
  if (!old.empty()) fs::remove_all(old, ec);
}

}  // namespace peftplan
