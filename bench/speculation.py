"""`--only speculative` and `--only breakdown`: what speculative decoding costs and gains.

Random weights cannot tell how often a draft is accepted, so speculative decoding is
measured with a controlled drafter: the real draft model runs (its cost is real), then
each proposal is replaced by the target's own next token with probability a (exactly a
of them in shuffled blocks of 20). Measured here: the costs that decide its speed (a
draft token, verify(K+1), the draft's catch-up pass, in target steps) and the speedups
they predict (cost_model.py); measured speedups beside those predictions; the target's
own narrow copy as its draft (self-draft); where a step's time goes (breakdown); and how
much real text a vocabulary-subset draft cannot propose.
"""
import argparse
import os

import numpy as np

import batching
import cost_model
import speculative
import utils
from bench.common import GREEDY, ROOT, TOKENIZER_DIR, greedy, in_format, prompt_ids
from cli.timing import draft_seconds, pass_seconds, step_seconds, verify_seconds
from kernels import cuda_decode_loop


def break_even_alpha(costs, K):
    """The acceptance rate at which speculative decoding with this K just pays (bisection)."""
    lo, hi = 0.0, 1.0
    if cost_model.speedup(hi, K, costs) < 1:
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cost_model.speedup(mid, K, costs) < 1 else (lo, mid)
    return hi


def paired(measure, step, reps):
    """measure() / step(), each measure taken between two steps and divided by their
    mean, so that both see the same machine (its bandwidth drifts by 20% over
    minutes); the median over reps."""
    ratios = []
    for _ in range(reps):
        before, x, after = step(), measure(), step()
        ratios.append(x / ((before + after) / 2))
    return float(np.median(ratios))


def settle(step, tries=20, within=0.05):
    """Time step() until two timings in a row agree within 5% (at most `tries`): after
    hundreds of MB of weights are made or converted, this machine runs slow for up to a
    minute, and the larger target slows more than a draft, which would bias every c low
    (benchmark_results/NOTES.md, int4)."""
    last = step()
    for _ in range(tries):
        now = step()
        if abs(now - last) <= within * last:
            return
        last = now


def bench_speculative_costs(draft, target, args):
    """The costs that decide speculative speed, each paired with target steps (as decoding
    runs them: step_seconds): verify(K+1) for K = 1..K_max (as speculative decoding runs it:
    verify_seconds) and one draft token (as drafting at K runs it: draft_seconds) with the
    full head and with vocabulary subsets, in target steps (and the draft's two-token
    catch-up pass over a one-token pass); the speedups they predict, and the acceptance
    rate at which each K breaks even. Each pass is the best of 3 (a single pass strays by
    10-20% here, enough to rank K wrong)."""
    L = args.prompt_len

    def step():
        return step_seconds(target, L, reps=3)
    settle(step)
    def verification(K):
        return verify_seconds(target, L, K, reps=3) or pass_seconds(target, L, K + 1, reps=3)
    verify = (1.0,) + tuple(paired(lambda: verification(K), step, args.reps) for K in range(1, args.K_max + 1))
    drafts, catch_up = {}, {}
    for N in [0] + args.draft_vocabs:
        subset = speculative.vocab_subset(draft, [prompt_ids(L)], N)
        drafts[N] = paired(lambda: draft_seconds(subset, L, args.K, reps=3) or pass_seconds(subset, L, reps=3), step,
                           args.reps)
        catch_up[N] = paired(lambda: pass_seconds(subset, L, 2, reps=3, n_logits=1),
                             lambda: pass_seconds(subset, L, reps=3), args.reps)
    step_s = float(np.median([step() for _ in range(args.reps)]))
    rows = []
    for K in range(1, args.K_max + 1):
        costs = cost_model.Costs(drafts[0], verify, catch_up[0])
        row = {"K": K, "verify_ms": verify[K] * step_s * 1e3, "verify_over_step": verify[K],
               "break_even_alpha": break_even_alpha(costs, K)}
        for a in args.alphas:
            row[f"predicted_a{a}"] = cost_model.speedup(a, K, costs)
        rows.append(row)
    return {"draft": args.draft, "target": args.target, "target_step_ms": step_s * 1e3, "verify": verify,
            "draft_over_target": {str(N): c for N, c in drafts.items()},
            "catch_up": {str(N): x for N, x in catch_up.items()}, "by_K": rows, "alphas": args.alphas}


