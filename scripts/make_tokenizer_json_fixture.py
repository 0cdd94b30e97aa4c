#!/usr/bin/env python3
"""Writes the tokenizer.json fixtures: tests/fixtures/tokenizers/{llama-spm,llama-bpe,qwen2}/ and
tests/fixtures/tokenizers/README.

The vocabularies are llama.cpp's vocab-only GGUF files ggml-vocab-NAME.gguf, with their test
strings (.gguf.inp) and the ids llama.cpp expects for them (.gguf.out). HF transformers converts
each GGUF into a fast tokenizer (AutoTokenizer.from_pretrained(dir, gguf_file=...)) and
save_pretrained writes its tokenizer.json and tokenizer_config.json. Three families:
  llama-spm  LLaMA 2: SentencePiece-style BPE on U+2581, byte fallback (as converted);
  llama-bpe  LLaMA 3: byte-level BPE. The conversion gives it GPT-2's pre-tokenizer and a
             SentencePiece decoder, so the JSON is patched into LLaMA 3's own tokenizer.json
             (its Split regex with \\p{N}{1,3}, ignore_merges, no byte fallback, no normalizer,
             a ByteLevel decoder);
  qwen2      Qwen2: byte-level BPE behind an NFC normalizer (as converted).
Each tokenizers.Tokenizer loaded from the final tokenizer.json is the reference. Per NAME:
  tokenizer.json.xz      the tokenizer.json, xz -9e;
  tokenizer_config.json  as save_pretrained wrote it; a large one (llama-bpe's) without its
                         added_tokens_decoder, whose tokens tokenizer.json's added_tokens hold;
  llamacpp.inp, .out     llama.cpp's test strings and expected ids, verbatim;
  cases.jsonl.xz         JSON Lines, xz -9e: {"text": ..., "ids": [...]} with the reference's
                         encode(text, add_special_tokens=False).ids, plus "decoded" when
                         decode(ids, skip_special_tokens=False) is not the text. First the
                         llama.cpp strings, then generated ones (a fixed seed per NAME).
It also prints how many llama.cpp strings get llama.cpp's ids from the reference (and, for
llama-bpe, from the unpatched conversion) and the sizes of the files written.
Deterministic: running it again gives identical files.

Run from the repository root (transformers 4.46, tokenizers 0.20 and gguf installed):
    python3 scripts/make_tokenizer_json_fixture.py [DIR]
DIR holds ggml-vocab-{llama-spm,llama-bpe,qwen2}.gguf{,.inp,.out}; without it the files are
taken from llama-cpp-python 0.3.36's sdist (vendor/llama.cpp/models/), fetched with
pip download into a temporary directory.
"""
import argparse
import json
import lzma
import math
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import unicodedata

os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' progress bar while it builds merges

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "tokenizers")
NAMES = ["llama-spm", "llama-bpe", "qwen2"]
SDIST = "llama-cpp-python==0.3.36"
SEP = "\n__ggml_vocab_test__\n"  # between llama.cpp's test strings (tests/test-tokenizer-0.cpp)
N_GENERATED = 20000
CONFIG_MAX = 16384  # a larger tokenizer_config.json loses its added_tokens_decoder
XZ_PRESET = 9 | lzma.PRESET_EXTREME

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


# ---------------------------------------------------------------- inputs

