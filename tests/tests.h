/* tests.h: the CUnit suites of `make test` and helpers they share. */
#ifndef FLEXGEN_TESTS_H
#define FLEXGEN_TESTS_H

#include <CUnit/CUnit.h>

void add_tokenizer_tests(void);  /* test_tokenizer.c */
void add_model_tests(void);      /* test_model.c: forward pass against PyTorch fixtures */
void add_checkpoint_tests(void); /* test_checkpoint.c: loader and its bad input */
void add_cli_tests(void);        /* test_cli.c: ./flexgen end to end and its bad flags */

/* Path of a file under tests/fixtures (static buffer, valid until the next call). */
const char *fixture(const char *rel);
/* A fresh empty directory under $TMPDIR for one test; removed by rm_tree(). */
char *make_temp_dir(void);
void rm_tree(const char *dir);

#endif
