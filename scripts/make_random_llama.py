#!/usr/bin/env python3
"""Writes a random-weight LLaMA checkpoint of a named shape, in HF's layout, shard by shard.

The directory it writes, loadable by transformers' LlamaForCausalLM.from_pretrained, by
./flexgen --model DIR and by llama.cpp's convert_hf_to_gguf.py:

  config.json                         the shape's real config.json values (LlamaConfig fields:
                                      hidden_size, intermediate_size, num_hidden_layers,
                                      num_attention_heads, num_key_value_heads, vocab_size,
                                      rope_theta, rope_scaling, tie_word_embeddings, ...), with
                                      torch_dtype float16 (the weights written)
  generation_config.json              the model's own (bos, eos, sampling defaults)
  model-0000i-of-0000n.safetensors    float16 tensors in LlamaForCausalLM's names, shards of at
                                      most --max-shard-size bytes of data
  model.safetensors.index.json        the shard index (metadata.total_size, weight_map)
  tokenizer.json, tokenizer_config.json
                                      copied from the repository's fixtures, tests/fixtures/
                                      tokenizers/: LLaMA 2's (llama-spm) for a vocabulary of 32000,
                                      LLaMA 3's (llama-bpe) for 128256 (--tokenizer)

Every linear weight and the embedding are normal(0, --std) values (0.02 by default, the models'
initializer_range), rounded to float16; the RMSNorm weights are 1. Each tensor draws from its
own generator, seeded by (--seed, the tensor's name), so the values do not depend on the
sharding, and the same --seed gives the same bytes.

Memory: the safetensors header is known from the shapes alone, so each shard is written with
its header first and then tensor by tensor, each generated and written in chunks of
--chunk-elems values; the process holds one chunk at a time, so its memory does not grow with
the model: a 13B checkpoint (26 GB) is written with about 100 MB for the values, beside the
interpreter and its imports (the peak RSS was 0.7 GB with torch imported, most of it torch).
A shard is written under a temporary name and renamed when complete, and the directory itself
is written as DIR.tmp and renamed to DIR at the end, so DIR is complete or absent.

  python3 scripts/make_random_llama.py --shape llama-3.2-1b --out /var/tmp/llama-3.2-1b-seed0
  python3 scripts/make_random_llama.py --shape llama-2-13b --out /var/tmp/llama-2-13b --seed 1
  python3 scripts/make_random_llama.py --shape llama-3.2-1b --layers 2 --out /tmp/l32-2layers
  python3 scripts/make_random_llama.py --list

Needs numpy (the tokenizer fixtures are unpacked with Python's lzma); where torch is importable,
its float16 cast is used, which gives the same bits as numpy's and is faster. The values come
from numpy's PCG64 generator and standard_normal, so the checkpoint does not depend on torch.
A 13B checkpoint takes several minutes, bound by the normal draws on one core.
"""
import argparse
import copy
import json
import lzma
import os
import shutil
import struct
import sys
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(os.path.dirname(HERE), "tests", "fixtures", "tokenizers")

# The real config.json of each model (the fields LlamaConfig reads; values as the model's hub
# repository has them, torch_dtype aside), and its generation_config.json.
LLAMA2_GEN = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": True,
              "temperature": 0.6, "top_p": 0.9, "max_length": 4096}
LLAMA3_GEN = {"bos_token_id": 128000, "eos_token_id": 128001, "do_sample": True,
              "temperature": 0.6, "top_p": 0.9}


def llama2(hidden, ffn, layers, heads, **extra):
    c = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
         "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
         "hidden_size": hidden, "initializer_range": 0.02, "intermediate_size": ffn,
         "max_position_embeddings": 4096, "mlp_bias": False, "num_attention_heads": heads,
         "num_hidden_layers": layers, "num_key_value_heads": heads, "pretraining_tp": 1,
         "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
         "tie_word_embeddings": False, "use_cache": True, "vocab_size": 32000}
    c.update(extra)
    return c