def acceptance_draws(a, rng):
    """The controlled drafter's accept (True) / reject outcomes, one per draft verified:
    i.i.d. draws would put 64 tokens' acceptance anywhere in 0.73-0.87 at a = 0.8 (10th-90th
    percentile), and the same seeds in every run the same way (0.77), so they come in
    shuffled blocks of L outcomes with exactly a L acceptances (blocked randomization; L = 20,
    or the first multiple of 20 that a L is whole in): each run's acceptance lands near a
    (sd 0.014 at a = 0.8 over 64 tokens, i.i.d.: 0.054), and the tokens a
    target pass yields average within 1% of what i.i.d. draws give (64-token runs: -0.1%;
    an endless stream: +0.7%, since a block drawn without replacement owes its acceptances
    back after a reject)."""
    L = next((L for L in range(20, 2001, 20) if abs(a * L - round(a * L)) < 1e-6), 2000)
    while True:
        yield from rng.permutation(np.arange(L) < round(a * L)).tolist()


def controlled_drafter(draft, truth, a, seed=0):
    """A drafter whose acceptance rate is a, for a greedy target: the draft model runs
    (so drafting costs what it really costs), then its proposals are replaced by the
    target's own next tokens (truth) while acceptance_draws says accept, and by another
    token at the first reject (and after it: those are never looked at, but the target
    still verifies all k). q is one-hot, so a proposal is accepted exactly when it is the
    truth. (The draft's cache keeps its own tokens where the text has the replacements;
    its proposals are discarded anyway.)"""
    draws = acceptance_draws(a, np.random.default_rng(seed))
    n_vocab = draft[1]["n_vocab"]

    def steer(text, K):
        proposals, accepting = [], True
        for t in truth[len(text):len(text) + K]:
            accepting = accepting and next(draws)
            proposals.append(t if accepting else (t + 1) % n_vocab)
        return proposals

    def propose(batch, k, vocab):
        speculative.draft_with_model(batch, draft, k, vocab)
        return speculative.draft_deterministic(batch, steer, k)
    return speculative.Drafter(propose, draft)


def controlled_run(draft, target, truth, a, config, n, seed=0):
    """One greedy speculative run with the controlled drafter: its Stats."""
    prompt = truth[:len(truth) - n]
    drafter = controlled_drafter(draft, truth, a, seed)
    config = speculative.resolve(config, target, draft)
    out, stats = batching.run(batching.requests([prompt], n, GREEDY), {"target": target, "draft": draft},
                              lambda batch: speculative.speculative_step(batch, target, drafter, config))
    assert out[0] == truth[len(prompt):], "speculative decoding must reproduce the target's greedy text"
    return stats


def typical_pass(model, L, T=1, n_logits=None, reps=3):
    """The median of reps single passes, each after a warm-up: what a pass inside a run
    takes. The best of a few passes is the best case, about 10% less than a 1558M run's
    passes take (breakdown-1558M)."""
    return float(np.median([pass_seconds(model, L, T, 1, n_logits) for _ in range(reps)]))


def costs_beside(draft, target, L, K):
    """(target step seconds, Costs) timed right before or after a run, so that the run and
    its prediction see the same machine: c, verify(K+1) (the only entry of the verify table
    that is filled in, at index K) and the draft's catch-up pass, typical passes each (where
    a step, a draft's K passes and a verification are recorded graphs, the best of three of
    each as it runs: draft_seconds, verify_seconds of one-hot drafts, as the controlled drafter's)."""
    step = draft_seconds(target, L, cuda_decode_loop.STEPS) or typical_pass(target, L)  # as plain decoding runs
    draft_pass = typical_pass(draft, L)
    draft_step = draft_seconds(draft, L, K) or draft_pass
    verify = (verify_seconds(target, L, K, one_hot=True) or typical_pass(target, L, K + 1)) / step
    catch_up = typical_pass(draft, L, 2, n_logits=1) / draft_pass
    return step, cost_model.Costs(draft_step / step, (1.0,) + (float("nan"),) * (K - 1) + (verify,), catch_up)


