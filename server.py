"""python server.py: serve GPT-2 over the OpenAI completions API (serving/server.py)."""
import sys

from serving.server import entry

if __name__ == "__main__":
    sys.exit(entry())
