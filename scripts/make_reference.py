#!/usr/bin/env python3
"""Build the tiny OPT reference fixtures in tests/fixtures/<model>/.

For each of six tiny, randomly initialised OPT models this script writes

    config.json, generation_config.json      (save_pretrained)
    model.safetensors | model-0000k-of-0000n.safetensors + model.safetensors.index.json
    prompts.txt     one prompt per line: its unpadded token ids (BOS = 2 first)
    tokens.txt      one line per prompt: the GEN_LEN greedily generated ids
    logits.bin      float32 little-endian [n_prompts][GEN_LEN][vocab]: for every prompt and step,
                    the logits of the last position, i.e. the ones the token was chosen from
    reference.json  sizes, logit statistics, versions, how it was made

The models:
    opt-tiny       pre-LN, word_embed_proj_dim == hidden, saved as fp16, one file
    opt-tiny-350m  post-LN (do_layer_norm_before=False) with project_in / project_out and no
                   final layer norm, like facebook/opt-350m; saved as fp32, sharded
    opt-tiny-bf16  pre-LN, other dims, saved as bf16
    opt-deep       pre-LN, 20 layers, word_embed_proj_dim 72 > hidden 40 (project_in / out)
    opt-tiny-text  pre-LN, with the vocab of tests/fixtures/tokenizer: text prompts through that
                   tokenizer (an HF-layout directory with vocab.json and merges.txt); also writes
                   texts.json, the prompts and what HF's tokenizer decodes the output to
    opt-outlier    pre-LN, 3 layers, with LLM.int8's outlier features: 4 hidden dims 24-56x the
                   rest in every linear layer's input (add_outliers below)

Numerics, matching the C implementation (weights stored as fp16, compute in fp32, the KV cache
stored as fp16):
  * every parameter is rounded so that it is exact both in the saved dtype and in fp16;
  * the reference runs in fp32, with forward hooks on every k_proj / v_proj that round the
    projection's output to fp16 and back (the C code stores K and V as fp16 as produced, and
    attention reads them as stored);
  * the initialisation is scaled up from HF's std 0.02 so that the logits are well spread, and
    the smallest top-two gap is asserted to be far above fp32 noise.

Generation: the prompts of different lengths are left-padded with pad id 1 (attention_mask 0
on pads) and run as one batch: a prefill with use_cache=True, then GEN_LEN - 1 decode steps,
each feeding the argmax token with the attention mask extended by a 1 and past_key_values.
No position_ids are passed: HF derives OPT's positions from the attention mask
(cumsum(mask) * mask - 1, looked up at + 2). No EOS stopping. The same prompts are then run one
at a time without padding as a check of the padding semantics.

Deterministic: fixed seeds, one CPU thread. Run, from anywhere, with a Python that has torch,
transformers and safetensors:
    python3 scripts/make_reference.py [--out DIR] [--only NAME ...]
"""

import argparse
import copy
import json
import os
import shutil
import sys

import torch
import transformers
from transformers import OPTConfig, OPTForCausalLM