SHAPES = {
    # meta-llama/Llama-3.2-1B
    "llama-3.2-1b": (llama2(2048, 8192, 16, 32, num_key_value_heads=8, head_dim=64,
                            bos_token_id=128000, eos_token_id=128001,
                            max_position_embeddings=131072, rope_theta=500000.0,
                            rope_scaling={"factor": 32.0, "high_freq_factor": 4.0,
                                          "low_freq_factor": 1.0,
                                          "original_max_position_embeddings": 8192,
                                          "rope_type": "llama3"},
                            tie_word_embeddings=True, vocab_size=128256),
                     LLAMA3_GEN, "LLaMA 3.2 1B"),
    # meta-llama/Meta-Llama-3-8B
    "llama-3-8b": (llama2(4096, 14336, 32, 32, num_key_value_heads=8, bos_token_id=128000,
                          eos_token_id=128001, max_position_embeddings=8192,
                          rope_theta=500000.0, vocab_size=128256),
                   dict(LLAMA3_GEN, max_length=4096), "LLaMA 3 8B"),
    # meta-llama/Llama-2-7b-hf, meta-llama/Llama-2-13b-hf
    "llama-2-7b": (llama2(4096, 11008, 32, 32), LLAMA2_GEN, "LLaMA 2 7B"),
    "llama-2-13b": (llama2(5120, 13824, 40, 40), LLAMA2_GEN, "LLaMA 2 13B"),
    # JackFram/llama-160m's dimensions (12 layers, hidden 768, ffn 3072, 12 heads) in LLaMA 2's
    # config otherwise: a small real-world LLaMA shape for quick runs
    "llama-160m": (llama2(768, 3072, 12, 12, max_position_embeddings=2048, rms_norm_eps=1e-06),
                   dict(LLAMA2_GEN, max_length=2048), "JackFram/llama-160m's dimensions"),
    # ours: two layers, grouped-query attention, LLaMA 2's vocabulary (tests of the plumbing)
    "tiny": (llama2(128, 256, 2, 4, num_key_value_heads=2, max_position_embeddings=2048),
             dict(LLAMA2_GEN, max_length=2048), "ours: 2 layers, hidden 128, GQA 4/2"),
}
TOKENIZER_BY_VOCAB = {32000: "llama-spm", 128256: "llama-bpe"}
# The special tokens of the real tokenizer_config.json (the fixtures' came from a vocab-only GGUF).
REAL_SPECIALS = {"llama-spm": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
                 "llama-bpe": {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}}


def tensors(cfg):
    """LlamaForCausalLM's state dict, in its order: (name, shape, kind)."""
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh
    out = [("model.embed_tokens.weight", (v, h), "normal")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (nh * hd, h), "normal"),
                (p + "self_attn.k_proj.weight", (nkv * hd, h), "normal"),
                (p + "self_attn.v_proj.weight", (nkv * hd, h), "normal"),
                (p + "self_attn.o_proj.weight", (h, nh * hd), "normal"),
                (p + "mlp.gate_proj.weight", (f, h), "normal"),
                (p + "mlp.up_proj.weight", (f, h), "normal"),
                (p + "mlp.down_proj.weight", (h, f), "normal"),
                (p + "input_layernorm.weight", (h,), "ones"),
                (p + "post_attention_layernorm.weight", (h,), "ones")]
    out.append(("model.norm.weight", (h,), "ones"))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (v, h), "normal"))
    return out


def nbytes(shape):
    n = 2  # float16
    for d in shape:
        n *= d
    return n


def shard_plan(ts, max_bytes):
    """Tensors grouped in order into shards of at most max_bytes (a larger tensor alone)."""
    shards, cur, size = [], [], 0
    for t in ts:
        b = nbytes(t[1])
        if cur and size + b > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += b
    if cur:
        shards.append(cur)
    return shards


def header_bytes(shard):
    hdr, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in shard:
        b = nbytes(shape)
        hdr[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [off, off + b]}
        off += b
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _f16_numpy(x):
    return x.astype(np.float16)


def _f16_torch(x):
    return torch.from_numpy(x).half().numpy()


try:  # torch's float32 -> float16 cast is vectorized (5x numpy's here); both round to nearest even
    import torch
    to_f16 = _f16_torch
