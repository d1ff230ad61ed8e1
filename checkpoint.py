"""Reading GPT-2's checkpoints without TensorFlow or PyTorch: what a checkpoint really is.

OpenAI released GPT-2 as TensorFlow checkpoints: a data file of raw little-endian
floats, plus an index that says where each named tensor starts.

- `model.ckpt.index` is a LevelDB "SSTable": sorted key/value blocks, a footer
  that points at the index block. Each key is a tensor name; each value is a
  protobuf `BundleEntryProto` (dtype, shape, offset, size, crc32c), decoded here
  by hand (`read_varint`, `parse_proto`).
  Formats: https://github.com/google/leveldb/blob/main/doc/table_format.md and
  tensorflow/core/protobuf/tensor_bundle.proto.
- `model.safetensors` (the Hugging Face mirror) is simpler still: an 8-byte
  header length, a JSON header, raw bytes.

Either way the tensors are `np.memmap` views into the file: zero copies, paged in
by the OS on first use. The index also stores each tensor's crc32c, which every load
checks (at memory speed), so a damaged file never loads. Nothing is ever unpickled.
The checkpoint's names are then mapped to picoGPT's nested dict
(`params["blocks"][i]["attn"]["c_attn"]["w"]`), and every shape is checked.
"""
import json
import math
import os
import re
import struct

import numpy as np
from crc32c import crc32c


TF_INDEX, TF_DATA = "model.ckpt.index", "model.ckpt.data-00000-of-00001"  # a checkpoint's two files


class LoadError(Exception):
    """Something the user can fix: the message is one line that says what and how."""


# ------------------------------------------------ TensorFlow checkpoint index --

def read_varint(buf, pos):
    """Decode a protobuf/LevelDB base-128 varint at buf[pos]; returns (value, new pos)."""
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("varint runs past the end of the buffer")
        if shift > 63:  # a 64-bit value takes at most 10 bytes
            raise ValueError("varint longer than 10 bytes")
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7


