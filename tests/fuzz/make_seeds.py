#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz harnesses, tests/fuzz/corpus/<target>/, from the fixtures.

Seeds stay small: a fixture's safetensors file keeps its header and the first bytes of its data
(the parser then reports the truncation, and the fuzzer mutates real headers), and a whole valid
checkpoint is made for fuzz_safetensors' small config (a few KB). Deterministic: running it again
gives identical files. Standard library only; run from the repository root:
    python3 tests/fuzz/make_seeds.py
"""
import json
import os
import shutil
import struct

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIX = os.path.join(ROOT, "tests", "fixtures")
OUT = os.path.join(ROOT, "tests", "fuzz", "corpus")
SEP = b"\n===\n"  # FUZZ_SEP of fuzz.h


def fixture(rel):
    with open(os.path.join(FIX, rel), "rb") as f:
        return f.read()


def put(target, name, data):
    os.makedirs(os.path.join(OUT, target), exist_ok=True)
    with open(os.path.join(OUT, target, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def safetensors(tensors):
    """A safetensors file of tensors [(name, dtype, shape)], each a ramp of small values."""
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name, dtype, shape in tensors:
        n = 1
        for d in shape:
            n *= d
        values = [(i % 7 - 3) / 8 for i in range(n)]
        if dtype == "F32":
            raw = struct.pack("<%df" % n, *values)
        elif dtype == "F16":
            raw = struct.pack("<%de" % n, *values)
        else:  # BF16: the upper half of each float32 (exact for these values)
            raw = b"".join(struct.pack("<f", v)[2:] for v in values)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def tiny_tensors(dtype, lm_head=False):
    """Every tensor of fuzz_safetensors' config: hidden 4, ffn 8, vocab 8, 4 positions, 1 layer."""
    h, f, v, p = 4, 8, 8, 4 + 2
    t = [("model.decoder.embed_tokens.weight", [v, h]), ("model.decoder.embed_positions.weight", [p, h]),
         ("model.decoder.final_layer_norm.weight", [h]), ("model.decoder.final_layer_norm.bias", [h])]
    L = "model.decoder.layers.0."
    for m in ("q_proj", "k_proj", "v_proj", "out_proj"):
        t += [(L + "self_attn.%s.weight" % m, [h, h]), (L + "self_attn.%s.bias" % m, [h])]
    t += [(L + "self_attn_layer_norm.weight", [h]), (L + "self_attn_layer_norm.bias", [h]),
          (L + "fc1.weight", [f, h]), (L + "fc1.bias", [f]), (L + "fc2.weight", [h, f]), (L + "fc2.bias", [h]),
          (L + "final_layer_norm.weight", [h]), (L + "final_layer_norm.bias", [h])]
    if lm_head:
        t.append(("lm_head.weight", [v, h]))
    return [(name, dtype, shape) for name, shape in t]


def truncated(rel, keep=256):
    """A fixture's safetensors file: its header and the first `keep` bytes of its data."""
    data = fixture(rel)
    (hlen,) = struct.unpack("<Q", data[:8])
    return data[: 8 + hlen + keep]