def fetch_sdist(tmp):
    """pip download the sdist into tmp and extract the three vocabularies; returns their folder."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    SDIST, "-d", tmp], check=True)
    sdists = [f for f in sorted(os.listdir(tmp)) if f.endswith(".tar.gz")]
    if len(sdists) != 1:
        sys.exit(f"expected one sdist in {tmp}, found {sdists}")
    return extract_models(os.path.join(tmp, sdists[0]), tmp)


def extract_models(sdist, tmp):
    wanted = {f"ggml-vocab-{n}.gguf{ext}" for n in NAMES for ext in ("", ".inp", ".out")}
    dest = os.path.join(tmp, "models")
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            parts = m.name.split("/")
            if (m.isfile() and parts[-1] in wanted
                    and parts[-4:-1] == ["vendor", "llama.cpp", "models"]):
                with tar.extractfile(m) as src, open(os.path.join(dest, parts[-1]), "wb") as dst:
                    shutil.copyfileobj(src, dst)
                wanted.discard(parts[-1])
    if wanted:
        sys.exit(f"{sdist} lacks {sorted(wanted)}")
    return dest


def read_llamacpp(src, name):
    """The .inp strings as test-tokenizer-0.cpp splits them, and the .out id lists."""
    with open(os.path.join(src, f"ggml-vocab-{name}.gguf.inp"), "rb") as f:
        raw = f.read().decode("utf-8")
    texts, pos = [], 0
    while pos < len(raw):
        nxt = raw.find(SEP, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(SEP)
    with open(os.path.join(src, f"ggml-vocab-{name}.gguf.out"), "rb") as f:
        lines = f.read().decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    ids = [[int(t) for t in line.split()] for line in lines]
    assert len(texts) == len(ids), (name, len(texts), len(ids))
    return texts, ids


def convert(src, name, tmp):
    """transformers' conversion of the GGUF; returns the folder save_pretrained wrote."""
    from transformers import AutoTokenizer
    gdir = os.path.join(tmp, f"gguf-{name}")
    os.makedirs(gdir)
    gguf = f"ggml-vocab-{name}.gguf"
    os.symlink(os.path.abspath(os.path.join(src, gguf)), os.path.join(gdir, gguf))
    out = os.path.join(tmp, f"hf-{name}")
    AutoTokenizer.from_pretrained(gdir, gguf_file=gguf).save_pretrained(out)
    return out


def patch_llama3(j):
    """Turns the converted llama-bpe tokenizer.json into LLaMA 3's."""
    j["normalizer"] = None
    j["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False},
        ],
    }
    j["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True}
    j["model"]["ignore_merges"] = True
    j["model"]["byte_fallback"] = False
    return j


# ---------------------------------------------------------------- generated text
# Characters are drawn from blocks that Unicode 3.2 already had, and kept only where their
# general category is the same in Unicode 3.2 and in this Python's tables; the emoji below
# (Unicode 6.0 to 9.0) are listed by hand. Implementations on different Unicode versions
# (Oniguruma's, the normalizer's) then classify and normalize them alike.

def stable(c):
    return (unicodedata.ucd_3_2_0.category(c) != "Cn"
            and unicodedata.ucd_3_2_0.category(c) == unicodedata.category(c)
            and unicodedata.category(c) not in ("Cs", "Co", "Cc"))


def block(lo, hi):
    return [chr(c) for c in range(lo, hi + 1) if stable(chr(c))]


BLOCKS = {
    "latin": block(0x00C0, 0x024F),
    "ipa": block(0x0250, 0x02AF),
    "greek": block(0x0370, 0x03FF),
    "cyrillic": block(0x0400, 0x04FF),
    "armenian": block(0x0531, 0x058A),
    "hebrew": block(0x05D0, 0x05EA),
    "arabic": block(0x0621, 0x064A) + block(0x0660, 0x0669),
    "devanagari": block(0x0900, 0x097F),
    "bengali": block(0x0980, 0x09FF),
    "thai": block(0x0E01, 0x0E5B),
    "georgian": block(0x10A0, 0x10FF),
    "ethiopic": block(0x1200, 0x137C),
    "cjk": block(0x4E00, 0x9FA5),
    "cjk_ext_b": block(0x20000, 0x2A6D6),
    "hiragana": block(0x3041, 0x3096),
    "katakana": block(0x30A1, 0x30FA),
    "hangul": block(0xAC00, 0xD7A3),
    "fullwidth": block(0xFF01, 0xFF5E),
    "math_alnum": block(0x1D400, 0x1D7FF),
    "symbols": block(0x2190, 0x23FF) + block(0x2500, 0x25FF) + block(0x2600, 0x26FF),
    "letterlike": block(0x2100, 0x218F),
    "combining": block(0x0300, 0x036F),
}

WORDS = """the of and to in is was that for it with as on be at by this had not are but from or
have an they which one you were her all she there would their we him been has when who will more
no if out so said what up its about into than them can only other new some could time these two
may then do first any my now such like our over man me even most made after also did many before
must through back years where much your way well down should because each just those people how
too little state good very make world still own see men work long get here between both life
being under never day same another know while last might us great old year off come since against
go came right used take three language model token cache memory disk batch layer weight quick
brown fox jumps lazy dog hello Hello World Paris London Tokyo Monday January OpenAI GPU CPU
""".split()

CONTRACTIONS = ["don't", "I'm", "we've", "they'll", "she'd", "it's", "you're", "can't", "won't",
                "isn't", "y'all", "o'clock", "he's", "I'd", "wouldn't", "let's", "ma'am",
                "rock'n'roll", "don\u2019t", "it\u2019s"]
SUFFIXES = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'VE", "'M", "'LL",
            "'D", "'Re", "'rE", "'Ll", "'lL", "'x", "'"]

