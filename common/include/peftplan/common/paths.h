// How a path is shown to the user: relative to the working directory when it lies inside it (as
// the user would type it), else as given. For messages only; files are opened by their own path.
#pragma once

#include <filesystem>
#include <string>
#include <system_error>

namespace peftplan {

inline std::string shown_path(const std::filesystem::path& p) {
  std::error_code ec;
  const std::filesystem::path cwd = std::filesystem::current_path(ec);
  if (ec) return p.string();
  const std::filesystem::path rel = std::filesystem::absolute(p, ec).lexically_relative(cwd);
  if (ec || rel.empty() || *rel.begin() == "..") return p.string();
  return rel.string();
}

}  // namespace peftplan
