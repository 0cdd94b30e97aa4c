#!/usr/bin/env python3
"""The reference fixture of a trained checkpoint (models/opt-kjv, from train_tiny_opt.py, or
models/llama-kjv, from train_tiny_llama.py), from PyTorch + HF transformers, in
tests/fixtures/<name>/:

    prompts.txt, tokens.txt, logits.bin, reference.json
        as scripts/make_reference.py writes them for the random models: a few prompts (BOS +
        the first words of held-out verses), GEN_LEN greedy tokens and the logits each was
        chosen from; the reference suite loads the weights from the model directory
    excerpt.txt
        the start of the held-out text, and in reference.json its perplexity for each window
        setting in PERPLEXITY, the tokens scored and the largest |logit| seen

The architecture is config.json's model_type. OPT: OPTForCausalLM, the tokenizer of vocab.json
and merges.txt, BOS </s> (2); numerics as in make_reference.py: the saved fp16 weights run in
fp32 with eager attention, one thread, and every k_proj / v_proj output is rounded to fp16 (the C
KV cache); the batch's positions come from the attention mask. LLaMA: LlamaForCausalLM, the
tokenizer.json, BOS <s> (1); numerics as in make_llama_reference.py: the keys after RoPE (as HF
caches them) and the v_proj outputs are rounded to fp16, and the positions are passed (the
mask's cumsum - 1). A trained model's top two logits can be close; prompts are kept only where
every step's top-two gap is at least GAP_FACTOR x 1e-4 x max|logit|, so that the suite's
tolerance cannot flip a token.

    venv/bin/python scripts/make_trained_reference.py [--model models/opt-kjv] [--name opt-kjv]
    venv/bin/python scripts/make_trained_reference.py --model models/llama-kjv --name llama-kjv
"""
import argparse
import json
import os
import sys

import torch
import transformers
from tokenizers import ByteLevelBPETokenizer, Tokenizer
from transformers import LlamaForCausalLM, OPTForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_llama_reference import PAD_ID as LLAMA_PAD_ID  # noqa: E402
from make_llama_reference import greedy as llama_greedy, round_cache, v_hooks  # noqa: E402
from make_reference import BOS_ID, GAP_FACTOR, GEN_LEN, REPO, add_kv_rounding_hooks, greedy  # noqa: E402
from train_tiny_opt import perplexity  # noqa: E402

N_PROMPTS = 4
PROMPT_WORDS = 5
EXCERPT_TOKENS = 1000
PERPLEXITY = [(None, None), (64, 16)]  # (window, stride); None: the model's positions, half


