#!/usr/bin/env python3
"""Convert an HF checkpoint directory from pytorch_model.bin to safetensors.

    python scripts/convert_to_safetensors.py SRC_DIR [DST_DIR] [--max-shard-size 2GB] [--force]
                                             [--verify]

SRC_DIR holds pytorch_model.bin, or shards pytorch_model-*.bin listed in
pytorch_model.bin.index.json. DST_DIR (default: SRC_DIR) receives model.safetensors, or, when the
tensors add up to more than --max-shard-size, model-0000i-of-0000n.safetensors shards plus
model.safetensors.index.json, in the layout transformers' save_pretrained writes. Tensor names
and dtypes are kept as they are. config.json, vocab.json, merges.txt and the other small
non-weight files are copied when DST_DIR differs from SRC_DIR.

Shared tensors: safetensors refuses tensors that alias one storage. lm_head.weight is dropped
when it holds the same values as the token embedding (tied, as in every OPT checkpoint; loaders
tie it back); any other alias is cloned. Input shards are read one at a time, so memory stays
near one input shard plus one output shard.

Exit status 0 on success; 1 with one line on stderr naming the file and the problem otherwise.
"""

import argparse
import gc
import json
import os
import re
import shutil
import sys

WEIGHT_INDEX = "pytorch_model.bin.index.json"
WEIGHT_FILE = "pytorch_model.bin"
ST_FILE = "model.safetensors"
ST_INDEX = "model.safetensors.index.json"
# Files never copied: weights in other formats and what this script writes.
SKIP_COPY = re.compile(r"(\.bin|\.pt|\.pth|\.ckpt|\.h5|\.msgpack|\.safetensors|\.index\.json)$")
SMALL_FILE = 64 << 20  # other files larger than this are not copied


class ConvertError(Exception):
    pass


def parse_size(s):
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(s), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {s!r}: use e.g. 2GB, 500MB, 1048576")
    num, unit = float(m.group(1)), (m.group(2) or "B").upper()
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
            "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    n = int(num * mult)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"bad size {s!r}: must be positive")
    return n


def source_files(src):
    """The list of .bin files to read, in order."""
    if not os.path.exists(src):
        raise ConvertError(f"{src}: no such directory")
    if not os.path.isdir(src):
        raise ConvertError(f"{src}: not a directory")
    idx = os.path.join(src, WEIGHT_INDEX)
    if os.path.isfile(idx):
        try:
            with open(idx) as fh:
                wm = json.load(fh)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConvertError(f"{idx}: not a valid weight index ({e})")
        files = sorted(set(wm.values()))
        for f in files:
            if not os.path.isfile(os.path.join(src, f)):
                raise ConvertError(f"{os.path.join(src, f)}: shard listed in {WEIGHT_INDEX} is missing")
        return [os.path.join(src, f) for f in files]
    single = os.path.join(src, WEIGHT_FILE)
    if os.path.isfile(single):
        return [single]
    shards = sorted(f for f in os.listdir(src) if re.fullmatch(r"pytorch_model-.*\.bin", f))
    if shards:
        raise ConvertError(f"{src}: has {len(shards)} pytorch_model-*.bin shards but no {WEIGHT_INDEX}")
    have = ", ".join(sorted(os.listdir(src))) or "nothing"
    raise ConvertError(f"{src}: neither {WEIGHT_FILE} nor {WEIGHT_INDEX} found (it holds: {have})")


