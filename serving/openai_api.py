"""The OpenAI completions API: what a request body may say, what it asks the engine for,
and how the engine's tokens become the text a client reads.

The fields mean what they mean in the OpenAI completions API as vLLM serves it
(https://platform.openai.com/docs/api-reference/completions, https://docs.vllm.ai), with
vLLM's extras top_k, min_p, repetition_penalty and ignore_eos. The bodies are pydantic
models: a field of the wrong type or out of range is refused before anything runs, with
the field's name (server.py turns that into OpenAI's error envelope, status 400). What a
schema cannot say (it needs the tokenizer, the model or the server's flags) is checked in
`to_requests`, and batching.check_request stays the last word on what the engine accepts.

A request's text is what main.py prints for the same prompt, settings and seed: choice i of
prompt j samples with (seed + j * n + i) mod 2^64 (a seed a request may send) from its own
random stream, whoever else the server is answering.
"""
import codecs
import re
import secrets
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

import batching
import sampling
import utils

MAX_N = 16  # choices per prompt
# characters a stop string may have: more than a whole window of text, and a bound on what a
# request can make the server compare (OpenAI and vLLM set none; TGI bounds their number)
MAX_STOP_CHARS = 4096
NOT_IMPLEMENTED = {"logit_bias": "logit_bias is not implemented by this server; leave it out",
                   "suffix": "suffix (insertion) is not implemented by this server; leave it out"}

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class ApiError(Exception):
    """A request the API refuses: HTTP status, message, and the field at fault (OpenAI's error body)."""

    def __init__(self, message, param=None, status=400, kind="invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """POST /v1/completions. Strict: 2.5 is not an integer, "yes" not a boolean, NaN not a
    number; a field the API does not have is refused (a typo must not pass as a default)."""
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    model: str | None = None
    prompt: str | Annotated[list[str], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    max_tokens: int = Field(16, ge=1)
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    stop: StopString | Annotated[list[StopString], Field(max_length=4)] | None = None
    seed: int | None = Field(None, ge=0, lt=2 ** 64)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(0, ge=-1)  # vLLM: -1 or 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    user: str | None = None  # a caller's tag for abuse monitoring at OpenAI; taken, and unused here

    @field_validator("*", mode="before")
    @classmethod
    def null_is_the_default(cls, value, info):
        """null means "the default", as OpenAI's API takes it."""
        field = cls.model_fields[info.field_name]
        return field.default if value is None and not field.is_required() else value


class Logprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class Choice(BaseModel):
    index: int
    text: str
    logprobs: Logprobs | None
    finish_reason: Literal["stop", "length"] | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # a prompt's tokens none of its choices computed: copied (serving/prefix_cache.py)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class Completion(BaseModel):
    """A whole response, or one event of a stream (a few choices' new text, or the usage)."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


# a \uD800-\uDBFF escape not followed by a \uDC00-\uDFFF one, or the second without the first
LONE_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                            rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def parse(raw):
    """The body as a CompletionRequest, or an ApiError that names the field at fault."""
    try:
        return CompletionRequest.model_validate_json(raw or b"null")
    except ValidationError as e:
        lone = LONE_SURROGATE.search(raw or b"")
        if lone and "hex escape" in str(e):  # the JSON parser's own words ("end of hex escape") mislead
            raise ApiError(f"body: {lone[0].decode()} at byte {lone.start()} is half of a UTF-16 surrogate pair "
                           f"without its other half: JSON text must be valid Unicode")
        errors = e.errors()
        loc = errors[0]["loc"][:1]  # (field, ...), or () for the body as a whole
        said = dict.fromkeys(x["msg"] for x in errors if x["loc"][:1] == loc)  # a union: each form's complaint
        param = quoted(loc[0]) if loc and isinstance(loc[0], str) else None  # an unknown field's name is the client's
        raise ApiError(f"{param or 'body'}: {'; or '.join(list(said)[:3])}", param)


def quoted(text, limit=200):
    """What a client sent, as an error message quotes it: at most limit characters."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def to_requests(body, model, encoder, hparams, max_model_len, max_queue):
    """(the batching.Requests, one per prompt and choice, and what the response needs).
    The checks a schema cannot make: the served model, the vocabulary, the window and the
    server's limits, and the fields this server does not implement."""
    if body.model is not None and body.model != model:
        raise ApiError(f"The model `{quoted(body.model)}` does not exist. This server serves `{model}`.", "model",
                       status=404, kind="NotFoundError")
    for name, problem in NOT_IMPLEMENTED.items():
        if getattr(body, name):
            raise ApiError(problem, name)
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(f"best_of (the best n of best_of choices) is not implemented: leave it out or set it to "
                       f"n ({body.n})", "best_of")
    if body.stream_options is not None and not body.stream:
        raise ApiError("stream_options is only allowed when stream is true", "stream_options")
    if body.logprobs is not None and body.echo:
        raise ApiError("echo with logprobs would need the prompt's logprobs, which this server does not compute: "
                       "leave out one of them", "logprobs")
    n_vocab, n_ctx = hparams["n_vocab"], hparams["n_ctx"]
    if body.top_k > n_vocab:
        raise ApiError(f"top_k must be in [-1, {n_vocab}] (0 or -1 = off), got {body.top_k}", "top_k")
    prompts = read_prompts(body.prompt, encoder, n_vocab)
    for p in prompts:
        if len(p) > n_ctx:
            raise ApiError(f"the prompt is {len(p)} tokens, more than the model's window of {n_ctx}", "prompt")
        if len(p) + body.max_tokens > max_model_len:
            raise ApiError(f"max_tokens {body.max_tokens} + the prompt's {len(p)} tokens is more than this "
                           f"server's --max_model_len {max_model_len}", "max_tokens")
    if len(prompts) * body.n > max_queue:
        raise ApiError(f"{len(prompts)} prompts x n = {body.n} choices are more than this server's whole queue "
                       f"(--max_queue {max_queue}): send fewer at a time", "n")
    try:
        settings = sampling.SamplingSettings(
            temperature=body.temperature, top_k=max(body.top_k, 0), top_p=body.top_p, min_p=body.min_p,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty)
    except sampling.BadSetting as e:
        raise ApiError(f"{e.name} {e.problem}", e.name)
    seed = secrets.randbelow(2 ** 63) if body.seed is None else body.seed
    eos = None if body.ignore_eos else encoder.eot_token
    reqs = [batching.Request(tuple(p), body.max_tokens, settings, (seed + j * body.n + i) % 2 ** 64, eos)
            for j, p in enumerate(prompts) for i in range(body.n)]
    for r in reqs:
        try:
            batching.check_request(r, n_vocab)
        except ValueError as e:
            raise ApiError(str(e), "prompt")
    return reqs, {"prompts": [prompts[k // body.n] for k in range(len(reqs))], "eos": eos,
                  "stop": [body.stop] if isinstance(body.stop, str) else body.stop or [],
                  "prompt_tokens": sum(len(p) for p in prompts),  # once per prompt, whatever n (as OpenAI)
                  "prompt_ids": prompts,
                  "echo": body.echo, "logprobs": body.logprobs, "stream": body.stream,
                  "usage": bool(body.stream_options and body.stream_options.include_usage)}


def read_prompts(prompt, encoder, n_vocab):
    """The API's four prompt forms (a string, strings, token ids, lists of token ids) as token ids."""
    if isinstance(prompt, str) or type(prompt[0]) is int:
        prompt = [prompt]
    ids = [encoder.encode(p, allowed_special={utils.EOT_TOKEN}) or [encoder.eot_token] if isinstance(p, str)
           else p for p in prompt]
    if any(t >= n_vocab for p in ids for t in p):
        raise ApiError(f"token ids must be in [0, {n_vocab})", "prompt")
    return ids


def new_choice(index, prompt_ids, encoder, how):
    """A choice as it grows: its tokens, its visible text, what has been streamed of it."""
    text = encoder.decode(prompt_ids) if how["echo"] else ""
    logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    return {"index": index, "tokens": [], "text": text, "generated_from": len(text), "sent": 0,
            "logprobs": logprobs if how["logprobs"] is not None else None,
            "utf8": codecs.getincrementaldecoder("utf-8")(errors="replace"), "finish_reason": None}


def grow(choice, event, encoder, how, logprobs=None):
    """One event into a choice (logprobs: the token's, from `token_logprobs`); True when the
    choice has just finished."""
    stop, eos = how["stop"], how["eos"]
    if choice["finish_reason"]:
        return False  # tokens the engine made before it saw this choice's cancellation
    if event.kind == "token":
        choice["tokens"].append(event.token)
        choice["cached_tokens"] = event.cached_tokens
        if event.token == eos:
            choice["finish_reason"] = "stop"
            return True
        if choice["logprobs"] is not None:
            add_logprobs(choice, event.token, logprobs, encoder)
        before = len(choice["text"])
        choice["text"] += choice["utf8"].decode(encoder.decode_single_token_bytes(event.token))
        # a new stop string ends after `before`, and never starts inside an echoed prompt
        hits = [at for at in (choice["text"].find(s, max(choice["generated_from"], before - len(s) + 1))
                              for s in stop) if at >= 0]
        if hits:
            choice["text"], choice["finish_reason"] = choice["text"][:min(hits)], "stop"
            return True
        return False
    choice["text"] += choice["utf8"].decode(b"", final=True)
    choice["finish_reason"] = "length"
    return True


def token_logprobs(logits, token, n_top):
    """(the token's log-probability, the n_top likeliest (token, log-probability)) under the
    target's own distribution: the log-softmax of its logits, before temperature, penalties
    and top-k/p (what vLLM returns by default). Speculative decoding reports the same numbers:
    they come from the target's logits at each position of its verify pass."""
    logits = logits.get() if hasattr(logits, "get") else logits  # CuPy: to the host
    logp = sampling.log_softmax(np.asarray(logits, dtype=np.float32))  # [n_vocab]
    top = np.argpartition(-logp, n_top)[:n_top] if n_top else []
    return float(logp[token]), [(int(t), float(logp[t])) for t in sorted(top, key=lambda t: -logp[t])]


def token_text(encoder, token):
    """A token's text in logprobs: its bytes as UTF-8, or, for a piece of a character
    (GPT-2 splits many characters into byte tokens), its bytes written as OpenAI writes
    them ('bytes:\\xe2\\x80'). Decoded, every such piece would be the same '\ufffd', and the
    top_logprobs of two of them one key."""
    piece = encoder.decode_single_token_bytes(token)
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def add_logprobs(choice, token, logprobs, encoder):
    logp, top = logprobs
    lp = choice["logprobs"]
    lp["tokens"].append(token_text(encoder, token))
    lp["token_logprobs"].append(logp)
    lp["top_logprobs"].append({token_text(encoder, t): p for t, p in top})
    lp["text_offset"].append(len(choice["text"]))  # where this token's text starts


def new_logprobs(choice):
    """The logprobs of the tokens not yet streamed (all of them for a whole response),
    let go of here: a stream would otherwise hold a KB a token (n_top of them) to its end."""
    lp = choice["logprobs"]
    if lp is None:
        return None
    choice["logprobs"] = {key: [] for key in lp}
    return lp


def ready_text(choice, stop):
    """The text that can be streamed now: all of it once finished, else all but a tail that
    might still grow into a stop string (that must never reach the client). Where each stop
    string's held tail may start only moves on as text comes, so each event costs at most
    a stop string's length of comparisons, however long the text."""
    text, end = choice["text"], len(choice["text"])
    if not choice["finish_reason"]:
        held = choice.setdefault("held", [0] * len(stop))  # per stop string: where its possible start is
        for j, s in enumerate(stop):
            at = max(held[j], len(text) - len(s) + 1, choice["generated_from"])
            while at < len(text) and not s.startswith(text[at:]):
                at = text.find(s[0], at + 1) % (len(text) + 1)  # not found (-1): at = len(text)
            held[j] = at
            end = min(end, at)
    new, choice["sent"] = text[choice["sent"]:end], max(choice["sent"], end)
    return new
