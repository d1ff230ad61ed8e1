"""From logits to the next token: the one sampling module both decoders share.

Decoding draws each token from a distribution built out of the model's logits
in two separate steps:

1. `probabilities(logits, counts, settings)`: penalties, temperature, top-k,
   top-p (nucleus) and min-p turn logits into a distribution, in the order
   Hugging Face transformers applies its logits processors.
2. `sample(probs, u)`: one token per row, by inverting the CDF at u ~ U(0, 1].

Speculative decoding (speculative.py) needs step 1 on its own: it compares the
target's processed distribution p with the draft's q, so both must come from
exactly these functions with the same settings. Temperature 0 is greedy: the
distribution puts all its mass on the argmax, and speculative sampling then
reduces to "accept while the draft's token is the target's argmax".

Which tokens the penalties count (`counts` [B, n_vocab]: occurrences of each
token in the text so far, prompt included; `prompt_counts`: in the prompt):
- repetition_penalty (transformers, CTRL): every token of the text, prompt included;
- presence_penalty and frequency_penalty (the OpenAI API's formula): the
  generated tokens only, unless penalize_prompt counts the prompt's too.

Where a GPU runs kernels of our own (GPT2_GPU_KERNELS=1), both steps on its arrays
are kernels/cuda_sampling.py's, one launch each after the penalties: the same
distribution and token, without a sort or a dozen operations' host time.
"""
from dataclasses import dataclass

import numpy as np

from gpt2 import softmax  # the model's own: exp(x - max) / sum
from kernels import cuda_sampling

# Below this temperature decoding is greedy, as in vLLM: dividing logits by a smaller
# number overflows float32, and the distribution is one-hot to float32 precision unless
# the top two logits tie within a few ulps.
GREEDY_BELOW = 1e-5


class BadSetting(ValueError):
    """A setting out of its range: `name` is the setting, the message says what is allowed."""

    def __init__(self, name, problem):
        super().__init__(f"{name} {problem}")
        self.name, self.problem = name, problem


