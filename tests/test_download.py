"""Downloads against a local server on 127.0.0.1: complete, resumed, dropped, missing, short."""
import os
import time

import pytest
import requests

import fileserver
import utils
from conftest import make_model_dir

FAST = {"backoff_s": 0.0, "timeout_s": 10.0}


@pytest.fixture
def server(tmp_path):
    """Serves a tiny model under /124M/ exactly as OpenAI's bucket lays it out."""
    make_model_dir(str(tmp_path / "srv" / "124M"), "tiny-openai")
    s = fileserver.start(str(tmp_path / "srv"))
    yield s
    s.shutdown()
    s.server_close()


def served(server, name):
    return open(os.path.join(server.root, "124M", name), "rb").read()


def test_full_download_then_no_network(server, tmp_path):
    d = utils.download_model("124M", str(tmp_path / "models"), base_url=server.url, **FAST)
    for f in utils.OPENAI_FILES:
        assert open(os.path.join(d, f), "rb").read() == served(server, f)
    assert not [f for f in os.listdir(d) if f.endswith(".part")]
    n = len(server.requests)
    utils.load_encoder_hparams_and_params("124M", str(tmp_path / "models"), base_url="http://127.0.0.1:9/none")
    assert len(server.requests) == n  # a complete directory never touches the network


def test_the_small_files_first_then_the_rest(server, tmp_path):
    """main.py fetches the tokenizer and hparams before the weights (to compile the kernels
    while the weights download and load); the full download then fetches only the rest."""
    d = utils.download_model("124M", str(tmp_path / "models"), base_url=server.url, only=utils.SMALL_FILES, **FAST)
    assert sorted(os.listdir(d)) == ["encoder.json", "hparams.json", "vocab.bpe"]
    utils.download_model("124M", str(tmp_path / "models"), base_url=server.url, **FAST)
    got = [path for path, _ in server.requests]
    assert sorted(got) == sorted(f"/124M/{f}" for f in utils.OPENAI_FILES), got  # each file once
    assert sorted(os.listdir(d)) == sorted(utils.OPENAI_FILES)


def test_partial_file_is_resumed_with_a_range_request(server, tmp_path):
    d = tmp_path / "models" / "124M"
    d.mkdir(parents=True)
    name = "model.ckpt.data-00000-of-00001"
    whole = served(server, name)
    (d / (name + ".part")).write_bytes(whole[:1000])
    utils.download_file(f"{server.url}/124M/{name}", str(d / name), **FAST)
    assert (d / name).read_bytes() == whole
    assert (f"/124M/{name}", "bytes=1000-") in server.requests


def test_connection_dropped_mid_file_is_retried_and_resumed(server, tmp_path):
    name = "model.ckpt.data-00000-of-00001"
    server.faults[f"124M/{name}"] = "drop"
    path = tmp_path / name
    utils.download_file(f"{server.url}/124M/{name}", str(path), **FAST)
    assert path.read_bytes() == served(server, name)
    ranges = [r for p, r in server.requests if p.endswith(name)]
    assert ranges[0] is None and ranges[1].startswith("bytes=") and len(ranges) == 2


def test_a_server_that_trickles_has_stalled_and_each_try_resumes_it(server, tmp_path):
    name = "hparams.json"  # ~80 bytes: at a byte every 20 ms, more than the two tries' 0.3 s bring
    server.faults[f"124M/{name}"] = "trickle"
    path = tmp_path / name
    with pytest.raises(utils.LoadError, match=r"after 2 tries \(stalled: under 1,000 bytes in 0.3 s\).*run again to "
                                              "resume"):
        utils.download_file(f"{server.url}/124M/{name}", str(path), retries=2, stall_s=0.3, stall_bytes=1000, **FAST)
    assert not path.exists()
    kept = (tmp_path / f"{name}.part").read_bytes()
    assert 0 < len(kept) < len(served(server, name)) and served(server, name).startswith(kept)
    ranges = [r for p, r in server.requests if p.endswith(name)]
    assert ranges[0] is None and ranges[1].startswith("bytes=") and len(ranges) == 2


def test_a_slow_server_above_the_stall_floor_is_waited_for(server, tmp_path):
    name = "hparams.json"
    server.faults[f"124M/{name}"] = "trickle"
    path = tmp_path / name  # ~25 bytes a window of 0.5 s: a pause of 0.45 s would be a stall
    utils.download_file(f"{server.url}/124M/{name}", str(path), retries=1, stall_s=0.5, stall_bytes=3, **FAST)
    assert path.read_bytes() == served(server, name)


