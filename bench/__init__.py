"""The benchmark behind `python benchmark.py`: every speed number in the README.

Its way in is `cli.main` (the flags in `cli.parse_args`; results.json and results.md are
written by `cli.write_results`, the tables made by report.py, the plots by plots.py). One
file per section of `--only`, each measuring one thing:

- decode.py: decode (tokens/s beside the roofline, context, layout, load)
- formats.py: formats (bfloat16, int8 and int4 against float32), with llama.cpp beside them (llamacpp.py)
- rows.py: rows and kernels (the numba kernel against the NumPy fallback); ceiling.py: ceiling
- speculation.py: speculative and breakdown (a controlled drafter, the cost model's predictions)
- serve.py: serving and http; beams.py: beams
- gpu.py: --backend cupy; transformers_peer.py: transformers' generate() beside ours
- common.py: what they share (random weights of the real shapes, timing, the machine)
- peers.py: each optional peer (llama.cpp, transformers) in a process of its own, so that
  its crash is its own line in the results, not the end of the run
"""
