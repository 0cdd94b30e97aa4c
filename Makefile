# FlexGen in C. `make` builds ./flexgen: the CPU backend, and the CUDA backend (flexgen.cu) too
# wherever nvcc is found (NVCC=, or /usr/local/cuda/bin); the binary picks one at run time.
# `make test` runs the CUnit suites, each in a process of its own, so that a crash ends one test
# and hides nothing else (the GPU suite skips without a GPU; SUITE=name runs one, e.g. `make test
# SUITE=quant`, and TEST="its description" one test of it), then the instruction-set matrix: the
# suites that reach a product again with lower levels forced, as a laptop runs them (MATRIX=0:
# not; docs/TESTS.md); its last line is `N passed, N failed`. `make test-san` runs the suites
# again under AddressSanitizer and UndefinedBehaviorSanitizer; `make test-gpu` runs the GPU suite
# under compute-sanitizer. `make fuzz` builds the libFuzzer harnesses of tests/fuzz/ (clang), which
# `bash scripts/fuzz.sh SECONDS` runs.
CC ?= gcc
ARCH := $(shell $(CC) -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
# A private prefix (DEPS=DIR: Debian packages unpacked with `dpkg-deb -x`, as in the bundle of
# scripts/gpu_bundle.sh) that the libraries and headers come from instead of /usr; empty: /usr.
DEPS ?=
PREFIX := $(if $(DEPS),$(abspath $(DEPS)))
# OpenBLAS's OpenMP build, so BLAS and our loops share one thread pool (docs/DESIGN.md, "Conventions").
BLAS_INC := $(PREFIX)/usr/include/$(ARCH)/openblas-openmp
BLAS_LIB := $(PREFIX)/usr/lib/$(ARCH)/openblas-openmp
# The prefix's other headers and libraries (cJSON, CUnit, GLPK, libgfortran). Its paths go in as
# DT_RPATH (--disable-new-dtags), not DT_RUNPATH: only DT_RPATH is also searched for the
# libraries' own dependencies (OpenBLAS's libgfortran, GLPK's libamd).
DEPS_CFLAGS := -I$(PREFIX)/usr/include
DEPS_LIBS := -L$(PREFIX)/usr/lib/$(ARCH) -Wl,-rpath,$(PREFIX)/usr/lib/$(ARCH) -Wl,--disable-new-dtags
# CFLAGS= (the environment's or the command line's) replaces the optimisation alone: the flags the
# build needs are added to it (override: a command-line CFLAGS would drop them).
CFLAGS ?= -O2
# Warnings are errors; WERROR= keeps them warnings (docs/EXERCISES.md: a function emptied for an
# exercise leaves its helpers and parameters unused).
WERROR ?= -Werror
override CFLAGS += -std=c11 -Wall -Wextra $(WERROR) -fopenmp -I. -I$(BLAS_INC)
# LDFLAGS= and LDLIBS= are added to the links the same way (the libraries the build needs kept).
override LDLIBS += -L$(BLAS_LIB) -Wl,-rpath,$(BLAS_LIB) -lopenblas -lcjson -lm
ifneq ($(PREFIX),)
override CFLAGS += $(DEPS_CFLAGS)
override LDLIBS += $(DEPS_LIBS)
endif
# oneDNN (Debian's libdnnl-dev), for the opt-in prefill schemes' products (support/onednn.c),
# where its header is found; without it those products run on plain loops.
ONEDNN_H := $(wildcard $(PREFIX)/usr/include/oneapi/dnnl/dnnl.h)
ifneq ($(ONEDNN_H),)
override CFLAGS += -DFLEXGEN_ONEDNN
override LDLIBS += -ldnnl
endif
# The tests' references: CUnit, and GLPK for lp.c (./flexgen itself links neither).
TEST_LIBS := -lcunit -lglpk
# Each object's list of the files it includes, beside it (OBJ.d, which make reads back); -MP: a
# target for each header too, so that a header removed or renamed stops no build.
DEPFLAGS := -MMD -MP
SAN := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined,float-cast-overflow -fno-sanitize-recover=all

# The paper's C files (flexgen.c's runtime in two: the schedule, and tiers.c, what it moves
# between) and llama_model.c beside opt_model.c (flexgen.cu, the fifth paper file,
# builds below); the services beneath them (support/); the program around them (app/): the
# command line, a run opened, the pipeline's stages, the CPU backends' tables. A first reading can
# skip both folders.
PAPER := opt_model.c llama_model.c quant.c flexgen.c tiers.c lp.c
SUPPORT := $(addprefix support/,util.c simd.c matmul.c int8.c workspace.c sampling.c safetensors.c \
           checkpoint.c weight_file.c tokenizer.c tokenizer_encode.c tokenizer_json.c nfc.c trace.c kv_pages.c avx512.c \
           avx512_simde.c disk_arena.c io_links.c blas_core.c onednn.c)
APP := $(addprefix app/,cpu_backend.c cpu_fp16.c perplexity.c pipeline.c profile.c jobs.c stage.c \
       runtime.c args.c prompts.c plan.c run.c job_run.c report.c commands.c int8_columns.c cli.c)
SRC := $(PAPER) $(SUPPORT) $(APP)
# The objects each binary links (the rules that build them are below the emulated GPU's):
# sources that read no build define (SHARED_SRC) compile once for all four binaries of a build.
# $(1): build or build-san; $(2): build-emu or build-san-emu
PER_BUILD_SRC := support/util.c app/cli.c
SHARED_SRC := $(filter-out $(PER_BUILD_SRC),$(SRC))
main_objs = $(SRC:%.c=$(1)/obj/%.o)
test_objs = $(SHARED_SRC:%.c=$(1)/obj/%.o) $(1)/obj/support/util.o $(1)/obj-tests/app/cli.o \
            $(TEST_SRC:%.c=$(1)/obj-tests/%.o)
emu_main_objs = $(SHARED_SRC:%.c=$(1)/obj/%.o) $(2)/obj/support/util.o $(1)/obj/app/cli.o
emu_test_objs = $(SHARED_SRC:%.c=$(1)/obj/%.o) $(2)/obj/support/util.o $(1)/obj-tests/app/cli.o \
                $(TEST_SRC:%.c=$(2)/obj-tests/%.o)

CUDA_OBJ :=
TEST_CUDA_OBJ :=

# CUDA: cuBLAS is the only GPU library. Code for T4 (sm_75), A100 (sm_80), RTX 30/40 (sm_86,
# sm_89), H100 (sm_90), and PTX of sm_90 for newer GPUs. The emulated build (below) gets the same list.
CUDA_SM := 75 80 86 89 90
comma := ,
empty :=
CUDA_ARCH_LIST := $(subst $(empty) $(empty),$(comma),$(CUDA_SM:%=%0))
NVCC ?= $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CUDA_LDLIBS :=
ifneq ($(NVCC),)
# The toolkit nvcc belongs to, as nvcc itself names it (its TOP: a wrapper script on the PATH still
# leads to the toolkit's libraries), else where nvcc's links end; CUDA_HOME= in the environment or
# on the command line wins.
ifeq ($(origin CUDA_HOME),undefined)
CUDA_HOME := $(abspath $(shell $(NVCC) --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^\#\$$ TOP=//p'))
endif
ifeq ($(CUDA_HOME),)
CUDA_HOME := $(patsubst %/bin/nvcc,%,$(realpath $(NVCC)))
endif
CUDA_ARCHS := $(foreach a,$(CUDA_SM),-gencode arch=compute_$(a),code=sm_$(a)) \
              -gencode arch=compute_$(lastword $(CUDA_SM)),code=compute_$(lastword $(CUDA_SM))
NVCCFLAGS ?= -O2
override NVCCFLAGS += -std=c++17 -I. $(CUDA_ARCHS) -Xcompiler -Wall,-Wextra,-Werror -Werror all-warnings
CUDA_OBJ := build/flexgen_cu.o build/cuda_device_cu.o
TEST_CUDA_OBJ := build/test_kernels.o build/cuda_device_cu.o
override CFLAGS += -DFLEXGEN_CUDA
CUDA_LDLIBS := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublasLt -lcublas -lcudart -lstdc++
endif
# MPI (pipeline parallelism, §4.4): pipeline.c talks MPI where mpicc is found (MPICC=); the
# whole program then links Open MPI's libraries. Without it every run is one process.
MPICC ?= $(shell command -v mpicc 2>/dev/null)
ifneq ($(MPICC),)
override CFLAGS += -DFLEXGEN_MPI $(shell $(MPICC) --showme:compile 2>/dev/null || $(MPICC) -compile-info | cut -d' ' -f2-)
override LDLIBS += $(shell $(MPICC) --showme:link 2>/dev/null || $(MPICC) -link-info | cut -d' ' -f2-)
endif
HDR := model.h tiers.h flexgen.h support/support.h support/tools.h support/nfc.h support/nfc_tables.h app/app.h
# The CUDA backend's plumbing (support/cuda_device.cu), beneath flexgen.cu: its header, for the
# CUDA sources alone.
CUDA_HDR := support/cuda_device.h support/cuda_kernels.h
TEST_SRC := $(wildcard tests/*.c)
# The tokenizer fixtures kept compressed (tests/fixtures/tokenizers/, xz), unpacked for the tests
# into build/tokenizers/ with the tokenizer_config.json each tokenizer.json reads beside it.
TOK_FIXTURES := $(patsubst tests/fixtures/%.xz,build/%,$(wildcard tests/fixtures/tokenizers/*.xz tests/fixtures/tokenizers/*/*.xz)) \
                $(patsubst tests/fixtures/%,build/%,$(wildcard tests/fixtures/tokenizers/*/tokenizer_config.json))

.PHONY: all test test-san test-gpu fuzz fuzz-toolchain bench clean print-cflags emu format FORCE

all: flexgen

flexgen: $(call main_objs,build) $(CUDA_OBJ)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $^ $(LDLIBS) $(CUDA_LDLIBS)
	@echo "flexgen: built $(if $(NVCC),with CUDA ($(NVCC)),without CUDA (no nvcc found; NVCC= names one)),\
	 $(if $(MPICC),with MPI,without MPI (no mpicc)), $(if $(ONEDNN_H),with oneDNN,without oneDNN (no dnnl.h))"

build/flexgen_cu.o: flexgen.cu $(HDR) $(CUDA_HDR)
	@mkdir -p build
	$(NVCC) $(NVCCFLAGS) -c -o $@ flexgen.cu

build/cuda_device_cu.o: support/cuda_device.cu $(HDR) $(CUDA_HDR)
	@mkdir -p build
	$(NVCC) $(NVCCFLAGS) -c -o $@ support/cuda_device.cu

# The kernel tests include flexgen.cu, so the test binary links them in its place.
build/test_kernels.o: tests/test_kernels.cu flexgen.cu $(HDR) $(CUDA_HDR) tests/tests.h
	@mkdir -p build
	$(NVCC) $(NVCCFLAGS) -I$(BLAS_INC) $(if $(PREFIX),$(DEPS_CFLAGS)) -c -o $@ tests/test_kernels.cu

build/test_flexgen: $(call test_objs,build) $(TEST_CUDA_OBJ)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $^ $(LDLIBS) $(CUDA_LDLIBS) $(TEST_LIBS)

# The emulated GPU (tests/cuda_emu, docs/GPU.md): flexgen.cu, support/cuda_device.cu and the
# kernel tests compiled by g++
# against the harness's cuda_runtime.h, cuda_fp16.h and cublas_v2.h, on every machine, nvcc or
# not. One step rewrites each launch `k<<<grid, block, shared, stream>>>(` into a macro call and
# `extern __shared__ T x[];` into the block's dynamic shared memory, and blanks nvcc's
# `#pragma unroll` lines; #line keeps flexgen.cu's lines.
# build-emu/test_flexgen runs the suites gpu, kernels and emu; ./flexgen-emu is ./flexgen on the
# emulated GPU (`make emu`; EMU_OPT=-O0 for stepping through kernels in gdb).
EMU := tests/cuda_emu
EMU_HDR := $(EMU)/cuda_runtime.h $(EMU)/cuda_fp16.h $(EMU)/cublas_v2.h $(EMU)/cublasLt.h $(EMU)/cuda_emu.h
EMU_SED := sed -e 's/\b\([A-Za-z_][A-Za-z_0-9]*\)<<<\(.*\)>>>(/CUDA_EMU_LAUNCH(\1, \2)(/' \
               -e 's/extern __shared__ \([A-Za-z_0-9]*\) \([A-Za-z_0-9]*\)\[\];/\1 *\2 = (\1 *)cuda_emu::dynamic_shared();/'
EMU_SED += -e 's/^ *\#pragma unroll$$//'
EMU_OPT ?= -O2
EMU_CXXFLAGS = -std=c++17 $(EMU_OPT) -g -Wall -Wextra $(WERROR) -ffp-contract=off -I$(EMU) -I. -I$(BLAS_INC) \
               $(if $(PREFIX),$(DEPS_CFLAGS)) -D__CUDA_ARCH_LIST__=$(CUDA_ARCH_LIST) -DFLEXGEN_CUDA_EMU
EMU_CFLAGS = $(filter-out -DFLEXGEN_CUDA,$(CFLAGS)) -DFLEXGEN_CUDA -DFLEXGEN_CUDA_EMU
EMU_LDLIBS := $(LDLIBS) -lstdc++

build-emu/%.cu: %.cu
	@mkdir -p $(dir $@)
	(echo '#line 1 "$<"'; $(EMU_SED) $<) > $@

# The optimization the emulated objects were built with is a file of its build directory, so
# that `make emu EMU_OPT=-O0` after an -O2 build (or back) builds them again.
EMU_OPT_TAG := $(subst $(empty) $(empty),_,$(subst -,,$(EMU_OPT)))

define emu_build # $(1): the build directory, $(2): extra flags (the sanitizers), $(3): the C objects' build
$(1)/.opt-$(EMU_OPT_TAG):
	@mkdir -p $(1) && rm -f $(1)/.opt-* && touch $$@
$(1)/emu.o $(1)/flexgen_cu.o $(1)/cuda_device_cu.o $(1)/test_kernels.o $(1)/test_emu.o: $(1)/.opt-$(EMU_OPT_TAG)
$(1)/emu.o: $(EMU)/emu.cpp $(EMU_HDR)
	@mkdir -p $(1)
	$(CXX) $(EMU_CXXFLAGS) $(2) $(DEPFLAGS) -c -o $$@ $$<
$(1)/flexgen_cu.o: build-emu/flexgen.cu $(EMU_HDR) $(HDR) $(CUDA_HDR)
	@mkdir -p $(1)
	$(CXX) $(EMU_CXXFLAGS) $(2) $(DEPFLAGS) -x c++ -c -o $$@ $$<
$(1)/cuda_device_cu.o: build-emu/support/cuda_device.cu $(EMU_HDR) $(HDR) $(CUDA_HDR)
	@mkdir -p $(1)
	$(CXX) $(EMU_CXXFLAGS) $(2) $(DEPFLAGS) -x c++ -c -o $$@ $$<
$(1)/test_kernels.o: build-emu/tests/test_kernels.cu build-emu/flexgen.cu $(EMU_HDR) $(HDR) $(CUDA_HDR) tests/tests.h
	@mkdir -p $(1)
	$(CXX) -Ibuild-emu $(EMU_CXXFLAGS) $(2) $(DEPFLAGS) -x c++ -c -o $$@ $$<
$(1)/test_emu.o: build-emu/tests/cuda_emu/test_emu.cu $(EMU_HDR) tests/tests.h
	@mkdir -p $(1)
	$(CXX) $(EMU_CXXFLAGS) $(2) $(DEPFLAGS) -x c++ -c -o $$@ $$<
$(1)/test_flexgen: $(call emu_test_objs,$(3),$(1)) $(1)/test_kernels.o $(1)/cuda_device_cu.o $(1)/test_emu.o $(1)/emu.o
	$(CC) $(EMU_CFLAGS) $(2) $(LDFLAGS) -o $$@ $$^ $(EMU_LDLIBS) $(TEST_LIBS)
endef
$(eval $(call emu_build,build-emu,,build))
$(eval $(call emu_build,build-san-emu,$(SAN),build-san))

flexgen-emu: $(call emu_main_objs,build,build-emu) build-emu/flexgen_cu.o build-emu/cuda_device_cu.o build-emu/emu.o
	$(CC) $(EMU_CFLAGS) $(LDFLAGS) -o $@ $^ $(EMU_LDLIBS)
build-san-emu/flexgen: $(call emu_main_objs,build-san,build-san-emu) build-san-emu/flexgen_cu.o build-san-emu/cuda_device_cu.o build-san-emu/emu.o
	$(CC) $(EMU_CFLAGS) $(SAN) $(LDFLAGS) -o $@ $^ $(EMU_LDLIBS)

# The C objects. Each source compiles once into build/obj/ (build-san/obj/ under the sanitizers),
# for ./flexgen, the emulated GPU's ./flexgen-emu and both test binaries alike. Two sources read
# the build's defines, and compile again where those differ: app/cli.c without its main() for the
# test binaries (FLEXGEN_NO_MAIN; obj-tests/, with the tests' sources), and support/util.c with
# FLEXGEN_CUDA for the emulated GPU (build-emu/obj/, where nvcc is missing). `make test` checks
# that no other source reads them. Each object directory keeps its flags in a file, .flags: when
# they change (CFLAGS=, NVCC= or WERROR= on the command line), its objects build again. Each
# object depends on every file it includes, by the list the compiler writes beside it (DEPFLAGS),
# which make reads back below (scripts/check_deps.sh, in make test, checks that it still does).
define objects # $(1): the directory, $(2): the flags
$(1)/.flags: FORCE
	@mkdir -p $(1)
	@echo '$(CC) $(2) $(DEPFLAGS)' | cmp -s - $$@ || echo '$(CC) $(2) $(DEPFLAGS)' >$$@
$(1)/%.o: %.c $(1)/.flags
	@mkdir -p $$(dir $$@)
	$(CC) $(2) $(DEPFLAGS) -c -o $$@ $$<
endef
$(eval $(call objects,build/obj,$(CFLAGS)))
$(eval $(call objects,build/obj-tests,$(CFLAGS) -DFLEXGEN_NO_MAIN))
$(eval $(call objects,build-emu/obj,$(EMU_CFLAGS)))
$(eval $(call objects,build-emu/obj-tests,$(EMU_CFLAGS) -DFLEXGEN_NO_MAIN))
$(eval $(call objects,build-san/obj,$(CFLAGS) $(SAN)))
$(eval $(call objects,build-san/obj-tests,$(CFLAGS) $(SAN) -DFLEXGEN_NO_MAIN))
$(eval $(call objects,build-san-emu/obj,$(EMU_CFLAGS) $(SAN)))
$(eval $(call objects,build-san-emu/obj-tests,$(EMU_CFLAGS) $(SAN) -DFLEXGEN_NO_MAIN))
FORCE:
-include $(shell find build build-san build-emu build-san-emu build-fuzz -name '*.d' 2>/dev/null)

emu: flexgen-emu

# `make test` runs the native suites (the GPU ones on a GPU, or skipping), then the emulated GPU's.
build/tokenizers/%: tests/fixtures/tokenizers/%.xz
	@mkdir -p $(dir $@)
	xz -dc $< >$@.part && mv $@.part $@

build/tokenizers/%/tokenizer_config.json: tests/fixtures/tokenizers/%/tokenizer_config.json
	@mkdir -p $(dir $@)
	cp $< $@

# SUITE=name runs one where it is: gpu in both binaries, kernels in both where nvcc is, emu in
# the emulated one.
EMU_SUITES := gpu kernels emu
# OpenMP's idle threads spin for a while by default; beside kernels that run on one thread, on
# two cores, that spinning made the emulated suites ten times slower.
EMU_ENV := GOMP_SPINCOUNT=1000
# test-san runs the emulated suites with the threads shuffled, make test in forward order.
EMU_SAN_ORDER := FLEXGEN_EMU_ORDER=shuffle:7
run_native = $(if $(SUITE),$(filter-out emu $(if $(NVCC),,kernels),$(SUITE)),all)
run_emu = $(if $(SUITE),$(filter $(EMU_SUITES),$(SUITE)),all)
# Each test binary runs every suite in a process of its own (tests/test_main.c), so that a crash
# ends one test and hides nothing else, and adds its counts to TALLY; the last line of make test
# (and test-san) is their total, `N passed, N failed`, and either fails if any test did. make test
# then runs the instruction-set matrix in the native binary (docs/TESTS.md; MATRIX=0: not).
MATRIX ?= 1
TALLY := build/test-tally
TOTAL = awk '{p += $$1; f += $$2; s += $$3} END {if (s) printf "%d skipped (not counted as passed; the suites say why)\n", s; printf "%d passed, %d failed\n", p, f}' $(TALLY) /dev/null

# Both binaries' run, for make test and test-san: $(1) the native test binary, $(2) the flexgen
# it runs; $(3) the emulated one, $(4) its flexgen; $(5) both's environment (the sanitizers');
# $(6) the emulated one's own (its threads' order); $(7) the native one's arguments where no
# SUITE is named (the matrix). Where both run, the emulated binary runs beside the native one,
# its output kept in suites.txt beside it and printed after the native one's: the emulated
# suites run on one thread (most of the native ones' time is one thread too), and on a machine
# of two cores the two together take the time of the longer. Beside them, OpenMP's threads in
# the native binary spin as briefly as the emulated ones' (EMU_ENV). Where one runs (SUITE
# names it), it runs in the foreground.
suite_args = $(SUITE) $(if $(TEST),"$(TEST)")
native_command = FLEXGEN_TEST_TALLY=$(TALLY) $(if $(run_emu),$(EMU_ENV)) FLEXGEN_BIN=$(2) $(5) $(1) $(if $(SUITE),$(suite_args),$(7))
emu_command = FLEXGEN_TEST_TALLY=$(TALLY) $(EMU_ENV) $(6) FLEXGEN_BIN=$(4) $(5) $(3) $(suite_args)
emu_output = $(dir $(3))suites.txt
define run_suites
@rm -f $(TALLY); rc=0; \
$(if $(run_emu),$(if $(run_native),($(emu_command) >$(emu_output) 2>&1) & emu=$$!;,$(emu_command) || rc=1;)) \
$(if $(run_native),$(native_command) || rc=1;) \
$(if $(run_emu),$(if $(run_native),wait $$emu || rc=1; cat $(emu_output);)) \
$(TOTAL); exit $$rc
endef

# The whole run also checks the layout (scripts/check_layout.sh), that no file's calls come back
# to it (scripts/call_graph.sh, from the compiled objects), that the docs' call graph and list of
# suites agree with the code (scripts/check_docs.sh), that clang-format would change no source
# and no statement chains commas (scripts/check_style.sh; `make format` formats), that each of
# those checks and scripts/check_deps.sh fails on a violation planted in a copy of the tree
# (scripts/check_checks.sh), that the planted bugs and the exercises' wrong versions still find
# the lines they change (their scripts' --patterns), and that each object is rebuilt when a file
# it includes changes (scripts/check_deps.sh).
test: flexgen build/test_flexgen flexgen-emu build-emu/test_flexgen $(TOK_FIXTURES)
	$(if $(SUITE),,bash scripts/check_layout.sh >build/layout.txt; rc=$$?; grep -v '^ok' build/layout.txt; exit $$rc)
	$(if $(SUITE),,bash scripts/call_graph.sh build/obj >build/call_graph.txt; rc=$$?; tail -1 build/call_graph.txt; exit $$rc)
	$(if $(SUITE),,bash scripts/check_docs.sh build/obj)
	$(if $(SUITE),,bash scripts/check_style.sh >build/style.txt; rc=$$?; grep -v '^ok' build/style.txt; exit $$rc)
	$(if $(SUITE),,bash scripts/check_checks.sh build/obj >build/checks.txt; rc=$$?; grep -v '^ok' build/checks.txt; exit $$rc)
	$(if $(SUITE),,@bad=$$(grep -lE '\bFLEXGEN_(NO_MAIN|CUDA|CUDA_EMU)\b' $(SHARED_SRC) $(HDR)); [ -z "$$bad" ] \
	  || { echo "$$bad: reads a build define, so it belongs in PER_BUILD_SRC (Makefile)"; exit 1; })
	$(if $(SUITE),,python3 scripts/check_cuda_bugs.py --patterns && python3 scripts/check_exercises.py --patterns)
	$(if $(SUITE),,bash scripts/check_deps.sh)
	$(call run_suites,./build/test_flexgen,./flexgen,./build-emu/test_flexgen,./flexgen-emu,,,$(if $(filter 1,$(MATRIX)),--matrix))

build-san/flexgen: $(call main_objs,build-san) $(CUDA_OBJ)
	$(CC) $(CFLAGS) $(SAN) $(LDFLAGS) -o $@ $^ $(LDLIBS) $(CUDA_LDLIBS)

build-san/test_flexgen: $(call test_objs,build-san) $(TEST_CUDA_OBJ)
	$(CC) $(CFLAGS) $(SAN) $(LDFLAGS) -o $@ $^ $(LDLIBS) $(CUDA_LDLIBS) $(TEST_LIBS)

# test-san's options, harmless without a GPU. protect_shadow_gap=0: the CUDA driver maps memory
# inside ASan's shadow gap, and with the gap protected cuInit fails and the GPU suite skips.
# tests/lsan-cuda.supp: what the CUDA driver and libraries never free. The pipeline suite's
# stages (on the CPU) add fast_unwind_on_malloc=0 to this ASAN_OPTIONS and take
# tests/lsan-mpi.supp instead.
SAN_ENV := ASAN_OPTIONS=detect_leaks=1:protect_shadow_gap=0 \
           LSAN_OPTIONS=suppressions=$(CURDIR)/tests/lsan-cuda.supp \
           UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

test-san: build-san/flexgen build-san/test_flexgen build-san-emu/flexgen build-san-emu/test_flexgen $(TOK_FIXTURES)
	$(call run_suites,./build-san/test_flexgen,./build-san/flexgen,./build-san-emu/test_flexgen,./build-san-emu/flexgen,$(SAN_ENV),$(EMU_SAN_ORDER),)

# The GPU suite under compute-sanitizer's memcheck (a GPU machine; the suite skips without one).
COMPUTE_SANITIZER ?= $(shell command -v compute-sanitizer 2>/dev/null || echo $(CUDA_HOME)/bin/compute-sanitizer)
test-gpu: build/test_flexgen
	$(COMPUTE_SANITIZER) --tool memcheck --error-exitcode 1 ./build/test_flexgen gpu

# Fuzzing: each harness of tests/fuzz/ calls one parser of user input on libFuzzer's bytes, under
# AddressSanitizer and UndefinedBehaviorSanitizer (clang; no CUDA, no MPI). The sources go into
# one archive; a harness that includes args.c or prompts.c (to reach their static parsers) replaces
# that object of it.
FUZZ_CC ?= clang
FUZZ_CFLAGS := -std=c11 -Wall -Wextra $(WERROR) -g -O1 -fno-omit-frame-pointer -fopenmp=libgomp \
               -fsanitize=address,undefined -fno-sanitize-recover=all -I. -I$(BLAS_INC) -DFLEXGEN_NO_MAIN
FUZZ_LIBS := -L$(BLAS_LIB) -Wl,-rpath,$(BLAS_LIB) -lopenblas -lcjson -lm
ifneq ($(PREFIX),)
FUZZ_CFLAGS += $(DEPS_CFLAGS)
FUZZ_LIBS += $(DEPS_LIBS)
endif
FUZZ_TARGETS := $(patsubst tests/fuzz/%.c,build-fuzz/%,$(wildcard tests/fuzz/fuzz_*.c))

fuzz: fuzz-toolchain $(FUZZ_TARGETS)

# Before anything is compiled: can FUZZ_CC build a libFuzzer harness that includes omp.h? If not,
# one line says what to install (clang's libFuzzer runtime: scripts/setup_fuzz.sh installs it).
FUZZ_PROBE := '\#include <omp.h>\n\#include <stddef.h>\n\#include <stdint.h>\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }\n'
fuzz-toolchain:
	@mkdir -p build-fuzz
	@printf $(FUZZ_PROBE) > build-fuzz/probe.c
	@ok=1; $(FUZZ_CC) -fopenmp=libgomp -fsanitize=fuzzer,address,undefined -o build-fuzz/probe build-fuzz/probe.c \
	  >/dev/null 2>&1 || ok=0; rm -f build-fuzz/probe build-fuzz/probe.c; [ $$ok = 1 ] \
	  || { echo "make fuzz: $(FUZZ_CC) cannot build a libFuzzer harness with omp.h; install clang, libclang-rt-14-dev and libomp-14-dev (bash scripts/setup_fuzz.sh)" >&2; exit 1; }

build-fuzz/obj/%.o: %.c $(HDR) | fuzz-toolchain
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(FUZZ_OPT) $(DEPFLAGS) -fsanitize=fuzzer-no-link -c -o $@ $<

# The AVX-512 kernels, SIMDe's portable ones and the native ones alike, take clang six to eight
# minutes each at -O1 under the sanitizers, and seconds at -O0; the harnesses parse input and
# never reach them.
build-fuzz/obj/support/avx512_simde.o build-fuzz/obj/support/avx512.o: FUZZ_OPT := -O0

build-fuzz/libflexgen.a: $(SRC:%.c=build-fuzz/obj/%.o)
	rm -f $@ && ar rcs $@ $^

build-fuzz/fuzz_%: tests/fuzz/fuzz_%.c tests/fuzz/fuzz.h app/args.c app/prompts.c build-fuzz/libflexgen.a
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(DEPFLAGS) -MF build-fuzz/obj/$(notdir $@).d -MT $@ -fsanitize=fuzzer -o $@ $< build-fuzz/libflexgen.a $(FUZZ_LIBS)

bench: flexgen
	bash scripts/bench_cpu.sh

# The programs of scripts/ that its benchmarks build (BENCHMARKS.md), with ./flexgen's flags:
# bench_lp, bench_quant and bench_matmul link ./flexgen's objects (cli.o without its main(), as
# the test binaries take it); sgemm_rate links support/blas_core.o; stream_rate stands alone.
BENCH_OBJS = $(filter-out build/obj/app/cli.o,$(call main_objs,build)) build/obj-tests/app/cli.o
build/bench_lp build/bench_quant build/bench_matmul: build/%: scripts/%.c $(BENCH_OBJS) $(CUDA_OBJ)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $^ $(LDLIBS) $(CUDA_LDLIBS)
build/sgemm_rate: scripts/sgemm_rate.c build/obj/support/blas_core.o
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $^ $(LDLIBS)
build/stream_rate: scripts/stream_rate.c
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $<

# The flags this build compiles with (scripts/call_graph.sh uses them).
print-cflags:
	@echo $(CFLAGS)

# Formats every C, CUDA and header file outside tests/ and the generated tables as .clang-format
# writes them (make test fails on a file this would change), then writes the maps' line numbers
# anew (scripts/check_layout.sh --fix-maps).
format:
	clang-format -i $$(bash scripts/check_style.sh --files)
	bash scripts/check_layout.sh --fix-maps >/dev/null || true

clean:
	rm -rf flexgen flexgen-emu build build-san build-fuzz build-emu build-san-emu