GEN_LEN = 8
PAD_ID = 1
BOS_ID = 2
# The smallest top-two logit gap must be at least GAP_FACTOR * 1e-4 * max|logit|.
GAP_FACTOR = 50.0
# Batched (padded) vs one-at-a-time logits: max |diff| / max |logit| must stay below this.
# Checked in pure fp32; with the fp16 K/V rounding on, fp16 rounding flips allow KV_NOISE_RTOL.
SINGLE_RTOL = 1e-5
KV_NOISE_RTOL = 2e-4

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = [
    dict(
        name="opt-tiny",
        seed=36,
        save_dtype=torch.float16,
        max_shard_size=None,
        config=dict(
            vocab_size=512,
            hidden_size=64,
            num_attention_heads=4,
            ffn_dim=256,
            num_hidden_layers=2,
            max_position_embeddings=64,
            word_embed_proj_dim=64,
            do_layer_norm_before=True,
        ),
        prompt_lengths=[3, 9, 14, 6, 1],
    ),
    dict(
        name="opt-tiny-350m",
        seed=32,
        save_dtype=torch.float32,
        max_shard_size="160KB",
        config=dict(
            vocab_size=512,
            hidden_size=64,
            num_attention_heads=4,
            ffn_dim=128,
            num_hidden_layers=2,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            do_layer_norm_before=False,
        ),
        prompt_lengths=[5, 1, 12, 8],
    ),
    dict(
        name="opt-tiny-bf16",
        seed=40,
        save_dtype=torch.bfloat16,
        max_shard_size=None,
        config=dict(
            vocab_size=384,
            hidden_size=48,
            num_attention_heads=6,
            ffn_dim=192,
            num_hidden_layers=3,
            max_position_embeddings=64,
            word_embed_proj_dim=48,
            do_layer_norm_before=True,
        ),
        prompt_lengths=[7, 2, 11, 4, 13],
    ),
    # A deep model: 20 layers, widths no multiple of 32, words wider than the hidden states.
    # docs/PIPELINE.md's bound between schedules grows with depth; runtime's "a 20-layer
    # checkpoint" test holds it here.
    dict(
        name="opt-deep",
        seed=26,
        save_dtype=torch.float16,
        max_shard_size=None,
        config=dict(
            vocab_size=300,
            hidden_size=40,
            num_attention_heads=4,
            ffn_dim=136,
            num_hidden_layers=20,
            max_position_embeddings=128,
            word_embed_proj_dim=72,
            do_layer_norm_before=True,
        ),
        prompt_lengths=[30, 41, 52, 36, 33, 47, 39, 50],
    ),
    # An HF-layout directory with a tokenizer: text prompts in, text out (the CLI's real-checkpoint
    # path). Its vocab is the tokenizer fixture's (tests/fixtures/tokenizer).
    dict(
        name="opt-tiny-text",
        seed=75,
        save_dtype=torch.float16,
        max_shard_size=None,
        config=dict(
            vocab_size=1000,
            hidden_size=64,
            num_attention_heads=4,
            ffn_dim=256,
            num_hidden_layers=2,
            max_position_embeddings=64,
            word_embed_proj_dim=64,
            do_layer_norm_before=True,
        ),
        texts=["Hello world", "The café is open, isn't it?", "日本語", "  spaces\tand tabs"],
    ),
    # Outlier features (LLM.int8, Dettmers et al. 2022): OPT from 6.7B up has a few hidden dims
    # whose activations are 20-60x the rest, in the rows entering the linear layers. Built as a
    # pre-LN opt-tiny, then edited by add_outliers() below; for --int8-activations' accuracy.
    dict(
        name="opt-outlier",
        seed=78,
        save_dtype=torch.float16,
        max_shard_size=None,
        config=dict(
            vocab_size=300,
            hidden_size=64,
            num_attention_heads=4,
            ffn_dim=256,
            num_hidden_layers=3,
            max_position_embeddings=64,
            word_embed_proj_dim=64,
            do_layer_norm_before=True,
        ),
        prompt_lengths=[12, 33, 7, 25, 40, 18, 3, 29],
        # ratios: the target mean|x| of each outlier dim over that of the other dims, at every
        # linear layer's input (one value per outlier dim); resid: the residual stream's scale-up
        # of those dims; pos_offset / bias: their systematic (same-signed) part, see add_outliers.
        outliers=dict(ratios=[24.0, 32.0, 44.0, 56.0], resid=150.0, pos_offset=16.0),
    ),
]

TOKENIZER_DIR = os.path.join(REPO, "tests", "fixtures", "tokenizer")

FP16_MIN_NORMAL = 2.0 ** -14

# Init: normal(mean, std). Linear weights get std gain / sqrt(fan_in); out_proj and fc2 use
# out_gain so the layers' residual contributions outweigh the token's own embedding (with tied
# embeddings a dominant input embedding makes the model repeat its last token).
INIT_SCALES = dict(embed=0.5, pos=1.0, ln_w=0.15, ln_b=0.02, bias=0.02, out_gain=4.0,
                   embed_rownorm=True)


def log(*a):
    print(*a, flush=True)


def make_config(spec):
    c = dict(spec["config"])
    assert c["hidden_size"] % c["num_attention_heads"] == 0, "head dim must divide hidden"
    return OPTConfig(
        **c,
        activation_function="relu",
        dropout=0.0,
        attention_dropout=0.0,
        layerdrop=0.0,
        enable_bias=True,
        layer_norm_elementwise_affine=True,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=BOS_ID,
        tie_word_embeddings=True,
        init_std=0.02,
        attn_implementation="eager",
    )


def round_param(t, save_dtype):
    """Round so the value is exact in save_dtype and in fp16."""
    if save_dtype == torch.bfloat16:
        t = t.bfloat16().float()
        # bf16 has fp16's mantissa bits to spare only in fp16's normal range.
        t = torch.where(t.abs() < FP16_MIN_NORMAL, torch.zeros_like(t), t)
    else:
        t = t.half().float()
    return t