def load_bin(path):
    import torch
    try:
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True)
        except TypeError:  # torch < 1.13 has no weights_only
            sd = torch.load(path, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - report whatever torch raised, with the file name
        raise ConvertError(f"{path}: cannot load ({type(e).__name__}: {e})")
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ConvertError(f"{path}: not a state dict of tensors")
    return sd


def tie_allowed(src):
    try:
        with open(os.path.join(src, "config.json")) as fh:
            return json.load(fh).get("tie_word_embeddings", True) is not False
    except (OSError, ValueError):
        return True


def is_embed(name):
    return name.endswith("embed_tokens.weight")


def is_lm_head(name):
    return name == "lm_head.weight" or name.endswith(".lm_head.weight")


class ShardWriter:
    """Collects tensors and writes temporary shard files of at most max_bytes each (a single
    tensor larger than that gets a shard of its own)."""

    def __init__(self, dst, max_bytes):
        self.dst, self.max_bytes = dst, max_bytes
        self.cur, self.cur_bytes = {}, 0
        self.shards = []  # (temp path, [names])
        self.total = 0
        self.dtypes = {}

    def add(self, name, t):
        n = t.numel() * t.element_size()
        if self.cur and self.cur_bytes + n > self.max_bytes:
            self.flush()
        self.cur[name] = t
        self.cur_bytes += n
        self.total += n
        self.dtypes[str(t.dtype)] = self.dtypes.get(str(t.dtype), 0) + 1

    def flush(self):
        from safetensors.torch import save_file
        if not self.cur:
            return
        # No aliasing inside one file; contiguous, owned storage for each tensor.
        seen, out = set(), {}
        for k, t in self.cur.items():
            ptr = (t.untyped_storage().data_ptr() if hasattr(t, "untyped_storage")
                   else t.storage().data_ptr())
            if ptr in seen or not t.is_contiguous() or t.storage_offset() != 0 \
                    or t.numel() * t.element_size() != _storage_nbytes(t):
                t = t.contiguous().clone()
            else:
                seen.add(ptr)
            out[k] = t
        path = os.path.join(self.dst, f".convert-tmp-{len(self.shards):05d}.safetensors")
        try:
            save_file(out, path, metadata={"format": "pt"})
        except Exception as e:  # noqa: BLE001
            raise ConvertError(f"{path}: cannot write ({type(e).__name__}: {e})")
        self.shards.append((path, list(out)))
        self.cur, self.cur_bytes = {}, 0

    def finish(self):
        self.flush()
        n = len(self.shards)
        if n == 0:
            raise ConvertError("no tensors to write")
        if n == 1:
            os.replace(self.shards[0][0], os.path.join(self.dst, ST_FILE))
            return [ST_FILE]
        names, wm = [], {}
        for i, (tmp, keys) in enumerate(self.shards):
            fn = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, os.path.join(self.dst, fn))
            names.append(fn)
            for k in keys:
                wm[k] = fn
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(wm.items()))}
        with open(os.path.join(self.dst, ST_INDEX), "w") as fh:
            json.dump(index, fh, indent=2)
            fh.write("\n")
        return names + [ST_INDEX]

    def abort(self):
        for tmp, _ in self.shards:
            if os.path.exists(tmp):
                os.remove(tmp)


def _storage_nbytes(t):
    if hasattr(t, "untyped_storage"):
        return t.untyped_storage().nbytes()
    s = t.storage()
    return s.size() * s.element_size()


def existing_outputs(dst):
    return sorted(f for f in os.listdir(dst)
                  if f == ST_FILE or f == ST_INDEX or re.fullmatch(r"model-\d+-of-\d+\.safetensors", f))


