import json
import os
import shutil

import numpy as np
import pytest

import checkpoint
import utils
from conftest import KERNELS_HERE, fixture_path, make_model_dir
from kernels import layout

REAL = fixture_path("gpt2-124M-real-index")


def test_real_124M_index_lists_148_tensors_with_their_shapes():
    entries = checkpoint.read_tf_index(os.path.join(REAL, "model.ckpt.index"))
    assert len(entries) == 148
    assert entries["model/h0/attn/c_attn/w"]["shape"] == (1, 768, 2304)
    assert entries["model/wte"]["shape"] == (50257, 768)
    assert entries["model/wpe"]["shape"] == (1024, 768)
    assert sum(e["size"] for e in entries.values()) == 4 * 124_439_808  # GPT-2 small's parameter count
    assert all(e["dtype"] == 1 and e["shard"] == 0 for e in entries.values())


def test_real_124M_first_tensor_reads_with_matching_crc32c():
    e = checkpoint.read_tf_index(os.path.join(REAL, "model.ckpt.index"))["model/h0/attn/c_attn/b"]
    with open(os.path.join(REAL, "model.ckpt.data-00000-of-00001"), "rb") as f:
        raw = f.read()[e["offset"]:e["offset"] + e["size"]]
    b = np.frombuffer(raw, "<f4")
    np.testing.assert_array_equal(b[:5], np.array([0.48033914, -0.5254326, -0.42926455, -0.2059525, -0.1277338],
                                                  np.float32))
    assert checkpoint.masked_crc32c(raw) == e["crc32c"]
    assert checkpoint.masked_crc32c(raw[:-1] + b"\0") != e["crc32c"]


def test_crc32c_check_value():
    assert checkpoint.crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value


def test_truncated_real_data_file_is_a_clear_error():
    with pytest.raises(utils.LoadError, match="truncated.*re-download"):
        checkpoint.load_tf_checkpoint(REAL)


def test_tiny_tf_and_safetensors_layouts_load_identical_params(tmp_path):
    e1, h1, p1 = utils.load_model_dir(make_model_dir(str(tmp_path / "a"), "tiny-openai"))
    e2, h2, p2 = utils.load_model_dir(make_model_dir(str(tmp_path / "b"), "tiny-hf"))
    assert h1 == h2 == {"n_vocab": 50257, "n_ctx": 64, "n_embd": 16, "n_head": 2, "n_layer": 2}

    def leaves(p, prefix=""):
        if isinstance(p, dict):
            return {k2: v for k, v in p.items() for k2, v in leaves(v, f"{prefix}/{k}").items()}
        if isinstance(p, list):
            return {k2: v for i, v in enumerate(p) for k2, v in leaves(v, f"{prefix}/{i}").items()}
        return {prefix: p}

    l1, l2 = leaves(layout.plain_layout(p1)), leaves(layout.plain_layout(p2))
    assert sorted(l1) == sorted(l2) and len(l1) == 4 + 2 * 12
    for k in l1:
        assert l1[k].dtype == np.float32, k
        np.testing.assert_array_equal(l1[k], l2[k], err_msg=k)
    assert l1["/blocks/1/attn/c_attn/w"].shape == (16, 48)  # leading 1 squeezed


def test_every_load_checks_each_tensor_against_the_index_crc32c(tmp_path):
    """TensorFlow wrote the tiny checkpoint's crc32c; one low mantissa bit flipped in a
    weight leaves a finite number (check_params' sum cannot see it) and fails the check."""
    d = make_model_dir(str(tmp_path / "m"), "tiny-openai")
    utils.load_model_dir(d)
    data = os.path.join(d, "model.ckpt.data-00000-of-00001")
    e = checkpoint.read_tf_index(os.path.join(d, "model.ckpt.index"))["model/h1/mlp/c_fc/w"]
    raw = bytearray(open(data, "rb").read())
    raw[e["offset"] + 40] ^= 0x01
    open(data, "wb").write(bytes(raw))
    assert np.isfinite(np.frombuffer(bytes(raw), "<f4")).all()
    with pytest.raises(utils.LoadError, match=r"damaged \(the bytes of model/h1/mlp/c_fc/w do not have the crc32c"):
        utils.load_model_dir(d)


