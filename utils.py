"""Getting GPT-2's weights into NumPy arrays: download, parse, memory-map.

OpenAI released GPT-2 as TensorFlow checkpoints. This file reads them without
TensorFlow, which teaches what a checkpoint really is: a data file of raw
little-endian floats, plus an index that says where each named tensor starts.

- `model.ckpt.index` is a LevelDB "SSTable": sorted key/value blocks, a footer
  that points at the index block. Each key is a tensor name; each value is a
  protobuf `BundleEntryProto` (dtype, shape, offset, size, crc32c).
  Formats: https://github.com/google/leveldb/blob/main/doc/table_format.md and
  tensorflow/core/protobuf/tensor_bundle.proto.
- `model.safetensors` (the Hugging Face mirror) is simpler still: an 8-byte
  header length, a JSON header, raw bytes.

Either way the tensors are `np.memmap` views into the file: zero copies, loaded
in milliseconds, paged in by the OS on first use. Nothing is ever unpickled.
Two kinds of tensor are then copied once, into the memory order that decoding
reads fastest (`decode_layout`). `to_backend` moves the params to a GPU (CuPy).
"""
import hashlib
import json
import os
import struct
import time

import numpy as np
import requests
import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import r50k_pat_str
from tqdm import tqdm

MODEL_SIZES = ("124M", "355M", "774M", "1558M")
OPENAI_BASE_URL = "https://openaipublic.blob.core.windows.net/gpt-2/models"
HF_BASE_URL = "https://huggingface.co"
HF_REPOS = {
    "124M": "openai-community/gpt2",
    "355M": "openai-community/gpt2-medium",
    "774M": "openai-community/gpt2-large",
    "1558M": "openai-community/gpt2-xl",
}
BASE_URL_ENV = "GPT2_BASE_URL"  # overrides the source's base URL (mirrors, tests)
OPENAI_FILES = ("checkpoint", "encoder.json", "hparams.json", "model.ckpt.index",
                "model.ckpt.data-00000-of-00001", "vocab.bpe")
HF_FILES = ("config.json", "model.safetensors", "vocab.json", "merges.txt")
SOURCES = ("openai", "hf")
EOT_TOKEN = "<|endoftext|>"


class LoadError(Exception):
    """Something the user can fix: the message is one line that says what and how."""


# ---------------------------------------------------------------- download --

def check_model_size(model_size):
    if model_size not in MODEL_SIZES:
        raise LoadError(f"unknown model size {model_size!r}: choose one of {', '.join(MODEL_SIZES)}")
    return model_size


def file_urls(model_size, source="openai", base_url=None):
    """{local file name: URL} for every file a model of this size needs."""
    check_model_size(model_size)
    if source == "openai":
        base = (base_url or os.environ.get(BASE_URL_ENV) or OPENAI_BASE_URL).rstrip("/")
        return {f: f"{base}/{model_size}/{f}" for f in OPENAI_FILES}
    if source == "hf":
        base = (base_url or os.environ.get(BASE_URL_ENV) or HF_BASE_URL).rstrip("/")
        return {f: f"{base}/{HF_REPOS[model_size]}/resolve/main/{f}" for f in HF_FILES}
    raise LoadError(f"unknown source {source!r}: choose one of {', '.join(SOURCES)}")


class _Retry(Exception):
    """A transient failure: the download is tried again after a pause."""


