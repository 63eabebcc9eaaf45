#!/usr/bin/env bash
# The one place that knows which Debian packages peftplan needs. Idempotent: packages already
# installed are skipped, so running it again costs a few dpkg queries and nothing else.
# CUDA and NCCL are deliberately not installed here: the build detects them when present.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config   # compiler and build
  libeigen3-dev                                  # executor CPU kernels (GEMM)
  nlohmann-json3-dev                             # every JSON file in and out
  libyaml-cpp-dev                                # accelerate's FSDP config YAML in and out
  libfmt-dev                                     # formatting tables and messages
  libssl-dev                                     # SHA-256 (OpenSSL libcrypto): config.json identity
  libcli11-dev                                   # command-line parsing
  libre2-dev                                     # PEFT's target_modules / rank_pattern regexes, matched in linear time
  libgtest-dev libgmock-dev googletest           # unit and end-to-end tests
  libbenchmark-dev                               # bench/ programs
  openmpi-bin libopenmpi-dev                     # executor ranks and CPU collectives
  qt6-base-dev qt6-charts-dev libgl-dev          # peftplan-gui (Widgets, Charts, Test)
  libqt6opengl6-dev libxkbcommon-dev             #   Qt6Charts' CMake config needs Qt6OpenGL, whose
                                                 #   config needs XKB: without them Charts is "not found"
  chromium                                       # renders and prints peftplan report's HTML in tests
  poppler-utils                                  # pdftoppm: the printed report's pages as images, checked for cut content
  xvfb xauth                                     # peftplan-gui in a real X window in tests
  clang libclang-rt-14-dev libomp-14-dev         # make fuzz: libFuzzer, the sanitizers' runtimes, OpenMP for clang
  python3 python3-torch libopenblas0-pthread     # tools/peftplan_callback.py and its CPU test
                                                 #   (without OpenBLAS torch runs reference BLAS)
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
