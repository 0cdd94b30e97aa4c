# FlexGen in C. `make` builds ./flexgen (CPU backend); `make test` runs the CUnit suites;
# `make test-san` runs them again under AddressSanitizer and UndefinedBehaviorSanitizer.
CC ?= gcc
ARCH := $(shell $(CC) -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
# OpenBLAS's OpenMP build, so BLAS and our loops share one thread pool (DESIGN.md).
BLAS_INC := /usr/include/$(ARCH)/openblas-openmp
BLAS_LIB := /usr/lib/$(ARCH)/openblas-openmp
CFLAGS ?= -O2
CFLAGS += -std=c11 -Wall -Wextra -Werror -fopenmp -I. -I$(BLAS_INC)
LDLIBS := -L$(BLAS_LIB) -Wl,-rpath,$(BLAS_LIB) -lopenblas -lcjson -lm
# The tests' references: CUnit, and GLPK for lp.c (./flexgen itself links neither).
TEST_LIBS := -lcunit -lglpk
SAN := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined,float-cast-overflow -fno-sanitize-recover=all

SRC := opt_model.c tokenizer.c quant.c flexgen.c lp.c
HDR := flexgen.h
TEST_SRC := $(wildcard tests/*.c)

.PHONY: all test test-san bench clean

all: flexgen

flexgen: $(SRC) $(HDR)
	$(CC) $(CFLAGS) -o $@ $(SRC) $(LDLIBS)

build/test_flexgen: $(SRC) $(HDR) $(TEST_SRC) tests/tests.h
	@mkdir -p build
	$(CC) $(CFLAGS) -DFLEXGEN_NO_MAIN -o $@ $(SRC) $(TEST_SRC) $(LDLIBS) $(TEST_LIBS)

test: flexgen build/test_flexgen
	FLEXGEN_BIN=./flexgen ./build/test_flexgen

build-san/flexgen: $(SRC) $(HDR)
	@mkdir -p build-san
	$(CC) $(CFLAGS) $(SAN) -o $@ $(SRC) $(LDLIBS)

build-san/test_flexgen: $(SRC) $(HDR) $(TEST_SRC) tests/tests.h
	@mkdir -p build-san
	$(CC) $(CFLAGS) $(SAN) -DFLEXGEN_NO_MAIN -o $@ $(SRC) $(TEST_SRC) $(LDLIBS) $(TEST_LIBS)

test-san: build-san/flexgen build-san/test_flexgen
	FLEXGEN_BIN=./build-san/flexgen ASAN_OPTIONS=detect_leaks=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ./build-san/test_flexgen

bench: flexgen
	bash scripts/bench_cpu.sh

clean:
	rm -rf flexgen build build-san