def main():
    shutil.rmtree(OUT, ignore_errors=True)

    # fuzz_safetensors: whole small checkpoints, and fixture headers with their data cut short
    for dtype in ("F16", "BF16", "F32"):
        put("safetensors", "tiny-%s.safetensors" % dtype.lower(), safetensors(tiny_tensors(dtype)))
    put("safetensors", "tiny-lm-head.safetensors", safetensors(tiny_tensors("F16", lm_head=True)))
    for rel in ("opt-tiny/model.safetensors", "opt-tiny-bf16/model.safetensors",
                "opt-tiny-350m/model-00001-of-00003.safetensors", "opt-tiny-350m/model-00003-of-00003.safetensors"):
        put("safetensors", rel.replace("/", "-"), truncated(rel))

    # fuzz_config and fuzz_index
    for d in ("opt-tiny", "opt-tiny-350m", "opt-tiny-bf16", "opt-tiny-text"):
        put("config", d + ".json", fixture(d + "/config.json"))
    put("index", "opt-tiny-350m.json", fixture("opt-tiny-350m/model.safetensors.index.json"))
    index = json.loads(fixture("opt-tiny-350m/model.safetensors.index.json"))
    index["weight_map"] = dict(list(index["weight_map"].items())[:3])
    put("index", "three-tensors.json", json.dumps(index, indent=1))

    # fuzz_tokenizer: vocab.json, merges.txt, a text and optionally tokenizer_config.json;
    # fuzz_encode: texts
    cases = [c["text"] for c in json.loads(fixture("tokenizer/cases.json"))]
    vocab, merges = fixture("tokenizer/vocab.json"), fixture("tokenizer/merges.txt")
    put("tokenizer", "fixture", vocab + SEP + merges + SEP + "The café is open, isn't it?".encode())
    put("tokenizer", "small", b'{"a":0,"b":1,"ab":2,"c":3}' + SEP + b"#version: 0.2\na b\n" + SEP + b"ababc")
    added = [c["text"] for c in json.loads(fixture("tokenizer-added/cases.json"))]
    put("tokenizer", "fixture-added", fixture("tokenizer-added/vocab.json") + SEP + fixture("tokenizer-added/merges.txt")
        + SEP + added[-1].encode() + SEP + fixture("tokenizer-added/tokenizer_config.json"))
    small_config = {"eos_token": "c", "unk_token": None, "added_tokens_decoder": {
        "4": {"content": "<x>", "lstrip": True}, "5": {"content": "ab", "rstrip": True, "single_word": True},
        "6": {"content": ""}}}
    put("tokenizer", "small-config", b'{"a":0,"b":1,"ab":2,"c":3}' + SEP + b"#version: 0.2\na b\n" + SEP
        + b"ab <x> cab" + SEP + json.dumps(small_config).encode())
    put("tokenizer", "bytes", '{"\\u0100":0,"a":1,"\\u00ff":2,"a\\u00ff":3}'.encode() + SEP + b"a \xc3\xbf\n" + SEP + b"a\xff\x00")
    for i, text in enumerate(cases):
        put("encode", "case-%02d" % i, text)
    put("encode", "invalid-utf8", b"caf\xc3 \xed\xa0\x80 \xf4\x90\x80\x80 \xff\xfe text")

    # fuzz_hardware
    with open(os.path.join(ROOT, "hardware", "t4-flexgen.json"), "rb") as f:
        put("hardware", "t4-flexgen.json", f.read())
    put("hardware", "cpu-backend.json",
        '{"ctog_bdw": 6e9, "gtoc_bdw_cache": 1.2e10, "gtoc_bdw_hidden": 1.2e10, "dtoc_bdw": 1.4e9,'
        ' "ctod_bdw_cache_p": 2.5e8, "ctod_bdw_hidden_p": 2.5e8, "ctod_bdw_g": 2.5e8,'
        ' "mm_flops_p": 1.3e11, "mm_flops_g": 1.7e11, "bmm_flops_p": 1e11, "bmm_flops_g": 4e10,'
        ' "cpu_flops": 4e10, "dequant_bdw": 5e9, "mem_bdw": 8e9, "gpu_is_host": true, "blas_core": "SkylakeX"}\n')

    # fuzz_cli_args: arguments separated by NUL bytes
    lines = [
        "--model opt-1.3b --percent 100 0 100 0 100 0 --gpu-batch-size 4 --num-gpu-batches 2",
        "--model tests/fixtures/opt-tiny --prompt-ids p.txt --gen-len 8 --json --quiet",
        "--policy auto --gpu-mem 16G --cpu-mem 200G --disk-mem 1.5T --max-latency 30 --hw hw.json",
        "--prompt hello --vocab v.json --merges m.txt --temperature 0.7 --top-p 0.9 --seed 3",
        "--compress-weight --compress-cache --attn-sparsity 0.5 --cpu-cache-compute --overlap 0",
        "--device cpu --pin-weight 1 --offload-dir /tmp --path /tmp --trace t.json --dump-logits l.bin",
        "--evaluate --stop-at-eos --prompt-len 64 --prompt-file p.txt",
    ]
    for i, line in enumerate(lines):
        put("cli_args", "args-%d" % i, line.replace(" ", "\0"))

    # fuzz_numbers
    for i, s in enumerate(["16G", "512M", "1.5G", "4096", "7KB", "1T", "0.7", "1e-9", "100", "auto", "cuda"]):
        put("numbers", "value-%02d" % i, s)

    # fuzz_prompt_ids: token ids (and the same bytes as text lines)
    for d in ("opt-tiny", "opt-tiny-350m", "opt-tiny-text"):
        put("prompt_ids", d + ".txt", fixture(d + "/prompts.txt"))
    texts = [t["prompt"] for t in json.loads(fixture("opt-tiny-text/texts.json"))]
    put("prompt_ids", "texts.txt", "\n".join(texts) + "\n")
    put("prompt_ids", "jobs.jsonl", "".join(json.dumps(o) + "\n" for o in [
        {"id": "a", "prompt": texts[0]}, {"prompt_ids": [2, 100, 7]}, {"id": 7, "prompt": texts[1]}]))

    # fuzz_tokenizer_json: small tokenizer.json files of the three kinds tokenizer_json.c reads
    for name, tok in tokenizer_json_seeds().items():
        put("tokenizer_json", name, json.dumps(tok, ensure_ascii=False).encode() + SEP +
            "Hello wörld 123 don't <s> \u00e9 \u0065\u0301 \U0001F999".encode())