def mean_costs(before, after):
    """The mean of two costs_beside results: what the run between them saw."""
    (s0, c0), (s1, c1) = before, after
    verify = tuple((x + y) / 2 for x, y in zip(c0.verify, c1.verify))
    return (s0 + s1) / 2, cost_model.Costs((c0.draft + c1.draft) / 2, verify, (c0.catch_up + c1.catch_up) / 2)


def bench_speculative_end_to_end(draft, target, costs, args):
    """Measured speedup of speculative decoding with the controlled drafter at each
    acceptance rate a, at K = args.K and at the K the measured costs recommend: each
    speculative run is timed right after a plain greedy run of the same text, and the
    speedup is the median of those paired ratios. Each repetition draws its own
    acceptances (seed), since 64 tokens are few draws. Next to it, what the cost model
    predicts: from the cost table at a, and from the costs timed right before and after
    each run at the acceptance rate that run drew (the model's own error, without the
    machine's drift between the table and the run)."""
    n, L = args.n_tokens * 2, args.prompt_len
    prompt = prompt_ids(L)
    truth = prompt + greedy([prompt], target, n)[0][0]
    plain_runs = []

    def plain():
        plain_runs.append(greedy([prompt], target, n)[1].decode_tokens_per_s)
        return plain_runs[-1]
    rows = []
    for vocab in dict.fromkeys([0, args.draft_vocab]):
        measured = cost_model.Costs(costs["draft_over_target"][str(vocab)], costs["verify"],
                                     costs["catch_up"][str(vocab)])
        subset = speculative.vocab_subset(draft, [prompt], vocab)
        for a in args.e2e_alphas:
            for K in dict.fromkeys([args.K, cost_model.best_K(a, measured, args.K_max)]):
                config = speculative.SpeculativeConfig(K=K, draft_vocab=vocab)
                runs, ratios, beside = [], [], []
                controlled_run(draft, target, truth, a, config, n)  # warm-up
                for rep in range(args.reps):
                    before = costs_beside(subset, target, L, K)
                    base = plain()
                    runs.append(controlled_run(draft, target, truth, a, config, n, seed=rep))
                    ratios.append(runs[-1].decode_tokens_per_s / base)
                    alpha = cost_model.estimate_alpha(runs[-1].accepted, runs[-1].rejected)
                    beside.append(cost_model.speedup(alpha, K, mean_costs(before, costs_beside(
                        subset, target, L, K))[1]))
                alpha = float(np.median([cost_model.estimate_alpha(s.accepted, s.rejected) for s in runs]))
                rows.append({"decoder": "speculative", "a": a, "K": K, "draft_vocab": vocab,
                             "tok_s": float(np.median([s.decode_tokens_per_s for s in runs])),
                             "speedup": float(np.median(ratios)), "speedup_min": min(ratios),
                             "speedup_max": max(ratios), "predicted": cost_model.speedup(a, K, measured),
                             "alpha": alpha, "predicted_beside": float(np.median(beside)),
                             "model_error": float(np.median([r / b - 1 for r, b in zip(ratios, beside)])),
                             "tokens_per_target_pass": float(np.median([s.tokens_per_target_pass for s in runs]))})
                print(f"  a={a} K={K} draft_vocab={vocab}: {rows[-1]['speedup']:.2f}x measured, "
                      f"{rows[-1]['predicted']:.2f}x predicted by the table, {rows[-1]['predicted_beside']:.2f}x by "
                      f"the costs beside each run at its alpha (median {alpha:.2f})", flush=True)
    plain_tok_s = float(np.median(plain_runs))
    return [{"decoder": "autoregressive", "a": None, "K": 0, "draft_vocab": None, "tok_s": plain_tok_s,
             "speedup": 1.0}] + rows