SCRIPT_WORDS = {
    "cyrillic": ["привет", "мир", "Москва", "нещо", "на", "Български", "ПРИВЕТ", "ёлка",
                 "Україна", "їжак", "Здравствуйте"],
    "greek": ["Καλημέρα", "κόσμε", "ΑΘΗΝΑ", "λόγος", "ἀρχή", "Ελληνικά", "ψυχή"],
    "arabic": ["مرحبا", "بالعالم", "العربية", "كتاب", "السلام عليكم", "٣٤٥"],
    "hebrew": ["שלום", "עולם", "עברית", "ספר", "תודה"],
    "devanagari": ["नमस्ते", "दुनिया", "हिन्दी", "भारत", "क़िला", "१२३"],
    "thai": ["สวัสดี", "ชาวโลก", "ภาษาไทย", "ขอบคุณ", "กรุงเทพมหานคร"],
    "chinese": ["你好", "世界", "我想在苹果工作", "中文", "汉字", "北京", "謝謝", "天～"],
    "japanese": ["こんにちは", "世界", "カタカナ", "ひらがな", "東京", "ありがとう", "ラーメン",
                 "ｶﾀｶﾅ"],
    "korean": ["안녕하세요", "세계", "한국어", "서울", "감사합니다", "읽다", "닭"],
    "khmer": ["កាន់តែពិសេស", "អាច"],
    "vietnamese": ["Cửa Việt", "Tiếng Việt", "người", "Hà Nội", "được"],
    "latin": ["Führer", "Äpfel", "naïve", "café", "Ångström", "façade", "Straße", "øre", "Łódź",
              "Ærø", "coöperate", "señor", "Dvořák", "İstanbul", "ǅemal", "ﬁnance"],
}

COMBINING = [
    "e\u0301", "\u00e9", "A\u030a", "\u00c5", "\u212b", "o\u0308\u0304", "\u022b",
    "a\u0323\u0302", "a\u0302\u0323", "\u1ead", "\u00e2\u0323", "\u1ea1\u0302",
    "e\u0301\u0301", "\u0301", "\u0301a", "n\u0303", "\u00f1", "u\u0308", "\u00fc",
    "C\u0327", "\u00c7", "s\u0323\u0307", "s\u0307\u0323", "\u1e69", "q\u0307\u0323",
    "\u2126", "\u212a", "\u0344", "\u0958", "\u0915\u093c", "\u1e9b\u0323", "i\u0307",
    "\u0041\u030a\u0301", "\u01fa", "\u0061\u0328\u0301", "\u0065\u0304\u0300",
    "\u0049\u0307", "\u0130", "\u00b4", "\u0308", "\u0627\u0653", "\u0622", "\u304b\u3099",
    "\u304c", "\u30cf\u309a", "\u30d1", "\u0dd9\u0dcf", "\u0b47\u0b3e", "\u1100\u1161\u11a8",
]

EMOJI = ["\U0001F601", "\U0001F602", "\U0001F603", "\U0001F604", "\U0001F605", "\U0001F606",
         "\U0001F609", "\U0001F60A", "\U0001F60D", "\U0001F60E", "\U0001F62D", "\U0001F64F",
         "\U0001F642", "\U0001F914", "\U0001F916", "\U0001F923", "\U0001F951", "\U0001F44D",
         "\U0001F44B", "\U0001F468", "\U0001F469", "\U0001F467", "\U0001F466", "\U0001F4BB",
         "\U0001F525", "\U0001F389", "\U0001F680", "\U0001F30D", "\U0001F40D", "\U0001F431",
         "\U0001F355", "\U0001F308", "\U0001F4AF", "\u2728", "\u2764", "\u2764\ufe0f",
         "\u2615", "\u26a1", "\u2705", "\u274c", "\u263a\ufe0f", "\u2600"]
SKIN = ["\U0001F3FB", "\U0001F3FC", "\U0001F3FD", "\U0001F3FE", "\U0001F3FF"]
ZWJ_SEQ = ["\U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466",
           "\U0001F469\u200d\U0001F4BB", "\U0001F3F3\ufe0f\u200d\U0001F308",
           "\U0001F468\U0001F3FD\u200d\U0001F4BB", "\U0001F469\u200d\u2764\ufe0f\u200d\U0001F468",
           "\U0001F441\u200d\U0001F5E8", "\U0001F46E\u200d\u2640\ufe0f"]
