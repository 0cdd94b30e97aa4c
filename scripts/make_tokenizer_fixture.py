#!/usr/bin/env python3
"""Writes the tokenizer fixtures: tests/fixtures/tokenizer{,-gpt2,-added}/, each a checkpoint's
tokenizer files (vocab.json, merges.txt and the special-token files HF reads beside them) and
cases.json, the ids HF gives for a list of strings.

OPT's real vocab is not part of the repository, so a small byte-level BPE (same format as OPT's:
GPT-2 byte map, `#version` header in merges.txt, <s> <pad> </s> <unk> at ids 0..3) is trained on
the text below with the `tokenizers` library, and CROSS_MERGES are appended. The three
directories share it and differ in the files around it:
  tokenizer/        special_tokens_map.json and tokenizer_config.json as OPT checkpoints have
                    them: bos, eos and unk are </s>, pad is <pad> (<s> and <unk> are plain text);
  tokenizer-gpt2/   as GPT-2 ships: <|endoftext|> last in the vocab and no special tokens in its
                    files, so GPT2Tokenizer's defaults make it bos, eos and unk; plus an
                    added_tokens.json;
  tokenizer-added/  a tokenizer_config.json with added_tokens_decoder (as newer transformers
                    save it): added tokens with lstrip, rstrip and single_word, some past the
                    vocab, and a special_tokens_map.json that HF ignores next to it.
The expected ids come from HF transformers' slow GPT2Tokenizer.from_pretrained(directory): the
Python reference that tokenizer.c reproduces. On text without special tokens HF's fast tokenizer
must agree with it (a sanity check of the fixture). A case whose decoded ids are not its text
(stripped whitespace) also records "decoded": HF's decode with skip_special_tokens=False,
spaces_between_special_tokens=False, clean_up_tokenization_spaces=False.
Deterministic: running it again gives identical files.

The slow GPT2Tokenizer exists up to transformers 4.x. Run from the repository root:
    .venv/bin/python scripts/make_tokenizer_fixture.py
"""
import argparse
import json
import os
import shutil
import tempfile

from tokenizers import ByteLevelBPETokenizer
from transformers import GPT2Tokenizer, PreTrainedTokenizer
from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
OUT = os.path.join(FIXTURES, "tokenizer")
VOCAB_SIZE = 1000  # below what the text supports, so some words stay in pieces
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]  # OPT's ids 0..3

TRAINING_TEXT = [
    """The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox did not
care. It ran over the hills and through the forest, where the trees were tall and the light was
thin. People who live near the forest say that the fox comes back every evening.""",
    """Large language models generate text one token at a time. Each new token depends on all the
tokens before it, so the model keeps a cache of keys and values for every layer. When the batch
is large, the cache does not fit in the memory of the GPU, and it has to be offloaded to the CPU
or even to the disk. Offloading trades bandwidth for capacity: the weights, the activations and
the cache are moved between the GPU, the CPU and the disk in a careful order.""",
    """She said: "I don't know what you're talking about." He replied, "You've seen it, haven't
you? I'll show you again; we'd better hurry." They're going to the station, and it's already
late. I'm sure we'll make it if we don't stop. Who's there? What's that? Let's go!""",
    """In 2023, the team trained 7 models with 125 million to 175 billion parameters. The largest
one needs 350 GB of memory in half precision, i.e. 2 bytes per parameter. Numbers like 3.14159,
2.71828, 1,000,000 and 0.001 appear often; so do dates such as 1999-12-31 and times like 23:59.""",
    """def forward(self, x):
    h = self.embed(x) + self.pos[: x.shape[1]]
    for layer in self.layers:
        h = layer(h)  # attention, then the feed-forward block
    return self.norm(h) @ self.embed.weight.T

if (n > 0 && ptr != NULL) { x[i] += y[i] * 2; } else { return -1; }
for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }
{"key": [1, 2, 3], "other": {"nested": true, "value": null}}
<html><body><p class="note">Hello &amp; welcome!</p></body></html>""",
    """Le café est ouvert depuis le matin. La fiancée naïve a lu son résumé à Zürich; il fait
très beau à Montréal. Über den Wolken muss die Freiheit wohl grenzenlos sein. El niño comió
piña en la mañana. São Paulo é uma cidade enorme. Dvořák, Gödel, Erdős, Łódź.""",
    """日本語のテキストを少し書きます。東京は大きな都市です。今日は天気がいいです。
中文的句子也在这里。我们今天去公园散步。你好，世界！
한국어 문장도 조금 있습니다. 안녕하세요.""",
    """Emoji appear in chat: 😀 😂 👍 🎉 ❤️ 🚀 🔥 and sometimes several in a row 😀😀😀.
Arrows → ← ↑ ↓, math ∑ ∫ √ ≈ ≠ ≤ ≥, currency € £ ¥ $ and symbols © ® ™ § ¶ •.""",
    """Whitespace matters:    four spaces here,\ttabs\t\there, and blank lines below.


Windows lines end with\r\nthis, and some lines end with trailing spaces   
    indented code line
        more indented""",
]

