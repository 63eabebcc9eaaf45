// A step program's identity: a hash of everything an interpreter reads (buffers' categories,
// sizes and views; every op's fields, operands, work and dependencies; the program's totals),
// and not of the names and labels that are there for people (a program built with names off
// hashes the same). plan.json carries it so that the executor can check that the program it
// builds from the file is the one the planner predicted (planner/plan_file.h).
// Deliberately not a cryptographic hash: it detects disagreement between builds, not tampering.
#pragma once

#include <cstdint>
#include <string>

#include "peftplan/sim/program.h"

namespace peftplan::sim {

// The version of the program contract (program.h, verify.h): bumped when an interpreter would
// read the same fields differently. plan.json records it beside the hash.
inline constexpr int kProgramContractVersion = 3;

// 64-bit FNV-1a over the program's interpreted fields, in program order.
std::uint64_t program_hash(const Program& program);

// Whether two programs agree in every field the hash reads (the same list), compared word for
// word: what a search uses to check a program it derived against a build.
bool same_interpreted_fields(const Program& a, const Program& b);

// The hash as plan.json writes it: 16 lower-case hex digits.
std::string program_hash_hex(const Program& program);

}  // namespace peftplan::sim