FLAGS = ["US", "JP", "DE", "FR", "BR", "IN", "CN", "KR", "GB", "UA", "EU"]
KEYCAPS = ["1\ufe0f\u20e3", "#\ufe0f\u20e3", "*\u20e3", "0\u20e3"]

SYMBOLS = list("∀∂∃∅∇∈∉∑∏√∞≠≤≥≈⊂⊃∫∮∝∧∨¬⊕⊗ℕℤℝℚℂℵ²³¹¼½¾ⅫⅣ①②⑩°±×÷µ‰€£¥₩¢©®™†‡•‣←→↑↓↔⇒⇔"
               "♠♣♥♦♪♫☀☃☎✓✗✔✘★☆◆○●□■▲△▼�") + [
    "\u20b9", "\U0001D538", "\U0001D7D8", "\U0001D49C", "\U0001D400\U0001D401", "\u2070",
    "\u02b0", "\u3007", "\u3021", "\u16ee", "\U00010330",
]

PUNCT = ["...", "!!!", "?!", "\u2014", "\u2013", "\u00ab\u00bb", "()[]{}", "\u201c\u201d",
         "\u2018\u2019", "''", "``", "\"\"", "---", "===", "***", "###", "@@", "~", "\u2026",
         "\u00bf\u00a1", "\u3001\u3002", "\uff01\uff1f", "\u3010\u3011", "\u300a\u300b", ";;", "::",
         "'''", "\"", "'", "-", "_", "__", "/", "\\", "|", "&", "%", "$", "^", "`", ",", ".", "!",
         "?", "(", ")", "<", ">", "<<", ">>", "......", "!!!!!!", "??????", "=====", "-->", "<!--"]

CODE = [
    "def f(x):\n    return x != 0\n",
    "if (a === b) { return c->d; }",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    "x => x ** 2",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); }",
    "SELECT * FROM users WHERE id = 42 AND name != 'bob';",
    "<div class=\"a\">hi</div>",
    "fn main() -> i32 { 0 }",
    "a &&= b || c ?? d;",
    "x <<= 3; y >>>= 1;",
    "// comment\n/* block */",
    "print(f\"{x!r:>10}\")",
    "    if x:\n        pass\n    else:\n        raise ValueError('bad')",
    "const y = {a: [1, 2, 3], 'b': null};",
    "$ ls -la | grep '\\.c$' > out.txt 2>&1",
    "std::vector<int> v{1,2,3}; v.push_back(4);",
    "\t\treturn (*p)->next;",
    "matrix[i][j] += A[i][k] * B[k][j];",
    "lambda: None",
    "{\"key\": \"value\", \"n\": 3.5e-10}",
    "\\begin{equation} E = mc^2 \\end{equation}",
    "x = y if a else b  # note",
    "@decorator\nclass Foo(Bar):\n    __slots__ = ()",
]

URLS = ["https://example.com/path?q=1&r=two#frag", "http://www.test.org/a_b-c/",
        "user.name+tag@example.co.uk", "ftp://files.example.net/pub/file.tar.gz",
        "mailto:someone@host.org", "https://en.wikipedia.org/wiki/Byte_pair_encoding",
        "www.github.com", "localhost:8080/api/v1/items", "john.doe@mail.example",
        "https://例子.测试/路径", "http://192.168.0.1:80/", "file:///home/user/x.txt"]

BYTE_LIKE = ["<0x41>", "<0x0A>", "<0xFF>", "<0x00>", "<0x>", "<0xZZ>", "<0x4>", "< 0x41>",
             "<0x20>", "<0xE2><0x96><0x81>", "0x41", "<0X41>", "\u2581", "\u2581\u2581", "\u0120",
             "\u010a", "\u0120\u0120"]

WS = [" ", "  ", "   ", "    ", "     ", "      ", "\t", "\t\t", "\n", "\r\n", "\n\n", "\n\n\n",
      " \n  \t", "\u00a0", "\u3000", "\u2009", "\r", "\x0b", "\x0c", " \t", "\t ", "\n ", " \n",
      "\u00a0 ", "\u202f", "\u2002", "\u1680", "\u205f", "\u0085", "\u2028", "\u2029"]