def init_weights(model, spec):
    """Re-initialise every parameter with scales that give well-spread logits, then round."""
    g = torch.Generator().manual_seed(spec["seed"])
    sc = dict(INIT_SCALES, **spec.get("init", {}))

    def randn(shape, std, mean=0.0):
        return torch.randn(shape, generator=g) * std + mean

    with torch.no_grad():
        for name, p in model.named_parameters():  # tied lm_head.weight appears once (embed_tokens)
            if name.endswith("embed_tokens.weight"):
                v = randn(p.shape, 1.0)
                if sc["embed_rownorm"]:  # equal-norm rows: no token wins by its norm alone
                    v = v / v.norm(dim=1, keepdim=True) * (p.shape[1] ** 0.5)
                v = v * sc["embed"]
            elif name.endswith("embed_positions.weight"):
                v = randn(p.shape, sc["pos"])
            elif "layer_norm" in name and name.endswith(".weight"):
                v = randn(p.shape, sc["ln_w"], 1.0)
            elif "layer_norm" in name and name.endswith(".bias"):
                v = randn(p.shape, sc["ln_b"])
            elif name.endswith(".weight") and p.dim() == 2:  # linear [out][in]
                gain = sc["out_gain"] if name.endswith(("out_proj.weight", "fc2.weight")) else 1.0
                v = randn(p.shape, gain / (p.shape[1] ** 0.5))
            elif name.endswith(".bias"):
                v = randn(p.shape, sc["bias"])
            else:
                raise RuntimeError(f"no init rule for {name}")
            p.copy_(round_param(v, spec["save_dtype"]))
        for name, p in model.named_parameters():
            assert torch.equal(p.half().float(), p), f"{name} is not fp16-exact"
            assert torch.equal(p.to(spec["save_dtype"]).float(), p), f"{name} not exact in save dtype"
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight, "lm_head must be tied"


# ---------------------------------------------------------------------------------------------
# opt-outlier: outlier features
#
# LLM.int8 (Dettmers et al. 2022, section 4) finds that OPT from 6.7B up carries a few hidden
# dimensions whose values in the rows entering the linear layers are 20-60x those of the other
# dimensions, systematically: in most tokens, with one sign per dimension, in every layer. They
# live in the residual stream, larger still there, and the LayerNorms' weights on them are small.
# add_outliers() builds that into a random pre-LN OPT with HF's own modules, editing parameters
# only, in forward order, each step measured on the fixture's prompts (each alone, prefill):
#
#  1. the residual stream: 4 outlier dims D (drawn from the seed; two of each sign) of
#     embed_positions get a same-signed offset pos_offset (16, the column's std is 1), then D of
#     embed_tokens and embed_positions are scaled so that the residual stream entering layer 0
#     has mean|h_j| = resid (150) x mean|h_other|; each layer's out_proj and fc2 bias on D is
#     then set to keep that ratio at every LayerNorm's input (the other dims grow with depth, so
#     D's biases do too). Balanced signs leave LayerNorm's mean nearly unmoved; outlier dims of
#     one sign would move every row's mean, and with it every other dim after the LayerNorm.
#     Weights' rows for D are not scaled: out_proj's and fc2's 4-bit groups run along the output
#     dim, so a scaled row would coarsen every group it is in; embeddings group along the
#     vocab / positions, biases are not compressed.
#  2. each layer's two LayerNorms: the weight on D set so that the LN output (the rows entering
#     q/k/v, and fc1) has mean|x_j| = ratio_j x mean|x_other|, ratio = 24, 32, 44, 56; on the
#     other dims scaled by one factor that gives them their size before step 1: at width 64 four
#     dims at 150x carry nearly all of a row's variance and LN would shrink the rest ~40x (in
#     OPT-6.7B's 4096 dims the outliers carry far less); this factor stands in for the width.
#     2b. q/k/v's and fc1's biases take the change in their inputs' mean over the prompts (the
#     systematic part of the outliers, which a trained model's biases absorb); without it every
#     token's q/k/v and fc1 are dominated by one constant vector and the model repeats one token.
#  3. out_proj's input (the heads' softmax-weighted V): v_proj's bias on 4 dims moved by delta_j
#     so that the rows entering out_proj have ratio_j there (softmax rows sum to 1: each row gets
#     exactly + delta_j); out_proj's bias minus W_o[:, j] delta_j keeps the function.
#  4. fc2's input (ReLU(fc1)): fc1's bias on 4 ffn dims per layer raised by delta_j > 0 so that
#     they are active in every token with ratio_j; fc2's bias minus W_2[:, j] delta_j.
#  5. the final LayerNorm: the tied lm_head's columns D are scaled as in 1, so its weight on D
#     makes D's share of each logit that of any other dim; the other dims as in 2.
# Consumers' weights (q/k/v, fc1, out_proj, fc2 on the outlier inputs) keep their random size, as
# the real models' are about as large on outlier channels as on others (SmoothQuant, Xiao et al.
# 2023, Fig. 4), so int8.c's decode, which rounds x[k] times the 4-bit scale of W's row k, sees
# the same ratios. Then every parameter is rounded to fp16. Measured on the saved model by
# print_outliers() (the build's log and reference.json "outliers"; 167 rows, all 3 layers):
#   residual stream at each LayerNorm's input: 149.9-150.1x on each of D;
#   rows entering q/k/v, out_proj, fc1 and fc2: 23.9-24.0 / 31.9-32.1 / 43.9-44.1 / 55.9-56.1x
#     (ratio = mean|x_j| / mean|x_other|); fc2's outlier units active in 100% of the rows;
#   LN weight on D / median of the others' LN weights: 0.2, 0.2, 0.3, 0.4 (every layer's two),
#     final LN 5e-4 to 8e-4.
# What it costs at width 64: §5's 4-bit weights move opt-outlier's prefill logits by 1.43x
# max|logit| (opt-tiny: 0.22x; measured in PyTorch with quant.c's rounding, as the C run does),
# 1.05x from q/k/v and fc1 alone, 0.74x from out_proj and fc2 alone (opt-tiny: 0.13x, 0.11x): the
# outlier inputs multiply the rounding errors of the weight rows that read them, ~10x the other
# 60 dims' share of an output's error here where OPT-6.7B's 4096 dims would give ~2x. So compare
# --int8-activations against the 4-bit run rather than against this reference.
# ---------------------------------------------------------------------------------------------

