"""The mixed load of issue #46, as a test: 48 clients for 60 s per decoder (readers, slow
readers that pause 1-8 s, clients that hang up, completions not streamed). No client that
resumes within --write_timeout_s (10 s) loses its completion, every finished text is its
lone run's, and the server's gauges, queues and memory come back to where they were."""
import gc
import json
import multiprocessing
import sys
import threading

import pytest

import soak_clients
from serving import server
from test_server_limits import exchange, request, wait_until

N_CLIENTS, SECONDS, PAUSE_S = 48, 60, (1.0, 8.0)
PROMPTS = ["Alan Turing", "The quick brown fox", "In a shocking finding,", "Once upon a time", "import numpy as np",
           "Dear Sir,", "1, 2, 3,", "The meaning of life is"]
BODIES = [{"prompt": p, "max_tokens": 40 + 60 * i, "seed": i, "temperature": 0.9, "ignore_eos": True}
          for i, p in enumerate(PROMPTS)]


def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="lag and progress are told by Linux's socket")
@pytest.mark.parametrize("mode", ["autoregressive", "speculative"])
def test_48_mixed_clients_for_a_minute_lose_nothing_and_leave_nothing_behind(models_dir, mode):
    args = server.parse_args(["--models_dir", models_dir, "--target_model_size", "124M", "--port", "0",
                              "--mode", mode, "--draft_model_size", "355M", "--K", "3", "--max_batch", "8",
                              "--max_model_len", "10000000", "--max_queue", "256"])
    httpd, engine = server.start(args)
    try:
        port = httpd.address[1]
        alone = []
        for body in BODIES:
            status, got = exchange(httpd, request(body, headers=""), timeout=60)
            assert status == 200
            alone.append(json.loads(got.split(b"\r\n\r\n", 1)[1])["choices"][0]["text"])
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(1) as pool:  # a short round first: what a run leaves in memory the first time
            pool.apply(soak_clients.run, (port, BODIES, 8, 2, (0.1, 0.2)))
            assert wait_until(lambda: not engine["outboxes"], 30)
            gc.collect()
            rss_before = rss_mb()
            scrapes, soaking = [], threading.Event()

            def scrape():  # the gauge as /metrics reads it, every 50 ms of the soak
                while not soaking.wait(0.05):
                    with engine["lock"]:
                        scrapes.append(len(engine["running"]))
            scraper = threading.Thread(target=scrape)
            scraper.start()
            try:
                outcomes = pool.apply(soak_clients.run, (port, BODIES, N_CLIENTS, SECONDS, PAUSE_S))
            finally:
                soaking.set()
                scraper.join()
        assert len(scrapes) > 100 and max(scrapes) <= 8  # running counts what runs (issue #57: it reached 12)
        assert wait_until(lambda: not engine["outboxes"], 30)
        gc.collect()
        rss_after = rss_mb()
        ended = {}
        for b, kind, pause, how, text in outcomes:
            ended.setdefault((kind, how.split(" ")[0]), []).append(pause)
            if kind == "leave":
                assert how == "left" and alone[b].startswith(text)
            else:  # every pause is under --write_timeout_s: nobody is cut off, nothing is cancelled
                assert how == "done" and text == alone[b], (kind, pause, how)
        print(f"\n{mode}: {len(outcomes)} requests, " + ", ".join(f"{k[0]} {k[1]}: {len(v)}" for k, v in
                                                                   sorted(ended.items())) +
              f"; pauses up to {max(ended[('pause', 'done')]):.1f} s; preemptions "
              f"{engine['metrics']['num_preemptions_total']}; RSS {rss_before:.0f} -> {rss_after:.0f} MB")
        assert len(ended[("pause", "done")]) >= 20 and max(ended[("pause", "done")]) > 6
        with engine["lock"]:
            assert not (engine["running"] or engine["waiting"] or engine["paused"] or engine["logprobs"]
                        or engine["lagging"])
        assert rss_after - rss_before < 64
    finally:
        server.stop(httpd, engine)