def download_file(url, path, retries=5, backoff_s=1.0, timeout_s=30.0):
    """Stream `url` to `path`, atomically: bytes go to `path.part`, which is resumed
    with an HTTP Range request after an interruption and renamed to `path` only
    when its size equals the server's Content-Length."""
    part = path + ".part"
    error = None
    for attempt in range(retries):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        have = os.path.getsize(part) if os.path.exists(part) else 0
        headers = {"Range": f"bytes={have}-"} if have else {}
        try:
            with requests.get(url, stream=True, headers=headers, timeout=timeout_s) as r:
                if r.status_code == 416:  # nothing left to send: the .part is not trustworthy
                    os.remove(part)
                    raise _Retry("server refused to resume; starting over")
                if r.status_code in (401, 403, 404):
                    raise LoadError(f"{url} answered HTTP {r.status_code}: check --base_url / ${BASE_URL_ENV}")
                if r.status_code >= 400:
                    raise _Retry(f"HTTP {r.status_code}")
                if "Content-Length" not in r.headers:
                    raise LoadError(f"{url} sent no Content-Length, so the download cannot be verified")
                resumed = r.status_code == 206
                total = (have if resumed else 0) + int(r.headers["Content-Length"])
                with open(part, "ab" if resumed else "wb") as f, tqdm(
                        total=total, initial=have if resumed else 0, unit="B", unit_scale=True,
                        desc=os.path.basename(path), leave=False) as bar:
                    for chunk in r.iter_content(chunk_size=1 << 20):
                        f.write(chunk)
                        bar.update(len(chunk))
            size = os.path.getsize(part)
            if size != total:
                raise _Retry(f"got {size} of {total} bytes")
            os.replace(part, path)
            return path
        except (_Retry, requests.ConnectionError, requests.Timeout,
                requests.exceptions.ChunkedEncodingError) as e:
            error = e
    reason = {requests.ConnectionError: "cannot connect", requests.Timeout: "timed out",
              requests.exceptions.ChunkedEncodingError: "connection dropped"}.get(type(error), str(error))
    raise LoadError(f"could not download {url} after {retries} tries ({reason}); "
                    f"check your network or --base_url, then run again to resume")


def is_complete(model_dir):
    """A model in either layout: weights, hparams and tokenizer, each under either naming."""
    have = lambda *names: all(os.path.exists(os.path.join(model_dir, n)) for n in names)
    return ((have("model.ckpt.index", "model.ckpt.data-00000-of-00001", "hparams.json")
             or have("model.safetensors", "config.json"))
            and (have("vocab.bpe", "encoder.json") or have("merges.txt", "vocab.json")))


def download_model(model_size, models_dir="models", source="openai", base_url=None, **download_kw):
    """Make sure models_dir/model_size holds every file; returns that directory.
    Files already there are complete (only verified files get their final name),
    so a full directory never touches the network."""
    urls = file_urls(model_size, source, base_url)
    model_dir = os.path.join(models_dir, model_size)
    if is_complete(model_dir):
        return model_dir
    missing = [f for f in urls if not os.path.exists(os.path.join(model_dir, f))]
    try:
        os.makedirs(model_dir, exist_ok=True)
        probe = os.path.join(model_dir, ".write-test")
        open(probe, "wb").close()
        os.remove(probe)
    except OSError as e:
        raise LoadError(f"cannot write to {model_dir} ({e.strerror}): pass a writable --models_dir")
    for f in missing:
        download_file(urls[f], os.path.join(model_dir, f), **download_kw)
    return model_dir


# ------------------------------------------------ TensorFlow checkpoint index --

def read_varint(buf, pos):
    """Decode a protobuf/LevelDB base-128 varint at buf[pos]; returns (value, new pos)."""
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("varint runs past the end of the buffer")
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
    if data[offset + size] != 0:  # trailer: compression type, then a crc32c
        raise ValueError("compressed block (TensorFlow bundles are never compressed)")
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


def parse_bundle_entry(value):
    """BundleEntryProto -> dict(dtype, shape, shard, offset, size, crc32c)."""
    f = parse_proto(value)
    dims = [parse_proto(d).get(1, [0])[0] for d in parse_proto(f.get(2, [b""])[0]).get(2, [])]
    return {"dtype": f.get(1, [0])[0], "shape": tuple(dims), "shard": f.get(3, [0])[0],
            "offset": f.get(4, [0])[0], "size": f.get(5, [0])[0],
            "crc32c": struct.unpack("<I", f[6][0])[0] if 6 in f else None}


