// The one way the peftplan command writes an output file: to a temporary name beside it, then a
// rename, so that a reader (or a failed run) never leaves half a file behind. Deliberately only
// the CLI's: the libraries write through their own writers (plan_file.h, cluster.h).
#pragma once

#include <filesystem>
#include <string>

namespace peftplan::cli {

// Throws InputError naming the path when it cannot be written (a missing folder, no space).
void write_text_atomic(const std::filesystem::path& path, const std::string& text);

}  // namespace peftplan::cli