def bench_self_draft(target, args, weights):
    """The target's own copy in args.self_draft (int8) as its draft: the costs and the
    controlled end-to-end speedups as for the other draft (at args.self_draft_alphas), and
    the acceptance alpha the copy really gets on greedy text. On random weights that alpha
    says little about a trained GPT-2 (it is labelled with the weights it came from)."""
    draft, convert_s = in_format(target, args.self_draft)
    label = f"{args.target} {args.self_draft}"
    sub = argparse.Namespace(**dict(vars(args), draft=label, e2e_alphas=args.self_draft_alphas))
    costs = bench_speculative_costs(draft, target, sub)
    end_to_end = bench_speculative_end_to_end(draft, target, costs, sub)
    prompts = [prompt_ids(args.prompt_len, seed=30 + i) for i in range(4)]
    reqs = batching.requests(prompts, args.n_tokens * 2, GREEDY)
    natural = speculative.speculative_generate(reqs, target, speculative.model_drafter(draft),
                                               speculative.SpeculativeConfig(K=args.K))[1]
    return dict(costs, end_to_end=end_to_end, K=args.K, draft_vocab=args.draft_vocab, dtype=args.self_draft,
                convert_s=convert_s, weights=weights,
                natural_alpha=cost_model.estimate_alpha(natural.accepted, natural.rejected))


def bench_breakdown(draft, target, args):
    """Where a speculative step's time goes, against the cost model with costs timed in
    the same minute: per decode step (the first, with both prefills, left out), the
    seconds drafting and verifying, and what c, the draft's catch-up pass and verify(K+1),
    timed right before and after the run, predict for them (drafting at the run's
    alpha). Each K and a from --K and --e2e_alphas."""
    n, L = args.n_tokens * 2, args.prompt_len
    prompt = prompt_ids(L)
    truth = prompt + greedy([prompt], target, n)[0][0]
    rows = []
    for a in args.e2e_alphas:
        config = speculative.SpeculativeConfig(K=args.K)
        controlled_run(draft, target, truth, a, config, n)  # warm-up
        for rep in range(args.reps):
            before = costs_beside(draft, target, L, args.K)
            s = controlled_run(draft, target, truth, a, config, n, seed=rep)
            step, costs = mean_costs(before, costs_beside(draft, target, L, args.K))
            steps = s.n_steps - 1
            alpha = cost_model.estimate_alpha(s.accepted, s.rejected)
            verify = costs.verify[args.K]
            rows.append({"a": a, "K": args.K, "target_step_ms": step * 1e3, "c": costs.draft,
                         "verify_over_step": verify, "catch_up": costs.catch_up, "alpha": alpha,
                         "step_ms": (s.seconds - s.ttft_s) / steps * 1e3,
                         "draft_ms": (s.draft_s - s.first_draft_s) / steps * 1e3,
                         "verify_ms": (s.verify_s - s.first_verify_s) / steps * 1e3,
                         "draft_ms_predicted": cost_model.draft_cost(alpha, args.K, costs) * step * 1e3,
                         "verify_ms_predicted": verify * step * 1e3,
                         "tokens_per_step": (s.n_tokens - s.first_step_tokens) / steps})
            print(f"  a={a} K={args.K}: step {rows[-1]['step_ms']:.0f} ms, drafting {rows[-1]['draft_ms']:.0f} "
                  f"({rows[-1]['draft_ms_predicted']:.0f} predicted), verifying {rows[-1]['verify_ms']:.0f} "
                  f"({rows[-1]['verify_ms_predicted']:.0f} predicted)", flush=True)
    return {"draft": args.draft, "target": args.target, "rows": rows}


def subset_coverage(Ns):
    """How often real text needs a token that a vocabulary-subset draft cannot propose
    (id >= N and not earlier in the text): an upper bound on the acceptance the subset
    loses, from GPT-2's tokenizer on English text found on this machine."""
    encoder = utils.load_encoder(TOKENIZER_DIR)
    sources = [p for p in ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0",
                           os.path.join(ROOT, "README.md")) if os.path.exists(p)]
    rows = []
    for path in sources:
        ids = encoder.encode(open(path, encoding="utf-8", errors="replace").read(), disallowed_special=())
        seen, missing = set(), {N: 0 for N in Ns}
        for t in ids:
            for N in Ns:
                missing[N] += t >= N and t not in seen
            seen.add(t)
        rows.append({"text": os.path.basename(path), "tokens": len(ids),
                     **{str(N): missing[N] / len(ids) for N in Ns}})
    return rows
