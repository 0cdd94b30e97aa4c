#!/usr/bin/env python3
"""Writes tests/fixtures/tokenizer/{vocab.json, merges.txt, cases.json}.

OPT's real vocab is not part of the repository, so a small byte-level BPE (same format as OPT's:
GPT-2 byte map, `#version` header in merges.txt, <s> <pad> </s> <unk> at ids 0..3) is trained on
the text below with the `tokenizers` library, and CROSS_MERGES are appended. The expected ids of
cases.json come from HF transformers' slow GPT2Tokenizer loaded from those files: the Python
reference that tokenizer.c reproduces. The fast tokenizer must agree with it on every case (a
sanity check of the fixture).
Deterministic: running it again gives identical files.

Run from the repository root:
    /work/venv/bin/python scripts/make_tokenizer_fixture.py
"""
import json
import os
import tempfile

from tokenizers import ByteLevelBPETokenizer
from transformers import GPT2Tokenizer
from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "tokenizer")
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


def expected_cases(fast):
    slow = GPT2Tokenizer(os.path.join(OUT, "vocab.json"), os.path.join(OUT, "merges.txt"),
                         unk_token="<unk>", bos_token="</s>", eos_token="</s>", pad_token="<pad>")
    cases = []
    for text in CASES + WHITESPACE_CASES:
        ids = slow.encode(text, add_special_tokens=False)
        assert ids == fast.encode(text).ids, f"fast and slow tokenizers disagree on {text!r}"
        assert slow.decode(ids, clean_up_tokenization_spaces=False) == text, text
        cases.append({"text": text, "ids": ids})
    return cases


def main():
    os.makedirs(OUT, exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        fast = train(workdir)
    cases = expected_cases(fast)
    with open(os.path.join(OUT, "cases.json"), "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False, indent=1)
        f.write("\n")
    with open(os.path.join(OUT, "vocab.json"), encoding="utf-8") as f:
        n_vocab = len(json.load(f))
    print(f"{OUT}: {n_vocab} tokens, {len(cases)} cases")


if __name__ == "__main__":
    main()