def read_tf_index(index_path):
    """{tensor name: BundleEntryProto fields} from a TensorFlow `model.ckpt.index`."""
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
                entries[key.decode()] = parse_bundle_entry(value)
    return entries


def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


CRC32C_TABLE = _crc32c_table()


def crc32c(data):
    """CRC-32C (Castagnoli), the checksum LevelDB and TensorFlow use. Pure Python,
    so it is slow (a few MB/s): used to verify small checkpoints and in tests."""
    crc = 0xFFFFFFFF
    for byte in bytes(data):
        crc = CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data):
    """TensorFlow stores crc32c 'masked' (rotated and offset) so that a crc of data
    that itself contains crcs does not look degenerate."""
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def load_tf_checkpoint(model_dir, verify_crc=False):
    """{tensor name: np.memmap} for every tensor of a TensorFlow checkpoint."""
    index_path = os.path.join(model_dir, "model.ckpt.index")
    data_path = os.path.join(model_dir, "model.ckpt.data-00000-of-00001")
    try:
        entries = read_tf_index(index_path)
    except (ValueError, IndexError, KeyError, struct.error) as e:
        raise LoadError(f"{index_path} is corrupt ({e}): delete it and run again to re-download")
    data_size = os.path.getsize(data_path)
    tensors = {}
    for name, e in entries.items():
        if e["shard"] != 0:
            raise LoadError(f"{name} lives in shard {e['shard']}, but GPT-2 checkpoints have one shard")
        if e["dtype"] not in TF_DTYPES:
            raise LoadError(f"{name} has TensorFlow dtype {e['dtype']}, which this reader does not handle")
        dtype = np.dtype(TF_DTYPES[e["dtype"]]).newbyteorder("<")
        if e["size"] != int(np.prod(e["shape"])) * dtype.itemsize:
            raise LoadError(f"{index_path} is corrupt: {name} has shape {e['shape']} but {e['size']} bytes")
        if e["offset"] + e["size"] > data_size:
            raise LoadError(f"{data_path} is truncated: {name} needs bytes up to {e['offset'] + e['size']} "
                            f"but the file has {data_size}; delete it and run again to re-download")
        tensors[name] = np.memmap(data_path, dtype=dtype, mode="r", offset=e["offset"], shape=e["shape"])
        if verify_crc and masked_crc32c(tensors[name].tobytes()) != e["crc32c"]:
            raise LoadError(f"{data_path} is corrupt: crc32c of {name} does not match the index")
    return tensors


# ------------------------------------------------------------- safetensors --

SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16}


def load_safetensors(path):
    """{tensor name: np.memmap} from a .safetensors file (8-byte header length, JSON, bytes)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8)) if size >= 8 else (size,)
        if n > size - 8:
            raise LoadError(f"{path} is truncated or not safetensors: delete it and run again to re-download")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise LoadError(f"{path} has a corrupt header ({e}): delete it and run again to re-download")
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise LoadError(f"{name} in {path} has dtype {info['dtype']}, which this reader does not handle")
        begin, end = info["data_offsets"]
        dtype = np.dtype(SAFETENSORS_DTYPES[info["dtype"]]).newbyteorder("<")
        if end - begin != int(np.prod(info["shape"])) * dtype.itemsize or 8 + n + end > size:
            raise LoadError(f"{path} is truncated or corrupt at {name}: delete it and run again to re-download")
        tensors[name] = np.memmap(path, dtype=dtype, mode="r", offset=8 + n + begin, shape=tuple(info["shape"]))
    return tensors


# ------------------------------------------------ names -> picoGPT's nested dict --

def params_from_openai_names(tensors, n_layer):
    """`model/h3/mlp/c_fc/w` -> params["blocks"][3]["mlp"]["c_fc"]["w"] (leading 1 squeezed)."""
    params = {"blocks": [{} for _ in range(n_layer)]}
    for name, array in tensors.items():
        parts = name.split("/")[1:]  # drop "model"
        if parts[0].startswith("h"):
            node = params["blocks"][int(parts[0][1:])]
            parts = parts[1:]
        else:
            node = params
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = np.squeeze(array, axis=0) if array.ndim == 3 else array
    return params


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
        if parts[0] == "h":
            node, parts = params["blocks"][int(parts[1])], parts[2:]
        else:
            node = params
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        leaf = HF_LEAF[parts[-1]]
        node[leaf.get(parts[-2], leaf["*"])] = array
    return params


# ------------------------------------------------------------------ loading --

def load_hparams(model_dir):
    """GPT-2's hparams (n_vocab, n_ctx, n_embd, n_head, n_layer) from either layout."""
    hparams_path = os.path.join(model_dir, "hparams.json")
    if os.path.exists(hparams_path):
        with open(hparams_path) as f:
            return json.load(f)
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    return {"n_vocab": c["vocab_size"], "n_ctx": c["n_positions"], "n_embd": c["n_embd"],
            "n_head": c["n_head"], "n_layer": c["n_layer"]}