def read_block(data, offset, size):
    """Entries (key, value) of one SSTable block: keys share prefixes with the previous key."""
    if offset + size + 5 > len(data):
        raise ValueError("block runs past the end of the file")
    if data[offset + size] != 0:  # trailer: compression type, then a crc32c of the block and type
        raise ValueError("compressed block (TensorFlow bundles are never compressed)")
    if masked_crc32c(data[offset:offset + size + 1]) != struct.unpack_from("<I", data, offset + size + 1)[0]:
        raise ValueError("a block's bytes do not have the crc32c its trailer stores")
    block = data[offset:offset + size]
    (n_restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    end = len(block) - 4 - 4 * n_restarts
    pos, key, entries = 0, b"", []
    while pos < end:
        shared, pos = read_varint(block, pos)
        non_shared, pos = read_varint(block, pos)
        value_len, pos = read_varint(block, pos)
        key = key[:shared] + block[pos:pos + non_shared]
        pos += non_shared
        entries.append((key, block[pos:pos + value_len]))
        pos += value_len
    return entries


def parse_proto(buf):
    """A protobuf message as {field number: [values]}: varints as ints, the rest as bytes."""
    fields, pos = {}, 0
    while pos < len(buf):
        tag, pos = read_varint(buf, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = read_varint(buf, pos)
        elif wire == 2:
            n, pos = read_varint(buf, pos)
            value, pos = buf[pos:pos + n], pos + n
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        fields.setdefault(number, []).append(value)
    return fields


TF_DTYPES = {1: np.float32, 19: np.float16}  # DataType enum: DT_FLOAT, DT_HALF


MOST_ELEMENTS = 1 << 40  # a dimension, or a tensor, past this is a corrupt index, not a GPT-2
MOST_TENSORS = 4096  # GPT-2 1558M has 580 (the Hugging Face layout 48 mask buffers more)
MOST_INDEX_BYTES = 1 << 24  # 1558M's index holds ~40 KB


def field(fields, number, kind, default):
    """The last value of a protobuf field, checked to be of the kind its schema says (an int
    for a varint, bytes for a message or a fixed32): a ValueError names what is wrong."""
    value = fields.get(number, [default])[-1]
    if not isinstance(value, kind):
        raise ValueError(f"field {number} of a tensor's entry has the wrong wire type")
    return value


def repeated(fields, number, kind):
    """Every value of a repeated protobuf field, each checked as `field` checks one."""
    values = fields.get(number, [])
    if not all(isinstance(value, kind) for value in values):
        raise ValueError(f"field {number} of a tensor's entry has the wrong wire type")
    return values


def parse_bundle_entry(value):
    """BundleEntryProto -> dict(dtype, shape, shard, offset, size, crc32c)."""
    f = parse_proto(value)
    dims = [field(parse_proto(d), 1, int, 0) for d in repeated(parse_proto(field(f, 2, bytes, b"")), 2, bytes)]
    if any(not 0 <= d < MOST_ELEMENTS for d in dims) or math.prod(dims) >= MOST_ELEMENTS:
        raise ValueError(f"a tensor's shape {dims} is not a shape")
    crc = field(f, 6, bytes, bytes(4))  # proto3 leaves out a field that holds its default, 0
    if len(crc) != 4:
        raise ValueError("a tensor's crc32c is not 4 bytes")
    return {"dtype": field(f, 1, int, 0), "shape": tuple(dims), "shard": field(f, 3, int, 0),
            "offset": field(f, 4, int, 0), "size": field(f, 5, int, 0), "crc32c": struct.unpack("<I", crc)[0]}


def read_tf_index(index_path):
    """{tensor name: BundleEntryProto fields} from a TensorFlow `model.ckpt.index`."""
    if os.path.getsize(index_path) > MOST_INDEX_BYTES:
        raise ValueError(f"{os.path.getsize(index_path)} bytes, more than any GPT-2's index")
    with open(index_path, "rb") as fh:
        data = fh.read()
    # footer (48 bytes): metaindex handle, index handle (varints, zero padded), 8-byte magic
    if len(data) < 48 or data[-8:] != struct.pack("<Q", 0xDB4775248B80FB57):
        raise ValueError("not a LevelDB table (bad footer magic)")
    footer = data[-48:]
    _, pos = read_varint(footer, read_varint(footer, 0)[1])  # skip the metaindex handle
    index_offset, pos = read_varint(footer, pos)
    index_size, _ = read_varint(footer, pos)
    entries = {}
    for _, handle in read_block(data, index_offset, index_size):
        offset, pos = read_varint(handle, 0)
        size, _ = read_varint(handle, pos)
        for key, value in read_block(data, offset, size):
            if key:  # the empty key holds the BundleHeaderProto, not a tensor
                if key.decode() in entries:
                    raise ValueError(f"tensor {key.decode()!r} is listed twice")
                if len(entries) == MOST_TENSORS:
                    raise ValueError(f"more than {MOST_TENSORS} tensors, more than any GPT-2 has")
                entries[key.decode()] = parse_bundle_entry(value)
    return entries


def masked_crc32c(data):
    """CRC-32C (Castagnoli), the checksum LevelDB and TensorFlow use, of any bytes-like
    object (a memory-mapped tensor is read in place, by the CPU's crc32 instruction where it
    has one), 'masked' (rotated and offset) as TensorFlow stores it, so that a crc of data
    that itself contains crcs does not look degenerate."""
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def load_tf_checkpoint(model_dir):
    """{tensor name: np.memmap} for every tensor of a TensorFlow checkpoint, each checked
    against the crc32c its index stores (at memory speed: a damaged file never loads)."""
    index_path, data_path = os.path.join(model_dir, TF_INDEX), os.path.join(model_dir, TF_DATA)
    try:
        entries = read_checked_index(index_path)
    except ValueError as e:
        raise LoadError(f"{index_path} is corrupt ({e}): delete it and run again to re-download")
    try:
        return tf_tensors(entries, data_path)
    except ValueError as e:
        raise LoadError(f"{data_path} is damaged ({e}): delete it and run again to re-download")


def read_checked_index(index_path):
    """The index's entries, each a tensor GPT-2's reader can map: one shard, a known dtype,
    as many bytes as its shape holds. A ValueError says how a corrupt index is corrupt (its
    blocks carry crc32c too); a LoadError names what this reader does not handle."""
    try:
        entries = read_tf_index(index_path)
    except (IndexError, KeyError, struct.error) as e:
        raise ValueError(f"{type(e).__name__}: {e}")
    for name, e in entries.items():
        if e["shard"] != 0:
            raise LoadError(f"{name} lives in shard {e['shard']}, but GPT-2 checkpoints have one shard")
        if e["dtype"] not in TF_DTYPES:
            raise LoadError(f"{name} has TensorFlow dtype {e['dtype']}, which this reader does not handle")
        if e["size"] != math.prod(e["shape"]) * np.dtype(TF_DTYPES[e["dtype"]]).itemsize:
            raise ValueError(f"{name} has shape {e['shape']} but {e['size']} bytes")
    return entries


def tf_tensors(entries, data_path):
    """{name: np.memmap} of the data file's tensors where the index's entries place them; a
    ValueError names the first that is not (the file's size) or whose bytes do not have the
    index's crc32c."""
    check_extents(os.path.getsize(data_path), [(e["offset"], e["offset"] + e["size"], name)
                                               for name, e in entries.items()])
    tensors = {}
    for name, e in entries.items():
        dtype = np.dtype(TF_DTYPES[e["dtype"]]).newbyteorder("<")
        tensors[name] = np.memmap(data_path, dtype=dtype, mode="r", offset=e["offset"], shape=e["shape"])
        if masked_crc32c(tensors[name]) != e["crc32c"]:
            raise ValueError(f"the bytes of {name} do not have the crc32c the index stores")
    return tensors


def check_extents(size, extents):
    """The tensors' byte ranges [(begin, end, name)] tile a data region of `size` bytes, in some
    order, with no gap, overlap or byte left over (as both formats write it): a file that
    is cut short, or longer (bytes before the first tensor would shift every one), or an
    index that points two tensors at the same bytes, is a ValueError."""
    if len(extents) > MOST_TENSORS:
        raise ValueError(f"its index lists {len(extents)} tensors, more than any GPT-2 has")
    at = 0
    for begin, end, name in sorted(extents):
        if begin != at or end < begin:
            raise ValueError(f"it does not match its index at {name}: bytes {begin}-{end}, expected from {at}")
        at = end
    if at != size:
        raise ValueError(f"{'truncated' if size < at else 'longer than its index says'}: {size} bytes where its "
                         f"index describes {at}")


# ------------------------------------------------------------- safetensors --

SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16}
MOST_HEADER = 100_000_000  # bytes: the safetensors library's own limit


def load_safetensors(path):
    """{tensor name: np.memmap} from a .safetensors file (8-byte header length, JSON, bytes)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8)) if size >= 8 else (size,)
        if n > min(size - 8, MOST_HEADER):
            raise LoadError(f"{path} is truncated or not safetensors: delete it and run again to re-download")
        try:
            header = json.loads(f.read(n), object_pairs_hook=unique_keys)
        except (ValueError, RecursionError) as e:
            raise LoadError(f"{path} has a corrupt header ({e}): delete it and run again to re-download")
    entries = {name: info for name, info in header.items() if name != "__metadata__"} if isinstance(header, dict) \
        else None
    if entries is None or not all(is_safetensors_entry(info) for info in entries.values()):
        raise LoadError(f"{path} has a header that is not safetensors: delete it and run again to re-download")
    try:
        check_extents(size - 8 - n, [(*info["data_offsets"], name) for name, info in entries.items()])
    except ValueError as e:
        raise LoadError(f"{path} is damaged ({e}): delete it and run again to re-download")
    tensors = {}
    for name, info in entries.items():
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise LoadError(f"{name} in {path} has dtype {info['dtype']}, which this reader does not handle")
        begin, end = info["data_offsets"]
        dtype = np.dtype(SAFETENSORS_DTYPES[info["dtype"]]).newbyteorder("<")
        if end - begin != math.prod(info["shape"]) * dtype.itemsize:
            raise LoadError(f"{path} is corrupt at {name}: delete it and run again to re-download")
        tensors[name] = np.memmap(path, dtype=dtype, mode="r", offset=8 + n + begin, shape=tuple(info["shape"]))
    return tensors


def unique_keys(pairs):
    """json's object_pairs_hook: a dict, or a ValueError where a key comes twice."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a name is listed twice")
    return out


def is_safetensors_entry(info):
    """A tensor's header entry: {"dtype": str, "shape": [ints], "data_offsets": [begin, end]}."""
    ints = lambda xs, n=None: (isinstance(xs, list) and (n is None or len(xs) == n)
                               and all(type(x) is int and 0 <= x < MOST_ELEMENTS for x in xs))
    return (isinstance(info, dict) and isinstance(info.get("dtype"), str) and ints(info.get("shape"))
            and ints(info.get("data_offsets"), 2) and math.prod(info["shape"]) < MOST_ELEMENTS)


# ------------------------------------------------ names -> picoGPT's nested dict --

def params_from_openai_names(tensors, n_layer):
    """`model/h3/mlp/c_fc/w` -> params["blocks"][3]["mlp"]["c_fc"]["w"] (leading 1 squeezed)."""
    params = {"blocks": [{} for _ in range(n_layer)]}
    for name, array in tensors.items():
        parts = name.split("/")[1:]  # drop "model"
        if name.split("/")[0] != "model" or not parts or not all(parts):
            raise ValueError(f"tensor {name!r} is not a GPT-2 tensor's name")
        if re.fullmatch(r"h[0-9]+", parts[0]):
            node = params["blocks"][block_index(parts[0][1:], n_layer, name)]
            parts = parts[1:]
        else:
            node = params
        place(node, parts, np.squeeze(array, axis=0) if array.ndim == 3 else array, name)
    return params


def place(node, parts, array, name):
    """node[parts[0]][parts[1]]... = array, the dicts on the way made as needed; a ValueError
    where the name ends at a block, runs through a tensor or the block list, or comes twice."""
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ValueError(f"tensor {name!r} is not a GPT-2 tensor's name")
    if not parts or parts[-1] in node:
        raise ValueError(f"tensor {name!r} is not a GPT-2 tensor's name, or comes twice")
    node[parts[-1]] = array


HF_LEAF = {"weight": {"ln_1": "g", "ln_2": "g", "ln_f": "g", "*": "w"}, "bias": {"*": "b"}}


def params_from_hf_names(tensors, n_layer):
    """`h.3.mlp.c_fc.weight` -> params["blocks"][3]["mlp"]["c_fc"]["w"]; the attention
    mask buffers (`attn.bias`, `attn.masked_bias`) and the tied `lm_head` are skipped."""
    params = {"blocks": [{} for _ in range(n_layer)]}
    for name, array in tensors.items():
        name = name.removeprefix("transformer.")
        parts = name.split(".")
        if name.startswith("lm_head.") or parts[-2:] in (["attn", "bias"], ["attn", "masked_bias"]):
            continue
        if parts[0] in ("wte", "wpe"):
            params[parts[0]] = array
            continue
        if parts[0] == "h" and len(parts) > 2:
            node, parts = params["blocks"][block_index(parts[1], n_layer, name)], parts[2:]
        else:
            node = params
        if len(parts) < 2 or parts[-1] not in HF_LEAF:
            raise ValueError(f"tensor {name!r} is not a GPT-2 tensor's name")
        leaf = HF_LEAF[parts[-1]]
        place(node, parts[:-1] + [leaf.get(parts[-2], leaf["*"])], array, name)
    return params


def block_index(digits, n_layer, name):
    """The block a tensor's name points into: digits below n_layer, or a ValueError."""
    if not re.fullmatch(r"[0-9]+", digits) or int(digits) >= n_layer:
        raise ValueError(f"tensor {name!r} names no block of GPT-2's {n_layer} (hparams' n_layer)")
    return int(digits)


def load_params(model_dir, n_layer):
    """picoGPT-style nested dict of float arrays from whichever layout model_dir holds."""
    if os.path.exists(os.path.join(model_dir, TF_INDEX)):
        return params_from_openai_names(load_tf_checkpoint(model_dir), n_layer)
    return params_from_hf_names(load_safetensors(os.path.join(model_dir, "model.safetensors")), n_layer)


def check_params(params, hparams):
    """Every tensor GPT-2 needs, with the shape hparams imply and finite values: a clear
    error otherwise."""
    V, C, E, L = hparams["n_vocab"], hparams["n_ctx"], hparams["n_embd"], hparams["n_layer"]
    want = {("wte",): (V, E), ("wpe",): (C, E), ("ln_f", "g"): (E,), ("ln_f", "b"): (E,)}
    for i in range(L):
        for ln in ("ln_1", "ln_2"):
            want[("blocks", i, ln, "g")] = want[("blocks", i, ln, "b")] = (E,)
        for path, (n_in, n_out) in {("attn", "c_attn"): (E, 3 * E), ("attn", "c_proj"): (E, E),
                                    ("mlp", "c_fc"): (E, 4 * E), ("mlp", "c_proj"): (4 * E, E)}.items():
            want[("blocks", i) + path + ("w",)] = (n_in, n_out)
            want[("blocks", i) + path + ("b",)] = (n_out,)
    extra = sorted(set(leaf_paths(params)) - set(want))
    if extra:
        raise LoadError(f"checkpoint has a tensor GPT-2 does not: {'/'.join(map(str, extra[0]))}")
    for path, shape in want.items():
        node = params
        try:
            for key in path:
                node = node[key]
        except (KeyError, IndexError, TypeError):
            raise LoadError(f"checkpoint has no tensor for {'/'.join(map(str, path))}")
        if isinstance(node, dict):
            raise LoadError(f"checkpoint has no tensor for {'/'.join(map(str, path))}, only tensors below it")
        if tuple(node.shape) != shape:
            raise LoadError(f"tensor {'/'.join(map(str, path))} has shape {tuple(node.shape)}, expected {shape}")
        # a NaN or an infinity (or a value too large to sum) is a damaged file, not a model: its text
        # would be garbage, or stop at the first draw (one float32 sum reads a tensor at memory speed)
        with np.errstate(all="ignore"):
            finite = np.isfinite(node.sum(dtype=np.float32))
        if not finite:
            raise LoadError(f"tensor {'/'.join(map(str, path))} holds values that are not finite numbers: the "
                            "checkpoint is damaged; delete the model's folder and run again to re-download")


def leaf_paths(node, path=()):
    """Every path to a tensor (a leaf that is not a dict or list) in the nested params."""
    if isinstance(node, dict):
        return [p for key, child in node.items() for p in leaf_paths(child, path + (key,))]
    if isinstance(node, list):
        return [p for i, child in enumerate(node) for p in leaf_paths(child, path + (i,))]
    return [path]