def test_headers_that_trickle_have_stalled(server, tmp_path):
    """requests' timeout bounds each read: headers a byte at a time would hold a download forever."""
    name = "hparams.json"
    server.faults[f"124M/{name}"] = "header_trickle"
    start = time.monotonic()
    with pytest.raises(utils.LoadError, match=r"after 2 tries \(stalled: no response in 0.5 s\)"):
        utils.download_file(f"{server.url}/124M/{name}", str(tmp_path / name), retries=2, stall_s=0.5, **FAST)
    assert time.monotonic() - start < 10 and not (tmp_path / name).exists()


def test_a_redirects_body_is_never_read(server, tmp_path):
    """requests reads a redirect's body whole, even when told not to follow it: one that never
    ends would hold the download forever (or fill the memory, sent fast)."""
    name = "hparams.json"
    server.faults[f"124M/{name}"] = "redirect_trickle"
    start = time.monotonic()
    utils.download_file(f"{server.url}/124M/{name}", str(tmp_path / name), stall_s=5, **FAST)
    assert time.monotonic() - start < 5 and (tmp_path / name).read_bytes() == served(server, name)
    assert [p for p, _ in server.requests] == [f"/124M/{name}", f"/{fileserver.LFS}124M/{name}"]


def test_a_whole_part_is_checked_not_downloaded_again(server, tmp_path):
    """A run that stopped after the last byte (before the checks or the rename) leaves a whole
    .part: the server's 416 names its length, and the .part is checked and renamed."""
    d = tmp_path / "models" / "124M"
    d.mkdir(parents=True)
    (d / utils.TF_INDEX).write_bytes(served(server, utils.TF_INDEX))
    (d / (utils.TF_DATA + ".part")).write_bytes(served(server, utils.TF_DATA))
    utils.download_model("124M", str(tmp_path / "models"), base_url=server.url, only=(utils.TF_DATA,), **FAST)
    assert (d / utils.TF_DATA).read_bytes() == served(server, utils.TF_DATA)
    assert [r for p, r in server.requests if p.endswith(utils.TF_DATA)] == [f"bytes={len(served(server, utils.TF_DATA))}-"]


def test_the_hubs_sha256_is_read_in_either_case():
    chain = [requests.Response() for _ in range(2)]
    chain[0].headers["X-Linked-Etag"] = '"' + "AB" * 32 + '"'
    assert utils.linked_sha256(chain) == "ab" * 32
    chain[0].headers["X-Linked-Etag"] = 'W/"' + "cd" * 32 + '"'
    assert utils.linked_sha256(chain) == "cd" * 32
    chain[0].headers["X-Linked-Etag"] = "W/abc"
    assert utils.linked_sha256(chain) is None


def test_an_answer_that_is_not_the_file_never_gets_its_name(tmp_path):
    """A 304, or a 3xx with no Location, is no file's bytes: one line, nothing under the name."""
    r = requests.Response()
    r.status_code, r.headers["Content-Length"] = 304, "0"
    with pytest.raises(utils.LoadError, match="answered HTTP 304, not the file"):
        utils.receive("http://127.0.0.1:9/x", r, str(tmp_path / "x.part"), 0, 60.0, 1000)
    assert not os.listdir(tmp_path)


def test_a_body_that_does_not_decode_is_one_clear_error(server, tmp_path):
    name = "hparams.json"
    server.faults[f"124M/{name}"] = "not_gzip"
    with pytest.raises(utils.LoadError, match=r"could not download .*hparams.json \(ContentDecodingError\): check "
                                              "--base_url"):
        utils.download_file(f"{server.url}/124M/{name}", str(tmp_path / name), **FAST)
    assert not (tmp_path / name).exists()


def test_server_without_range_support_restarts_cleanly(tmp_path):
    make_model_dir(str(tmp_path / "srv" / "124M"), "tiny-openai")
    s = fileserver.start(str(tmp_path / "srv"), ranges=False)
    try:
        name = "encoder.json"
        (tmp_path / (name + ".part")).write_bytes(b"stale bytes")
        utils.download_file(f"{s.url}/124M/{name}", str(tmp_path / name), **FAST)
        assert (tmp_path / name).read_bytes() == open(tmp_path / "srv" / "124M" / name, "rb").read()
    finally:
        s.shutdown()
        s.server_close()


def test_404_is_one_clear_error_and_leaves_nothing(server, tmp_path):
    (tmp_path / "dl").mkdir()
    with pytest.raises(utils.LoadError, match="HTTP 404"):
        utils.download_file(f"{server.url}/124M/nope", str(tmp_path / "dl" / "nope"), **FAST)
    assert os.listdir(tmp_path / "dl") == []