OUTLIER_N = 4


def _capture(model, prompts):
    """Each prompt alone (no padding), prefill, no cache: the rows entering each LayerNorm and
    linear layer, {(layer, name): [rows][dim]}; (n_layers, 'final_ln') and 'lm_head' for the
    last LayerNorm."""
    dec = model.model.decoder
    rows, hooks = {}, []

    def grab(key):
        def pre(_m, inp):
            x = inp[0]
            rows.setdefault(key, []).append(x.reshape(-1, x.shape[-1]).detach().clone())
        return pre

    for i, layer in enumerate(dec.layers):
        at = layer.self_attn
        for name, mod in (("attn_ln", layer.self_attn_layer_norm), ("qkv", at.q_proj),
                          ("out_proj", at.out_proj), ("ffn_ln", layer.final_layer_norm),
                          ("fc1", layer.fc1), ("fc2", layer.fc2)):
            hooks.append(mod.register_forward_pre_hook(grab((i, name))))
    n = len(dec.layers)
    hooks.append(dec.final_layer_norm.register_forward_pre_hook(grab((n, "final_ln"))))
    hooks.append(model.lm_head.register_forward_pre_hook(grab((n, "lm_head"))))
    with torch.no_grad():
        for p in prompts:
            model(input_ids=torch.tensor([p]), use_cache=False)
    for h in hooks:
        h.remove()
    return {k: torch.cat(v) for k, v in rows.items()}


def _ratios(x, dims):
    """mean|x_j| / mean|x_other| over all rows, for each j in dims."""
    other = torch.ones(x.shape[1], dtype=torch.bool)
    other[dims] = False
    typical = x[:, other].abs().mean()
    return [(x[:, j].abs().mean() / typical).item() for j in dims]


def _normed(ln, h):
    mu = h.mean(-1, keepdim=True)
    var = h.var(-1, unbiased=False, keepdim=True)
    return (h - mu) / torch.sqrt(var + ln.eps)


def outlier_dims(spec):
    """The outlier dims: D of the residual stream with their signs, of V (out_proj's input), and
    of each layer's ffn (fc2's input)."""
    c = spec["config"]
    g = torch.Generator().manual_seed(spec["seed"] + 2)
    d = torch.randperm(c["hidden_size"], generator=g)[:OUTLIER_N].tolist()
    # half of each sign: LayerNorm's mean is then not moved by the outliers' systematic part
    sign = [1.0 - 2.0 * (i % 2) for i in torch.randperm(OUTLIER_N, generator=g).tolist()]
    v = torch.randperm(c["hidden_size"], generator=g)[:OUTLIER_N].tolist()
    vsign = [1.0 if s else -1.0 for s in torch.randint(0, 2, (OUTLIER_N,), generator=g).tolist()]
    f = [torch.randperm(c["ffn_dim"], generator=g)[:OUTLIER_N].tolist()
         for _ in range(c["num_hidden_layers"])]
    return dict(resid=d, sign=sign, v=v, vsign=vsign, ffn=f)