except ImportError:
    to_f16 = _f16_numpy


def write_tensor(f, name, shape, kind, seed, std, chunk):
    n = 1
    for d in shape:
        n *= d
    if kind == "ones":
        np.ones(n, dtype=np.float16).tofile(f)
        return
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(
        [seed, zlib.crc32(name.encode())])))
    buf = np.empty(min(n, chunk), dtype=np.float32)
    done = 0
    while done < n:
        k = min(chunk, n - done)
        x = buf[:k]
        rng.standard_normal(out=x, dtype=np.float32)
        x *= std
        to_f16(x).tofile(f)
        done += k


def write_tokenizer(kind, out, fixtures):
    src = os.path.join(fixtures, kind)
    xz = os.path.join(src, "tokenizer.json.xz")
    if not os.path.isfile(xz):
        sys.exit(f"make_random_llama.py: no tokenizer fixture {xz} (--fixtures, or --tokenizer none)")
    with lzma.open(xz, "rb") as fi, open(os.path.join(out, "tokenizer.json"), "wb") as fo:
        shutil.copyfileobj(fi, fo)
    with open(os.path.join(src, "tokenizer_config.json")) as fi:
        tc = json.load(fi)
    tc.update(REAL_SPECIALS.get(kind, {}))
    for k in ("bos_token_id", "eos_token_id", "unk_token_id"):
        tc.pop(k, None)  # not tokenizer_config.json fields: the tokens above name them
    with open(os.path.join(out, "tokenizer_config.json"), "w") as fo:
        json.dump(tc, fo, indent=2)
        fo.write("\n")


def tokenizer_vocab(kind, fixtures):
    with lzma.open(os.path.join(fixtures, kind, "tokenizer.json.xz"), "rt", encoding="utf-8") as f:
        j = json.load(f)
    ids = list(j["model"]["vocab"].values()) + [t["id"] for t in j.get("added_tokens", [])]
    return max(ids) + 1


