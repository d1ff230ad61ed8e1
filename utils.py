"""picoGPT's utils: download GPT-2, read its hparams and tokenizer, load its weights.

`load_encoder_hparams_and_params(size)` downloads whatever is missing (resumable,
atomic: a file gets its final name only when complete and, for the weights, checked
against the index's checksums), builds GPT-2's byte-level BPE with tiktoken from the
downloaded files, and reads the weights through checkpoint.py (which parses the formats).
The weight matrices are then copied once, into the layout that the kernels read fastest
(kernels/layout.py: `decode_layout`; its `to_backend` moves the params to a GPU with CuPy
when asked).
"""
import contextlib
import functools
import hashlib
import json
import os
import queue
import re
import threading
import time
import urllib.parse

import requests
import tiktoken
import urllib3
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import r50k_pat_str
from tqdm import tqdm

import checkpoint
from kernels import layout
from checkpoint import LoadError  # the one error a user can fix: its message says how
from checkpoint import TF_DATA, TF_INDEX

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
OPENAI_FILES = ("checkpoint", "encoder.json", "hparams.json", TF_INDEX, TF_DATA, "vocab.bpe")
HF_FILES = ("config.json", "model.safetensors", "vocab.json", "merges.txt")
# the tokenizer and hparams of either layout: main.py fetches them first (kernels/compiling.py)
SMALL_FILES = ("encoder.json", "vocab.bpe", "hparams.json", "config.json", "vocab.json", "merges.txt")
SOURCES = ("openai", "hf")
EOT_TOKEN = "<|endoftext|>"


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


STALL_BYTES = 64 << 10  # a minute's: 1 KiB/s, at which 124M would take 6 days
MOST_BYTES = 8 << 30  # more than any GPT-2 file (1558M's data: 6.2 GB): a server promising more is not one


def download_file(url, path, retries=5, backoff_s=1.0, timeout_s=30.0, stall_s=60.0, stall_bytes=STALL_BYTES,
                  check=None):
    """Stream `url` to `path`, atomically: bytes go to `path.part`, which is resumed
    with an HTTP Range request after an interruption and renamed to `path` only
    when its size equals the server's Content-Length, its SHA-256 the one the server names
    (where it names one: `linked_sha256`) and `check(part)`, where given, returns (it
    raises a LoadError for a file whose content is wrong). Bytes come as stored
    (Accept-Encoding: identity: a compressed body's length is not the file's), and a
    resumed body must start where the .part ends (its Content-Range), else it starts over.
    A try that brings under stall_bytes in stall_s seconds has stalled (timeout_s bounds
    only each read, which a byte at a time resets) and the next try resumes it."""
    part = path + ".part"
    error = None
    for attempt in range(retries):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        have = os.path.getsize(part) if os.path.exists(part) else 0
        headers = {"Accept-Encoding": "identity", **({"Range": f"bytes={have}-"} if have else {})}
        try:
            with responding(url, headers, timeout_s, stall_s) as chain:
                r = chain[-1]
                if r.status_code == 416 and is_whole(r.headers, have):
                    total = have  # a run that stopped after the last byte, before the checks or the rename
                else:
                    total = receive(url, r, part, have, stall_s, stall_bytes)
            size = os.path.getsize(part)
            if size != total:
                raise _Retry(f"got {size} of {total} bytes")
            sha256 = linked_sha256(chain)
            if sha256 is not None and sha256_of(part) != sha256:
                os.remove(part)
                raise LoadError(f"{url} arrived damaged (its SHA-256 is not the {sha256[:12]}... the server names); "
                                f"removed it: run again to download it afresh, or check --base_url / ${BASE_URL_ENV}")
            if check is not None:
                check(part)
            os.replace(part, path)
            return path
        except (_Retry, requests.ConnectionError, requests.Timeout,
                requests.exceptions.ChunkedEncodingError) as e:
            error = e
        except requests.RequestException as e:  # a redirect loop, a body that does not decode...
            raise LoadError(f"could not download {url} ({type(e).__name__}): check --base_url / ${BASE_URL_ENV}")
        except OSError as e:
            raise LoadError(f"cannot write {part} ({e.strerror}): free some space or pass another --models_dir, "
                            "then run again to resume")
    reason = {requests.ConnectionError: "cannot connect", requests.Timeout: "timed out",
              requests.ReadTimeout: "timed out",
              requests.exceptions.ChunkedEncodingError: "connection dropped"}.get(type(error), str(error))
    raise LoadError(f"could not download {url} after {retries} tries ({reason}); "
                    f"check your network or --base_url, then run again to resume")