@torch.no_grad()
def add_outliers(model, spec, prompts):
    """Steps 1-5 of the comment above, on the fp32 model, then rounds every parameter."""
    o = spec["outliers"]
    od = outlier_dims(spec)
    dims, sign = od["resid"], torch.tensor(od["sign"])
    ratios, c = o["ratios"], o["resid"]
    dec = model.model.decoder
    base = _capture(model, prompts)

    def set_bias(src, dst, key, idx, signs, target):
        """src's bias on idx moved so that the rows at key have target ratios there; dst's bias
        (if any) makes up for it."""
        for _ in range(4):
            x = _capture(model, prompts)[key]
            other = torch.ones(x.shape[1], dtype=torch.bool)
            other[idx] = False
            typical = x[:, other].abs().mean()
            for j, s, t in zip(idx, signs, target):
                delta = s * (t * typical - x[:, j].abs().mean())
                src.bias[j] += delta
                if dst is not None:
                    dst.bias -= dst.weight[:, j] * delta

    def set_ln(ln, key_in, key_out, targets):
        """LN weight: the others back to their base size, D to targets x the others."""
        other = torch.ones(ln.weight.shape[0], dtype=torch.bool)
        other[dims] = False
        for _ in range(3):  # the LN bias makes one pass approximate
            n = _normed(ln, _capture(model, prompts)[key_in])
            cur = (n[:, other] * ln.weight[other] + ln.bias[other]).abs().mean()
            ln.weight[other] *= base[key_out][:, other].abs().mean() / cur
            typical = (n[:, other] * ln.weight[other] + ln.bias[other]).abs().mean()
            for j, t in zip(dims, targets):
                ln.weight[j] = (t * typical - ln.bias[j].abs()) / n[:, j].abs().mean()

    # 1. the residual stream: the embeddings' D, then each out_proj's and fc2's bias on D
    pos = dec.embed_positions.weight
    pos[:, dims] += sign * o["pos_offset"]
    emb = torch.tensor(_ratios(_capture(model, prompts)[(0, "attn_ln")], dims))
    emb = c / emb  # the ratio is linear in the columns' scale
    dec.embed_tokens.weight[:, dims] *= emb
    pos[:, dims] *= emb
    resid = [c] * OUTLIER_N

    def absorb_mean(key, consumers):
        """The consumers' bias takes the mean of their input on D (what a trained model learns
        for a systematic feature: step 2b)."""
        mu = _capture(model, prompts)[key].mean(0) - base[key].mean(0)
        for lin in consumers:
            lin.bias -= lin.weight @ mu

    n_layers = len(dec.layers)
    for i, layer in enumerate(dec.layers):
        nxt = (i + 1, "attn_ln") if i + 1 < n_layers else (n_layers, "final_ln")
        at = layer.self_attn
        set_ln(layer.self_attn_layer_norm, (i, "attn_ln"), (i, "qkv"), ratios)        # 2.
        absorb_mean((i, "qkv"), (at.q_proj, at.k_proj, at.v_proj))                   # 2b.
        set_bias(layer.self_attn.v_proj, layer.self_attn.out_proj, (i, "out_proj"),  # 3.
                 od["v"], od["vsign"], ratios)
        set_bias(layer.self_attn.out_proj, None, (i, "ffn_ln"), dims, sign, resid)    # 1.
        set_ln(layer.final_layer_norm, (i, "ffn_ln"), (i, "fc1"), ratios)             # 2.
        absorb_mean((i, "fc1"), (layer.fc1,))                                         # 2b.
        set_bias(layer.fc1, layer.fc2, (i, "fc2"), od["ffn"][i], [1.0] * OUTLIER_N,  # 4.
                 ratios)
        set_bias(layer.fc2, None, nxt, dims, sign, resid)                             # 1.
    set_ln(dec.final_layer_norm, (n_layers, "final_ln"), (n_layers, "lm_head"),     # 5.
           (1.0 / emb).tolist())

    for name, p in model.named_parameters():
        p.copy_(round_param(p, spec["save_dtype"]))