def test_an_index_damaged_on_disk_names_the_index(tmp_path):
    """A flipped byte in a tensor's crc32c field: the block's own crc32c names the index, where
    the tensor's check would blame the data (and a re-download of the data would not help)."""
    d = make_model_dir(str(tmp_path / "m"), "tiny-openai")
    index = os.path.join(d, "model.ckpt.index")
    raw = bytearray(open(index, "rb").read())
    e = checkpoint.read_tf_index(index)["model/wte"]
    at = bytes(raw).index(e["crc32c"].to_bytes(4, "little"))
    raw[at] ^= 0x01
    open(index, "wb").write(bytes(raw))
    with pytest.raises(utils.LoadError, match=r"model.ckpt.index is corrupt \(a block's bytes do not have the crc32c "
                                              r".*delete it"):
        utils.load_model_dir(d)


def test_an_entry_without_its_crc32c_field_has_the_default_0():
    """proto3 leaves out a field holding its default: an entry with no crc32c says 0, which no
    tensor's masked crc32c is in practice, so a damaged index cannot turn the check off."""
    fields = entry((1, 0, 1), (2, 2, shape(4)), (4, 0, 0), (5, 0, 16))
    assert checkpoint.parse_bundle_entry(fields)["crc32c"] == 0
    assert checkpoint.parse_bundle_entry(fields + entry((6, 2, bytes([1, 2, 3, 4]))))["crc32c"] == 0x04030201


def test_an_index_listing_more_tensors_than_any_gpt2_stops_at_the_limit(monkeypatch):
    monkeypatch.setattr(checkpoint, "MOST_TENSORS", 100)
    with pytest.raises(ValueError, match="more than 100 tensors"):
        checkpoint.read_tf_index(os.path.join(REAL, "model.ckpt.index"))  # 148


MATRICES = (("attn", "c_attn"), ("attn", "c_proj"), ("mlp", "c_fc"), ("mlp", "c_proj"))