def receive(url, r, part, have, stall_s, stall_bytes):
    """A response's body appended to the .part (a 206 that continues it) or written over it;
    returns the size the file will have."""
    resumed = r.status_code == 206
    if r.status_code == 416 or resumed and not continues(r.headers, have):
        with contextlib.suppress(FileNotFoundError):  # the .part is not what the server would continue
            os.remove(part)
        raise _Retry("server did not resume where the download stopped; starting over")
    if r.status_code in (401, 403, 404):
        raise LoadError(f"{url} answered HTTP {r.status_code}: check --base_url / ${BASE_URL_ENV}")
    if r.status_code >= 400:
        raise _Retry(f"HTTP {r.status_code}")
    if r.status_code not in (200, 206):  # a 204, a 304, a 3xx with no Location: no file's bytes
        raise LoadError(f"{url} answered HTTP {r.status_code}, not the file: check --base_url / ${BASE_URL_ENV}")
    length = r.headers.get("Content-Length", "")
    if not re.fullmatch(r"[0-9]+", length) or int(length) > MOST_BYTES:
        raise LoadError(f"{url} sent Content-Length {length or 'none'}, so the download cannot be "
                        "verified: check --base_url / $" + BASE_URL_ENV)
    total = (have if resumed else 0) + int(length)
    with open(part, "ab" if resumed else "wb") as f, tqdm(
            total=total, initial=have if resumed else 0, unit="B", unit_scale=True,
            desc=os.path.basename(part[:-len(".part")]), leave=False) as bar:
        since, got = time.monotonic(), 0  # the window the stall check counts over
        for chunk in arriving(r):
            f.write(chunk)
            bar.update(len(chunk))
            got += len(chunk)
            if time.monotonic() - since >= stall_s:
                if got < stall_bytes:
                    raise _Retry(f"stalled: under {stall_bytes:,} bytes in {stall_s:g} s")
                since, got = time.monotonic(), 0
    return total


MOST_REDIRECTS = 10


@contextlib.contextmanager
def responding(url, headers, timeout_s, deadline_s):
    """The streamed responses of a GET of `url`: the redirects that led to the last, then the
    last, whose body is left to read. Two things requests' timeout (a bound on each read)
    leaves open are bounded here: a status line and headers that come a byte at a time get
    deadline_s in all (`within`), and a redirect's body is never read (a Session reads it
    whole, however long it runs, even when told not to follow: so each hop goes to its
    adapter, with the settings the environment gives a Session, proxies included)."""
    chain, session = [], requests.Session()
    try:
        for _ in range(MOST_REDIRECTS + 1):
            request = session.prepare_request(requests.Request("GET", url, headers=headers))
            settings = session.merge_environment_settings(request.url, {}, True, None, None)
            send = session.get_adapter(request.url).send
            chain.append(within(deadline_s, functools.partial(send, request, timeout=timeout_s, **settings)))
            if not chain[-1].is_redirect:
                yield chain
                return
            url = urllib.parse.urljoin(url, chain[-1].headers["Location"])
        raise requests.TooManyRedirects(f"more than {MOST_REDIRECTS} redirects")
    finally:
        for r in chain:
            r.close()
        session.close()


def within(seconds, fn):
    """fn() on a thread of its own, waited for `seconds` at most, after which the try has
    stalled (the thread, a daemon, is left to the server's next byte or the process's end)."""
    out = queue.Queue()

    def run():
        try:
            out.put((True, fn()))
        except Exception as e:  # raised where the caller waits
            out.put((False, e))
    threading.Thread(target=run, daemon=True).start()
    try:
        ok, value = out.get(timeout=seconds)
    except queue.Empty:
        raise _Retry(f"stalled: no response in {seconds:g} s") from None
    if not ok:
        raise value
    return value


def is_whole(headers, have):
    """Whether a 416 (the Range asked starts at the file's end) names the file's length as the
    .part's (`bytes */have`): the .part is whole already."""
    return have > 0 and re.fullmatch(rf"bytes \*/{have}", headers.get("Content-Range", "").strip(), re.IGNORECASE) is not None


def arriving(r, most=1 << 20):
    """A streamed response's body as it arrives, at most `most` bytes a piece: urllib3's read1
    returns what one read of the socket brings, where iter_content waits until `most` have come
    (so a trickle would never reach the stall check). urllib3's errors become requests' own, as
    iter_content makes them."""
    try:
        while piece := r.raw.read1(most, decode_content=True):
            yield piece
    except urllib3.exceptions.ReadTimeoutError as e:
        raise requests.exceptions.ReadTimeout(e) from None
    except urllib3.exceptions.ProtocolError as e:  # a connection reset or closed early
        raise requests.exceptions.ChunkedEncodingError(e) from None
    except urllib3.exceptions.DecodeError as e:
        raise requests.exceptions.ContentDecodingError(e) from None
    except urllib3.exceptions.SSLError as e:
        raise requests.exceptions.SSLError(e) from None


