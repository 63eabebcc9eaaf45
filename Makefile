# Thin wrapper over the CMake presets. `make run` and `make test` each do every set-up step on a
# fresh machine (packages, configure, build) before they do their job.
PRESET ?= release
BUILD := build/$(PRESET)
JOBS ?= $(shell nproc)

.PHONY: all deps configure build run test bench clean

all: build

deps:
	./scripts/install-deps.sh

$(BUILD)/build.ninja: CMakeLists.txt CMakePresets.json
	cmake --preset $(PRESET)

configure: deps $(BUILD)/build.ninja

build: configure
	cmake --build --preset $(PRESET) -j $(JOBS)

# The main job on the embedded default: plan a bundled model on a bundled cluster.
run: build
	$(BUILD)/cli/peftplan plan

test: build
	ctest --preset $(PRESET) -j $(JOBS)

bench: build
	$(BUILD)/bench/bench_planner

clean:
	rm -rf build