WS_WEIGHTS = [30, 6, 3, 2, 1, 1, 4, 1, 8, 3, 2, 1, 1, 2, 2, 1, 1, 0.3, 0.3, 1, 1, 1, 1, 0.5, 0.3,
              0.3, 0.2, 0.2, 0.2, 0.2, 0.2]

# The Unicode 3.2 filter does not cover these; all are in Unicode 9.0.
LATER = set("".join(EMOJI + SKIN + ZWJ_SEQ + KEYCAPS) + "\u20b9\U0001F441\U0001F5E8\U0001F46E"
            + "".join(chr(c) for c in range(0x1F1E6, 0x1F200)))


def case_variant(rng, s):
    r = rng.random()
    if r < 0.4:
        return s
    if r < 0.55:
        return s.lower()
    if r < 0.7:
        return s.upper()
    if r < 0.95:
        return s[:1].upper() + s[1:]
    return "".join(c.upper() if rng.random() < 0.5 else c.lower() for c in s)


def gen_words(rng, specials):
    n = rng.randint(1, 6)
    words = [case_variant(rng, rng.choice(WORDS)) for _ in range(n)]
    s = " ".join(words)
    if rng.random() < 0.5:
        s = s[:1].upper() + s[1:] + rng.choice([".", "!", "?", ",", ";", ":", "", "..."])
    return s


def gen_contraction(rng, specials):
    r = rng.random()
    if r < 0.5:
        return case_variant(rng, rng.choice(CONTRACTIONS))
    if r < 0.7:  # after digits
        return str(rng.randint(0, 2100)) + rng.choice(SUFFIXES)
    if r < 0.85:  # at the start, or alone
        return rng.choice(SUFFIXES) + rng.choice(["", " ", "x", " go", "s", "'"])
    return case_variant(rng, rng.choice(WORDS)) + rng.choice(SUFFIXES)


def digits(rng, n):
    return "".join(rng.choice("0123456789") for _ in range(n))


def gen_number(rng, specials):
    r = rng.random()
    if r < 0.4:
        return digits(rng, rng.randint(1, 12))
    if r < 0.55:
        return f"{rng.randint(0, 10 ** rng.randint(1, 12)):,}"
    if r < 0.65:
        return digits(rng, rng.randint(1, 6)) + "." + digits(rng, rng.randint(1, 8))
    if r < 0.75:
        return f"{rng.randint(1900, 2099)}-{rng.randint(1, 12):02d}-{rng.randint(1, 31):02d}"
    if r < 0.82:
        return "-".join(digits(rng, rng.randint(1, 4)) for _ in range(rng.randint(2, 4)))
    if r < 0.88:
        return rng.choice(["+", "-", "$", "#", "\u20ac", "~"]) + digits(rng, rng.randint(1, 9))
    if r < 0.94:
        return (digits(rng, rng.randint(1, 3)) + rng.choice([",", ".", " ", "\u00a0", "'"])
                + digits(rng, 3) + rng.choice(["", ",", "."]) + digits(rng, rng.randint(0, 3)))
    other = rng.choice(["\u0660", "\u06f0", "\u0966", "\u09e6", "\u0e50", "\uff10", "\U0001D7CE"])
    return "".join(chr(ord(other) + rng.randint(0, 9)) for _ in range(rng.randint(1, 7)))


def gen_ws(rng, specials):
    return "".join(rng.choices(WS, WS_WEIGHTS)[0] for _ in range(rng.randint(1, 3)))


def gen_script(rng, specials):
    if rng.random() < 0.75:
        words = SCRIPT_WORDS[rng.choice(sorted(SCRIPT_WORDS))]
        return " ".join(rng.choice(words) for _ in range(rng.randint(1, 4)))
    chars = BLOCKS[rng.choice(["latin", "ipa", "greek", "cyrillic", "armenian", "hebrew",
                               "arabic", "devanagari", "bengali", "thai", "georgian", "ethiopic",
                               "cjk", "cjk", "cjk_ext_b", "hiragana", "katakana", "hangul",
                               "fullwidth", "math_alnum"])]
    return "".join(rng.choice(chars) for _ in range(rng.randint(1, 6)))


