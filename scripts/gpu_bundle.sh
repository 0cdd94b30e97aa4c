#!/usr/bin/env bash
# Writes one directory with everything that the first run of the CUDA backend needs on a GPU
# machine that has no network and no package registry (docs/GPU.md, "Without a network"); run it
# where Debian's packages and PyPI can be reached, on Debian 12 (x86-64; its libraries need
# glibc 2.34 or newer), then carry DIR over and run there
#   bash scripts/gpu_check.sh --bundle DIR       (or scripts/gpu_first_run.sh --bundle DIR)
# DIR holds:
#   debs/    the Debian packages of the build and the tests: OpenBLAS's OpenMP build, cJSON,
#            CUnit and GLPK, each with its -dev, and the libraries they need that a CUDA image
#            may lack (libgfortran5, GLPK's libamd2, ...), from `apt-cache depends`;
#            gpu_first_run.sh unpacks them into a private prefix and builds with `make DEPS=`
#   wheels/  FlexGen's Python package (flexgen 0.1.8, module `flexgen`), and the wheels WHEELS
#            names; installed with `pip install --no-index --no-deps --target`
#   hf/      a Hugging Face cache (HF_HOME) holding a tokenizer under the repo id
#            facebook/opt-30b, which FlexGen loads even with dummy weights: models/opt-kjv's BPE
#            (a 4,096-token vocabulary with OPT's special tokens), not OPT's own; with dummy
#            weights only the token ids' range matters, so the throughput does not change
#   README.md  the contents, their sizes and the tokenizer's caveat
#   MANIFEST   the sha256 of every other file (`sha256sum -c MANIFEST` checks them)
# It writes DIR.tmp and renames it to DIR at the end, so a failed download leaves no DIR; an
# existing bundle DIR is replaced. The total size is printed last, and must stay under 64 MiB.
# `unpack` (gpu_first_run.sh and check_bundle.sh use it; no network, no root) checks a bundle
# against its MANIFEST and unpacks it into PREFIX: the packages with `dpkg-deb -x` (or Python's
# tarfile where dpkg-deb is missing), so that `make DEPS=PREFIX` builds against them, and the
# wheels into PREFIX/python, for PYTHONPATH.
#
# Usage: bash scripts/gpu_bundle.sh DIR
#        bash scripts/gpu_bundle.sh unpack DIR PREFIX
#        bash scripts/gpu_bundle.sh prefix DIR   (gpu_first_run.sh's and gpu_check.sh's --bundle)
# Environment:
#   WHEELS  more pip requirements to bundle as wheels, beside flexgen==0.1.8 [none]; e.g.
#           WHEELS=pulp (FlexGen's own policy search, experimental/cost_model.py, 16 MB;
#           flexgen.flex_opt does not import it)
#   PYTHON  a Python whose pip downloads the wheels, and which, where it imports transformers,
#           loads the bundled tokenizer offline as a check [python3]
set -euo pipefail

die() { echo "gpu_bundle.sh: $*" >&2; exit 1; }
PYTHON=${PYTHON:-python3}

is_bundle() { # DIR: fails with one line unless DIR is a bundle
    [ -d "$1" ] || die "no directory $1"
    if [ ! -f "$1/MANIFEST" ] || [ ! -d "$1/debs" ] || [ ! -d "$1/wheels" ] || [ ! -d "$1/hf/hub" ]; then
        die "$1 is not a bundle of scripts/gpu_bundle.sh (no MANIFEST, debs/, wheels/ or hf/hub/)"
    fi
}

unpack_deb() { # DEB PREFIX: its files under PREFIX, as `dpkg-deb -x` puts them
    if command -v dpkg-deb > /dev/null; then
        dpkg-deb -x "$1" "$2"
        return
    fi
    "$PYTHON" - "$1" "$2" <<'PY'
import io, sys, tarfile
data = open(sys.argv[1], "rb").read()
assert data.startswith(b"!<arch>\n"), "not a .deb"
pos = 8
while pos < len(data):  # the ar archive's members: debian-binary, control.tar.*, data.tar.*
    name, size = data[pos:pos + 16].decode().strip().rstrip("/"), int(data[pos + 48:pos + 58])
    if name.startswith("data.tar"):
        tarfile.open(fileobj=io.BytesIO(data[pos + 60:pos + 60 + size])).extractall(sys.argv[2])
        break
    pos += 60 + size + size % 2
else:
    sys.exit("no data.tar in " + sys.argv[1])
PY
}