CASES = [
    "",
    " ",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "don't I'll we've they're she's it'd I'm you'd",
    "DON'T SHOUT, IT'S LOUD 'S 'T",
    "x''s 'sll ''' 'abc' rock'n'roll",
    "Numbers: 1234567890 3.14159 -42 1e10 ٣٤٥ ½ Ⅻ ²",
    "Punctuation!!! ... ??? (a,b) [c] {d} <e> a->b && c || !d; @#$%^&*_+=~`",
    "for (int i = 0; i < n; ++i) { x[i] += y[i] * 2; }",
    "café naïve résumé Zürich Dvořák",
    "日本語のテキスト",
    "中文测试，你好世界。",
    "emoji 👍🏽 🎉",
    "family 👨‍👩‍👧‍👦 and flag 🇯🇵",
    "    four leading spaces",
    "trailing spaces   ",
    "tabs\there\t\tand\tthere",
    "line1\nline2\n\nline4\n",
    "\r\n windows line\r\nend\r\n",
    "  \n  \t mixed whitespace \n ",
    "\n",
    "a  b   c    d",
    "Mixed: English, Ελληνικά, Русский, العربية, हिन्दी, 한국어, ไทย",
    "NBSP\u00a0here, ideographic\u3000space, and en\u2002space",
    "unseen characters: ⅍ ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀 ᚠᛇᚻ Ꭰ",
    "pneumonoultramicroscopicsilicovolcanoconiosis",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "URL https://example.com/path?q=1&r=2#frag and mail someone@example.org",
    "zero\u200bwidth and soft\u00adhyphen",
    "control \x01\x02\x7f bytes and \x0b\x0c vt ff",
    "The GPU keeps the cache; the CPU holds the weights. It's 2 bytes per parameter.",
    "   ",
    " \t\n",
    "'s",
    "it's 's'",
]

# The pre-tokenizer's optional space is ' ' only: other whitespace before a contraction, a word,
# a number or punctuation is a token of its own (or joins the whitespace run). CROSS_MERGES make a
# pre-tokenizer that got this wrong give other ids.
WHITESPACE_CASES = [
    "a\t's b\n't c\r're d\u00a0've e\u3000ll f  'm g\t\t'd",
    "\tword \nword \rword \x0bword \x0cword \u00a0word \u3000word \u2003word",
    "x\t123 x\n456 x\r789 x\u00a0123 x\u3000456 x  789",
    "x\t!! x\n?? x\r.. x\u00a0;; x\u3000() x  --",
    "\u00a0\u00a0word \u3000 word \u00a0 word  \u00a0word",
    "end\t\nend\r\n\r\nend\u2028end\u2029end\u0085end",
    "\x1cword \x1d123 \x1e!! \x1f's",
    "\u1680word\u202fword\u205fword\u2000word\u200aword",
    "  \t  's \r\n 123 \n\t!! \u00a0 \u3000 ",
    "word\u00a0",
    "\u3000",
]


# OPT: </s> is bos, eos and unk, <pad> is pad; <s> and <unk> are ordinary text.
OPT_SPECIAL_CASES = [
    "</s>",
    "Hello</s>world",
    "Hello </s> world",
    "Hello</s> world",
    "Hello </s>world",
    "</s></s></s>",
    "</s> </s>  </s>\t</s>\n</s>",
    "<pad>Hello<pad>",
    "<pad></s><pad>",
    "</s",
    "</s >",
    "</ s>",
    "< /s>",
    "</S>",
    "<s>x",
    "<s></s><pad><unk>",
    "<</s>>",
    "</s>>",
    "<</s>",
    "<<pad>>",
    "<pa</s>d>",
    "in</s>side a wo</s>rd",
    "don</s>'t</s>'s '</s>s",
    "\n</s>\n",
    "\t</s>\t",
    "  </s>  ",
    "</s>\u00a0word word\u3000</s>",
    "x</s",
    "\U0001F600</s>\u65e5\u672c",
    "123</s>456 !!</s>??",
    "</s>Hello world</s>",
]