def parse_size(s):
    """A size of bytes, "5GB", "512MiB" or "1000"; an argparse type (a bad one is its error)."""
    mult = {"K": 1000, "M": 1000 ** 2, "G": 1000 ** 3, "KB": 1000, "MB": 1000 ** 2,
            "GB": 1000 ** 3, "KIB": 1024, "MIB": 1024 ** 2, "GIB": 1024 ** 3}
    u = s.upper().rstrip()
    try:
        for suf in sorted(mult, key=len, reverse=True):
            if u.endswith(suf):
                n = int(float(u[:-len(suf)]) * mult[suf])
                break
        else:
            n = int(u)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {s!r} (e.g. 5GB, 512MiB)")
    if n < 1:
        raise argparse.ArgumentTypeError(f"not a positive size: {s!r}")
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="shapes: " + ", ".join(SHAPES))
    ap.add_argument("--shape", choices=sorted(SHAPES), help="the model shape")
    ap.add_argument("--out", help="the checkpoint directory (must not exist)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights [0]")
    ap.add_argument("--std", type=float, default=0.02, help="std of the normal weights [0.02]")
    ap.add_argument("--layers", type=int, help="num_hidden_layers instead of the shape's")
    ap.add_argument("--max-shard-size", default="5GB", type=parse_size,
                    help="data bytes per shard (K/M/G: powers of 1000, KiB/MiB/GiB: of 1024) [5GB]")
    ap.add_argument("--tokenizer", default="auto",
                    help="auto (llama-spm for vocab 32000, llama-bpe for 128256), llama-spm, "
                         "llama-bpe or none [auto]")
    ap.add_argument("--fixtures", default=FIXTURES,
                    help="the tokenizer fixtures' directory [tests/fixtures/tokenizers]")
    ap.add_argument("--chunk-elems", type=int, default=1 << 24,
                    help="values generated at a time [16777216]")
    ap.add_argument("--list", action="store_true", help="list the shapes and exit")
    ap.add_argument("--bytes", action="store_true",
                    help="print the weights' bytes of --shape (with --layers) and exit")
    ap.add_argument("--quiet", action="store_true", help="no progress on stderr")
    a = ap.parse_args()
    if a.layers is not None and a.layers < 1:
        ap.error("--layers must be at least 1")

    if a.list:
        for name, (cfg, _, what) in SHAPES.items():
            n = sum(np.prod(s, dtype=np.int64) for _, s, _ in tensors(cfg))
            print(f"{name:14s} {n / 1e9:7.3f}B params  {2 * n / 1e9:7.2f} GB fp16  "
                  f"layers {cfg['num_hidden_layers']}, hidden {cfg['hidden_size']}, "
                  f"ffn {cfg['intermediate_size']}, heads {cfg['num_attention_heads']}/"
                  f"{cfg['num_key_value_heads']}, vocab {cfg['vocab_size']}  ({what})")
        return
    if a.bytes:
        if not a.shape:
            ap.error("--bytes needs --shape")
        cfg = copy.deepcopy(SHAPES[a.shape][0])
        if a.layers is not None:
            cfg["num_hidden_layers"] = a.layers
        print(sum(nbytes(s) for _, s, _ in tensors(cfg)))
        return
    if not a.shape or not a.out:
        ap.error("--shape and --out are required")
    if os.path.exists(a.out):
        sys.exit(f"make_random_llama.py: {a.out} exists")
    if a.chunk_elems < 1:
        ap.error("--chunk-elems must be positive")
    max_bytes = a.max_shard_size

    cfg0, gen, _ = SHAPES[a.shape]
    cfg = copy.deepcopy(cfg0)
    if a.layers is not None:
        cfg["num_hidden_layers"] = a.layers
    cfg["torch_dtype"] = "float16"
    cfg["transformers_version"] = "4.46.3"
    gen = dict(gen, transformers_version="4.46.3")

    tok = a.tokenizer
    if tok == "auto":
        tok = TOKENIZER_BY_VOCAB.get(cfg["vocab_size"], "none")
    if tok not in ("none", "llama-spm", "llama-bpe"):
        ap.error(f"unknown --tokenizer {tok!r}")
    if tok != "none":
        tv = tokenizer_vocab(tok, a.fixtures)
        if tv > cfg["vocab_size"]:
            sys.exit(f"make_random_llama.py: the {tok} tokenizer has {tv} ids, more than "
                     f"vocab_size {cfg['vocab_size']}")

    ts = tensors(cfg)
    shards = shard_plan(ts, max_bytes)
    total = sum(nbytes(s) for _, s, _ in ts)
    tmp = a.out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    weight_map, written = {}, 0
    tty = not a.quiet and sys.stderr.isatty()  # progress in place on a terminal, else per shard
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        path = os.path.join(tmp, fname)
        with open(path + ".part", "wb") as f:
            f.write(header_bytes(shard))
            for name, shape, kind in shard:
                write_tensor(f, name, shape, kind, a.seed, a.std, a.chunk_elems)
                weight_map[name] = fname
                written += nbytes(shape)
                if tty:
                    print(f"\rmake_random_llama.py: {fname}: {written / 1e9:.2f} / "
                          f"{total / 1e9:.2f} GB", end="", file=sys.stderr, flush=True)
        os.rename(path + ".part", path)
        if not a.quiet and not tty:
            print(f"make_random_llama.py: {fname}: {written / 1e9:.2f} / {total / 1e9:.2f} GB",
                  file=sys.stderr, flush=True)
    if tty:
        print(file=sys.stderr)
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        f.write("\n")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2, sort_keys=True)
        f.write("\n")
    if tok != "none":
        write_tokenizer(tok, tmp, a.fixtures)
    os.rename(tmp, a.out)
    n = total // 2
    print(f"make_random_llama.py: {a.out}: {a.shape}"
          f"{'' if a.layers is None else f' with {a.layers} layers'}, {n} parameters "
          f"({total / 1e9:.2f} GB float16) in {len(shards)} shard(s), seed {a.seed}, "
          f"tokenizer {tok}", file=sys.stderr)


if __name__ == "__main__":
    main()
