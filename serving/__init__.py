"""Serving: many requests at once, over HTTP.

- scheduler.py: continuous batching (`scheduler.serve`, `scheduler.loop`), with
  preemption; main.py's --max_batch runs it too. chunking.py: chunked prefill, how a
  step's token budget is spent on the prompts still being computed. prefix_cache.py: the keys and values of
  beginnings already computed, which a joining request copies instead of computing.
- server.py: the OpenAI-compatible HTTP server (`server.start`, `python server.py`);
  engine.py is its engine thread, sockets.py what a socket needs against hostile
  clients, openai_api.py what a request body may hold.

The way in is `scheduler.loop`: everything here decodes through it.
"""