# GPT-2: <|endoftext|> from GPT2Tokenizer's defaults, <|im_start|> from added_tokens.json.
GPT2_CASES = [
    "<|endoftext|>",
    "Hello<|endoftext|>world",
    "Hello <|endoftext|> world",
    "<|endoftext|><|endoftext|>",
    "<|endoftext|",
    "<|endoftext|>x",
    "<|endoftext||>",
    "</s><pad> are plain text here",
    "<|im_start|>user\nhi<|endoftext|>",
    "a<|im_start|>b",
]

# Added tokens with flags (added_files): <mask> lstrip, <eat> rstrip, <both> both, <word>
# single_word, <lw> lstrip and single_word, <pad> and <new> rstrip; <ab> and <ab>c overlap;
# \u0120world, \u0120cls and \u0120the hold a byte-map character (the special ones decode through
# the byte map unless past the vocab); <unk> is special only here.
ADDED_CASES = [
    "Hello <mask> world",
    "Hello<mask>world",
    "Hello \t <mask>world",
    "\u00a0\u3000\x1c<mask>",
    "<mask>",
    "  <mask>  ",
    "a <eat>  b",
    "a <eat>\n\tb",
    "a<eat>",
    "<eat> ",
    "<eat>\x1f\u2028x",
    "<both>",
    "x  <both>  y",
    "x<both>y",
    "<word>",
    "x<word>",
    "x <word>",
    "x <word> y",
    "x<word> y",
    "x <word>y",
    "<word>y",
    "<word> <word>",
    "<word><word>",
    "<word><mask>",
    "<mask><word>",
    "x <eat><word> y",
    "x <lw>",
    "x<lw>",
    "x  <lw> y",
    "x\t<lw>y",
    "<ab>",
    "<ab>c",
    "<ab>cd",
    "x<ab>c>y",
    "<a<ab>",
    "hello\u0120world \u0120world",
    "x\u0120cls y\u0120cls",
    "</s><pad><new><unk>",
    "<pad>  x <new> \t y",
    "x\u0120the the \u0120the",
    "<new>, <new>.",
    "<sep> and <cls> are text: special_tokens_map.json is not read",
    "<mask><eat><both><new></s>",
]

# HF's AddedToken fields, as tokenizer files store them.
def token(content, lstrip=False, rstrip=False, single_word=False, normalized=True):
    return {"content": content, "lstrip": lstrip, "normalized": normalized, "rstrip": rstrip,
            "single_word": single_word}


# OPT's two files (facebook/opt-*): the AddedToken dicts written by transformers 4.19-era code.
def opt_files():
    eos, pad = token("</s>"), token("<pad>")
    typed = lambda t: dict(t, __type="AddedToken")
    return {
        "special_tokens_map.json": {"bos_token": eos, "eos_token": eos, "unk_token": eos,
                                    "pad_token": pad},
        "tokenizer_config.json": {"errors": "replace", "unk_token": typed(eos),
                                  "bos_token": typed(eos), "eos_token": typed(eos),
                                  "pad_token": typed(pad), "add_prefix_space": False,
                                  "add_bos_token": True, "special_tokens_map_file": None,
                                  "name_or_path": "facebook/opt-125m"},
    }


def gpt2_files(n_vocab):
    return {"tokenizer_config.json": {"model_max_length": 1024},
            "added_tokens.json": {"<|im_start|>": n_vocab + 1}}


# Newer transformers save every added token in tokenizer_config.json's added_tokens_decoder; HF
# then reads neither special_tokens_map.json nor added_tokens.json.
def added_files(n_vocab):
    special = lambda t: dict(t, special=True)
    plain = lambda t: dict(t, special=False)
    added = [special(token("<mask>", lstrip=True)), plain(token("<eat>", rstrip=True)),
             plain(token("<both>", lstrip=True, rstrip=True)),
             plain(token("<word>", single_word=True)), plain(token("<ab>")), plain(token("<ab>c")),
             plain(token("\u0120world")), special(token("<new>", rstrip=True)),
             special(token("\u0120cls")),
             plain(token("<lw>", lstrip=True, single_word=True))]
    decoder = {"1": special(token("<pad>", rstrip=True)), "2": special(token("</s>"))}
    decoder.update({str(n_vocab + i): t for i, t in enumerate(added)})
    return {
        "tokenizer_config.json": {
            "add_bos_token": True, "add_prefix_space": False, "added_tokens_decoder": decoder,
            "additional_special_tokens": ["<new>", "\u0120the"], "bos_token": "</s>", "cls_token": "\u0120cls",
            "eos_token": "</s>", "errors": "replace", "mask_token": "<mask>",
            "model_max_length": 2048, "pad_token": "<pad>", "tokenizer_class": "GPT2Tokenizer",
            "unk_token": "<unk>",
        },
        "special_tokens_map.json": {"sep_token": "<sep>", "bos_token": "</s>",
                                    "eos_token": "</s>", "unk_token": "</s>",
                                    "pad_token": "<pad>"},
    }