def test_a_download_that_wrote_nothing_leaves_no_folder(server, tmp_path):
    """A refused connection makes neither models_dir nor its model's folder; one that wrote a
    .part keeps it (and so its folder), for the next run to resume."""
    models = tmp_path / "models"
    with pytest.raises(utils.LoadError, match="cannot connect"):
        utils.download_model("124M", str(models), base_url="http://127.0.0.1:9", retries=1, **FAST)
    assert not models.exists()
    server.faults["124M/vocab.bpe"] = "always_short"
    with pytest.raises(utils.LoadError, match="after 1 tries"):
        utils.download_model("124M", str(models), base_url=server.url, only=["vocab.bpe"], retries=1, **FAST)
    assert os.listdir(models / "124M") == ["vocab.bpe.part"]


def test_wrong_size_never_becomes_a_complete_file(server, tmp_path):
    name = "vocab.bpe"
    server.faults[f"124M/{name}"] = "always_short"
    d = tmp_path / "models" / "124M"
    d.mkdir(parents=True)
    with pytest.raises(utils.LoadError, match="could not download .* after 3 tries"):
        utils.download_file(f"{server.url}/124M/{name}", str(d / name), retries=3, **FAST)
    assert not (d / name).exists()  # only the .part remains, which no later run takes as complete
    with pytest.raises(utils.LoadError):
        utils.load_model_dir(str(d))


@pytest.fixture
def hub(tmp_path):
    """Serves a tiny model as the Hugging Face hub lays it out, model.safetensors through
    the redirect that names its SHA-256."""
    root = tmp_path / "srv" / "openai-community" / "gpt2" / "resolve" / "main"
    make_model_dir(str(root), "tiny-hf")
    os.rename(root / "encoder.json", root / "vocab.json")
    os.rename(root / "vocab.bpe", root / "merges.txt")
    s = fileserver.start(str(tmp_path / "srv"), lfs=True)
    yield s
    s.shutdown()
    s.server_close()


def test_hf_source_downloads_and_loads(hub, tmp_path):
    enc, hparams, params = utils.load_encoder_hparams_and_params(
        "124M", str(tmp_path / "models"), source="hf", base_url=hub.url, **FAST)
    assert hparams["n_embd"] == 16 and enc.encode("Hello, world!") == [15496, 11, 995, 0]
    assert sorted(os.listdir(tmp_path / "models" / "124M")) == sorted(utils.HF_FILES)
    assert any(path.startswith("/" + fileserver.LFS) for path, _ in hub.requests)  # by the redirect


def test_hf_weights_that_are_not_the_sha256_the_hub_names_are_removed(hub, tmp_path):
    hub.faults["openai-community/gpt2/resolve/main/model.safetensors"] = "flip"
    models = tmp_path / "models"
    with pytest.raises(utils.LoadError, match=r"model.safetensors arrived damaged \(its SHA-256 is not the [0-9a-f]{12}"
                                              r"\.\.\. the server names\); removed it: run again") as e:
        utils.download_model("124M", str(models), source="hf", base_url=hub.url, **FAST)
    assert "\n" not in str(e.value)
    assert not [f for f in os.listdir(models / "124M") if f.startswith("model.safetensors")]
    utils.load_encoder_hparams_and_params("124M", str(models), source="hf", base_url=hub.url, **FAST)


def test_base_url_from_environment(monkeypatch):
    monkeypatch.setenv(utils.BASE_URL_ENV, "http://127.0.0.1:1/mirror/")
    assert utils.file_urls("355M")["vocab.bpe"] == "http://127.0.0.1:1/mirror/355M/vocab.bpe"
    monkeypatch.delenv(utils.BASE_URL_ENV)
    assert utils.file_urls("1558M", "hf")["model.safetensors"] == \
        "https://huggingface.co/openai-community/gpt2-xl/resolve/main/model.safetensors"


def test_unwritable_models_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(utils.LoadError, match="cannot write"):
        utils.download_model("124M", str(blocker / "models"))


@pytest.mark.parametrize("fault", ["range_ignored", "range_short"])
def test_a_resume_that_is_not_the_rest_of_the_file_starts_over(server, tmp_path, fault):
    """A 206 whose Content-Range does not begin where the .part ends would be appended to it
    (the weights shifted, silently), and one that ends before the file does would leave it
    short under its final name: the download starts over instead."""
    name = "model.ckpt.data-00000-of-00001"
    whole = served(server, name)
    (tmp_path / (name + ".part")).write_bytes(whole[:1000])
    server.faults[f"124M/{name}"] = fault
    utils.download_file(f"{server.url}/124M/{name}", str(tmp_path / name), **FAST)
    assert (tmp_path / name).read_bytes() == whole


