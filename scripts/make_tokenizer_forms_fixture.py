#!/usr/bin/env python3
"""Writes tests/fixtures/tokenizer-forms/: small tokenizer.json files, one for each form of the
parts that tokenizer_json.c reads and the real vocabularies of tests/fixtures/tokenizers/ leave
out, and what HF tokenizers does with each.

Forms (each NAME.json a tokenizer.json as tokenizers writes it, patched where a form is older):
  template-bos        SentencePiece-style BPE whose post_processor's TemplateProcessing adds the
                      BOS ("<s> $A"), with no tokenizer_config.json beside it to say add_bos_token;
  template-plain      the same with the template "$A": no BOS;
  template-sequence   byte-level BPE whose post_processor is a Sequence of ByteLevel and a
                      TemplateProcessing that adds the BOS ("<|bos|> $A"), as LLaMA 3's;
  metaspace-first, metaspace-always, metaspace-never
                      a Metaspace pre_tokenizer ("split": false) and a Metaspace decoder with
                      that prepend_scheme;
  metaspace-legacy-true, metaspace-legacy-false
                      a Metaspace decoder in the older form, add_prefix_space instead of
                      prepend_scheme (behind SentencePiece's normalizer). tokenizers 0.23 reads
                      add_prefix_space true as prepend_scheme "always" and no longer loads false,
                      which the versions that wrote it decoded as "never" does (the first token's
                      U+2581 kept): the reference of legacy-false is its file with that decoder.
None has a tokenizer_config.json beside it. cases.json holds, for each form, its BOS id (or null)
and cases: {"text", "ids"} with encode(text).ids (add_special_tokens=True: the template's BOS
included) and "decoded", decode(ids, skip_special_tokens=False); and {"ids", "decoded"} for id
sequences chosen to hold what a decoder treats apart (the first token, U+2581 alone or twice,
a special token first).
Deterministic: running it again gives identical files.

Run from the repository root, with HF tokenizers installed (0.23 wrote the committed files):
    python3 -m venv /tmp/tokvenv && /tmp/tokvenv/bin/pip install tokenizers
    /tmp/tokvenv/bin/python scripts/make_tokenizer_forms_fixture.py
"""
import argparse
import json
import os

import tokenizers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "tokenizer-forms")
META = "\u2581"

TEXTS = ["a b", "ab ba", "  a", " a", "a ", "ab  ab", "b\u00e9a", "c", "", "a<s>b"]


def spm_vocab():
    """<unk> <s> </s>, U+2581 alone and twice, a b c, and their merges with U+2581."""
    tokens = ["<unk>", "<s>", "</s>", META, META + META, "a", "b", "c", "ab", "ba",
              META + "a", META + "b", META + "ab", META + META + "a"]
    merges = [(META, "a"), (META, "b"), ("a", "b"), ("b", "a"), (META, META), (META + "a", "b"),
              (META + META, "a")]
    return {t: i for i, t in enumerate(tokens)}, merges


def byte_vocab():
    """Every byte through GPT-2's byte map, <|bos|>, and a few merges of 'a', 'b' and the space."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    chars = [chr(c) for _, c in sorted(zip(bs, cs))]
    vocab = {c: i for i, c in enumerate(chars)}
    space = chars[ord(" ")]
    for extra in ["ab", space + "a", space + "ab", "<|bos|>"]:
        vocab[extra] = len(vocab)
    return vocab, [("a", "b"), (space, "a"), (space + "a", "b")]


def spm_tokenizer(pre_tokenizer, decoder, post_processor, spm_normalizer):
    vocab, merges = spm_vocab()
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True))
    if spm_normalizer:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(META), normalizers.Replace(" ", META)])
    if pre_tokenizer:
        tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    if post_processor:
        tok.post_processor = post_processor
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


SPM_DECODER = decoders.Sequence([decoders.Replace(META, " "), decoders.ByteFallback(), decoders.Fuse(),
                                 decoders.Strip(" ", 1, 0)])


def template(bos, bos_id):
    return processors.TemplateProcessing(single=bos + " $A" if bos else "$A",
                                         special_tokens=[(bos, bos_id)] if bos else [])


def metaspace_form(scheme):
    return spm_tokenizer(pre_tokenizers.Metaspace(META, prepend_scheme=scheme, split=False),
                         decoders.Metaspace(META, prepend_scheme=scheme, split=False), None, False)


def legacy_decoder(tok, add_prefix_space):
    """The tokenizer's JSON with its decoder as older tokenizers wrote Metaspace."""
    data = json.loads(tok.to_str())
    data["decoder"] = {"type": "Metaspace", "replacement": META, "add_prefix_space": add_prefix_space}
    return data


def forms():
    vocab, merges = byte_vocab()
    byte_level = Tokenizer(models.BPE(vocab, merges))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    byte_level.decoder = decoders.ByteLevel()
    byte_level.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False),
                                                     template("<|bos|>", vocab["<|bos|>"])])
    byte_level.add_special_tokens(["<|bos|>"])
    out = {
        "template-bos": spm_tokenizer(None, SPM_DECODER, template("<s>", 1), True),
        "template-plain": spm_tokenizer(None, SPM_DECODER, template(None, None), True),
        "template-sequence": byte_level,
        "metaspace-first": metaspace_form("first"),
        "metaspace-always": metaspace_form("always"),
        "metaspace-never": metaspace_form("never"),
    }
    data = {name: json.loads(tok.to_str()) for name, tok in out.items()}
    for flag in (True, False):
        plain = spm_tokenizer(None, SPM_DECODER, None, True)
        data["metaspace-legacy-" + str(flag).lower()] = legacy_decoder(plain, flag)
    return data


def reference_text(name, data, text):
    """The JSON HF tokenizers runs as the reference: the file as written, but for legacy-false."""
    if name != "metaspace-legacy-false":
        return text
    older = dict(data)
    older["decoder"] = {"type": "Metaspace", "replacement": META, "prepend_scheme": "never", "split": True}
    return json.dumps(older, ensure_ascii=False)


def decode_cases(tok):
    """Id sequences whose decoding turns on the first token and on U+2581 (ids of the SPM vocab)."""
    v = tok.get_vocab()
    if META not in v:
        return []
    seqs = [[v[META + META], v[META + "a"]], [v[META + META + "a"], v["b"]], [v["a"], v[META]],
            [v[META], v["a"]], [v[META]], [v["<s>"], v[META + "a"]], [v[META + "ab"], v[META + META]]]
    return [{"ids": s, "decoded": tok.decode(s, skip_special_tokens=False)} for s in seqs]


def main():
    argparse.ArgumentParser(description="Writes tests/fixtures/tokenizer-forms/.").parse_args()
    os.makedirs(OUT, exist_ok=True)
    cases = {}
    for name, data in sorted(forms().items()):
        text = json.dumps(data, ensure_ascii=False, indent=1) + "\n"
        with open(os.path.join(OUT, name + ".json"), "w", encoding="utf-8") as f:
            f.write(text)
        tok = Tokenizer.from_str(reference_text(name, data, text))
        bos = data["post_processor"]
        encodes = []
        for t in TEXTS:
            ids = tok.encode(t).ids
            encodes.append({"text": t, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)})
        bos_id = tok.encode("").ids[0] if bos and tok.encode("").ids else None
        cases[name] = {"bos": bos_id, "cases": encodes + decode_cases(tok)}
    with open(os.path.join(OUT, "cases.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps({"tokenizers": tokenizers.__version__, "forms": cases}, ensure_ascii=False, indent=1) + "\n")
    print("wrote", len(cases), "forms to", OUT)


if __name__ == "__main__":
    main()
