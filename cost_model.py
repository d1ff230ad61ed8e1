"""When speculative decoding pays: what a step costs, and the K that makes it fastest.

A step of draft-verify decoding (speculative.py) emits, on average, E = (1 - alpha^(K+1)) /
(1 - alpha) tokens, where alpha is the chance that the target accepts a draft
(Leviathan et al. 2023, eq. 1, https://arxiv.org/abs/2211.17192). It costs, in target
decode steps, K draft tokens (c each) plus one target pass over K+1 tokens, verify(K+1):

    speedup(alpha, K) = E(alpha, K) / (c * K + verify(K+1))

(the first draft token after a fully accepted step covers two tokens, `catch_up`). On a
GPU a pass over K+1 tokens reads the same weights and makes about the same calls as a step:
verify(K+1) measured 0.97-1.10 steps up to K = 7 on an H100 and 1.2-1.4 on an H200
(benchmark_results/earlier/cupy, cupy-h200), so a large K pays; on a 2-core CPU a pass over
K+1 tokens costs 1.1-1.7 steps with the row kernel (kernels/row_kernel.py, CPU_VERIFY), so K
stays moderate. `best_K` picks the K with the largest speedup; adaptive K (speculative.py) asks it
before every step with each row's own alpha. The costs are fixed numbers, never this run's
clock, so the same seed gives the same text; `cli.timing.measure_costs` times them on the
machine at hand to advise (main.py prints the K it recommends). This file is the math only.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Costs:
    """What a step costs, in target decode steps: `draft` is one draft-model token (the
    papers' c), `verify[K]` one target pass over K+1 tokens. `catch_up`: the draft's
    pass over two tokens, in draft tokens; after a step that accepted all K drafts the
    draft has yet to read its own last draft and the target's extra token, so its next
    pass covers both. Fixed numbers rather than this run's clock, so that adaptive K,
    and with it the text, is the same every run."""
    draft: float
    verify: tuple
    catch_up: float = 1.0


# verify(K+1) / one decode step for K = 0..8 on a 2-core AVX2 CPU, 355M target, the numba row
# kernel: `python benchmark.py --only rows --target 355M` (n = K + 1 rows; K = 8, n = 9, lies
# between its n = 8 and n = 12). Each cost is at least the one before: adaptive K must never
# see a longer pass as cheaper, and up to n = 6 a pass is one register tile, so a lower
# reading is noise. From n = 7 two tiles: bound by multiply-adds.
CPU_VERIFY = (1.0, 1.08, 1.11, 1.14, 1.14, 1.14, 1.51, 1.53, 1.68)


def expected_tokens(alpha, K):
    """E[tokens per target pass] = (1 - alpha^(K+1)) / (1 - alpha) (Leviathan et al. eq. 1):
    drafts are accepted left to right with probability alpha each, plus one target token."""
    return K + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (K + 1)) / (1.0 - alpha)


def verify_cost(costs, K):
    """verify(K+1) in target steps; past the table, growing with the rows like a compute-bound pass."""
    table = costs.verify
    return table[K] if K < len(table) else table[-1] * (K + 1) / len(table)


def best_K(alpha, costs, K_max):
    """The K with the most expected tokens per unit of time: E[tokens](alpha, K) over the
    cost of K draft tokens and one verification of K+1 tokens."""
    return max(range(1, K_max + 1), key=lambda K: speedup(alpha, K, costs))


def estimate_alpha(accepted, rejected):
    """alpha from drafts seen: each accepted draft a success, each step that rejected one
    a failure (the maximum-likelihood estimate for the papers' geometric model)."""
    return accepted / (accepted + rejected) if accepted + rejected else 0.0


def step_parameters(hparams, vocab=0):
    """Weights one decode step streams: 12 n_embd^2 per layer (attention 4, MLP 8) plus
    the head (only `vocab` rows of it for a vocabulary-subset draft)."""
    head = min(vocab, hparams["n_vocab"]) if vocab else hparams["n_vocab"]
    return 12 * hparams["n_layer"] * hparams["n_embd"] ** 2 + head * hparams["n_embd"]


def draft_cost(alpha, K, costs):
    """K draft tokens in target steps, the first of them a two-token catch-up pass when
    the step before accepted all its drafts (probability alpha^K)."""
    return costs.draft * (K + alpha ** K * (costs.catch_up - 1.0))


def speedup(alpha, K, costs):
    """Expected speedup over plain decoding: tokens per step over the step's cost in target steps."""
    return expected_tokens(alpha, K) / (draft_cost(alpha, K, costs) + verify_cost(costs, K))


def weight_bytes(model):
    """Bytes one weight of a model's matrices takes as stored: 4 (float32), 2 (bfloat16,
    float16), 1 (int8), 0.5 + 2 / 32 (int4: half a byte, and a 2-byte scale per group of 32;
    kernels/weight_formats.py)."""
    w = model[0]["blocks"][0]["mlp"]["c_fc"]["w"]  # a weights.Matrix, or a plain array (a GPU's)
    stored = getattr(w, "stored", w)
    if stored.dtype.name == "uint8":
        return (stored.nbytes + w.scale.nbytes) / (2 * stored.nbytes)
    return stored.itemsize


def default_costs(target, draft, draft_vocab=0):
    """Costs estimated from sizes: decoding is bound by reading the weights, so a draft
    token costs its model's share of the bytes, its weights times their stored size (0
    for a drafter without a model; a target's own int8 copy 1/4), and verification
    follows the CPU table CPU_VERIFY (and so does the draft's two-token pass)."""
    if not draft:
        return Costs(draft=0.0, verify=CPU_VERIFY, catch_up=CPU_VERIFY[1])
    c = (step_parameters(draft[1], draft_vocab) * weight_bytes(draft)
         / (step_parameters(target[1]) * weight_bytes(target)))
    return Costs(draft=c, verify=CPU_VERIFY, catch_up=CPU_VERIFY[1])