def linked_sha256(chain):
    """The SHA-256 of the file a chain of responses brings, where the server names it: the
    Hugging Face hub answers a download of a file it keeps in LFS (model.safetensors) with a
    redirect whose X-Linked-Etag is the file's SHA-256; None for a server that names none."""
    for response in chain:
        m = re.fullmatch(r'(?:w/)?"?([0-9a-f]{64})"?', response.headers.get("X-Linked-Etag", "").strip().lower())
        if m:
            return m[1]
    return None


def continues(headers, have):
    """Whether a 206's body is the rest of a file whose first `have` bytes the .part holds:
    its Content-Range runs from `have` to the file's last byte (of a length it names), as long
    as its Content-Length."""
    m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", headers.get("Content-Range", "").strip(), re.IGNORECASE)
    if not m or not re.fullmatch(r"[0-9]+", headers.get("Content-Length", "")):
        return False
    first, last, whole = int(m[1]), int(m[2]), m[3]
    return first == have and last - first + 1 == int(headers["Content-Length"]) and last + 1 == int(whole)


def is_complete(model_dir):
    """A model in either layout: weights, hparams and tokenizer, each under either naming."""
    have = lambda *names: all(os.path.exists(os.path.join(model_dir, n)) for n in names)
    return ((have(TF_INDEX, TF_DATA, "hparams.json")
             or have("model.safetensors", "config.json"))
            and (have("vocab.bpe", "encoder.json") or have("merges.txt", "vocab.json")))


def download_model(model_size, models_dir="models", source="openai", base_url=None, only=None, **download_kw):
    """Make sure models_dir/model_size holds every file (or those named in `only`); returns
    that directory. Files already there are complete (only verified files get their final
    name), so a full directory never touches the network."""
    urls = file_urls(model_size, source, base_url)
    model_dir = os.path.join(models_dir, model_size)
    if is_complete(model_dir):
        return model_dir
    missing = [f for f in urls if not os.path.exists(os.path.join(model_dir, f)) and (only is None or f in only)]
    made = [d for d in (models_dir, model_dir) if not os.path.isdir(d)]  # the folders this call makes
    try:
        os.makedirs(model_dir, exist_ok=True)
        probe = os.path.join(model_dir, ".write-test")
        open(probe, "wb").close()
        os.remove(probe)
    except OSError as e:
        raise LoadError(f"cannot write to {model_dir} ({e.strerror}): pass a writable --models_dir")
    if TF_DATA in missing and TF_INDEX not in missing and not os.path.exists(os.path.join(model_dir, TF_INDEX)):
        missing.insert(missing.index(TF_DATA), TF_INDEX)  # the data is checked against it
    try:
        for f in missing:
            check = {TF_INDEX: functools.partial(check_tf_index, urls[f]),
                     TF_DATA: functools.partial(check_tf_data, model_dir, urls[f])}.get(f)
            download_file(urls[f], os.path.join(model_dir, f), check=check, **download_kw)
    except LoadError:
        for d in reversed(made):  # a download that wrote nothing leaves no empty folder (a .part stays, to resume)
            with contextlib.suppress(OSError):
                os.rmdir(d)
        raise
    return model_dir


def check_tf_index(url, part):
    """A downloaded index that is not one GPT-2's reader can map (an error page, a damaged
    copy: LevelDB stores each block's crc32c) is removed, not renamed."""
    try:
        checkpoint.read_checked_index(part)
    except (ValueError, LoadError) as e:
        os.remove(part)
        raise LoadError(f"{url} arrived damaged ({e}); removed it: run again to download it afresh, or check "
                        f"--base_url / ${BASE_URL_ENV}")


def check_tf_data(model_dir, url, part):
    """A downloaded data file whose bytes are not what the index says (a damaged transfer, a
    resume spliced onto another file, an index of another version) is removed, not renamed,
    and the index with it, so that the next run fetches a matching pair: each tensor's crc32c
    against the one the index stores, as every load checks them."""
    index_path = os.path.join(model_dir, TF_INDEX)
    try:
        checkpoint.tf_tensors(checkpoint.read_checked_index(index_path), part)
    except (ValueError, LoadError) as e:
        for path in (part, index_path):
            os.remove(path)
        raise LoadError(f"{url} does not match {TF_INDEX} ({e}); removed both: run again to download them afresh, "
                        f"or check --base_url / ${BASE_URL_ENV}")


# ------------------------------------------------------------------ loading --

HPARAMS_MOST = {"n_vocab": 1 << 24, "n_ctx": 1 << 20, "n_embd": 1 << 16, "n_head": 1 << 10, "n_layer": 1 << 10}


