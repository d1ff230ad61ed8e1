"""The command line the three commands share (main.py, server.py, benchmark.py).

Its way in is `flags`: `add_model_flags` / `add_decoder_flags` build a parser's flags;
`loading.load_models(args)` loads what they name. main.py's machinery beside them: `warm`
(what a run compiles and warms before it is timed), `printing` (a decoder's run, printed)
and `timing` (passes timed on this machine: the advice on K).
"""