@dataclass(frozen=True)
class SamplingSettings:
    """How one request turns logits into its next token's distribution (`probabilities`)."""
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW) means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0  # OpenAI API, in [-2, 2]: logit -= presence * (count > 0)
    frequency_penalty: float = 0.0  # OpenAI API, in [-2, 2]: logit -= frequency * count
    repetition_penalty: float = 1.0  # transformers, in [0.01, 100]: divide positive logits, multiply negative
    penalize_prompt: bool = False  # presence/frequency count the prompt's tokens too
    no_repeat_ngram_size: int = 0  # transformers: > 0 bans any token that would repeat an n-gram of the text
    # (it needs the text: batching.distributions applies it, with banned_tokens below)

    def __post_init__(self):
        validate(self)

    @property
    def greedy(self):
        return self.temperature < GREEDY_BELOW

    @property
    def picks_argmax(self):
        """Greedy with nothing that changes the logits first (no penalty, no n-gram ban): the
        token is the logits' first maximum, as probabilities' one-hot and sample give it."""
        return self.greedy and not self.uses_counts and not self.no_repeat_ngram_size

    @property
    def uses_counts(self):
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def validate(s):
    """Every setting in its range, so the arithmetic below stays finite."""
    for name in ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "no_repeat_ngram_size"):
        value = getattr(s, name)
        if not is_real(value) or not np.isfinite(value):
            raise BadSetting(name, f"must be a finite number, got {value!r}")
    if not float(s.no_repeat_ngram_size).is_integer() or s.no_repeat_ngram_size < 0:
        raise BadSetting("no_repeat_ngram_size", f"must be an integer >= 0 (0 = off), got {s.no_repeat_ngram_size}")
    if not isinstance(s.penalize_prompt, (bool, np.bool_)):
        raise BadSetting("penalize_prompt", f"must be True or False, got {s.penalize_prompt!r}")
    if s.temperature < 0:
        raise BadSetting("temperature", f"must be >= 0 (0 = greedy), got {s.temperature}")
    if s.temperature > float(np.finfo(np.float32).max):  # the logits are float32: it would become inf
        raise BadSetting("temperature", f"must be at most 3.4e38 (float32's largest), got {s.temperature}")
    if not float(s.top_k).is_integer() or s.top_k < 0:
        raise BadSetting("top_k", f"must be an integer >= 0 (0 = off), got {s.top_k}")
    if not 0 < s.top_p <= 1:
        raise BadSetting("top_p", f"must be in (0, 1], got {s.top_p}")
    if not 0 <= s.min_p < 1:
        raise BadSetting("min_p", f"must be in [0, 1), got {s.min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(s, name) <= 2:
            raise BadSetting(name, f"must be in [-2, 2] (the OpenAI API's range; 0 = off), got {getattr(s, name)}")
    if not 0.01 <= s.repetition_penalty <= 100:
        raise BadSetting("repetition_penalty", f"must be in [0.01, 100] (1 = off), got {s.repetition_penalty}")


def is_int(x):
    """An integer (Python's or NumPy's), not a bool and not a float that happens to be whole."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_real(x):
    """Whether x is a real number (an int or a float; a bool is neither here)."""
    return (is_int(x) or isinstance(x, (float, np.floating))) and not isinstance(x, (bool, np.bool_))


def token_counts(histories, n_vocab):
    """counts [B, n_vocab]: occurrences of every token in each row's history."""
    counts = np.zeros((len(histories), n_vocab), dtype=np.int32)
    for b, history in enumerate(histories):
        np.add.at(counts[b], np.asarray(history, dtype=np.int64), 1)
    return counts


def banned_tokens(text, n):
    """Tokens that would repeat an n-gram of text (transformers' no_repeat_ngram_size): those
    that followed an earlier occurrence of its last n - 1 tokens, the prompt included."""
    if len(text) < n:  # no earlier n-gram to repeat
        return []
    tail = tuple(text[len(text) - n + 1:])
    return [text[i + n - 1] for i in range(len(text) - n + 1) if tuple(text[i:i + n - 1]) == tail]


def apply_repetition_penalty(logits, counts, penalty):
    """transformers': each token seen (counts > 0) gets a positive logit divided by penalty,
    a negative one multiplied, so > 1 makes it less likely either way."""
    seen = counts > 0
    penalized = np.where(logits > 0, logits / penalty, logits * penalty)
    return np.where(seen, penalized, logits)


def apply_presence_frequency_penalty(logits, counts, presence, frequency):
    """OpenAI's: logit -= frequency * count + presence * (count > 0)."""
    counts = counts.astype(logits.dtype)  # int or bool times a float would promote to float64
    return logits - counts * frequency - (counts > 0).astype(logits.dtype) * presence


def apply_temperature(logits, temperature):
    """logits / temperature: below 1 sharpens the softmax, above 1 flattens it."""
    return logits / temperature


def apply_top_k(logits, k):
    """Keep the k largest logits (and any tied with the k-th), -inf for the rest."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = -np.partition(-logits, k - 1, axis=-1)[..., k - 1:k]  # [..., 1]: the k-th largest
    return np.where(logits < kth, -np.inf, logits)


def apply_top_p(logits, top_p):
    """Keep the smallest set of tokens whose probability sums to at least top_p."""
    if top_p >= 1.0:
        return logits
    order = np.argsort(logits, axis=-1, kind="stable")  # [B, n_vocab]: ascending, as transformers does
    sorted_logits = np.take_along_axis(logits, order, axis=-1)  # [B, n_vocab]
    cumulative = np.cumsum(softmax(sorted_logits), axis=-1)  # [B, n_vocab]
    remove_sorted = cumulative <= 1.0 - top_p
    remove_sorted[..., -1] = False  # always keep the most likely token
    remove = np.empty_like(remove_sorted)
    np.put_along_axis(remove, order, remove_sorted, axis=-1)
    return np.where(remove, -np.inf, logits)


def apply_min_p(logits, min_p):
    """Remove tokens less likely than min_p times the most likely one."""
    if min_p <= 0.0:
        return logits
    probs = softmax(logits)
    return np.where(probs < min_p * probs.max(axis=-1, keepdims=True), -np.inf, logits)


def log_softmax(x):
    """log(softmax(x)), without taking the log of a probability that underflowed to 0."""
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def penalize(logits, counts, s, prompt_counts=None):
    """Logits [..., n_vocab] after the penalties, which read the text's token counts."""
    if s.uses_counts:  # the host's counts go to the logits' device
        counts = np.asarray(counts, like=logits)
        prompt_counts = None if prompt_counts is None else np.asarray(prompt_counts, like=logits)
    if s.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, counts, s.repetition_penalty)
    if s.presence_penalty or s.frequency_penalty:
        generated = counts if s.penalize_prompt or prompt_counts is None else counts - prompt_counts
        logits = apply_presence_frequency_penalty(logits, generated, s.presence_penalty, s.frequency_penalty)
    return logits