def load(model_dir):
    """The checkpoint in fp32 with its cache's fp16 rounding, its tokenizer's encode (no BOS), its
    BOS id, its greedy generation and the words of the note that differ by architecture."""
    with open(os.path.join(model_dir, "config.json")) as fh:
        model_type = json.load(fh).get("model_type")
    if model_type == "llama":
        tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32,
                                                 attn_implementation="eager").eval()
        round_cache("llama")
        v_hooks(model)
        words = dict(rounded="keys after RoPE and v_proj outputs", bos="<s>",
                     batch="one left-padded batch (pad id %d, positions from the mask)" % LLAMA_PAD_ID)
        return (model, lambda s: tok.encode(s, add_special_tokens=False).ids, model.config.bos_token_id,
                llama_greedy, words)
    if model_type != "opt":
        sys.exit(f"make_trained_reference: {model_dir}: model_type {model_type!r} (known: opt, llama)")
    tok = ByteLevelBPETokenizer(os.path.join(model_dir, "vocab.json"),
                                os.path.join(model_dir, "merges.txt"))
    model = OPTForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32,
                                           attn_implementation="eager").eval()
    add_kv_rounding_hooks(model)
    words = dict(rounded="k_proj/v_proj outputs", bos="</s>", batch="one left-padded batch")
    return model, lambda s: tok.encode(s).ids, BOS_ID, greedy, words


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(REPO, "models", "opt-kjv"))
    ap.add_argument("--name", default="opt-kjv")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out = os.path.join(REPO, "tests", "fixtures", args.name)
    os.makedirs(out, exist_ok=True)

    model, encode, bos_id, greedy, words = load(args.model)
    held = open(os.path.join(args.model, "heldout.txt"), encoding="utf-8").read().splitlines()

    # Prompts: the first words of held-out verses, where greedy decoding is far from a tie.
    prompts, tokens, logits = [], [], []
    for verse in held:
        p = [bos_id] + encode(" ".join(verse.split()[:PROMPT_WORDS]))
        t, l = greedy(model, [p], GEN_LEN)
        top = l[0].topk(2, dim=-1).values
        if (top[:, 0] - top[:, 1]).min().item() >= GAP_FACTOR * 1e-4 * l.abs().max().item():
            prompts.append(p), tokens.append(t[0]), logits.append(l[0])
        if len(prompts) == N_PROMPTS:
            break
    # Run again as one left-padded batch: what the C code is compared with.
    tokens_b, logits_b = greedy(model, prompts, GEN_LEN)
    assert torch.equal(tokens_b, torch.stack(tokens)), "batched greedy tokens differ from single"
    max_abs = logits_b.abs().max().item()
    top = logits_b.topk(2, dim=-1).values
    gap = (top[..., 0] - top[..., 1]).min().item()
    with open(os.path.join(out, "prompts.txt"), "w") as fh:
        fh.writelines(" ".join(map(str, p)) + "\n" for p in prompts)
    with open(os.path.join(out, "tokens.txt"), "w") as fh:
        fh.writelines(" ".join(map(str, r)) + "\n" for r in tokens_b.tolist())
    logits_b.numpy().astype("<f4").tofile(os.path.join(out, "logits.bin"))

    # The perplexity of the excerpt: whole lines of the held-out text, about EXCERPT_TOKENS.
    lines, n = [], 1
    for line in held:
        n += len(encode(line + "\n"))
        lines.append(line + "\n")
        if n >= EXCERPT_TOKENS:
            break
    excerpt = "".join(lines)
    with open(os.path.join(out, "excerpt.txt"), "w", encoding="utf-8") as fh:
        fh.write(excerpt)
    ids = [bos_id] + encode(excerpt)
    ppl = []
    for window, stride in PERPLEXITY:
        w = window or model.config.max_position_embeddings
        value, scored, top_abs = perplexity(model, ids, w, torch, stride)
        ppl.append({"window": w, "stride": stride or w // 2, "perplexity": value,
                    "scored_tokens": scored, "max_abs_logit": top_abs})
        print(f"excerpt: window {w}, stride {stride or w // 2}: perplexity {value:.6f} over {scored} "
              f"tokens, max|logit| {top_abs:.3f}")

    meta = {
        "model": os.path.relpath(args.model, REPO),
        "n_prompts": len(prompts), "gen_len": GEN_LEN, "vocab": model.config.vocab_size,
        "max_abs_logit": max_abs, "min_top2_gap": gap,
        "perplexity": ppl,
        "transformers": transformers.__version__, "torch": torch.__version__,
        "note": ("Made by scripts/make_trained_reference.py from the trained checkpoint named in "
                 "`model`: fp16 weights run in fp32 (eager attention, 1 thread) with %s "
                 "rounded to fp16. Prompts: %s + the first %d words of held-out verses, "
                 "kept where every greedy step's top-two gap is at least %g x 1e-4 x max|logit|; "
                 "%s, %d greedy steps. Perplexity of excerpt.txt (%s + its "
                 "tokens): windows advancing by `stride`, each scoring the tokens no earlier one "
                 "did." % (words["rounded"], words["bos"], PROMPT_WORDS, GAP_FACTOR, words["batch"], GEN_LEN,
                           words["bos"])),
    }
    with open(os.path.join(out, "reference.json"), "w") as fh:
        json.dump(meta, fh, indent=2)
        fh.write("\n")
    print(f"{out}: {len(prompts)} prompts, max|logit| {max_abs:.3f}, min top-2 gap {gap:.4f}")


if __name__ == "__main__":
    main()