def convert(src, dst, max_bytes, force=False, verify=False, log=print):
    files = source_files(src)
    dst = dst or src
    os.makedirs(dst, exist_ok=True)
    old = existing_outputs(dst)
    if old:
        if not force:
            raise ConvertError(f"{dst}: already holds {', '.join(old)} (use --force to replace)")
        for f in old:
            os.remove(os.path.join(dst, f))

    tie = tie_allowed(src)
    writer = ShardWriter(dst, max_bytes)
    embed = None          # (name, tensor) of the token embedding, for the lm_head check
    pending_head = None   # lm_head.weight seen before the embedding
    names_in, seen_names = [], set()
    dropped = []
    try:
        for path in files:
            log(f"reading {path}")
            sd = load_bin(path)
            for name, t in sd.items():
                if name in seen_names:
                    raise ConvertError(f"{path}: tensor {name} also occurs in an earlier shard")
                seen_names.add(name)
                names_in.append(name)
                if is_embed(name) and embed is None:
                    embed = (name, t)
                if is_lm_head(name) and tie:
                    if embed is None:
                        pending_head = (name, t)
                        continue
                    if _same(t, embed[1]):
                        dropped.append(name)
                        continue
                writer.add(name, t)
            del sd
            gc.collect()
        if pending_head is not None:
            name, t = pending_head
            if embed is not None and _same(t, embed[1]):
                dropped.append(name)
            else:
                writer.add(name, t)
        written = writer.finish()
    except BaseException:
        writer.abort()
        raise
    for name in dropped:
        log(f"dropped {name}: same values as {embed[0]} (tied; loaders tie it back)")
    dtypes = ", ".join(f"{k.replace('torch.', '')} x{v}" for k, v in sorted(writer.dtypes.items()))
    log(f"wrote {len(names_in) - len(dropped)} tensors, {writer.total} bytes "
        f"({dtypes}) "
        f"to {dst}: {', '.join(written)}")

    copied = []
    if os.path.realpath(dst) != os.path.realpath(src):
        for f in sorted(os.listdir(src)):
            p = os.path.join(src, f)
            if not os.path.isfile(p) or SKIP_COPY.search(f) or f.startswith("."):
                continue
            if os.path.getsize(p) > SMALL_FILE:
                log(f"not copied (over {SMALL_FILE >> 20} MiB): {f}")
                continue
            shutil.copy2(p, os.path.join(dst, f))
            copied.append(f)
        log(f"copied: {', '.join(copied) if copied else 'nothing'}")
        if "config.json" not in copied:
            log(f"warning: {src} has no config.json")

    if verify:
        verify_conversion(files, dst, set(dropped), log)
    return written, dropped, copied


def _same(a, b):
    import torch
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def verify_conversion(files, dst, dropped, log=print):
    """Re-read every source shard and compare it with the written safetensors, bit for bit."""
    import torch
    from safetensors import safe_open
    idx = os.path.join(dst, ST_INDEX)
    if os.path.exists(idx):
        with open(idx) as fh:
            wm = json.load(fh)["weight_map"]
    else:
        with safe_open(os.path.join(dst, ST_FILE), framework="pt") as sf:
            wm = {k: ST_FILE for k in sf.keys()}
    n = 0
    for path in files:
        for name, t in load_bin(path).items():
            if name in dropped:
                continue
            if name not in wm:
                raise ConvertError(f"verify: {name} from {path} missing in {dst}")
            with safe_open(os.path.join(dst, wm[name]), framework="pt") as sf:
                u = sf.get_tensor(name)
            if u.dtype != t.dtype or u.shape != t.shape or not torch.equal(u, t):
                raise ConvertError(f"verify: {name} differs between {path} and {wm[name]}")
            n += 1
    if n != len(wm):
        raise ConvertError(f"verify: {dst} holds {len(wm)} tensors, sources {n}")
    log(f"verified {n} tensors: names, dtypes, shapes and values equal")


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Convert an HF pytorch_model.bin checkpoint directory to safetensors.")
    ap.add_argument("src", metavar="SRC_DIR")
    ap.add_argument("dst", metavar="DST_DIR", nargs="?", help="default: SRC_DIR")
    ap.add_argument("--max-shard-size", type=parse_size, default=parse_size("2GB"),
                    help="largest output file before sharding (default 2GB)")
    ap.add_argument("--force", action="store_true", help="replace safetensors already in DST_DIR")
    ap.add_argument("--verify", action="store_true",
                    help="re-read the sources and compare every tensor with what was written")
    args = ap.parse_args(argv)
    try:
        convert(args.src, args.dst, args.max_shard_size, args.force, args.verify)
    except ConvertError as e:
        print(f"convert_to_safetensors: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