@pytest.mark.parametrize("kernel", KERNELS_HERE)
def test_params_are_memory_mapped_except_the_decode_layout_copies(models_dir, kernel):
    params = layout.decode_layout(checkpoint.load_params(os.path.join(models_dir, "124M"), 2), kernel)
    assert isinstance(params["wpe"], np.memmap) or isinstance(params["wpe"].base, np.memmap)  # the lookups
    for block in params["blocks"]:
        for w in (block[m][name]["w"].stored for m, name in MATRICES):
            assert not isinstance(w, np.memmap) and w.dtype == np.float32
            if kernel == "numba":  # blocks of 64 output columns, each one run of memory
                assert w.ndim == 3 and w.shape[2] == 64 and w.flags.c_contiguous
            else:  # column-major
                assert w.flags.f_contiguous and not w.flags.c_contiguous
    if kernel == "numba":  # the tied head as blocks, the vocabulary padded to a multiple of 64
        assert params["wte"].T.stored.shape == (-(-50257 // 64), 16, 64)
    else:
        assert params["wte"].T.stored.flags.f_contiguous  # the head: column-major as stored


@pytest.mark.parametrize("kernel", KERNELS_HERE)
def test_decode_layout_keeps_shapes_and_values(models_dir, kernel):
    raw = checkpoint.load_params(os.path.join(models_dir, "124M"), 2)
    fast = layout.decode_layout(raw, kernel)
    back = layout.plain_layout(fast)
    np.testing.assert_array_equal(back["wte"], raw["wte"])
    for m, name in MATRICES:
        np.testing.assert_array_equal(back["blocks"][1][m][name]["w"], raw["blocks"][1][m][name]["w"])
        assert fast["blocks"][1][m][name]["b"] is raw["blocks"][1][m][name]["b"]
    if kernel == "numba":
        from kernels import row_kernel
        np.testing.assert_array_equal(row_kernel.unblocked(fast["wte"].T.stored, 50257), raw["wte"].T)
        assert not fast["wte"].T.stored[-1, :, 50257 % 64:].any()  # the padding is zeros
    assert raw["blocks"][1]["mlp"]["c_fc"]["w"].flags.c_contiguous  # the input is not modified


def test_corrupt_index_is_a_clear_error(tmp_path):
    d = make_model_dir(str(tmp_path / "m"), "tiny-openai")
    with open(os.path.join(d, "model.ckpt.index"), "r+b") as f:
        f.seek(-8, 2)
        f.write(b"garbage!")
    with pytest.raises(utils.LoadError, match="corrupt"):
        utils.load_model_dir(d)


def test_truncated_safetensors_is_a_clear_error(tmp_path):
    d = make_model_dir(str(tmp_path / "m"), "tiny-hf")
    path = os.path.join(d, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 10)
    with pytest.raises(utils.LoadError, match="truncated"):
        utils.load_model_dir(d)


def test_hf_names_with_transformer_prefix_and_buffers():
    t = checkpoint.load_safetensors(fixture_path("tiny-hf", "model.safetensors"))
    plain = checkpoint.params_from_hf_names(t, 2)
    prefixed = checkpoint.params_from_hf_names({"transformer." + k: v for k, v in t.items()}
                                          | {"lm_head.weight": t["wte.weight"],
                                             "transformer.h.0.attn.masked_bias": np.zeros(1)}, 2)
    assert set(plain["blocks"][0]["attn"]) == {"c_attn", "c_proj"}
    np.testing.assert_array_equal(plain["blocks"][0]["attn"]["c_attn"]["b"], t["h.0.attn.c_attn.bias"])
    np.testing.assert_array_equal(prefixed["blocks"][1]["mlp"]["c_fc"]["w"], plain["blocks"][1]["mlp"]["c_fc"]["w"])
    assert set(prefixed) == set(plain) == {"wte", "wpe", "blocks", "ln_f"}


def test_missing_tensor_is_a_clear_error(tmp_path, tiny):
    raw = checkpoint.load_params(fixture_path("tiny-openai"), tiny[1]["n_layer"])  # as read, before the layout
    params = dict(raw, ln_f={"g": raw["ln_f"]["g"]})
    with pytest.raises(utils.LoadError, match="ln_f/b"):
        checkpoint.check_params(params, tiny[1])


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, 3e38])
def test_a_tensor_that_holds_no_finite_numbers_is_a_damaged_checkpoint(tiny, value):
    """A NaN or an infinity gave garbage text or a failed draw, without naming the file (3e38:
    finite, but no weight, and its tensor's sum overflows)."""
    hparams = tiny[1]
    params = checkpoint.load_params(fixture_path("tiny-openai"), hparams["n_layer"])  # as read, before the layout
    b = np.array(params["ln_f"]["b"])
    b[[0, 3]] = value
    with pytest.raises(utils.LoadError, match="ln_f/b holds values that are not finite.*re-download"):
        checkpoint.check_params(dict(params, ln_f={"g": params["ln_f"]["g"], "b": b}), hparams)
    checkpoint.check_params(params, hparams)