@torch.no_grad()
def print_outliers(model, spec, prompts):
    """Measures the outliers on model (the saved one): prints them, returns reference.json's."""
    od = outlier_dims(spec)
    dims = od["resid"]
    rows = _capture(model, prompts)
    dec = model.model.decoder
    fmt = lambda r: "/".join(f"{v:.1f}" for v in r)
    log(f"  outliers: residual dims {dims} (signs {od['sign']}), V dims {od['v']}, "
        f"ffn dims {od['ffn']}; mean|x_j| / mean|x_other| over {rows[(0, 'qkv')].shape[0]} rows:")
    out = dict(resid_dims=dims, v_dims=od["v"], ffn_dims=od["ffn"], layers=[])
    for i, layer in enumerate(dec.layers):
        fc2_in = rows[(i, "fc2")]
        r = dict(residual=_ratios(rows[(i, "attn_ln")], dims), qkv=_ratios(rows[(i, "qkv")], dims),
                 out_proj=_ratios(rows[(i, "out_proj")], od["v"]),
                 fc1=_ratios(rows[(i, "fc1")], dims), fc2=_ratios(fc2_in, od["ffn"][i]),
                 fc2_active=(fc2_in[:, od["ffn"][i]] > 0).float().mean().item())
        lw = []
        for ln in (layer.self_attn_layer_norm, layer.final_layer_norm):
            other = torch.ones(ln.weight.shape[0], dtype=torch.bool)
            other[dims] = False
            lw.append((ln.weight[dims].abs() / ln.weight[other].abs().median()).tolist())
        r["ln_weight_rel"] = lw
        out["layers"].append(r)
        log(f"    layer {i}: residual {fmt(r['residual'])}  q/k/v in {fmt(r['qkv'])}  out_proj in "
            f"{fmt(r['out_proj'])}  fc1 in {fmt(r['fc1'])}  fc2 in {fmt(r['fc2'])} (active "
            f"{r['fc2_active']:.2f}); LN weight on D / others' median: attn "
            f"{fmt(lw[0])}, ffn {fmt(lw[1])}")
    f = dec.final_layer_norm
    other = torch.ones(f.weight.shape[0], dtype=torch.bool)
    other[dims] = False
    out["final_ln_weight_rel"] = (f.weight[dims].abs() / f.weight[other].abs().median()).tolist()
    log("    final LN weight on D / others' median: "
        + "/".join(f"{v:.2g}" for v in out["final_ln_weight_rel"]))
    return out


def add_kv_rounding_hooks(model):
    handles = []

    def hook(_module, _inp, out):
        return out.half().float()

    for name, mod in model.named_modules():
        if name.endswith("k_proj") or name.endswith("v_proj"):
            handles.append(mod.register_forward_hook(hook))
    return handles


def text_tokenizer():
    from transformers import GPT2Tokenizer
    return GPT2Tokenizer(os.path.join(TOKENIZER_DIR, "vocab.json"),
                         os.path.join(TOKENIZER_DIR, "merges.txt"))


def make_prompts(spec, vocab):
    if "texts" in spec:
        tok = text_tokenizer()
        return [[BOS_ID] + tok.encode(t) for t in spec["texts"]]
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    prompts = []
    for n in spec["prompt_lengths"]:
        rest = torch.randint(3, vocab, (n - 1,), generator=g).tolist()
        prompts.append([BOS_ID] + rest)
    return prompts


