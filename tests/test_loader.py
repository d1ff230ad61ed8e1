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


def test_tiny_checkpoint_crc32c_verifies(tmp_path):
    d = make_model_dir(str(tmp_path / "m"), "tiny-openai")
    checkpoint.load_tf_checkpoint(d, verify_crc=True)
    data = os.path.join(d, "model.ckpt.data-00000-of-00001")
    raw = bytearray(open(data, "rb").read())
    raw[100] ^= 0xFF  # flip bits inside the first tensor
    open(data, "wb").write(bytes(raw))
    with pytest.raises(utils.LoadError, match="crc32c"):
        checkpoint.load_tf_checkpoint(d, verify_crc=True)


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
    params = dict(tiny[2], ln_f={"g": tiny[2]["ln_f"]["g"]})
    with pytest.raises(utils.LoadError, match="ln_f/b"):
        checkpoint.check_params(params, tiny[1])


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