@pytest.mark.parametrize("size", ["125M", "../124M", "", "124m"])
def test_unknown_model_size_is_rejected_before_any_path_is_built(size, tmp_path):
    with pytest.raises(utils.LoadError, match="124M, 355M, 774M, 1558M"):
        utils.download_model(size, str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_tokenizer_known_ids_and_round_trip(tiny):
    enc = tiny[0]
    assert enc.encode("Hello, world!") == [15496, 11, 995, 0]
    assert enc.encode("The quick brown fox jumps over the lazy dog.") == [
        464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    assert enc.eot_token == 50256 and enc.n_vocab == 50257
    for text in ["", "  spaces\n\ttabs", "naïve café — ünïcödé 🤖", "x" * 300]:
        assert enc.decode(enc.encode(text)) == text


def test_tokenizer_from_hf_file_names(tmp_path):
    src = fixture_path("gpt2-tokenizer")
    shutil.copy(os.path.join(src, "encoder.json"), tmp_path / "vocab.json")
    shutil.copy(os.path.join(src, "vocab.bpe"), tmp_path / "merges.txt")
    assert utils.load_encoder(str(tmp_path)).encode("Hello, world!") == [15496, 11, 995, 0]


def test_to_backend_numpy_keeps_the_params_and_refuses_float16(tiny):
    params = tiny[2]
    assert layout.to_backend(params) is params  # still memory-mapped: no copy on the CPU
    with pytest.raises(utils.LoadError, match="--dtype float16 needs --backend cupy"):
        layout.to_backend(params, "numpy", "float16")


def rewrite_safetensors(path, change):
    """The file at path with its JSON header replaced by change(header) (a str: written as is)."""
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = change(json.loads(raw[8:8 + n]))
    text = header if isinstance(header, str) else json.dumps(header)
    open(path, "wb").write(len(text.encode()).to_bytes(8, "little") + text.encode() + raw[8 + n:])


def first_tensor(h):
    return min((name for name in h if name != "__metadata__"), key=lambda name: h[name]["data_offsets"][0])


SAFETENSORS_CORRUPTIONS = {
    # offsets before the data: the header's own bytes read as weights
    "offsets into the header": lambda h: {**h, first_tensor(h): {**h[first_tensor(h)], "data_offsets": [
        h[first_tensor(h)]["data_offsets"][0] - 64, h[first_tensor(h)]["data_offsets"][1] - 64]}},
    "two tensors on the same bytes": lambda h: {**h, **{name: {**h[name], "data_offsets": h[first_tensor(h)][
        "data_offsets"]} for name in h if name != "__metadata__" and h[name]["shape"] == h[first_tensor(h)]["shape"]}},
    "not a dict": lambda h: list(h),
    "an entry not a dict": lambda h: {**h, first_tensor(h): 7},
    "a dtype not a string": lambda h: {**h, first_tensor(h): {**h[first_tensor(h)], "dtype": ["F32"]}},
    "offsets as strings": lambda h: {**h, first_tensor(h): {**h[first_tensor(h)], "data_offsets": ["0", "8"]}},
    "a float in a shape": lambda h: {**h, first_tensor(h): {**h[first_tensor(h)], "shape": [1.5]}},
    "a shape past 2**64": lambda h: {**h, first_tensor(h): {**h[first_tensor(h)], "shape": [2 ** 64 - 1, 16]}},
    "a name twice": lambda h: json.dumps(h)[:-1] + ', "wpe.weight": ' + json.dumps(h["wpe.weight"]) + "}",
    "nested past the parser": lambda h: "[" * 100_000 + "]" * 100_000,
}


@pytest.mark.parametrize("how", SAFETENSORS_CORRUPTIONS)
def test_a_safetensors_header_that_does_not_describe_its_bytes_is_one_clear_error(tmp_path, how):
    """The header's entries must be well formed and tile the data exactly: otherwise one line
    that says to download again, never weights read from the header's bytes or a traceback."""
    d = make_model_dir(str(tmp_path / "m"), "tiny-hf")
    rewrite_safetensors(os.path.join(d, "model.safetensors"), SAFETENSORS_CORRUPTIONS[how])
    with pytest.raises(utils.LoadError, match="re-download") as e:
        utils.load_model_dir(d)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("layout_name, data", [("tiny-openai", "model.ckpt.data-00000-of-00001"),
                                               ("tiny-hf", "model.safetensors")])
def test_a_data_file_longer_than_its_index_says_is_refused(tmp_path, layout_name, data):
    """Bytes added before the tensors (a resumed download that started over inside its .part)
    would shift every weight: the data must end where its last tensor does."""
    d = make_model_dir(str(tmp_path / "m"), layout_name)
    path = os.path.join(d, data)
    raw = open(path, "rb").read()
    if layout_name == "tiny-hf":
        n = int.from_bytes(raw[:8], "little")
        raw = raw[:8 + n] + bytes(1000) + raw[8 + n:]
    else:
        raw = bytes(1000) + raw
    open(path, "wb").write(raw)
    with pytest.raises(utils.LoadError, match="longer than its index says.*re-download"):
        utils.load_model_dir(d)


def varint(n):
    out = b""
    while True:
        out += bytes([n & 0x7F | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            return out


def entry(*fields):
    """A BundleEntryProto from (field number, wire type, payload) triples."""
    return b"".join(varint(number << 3 | wire) + (varint(value) if wire == 0 else varint(len(value)) + value)
                    for number, wire, value in fields)


def shape(*dims):
    return entry(*[(2, 2, entry((1, 0, d))) for d in dims])


@pytest.mark.parametrize("fields", [
    [(1, 0, 1), (2, 2, shape(4)), (4, 2, b"\x00\x01"), (5, 0, 16)],  # an offset as bytes
    [(1, 0, 1), (2, 0, 3), (4, 0, 0), (5, 0, 16)],  # a shape as a varint
    [(1, 0, 1), (2, 2, shape(2 ** 63 + 5, 2 ** 63 + 5)), (4, 0, 0), (5, 0, 16)],  # wraps to 16 in 64 bits
    [(1, 0, 1), (2, 2, shape(2 ** 41)), (4, 0, 0), (5, 0, 2 ** 43)],  # no GPT-2's
    [(1, 0, 1), (2, 2, shape(4)), (4, 0, 0), (5, 0, 16), (6, 0, 5)],  # a crc32c as a varint
    [(1, 0, 1), (2, 2, entry((2, 0, 4))), (4, 0, 0), (5, 0, 16)],  # a dimension as a varint (one byte flipped)
], ids=["offset bytes", "shape varint", "dims wrapping", "dims huge", "crc varint", "dim varint"])
def test_a_tensor_entry_with_fields_of_the_wrong_kind_is_a_value_error(fields):
    """What load_tf_checkpoint turns into one line naming the corrupt index."""
    assert checkpoint.parse_bundle_entry(entry((1, 0, 1), (2, 2, shape(4)), (4, 0, 0), (5, 0, 16)))["size"] == 16
    with pytest.raises(ValueError):
        checkpoint.parse_bundle_entry(entry(*fields))


def test_a_varint_longer_than_ten_bytes_is_refused_at_once():
    with pytest.raises(ValueError, match="longer than 10 bytes"):
        checkpoint.read_varint(b"\xff" * 1_000_000 + b"\x01", 0)


@pytest.mark.parametrize("name", ["model/h-1/ln_1/g", "model/h9/ln_1/g", "model/h٣/ln_1/g", "other/wte",
                                  "model/ln_f/g/x", "model/extra", "model/blocks/x", "model/h0", "model"])
def test_a_tensor_name_that_is_not_gpt2s_is_refused(tmp_path, tiny, name):
    """Block indices in ASCII digits below n_layer; every name one that GPT-2 has (in memory:
    no read-only memmap stops a write in its place). load_model_dir makes a ValueError one line."""
    _, hparams, _ = tiny
    plain = {k: np.array(v) for k, v in checkpoint.load_tf_checkpoint(
        make_model_dir(str(tmp_path / "m"), "tiny-openai")).items()}
    tensors = dict(plain, **{name: plain["model/ln_f/g"]})
    with pytest.raises((ValueError, utils.LoadError)):
        checkpoint.check_params(checkpoint.params_from_openai_names(tensors, hparams["n_layer"]), hparams)


@pytest.mark.parametrize("name", ["blocks.x.weight", "h.0.weight", "h.7.ln_1.weight", "ln_f.weight.x", "h.0"])
def test_a_safetensors_name_that_is_not_gpt2s_is_one_clear_error(tmp_path, name):
    d = make_model_dir(str(tmp_path / "m"), "tiny-hf")
    rewrite_safetensors(os.path.join(d, "model.safetensors"), lambda h: {
        (name if key == "ln_f.bias" else key): value for key, value in h.items()})
    with pytest.raises(utils.LoadError, match="GPT-2.*re-download") as e:
        utils.load_model_dir(d)
    assert "\n" not in str(e.value)


HPARAMS_CORRUPTIONS = {"a list": [1, 2], "a key missing": {"n_vocab": 50257, "n_ctx": 64, "n_embd": 16, "n_head": 2},
                       "a string": {"n_layer": "2"}, "a bool": {"n_layer": True}, "zero": {"n_ctx": 0},
                       "n_head not dividing n_embd": {"n_head": 3}, "n_layer past any model": {"n_layer": 10 ** 12},
                       "a float": {"n_embd": 16.0}, "more tokens than the tokenizer": {"n_vocab": 50258},
                       "fewer tokens than the tokenizer": {"n_vocab": 1000},
                       "an HTML page": "<html><body>Moved</body></html>"}


@pytest.mark.parametrize("how", HPARAMS_CORRUPTIONS)
def test_bad_hparams_are_one_clear_error_before_anything_is_allocated(tmp_path, how):
    d = make_model_dir(str(tmp_path / "m"), "tiny-openai")
    path = os.path.join(d, "hparams.json")
    good, change = json.load(open(path)), HPARAMS_CORRUPTIONS[how]
    if isinstance(change, str):
        open(path, "w").write(change)
    else:
        json.dump({**good, **change} if isinstance(change, dict) and how != "a key missing" else change,
                  open(path, "w"))
    with pytest.raises(utils.LoadError, match="re-download") as e:
        utils.load_model_dir(d)
    assert "\n" not in str(e.value) and ("hparams.json" in str(e.value) or "tokenizer" in str(e.value))


def test_a_tokenizer_file_that_is_not_one_is_one_clear_error(tmp_path):
    """An HTML page saved as encoder.json (a mirror's error page served with HTTP 200)."""
    d = make_model_dir(str(tmp_path / "m"), "tiny-openai")
    open(os.path.join(d, "encoder.json"), "w").write("<html><body>Not here</body></html>")
    utils.load_encoder.cache_clear()
    with pytest.raises(utils.LoadError, match="encoder.json.*delete them") as e:
        utils.load_model_dir(d)
    assert "\n" not in str(e.value)


def test_a_tiktoken_cache_that_cannot_be_used_is_named_not_the_tokenizer(tmp_path, monkeypatch):
    """tiktoken copies the files into its cache folder: one it cannot write is the folder's fault
    (the message once said to delete the good tokenizer files)."""
    d = make_model_dir(str(tmp_path / "m"), "tiny-openai")
    (tmp_path / "a_file").write_text("x")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "a_file" / "cache"))
    utils.load_encoder.cache_clear()
    with pytest.raises(utils.LoadError, match="cannot use tiktoken's cache folder .*set TIKTOKEN_CACHE_DIR") as e:
        utils.load_encoder(d)
    assert "\n" not in str(e.value) and "delete" not in str(e.value)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # no cache: the files alone
    utils.load_encoder.cache_clear()
    assert utils.load_encoder(d).n_vocab == 50257
    utils.load_encoder.cache_clear()