@torch.no_grad()
def greedy(model, prompts, gen_len):
    """Left-padded batched greedy generation. Returns (tokens [B][gen_len], logits [B][gen_len][V])."""
    b = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((b, width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    tokens, logits = [], []
    for step in range(gen_len):
        last = out.logits[:, -1, :].float()
        nxt = last.argmax(dim=-1)
        logits.append(last.clone())
        tokens.append(nxt.clone())
        if step == gen_len - 1:
            break
        mask = torch.cat([mask, torch.ones((b, 1), dtype=torch.long)], dim=1)
        out = model(input_ids=nxt[:, None], attention_mask=mask,
                    past_key_values=out.past_key_values, use_cache=True)
    return torch.stack(tokens, dim=1), torch.stack(logits, dim=1)


def top2_gap(logits):
    top = logits.topk(2, dim=-1).values
    return (top[..., 0] - top[..., 1]).min().item()


def clean_dir(d):
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(d):
        if (f.endswith(".safetensors") or f.endswith(".bin") or f.endswith(".json")
                or f in ("prompts.txt", "tokens.txt")):
            os.remove(os.path.join(d, f))


def saved_tensor_names(d):
    from safetensors import safe_open
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    res = {}
    for f in files:
        with safe_open(os.path.join(d, f), framework="pt") as sf:
            res[f] = {k: (str(sf.get_slice(k).get_dtype()), list(sf.get_slice(k).get_shape()))
                      for k in sf.keys()}
    return res


def build(spec, out_root):
    name = spec["name"]
    d = os.path.join(out_root, name)
    log(f"=== {name} (seed {spec['seed']}, saved as {spec['save_dtype']}) ===")
    cfg = make_config(spec)
    torch.manual_seed(spec["seed"])
    model = OPTForCausalLM(cfg).float().eval()
    init_weights(model, spec)
    if "outliers" in spec:
        add_outliers(model, spec, make_prompts(spec, cfg.vocab_size))
    dec = model.model.decoder
    if cfg.word_embed_proj_dim != cfg.hidden_size:
        assert dec.project_in is not None and dec.project_out is not None
    if not cfg.do_layer_norm_before:
        assert dec.final_layer_norm is None, "350m-style model must have no final layer norm"

    # Save in the target dtype.
    clean_dir(d)
    to_save = copy.deepcopy(model).to(spec["save_dtype"])
    kw = dict(safe_serialization=True)
    if spec["max_shard_size"]:
        kw["max_shard_size"] = spec["max_shard_size"]
    to_save.save_pretrained(d, **kw)
    del to_save
    names = saved_tensor_names(d)
    for f, ts in names.items():
        log(f"  {f}: {len(ts)} tensors")
        for k, (dt, shape) in ts.items():
            log(f"    {k:55s} {dt:8s} {shape}")
    all_names = [k for ts in names.values() for k in ts]
    assert not any(k.endswith("lm_head.weight") for k in all_names), "lm_head.weight was saved"
    if spec["max_shard_size"]:
        assert os.path.exists(os.path.join(d, "model.safetensors.index.json"))
        assert 2 <= len(names) <= 3, f"expected 2-3 shards, got {len(names)}"
    else:
        assert list(names) == ["model.safetensors"], list(names)
    with open(os.path.join(d, "config.json")) as fh:
        saved_cfg = json.load(fh)
    want_dtype = str(spec["save_dtype"]).replace("torch.", "")
    assert saved_cfg.get("torch_dtype") == want_dtype, (saved_cfg.get("torch_dtype"), want_dtype)

    # Reload from the files just written, in fp32, and check it holds the same numbers.
    ref = OPTForCausalLM.from_pretrained(d, torch_dtype=torch.float32,
                                         attn_implementation="eager").eval()
    assert ref.lm_head.weight.data_ptr() == ref.model.decoder.embed_tokens.weight.data_ptr()
    sd_a, sd_b = model.state_dict(), ref.state_dict()
    assert sd_a.keys() == sd_b.keys()
    for k in sd_a:
        assert torch.equal(sd_a[k], sd_b[k]), f"reloaded {k} differs"
    del model
    outliers = print_outliers(ref, spec, make_prompts(spec, cfg.vocab_size)) \
        if "outliers" in spec else None
    hooks = add_kv_rounding_hooks(ref)

    vocab = cfg.vocab_size
    prompts = make_prompts(spec, vocab)
    tokens, logits = greedy(ref, prompts, GEN_LEN)
    assert torch.isfinite(logits).all()
    max_abs = logits.abs().max().item()
    gap = top2_gap(logits)
    log(f"  max|logit| = {max_abs:.6g}   min top-2 gap = {gap:.6g}   "
        f"gap / (1e-4 * max|logit|) = {gap / (1e-4 * max_abs):.1f}")
    assert gap >= GAP_FACTOR * 1e-4 * max_abs, \
        f"{name}: top-2 gap {gap} too small for max|logit| {max_abs}; change seed/scales"

    # Padding-semantics check: each prompt alone, unpadded. In pure fp32 (no K/V rounding) this
    # differs from the padded batch only by fp32 summation order. With the fp16 K/V rounding, a
    # different summation order can move a K or V element across an fp16 rounding boundary (one
    # fp16 ulp, ~5e-4 relative), which shows in the logits at ~1e-5 relative: the same noise any
    # other implementation (the C code) will show against this reference.
    def batch_vs_single(p_logits, p_tokens):
        worst = 0.0
        for i, p in enumerate(prompts):
            t1, l1 = greedy(ref, [p], GEN_LEN)
            assert torch.equal(t1[0], p_tokens[i]), f"{name}: prompt {i} tokens differ unpadded"
            worst = max(worst, (l1[0] - p_logits[i]).abs().max().item())
        return worst / p_logits.abs().max().item()

    rel = batch_vs_single(logits, tokens)
    for h in hooks:
        h.remove()
    tokens32, logits32 = greedy(ref, prompts, GEN_LEN)
    rel32 = batch_vs_single(logits32, tokens32)
    ref_vs_32 = (logits32 - logits).abs().max().item() / max_abs
    log(f"  batched vs one-at-a-time, tokens equal: max |dlogit| / max|logit| = {rel:.3g} with fp16 "
        f"K/V, {rel32:.3g} in pure fp32")
    log(f"  fp16 K/V vs pure fp32 K/V: max |dlogit| / max|logit| = {ref_vs_32:.3g}, tokens "
        f"{'equal' if torch.equal(tokens32, tokens) else 'DIFFER'}")
    assert rel32 <= SINGLE_RTOL, f"{name}: padded vs unpadded fp32 logits differ by {rel32} relative"
    assert rel <= KV_NOISE_RTOL, f"{name}: padded vs unpadded logits differ by {rel} relative"

    with open(os.path.join(d, "prompts.txt"), "w") as fh:
        for p in prompts:
            fh.write(" ".join(map(str, p)) + "\n")
    with open(os.path.join(d, "tokens.txt"), "w") as fh:
        for row in tokens.tolist():
            fh.write(" ".join(map(str, row)) + "\n")
    logits.numpy().astype("<f4").tofile(os.path.join(d, "logits.bin"))
    meta = {
        "n_prompts": len(prompts),
        "gen_len": GEN_LEN,
        "vocab": vocab,
        "max_abs_logit": max_abs,
        "min_top2_gap": gap,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "note": (
            "Made by scripts/make_reference.py: random OPT (seed %d), every parameter rounded to "
            "be exact in the saved dtype (%s) and in fp16; reference run in fp32 (eager attention, "
            "1 CPU thread) from the saved files, with k_proj/v_proj outputs rounded to fp16 "
            "(the C KV cache). Prompts left-padded with pad id 1 (attention_mask 0), one batch; "
            "greedy argmax, prefill + %d cached decode steps, positions from the attention mask "
            "(no position_ids), no EOS stopping. logits.bin: float32 LE "
            "[n_prompts][gen_len][vocab], the last position's logits each token was chosen from. "
            "Unpadded one-at-a-time runs give the same tokens; max |dlogit| / max|logit| = %.3g "
            "(%.3g with K/V left in fp32: fp16 rounding flips of K/V elements under a different "
            "summation order cause the rest, so compare logits with a tolerance well above 1e-5 "
            "relative). Pure-fp32 K/V would change the logits by %.3g relative."
            % (spec["seed"], want_dtype, GEN_LEN - 1, rel, rel32, ref_vs_32)
        ),
    }
    if outliers:
        meta["outliers"] = dict(spec["outliers"], **outliers, note=(
            "add_outliers() in scripts/make_reference.py: mean|x_j| / mean|x_other| of the "
            "rows entering each layer's linear layers, on the prompts run alone (prefill)"))
    if "texts" in spec:  # the tokenizer files, and what HF's tokenizer decodes the output to
        for f in ("vocab.json", "merges.txt"):
            shutil.copyfile(os.path.join(TOKENIZER_DIR, f), os.path.join(d, f))
        tok = text_tokenizer()
        outs = [{"prompt": t, "generated": tok.decode(row, clean_up_tokenization_spaces=False)}
                for t, row in zip(spec["texts"], tokens.tolist())]
        with open(os.path.join(d, "texts.json"), "w") as fh:
            json.dump(outs, fh, indent=2, ensure_ascii=False)
            fh.write("\n")
    with open(os.path.join(d, "reference.json"), "w") as fh:
        json.dump(meta, fh, indent=2)
        fh.write("\n")
    log(f"  tokens: {tokens.tolist()}")
    return meta


def main(models=MODELS, build_one=None, doc=__doc__):
    """The command line of a fixture script: --out, --only, one thread, deterministic."""
    build_one = build_one or build
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "fixtures"))
    ap.add_argument("--only", nargs="*", help="model names to build (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    log(f"transformers {transformers.__version__}, torch {torch.__version__}")
    specs = [s for s in models if not args.only or s["name"] in args.only]
    if args.only and len(specs) != len(args.only):
        sys.exit(f"unknown model in {args.only}; known: {[s['name'] for s in models]}")
    for s in specs:
        build_one(s, args.out)


if __name__ == "__main__":
    main()
