#!/usr/bin/env python3
"""Train a small OPT from scratch on the King James Bible, on the CPU, and save it in Hugging
Face's layout so that both ./flexgen and transformers' OPTForCausalLM load it.

    apt-get install bible-kjv-text          # Debian's KJV text and its reader, /usr/bin/bible
    python3 -m venv venv && venv/bin/pip install torch transformers tokenizers safetensors
    venv/bin/python scripts/train_tiny_opt.py --out models/opt-kjv

The corpus: `bible -f gen1:1-rev22:21` prints the 31,102 verses, one a line after its reference
("Ge1:1 In the beginning ..."). The reference is dropped. Each of the 1,189 chapters is a
document: its verses joined by newlines. Every 25th chapter (the 25th, the 50th, ...) is held
out for evaluation; the rest train the tokenizer and the model.

The tokenizer: a byte-level BPE (GPT-2's scheme: the same pre-tokenizer regex and byte alphabet)
of --vocab tokens, trained with the `tokenizers` package on the training chapters. Its first
four ids are OPT's special tokens: <s> 0, <pad> 1, </s> 2, <unk> 3. It is saved as GPT-2's
vocab.json and merges.txt, with tokenizer_config.json naming the special tokens.

The model: OPTForCausalLM itself, so the architecture is OPT's (pre-LN, learned positions offset
by 2, ReLU, lm_head tied to the token embedding), with --layers layers of --hidden, heads of 64,
an MLP of 4 x hidden and --context positions. No dropout. Training reads windows of --context
tokens from the stream of training chapters, each chapter preceded by </s> (OPT's document
separator, and the BOS its tokenizer prepends); a quarter of the windows start at a chapter's
</s>, so that a prompt begun with BOS is familiar. AdamW, linear warm-up then cosine decay.

The held-out perplexity is computed the usual way for a model of fixed length (HF's guide):
the ids are </s> + the held-out text's tokens, windows of --context tokens advance by half of
it, and each window scores only the tokens the previous one did not; every token but the first
is scored once. `flexgen perplexity` computes the same on the same file.

What is written to --out:
    config.json, generation_config.json, model.safetensors (fp16), vocab.json, merges.txt,
    tokenizer_config.json, special_tokens_map.json
    heldout.txt      the held-out chapters, as one text
    training.tsv     the training curve: step, tokens seen, mean training loss since the last
                     row, held-out perplexity (fp32 weights; and at the end, fp16 as saved)

Deterministic given --seed: the BPE, the window order and the initialisation come from it, and
the run uses --threads CPU threads with torch's deterministic algorithms.
"""
import argparse
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time

SPECIAL = ["<s>", "<pad>", "</s>", "<unk>"]
PAD_ID, BOS_ID = 1, 2
HELD_OUT_EVERY = 25
VERSE = re.compile(r"^(\w+?)(\d+):(\d+) (.*)$")


def read_chapters(bible):
    """The chapters of the KJV in order, each the text of its verses, one a line."""
    if not shutil.which(bible):
        sys.exit(f"train_tiny_opt: {bible}: not found; install Debian's bible-kjv-text "
                 "(apt-get install bible-kjv-text), or name the reader with --bible")
    out = subprocess.run([bible, "-f", "gen1:1-rev22:21"], capture_output=True, text=True,
                         check=True).stdout
    chapters, key = [], None
    for line in out.splitlines():
        m = VERSE.match(line)
        if not m:
            continue
        if (m.group(1), m.group(2)) != key:
            key = (m.group(1), m.group(2))
            chapters.append([])
        chapters[-1].append(m.group(4))
    if len(chapters) != 1189:
        sys.exit(f"train_tiny_opt: {bible} gave {len(chapters)} chapters, expected 1189")
    return ["\n".join(verses) + "\n" for verses in chapters]


def train_tokenizer(texts, vocab_size, out):
    from tokenizers import ByteLevelBPETokenizer
    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL,
                            show_progress=False)
    tok.save_model(out)
    for i, s in enumerate(SPECIAL):
        assert tok.token_to_id(s) == i, f"{s} is not id {i}"
    return tok


def write_tokenizer_config(out, context):
    config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": "</s>", "eos_token": "</s>",
              "unk_token": "<unk>", "pad_token": "<pad>", "add_prefix_space": False,
              "add_bos_token": True, "errors": "replace", "model_max_length": context}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "</s>", "eos_token": "</s>", "unk_token": "<unk>",
                   "pad_token": "<pad>"}, f, indent=2)


def perplexity(model, ids, window, torch, stride=None):
    """exp(mean NLL) of ids[1:] in windows of `window` tokens advancing by `stride` (half the
    window), each scoring the tokens no earlier window did; also the count and max |logit|."""
    stride = stride or window // 2
    nll, count, max_abs, scored_to, begin = 0.0, 0, 0.0, 1, 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        while True:
            end = min(begin + window, len(ids))
            logits = model(input_ids=torch.tensor([ids[begin:end]])).logits[0]
            max_abs = max(max_abs, logits.abs().max().item())
            logp = torch.log_softmax(logits.double(), dim=-1)
            targets = torch.tensor(ids[scored_to:end])
            rows = torch.arange(scored_to - 1 - begin, end - 1 - begin)
            nll -= logp[rows, targets].sum().item()
            count += end - scored_to
            scored_to = end
            if end == len(ids):
                break
            begin += stride
    model.train(was_training)
    return math.exp(nll / count), count, max_abs