def test_a_server_that_would_compress_sends_the_bytes_as_stored(server, tmp_path):
    """requests asks for gzip unless told otherwise, and a compressed body's length is not the
    file's: every try would fail its size check."""
    server.faults["124M/encoder.json"] = "gzip"
    utils.download_file(f"{server.url}/124M/encoder.json", str(tmp_path / "encoder.json"), **FAST)
    assert (tmp_path / "encoder.json").read_bytes() == served(server, "encoder.json")


@pytest.mark.parametrize("fault, says", [("endless", "Content-Length 1000000000000000"),
                                         ("superscript", "Content-Length \xb2"), ("redirect_loop", "TooManyRedirects")])
def test_a_server_that_is_not_a_checkpoints_is_one_clear_error(server, tmp_path, fault, says):
    """A length no GPT-2 file has (refused before a byte is written) and a redirect loop: one
    line naming the URL and --base_url, no traceback, nothing under the file's name."""
    server.faults["124M/hparams.json"] = fault
    with pytest.raises(utils.LoadError, match=f"{says}.*--base_url") as e:
        utils.download_file(f"{server.url}/124M/hparams.json", str(tmp_path / "hparams.json"), **FAST)
    assert "\n" not in str(e.value) and not (tmp_path / "hparams.json").exists()


def test_damaged_weights_are_removed_not_renamed_and_the_next_run_downloads_them(server, tmp_path):
    """A data file of the right size with one bit changed fails the index's crc32c: one line,
    nothing under its name and no .part to resume from; the next run gets the whole file."""
    name = utils.TF_DATA
    server.faults[f"124M/{name}"] = "flip"
    models = str(tmp_path / "models")
    with pytest.raises(utils.LoadError, match=r"does not match model.ckpt.index \(the bytes of model/\S+ do not have "
                                              r"the crc32c.*removed both: run again") as e:
        utils.download_model("124M", models, base_url=server.url, **FAST)
    assert "\n" not in str(e.value)
    left = os.listdir(os.path.join(models, "124M"))
    assert not {name, name + ".part", utils.TF_INDEX} & set(left), left  # the next run fetches a matching pair
    d = utils.download_model("124M", models, base_url=server.url, **FAST)
    assert open(os.path.join(d, name), "rb").read() == served(server, name)


def test_a_resume_spliced_onto_another_file_fails_the_check(server, tmp_path):
    """A .part left by another version of the file (its first bytes differ) resumes to the
    right size with the wrong content: the check removes it."""
    d = tmp_path / "models" / "124M"
    d.mkdir(parents=True)
    (d / utils.TF_INDEX).write_bytes(served(server, utils.TF_INDEX))
    (d / (utils.TF_DATA + ".part")).write_bytes(bytes(1000))
    with pytest.raises(utils.LoadError, match="does not match model.ckpt.index"):
        utils.download_model("124M", str(tmp_path / "models"), base_url=server.url, **FAST)
    assert (f"/124M/{utils.TF_DATA}", "bytes=1000-") in server.requests
    assert not (d / utils.TF_DATA).exists() and not (d / (utils.TF_DATA + ".part")).exists()


def test_the_data_file_alone_brings_its_index_to_be_checked_against(server, tmp_path):
    d = utils.download_model("124M", str(tmp_path / "models"), base_url=server.url, only=(utils.TF_DATA,), **FAST)
    assert sorted(os.listdir(d)) == sorted([utils.TF_INDEX, utils.TF_DATA])


@pytest.mark.parametrize("fault", ["flip", "html"])
def test_an_index_that_is_not_one_is_removed_before_the_data_downloads(server, tmp_path, fault):
    """A damaged index (LevelDB stores each block's crc32c) or an error page in its place: one
    line naming it when it arrives, not a data file blamed for it after gigabytes."""
    if fault == "html":
        open(os.path.join(server.root, "124M", utils.TF_INDEX), "wb").write(b"<html>Not Found</html>" * 10)
    else:
        server.faults[f"124M/{utils.TF_INDEX}"] = "flip"
    models = tmp_path / "models"
    with pytest.raises(utils.LoadError, match="model.ckpt.index arrived damaged .*removed it: run again") as e:
        utils.download_model("124M", str(models), base_url=server.url, **FAST)
    assert "\n" not in str(e.value)
    assert not [f for f in os.listdir(models / "124M") if f.startswith("model.ckpt")]
    assert f"/124M/{utils.TF_DATA}" not in [path for path, _ in server.requests]
