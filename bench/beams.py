"""`--only beams`: what a beam search step costs against a greedy step.

A beam step is one cached pass over num_beams rows plus the search's own bookkeeping
(beam_search.py); the two decoders run in turns on one prompt.
"""
import time

import numpy as np

from bench.common import greedy, prompt_ids


def bench_beams(model, args, size, num_beams=4):
    """Beam search with num_beams beams against greedy decoding on one prompt, in turns: a
    beam step is one cached pass over num_beams rows plus the search's own bookkeeping."""
    import beam_search  # only this section needs it
    prompt, n = prompt_ids(args.prompt_len, seed=0), args.n_tokens
    rows = []
    for rep in range(args.reps + 1):  # the first is a warm-up
        start = time.perf_counter()
        beam_search.beam_search([prompt], model, n, beam_search.BeamSettings(num_beams=num_beams))
        beam_s = time.perf_counter() - start
        start = time.perf_counter()
        greedy([prompt], model, n)
        greedy_s = time.perf_counter() - start
        if rep:
            rows.append({"beam_step_ms": 1e3 * beam_s / n, "greedy_step_ms": 1e3 * greedy_s / n,
                         "beam_over_greedy": beam_s / greedy_s, "beam_tok_s": n / beam_s})
    ratio = float(np.median([r["beam_over_greedy"] for r in rows]))
    print(f"  beam search ({num_beams} beams) on {size}: a step costs {ratio:.2f} greedy steps", flush=True)
    return {"size": size, "num_beams": num_beams, "n_tokens": n, "prompt_len": args.prompt_len, "runs": rows}