def gen_hangul(rng, specials):
    r = rng.random()
    syl = "".join(rng.choice(BLOCKS["hangul"]) for _ in range(rng.randint(1, 5)))
    if r < 0.3:
        return syl
    if r < 0.6:
        return unicodedata.normalize("NFD", syl)  # conjoining jamo, U+1100..
    if r < 0.8:
        out = []
        for _ in range(rng.randint(1, 4)):
            out.append(chr(0x1100 + rng.randint(0, 18)) + chr(0x1161 + rng.randint(0, 20)))
            if rng.random() < 0.5:
                out.append(chr(0x11A8 + rng.randint(0, 26)))
        return "".join(out)
    # partial sequences: a lone L or V or T, an LV syllable followed by a T jamo, L L V
    pick = rng.choice([chr(0x1100 + rng.randint(0, 18)), chr(0x1161 + rng.randint(0, 20)),
                       chr(0x11A8 + rng.randint(0, 26)), "\uac00\u11a8", "\uac01\u11a8",
                       "\u1100\u1100\u1161", "\u1161\u11a8", "\uac00\u1161"])
    return pick


def gen_combining(rng, specials):
    r = rng.random()
    if r < 0.5:
        return "".join(rng.choice(COMBINING) for _ in range(rng.randint(1, 3)))
    base = rng.choice("aeiouAEIOUnNcCsSzZyY" + "\u03b1\u0430\u05d0")
    marks = "".join(rng.choice(BLOCKS["combining"]) for _ in range(rng.randint(1, 3)))
    s = base + marks
    return unicodedata.normalize("NFC", s) if rng.random() < 0.3 else s


def gen_emoji(rng, specials):
    r = rng.random()
    if r < 0.35:
        return "".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 3)))
    if r < 0.55:
        return rng.choice(["\U0001F44D", "\U0001F44B", "\U0001F468", "\U0001F469"]) + rng.choice(SKIN)
    if r < 0.75:
        return rng.choice(ZWJ_SEQ)
    if r < 0.9:
        flag = rng.choice(FLAGS)
        return "".join(chr(0x1F1E6 + ord(c) - ord("A")) for c in flag)
    return rng.choice(KEYCAPS)


def gen_symbol(rng, specials):
    return "".join(rng.choice(SYMBOLS) for _ in range(rng.randint(1, 4)))


def gen_punct(rng, specials):
    return "".join(rng.choice(PUNCT) for _ in range(rng.randint(1, 3)))


def gen_code(rng, specials):
    return rng.choice(CODE)


def gen_url(rng, specials):
    return rng.choice(URLS)


def gen_special(rng, specials):
    pieces = []
    for _ in range(rng.randint(1, 3)):
        pieces.append(rng.choice(specials))
        pieces.append(rng.choice(["", "", " ", "  ", "\n", "x", "Hello", " world "]))
    return "".join(pieces)


def gen_byte_like(rng, specials):
    return rng.choice(BYTE_LIKE)


GENERATORS = [(gen_words, 20), (gen_contraction, 8), (gen_number, 8), (gen_ws, 6),
              (gen_script, 14), (gen_hangul, 3), (gen_combining, 5), (gen_emoji, 4),
              (gen_symbol, 3), (gen_punct, 5), (gen_code, 3), (gen_url, 2), (gen_special, 4),
              (gen_byte_like, 1)]


def check_chars(text):
    for c in text:
        assert c in LATER or stable(c) or c in "\t\n\r\x0b\x0c\x85", (text, hex(ord(c)))


for _s in (WORDS + CONTRACTIONS + SUFFIXES + sum(SCRIPT_WORDS.values(), []) + COMBINING + EMOJI
           + SKIN + ZWJ_SEQ + KEYCAPS + SYMBOLS + PUNCT + CODE + URLS + BYTE_LIKE + WS):
    check_chars(_s)


LOW_ENTROPY = [(gen_words, 20), (gen_contraction, 4), (gen_ws, 6), (gen_punct, 3), (gen_code, 4),
               (gen_url, 1), (gen_special, 1)]


