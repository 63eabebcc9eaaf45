// The text bundled with peftplan (data/corpus.txt, compiled in by cli/CMakeLists.txt): what
// `peftplan run` trains on when no --data is given, so that the default job needs no files.
#pragma once

#include <string_view>

namespace peftplan::cli {

std::string_view bundled_corpus();

}  // namespace peftplan::cli
