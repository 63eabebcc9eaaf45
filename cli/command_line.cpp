// The process's command line, kept for reports (commands.h).
#include <cmath>
#include <string>

#include "commands.h"

namespace peftplan::cli {
namespace {
std::string& line() {
  static std::string s;
  return s;
}
}  // namespace

void set_command_line(int argc, char** argv) {
  std::string s = "peftplan";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool plain = !a.empty() && a.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:,+@%") == std::string::npos;
    if (plain) {
      s += " " + a;
      continue;
    }
    std::string q = " '";
    for (char c : a) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    s += q + "'";
  }
  line() = s;
}

const std::string& command_line() { return line(); }

std::string as_folder(const std::string& path) {
  std::string s = path;
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return s == "/" ? s : s + "/";
}

CLI::Validator finite_non_negative() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        std::size_t used = 0;
        double v = 0.0;
        try {
          v = std::stod(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used != text.size() || used == 0) return "must be a number, got " + text;
        return std::isfinite(v) && v >= 0.0 ? std::string() : "must be a finite number >= 0, got " + text;
      },
      "NUMBER >= 0");
}

}  // namespace peftplan::cli
