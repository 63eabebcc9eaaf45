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

// Writes the pieces, in order, as one file. Throws InputError "<path>: <what went wrong>" (a
// missing folder, no space, no permission); the temporary is removed.
inline void write_file_atomic(const std::filesystem::path& path, std::span<const std::string_view> pieces) {
  const std::string tmp = fmt::format("{}.tmp.{}", path.string(), ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    throw InputError(fmt::format("{}: cannot be written ({}; does the folder exist?)", path.string(), std::strerror(errno)));
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
  ok = ok && ::fsync(fd) == 0;
  const int err = errno;
  ok = ::close(fd) == 0 && ok;
  if (!ok) {
    ::unlink(tmp.c_str());
    throw InputError(fmt::format("{}: could not be written completely ({})", path.string(), std::strerror(err)));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    ::unlink(tmp.c_str());
    throw InputError(fmt::format("{}: cannot be renamed into place ({})", path.string(), ec.message()));
  }
}

inline void write_file_atomic(const std::filesystem::path& path, std::initializer_list<std::string_view> pieces) {
  write_file_atomic(path, std::span<const std::string_view>(pieces.begin(), pieces.size()));
}

inline void write_text_atomic(const std::filesystem::path& path, std::string_view text) { write_file_atomic(path, {text}); }

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