def gen_long(rng, specials):
    """200 to 2000 characters: a short piece repeated, or text of the less random kinds."""
    length = int(math.exp(rng.uniform(math.log(200), math.log(2000))))
    fns, weights = zip(*GENERATORS)
    if rng.random() < 0.85:
        piece = rng.choices(fns, weights)[0](rng, specials)[:rng.randint(1, 20)] or "a"
        out = piece * (length // len(piece) + 1)
    else:
        fns, weights = zip(*LOW_ENTROPY)
        out = ""
        while len(out) < length:
            out += rng.choices(fns, weights)[0](rng, specials) + rng.choice(["", " ", " ", "\n"])
    return out[:length]


def gen_line(rng, specials):
    r = rng.random()
    if r < 0.02:  # empty or whitespace only
        return "" if rng.random() < 0.15 else gen_ws(rng, specials)
    if r < 0.03:
        return gen_long(rng, specials)
    # 1..200 characters, most under 12 (each line costs its ids, whatever its length)
    top = 12 if rng.random() < 0.93 else 200
    length = int(math.exp(rng.uniform(0, math.log(top))))
    fns, weights = zip(*GENERATORS)
    if rng.random() < 0.3:  # one kind only
        fns, weights = [rng.choices(fns, weights)[0]], [1]
    out = ""
    if rng.random() < 0.1:
        out += gen_ws(rng, specials)
    while len(out) < length:
        out += rng.choices(fns, weights)[0](rng, specials)
        if len(out) < length:
            out += rng.choices(["", " ", None], [2, 10, 2])[0] or gen_ws(rng, specials)
    out = out[:length]
    if rng.random() < 0.1:
        out += gen_ws(rng, specials)
    r = rng.random()
    if r < 0.03:  # a special token at either end
        out = rng.choice(specials) + rng.choice(["", " "]) + out
    elif r < 0.06:
        out = out + rng.choice(["", " "]) + rng.choice(specials)
    return out


def generated(name, specials, exclude):
    rng = random.Random(f"tokenizer-json-{name}")
    seen = set(exclude)
    texts = []
    while len(texts) < N_GENERATED:
        t = gen_line(rng, specials)
        if t in seen:
            continue
        check_chars(t)
        seen.add(t)
        texts.append(t)
    return texts


def specials_of(name, tok_json):
    added = [a["content"] for a in tok_json["added_tokens"]]
    if name == "llama-bpe":
        want = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|reserved_special_token_5|>",
                "<|reserved_special_token_247|>", "<|reserved_special_token_0|>"]
        near = ["<|eot_id|", "<|begin_of_text>", "<|EOT_ID|>", "<|reserved_special_token_|>",
                "<|reserved_special_token_251|>", "|>", "<|"]
    elif name == "qwen2":
        want = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        near = ["<|im_start|", "<|im_start>", "<|IM_END|>", "<|endoftext|>>", "<|", "|>"]
    else:
        want = ["<s>", "</s>", "<unk>"]
        near = ["<s >", "< s>", "<S>", "</s", "<unk", "<pad>", "<<s>>"]
    for t in want:
        assert t in added, (name, t)
    return want * 3 + near


# ---------------------------------------------------------------- output

def xz(data):
    return lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=XZ_PRESET)


def jsonl_line(obj):
    s = json.dumps(obj, ensure_ascii=False)
    # Lines stay lines for readers that split on Unicode line breaks too.
    for c in ("\u0085", "\u2028", "\u2029"):
        s = s.replace(c, "\\u%04x" % ord(c))
    return s + "\n"