def prepare_corpus(args, torch):
    """Seeds, threads and torch's deterministic algorithms from args; the chapters split into
    held-out and training ones, the held-out written to --out's heldout.txt; returns both."""
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    os.makedirs(args.out, exist_ok=True)
    chapters = read_chapters(args.bible)
    held = [c for i, c in enumerate(chapters) if (i + 1) % HELD_OUT_EVERY == 0]
    train = [c for i, c in enumerate(chapters) if (i + 1) % HELD_OUT_EVERY != 0]
    with open(os.path.join(args.out, "heldout.txt"), "w") as f:
        f.write("".join(held))
    return held, train


def train_model(model, stream, starts, eval_ids, args, torch):
    """AdamW over windows of the stream (a quarter starting at a document's BOS), warm-up then
    cosine decay, the held-out perplexity every --eval-every steps into training.tsv; returns
    that file, open, for the row of the weights as saved."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    curve = open(os.path.join(args.out, "training.tsv"), "w")
    curve.write("step\ttokens\ttrain_loss\theldout_ppl\n")
    last_start = len(stream) - args.context
    sum_loss, n_loss, t0 = 0.0, 0, time.time()
    for step in range(args.steps):
        offsets = [random.choice(starts) if random.random() < 0.25 else random.randrange(last_start)
                   for _ in range(args.batch)]
        offsets = [min(o, last_start) for o in offsets]
        x = torch.tensor([stream[o:o + args.context] for o in offsets])
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sum_loss += loss.item()
        n_loss += 1
        done = step + 1
        if done % args.eval_every == 0 or done == args.steps:
            ppl, _, _ = perplexity(model, eval_ids, args.context, torch)
            seen = done * args.batch * args.context
            curve.write(f"{done}\t{seen}\t{sum_loss / n_loss:.4f}\t{ppl:.3f}\n")
            curve.flush()
            print(f"step {done}/{args.steps}: train loss {sum_loss / n_loss:.3f}, held-out "
                  f"perplexity {ppl:.2f} ({time.time() - t0:.0f} s)", flush=True)
            sum_loss, n_loss = 0.0, 0
    return curve


def training_args(doc, out, vocab, batch, steps, lr):
    """The command line both training scripts share, with each one's defaults."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=out)
    ap.add_argument("--bible", default="bible", help="the KJV reader of bible-kjv [bible]")
    ap.add_argument("--seed", type=int, default=1611)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=vocab)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, default=batch, help="windows per step")
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=200)
    return ap


def main():
    args = training_args(__doc__, "models/opt-kjv", vocab=4096, batch=16, steps=1200, lr=1e-3).parse_args()
    if args.hidden % 64 or args.context < 4 or args.steps < 1:
        sys.exit("train_tiny_opt: --hidden must be a multiple of 64, --context at least 4, --steps at least 1")

    import torch
    from transformers import OPTConfig, OPTForCausalLM

    held, train = prepare_corpus(args, torch)

    tok = train_tokenizer(train, args.vocab, args.out)
    write_tokenizer_config(args.out, args.context)
    starts, stream = [], []
    for text in train:
        starts.append(len(stream))
        stream += [BOS_ID] + tok.encode(text).ids
    eval_ids = [BOS_ID] + tok.encode("".join(held)).ids
    print(f"corpus: {len(train)} training chapters, {len(stream)} tokens; {len(held)} held out, "
          f"{len(eval_ids)} tokens", flush=True)

    config = OPTConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                       ffn_dim=4 * args.hidden, num_attention_heads=args.hidden // 64,
                       max_position_embeddings=args.context, word_embed_proj_dim=args.hidden,
                       do_layer_norm_before=True, dropout=0.0, attention_dropout=0.0,
                       activation_dropout=0.0, layerdrop=0.0, activation_function="relu",
                       pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=BOS_ID,
                       tie_word_embeddings=True)
    model = OPTForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.layers} layers of {args.hidden}, {config.num_attention_heads} heads, "
          f"{args.context} positions, vocab {args.vocab}: {n_params / 1e6:.2f}M parameters", flush=True)
    t0 = time.time()
    curve = train_model(model, stream, starts, eval_ids, args, torch)

    model = model.half()
    model.config.dtype = torch.float16
    model.save_pretrained(args.out, safe_serialization=True)
    ppl16, count, _ = perplexity(model.float(), eval_ids, args.context, torch)
    curve.write(f"fp16\t{args.steps * args.batch * args.context}\t\t{ppl16:.3f}\n")
    curve.close()
    print(f"saved {args.out}: held-out perplexity {ppl16:.3f} over {count} tokens with the fp16 "
          f"weights as saved ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
