"""The llama.cpp peer of `benchmark.py --only formats`: the same GPT-2 weights decoded by
llama.cpp, the C/C++ engine most people run on a CPU, in its formats beside ours:
F32 / F16 / Q8_0 (blocks of 32 int8 weights sharing a float16 scale) / Q4_0 (blocks of
32 4-bit weights sharing one) against our float32 / bfloat16 / int8 / int4.

The weights are written as GGUF, llama.cpp's file format, with the `gguf` package
(as llama.cpp's own convert_hf_to_gguf.py writes GPT-2: its matrices transposed to
[n_out, n_in], the head tied to the embedding, norms, biases and position embeddings
kept float32), to a folder in memory (/dev/shm where there is one: no disk writeback
under the timed runs), and decoded at batch 1 by llama-cpp-python. Both are optional
(`pip install gguf llama-cpp-python`; llama-cpp-python compiles llama.cpp for the CPU
it is built on, see benchmark_results/README.md): where either is missing the
benchmark says so in one line.

Each format's llama.cpp runs in a process of its own (peers.py), which alone imports
llama_cpp: the peer_* functions run there. Where one crashes or refuses, its line in the
results says so, and the other formats and the rest of the run go on.
"""
import importlib.util
import json
import os
import tempfile
import time

import numpy as np

from bench import common, peers

MISSING = next((f"{name} is not installed; pip install gguf llama-cpp-python" for name in ("gguf", "llama_cpp")
                if importlib.util.find_spec(name) is None), None)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: GPT-2's tokenizer
HELD = {}  # in a peer's process: GGUF path -> its llama.cpp model

# our format -> llama.cpp's format of the same width
PEER_FORMATS = {"float32": "F32", "bfloat16": "F16", "int8": "Q8_0", "int4": "Q4_0"}


def version():
    """llama-cpp-python's version and the CPU features its llama.cpp was built for."""
    import llama_cpp
    features = llama_cpp.llama_print_system_info().decode().strip()
    return f"llama-cpp-python {llama_cpp.__version__}; {features}"


def gguf_tensors(params):
    """(name, float32 array) in GGUF's names and shapes, from the plain layout: every
    matrix [n_in, n_out] as the checkpoint stores it becomes [n_out, n_in]."""
    yield "token_embd.weight", params["wte"]                              # [n_vocab, n_embd]
    yield "position_embd.weight", params["wpe"]                           # [n_ctx, n_embd]
    for i, block in enumerate(params["blocks"]):
        linear = {"attn_qkv": block["attn"]["c_attn"], "attn_output": block["attn"]["c_proj"],
                  "ffn_up": block["mlp"]["c_fc"], "ffn_down": block["mlp"]["c_proj"]}
        for name, layer in linear.items():
            yield f"blk.{i}.{name}.weight", np.ascontiguousarray(layer["w"].T)  # [n_out, n_in]
            yield f"blk.{i}.{name}.bias", layer["b"]
        for name, norm in (("attn_norm", block["ln_1"]), ("ffn_norm", block["ln_2"])):
            yield f"blk.{i}.{name}.weight", norm["g"]
            yield f"blk.{i}.{name}.bias", norm["b"]
    yield "output_norm.weight", params["ln_f"]["g"]
    yield "output_norm.bias", params["ln_f"]["b"]


def write_gguf(path, params, hparams, encoder_dir, peer_format):
    """One GGUF file of the model in peer_format (F32, F16, Q8_0 or Q4_0 for the matrices
    and the embedding; everything else float32), with GPT-2's tokenizer."""
    import gguf
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(hparams["n_layer"])
    writer.add_context_length(hparams["n_ctx"])
    writer.add_embedding_length(hparams["n_embd"])
    writer.add_feed_forward_length(4 * hparams["n_embd"])
    writer.add_head_count(hparams["n_head"])
    writer.add_layer_norm_eps(1e-5)
    writer.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                          "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[peer_format])
    with open(os.path.join(encoder_dir, "encoder.json"), encoding="utf-8") as f:
        encoder = json.load(f)
    with open(os.path.join(encoder_dir, "vocab.bpe"), encoding="utf-8") as f:
        merges = [line for line in f.read().split("\n")[1:] if line]
    tokens = sorted(encoder, key=encoder.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t == "<|endoftext|>" else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(encoder["<|endoftext|>"])
    writer.add_eos_token_id(encoder["<|endoftext|>"])
    for name, a in gguf_tensors(params):
        a = np.asarray(a, dtype=np.float32)
        if a.ndim < 2 or name == "position_embd.weight" or peer_format == "F32":
            writer.add_tensor(name, a)
        elif peer_format == "F16" or a.shape[-1] % 32:  # Q8_0 / Q4_0 need rows of whole blocks; else F16, as convert does
            writer.add_tensor(name, a.astype(np.float16))
        else:
            qtype = getattr(gguf.GGMLQuantizationType, peer_format)
            writer.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def load(path, n_ctx, n_threads):
    """A llama.cpp context on the file: one sequence, the logits of the last token only."""
    import llama_cpp
    return llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_threads=n_threads,
                           n_threads_batch=n_threads, verbose=False)


