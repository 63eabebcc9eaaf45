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

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <fmt/format.h>

#include "peftplan/common/error.h"

namespace peftplan {

// A file written under its temporary name, not yet in place (stage_file / commit_file).
struct StagedFile {
  std::filesystem::path path;  // where it goes (a symbolic link resolved)
  std::string tmp;             // where it is now; empty for a target written in place at commit
  std::string in_place_text;   // what commit writes to a device or a pipe
};

namespace detail {

// Writes all of `text` to `fd` and closes it; false with errno set at the call that failed.
inline bool write_all_and_close(int fd, std::string_view text, bool sync) {
  bool ok = true;
  int err = 0;
  const char* c = text.data();
  std::size_t left = text.size();
  while (ok && left > 0) {
    const ssize_t w = ::write(fd, c, left);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      ok = false;
      err = w < 0 ? errno : EIO;  // write(2) returning 0 sets no errno
    } else {
      c += w;
      left -= static_cast<std::size_t>(w);
    }
  }
  if (ok && sync && ::fsync(fd) != 0) {
    ok = false;
    err = errno;
  }
  if (::close(fd) != 0 && ok) {
    ok = false;
    err = errno;
  }
  errno = err;
  return ok;
}

}  // namespace detail

// Writes the pieces, in order, under the temporary name beside `path_given` (flushed to the disk).
// Throws InputError "<path>: <what went wrong>" (a missing folder, a folder in the file's place,
// no space, no permission); the temporary is removed. What is not a regular file is written as
// it is, not replaced, and only at commit_file: a device or a pipe (`--trace /dev/null`,
// `/dev/stdout`, a FIFO; any path under /dev or /proc, whose links lead through /proc/self/fd to
// whatever the stream is) has no contents to keep whole, and renaming over it would put a file in
// its place (as root, over /dev/null itself). A symbolic link elsewhere is followed, to a file
// that exists or not: the file it names is written, and the link stays.
inline StagedFile stage_file(const std::filesystem::path& path_given, std::span<const std::string_view> pieces) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (path_given.empty()) throw InputError("an output file's name is empty");
  const fs::file_status st = fs::status(path_given, ec);
  if (st.type() == fs::file_type::directory)
    throw InputError(fmt::format("{}: is a folder (give a file name)", path_given.string()));
  const std::string abs = fs::absolute(path_given, ec).string();
  const bool special = abs.starts_with("/dev/") || abs.starts_with("/proc/");
  StagedFile f;
  f.path = path_given;
  if (special || (fs::exists(st) && st.type() != fs::file_type::regular)) {
    // Opened now to know it can be (a pipe with no reader yet, ENXIO, is waited for at commit).
    const int fd = ::open(path_given.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0 && errno != ENXIO) throw InputError(fmt::format("{}: cannot be written ({})", path_given.string(), std::strerror(errno)));
    if (fd >= 0) ::close(fd);
    for (std::string_view piece : pieces) f.in_place_text.append(piece);
    return f;  // written at commit_file
  }
  if (fs::is_symlink(path_given, ec)) {
    const fs::path target = fs::read_symlink(path_given, ec);
    if (!ec) f.path = target.is_absolute() ? target : path_given.parent_path() / target;
  }
  f.tmp = fmt::format("{}.tmp.{}", f.path.string(), ::getpid());
  const int fd = ::open(f.tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    throw InputError(fmt::format("{}: cannot be written ({}; does the folder exist?)", f.path.string(), std::strerror(errno)));
  std::string text;
  for (std::string_view piece : pieces) text.append(piece);
  if (!detail::write_all_and_close(fd, text, true)) {
    const int err = errno;
    ::unlink(f.tmp.c_str());
    throw InputError(fmt::format("{}: could not be written completely ({})", f.path.string(), std::strerror(err)));
  }
  return f;
}

// The descriptor a path names of this process's own (/dev/stdout, /dev/stderr, /dev/fd/N,
// /proc/self/fd/N), or -1. Opening such a path again would start a second offset at 0 in a file
// the stream was redirected to, and overwrite what the stream writes.
inline int own_descriptor(const std::filesystem::path& p) {
  const std::string s = p.string();
  if (s == "/dev/stdout") return 1;
  if (s == "/dev/stderr") return 2;
  for (const char* prefix : {"/dev/fd/", "/proc/self/fd/"})
    if (s.starts_with(prefix) && s.size() > std::strlen(prefix) && s.find_first_not_of("0123456789", std::strlen(prefix)) == std::string::npos)
      return std::atoi(s.c_str() + std::strlen(prefix));
  return -1;
}

// Puts a staged file in place: renamed over its path, or, for a device or a pipe, written now.
inline void commit_file(const StagedFile& f) {
  if (f.tmp.empty()) {
    if (const int own = own_descriptor(f.path); own >= 0) {  // written through the stream itself, after what it holds
      std::fflush(stdout);
      std::fflush(stderr);
      const int fd = ::dup(own);
      if (fd < 0 || !detail::write_all_and_close(fd, f.in_place_text, false))
        throw InputError(fmt::format("{}: could not be written completely ({})", f.path.string(), std::strerror(errno)));
      return;
    }
    const int fd = ::open(f.path.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) throw InputError(fmt::format("{}: cannot be written ({})", f.path.string(), std::strerror(errno)));
    if (!detail::write_all_and_close(fd, f.in_place_text, false))
      throw InputError(fmt::format("{}: could not be written completely ({})", f.path.string(), std::strerror(errno)));
    return;
  }
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

// One of several files written together (write_files_together). `label` names it in messages
// before its path (a flag: "--trace"), or is empty.
struct FileToWrite {
  std::string_view label;
  std::filesystem::path path;
  std::string_view text;
};

// Writes the files as one output: every file staged under its temporary name first, then all put
// in place, the renamed ones before the devices and pipes (which cannot be taken back). One that
// cannot be staged leaves none of the others behind ("... (nothing was written)"); a commit that
// fails discards the rest and names what was written before it.
inline void write_files_together(std::span<const FileToWrite> files) {
  std::vector<StagedFile> staged;
  for (const FileToWrite& f : files) {
    try {
      staged.push_back(stage_file(f.path, {&f.text, 1}));
    } catch (const InputError& e) {
      for (const StagedFile& done : staged) discard_file(done);
      throw InputError(fmt::format("{}{}{} (nothing was written)", f.label, f.label.empty() ? "" : " ", e.what()));
    }
  }
  std::stable_partition(staged.begin(), staged.end(), [](const StagedFile& f) { return !f.tmp.empty(); });
  for (std::size_t i = 0; i < staged.size(); ++i) {
    try {
      commit_file(staged[i]);
    } catch (const InputError& e) {
      std::string written;
      for (std::size_t k = 0; k < i; ++k) written += fmt::format("{}{}", k ? ", " : "", staged[k].path.string());
      for (std::size_t k = i + 1; k < staged.size(); ++k) discard_file(staged[k]);
      throw InputError(fmt::format("{} ({})", e.what(), written.empty() ? "nothing was written" : "written before it: " + written));
    }
  }
}

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
