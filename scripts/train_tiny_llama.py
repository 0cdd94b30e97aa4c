#!/usr/bin/env python3
"""Train a small LLaMA from scratch on the King James Bible, on the CPU, and save it in Hugging
Face's layout so that both ./flexgen and transformers' LlamaForCausalLM load it.

    apt-get install bible-kjv-text          # Debian's KJV text and its reader, /usr/bin/bible
    python3 -m venv venv && venv/bin/pip install torch transformers tokenizers safetensors
    venv/bin/python scripts/train_tiny_llama.py --out models/llama-kjv

The corpus and its split are train_tiny_opt.py's (its read_chapters): the 1,189 chapters of
`bible -f gen1:1-rev22:21`, each its verses joined by newlines; every 25th chapter is held out
for evaluation, the rest train the tokenizer and the model.

The tokenizer: LLaMA 2's SentencePiece-style BPE with byte fallback, as an HF tokenizer.json of
--vocab tokens, trained with the `tokenizers` package on the training chapters. The normalizer
puts U+2581 ("▁") before the text and in place of every space; there is no pre-tokenizer (the
text is one word); a character the vocabulary lacks becomes its UTF-8 bytes, <0x00> .. <0xFF>.
It is trained with a pre-tokenizer that isolates each newline and splits before each "▁"
(Metaspace), so that no merge crosses the start of a word or a line: no learned token holds a
"▁" but at its start, none holds a newline, and dropping the pre-tokenizer afterwards changes no
segmentation. The newline itself is left to its byte token, <0x0A>, as in LLaMA 2. The file
written has LLaMA 2's structure: the ids <unk> 0, <s> 1, </s> 2, then the 256 byte tokens
(3 .. 258), then the learned tokens (the alphabet's characters and the merges' results) in the
trainer's order; the merges by rank; the post-processor prepends <s>; the decoder is
Replace("▁", " "), ByteFallback, Fuse, Strip(" ", 1, 0). It is checked against the tokenizer
trained: the same segmentation of the held-out text, a lossless round trip, and bytes for
characters outside the alphabet.

The model: LlamaForCausalLM itself, so the architecture is LLaMA's (pre-RMSNorm, rotary
positions, SwiGLU, no biases, lm_head tied to the token embedding), with --layers layers of
--hidden, query heads of 64 sharing --kv-heads key/value heads (grouped-query attention), an MLP
of --ffn and --context positions. No dropout. Training reads windows of --context tokens from the
stream of training chapters, each chapter as <s> + its tokens + </s> (so that the model learns
to end a chapter: generation can stop at EOS); a quarter of the windows start at a chapter's
<s>, so that a prompt begun with BOS is familiar. AdamW, linear warm-up then cosine decay.

The held-out perplexity is train_tiny_opt.py's (its perplexity): the ids are <s> + the held-out
text's tokens, windows of --context tokens advance by half of it, and each window scores only
the tokens the previous one did not. `flexgen perplexity` computes the same on the same file.

What is written to --out:
    config.json, generation_config.json, model.safetensors (fp16), tokenizer.json,
    tokenizer_config.json, special_tokens_map.json
    heldout.txt      the held-out chapters, as one text
    training.tsv     the training curve: step, tokens seen, mean training loss since the last
                     row, held-out perplexity (fp32 weights; and at the end, fp16 as saved)

Deterministic given --seed: the window order and the initialisation come from it (the BPE is
deterministic by itself), and the run uses --threads CPU threads with torch's deterministic
algorithms. OMP_WAIT_POLICY defaults to PASSIVE: on a busy CPU, OpenMP threads that spin while
they wait made a training step six times slower here (the numbers are the same either way).
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_tiny_opt import perplexity, prepare_corpus, train_model, training_args  # noqa: E402

SPECIAL = ["<unk>", "<s>", "</s>"]
BOS_ID, EOS_ID = 1, 2
N_BYTES = 256
META = "\u2581"


def byte_token(b):
    return f"<0x{b:02X}>"


def train_tokenizer(texts, vocab_size, out):
    """Train the BPE (newlines isolated, words split before each "▁"), write LLaMA 2's
    tokenizer.json to out; return the tokenizer trained and its id -> the file's id."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(META), normalizers.Replace(" ", META)])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", "isolated"),
        pre_tokenizers.Metaspace(replacement=META, prepend_scheme="never", split=True)])
    # + 1: the trainer's "\n" gives way to the byte token <0x0A>.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - N_BYTES + 1, min_frequency=2,
                                  special_tokens=SPECIAL, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    trained = json.loads(tok.to_str())["model"]
    for i, s in enumerate(SPECIAL):
        assert tok.token_to_id(s) == i, f"{s} is not id {i}"

    vocab = {s: i for i, s in enumerate(SPECIAL)}
    vocab.update((byte_token(b), len(SPECIAL) + b) for b in range(N_BYTES))
    new_id = {i: i for i in range(len(SPECIAL))}
    for token, old in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        if old < len(SPECIAL):
            continue
        if token == "\n":  # LLaMA's newline: its byte
            new_id[old] = vocab[byte_token(ord("\n"))]
            continue
        assert "\n" not in token, f"learned token {token!r} holds a newline"
        assert token not in vocab, f"learned token {token!r} is a special or byte token"
        assert META not in token[1:], f"learned token {token!r} has a {META} past its start"
        new_id[old] = vocab[token] = len(vocab)
    merges = []
    for m in trained["merges"]:
        a, b = m.split(" ") if isinstance(m, str) else m
        assert " " not in a + b and a + b in vocab, f"merge {m!r}"
        merges.append(f"{a} {b}")

    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, s in enumerate(SPECIAL)]
    bos = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    config = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": META},
            {"type": "Replace", "pattern": {"String": " "}, "content": META}]},
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [BOS_ID], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": META}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
                  "ignore_merges": False, "vocab": vocab, "merges": merges},
    }
    assert len(vocab) == vocab_size, f"{len(vocab)} tokens, asked for {vocab_size}"
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return tok, new_id