def make(name, src, tmp, sizes):
    from tokenizers import Tokenizer
    dest = os.path.join(OUT, name)
    os.makedirs(dest, exist_ok=True)
    hf = convert(src, name, tmp)
    with open(os.path.join(hf, "tokenizer.json"), "rb") as f:
        data = f.read()
    converted = Tokenizer.from_str(data.decode("utf-8"))
    tok_json = json.loads(data)
    if name == "llama-bpe":
        data = Tokenizer.from_str(json.dumps(patch_llama3(tok_json))).to_str(pretty=True).encode()
        tok_json = json.loads(data)
    ref_path = os.path.join(tmp, f"{name}.tokenizer.json")
    with open(ref_path, "wb") as f:
        f.write(data)
    tok = Tokenizer.from_file(ref_path)

    files = {"tokenizer.json.xz": xz(data)}
    with open(os.path.join(hf, "tokenizer_config.json"), "rb") as f:
        cfg = f.read()
    if len(cfg) > CONFIG_MAX:
        c = json.loads(cfg)
        del c["added_tokens_decoder"]
        cfg = (json.dumps(c, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()
    files["tokenizer_config.json"] = cfg
    for ext in ("inp", "out"):
        with open(os.path.join(src, f"ggml-vocab-{name}.gguf.{ext}"), "rb") as f:
            files[f"llamacpp.{ext}"] = f.read()

    # llama.cpp's expectations against the reference
    inp, exp = read_llamacpp(src, name)
    agree = [tok.encode(t, add_special_tokens=False).ids == e for t, e in zip(inp, exp)]
    print(f"{name}: {sum(agree)} of {len(inp)} llama.cpp strings agree with the reference "
          f"(encode(text, add_special_tokens=False))")
    for t, e, ok in zip(inp, exp, agree):
        if not ok:
            print(f"  {t!r}\n    reference {tok.encode(t, add_special_tokens=False).ids}\n"
                  f"    llama.cpp {e}")
    with_bos = sum(tok.encode(t, add_special_tokens=True).ids == e for t, e in zip(inp, exp))
    bos = tok.encode("", add_special_tokens=True).ids  # what the post-processor adds
    led = sum(bool(bos) and e[:len(bos)] == bos for e in exp)
    print(f"  with add_special_tokens=True (adds {bos}): {with_bos} of {len(inp)} agree; "
          f"{led} of llama.cpp's id lists start with {bos}")
    if name == "llama-bpe":
        n = sum(converted.encode(t, add_special_tokens=False).ids == e for t, e in zip(inp, exp))
        print(f"  unpatched conversion: {n} of {len(inp)} agree, {len(inp) - n} disagree")

    texts = inp + generated(name, specials_of(name, tok_json), inp)
    lines, n_decoded = [], 0
    for t in texts:
        ids = tok.encode(t, add_special_tokens=False).ids
        obj = {"text": t, "ids": ids}
        d = tok.decode(ids, skip_special_tokens=False)
        if d != t:
            obj["decoded"] = d
            n_decoded += 1
        lines.append(jsonl_line(obj))
    files["cases.jsonl.xz"] = xz("".join(lines).encode("utf-8"))
    print(f"  cases: {len(texts)} lines, {n_decoded} with \"decoded\"")

    for fname, content in files.items():
        with open(os.path.join(dest, fname), "wb") as f:
            f.write(content)
        sizes[f"{name}/{fname}"] = len(content)


README = """\
Fixtures for tokenizer.json (HF tokenizers' format), one directory per vocabulary:
  llama-spm/  LLaMA 2: SentencePiece-style BPE on U+2581 with byte fallback
  llama-bpe/  LLaMA 3: byte-level BPE, Split regex with \\p{N}{1,3}, ignore_merges
  qwen2/      Qwen2: byte-level BPE behind an NFC normalizer
Each holds:
  tokenizer.json.xz      the tokenizer.json (xz -9e), converted by HF transformers from
                         llama.cpp's vocab-only ggml-vocab-NAME.gguf; llama-bpe's is patched
                         into LLaMA 3's own pre-tokenizer, model options and decoder
  tokenizer_config.json  as transformers' save_pretrained wrote it (llama-bpe's without
                         added_tokens_decoder, whose tokens are tokenizer.json's added_tokens)
  llamacpp.inp           llama.cpp's test strings, separated by lines __ggml_vocab_test__
  llamacpp.out           the ids llama.cpp expects for them, one line per string, without BOS
  cases.jsonl.xz         JSON Lines (xz -9e): {"text", "ids"} with the ids of
                         tokenizers.Tokenizer encode(text, add_special_tokens=False), and
                         "decoded", decode(ids, skip_special_tokens=False), where that is not
                         the text; the llama.cpp strings first, then generated text
Beside them, nfc-cases.txt.xz: "input hex<TAB>NFC hex" lines from Python's unicodedata, written by
  python3 scripts/gen_nfc_cases.py --fixture
The directories are made, deterministically, from the repository root by
  python3 scripts/make_tokenizer_json_fixture.py [DIR]   (transformers 4.46, tokenizers 0.20, gguf)
with DIR holding ggml-vocab-NAME.gguf{,.inp,.out} (by default taken from llama-cpp-python
0.3.36's sdist, vendor/llama.cpp/models/).
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", nargs="?",
                    help="folder with ggml-vocab-NAME.gguf{,.inp,.out} (default: from the sdist)")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    sizes = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.abspath(args.dir) if args.dir else fetch_sdist(tmp)
        for name in NAMES:
            make(name, src, tmp, sizes)
    with open(os.path.join(OUT, "README"), "w") as f:
        f.write(README)
    sizes["README"] = len(README.encode())
    for k, v in sizes.items():
        print(f"{v:>10}  {os.path.relpath(os.path.join(OUT, k), ROOT)}")
    print(f"{sum(sizes.values()):>10}  total")


if __name__ == "__main__":
    main()