def load_encoder(model_dir):
    """GPT-2's byte-level BPE as a tiktoken Encoding, built from the downloaded files
    (encoder.json + vocab.bpe, or the same content as vocab.json + merges.txt)."""
    names = [("vocab.bpe", "encoder.json"), ("merges.txt", "vocab.json")]
    for bpe, enc in names:
        bpe_path, enc_path = os.path.join(model_dir, bpe), os.path.join(model_dir, enc)
        if os.path.exists(bpe_path) and os.path.exists(enc_path):
            # hashing our own files lets tiktoken's cache tell one file from another
            ranks = data_gym_to_mergeable_bpe_ranks(bpe_path, enc_path, sha256_of(bpe_path), sha256_of(enc_path))
            return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                     special_tokens={EOT_TOKEN: len(ranks)})
    raise LoadError(f"no tokenizer files (vocab.bpe + encoder.json) in {model_dir}")


def sha256_of(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def load_params(model_dir, n_layer, verify_crc=False):
    """picoGPT-style nested dict of float arrays from whichever layout model_dir holds."""
    if os.path.exists(os.path.join(model_dir, "model.ckpt.index")):
        return params_from_openai_names(load_tf_checkpoint(model_dir, verify_crc), n_layer)
    return params_from_hf_names(load_safetensors(os.path.join(model_dir, "model.safetensors")), n_layer)


def check_params(params, hparams):
    """Every tensor GPT-2 needs, with the shape hparams imply: a clear error otherwise."""
    V, C, E, L = hparams["n_vocab"], hparams["n_ctx"], hparams["n_embd"], hparams["n_layer"]
    want = {("wte",): (V, E), ("wpe",): (C, E), ("ln_f", "g"): (E,), ("ln_f", "b"): (E,)}
    for i in range(L):
        for ln in ("ln_1", "ln_2"):
            want[("blocks", i, ln, "g")] = want[("blocks", i, ln, "b")] = (E,)
        for path, (n_in, n_out) in {("attn", "c_attn"): (E, 3 * E), ("attn", "c_proj"): (E, E),
                                    ("mlp", "c_fc"): (E, 4 * E), ("mlp", "c_proj"): (4 * E, E)}.items():
            want[("blocks", i) + path + ("w",)] = (n_in, n_out)
            want[("blocks", i) + path + ("b",)] = (n_out,)
    for path, shape in want.items():
        node = params
        try:
            for key in path:
                node = node[key]
        except (KeyError, IndexError, TypeError):
            raise LoadError(f"checkpoint has no tensor for {'/'.join(map(str, path))}")
        if tuple(node.shape) != shape:
            raise LoadError(f"tensor {'/'.join(map(str, path))} has shape {tuple(node.shape)}, expected {shape}")


def decode_layout(params):
    """params with the tied embedding wte and every MLP down-projection copied into
    column-major (Fortran) order; every other tensor stays memory-mapped.

    Shapes and values do not change, so gpt2.py reads the same; only the byte order
    does, and it decides which OpenBLAS kernel a matmul runs. Measured on the 2-core
    dev machine with 124M shapes: the head x @ wte.T took 4.3 ms instead of 5.0 for
    one row and 9 ms instead of 14 for eight (speculative verification), the twelve
    [3072, 768] down-projections 3.2 ms instead of 4.4 for one row, and a whole decode
    step 8-27% less across benchmark runs (benchmark.py's "weight layout" rows). The
    attention weights gain at most 3% of a step at one row and lose at eight rows, so
    they are not copied. The price: a copy of wte and the down-projections at load
    (270 MB for 124M, 2.3 GB for 1558M).
    """
    def mlp(m):
        return {**m, "c_proj": {**m["c_proj"], "w": column_major(m["c_proj"]["w"])}}  # [4*n_embd, n_embd]
    blocks = [{**block, "mlp": mlp(block["mlp"])} for block in params["blocks"]]
    return {**params, "wte": column_major(params["wte"]), "blocks": blocks}  # wte: [n_vocab, n_embd]


def column_major(w, rows=256):
    """np.asfortranarray(w), 2-3x faster on big matrices (550 -> 190 ms for 355M's wte):
    a whole-matrix transposing copy strides through memory on one side, while 256
    rows at a time stay in cache on both."""
    out = np.empty(w.shape, w.dtype, order="F")
    for i in range(0, w.shape[0], rows):
        out[i:i + rows] = w[i:i + rows]
    return out


def to_backend(params, backend="numpy", dtype="float32"):
    """The params on the array library that runs them. NumPy keeps them as they are
    (memory-mapped); CuPy copies every tensor to the GPU once, as `dtype`. From then
    on the model runs wherever its weights are (gpt2.py says how). CuPy is imported
    only here, so the NumPy path never needs it."""
    if backend == "numpy":
        if dtype != "float32":
            raise LoadError(f"--dtype {dtype} needs --backend cupy (NumPy has no fast {dtype} matmul)")
        return params
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no CuPy, or no CUDA driver or GPU
        raise LoadError(f"--backend cupy needs CuPy and an NVIDIA GPU ({type(e).__name__}: {e}): "
                        "pip install cupy-cuda12x (or cupy-cuda13x), or use --backend numpy")
    try:
        return tree_map(lambda w: cupy.asarray(w.astype(dtype, copy=False)), params)
    except cupy.cuda.memory.OutOfMemoryError as e:
        raise LoadError(f"the GPU has too little free memory for these weights ({e}): "
                        "try --dtype float16, a smaller model, or --backend numpy")


def tree_map(f, tree):
    """f applied to every array of a nested dict/list of params."""
    if isinstance(tree, dict):
        return {k: tree_map(f, v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [tree_map(f, v) for v in tree]
    return f(tree)


def load_encoder_hparams_and_params(model_size, models_dir="models", source="openai", base_url=None,
                                    verify_crc=False, **download_kw):
    """picoGPT's entry point: download what is missing, then (encoder, hparams, params)."""
    model_dir = download_model(model_size, models_dir, source, base_url, **download_kw)
    return load_model_dir(model_dir, verify_crc)


def load_model_dir(model_dir, verify_crc=False):
    """(encoder, hparams, params) from a directory that already holds a model."""
    try:
        hparams = load_hparams(model_dir)
    except (OSError, ValueError, KeyError) as e:
        raise LoadError(f"cannot read hparams.json / config.json in {model_dir} ({e})")
    encoder = load_encoder(model_dir)
    try:
        params = load_params(model_dir, hparams["n_layer"], verify_crc)
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise LoadError(f"cannot read the checkpoint in {model_dir} ({type(e).__name__}: {e})")
    check_params(params, hparams)
    return encoder, hparams, decode_layout(params)