def check_tokenizer(out, tok, new_id, text):
    """The tokenizer.json written segments text as the tokenizer trained, round-trips it, and
    spells a character outside the alphabet in bytes."""
    from tokenizers import Tokenizer
    final = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    ids = final.encode(text, add_special_tokens=False).ids
    assert ids == [new_id[i] for i in tok.encode(text).ids], "tokenizer.json segments differently"
    assert final.decode(ids) == text, "tokenizer.json does not round-trip the held-out text"
    assert final.encode("And").ids[0] == BOS_ID, "no <s> prepended"
    for s in ["caf\u00e9", "\u65e5\u672c", "\U0001f600"]:
        pieces = final.encode(s, add_special_tokens=False).tokens
        want = [byte_token(b) for b in s.encode("utf-8") if b >= 0x80]
        assert [p for p in pieces if p.startswith("<0x")] == want, (s, pieces)
        assert final.decode(final.encode(s).ids) == s, (s, pieces)
    return ids


def write_tokenizer_config(out, context):
    config = {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "legacy": True, "model_max_length": context}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, f, indent=2)


def main():
    ap = training_args(__doc__, "models/llama-kjv", vocab=2048, batch=12, steps=1000, lr=2e-3)
    ap.add_argument("--kv-heads", type=int, default=2, help="key/value heads (of hidden / 64)")
    ap.add_argument("--ffn", type=int, default=704, help="the MLP's width")
    args = ap.parse_args()
    if args.hidden % 64 or args.context < 4 or args.steps < 1 or (args.hidden // 64) % args.kv_heads:
        sys.exit("train_tiny_llama: --hidden must be a multiple of 64, --context at least 4, --steps at "
                 "least 1, and --kv-heads must divide hidden / 64")
    if args.vocab <= len(SPECIAL) + N_BYTES:
        sys.exit(f"train_tiny_llama: --vocab must exceed {len(SPECIAL) + N_BYTES}")

    # OpenMP threads that spin while waiting for each other are several times slower on a CPU
    # shared with other work; sleeping ones are not slower alone, and give the same numbers.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    held, train = prepare_corpus(args, torch)

    tok, new_id = train_tokenizer(train, args.vocab, args.out)
    write_tokenizer_config(args.out, args.context)
    eval_ids = [BOS_ID] + check_tokenizer(args.out, tok, new_id, "".join(held))
    starts, stream = [], []
    for text in train:
        starts.append(len(stream))
        stream += [BOS_ID] + [new_id[i] for i in tok.encode(text).ids] + [EOS_ID]
    print(f"corpus: {len(train)} training chapters, {len(stream)} tokens; {len(held)} held out, "
          f"{len(eval_ids)} tokens", flush=True)

    n_heads = args.hidden // 64
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=n_heads,
                         num_key_value_heads=args.kv_heads, hidden_act="silu",
                         max_position_embeddings=args.context, rms_norm_eps=1e-5, rope_theta=10000.0,
                         attention_bias=False, mlp_bias=False, attention_dropout=0.0,
                         bos_token_id=BOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.layers} layers of {args.hidden}, {n_heads} heads, {args.kv_heads} key/value heads, "
          f"MLP {args.ffn}, {args.context} positions, vocab {args.vocab}: {n_params / 1e6:.2f}M parameters",
          flush=True)
    t0 = time.time()
    curve = train_model(model, stream, starts, eval_ids, args, torch)

    model = model.half()
    model.save_pretrained(args.out, safe_serialization=True)
    ppl16, count, _ = perplexity(model.float(), eval_ids, args.context, torch)
    curve.write(f"fp16\t{args.steps * args.batch * args.context}\t\t{ppl16:.3f}\n")
    curve.close()
    print(f"saved {args.out}: held-out perplexity {ppl16:.3f} over {count} tokens with the fp16 "
          f"weights as saved ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
