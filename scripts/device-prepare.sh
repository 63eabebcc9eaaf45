#!/usr/bin/env bash
# Copies into DIR (default .device/deps) a prefix holding what the project's find_package calls
# need and a GPU machine lacks: it has a compiler, CMake, Ninja and CUDA but none of our Debian
# -dev packages and no network. Run here, on the Debian 12 machine that has them
# (scripts/install-deps.sh); the tree then travels with the working tree, and the `device` preset
# points CMAKE_PREFIX_PATH at it.
#
# Each package's files under /usr are copied to the same place under DIR (DIR/include,
# DIR/lib/x86_64-linux-gnu, DIR/share/...), so its CMake config files, which locate themselves
# relative to their own path, keep working; OpenSSL's multiarch headers
# (/usr/include/x86_64-linux-gnu/openssl) move to DIR/include/openssl, where its other headers
# find them without the compiler's multiarch include path. RE2 has a pkg-config file and no CMake
# package: its re2.pc is rewritten to locate itself (${pcfiledir}), and models/CMakeLists.txt
# finds the library without pkg-config where that is absent. GoogleTest goes as its source tree
# (DIR/src/googletest), built with the tests by that machine's compiler.
#
# Deliberately left out (the tree travels under a 64 MiB limit): documentation, man pages, other
# pkg-config files, static libraries, Eigen's unsupported/ modules, OpenSSL's engines and
# providers, and GoogleTest's own tests and samples. Shared libraries are copied with their links
# (libfmt, libyaml-cpp, libre2, libcrypto, and libssl, which nothing links but FindOpenSSL looks
# for) and found at run time through the build tree's RPATH.
#
# Usage: scripts/device-prepare.sh [DIR]   (prints what it copied and the total size)
set -euo pipefail

cd "$(dirname "$0")/.."
dest=${1:-.device/deps}
limit_mib=40  # the working tree travels with a 64 MiB limit; leave room for the rest of it

multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch)

packages=(nlohmann-json3-dev libfmt-dev libfmt9 libcli11-dev libyaml-cpp-dev libyaml-cpp0.7
          libeigen3-dev libssl-dev libssl3 libre2-dev libre2-9 googletest)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "device-prepare: not installed: ${missing[*]} (scripts/install-deps.sh, or apt-get install them)" >&2
  exit 2
fi

# Whether a packaged path is left out (see the file comment).
skipped() {
  case "$1" in
    */pkgconfig/re2.pc) return 1 ;;
    /usr/share/doc/* | /usr/share/man/* | /usr/share/lintian/* | */pkgconfig/*) return 0 ;;
    *.a) return 0 ;;
    /usr/include/eigen3/unsupported/*) return 0 ;;
    /usr/share/eigen3/cmake/UseEigen3.cmake) return 0 ;;
    */engines-3/* | */ossl-modules/*) return 0 ;;
    /usr/src/*) return 0 ;;  # googletest: copied below as a source tree
    /usr/lib/*/*) return 1 ;;
    /usr/include/* | /usr/share/cmake/* | /usr/share/eigen3/* | /usr/lib/cmake/*) return 1 ;;
  esac
  return 0  # anything else (binaries, /etc, /usr/share/<other>) is not needed to build
}

rm -rf "$dest"
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
copied=0
for p in "${packages[@]}"; do
  while IFS= read -r f; do
    [[ -f "$f" || -L "$f" ]] || continue  # directories come with their files
    skipped "$f" && continue
    rel=${f#/usr/}
    rel=${rel/#include\/$multiarch\//include/}  # multiarch headers beside the others
    mkdir -p "$dest/$(dirname "$rel")"
    cp -P "$f" "$dest/$rel"  # links stay links (libfmt.so -> libfmt.so.9 -> libfmt.so.9.1.0)
    copied=$((copied + 1))
  done < <(dpkg -L "$p")
done

# re2.pc names /usr; pkg-config's ${pcfiledir} (the folder the .pc file is in) makes it relative.
pc="$dest/lib/$multiarch/pkgconfig/re2.pc"
sed -i -e "s|=/usr/|=\${pcfiledir}/../../../|" "$pc"
if grep -q '/usr' "$pc"; then
  echo "device-prepare: $pc still names /usr" >&2
  exit 1
fi

# GoogleTest's source tree: the libraries and their CMake files, not its tests, samples or docs.
src=/usr/src/googletest
mkdir -p "$dest/src/googletest"
cp "$src/CMakeLists.txt" "$dest/src/googletest/"
for part in googletest googlemock; do
  mkdir -p "$dest/src/googletest/$part"
  cp "$src/$part/CMakeLists.txt" "$dest/src/googletest/$part/"
  cp -r "$src/$part/cmake" "$src/$part/include" "$src/$part/src" "$dest/src/googletest/$part/"
done

# Every link must resolve inside the prefix (a link to /usr would work here and nowhere else).
while IFS= read -r l; do
  target=$(readlink -f "$l" || true)
  if [[ "$target" != "$dest"/* || ! -e "$target" ]]; then
    echo "device-prepare: $l points outside the prefix ($(readlink "$l"))" >&2
    exit 1
  fi
done < <(find "$dest" -type l)

# The config files must locate everything relative to themselves. Debian's exports keep one
# absolute path each, in a guard that applies only when the file sits at its original /usr place
# ("/usr move" symlinks): get_filename_component(_realOrig "/usr/lib/.../cmake/<pkg>" REALPATH)
# and the set() under it. Any other absolute /usr path is an error.
bad=$(grep -rn --include='*.cmake' '/usr' "$dest" \
  | grep -v '_realOrig "/usr/' \
  | grep -v 'set(_IMPORT_PREFIX "/usr/' \
  | grep -v 'set(PACKAGE_PREFIX_DIR "/usr")' \
  | grep -v ':[0-9]*:[[:space:]]*#' \
  | grep -v "$dest/src/googletest/" || true)
if [[ -n "$bad" ]]; then
  echo "device-prepare: absolute /usr paths in the copied CMake files:" >&2
  echo "$bad" >&2
  exit 1
fi

bytes=$(du -sb "$dest" | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "device-prepare: $copied packaged files and GoogleTest's source in $dest: $mib MiB"
for d in include lib share src; do
  [[ -d "$dest/$d" ]] && printf '  %-8s %s\n' "$d" "$(du -sh "$dest/$d" | cut -f1)"
done
if ((bytes > limit_mib * 1048576)); then
  echo "device-prepare: $mib MiB is over the ${limit_mib} MiB budget" >&2
  exit 1
fi
