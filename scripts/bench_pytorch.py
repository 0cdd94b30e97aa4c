#!/usr/bin/env python3
"""The PyTorch baseline of scripts/bench_cpu.sh: eager OPT with a KV cache on the CPU.

transformers' OPTForCausalLM, built from an OPTConfig with the dims of --model and random (dummy)
weights, fp32, model.eval(), under torch.inference_mode(), with torch.set_num_threads(--threads).

Synthetic prompts as ./flexgen makes them: --batch prompts of --prompt-len ids, the first 2 (BOS)
and the rest random, all the same length (no padding, so no attention mask is needed).

  prefill: one forward over the prompts with use_cache=True; the lm_head runs on the last
           position only (as in ./flexgen); argmax
  decode:  gen_len - 1 steps, each feeding the argmax token with past_key_values

Both are timed with time.perf_counter (model construction and a short warm-up are not), and one
JSON line is printed with ./flexgen --json's throughput keys and FlexGen's definitions:

  prefill_throughput = batch * prompt_len / prefill_latency
  decode_throughput  = batch * (gen_len - 1) / decode_latency
  total_throughput   = batch * gen_len / (prefill_latency + decode_latency)

plus model, batch, prompt_len, gen_len, threads.

  python scripts/bench_pytorch.py --model opt-125m --batch 2 --prompt-len 16 --gen-len 4 --threads 2
"""
import argparse
import json
import sys
import time

# name: (layers, hidden, heads, ffn, word_embed_proj_dim, do_layer_norm_before); the same dims as
# opt_model.c's table. scripts/bench_cpu.sh imports this table for its FLOP and memory arithmetic.
MODELS = {
    "opt-125m": (12, 768, 12, 3072, 768, True),
    "opt-350m": (24, 1024, 16, 4096, 512, False),
    "opt-1.3b": (24, 2048, 32, 8192, 2048, True),
    "opt-2.7b": (32, 2560, 32, 10240, 2560, True),
    "opt-6.7b": (32, 4096, 32, 16384, 4096, True),
    "opt-13b": (40, 5120, 40, 20480, 5120, True),
    "opt-30b": (48, 7168, 56, 28672, 7168, True),
    "opt-66b": (64, 9216, 72, 36864, 9216, True),
    "opt-175b": (96, 12288, 96, 49152, 12288, True),
}
VOCAB = 50272
MAX_POSITIONS = 2048
BOS = 2


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="opt-125m", choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's own choice)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.batch < 1 or a.prompt_len < 1 or a.gen_len < 1:
        p.error("--batch, --prompt-len and --gen-len must be >= 1")
    if a.prompt_len + a.gen_len > MAX_POSITIONS:
        p.error(f"--prompt-len + --gen-len must be <= {MAX_POSITIONS}")
    if a.threads is not None and a.threads < 1:
        p.error("--threads must be >= 1")
    return a


def model_config(name):
    """The OPTConfig of a real OPT model of this size (random weights are drawn from init_std);
    scripts/bench_peers.py saves checkpoints with it."""
    from transformers import OPTConfig

    layers, hidden, heads, ffn, word_dim, ln_before = MODELS[name]
    return OPTConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        ffn_dim=ffn,
        num_attention_heads=heads,
        max_position_embeddings=MAX_POSITIONS,
        word_embed_proj_dim=word_dim,
        do_layer_norm_before=ln_before,
        _remove_final_layer_norm=False,
        activation_function="relu",
        dropout=0.1,
        attention_dropout=0.0,
        layerdrop=0.0,
        init_std=0.02,
        enable_bias=True,
        layer_norm_elementwise_affine=True,
        use_cache=True,
        pad_token_id=1,
        bos_token_id=BOS,
        eos_token_id=2,
        tie_word_embeddings=True,
    )


def build_model(name):
    from transformers import OPTForCausalLM

    model = OPTForCausalLM(model_config(name))  # random init: dummy weights
    return model.float().eval()


def step(model, ids, past):
    """One forward: the decoder over ids (with the cache), the lm_head on the last position."""
    out = model.model.decoder(input_ids=ids, past_key_values=past, use_cache=True, return_dict=True)
    logits = model.lm_head(out.last_hidden_state[:, -1, :])
    return logits.argmax(dim=-1, keepdim=True), out.past_key_values


def main(argv):
    a = parse_args(argv)
    import torch

    if a.threads is not None:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model = build_model(a.model)

    g = torch.Generator().manual_seed(a.seed + 1)
    prompts = torch.randint(3, VOCAB, (a.batch, a.prompt_len), generator=g, dtype=torch.long)
    prompts[:, 0] = BOS

    with torch.inference_mode():
        # Warm-up, not timed: a short prefill and one decode step.
        tok, past = step(model, prompts[:1, :8], None)
        step(model, tok, past)
        del tok, past

        t0 = time.perf_counter()
        tok, past = step(model, prompts, None)
        t1 = time.perf_counter()
        for _ in range(a.gen_len - 1):
            tok, past = step(model, tok, past)
        t2 = time.perf_counter()

    prefill, decode = t1 - t0, t2 - t1
    total = prefill + decode
    res = {
        "impl": "pytorch",
        "model": a.model,
        "batch": a.batch,
        "prompt_len": a.prompt_len,
        "gen_len": a.gen_len,
        "threads": a.threads if a.threads is not None else torch.get_num_threads(),
        "torch_version": torch.__version__,
        "prefill_latency": prefill,
        "prefill_throughput": a.batch * a.prompt_len / max(prefill, 1e-10),
        "decode_latency": decode,
        "decode_throughput": a.batch * (a.gen_len - 1) / max(decode, 1e-10),
        "total_latency": total,
        "total_throughput": a.batch * a.gen_len / max(total, 1e-10),
    }
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
