# Thin wrapper over the CMake presets. `make run` and `make test` each do every set-up step on a
# fresh machine (packages, configure, build) before they do their job.
PRESET ?= release
BUILD := build/$(PRESET)
JOBS ?= $(shell nproc)

.PHONY: all deps configure build run test bench fuzz clean

all: build

deps:
	./scripts/install-deps.sh

$(BUILD)/build.ninja: CMakeLists.txt CMakePresets.json
	cmake --preset $(PRESET)

configure: deps $(BUILD)/build.ninja

build: configure
	cmake --build --preset $(PRESET) -j $(JOBS)

# The main job on the embedded default: plan-and-run a tiny Llama with LoRA on 2 ranks with DDP,
# ZeRO-2 and ZeRO-3, trained on the bundled text, ending with the predicted-versus-measured
# comparison (calibrating this machine when ~/.cache/peftplan has no profile, or when the machine's
# speed has moved more than the time tolerance, 15%, from the cached one, or the cached one was made
# beside more other work than the machine has now). Exit code 1 when a
# figure falls outside the tolerances (see README, "Predicted versus measured").
# It builds only what it runs (the CLI and the MPI executor it launches): 5 min on a fresh clone
# of this 2-core VM instead of the whole tree's 7-8 (tests, benchmarks, the GUI); `make test`
# builds the rest.
RUN_TARGETS := peftplan peftplan-exec
run: configure
	cmake --build --preset $(PRESET) -j $(JOBS) --target $(RUN_TARGETS)
	$(BUILD)/cli/peftplan run --out out/run

test: build
	ctest --preset $(PRESET) -j $(JOBS)

bench: build
	$(BUILD)/bench/bench_planner

# Every parser under libFuzzer for FUZZ_SECONDS each (clang, AddressSanitizer and
# UndefinedBehaviorSanitizer; its own build tree, build/fuzz). Findings land in
# build/fuzz/fuzz-findings/<target>/, the summary in build/fuzz/fuzz-summary.txt (scripts/fuzz.sh).
FUZZ_SECONDS ?= 600
fuzz: deps
	cmake --preset fuzz
	cmake --build --preset fuzz --target fuzz_targets -j $(JOBS)
	./scripts/fuzz.sh build/fuzz $(FUZZ_SECONDS)

clean:
	rm -rf build
