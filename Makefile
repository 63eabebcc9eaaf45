# Thin wrapper over the CMake presets. `make run` and `make test` each do every set-up step on a
# fresh machine (packages, configure, build) before they do their job.
PRESET ?= release
BUILD := build/$(PRESET)
JOBS ?= $(shell nproc)

.PHONY: all deps configure build run demo test bench clean

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

# Plan-and-run on the embedded default: a tiny Llama with LoRA on 2 ranks, three strategies,
# trained on this README; each run ends with its predicted-versus-measured table. The exit code
# is 1 when a figure falls outside the tolerances (see README, "Predicted versus measured").
DEMO_STRATEGIES ?= ddp zero2 zero3
demo: build
	@status=0; for s in $(DEMO_STRATEGIES); do \
	  echo "== peftplan run --strategy $$s"; \
	  OMP_NUM_THREADS=1 $(BUILD)/cli/peftplan run --model tiny-llama-4l --lora-r 16 --lora-alpha 32 \
	    --lora-targets all-linear --gpus 2 --strategy $$s --micro-batch 2 --seq-len 128 --steps 20 \
	    --lr 3e-3 --data README.md --out out/demo-$$s || status=$$?; \
	done; exit $$status

test: build
	ctest --preset $(PRESET) -j $(JOBS)

bench: build
	$(BUILD)/bench/bench_planner

clean:
	rm -rf build