def load_hparams(model_dir):
    """GPT-2's hparams (n_vocab, n_ctx, n_embd, n_head, n_layer) from either layout, each
    checked (an int of a sane size, n_head dividing n_embd): a LoadError names the wrong one."""
    hparams_path = os.path.join(model_dir, "hparams.json")
    path = hparams_path if os.path.exists(hparams_path) else os.path.join(model_dir, "config.json")
    with open(path) as f:
        try:
            h = json.load(f)
        except RecursionError:
            raise ValueError("nested too deeply")
    if path != hparams_path and isinstance(h, dict):
        h = {name: h.get(key) for name, key in (("n_vocab", "vocab_size"), ("n_ctx", "n_positions"),
                                                ("n_embd", "n_embd"), ("n_head", "n_head"), ("n_layer", "n_layer"))}
    for name, most in HPARAMS_MOST.items():
        value = h.get(name) if isinstance(h, dict) else None
        if type(value) is not int or not 1 <= value <= most:
            raise LoadError(f"{path}: {name} must be an integer from 1 to {most}, got {value!r}; delete the file "
                            "and run again to re-download")
    if h["n_embd"] % h["n_head"]:
        raise LoadError(f"{path}: n_head {h['n_head']} does not divide n_embd {h['n_embd']}; delete the file and "
                        "run again to re-download")
    return {name: h[name] for name in HPARAMS_MOST}


@functools.lru_cache(maxsize=None)  # main.py reads it before the weights, to know the prompts' lengths
def load_encoder(model_dir):
    """GPT-2's byte-level BPE as a tiktoken Encoding, built from the downloaded files
    (encoder.json + vocab.bpe, or the same content as vocab.json + merges.txt)."""
    names = [("vocab.bpe", "encoder.json"), ("merges.txt", "vocab.json")]
    for bpe, enc in names:
        bpe_path, enc_path = os.path.join(model_dir, bpe), os.path.join(model_dir, enc)
        if os.path.exists(bpe_path) and os.path.exists(enc_path):
            try:  # hashing our own files lets tiktoken's cache tell one file from another
                ranks = data_gym_to_mergeable_bpe_ranks(bpe_path, enc_path, sha256_of(bpe_path), sha256_of(enc_path))
            except (OSError, ValueError, KeyError, TypeError, AttributeError, AssertionError, RecursionError) as e:
                if isinstance(e, OSError) and e.filename not in (bpe_path, enc_path):  # tiktoken's copy of them
                    raise LoadError(f"cannot use tiktoken's cache folder ({type(e).__name__}: {e}): set "
                                    "TIKTOKEN_CACHE_DIR to a writable folder, or to an empty string for none")
                raise LoadError(f"{bpe_path} and {enc_path} are not GPT-2's tokenizer ({type(e).__name__}: {e}); "
                                "delete them and run again to re-download")
            return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                     special_tokens={EOT_TOKEN: len(ranks)})
    raise LoadError(f"no tokenizer files (vocab.bpe + encoder.json) in {model_dir}")


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(1 << 24):
            h.update(piece)
    return h.hexdigest()


def load_encoder_hparams_and_params(model_size, models_dir="models", source="openai", base_url=None,
                                    dtype="float32", **download_kw):
    """picoGPT's entry point: download what is missing, then (encoder, hparams, params)."""
    model_dir = download_model(model_size, models_dir, source, base_url, **download_kw)
    return load_model_dir(model_dir, dtype)


def check_vocabulary(model_dir, hparams, encoder):
    """A model scores every token its tokenizer makes, and no other: fewer rows of wte would
    leave token ids that index nothing (beam search's took a row past the end)."""
    if hparams["n_vocab"] != encoder.n_vocab:
        raise LoadError(f"{model_dir}: the model has {hparams['n_vocab']} tokens, its tokenizer {encoder.n_vocab}: "
                        "delete the directory and run again to re-download")


def load_model_dir(model_dir, dtype="float32"):
    """(encoder, hparams, params) from a directory that already holds a model, its
    matrices in the format dtype (kernels/weight_formats.py), converted from the checkpoint's
    float32 as they are laid out."""
    try:
        hparams = load_hparams(model_dir)
    except (OSError, ValueError, KeyError) as e:
        raise LoadError(f"cannot read hparams.json / config.json in {model_dir} ({e}): delete it and run again "
                        "to re-download")
    encoder = load_encoder(model_dir)
    check_vocabulary(model_dir, hparams, encoder)
    try:
        params = checkpoint.load_params(model_dir, hparams["n_layer"])
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise LoadError(f"cannot read the checkpoint in {model_dir} ({type(e).__name__}: {e}); delete it and run "
                        "again to re-download")
    checkpoint.check_params(params, hparams)
    return encoder, hparams, layout.decode_layout(params, dtype=dtype)
