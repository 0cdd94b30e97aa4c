#!/usr/bin/env python3
"""Writes the test cases of tests/nfc_check.c: one line per case, `INPUT_HEX\tEXPECTED_HEX`, the
input's UTF-8 bytes and their NFC form (Python's unicodedata.normalize) as hex.

Cases (seeded, so the file is the same every run):
  - every code point alone (surrogates skipped);
  - NormalizationTest-like sequences: starters followed by combining marks of many classes in
    random orders, the NFD forms of every primary composite with marks around them, Hangul
    syllables and conjoining jamo (every L V and L V T, and broken sequences), characters with
    singleton decompositions (U+212B ANGSTROM SIGN, U+2126 OHM SIGN, ...) and composition
    exclusions (U+0958 ...), alone and with marks;
  - random strings over a mix of all of the above and random code points;
  - byte strings with invalid UTF-8 in them: the expected form treats each invalid byte as a
    starter that never composes, so it is NFC of the valid stretches between them, bytes kept.

Run from the repository root:
    python3 scripts/gen_nfc_cases.py [OUT]     (OUT: /tmp/nfc_cases.txt, all 1.3 million cases)
    python3 scripts/gen_nfc_cases.py --fixture (tests/fixtures/tokenizers/nfc-cases.txt.xz: the
                                                empty string, then 10,000 cases NFC changes and
                                                2,000 it keeps, drawn from them)
"""
import argparse
import random
import re
import subprocess
import unicodedata as ud

SEED = 15
RANDOM_STRINGS = 100_000
INVALID_STRINGS = 20_000
L_BASE, V_BASE, T_BASE, S_BASE = 0x1100, 0x1161, 0x11A7, 0xAC00
ESCAPED = re.compile("[\udc80-\udcff]")  # invalid bytes, as surrogateescape decodes them


def nfc_bytes(raw):
    """NFC of raw UTF-8 bytes, each invalid byte kept as an uncomposing starter."""
    text = raw.decode("utf-8", "surrogateescape")
    parts, pos = [], 0
    for m in ESCAPED.finditer(text):
        parts += [ud.normalize("NFC", text[pos:m.start()]), m.group()]
        pos = m.end()
    parts.append(ud.normalize("NFC", text[pos:]))
    return "".join(parts).encode("utf-8", "surrogateescape")


def code_point_pools():
    valid = [cp for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF]
    marks = [cp for cp in valid if ud.combining(chr(cp))]
    decomposable = [cp for cp in valid if ud.decomposition(chr(cp)) and
                    not ud.decomposition(chr(cp)).startswith("<")]
    singletons = [cp for cp in decomposable if len(ud.decomposition(chr(cp)).split()) == 1]
    excluded = [cp for cp in decomposable if len(ud.decomposition(chr(cp)).split()) == 2 and
                ud.normalize("NFC", chr(cp)) != chr(cp)]
    not_primary = set(singletons) | set(excluded)
    composites = [cp for cp in decomposable if cp not in not_primary]
    starters = sorted({ord(ud.normalize("NFD", chr(cp))[0]) for cp in composites})
    jamo = list(range(0x1100, 0x1113)) + list(range(0x1161, 0x1176)) + list(range(0x11A7, 0x11C3))
    syllables = [S_BASE + i for i in range(0, 11172, 7)]
    return dict(valid=valid, marks=marks, singletons=singletons, excluded=excluded,
                composites=composites, starters=starters, jamo=jamo, syllables=syllables,
                latin=[cp for cp in range(0x41, 0x250) if chr(cp).isalpha()],
                greek=list(range(0x370, 0x400)) + list(range(0x1F00, 0x2000)),
                cyrillic=list(range(0x400, 0x530)))


def hangul_cases():
    out = []
    for l in range(19):
        for v in range(21):
            out.append([L_BASE + l, V_BASE + v])
            out += [[L_BASE + l, V_BASE + v, T_BASE + t] for t in range(1, 28)]
    lv, lvt = S_BASE, S_BASE + 5
    out += [[lv, T_BASE + 3], [lvt, T_BASE + 3], [lv, T_BASE], [lv, V_BASE], [L_BASE, L_BASE, V_BASE],
            [V_BASE, T_BASE + 1], [L_BASE, T_BASE + 1], [L_BASE, 0x301, V_BASE],
            [lv, 0x301, T_BASE + 1], [L_BASE + 19, V_BASE], [L_BASE, V_BASE + 21], [lv, T_BASE + 28],
            [T_BASE, V_BASE], [L_BASE - 1, V_BASE], [L_BASE, V_BASE - 1], [S_BASE + 11171, T_BASE + 1],
            [S_BASE - 1, T_BASE + 1]]
    return out