def tokenizer_json_seeds():
    """A SentencePiece-style, a LLaMA 3 and a Qwen2 tokenizer.json over a few dozen tokens."""
    meta = "\u2581"
    added = [{"id": 0, "content": "<unk>", "special": True}, {"id": 1, "content": "<s>", "special": True}]
    spm_vocab = {"<unk>": 0, "<s>": 1, meta: 2, **{c: 3 + i for i, c in enumerate("abcdehlorstw")}}
    spm_vocab.update({"<0x%02X>" % b: 15 + b for b in range(256)})
    spm_vocab.update({meta + "t": 271, "he": 272, meta + "the": 273})
    spm = {"added_tokens": added,
           "normalizer": {"type": "Sequence", "normalizers": [
               {"type": "Prepend", "prepend": meta},
               {"type": "Replace", "pattern": {"String": " "}, "content": meta}]},
           "pre_tokenizer": None,
           "post_processor": {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}}],
                              "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
           "decoder": {"type": "Sequence", "decoders": [
               {"type": "Replace", "pattern": {"String": meta}, "content": " "},
               {"type": "ByteFallback"}, {"type": "Fuse"},
               {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
           "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": True, "byte_fallback": True,
                     "vocab": spm_vocab, "merges": [meta + " t", "h e", meta + "t he"]}}
    byte_map = [chr(b) if 33 <= b <= 126 or 161 <= b <= 172 or b >= 174 else None for b in range(256)]
    n = 0
    for b in range(256):
        if byte_map[b] is None:
            byte_map[b] = chr(256 + n)
            n += 1
    bl_vocab = {c: i for i, c in enumerate(byte_map)}
    bl_vocab.update({"<|begin_of_text|>": 256, "he": 257, "hel": 258, "\u0120w": 259})
    split = {"type": "Split", "behavior": "Isolated", "invert": False, "pattern": {"Regex": (
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
        "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")}}
    llama3 = {"added_tokens": [{"id": 256, "content": "<|begin_of_text|>", "special": True}],
              "normalizer": None,
              "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                  split, {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]},
              "post_processor": None, "decoder": {"type": "ByteLevel"},
              "model": {"type": "BPE", "ignore_merges": True, "vocab": bl_vocab,
                        "merges": [["h", "e"], ["he", "l"], ["\u0120", "w"]]}}
    qwen2 = json.loads(json.dumps(llama3))
    qwen2["normalizer"] = {"type": "NFC"}
    qwen2["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = split["pattern"]["Regex"].replace(
        "\\p{N}{1,3}", "\\p{N}")
    qwen2["model"]["merges"] = ["h e", "he l", "\u0120 w"]
    return {"spm": spm, "llama3": llama3, "qwen2": qwen2}


if __name__ == "__main__":
    main()
