#!/usr/bin/env bash
# scripts/device-prepare.sh end to end (ctest label device-prepare): the prefix it copies into a
# fresh folder lets the project configure as on a GPU machine that has none of our Debian
# packages: every vendored package found in the prefix and none from /usr (CMake told to ignore
# the system prefixes), MPI absent, RE2 found once through pkg-config and once without it (the
# GPU machine may lack pkg-config), GoogleTest built from the prefix's source. Configure only: the
# build is the GPU machine's (README, "Building on a GPU machine").
# Exit 77 (ctest's skip) where the Debian packages the script copies are not installed.
#   tests/test_device_prepare.sh SOURCE_DIR [CMAKE [GENERATOR [MAKE_PROGRAM [CXX_COMPILER]]]]
set -euo pipefail

src=$1
cmake=${2:-cmake}
generator=${3:-Ninja}
make_program=${4:-}
cxx=${5:-}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/peftplan-device-prepare.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
deps=$tmp/deps

rc=0
"$src/scripts/device-prepare.sh" "$deps" >"$tmp/prepare.log" 2>&1 || rc=$?
cat "$tmp/prepare.log"
if ((rc == 2)); then
  echo "skipped: the packages device-prepare.sh copies are not installed here"
  exit 77
fi
((rc == 0)) || { echo "FAIL: device-prepare.sh exited $rc"; exit 1; }
deps=$(cd "$deps" && pwd)

failures=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

# A cache entry's value (the part after the first '=').
cache_value() { sed -n "s|^$2:[A-Z]*=||p" "$1/CMakeCache.txt" | head -1; }

for mode in pkg-config no-pkg-config; do
  build=$tmp/build-$mode
  args=(-S "$src" -B "$build" -G "$generator"
        -DCMAKE_BUILD_TYPE=Release
        -DCMAKE_PREFIX_PATH="$deps" -DOPENSSL_ROOT_DIR="$deps"
        -DPEFTPLAN_GTEST_SOURCE_DIR="$deps/src/googletest"
        # Nothing of ours from the system: CMake >= 3.23 skips these prefixes in every find_*.
        "-DCMAKE_IGNORE_PREFIX_PATH=/usr;/usr/local;/"
        "-DCMAKE_SYSTEM_IGNORE_PREFIX_PATH=/usr;/usr/local;/"
        -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
        -DPEFTPLAN_BUILD_GUI=OFF -DPEFTPLAN_BUILD_BENCH=OFF -DPEFTPLAN_WITH_CUDA=OFF
        -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON)
  [[ -n "$make_program" ]] && args+=(-DCMAKE_MAKE_PROGRAM="$make_program")
  [[ -n "$cxx" ]] && args+=(-DCMAKE_CXX_COMPILER="$cxx")
  # A machine without pkg-config: FindPkgConfig finds no executable.
  [[ "$mode" == no-pkg-config ]] && args+=(-DPKG_CONFIG_EXECUTABLE="$tmp/no-pkg-config")
  echo "== configure ($mode)"
  if ! "$cmake" "${args[@]}" >"$build.log" 2>&1; then
    cat "$build.log"
    fail "configure ($mode) failed"
    continue
  fi
  grep -E '^-- (peftplan:|Found)' "$build.log" || true

  # Each vendored package from the prefix. The *_DIR entries are the config files' folders.
  vars=(nlohmann_json_DIR fmt_DIR CLI11_DIR yaml-cpp_DIR Eigen3_DIR OPENSSL_INCLUDE_DIR
        OPENSSL_CRYPTO_LIBRARY OPENSSL_SSL_LIBRARY)
  if [[ "$mode" == pkg-config ]]; then
    vars+=(pkgcfg_lib_RE2_re2)
  else
    vars+=(RE2_INCLUDE_DIR RE2_LIBRARY)
  fi
  for v in "${vars[@]}"; do
    value=$(cache_value "$build" "$v")
    case "$value" in
      "$deps"/*) echo "ok: $v=$value" ;;
      *) fail "$mode: $v is '$value', not under $deps" ;;
    esac
  done
  grep -q "peftplan: GoogleTest built from $deps/src/googletest" "$build.log" || fail "$mode: GoogleTest not built from the prefix"
  grep -q "peftplan: MPI not found: peftplan-exec runs one rank" "$build.log" || fail "$mode: peftplan-exec is not built for one rank without MPI"
  if [[ "$mode" == no-pkg-config ]]; then
    grep -q "peftplan: RE2 found without pkg-config: $deps/" "$build.log" || fail "$mode: RE2 not found without pkg-config"
  fi
done

if ((failures)); then
  echo "$failures failure(s)"
  exit 1
fi
echo "device-prepare: the project configures from $deps alone"