def structured_cases(pools, rng):
    out = [[cp] for cp in pools["valid"]]
    out += hangul_cases()
    for cp in pools["composites"] + pools["singletons"] + pools["excluded"]:
        nfd = [ord(c) for c in ud.normalize("NFD", chr(cp))]
        out += [nfd, [cp, rng.choice(pools["marks"])], nfd + rng.sample(pools["marks"], 2),
                [nfd[0]] + rng.sample(pools["marks"], 3) + nfd[1:]]
    for cp in [0x212B, 0x2126, 0x212A, 0x0958, 0x0959, 0x2ADC, 0x1D15E, 0x0344, 0x0F73, 0x0F75]:
        out += [[cp], [cp, 0x301], [0x41, cp], [0x41, 0x30A, cp], [cp, 0x323, 0x30A]]
    for _ in range(50_000):  # a starter, then marks of mixed classes in a random order
        base = rng.choice(pools["starters"] + pools["composites"] + pools["syllables"])
        marks = [rng.choice(pools["marks"]) for _ in range(rng.randint(1, 5))]
        out.append([base] + marks + ([rng.choice(pools["starters"])] if rng.random() < 0.3 else []))
    return out


def random_strings(pools, rng):
    names = list(pools)
    for _ in range(RANDOM_STRINGS):
        yield [rng.choice(pools[rng.choice(names)]) for _ in range(rng.randint(1, 12))]


def invalid_strings(pools, rng):
    bad = [b"\xff", b"\xfe", b"\xc0", b"\xc1\x81", b"\x80", b"\xbf", b"\xcc", b"\xe0\x80\x80",
           b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xf0\x9f", b"\xe1\x84", b"\xcc\xcc\x81"]
    for _ in range(INVALID_STRINGS):
        raw = b""
        for _ in range(rng.randint(1, 8)):
            if rng.random() < 0.3:
                raw += rng.choice(bad)
            else:
                pool = pools[rng.choice(["marks", "starters", "jamo", "composites"])]
                raw += chr(rng.choice(pool)).encode()
        yield raw


def all_cases():
    rng = random.Random(SEED)
    pools = code_point_pools()
    cases = [bytes("".join(map(chr, cps)), "utf-8") for cps in structured_cases(pools, rng)]
    cases += [bytes("".join(map(chr, cps)), "utf-8") for cps in random_strings(pools, rng)]
    cases += list(invalid_strings(pools, rng))
    return [(raw, nfc_bytes(raw)) for raw in cases]


def main():
    ap = argparse.ArgumentParser(description="Writes the NFC test cases of tests/nfc_check.c.")
    ap.add_argument("out", nargs="?", help="the file of all cases [/tmp/nfc_cases.txt]")
    ap.add_argument("--fixture", action="store_true",
                    help="write the sample of tests/fixtures/tokenizers/nfc-cases.txt.xz instead")
    args = ap.parse_args()
    if args.fixture and args.out:
        ap.error("--fixture writes tests/fixtures/tokenizers/nfc-cases.txt.xz; give no OUT with it")
    fixture = args.fixture
    path = "tests/fixtures/tokenizers/nfc-cases.txt" if fixture else (args.out or "/tmp/nfc_cases.txt")
    cases = all_cases()
    if fixture:
        rng = random.Random(SEED + 1)
        changed = [c for c in cases if c[0] != c[1]]
        kept = [c for c in cases if c[0] == c[1]]
        cases = rng.sample(changed, 10_000) + rng.sample(kept, 2_000)
    with open(path, "w") as f:
        f.write("\t\n")  # the empty string
        for raw, nfc in cases:
            f.write(f"{raw.hex()}\t{nfc.hex()}\n")
    print(f"{path}: {len(cases) + 1} cases (Unicode {ud.unidata_version})")
    if fixture:
        subprocess.run(["xz", "-9e", "-f", path], check=True)


if __name__ == "__main__":
    main()
