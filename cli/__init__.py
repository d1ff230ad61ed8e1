"""The command line the three commands share (main.py, server.py, benchmark.py).

Its door is `flags`: `add_model_flags` / `add_decoder_flags` build a parser's flags,
`load_models(args)` loads what they name.
"""
