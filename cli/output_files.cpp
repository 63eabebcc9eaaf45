// Atomic output files (see output_files.h).
#include "output_files.h"

#include <unistd.h>

#include <fstream>
#include <system_error>

#include <fmt/format.h>

#include "peftplan/common/error.h"

namespace peftplan::cli {

void write_text_atomic(const std::filesystem::path& path, const std::string& text) {
  const std::filesystem::path tmp = path.string() + fmt::format(".tmp.{}", ::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw input_error(path.string(), "", "cannot be written (does the folder exist?)");
    f << text;
    if (!f.flush()) {
      std::error_code ignored;
      std::filesystem::remove(tmp, ignored);
      throw input_error(path.string(), "", "could not be written completely");
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    throw input_error(path.string(), "", "cannot be renamed into place");
  }
}

}  // namespace peftplan::cli