def process_logits(logits, counts, s, prompt_counts=None):
    """Logits [..., n_vocab] after every processor: -inf marks a removed token."""
    logits = penalize(logits, counts, s, prompt_counts)
    if s.greedy:
        return logits  # only the argmax matters: temperature, top-k/p and min-p cannot change it
    logits = apply_temperature(logits, s.temperature)
    logits = apply_top_k(logits, int(s.top_k))
    logits = apply_top_p(logits, s.top_p)
    return apply_min_p(logits, s.min_p)


def probabilities(logits, counts, s, prompt_counts=None):
    """The distribution [..., n_vocab] that decoding draws from (float32), computed
    where the logits are (NumPy, or CuPy on a GPU)."""
    if cuda_sampling.takes(logits):  # a GPU's kernels of our own: the rest in one launch
        return cuda_sampling.distribution(penalize(logits.astype(np.float32, copy=False), counts, s, prompt_counts), s)
    logits = process_logits(logits.astype(np.float32, copy=False), counts, s, prompt_counts)
    if s.greedy:
        greedy = np.zeros(logits.shape, dtype=np.float32, like=logits)
        np.put_along_axis(greedy, np.argmax(logits, axis=-1)[..., None], 1.0, axis=-1)  # [..., n_vocab]: one-hot
        return greedy
    return softmax(logits)


def sample(probs, u):
    """One token per row of probs [B, n_vocab]: the first whose cumulative probability
    reaches u [B] in (0, 1] times the row's total; u > 0, so a zero-probability token
    never wins. A row that is not a distribution (NaN, inf, negative, no mass) is refused.

    The running sums (float64, in token order) are the cost: 50257 dependent adds a row.
    A token no row can draw adds 0.0 to every sum, which changes no bit of it, so the sums
    run over the drawable tokens only: a greedy or top-k batch sums a few columns, and
    every row gets the token it would get from its whole row."""
    if cuda_sampling.takes(probs):  # a GPU's kernels of our own: the same token, in one launch
        return cuda_sampling.sample(probs, u)
    peak = probs.max(axis=-1)  # [B]: NaN or inf anywhere in a row shows here
    if not (bool(np.isfinite(peak).all()) and bool((peak > 0).all()) and bool(probs.min() >= 0)):
        raise ValueError("cannot sample: a distribution holds NaN, inf or negative values, or no mass at all")
    drawable = (probs > 0).any(axis=0)  # [n_vocab]
    if bool(drawable.all()):
        tokens, cdf = np.arange(probs.shape[-1], like=probs), probs.astype(np.float64)  # [B, n_vocab]
    else:
        tokens = np.flatnonzero(drawable)  # [m]
        cdf = probs[:, tokens].astype(np.float64)  # [B, m]
    cdf = np.cumsum(cdf, axis=-1, out=cdf)  # in place on the float64 copy: np.cumsum(probs, dtype=float64) is 2x slower
    u = np.asarray(u, like=cdf) * cdf[:, -1]  # [B]: u times each row's total
    return tokens[np.minimum((cdf < u[:, None]).sum(axis=-1), len(tokens) - 1)]  # [B]