# `prefix DIR`: the bundle unpacked once into a prefix that the binaries' DT_RPATH names (so it
# stays where it is for later commands), with its tokenizer cache copied where the hub may write;
# prints the prefix (BUNDLE_PREFIX, or /tmp/flexgen-bundle-<the MANIFEST's hash>).
if [ "${1:-}" = prefix ]; then
    [ $# = 2 ] || die "usage: bash scripts/gpu_bundle.sh prefix DIR"
    is_bundle "$2"
    BUNDLE=$(cd "$2" && pwd)
    PREFIX=${BUNDLE_PREFIX:-/tmp/flexgen-bundle-$(sha256sum "$BUNDLE/MANIFEST" | cut -c1-12)}
    if [ ! -f "$PREFIX/MANIFEST" ] || ! cmp -s "$BUNDLE/MANIFEST" "$PREFIX/MANIFEST"; then
        rm -rf "$PREFIX"
        bash "$0" unpack "$BUNDLE" "$PREFIX" >&2 || { rm -rf "$PREFIX"; exit 1; }
        # the MANIFEST last: a prefix without it is unpacked again
        if ! cp -R "$BUNDLE/hf" "$PREFIX/hf" || ! cp "$BUNDLE/MANIFEST" "$PREFIX/MANIFEST"; then
            rm -rf "$PREFIX"
            die "cannot copy the bundle's files into $PREFIX"
        fi
    fi
    echo "$PREFIX"
    exit 0
fi

if [ "${1:-}" = unpack ]; then
    [ $# = 3 ] || die "usage: bash scripts/gpu_bundle.sh unpack DIR PREFIX"
    BUNDLE=$2 PREFIX=$3
    is_bundle "$BUNDLE"
    if command -v sha256sum > /dev/null; then
        bad=$(cd "$BUNDLE" && sha256sum -c --quiet MANIFEST 2>&1) || die "$BUNDLE does not match its MANIFEST: $(echo "$bad" | head -n 1)"
    fi
    mkdir -p "$PREFIX" || die "cannot make $PREFIX"
    n=0
    for deb in "$BUNDLE"/debs/*.deb; do
        unpack_deb "$deb" "$PREFIX" || die "cannot unpack $deb"
        n=$((n + 1))
    done
    for h in cjson/cJSON.h CUnit/Basic.h glpk.h; do
        [ -f "$PREFIX/usr/include/$h" ] || die "the bundle's packages have no $h"
    done
    # pure Python wheels: pip where there is one, else unzipped as they are
    if "$PYTHON" -m pip --version > /dev/null 2>&1; then
        PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --target "$PREFIX/python" "$BUNDLE"/wheels/*.whl ||
            die "pip cannot install the bundle's wheels into $PREFIX/python"
    else
        "$PYTHON" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
            "$PREFIX/python" "$BUNDLE"/wheels/*.whl || die "cannot unzip the bundle's wheels into $PREFIX/python"
    fi
    echo "unpacked $n packages into $PREFIX (make DEPS=$PREFIX), the wheels into $PREFIX/python (PYTHONPATH)"
    exit 0
fi

[ $# = 1 ] || die "usage: bash scripts/gpu_bundle.sh DIR (one directory to write)"
case $1 in -*) die "unknown flag '$1'; usage: bash scripts/gpu_bundle.sh DIR" ;; esac
DIR=${1%/}
[ -n "$DIR" ] || die "DIR is empty"
if [ -e "$DIR" ] && [ ! -f "$DIR/MANIFEST" ]; then
    die "$DIR exists and is not a bundle (no MANIFEST): name a new directory"
fi
for tool in apt-get apt-cache dpkg-deb sha256sum "$PYTHON"; do
    command -v "$tool" > /dev/null || die "$tool not found (this runs on Debian 12, with pip)"
done
"$PYTHON" -m pip --version > /dev/null 2>&1 || die "$PYTHON has no pip"
[ "$(dpkg --print-architecture)" = amd64 ] || die "the packages must be amd64 (x86-64), this is $(dpkg --print-architecture)"
# shellcheck disable=SC1091
CODENAME=$(. /etc/os-release && echo "${VERSION_CODENAME:-unknown}")
[ "$CODENAME" = bookworm ] ||
    echo "gpu_bundle.sh: warning: this is $CODENAME, not Debian 12 (bookworm): its packages may need a newer glibc than the GPU machine has" >&2

ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$(dirname "$DIR")"
DIR=$(cd "$(dirname "$DIR")" && pwd)/$(basename "$DIR")
TMP=$DIR.tmp
rm -rf "$TMP"
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/debs" "$TMP/wheels"

# ---- the Debian packages: the -dev packages of the build and the tests, and, from
# `apt-cache depends`, what they depend on, leaving out what any machine with gcc has (glibc,
# libgcc, libstdc++, libgomp, zlib) and the -dev packages that only static linking needs
# (libglpk-dev's libgmp-dev, zlib1g-dev and libsuitesparse-dev: -lglpk links the shared library)
ROOTS="libopenblas-openmp-dev libcjson-dev libcunit1-dev libglpk-dev libsimde-dev"
PRESENT=" libc6 libgcc-s1 gcc-12-base libgomp1 libstdc++6 zlib1g libgmp-dev zlib1g-dev libsuitesparse-dev "

depends() { # PACKAGE: its Depends and Pre-Depends, the first of each group of alternatives
    apt-cache depends --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces \
        --no-enhances "$1" | awk '
        alt { alt = ($1 ~ /^\|/); next }
        $1 ~ /^\|?(Pre)?Depends:$/ { print $2; alt = ($1 ~ /^\|/) }'
}

PACKAGES=()
read -r -a queue <<< "$ROOTS"
while [ ${#queue[@]} -gt 0 ]; do
    p=${queue[0]}
    queue=("${queue[@]:1}")
    case " $PRESENT ${PACKAGES[*]} " in *" $p "*) continue ;; esac
    apt-cache show "$p" > /dev/null 2>&1 || die "apt knows no package $p (run apt-get update first)"
    case $p in "<"*) die "$p is a virtual package: name a real one in ROOTS" ;; esac
    PACKAGES+=("$p")
    read -r -a deps <<< "$(depends "$p" | tr '\n' ' ')"
    queue+=("${deps[@]}")
done
echo "== ${#PACKAGES[@]} Debian packages: ${PACKAGES[*]}"
sandbox=()
[ "$(id -u)" = 0 ] && sandbox=(-o APT::Sandbox::User=root)
(cd "$TMP/debs" && apt-get download -q "${sandbox[@]}" "${PACKAGES[@]}" > "$TMP/apt.log" 2>&1) ||
    die "apt-get download failed: $(grep -m 1 -E '^(E|Err):' "$TMP/apt.log" || tail -n 1 "$TMP/apt.log")"
rm -f "$TMP/apt.log"
n=$(find "$TMP/debs" -name '*.deb' | wc -l)
[ "$n" = ${#PACKAGES[@]} ] || die "apt-get download wrote $n .deb files for ${#PACKAGES[@]} packages"

# ---- the wheels: pure Python, for the GPU machine's Python 3.12
echo "== wheels: flexgen==0.1.8 ${WHEELS:-}"
# shellcheck disable=SC2086
"$PYTHON" -m pip download -q --no-deps --only-binary :all: --python-version 3.12 -d "$TMP/wheels" \
    flexgen==0.1.8 ${WHEELS:-} > "$TMP/pip.log" 2>&1 ||
    die "pip download failed: $(grep -m 1 -E 'ERROR' "$TMP/pip.log" || tail -n 1 "$TMP/pip.log")"
rm -f "$TMP/pip.log"
for w in "$TMP"/wheels/*; do
    case $w in *-none-any.whl) ;; *) die "$(basename "$w") is not a pure Python wheel" ;; esac
done

# ---- the tokenizer, laid out as the Hugging Face cache holds a repo: refs/main names a commit,
# snapshots/COMMIT holds the files. config.json is OPT-30B's shape (support/checkpoint.c); the
# tokenizer is models/opt-kjv's, with OPT's context length.
echo "== tokenizer: models/opt-kjv's, as facebook/opt-30b"
REPO=$TMP/hf/hub/models--facebook--opt-30b
mkdir -p "$REPO/refs" "$REPO/snapshots/new"
cp "$ROOT/models/opt-kjv/vocab.json" "$ROOT/models/opt-kjv/merges.txt" \
    "$ROOT/models/opt-kjv/special_tokens_map.json" "$REPO/snapshots/new/"
"$PYTHON" - "$ROOT/models/opt-kjv/tokenizer_config.json" "$REPO/snapshots/new" <<'PY' || die "cannot write the tokenizer's files"
import json, sys
tok = json.load(open(sys.argv[1]))
tok["model_max_length"] = 2048
json.dump(tok, open(sys.argv[2] + "/tokenizer_config.json", "w"), indent=2)
config = {
    "architectures": ["OPTForCausalLM"], "model_type": "opt", "activation_function": "relu",
    "hidden_size": 7168, "word_embed_proj_dim": 7168, "ffn_dim": 28672, "num_hidden_layers": 48,
    "num_attention_heads": 56, "max_position_embeddings": 2048, "vocab_size": 50272,
    "do_layer_norm_before": True, "enable_bias": True, "dropout": 0.1, "attention_dropout": 0.0,
    "activation_dropout": 0.0, "layerdrop": 0.0, "init_std": 0.02, "use_cache": True,
    "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1, "prefix": "</s>",
    "torch_dtype": "float16",
}
json.dump(config, open(sys.argv[2] + "/config.json", "w"), indent=2)
PY
commit=$(cd "$REPO/snapshots/new" && cat config.json merges.txt special_tokens_map.json tokenizer_config.json vocab.json | sha1sum | cut -c1-40)
mv "$REPO/snapshots/new" "$REPO/snapshots/$commit"
printf '%s' "$commit" > "$REPO/refs/main"

if "$PYTHON" -c 'import transformers' > /dev/null 2>&1; then
    ids=$(HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME="$TMP/hf" "$PYTHON" -c '
from transformers import AutoTokenizer
t = AutoTokenizer.from_pretrained("facebook/opt-30b", padding_side="left")
print(t("Paris is the capital city of").input_ids, t("\n").input_ids)' 2> "$TMP/tokenizer.err") ||
        die "the bundled tokenizer does not load offline: $(tail -n 1 "$TMP/tokenizer.err")"
    rm -f "$TMP/tokenizer.err"
    echo "tokenizer loads offline: $ids"
else
    echo "tokenizer: not loaded as a check ($PYTHON does not import transformers)"
fi
rm -rf "$TMP/hf/hub/.locks" "$TMP/hf/hub/models--facebook--opt-30b/.no_exist"

# ---- README.md and MANIFEST
size() { stat -c %s "$1"; }
content=$(du -sb "$TMP" | cut -f1)
{
    echo "# The offline bundle of FlexGen in C's first GPU run"
    echo
    echo "Written by \`scripts/gpu_bundle.sh\` on $(date -u +%Y-%m-%d) (Debian $CODENAME, amd64). On a GPU machine"
    echo "without a network, from the repository's root:"
    echo
    echo "    bash scripts/gpu_first_run.sh --bundle $(basename "$DIR")"
    echo
    echo "It unpacks \`debs/\` into a private prefix (\`dpkg-deb -x\`, no system-wide install) and builds"
    echo "with \`make DEPS=PREFIX\`, installs \`wheels/\` with \`pip install --no-index --no-deps --target\`,"
    echo "and runs FlexGen with \`HF_HOME\` at a copy of \`hf/\` and \`HF_HUB_OFFLINE=1\`."
    echo "\`sha256sum -c MANIFEST\` checks every file."
    echo
    echo "The tokenizer in \`hf/\`, under the repo id \`facebook/opt-30b\`, is not OPT's: it is"
    echo "\`models/opt-kjv\`'s byte-level BPE (4,096 tokens, trained on the King James Bible), with OPT's"
    echo "special tokens at OPT's ids (\`<s>\` 0, \`<pad>\` 1, \`</s>\` 2, \`<unk>\` 3). FlexGen loads it even"
    echo "with dummy weights, to pad its one test prompt to the prompt length; with dummy weights only"
    echo "the ids' range matters (all below OPT's 50,272), so the throughput is the same as with OPT's"
    echo "own tokenizer. \`config.json\` beside it has OPT-30B's shape."
    echo
    echo "| file | bytes | what |"
    echo "|---|---|---|"
    for f in "$TMP"/debs/*.deb; do
        echo "| debs/$(basename "$f") | $(size "$f") | $(dpkg-deb -f "$f" Package) $(dpkg-deb -f "$f" Version) |"
    done
    for f in "$TMP"/wheels/*.whl; do
        echo "| wheels/$(basename "$f") | $(size "$f") | Python wheel |"
    done
    (cd "$TMP" && find hf -type f | sort) | while read -r f; do
        echo "| $f | $(size "$TMP/$f") | tokenizer |"
    done
    echo
    echo "Total: $content bytes, besides this file and MANIFEST."
} > "$TMP/README.md"
files=$(cd "$TMP" && find . -type f | sed 's|^\./||' | LC_ALL=C sort)
(cd "$TMP" && echo "$files" | xargs sha256sum) > "$TMP/MANIFEST.sums" && mv "$TMP/MANIFEST.sums" "$TMP/MANIFEST"

total=$(du -sb "$TMP" | cut -f1)
[ "$total" -lt $((64 << 20)) ] || die "the bundle is $((total >> 20)) MiB, over 64 MiB (WHEELS=${WHEELS:-})"
rm -rf "$DIR"
mv "$TMP" "$DIR"
trap - EXIT
echo "== $DIR: $(find "$DIR" -type f | wc -l) files, $total bytes ($(awk -v b="$total" 'BEGIN { printf "%.1f", b / 1048576 }') MiB)"
