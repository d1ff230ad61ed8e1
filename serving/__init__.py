"""Serving: many requests at once, over HTTP.

- scheduler.py: continuous batching (`scheduler.serve`, `scheduler.serving`), with
  preemption; main.py's --max_batch runs it too.
- server.py: the OpenAI-compatible HTTP server (`server.start`, `python server.py`);
  engine.py is its engine thread, sockets.py what a socket needs against hostile
  clients, openai_api.py what a request body may hold.

The door is `scheduler.serving`: everything here decodes through it.
"""
