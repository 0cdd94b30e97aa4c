#!/usr/bin/env python3
"""Writes tests/fixtures/config-v5/NAME.json: each LLaMA-family fixture's config.json as
transformers 5 saves it (AutoConfig.from_pretrained, then save_pretrained), where RoPE's
rope_theta and scaling have moved into one "rope_parameters" object.

tests/test_checkpoint.c reads each file beside the fixture's own config.json and holds the two to
the same model. Run with a Python that has transformers 5 (no network: the fixtures are local):

    python3 scripts/make_config_v5.py
"""
import argparse
import json
import os
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
NAMES = ["llama-tiny-mha", "llama-tiny-gqa2-llama3", "llama-tiny-gqa4-linear", "llama-tiny-mqa-bias",
         "mistral-tiny-gqa8", "qwen2-tiny"]


def main():
    ap = argparse.ArgumentParser(description="Writes tests/fixtures/config-v5/NAME.json as transformers 5 saves "
                                             "each LLaMA-family fixture's config.json.")
    ap.parse_args()
    import transformers
    from transformers import AutoConfig

    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise SystemExit(f"transformers {transformers.__version__}: version 5 writes rope_parameters")
    out_dir = os.path.join(FIXTURES, "config-v5")
    os.makedirs(out_dir, exist_ok=True)
    for name in NAMES:
        with tempfile.TemporaryDirectory() as tmp:
            AutoConfig.from_pretrained(os.path.join(FIXTURES, name)).save_pretrained(tmp)
            with open(os.path.join(tmp, "config.json")) as f:
                config = json.load(f)
        if "rope_parameters" not in config or "rope_scaling" in config or "rope_theta" in config:
            raise SystemExit(f"{name}: expected RoPE in rope_parameters alone, got {sorted(config)}")
        with open(os.path.join(out_dir, name + ".json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
        print(name, config["rope_parameters"])


if __name__ == "__main__":
    main()