def logits(llm):
    """The logits of the last token llm evaluated (a view into llama.cpp's buffer)."""
    import llama_cpp
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))


def last_logits(llm, ids):
    """The logits llama.cpp gives for the token after ids, from a fresh sequence."""
    llm.reset()
    llm.eval(ids)
    return logits(llm).copy()  # [n_vocab]


def greedy_decode_tok_s(llm, prompt, n_tokens):
    """Tokens/s of greedy decoding after the prompt, prefill left out, as our decode rows."""
    llm.reset()
    llm.eval(prompt)
    start = time.perf_counter()
    for _ in range(n_tokens):
        llm.eval([int(np.argmax(logits(llm)))])
    return n_tokens / (time.perf_counter() - start)


def scratch_dir():
    """A temporary folder in memory where the machine has one."""
    return tempfile.TemporaryDirectory(prefix="gpt2-gguf-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)


def peer_open(path, n_ctx, n_threads, ids, want):
    """In the peer's process: load the file, and compare llama.cpp's logits for the token
    after ids with ours (want [n_vocab]): what to record of the file, and the version."""
    HELD[path] = load(path, n_ctx, n_threads)
    got = last_logits(HELD[path], ids)
    return {"version": version(), "logits_max_rel_error": float(np.max(np.abs(got - want)) / np.max(np.abs(want))),
            "same_top1": bool(np.argmax(got) == np.argmax(want))}


def peer_decode_tok_s(path, prompt, n_tokens):
    """In the peer's process: greedy_decode_tok_s on the file peer_open loaded."""
    return greedy_decode_tok_s(HELD[path], prompt, n_tokens)


def peer_close(path):
    """In the peer's process: close the model before its file goes."""
    HELD.pop(path).close()


def fail(record, size, fmt, doing, why):
    """One failed format as the peer's line in the results, and on the screen."""
    record["failed"].append({"size": size, "format": fmt, "while": doing, "why": why})
    print(f"  llama.cpp {fmt} ({size}), {doing}: {why}", flush=True)


def start_peers(params, hparams, size, dtypes, workdir, n_ctx, ids, want):
    """({our format: (its peer process, its GGUF path)}, what to record of them): for each
    of dtypes, the plain-layout params written as GGUF in llama.cpp's format of that width
    and loaded by llama.cpp in a process of its own, its logits for ids checked against
    ours (want). On the F32 file they must be ours, else we would time another model: then
    no format is timed. A format that crashes or refuses is a line in record["failed"]."""
    live, record = {}, {"version": None, "threads": common.cores(), "files": [], "decode": [], "failed": []}
    for dtype in dtypes:
        fmt = PEER_FORMATS[dtype]
        path = os.path.join(workdir, f"gpt2-{size}-{fmt}.gguf")
        start = time.perf_counter()
        try:
            write_gguf(path, params, hparams, os.path.join(ROOT, "tests", "fixtures", "gpt2-tokenizer"), fmt)
        except Exception as e:  # the gguf package's own error: the file is this format's alone
            fail(record, size, fmt, "writing its GGUF", f"{type(e).__name__}: {e}")
            continue
        write_s = time.perf_counter() - start
        peer = peers.start()
        try:
            opened = peers.call(peer, peer_open, path, n_ctx, common.cores(), ids, want)
        except peers.PeerFailed as e:
            peers.stop(peer)
            fail(record, size, fmt, "loading", str(e))
            continue
        record["version"] = opened.pop("version")
        record["files"].append({"size": size, "format": fmt, "mib": os.path.getsize(path) / 2**20,
                                "write_s": write_s, **opened})
        live[dtype] = (peer, path)
        # llama.cpp rounds its own way (its GELU is a float16 table): 0.06% off on a right file
        if fmt == "F32" and opened["logits_max_rel_error"] > 1e-2:
            stop_peers(live)
            fail(record, size, fmt, "checking its logits", f"{opened['logits_max_rel_error']:.2%} off ours, not our "
                 "model (the GGUF is wrong); no format timed")
            return {}, record
    if record["version"]:
        print(f"  llama.cpp peer: {record['version']}", flush=True)
    return live, record


def decode_turn(live, record, dtype, size, prompt, n_tokens):
    """One timed run of the peer in dtype's width (greedy_decode_tok_s): tokens/s, or None
    where it failed now (recorded, and the peer dropped from live)."""
    peer, path = live[dtype]
    try:
        return peers.call(peer, peer_decode_tok_s, path, prompt, n_tokens)
    except peers.PeerFailed as e:
        del live[dtype]
        peers.stop(peer)
        fail(record, size, PEER_FORMATS[dtype], "decoding", str(e))
        return None


def stop_peers(live):
    """Close each peer's model (before its file goes) and end its process."""
    for peer, path in live.values():
        try:
            peers.call(peer, peer_close, path)
        except peers.PeerFailed:
            pass  # a peer that cannot even close: its process ends anyway
        peers.stop(peer)
    live.clear()
