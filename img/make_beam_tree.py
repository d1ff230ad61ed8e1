"""Draw img/beam_tree.svg: the beams of one beam search, step by step, from a real run.

    python img/make_beam_tree.py --models_dir models --model_size 124M --prompt "Alan Turing"

Each column is a step; each box a running beam with its new token and summed log
probability; a line joins a beam to the beam it grew from. Beams that no line leaves
were cut at the next step. Hand-written SVG: no plotting library needed.
"""
import argparse
import html
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import beam_search  # noqa: E402
import utils  # noqa: E402

W, H, X0, Y0 = 118, 46, 20, 50  # a step's width, a beam's height, the margins


def draw(prompt_text, steps, encoder, N):
    width, height = X0 + W * len(steps) + 20, Y0 + H * N + 20
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{X0}" y="24" font-size="14" font-weight="bold">{html.escape(prompt_text)} ... '
           f'({N} beams; a line joins a beam to the one it grew from)</text>']
    for t, step in enumerate(steps):
        x = X0 + W * t
        for j in range(N):
            y = Y0 + H * j
            if t:  # the line from the beam this one grew from
                k = step["src"][0][j]
                out.append(f'<line x1="{x - W + 100}" y1="{Y0 + H * k + 16}" x2="{x}" y2="{y + 16}" '
                           'stroke="#3366cc" stroke-width="1.5"/>')
            alive = t + 1 == len(steps) or j in steps[t + 1]["src"][0]
            word = encoder.decode([step["tokens"][0][j]])[:12]
            out.append(f'<rect x="{x}" y="{y}" width="100" height="32" rx="4" '
                       f'fill="{"#dde8ff" if alive else "#f4f4f4"}" stroke="#333"/>')
            out.append(f'<text x="{x + 50}" y="{y + 14}" text-anchor="middle" font-size="11">'
                       f'{html.escape(repr(word)[1:-1])}</text>')
            out.append(f'<text x="{x + 50}" y="{y + 27}" text-anchor="middle" font-size="10" fill="#555">'
                       f'{step["scores"][0][j]:.2f}</text>')
    out.append("</svg>")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models_dir", default="models")
    ap.add_argument("--model_size", default="124M", choices=utils.MODEL_SIZES)
    ap.add_argument("--prompt", default="Alan Turing theorized that computers would one day become")
    ap.add_argument("--num_beams", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "beam_tree.svg"))
    args = ap.parse_args(argv)
    try:
        encoder, hparams, params = utils.load_encoder_hparams_and_params(args.model_size, args.models_dir)
        trace = []
        beam_search.beam_search([encoder.encode(args.prompt) or [encoder.eot_token]], (params, hparams), args.steps,
                                beam_search.BeamSettings(num_beams=args.num_beams), trace=trace)
    except (utils.LoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with open(args.out, "w") as f:
        f.write(draw(args.prompt, trace, encoder, args.num_beams))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
