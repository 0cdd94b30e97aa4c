#!/usr/bin/env python3
"""Build the tiny LLaMA-family reference fixtures in tests/fixtures/<model>/.

Each is a small, randomly initialised LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM,
saved by transformers, with the files of scripts/make_reference.py beside it (prompts.txt,
tokens.txt, logits.bin, reference.json; the same formats). Together they cover:

    grouped-query ratios 1, 2, 4 and 8 (8 also as multi-query attention, one K and V head);
    head dims 64 and 128, and 24 (not a power of two, and heads x head_dim != hidden);
    rope_theta 1e4, 5e5 and 1e6, rope_scaling "llama3" and "linear";
    attention_bias and mlp_bias (LLaMA), Qwen2's q/k/v biases, Mistral;
    tied and untied embeddings; saved as fp16, bf16 and fp32, one of them sharded.

Numerics match the C implementation (weights stored as fp16, compute in fp32, the KV cache in
fp16): every parameter is exact in fp16 and in the saved dtype; the reference runs in fp32 with
eager attention, and the keys (after RoPE, as HF caches them) and the values are rounded to fp16
where the cache takes them. Prompts of different lengths are left-padded (attention_mask 0) and
run as one batch, positions from the mask (cumsum - 1, as generate() passes them); greedy, a
prefill then GEN_LEN - 1 cached decode steps, no EOS stopping. Each prompt is run alone too, and
must give the same tokens. A seed is kept only if the smallest top-two logit gap is far above
fp32 noise (GAP_FACTOR, as for OPT).

Deterministic: fixed seeds, one CPU thread. Run with a Python that has torch and transformers:
    python scripts/make_llama_reference.py [--out DIR] [--only NAME ...]
"""

import json
import os
import sys

import torch
import transformers
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_reference import (GAP_FACTOR, KV_NOISE_RTOL, clean_dir, log, round_param,  # noqa: E402
                            saved_tensor_names, top2_gap)
from make_reference import main as reference_main  # noqa: E402

GEN_LEN = 8
PAD_ID = 0
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
            "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
BASE = dict(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
            max_position_embeddings=128, rms_norm_eps=1e-5)

MODELS = [
    dict(name="llama-tiny-mha", family="llama", seed=1, dtype=torch.float16, shard=None,
         config=dict(num_attention_heads=2, num_key_value_heads=2, rope_theta=1e4,
                     tie_word_embeddings=False),
         prompt_lengths=[3, 9, 14, 6, 1]),
    dict(name="llama-tiny-gqa2-llama3", family="llama", seed=2, dtype=torch.bfloat16, shard=None,
         config=dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=5e5,
                     tie_word_embeddings=True,
                     rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0, original_max_position_embeddings=32)),
         prompt_lengths=[7, 2, 11, 4, 13]),
    dict(name="llama-tiny-gqa4-linear", family="llama", seed=3, dtype=torch.float32, shard="200KB",
         config=dict(num_attention_heads=8, num_key_value_heads=2, rope_theta=1e4,
                     tie_word_embeddings=False, rope_scaling=dict(rope_type="linear", factor=2.0)),
         prompt_lengths=[5, 1, 12, 8]),
    dict(name="llama-tiny-mqa-bias", family="llama", seed=4, dtype=torch.float16, shard=None,
         config=dict(num_attention_heads=8, num_key_value_heads=1, head_dim=24, rope_theta=1e4,
                     attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
         prompt_lengths=[6, 10, 3, 12]),
    dict(name="mistral-tiny-gqa8", family="mistral", seed=5, dtype=torch.float16, shard=None,
         config=dict(num_attention_heads=16, num_key_value_heads=2, rope_theta=1e6,
                     sliding_window=None, tie_word_embeddings=False),
         prompt_lengths=[4, 13, 9, 2]),
    dict(name="qwen2-tiny", family="qwen2", seed=6, dtype=torch.bfloat16, shard=None,
         config=dict(num_attention_heads=1, num_key_value_heads=1, rope_theta=1e6, rms_norm_eps=1e-6,
                     tie_word_embeddings=True, use_sliding_window=False),
         prompt_lengths=[8, 3, 12, 5]),
]

# Init: normal(mean, std); linear weights std gain / sqrt(fan_in), o_proj and down_proj out_gain.
# Tied: a smaller embedding and larger layer outputs, or the token's own embedding decides the
# logits and the model repeats its input.
SCALES = dict(embed=1.0, norm=0.15, bias=0.05, out_gain=2.0)
TIED_SCALES = dict(SCALES, embed=0.25, out_gain=6.0)


