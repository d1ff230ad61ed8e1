"""The llama.cpp peer of `benchmark.py --only formats`: the same GPT-2 weights decoded by
llama.cpp, the C/C++ engine most people run on a CPU, in its formats beside ours:
F32 / F16 / Q8_0 (blocks of 32 int8 weights sharing a float16 scale) against our
float32 / bfloat16 / int8.

The weights are written as GGUF, llama.cpp's file format, with the `gguf` package
(as llama.cpp's own convert_hf_to_gguf.py writes GPT-2: its matrices transposed to
[n_out, n_in], the head tied to the embedding, norms, biases and position embeddings
kept float32), to a folder in memory (/dev/shm where there is one: no disk writeback
under the timed runs), and decoded at batch 1 by llama-cpp-python. Both are optional
(`pip install gguf llama-cpp-python`; llama-cpp-python compiles llama.cpp for the CPU
it is built on, see benchmark_results/README.md): where either is missing the
benchmark says so in one line. Only the benchmark imports this file.
"""
import json
import os
import tempfile
import time

import numpy as np

try:
    import gguf
    import llama_cpp
    MISSING = None
except ImportError as e:
    MISSING = f"{e.name} is not installed; pip install gguf llama-cpp-python"

# our format -> llama.cpp's format of the same width
PEER_FORMATS = {"float32": "F32", "bfloat16": "F16", "int8": "Q8_0"}


def version():
    """llama-cpp-python's version and the CPU features its llama.cpp was built for."""
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
    """One GGUF file of the model in peer_format (F32, F16 or Q8_0 for the matrices and
    the embedding; everything else float32), with GPT-2's tokenizer."""
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(hparams["n_layer"])
    writer.add_context_length(hparams["n_ctx"])
    writer.add_embedding_length(hparams["n_embd"])
    writer.add_feed_forward_length(4 * hparams["n_embd"])
    writer.add_head_count(hparams["n_head"])
    writer.add_layer_norm_eps(1e-5)
    writer.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                          "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[peer_format])
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
        elif peer_format == "F16" or a.shape[-1] % 32:  # Q8_0 needs rows of whole blocks; else F16, as convert does
            writer.add_tensor(name, a.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def load(path, n_ctx, n_threads):
    """A llama.cpp context on the file: one sequence, the logits of the last token only."""
    return llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_threads=n_threads,
                           n_threads_batch=n_threads, verbose=False)


def logits(llm):
    """The logits of the last token llm evaluated (a view into llama.cpp's buffer)."""
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