# Merges added after training, at the lowest ranks: each joins the last byte of a whitespace
# character to the ASCII character after it. Trained merges never cross a pre-token boundary, so
# without these a pre-tokenizer that let "\tword" be one pre-token would still give the same ids.
CROSS_MERGES = ["\tw", "\nw", "\rw", "\x0bw", "\x0cw", "\u00a0w", "\u3000w", "\u2003w",
                "\t1", "\n4", "\r7", "\u00a01", "\u30004",
                "\t!", "\n?", "\r.", "\u00a0;", "\u3000("]


def add_cross_merges():
    byte_char = bytes_to_unicode()
    vocab_path, merges_path = os.path.join(OUT, "vocab.json"), os.path.join(OUT, "merges.txt")
    with open(vocab_path, encoding="utf-8") as f:
        vocab = json.load(f)
    with open(merges_path, "a", encoding="utf-8") as f:
        for pair in CROSS_MERGES:
            left, right = (byte_char[pair[:-1].encode()[-1]], byte_char[ord(pair[-1])])
            f.write(f"{left} {right}\n")
            vocab[left + right] = len(vocab)
    with open(vocab_path, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False, separators=(",", ":"))


def train(workdir):
    files = []
    for i, text in enumerate(TRAINING_TEXT):
        path = os.path.join(workdir, f"train{i}.txt")
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        files.append(path)
    tok = ByteLevelBPETokenizer()
    tok.train(files, vocab_size=VOCAB_SIZE, min_frequency=1, special_tokens=SPECIALS,
              show_progress=False)
    tok.save_model(OUT)
    add_cross_merges()
    return ByteLevelBPETokenizer.from_file(os.path.join(OUT, "vocab.json"),
                                           os.path.join(OUT, "merges.txt"))


def write_json(path, obj, indent=2):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=indent)
        f.write("\n")


def write_dir(name, files, extra_vocab=None):
    """tests/fixtures/NAME: the trained vocab (plus extra_vocab) and merges, and `files`."""
    out = os.path.join(FIXTURES, name)
    if out != OUT:
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        shutil.copy(os.path.join(OUT, "merges.txt"), out)
        with open(os.path.join(OUT, "vocab.json"), encoding="utf-8") as f:
            vocab = json.load(f)
        vocab.update(extra_vocab or {})
        with open(os.path.join(out, "vocab.json"), "w", encoding="utf-8") as f:
            json.dump(vocab, f, ensure_ascii=False, separators=(",", ":"))
    for file_name, obj in files.items():
        write_json(os.path.join(out, file_name), obj)
    return out


def expected_cases(directory, texts, fast=None):
    slow = GPT2Tokenizer.from_pretrained(directory)
    assert isinstance(slow, PreTrainedTokenizer), "needs transformers 4.x (the slow tokenizer)"
    cases = []
    for text in texts:
        ids = slow.encode(text, add_special_tokens=False)
        if fast is not None:
            assert ids == fast.encode(text).ids, f"fast and slow tokenizers disagree on {text!r}"
        case = {"text": text, "ids": ids}
        decoded = slow.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False,
                              clean_up_tokenization_spaces=False)
        if decoded != text:
            assert fast is None, text
            case["decoded"] = decoded
        cases.append(case)
    return cases


def write_cases(directory, cases):
    write_json(os.path.join(directory, "cases.json"), cases, indent=1)
    print(f"{directory}: {len(cases)} cases")


def main():
    ap = argparse.ArgumentParser(description="Writes tests/fixtures/tokenizer{,-gpt2,-added}/.")
    ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        fast = train(workdir)
    with open(os.path.join(OUT, "vocab.json"), encoding="utf-8") as f:
        n_vocab = len(json.load(f))
    opt = write_dir("tokenizer", opt_files())
    write_cases(opt, expected_cases(opt, CASES + WHITESPACE_CASES, fast) +
                expected_cases(opt, OPT_SPECIAL_CASES))
    gpt2 = write_dir("tokenizer-gpt2", gpt2_files(n_vocab), {"<|endoftext|>": n_vocab})
    write_cases(gpt2, expected_cases(gpt2, GPT2_CASES))
    added = write_dir("tokenizer-added", added_files(n_vocab))
    write_cases(added, expected_cases(added, ADDED_CASES))


if __name__ == "__main__":
    main()