def make_model(spec, seed):
    cfg_cls, model_cls = FAMILIES[spec["family"]]
    cfg = cfg_cls(**dict(BASE, **spec["config"]), hidden_act="silu", attention_dropout=0.0,
                  bos_token_id=1 if spec["family"] != "qwen2" else None, eos_token_id=2,
                  pad_token_id=PAD_ID, attn_implementation="eager")
    torch.manual_seed(seed)
    model = model_cls(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    sc = TIED_SCALES if cfg.tie_word_embeddings else SCALES
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied lm_head appears once (embed_tokens)
            if name.endswith("norm.weight"):
                v = torch.randn(p.shape, generator=g) * sc["norm"] + 1.0
            elif name.endswith("embed_tokens.weight") or name == "lm_head.weight":
                v = torch.randn(p.shape, generator=g) * sc["embed"]
            elif name.endswith(".bias"):
                v = torch.randn(p.shape, generator=g) * sc["bias"]
            else:
                gain = sc["out_gain"] if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
                v = torch.randn(p.shape, generator=g) * gain / p.shape[1] ** 0.5
            p.copy_(round_param(v, spec["dtype"]))
    return cfg, model


def round_cache(family):
    """The keys after RoPE and the values rounded to fp16, as the C cache stores them."""
    module = sys.modules[FAMILIES[family][1].__module__]
    plain = module.apply_rotary_pos_emb

    def rotary(q, k, cos, sin, *a, **kw):
        q, k = plain(q, k, cos, sin, *a, **kw)
        return q, k.half().float()

    module.apply_rotary_pos_emb = rotary
    return module, plain


def v_hooks(model):
    return [m.register_forward_hook(lambda _m, _i, out: out.half().float())
            for n, m in model.named_modules() if n.endswith("v_proj")]


@torch.no_grad()
def greedy(model, prompts, gen_len):
    b, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((b, width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    tokens, logits = [], []
    for step in range(gen_len):
        last = out.logits[:, -1, :].float()
        nxt = last.argmax(dim=-1)
        logits.append(last.clone())
        tokens.append(nxt.clone())
        if step == gen_len - 1:
            break
        mask = torch.cat([mask, torch.ones((b, 1), dtype=torch.long)], dim=1)
        pos = pos[:, -1:] + 1
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos,
                    past_key_values=out.past_key_values, use_cache=True)
    return torch.stack(tokens, dim=1), torch.stack(logits, dim=1)


def make_prompts(spec, cfg, seed):
    g = torch.Generator().manual_seed(seed + 1)
    bos = [cfg.bos_token_id] if cfg.bos_token_id is not None else []
    return [bos + torch.randint(3, cfg.vocab_size, (n - len(bos),), generator=g).tolist()
            for n in spec["prompt_lengths"]]


def attempt(spec, seed, d):
    cfg, model = make_model(spec, seed)
    clean_dir(d)
    model.to(spec["dtype"]).save_pretrained(d, safe_serialization=True,
                                            **({"max_shard_size": spec["shard"]} if spec["shard"] else {}))
    ref = FAMILIES[spec["family"]][1].from_pretrained(d, torch_dtype=torch.float32,
                                                      attn_implementation="eager").eval()
    hooks = v_hooks(ref)
    prompts = make_prompts(spec, cfg, seed)
    tokens, logits = greedy(ref, prompts, GEN_LEN)
    max_abs, gap = logits.abs().max().item(), top2_gap(logits)
    worst = 0.0
    for i, p in enumerate(prompts):  # the padding's semantics: each prompt alone, unpadded
        t1, l1 = greedy(ref, [p], GEN_LEN)
        assert torch.equal(t1[0], tokens[i]), f"{spec['name']}: prompt {i} tokens differ unpadded"
        worst = max(worst, (l1[0] - logits[i]).abs().max().item())
    for h in hooks:
        h.remove()
    return cfg, prompts, tokens, logits, max_abs, gap, worst / max_abs


def build(spec, out_root):
    d = os.path.join(out_root, spec["name"])
    module, plain = round_cache(spec["family"])
    try:
        for seed in range(spec["seed"], spec["seed"] + 1000 * 100, 1000):
            cfg, prompts, tokens, logits, max_abs, gap, rel = attempt(spec, seed, d)
            log(f"{spec['name']} seed {seed}: max|logit| {max_abs:.4g}, min top-2 gap {gap:.4g} "
                f"({gap / (1e-4 * max_abs):.1f} x 1e-4 max), padded vs alone {rel:.3g}")
            if gap >= GAP_FACTOR * 1e-4 * max_abs and rel <= KV_NOISE_RTOL:
                break
        else:
            sys.exit(f"{spec['name']}: no seed gave a wide enough top-two gap")
    finally:
        module.apply_rotary_pos_emb = plain
    names = saved_tensor_names(d)
    assert (len(names) >= 2) == bool(spec["shard"]), list(names)
    saved = [k for ts in names.values() for k in ts]
    assert ("lm_head.weight" in saved) == (not cfg.tie_word_embeddings), "lm_head saved iff untied"
    with open(os.path.join(d, "prompts.txt"), "w") as fh:
        fh.writelines(" ".join(map(str, p)) + "\n" for p in prompts)
    with open(os.path.join(d, "tokens.txt"), "w") as fh:
        fh.writelines(" ".join(map(str, row)) + "\n" for row in tokens.tolist())
    logits.numpy().astype("<f4").tofile(os.path.join(d, "logits.bin"))
    meta = dict(n_prompts=len(prompts), gen_len=GEN_LEN, vocab=cfg.vocab_size, max_abs_logit=max_abs,
                min_top2_gap=gap, seed=seed, transformers=transformers.__version__, torch=torch.__version__,
                note=("Made by scripts/make_llama_reference.py: a random %s model, parameters exact in "
                      "fp16 and in the saved dtype (%s); reference in fp32, eager attention, keys after "
                      "RoPE and values rounded to fp16; prompts left-padded with id %d, positions from "
                      "the mask; greedy, prefill + %d cached decode steps. logits.bin: float32 LE "
                      "[n_prompts][gen_len][vocab]. Each prompt alone gives the same tokens, logits "
                      "within %.3g of max|logit|." % (spec["family"], str(spec["dtype"])[6:], PAD_ID,
                                                       GEN_LEN - 1, rel)))
    with open(os.path.join(d, "reference.json"), "w") as fh:
        json.dump(meta, fh, indent=2)
        fh.write("\n")
    log(f"  tokens: {tokens.tolist()}")


if __name__ == "__main__":
    reference_main(MODELS, build, __doc__)
