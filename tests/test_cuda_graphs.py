"""The GPU's own kernels and recorded steps (issue #61), checked on a CPU: their CUDA C
compiles (NVRTC is a library: no GPU needed, only CuPy), and the recorded step's
bookkeeping (its buffers, positions and padding, a graph per shape, rows joining and
leaving, speculative verification) gives what the eager path gives, with NumPy standing
in for the device (layout.device_layout(params, numpy)). Then the whole step on a device
(the `cupy` fixture: a GPU, or our kernels run on the CPU with CUDA graphs recorded and
replayed as a GPU would, tests/cuda_on_cpu.py): the CPU's logits and text, and replay equal
to eager bit for bit."""
import collections
import dataclasses
import gc
import struct
import sys

import numpy as np
import pytest

import batching
import beam_search
import cost_model
import cuda_on_cpu
import kv_cache
import sampling
import speculative
from bench import common
from kernels import cuda, cuda_decode_loop, cuda_graphs, cuda_matmul, cuda_ops, cuda_sampling, layout
from serving import prefix_cache, scheduler

GREEDY = sampling.SamplingSettings(temperature=0.0)
SAMPLED = sampling.SamplingSettings(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.2)
UNPENALIZED = sampling.SamplingSettings(temperature=0.8, top_k=40, top_p=0.9)  # drawn inside a recorded graph
MIN_P = sampling.SamplingSettings(temperature=1.3, min_p=0.05)
CHEAP = cost_model.Costs(0.02, (1.0,) * 9)  # a draft so cheap that adaptive K gives each row K from 1 to 7
PROMPTS = [[464, 2068, 7586, 21831], [15496, 11, 995, 0, 383, 2068, 7586, 21831, 18045, 625, 262], [36235]]


@pytest.fixture(scope="module")
def both(tiny):
    """(hparams, the CPU's params, the same weights in the GPU's layout on NumPy)."""
    _, hparams, params = tiny
    return hparams, params, layout.device_layout(layout.plain_layout(params), np)


def generate(params, hparams, n, settings=GREEDY, seed=0, prompts=PROMPTS):
    return batching.generate(batching.requests(prompts, n, settings, seed), (params, hparams))[0]


def reading_logits(reqs):
    """reqs whose callback reads each token's logits (a server's logprobs)."""
    return [dataclasses.replace(r, wants_logits=True) for r in reqs]


def spec(params, hparams, n, K, settings=GREEDY, seed=0, adaptive=False):
    """Speculative decoding of PROMPTS with the first layer as the draft; settings: every
    row's, or a list of each row's."""
    draft = speculative.model_drafter((dict(params, blocks=params["blocks"][:1]), dict(hparams, n_layer=1)))
    each = settings if isinstance(settings, list) else [settings] * len(PROMPTS)
    reqs = [batching.Request(tuple(p), n, s, seed=seed + b) for b, (p, s) in enumerate(zip(PROMPTS, each))]
    return speculative.speculative_generate(reqs, (params, hparams), draft,
                                            speculative.SpeculativeConfig(K=K, adaptive=adaptive, costs=CHEAP))


@pytest.mark.parametrize("source", [cuda_matmul.SOURCE, cuda_ops.SOURCE, cuda_sampling.SOURCE],
                         ids=["matmul", "ops", "sampling"])
def test_the_cuda_sources_compile_without_a_gpu(source):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC comes with CuPy (pip install cupy-cuda12x)")
    cuda.check(source)


def test_a_typo_in_the_cuda_source_is_caught_without_a_gpu():
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC comes with CuPy (pip install cupy-cuda12x)")
    with pytest.raises(RuntimeError, match="warp_summ"):
        cuda.check(cuda_matmul.SOURCE.replace("warp_sum(acc[r][c])", "warp_summ(acc[r][c])"))


def built_for(source, arch="sm_90"):
    """{kernel: [registers a thread, stack frame bytes, static shared memory bytes]} of source
    as NVRTC builds it for arch (cuda.OPTIONS, and CuPy's -ftz=true), read from the cubin: the .nv.info
    sections' EIATTR_REGCOUNT (0x2f) and EIATTR_FRAME_SIZE (0x11), each an 8-byte value (the
    kernel's symbol, the number), and the size of its .nv.shared.<kernel> section."""
    from cupy_backends.cuda.libs import nvrtc
    program = nvrtc.createProgram(cuda.SHARED + source, "k.cu", [], [])
    try:
        nvrtc.compileProgram(program, [f"--gpu-architecture={arch}", *cuda.OPTIONS, "-ftz=true"])
        elf = nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)
    (table,), (entry, count, names) = struct.unpack_from("<Q", elf, 0x28), struct.unpack_from("<HHH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, table + i * entry) for i in range(count)]  # ELF64 headers

    def string(strings, at):  # a name from string table section `strings`
        start = sections[strings][4] + at
        return elf[start:elf.index(b"\0", start)].decode()
    symbols = next(s for s in sections if s[1] == 2)  # SHT_SYMTAB, 24-byte entries, names in section s[6]
    found = collections.defaultdict(lambda: [0, 0, 0])
    for name, _, _, _, at, size, *_ in sections:
        if string(names, name).startswith(".nv.shared.") and not string(names, name).startswith(".nv.shared.reserved"):
            found[string(names, name).removeprefix(".nv.shared.")][2] = size
        if not string(names, name).startswith(".nv.info"):
            continue
        end = at + size
        while at < end:
            form, attribute = elf[at], elf[at + 1]
            if form == 4:  # a value with its size
                n, = struct.unpack_from("<H", elf, at + 2)
                if attribute in (0x2f, 0x11) and n == 8:
                    symbol, value = struct.unpack_from("<II", elf, at + 4)
                    found[string(symbols[6], struct.unpack_from("<I", elf, symbols[4] + 24 * symbol)[0])][
                        attribute == 0x11] = value
                at += 4 + n
            else:
                at += 4 if form in (2, 3) else 2
    return found


def test_a_decode_products_kernels_keep_their_blocks_an_sm_and_no_kernel_spills():
    """Registers decide how many blocks an SM holds, so how many weight loads are in flight:
    built for an H100/H200 (sm_90), every one-row product (the layer norm's or not) fits 3
    blocks an SM and every few-row product 2, and no product or attention kernel keeps values
    on a stack (spills)."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC comes with CuPy (pip install cupy-cuda12x)")
    products, ops = built_for(cuda_matmul.SOURCE), built_for(cuda_ops.SOURCE)
    one_row = {name: r for name, (r, *_) in products.items() if name.startswith("row_times_columns")}
    rows = {name: r for name, (r, *_) in products.items() if name.startswith("rows_times_columns")}
    assert len(one_row) == len(rows) == 4 and max(one_row.values()) <= 80, one_row  # 65,536 an SM, 8 at a time
    assert max(rows.values()) <= 128, rows  # ROWS rows: 2 blocks an SM
    kernels = {name: frame for name, (_, frame, _) in {**products, **ops}.items() if not name.startswith("$")}
    assert len(kernels) == 12 + 6 and not any(kernels.values()), kernels  # ("$": CUDA's own division helpers)


def test_every_kernels_shared_memory_fits_a_block_with_the_most_its_launch_asks():
    """A block has 48 KiB of shared memory (more is an opt-in our launches do not make), or
    the launch fails: each kernel's own (static: from the machine code NVRTC builds for an
    A100, sm_80; sm_90's adds the 1 KiB the driver reserves a block, which the 48 may or may
    not count: attention leaves room for it), and attention's with a row's scores at the most
    slots attend_stored allows."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC comes with CuPy (pip install cupy-cuda12x)")
    built = {name: shared for source in (cuda_matmul.SOURCE, cuda_ops.SOURCE, cuda_sampling.SOURCE)
             for name, (*_, shared) in built_for(source, "sm_80").items() if not name.startswith("$")}
    attend = {name: shared for name, shared in built.items() if name.startswith("attend")}
    assert len(attend) == 4 and all(s + cuda_ops.RESERVED + 4 * cuda_ops.ATTEND_SLOTS <= 48 * 1024 for s in attend.values()), attend
    assert len(built) == 12 + 6 + 4 and max(built.values()) <= 48 * 1024, built
    assert cuda_ops.ATTEND_SLOTS >= 1024  # GPT-2's window


def test_every_step_gives_the_eager_passes_logits(both):
    """Prompts of 4, 11 and 1 tokens, then 12 one-token steps: each step's logits within
    float32's rounding of the CPU's pass (the stand-in sums in NumPy's order, not the kernels')."""
    hparams, params, dev = both
    texts = [list(p) for p in PROMPTS]
    cpu, gpu = (kv_cache.init_cache(hparams, 3, hparams["n_ctx"], like=p["wpe"]) for p in (params, dev))
    for _ in range(12):
        want = kv_cache.next_logits((params, hparams), cpu, texts)
        got = kv_cache.next_logits((dev, hparams), gpu, texts)
        assert got.dtype == np.float32 and got.shape == want.shape == (3, 1, hparams["n_vocab"])
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
        for text, token in zip(texts, want[:, -1].argmax(-1)):
            text.append(int(token))
    assert np.array_equal(gpu["lengths"], cpu["lengths"])


def test_a_shape_runs_eagerly_twice_then_is_recorded_and_replayed(both):
    hparams, _, dev = both
    texts = [list(p) for p in PROMPTS]
    cache = kv_cache.init_cache(hparams, 3, hparams["n_ctx"], like=dev["wpe"])
    for _ in range(5):
        kv_cache.next_logits((dev, hparams), cache, texts)
        for text in texts:
            text.append(7)
    steps = {key[2:]: shaped for key, shaped in cache["graphs"].items()}
    assert steps[(4, 1)]["uses"] == 4 and steps[(4, 1)]["replay"] is not None  # 3 rows in the bucket of 4
    assert all(shaped["replay"] is None for shape, shaped in steps.items() if shaped["uses"] == 1)
    view = kv_cache.rows(cache, 0, 2)  # a view of the first rows shares the cache's graphs, with shapes of its own
    kv_cache.next_logits((dev, hparams), view, texts[:2])
    assert view["graphs"] is cache["graphs"] and any(key[2:] == (2, 1) for key in cache["graphs"])
    assert [cuda_graphs.bucket(B) for B in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 16]


@pytest.mark.parametrize("T", [1, 5])
def test_a_timed_pass_on_a_static_step_is_a_replay(both, monkeypatch, T):
    """The benchmark's and main.py's costs (cli/timing.pass_seconds) time replays of the
    recorded step, not the eager passes before it (the second of which records): on a GPU
    those cost several times a replay. The CPU's kernels keep their one warm-up."""
    from cli import timing
    hparams, params, dev = both
    replays, step = [], cuda_graphs.step

    def watched(model, cache, inputs, n_new, n_logits):
        replays.append(cuda_graphs.static_step(model, cache, cuda_graphs.bucket(inputs.shape[0]), inputs.shape[1])[
            "replay"] is not None)
        return step(model, cache, inputs, n_new, n_logits)
    monkeypatch.setattr(cuda_graphs, "step", watched)
    for reps in (1, 3):
        replays.clear()
        assert timing.pass_seconds((dev, hparams), 16, T, reps=reps) > 0
        assert replays == [False, False] + [True] * reps  # two warm-ups, then every timed pass a replay
    passes, next_logits, steps = [], kv_cache.next_logits, len(replays)
    monkeypatch.setattr(kv_cache, "next_logits", lambda *a, **k: passes.append(1) or next_logits(*a, **k))
    timing.pass_seconds((params, hparams), 16, T, reps=2)
    assert len(passes) == 3 and len(replays) == steps  # the CPU: one warm-up, no static step


def test_a_timed_draft_token_is_a_replay_of_the_draft_loop_over_K(both, monkeypatch):
    """The benchmark's and main.py's draft cost c on a GPU: a K-token draft's replay over K
    (the two runs before it warm up and record); None on the CPU, where a pass is timed."""
    from cli import timing
    hparams, params, dev = both
    ran, run = [], cuda_graphs.run
    monkeypatch.setattr(cuda_graphs, "run", lambda static: ran.append(("q" in static, static["replay"] is not None))
                        or run(static))
    assert timing.draft_seconds((dev, hparams), 16, K=3, reps=2) > 0
    assert ran == [(True, False)] * 2 + [(True, True)] * 2
    ran.clear()
    assert timing.draft_seconds((params, hparams), 16, K=3, reps=2) is None and not ran


def test_a_timed_step_and_verification_are_replays_of_their_graphs(both, monkeypatch):
    """The benchmark's and main.py's decode step and verify(K+1) on a GPU: the replay of a step
    with its draw, and of a verification of K drafts with its pass (the two runs before each
    warm up and record). On the CPU, a pass, and no verification graph (None)."""
    from cli import timing
    hparams, params, dev = both
    ran, run = [], cuda_graphs.run
    monkeypatch.setattr(cuda_graphs, "run", lambda static: ran.append((sorted({"q", "accept"} & set(static)),
                                                                       static["replay"] is not None)) or run(static))
    assert timing.step_seconds((dev, hparams), 16, reps=2) > 0
    assert timing.verify_seconds((dev, hparams), 16, K=3, reps=2) > 0
    assert ran == [(["q"], False)] * 2 + [(["q"], True)] * 2 + [(["accept", "q"], False)] * 2 + [
        (["accept", "q"], True)] * 2
    ran.clear()
    qs = []  # the q each verification's graph reads: one-hot drafts (prompt lookup's) copy none in
    monkeypatch.setattr(cuda_graphs, "run", lambda static: qs.append(static.get("q")) or run(static))
    assert timing.verify_seconds((dev, hparams), 16, K=3, reps=2, one_hot=True) > 0
    assert len(qs) == 4 and all(q is None for q in qs)
    ran.clear()
    assert timing.step_seconds((params, hparams), 16, reps=2) > 0 and not ran
    assert timing.verify_seconds((params, hparams), 16, K=3, reps=2) is None and not ran


def test_the_decode_loop_leaves_what_it_cannot_record_and_records_a_graph_whatever_the_settings(both):
    """A row's penalties or n-gram ban, riders, no drafts: None, nothing drawn, nothing cached
    (a pass at a time does it all). Each row's settings are its own and the graph's data, not
    its kernels' arguments: rows of different settings share one graph, as do later steps
    under other settings."""
    hparams, _, dev = both
    model = (dict(dev, blocks=dev["blocks"][:1]), dict(hparams, n_layer=1))
    cache = kv_cache.init_cache(model[1], 2, hparams["n_ctx"], like=dev["wpe"])
    texts = [list(PROMPTS[0]), list(PROMPTS[2])]

    def never():
        raise AssertionError("drew for a loop that does not run")
    banning = sampling.SamplingSettings(temperature=0.8, no_repeat_ngram_size=2)
    for k, settings, riders in (([3, 3], [SAMPLED] * 2, ()), ([3, 3], [banning] * 2, ()),
                                ([3, 3], [GREEDY, SAMPLED], ()), ([0, 0], [GREEDY] * 2, ()),
                                ([3, 3], [GREEDY] * 2, [(kv_cache.rows(cache, 1, 2), texts[1], 1)])):
        assert cuda_decode_loop.draft(model, cache, texts, k, settings, never, riders) is None
        assert not cache["lengths"].any()
    for t in range(4):
        settings = [sampling.SamplingSettings(temperature=0.5 + t / 10, top_k=2 + t), GREEDY]
        drafts, q = cuda_decode_loop.draft(model, cache, texts, [3, 1], settings, lambda: np.full((2, 3), 0.5))
        assert [len(d) for d in drafts] == [3, 1] and q.shape == (2, 3, hparams["n_vocab"])
        assert list(cache["lengths"]) == [len(texts[0]) + 2, len(texts[1]) + 1]  # pass 0, then the drafts read
        assert ((q[1, 0] == 0) | (q[1, 0] == 1)).all() and (q[0, 0] < 1).all()  # greedy one-hot, the other not
        kv_cache.rollback(cache, [len(text) - 1 for text in texts])
    assert [key[3:6] for key in cache["graphs"] if key[0] == "decode loop"] == [(2, 4, 3), (2, 1, 3)]  # (B', T, K)


def verification_args(model, drafts, q_dtype=np.float32):
    """cuda_decode_loop.verify's arguments after the texts (q uniform on the host)."""
    (B, K), n_vocab = drafts.shape, model[1]["n_vocab"]
    return (np.full((B, K, n_vocab), 1 / n_vocab, q_dtype), drafts, [K] * B, np.full((B, K), 0.5), np.full(B, 0.5))


def test_the_verification_leaves_what_it_cannot_record(both):
    """A row's penalties or n-gram ban, riders, no drafts, a q that is not [B, K, n_vocab]:
    None, nothing cached (the verification after its pass does it all); then a verification
    of two drafts a row caches the texts and accepts up to 2."""
    hparams, _, dev = both
    model = (dict(dev, blocks=dev["blocks"][:1]), dict(hparams, n_layer=1))
    cache = kv_cache.init_cache(model[1], 2, hparams["n_ctx"], like=dev["wpe"])
    drafts = np.array([[5, 6], [7, 8]])
    texts = [list(PROMPTS[0]) + [5, 6], list(PROMPTS[2]) + [7, 8]]
    q, _, k, u, v = verification_args(model, drafts)
    banning = sampling.SamplingSettings(temperature=0.8, no_repeat_ngram_size=2)
    riders = [(kv_cache.rows(cache, 1, 2), texts[1], 1)]
    for args, settings, riders in (((q, drafts), [SAMPLED] * 2, ()), ((q, drafts), [GREEDY, banning], ()),
                                   ((q, drafts), [GREEDY] * 2, riders), ((q[:, :0], drafts[:, :0]), [GREEDY] * 2, ()),
                                   ((q[:, :, :-1], drafts), [GREEDY] * 2, ()), ((q[:1], drafts), [GREEDY] * 2, ())):
        assert cuda_decode_loop.verify(model, cache, texts, *args, k, u, v, settings, speculative.verify,
                                       riders) is None
        assert not cache["lengths"].any()
    logits, n, token = cuda_decode_loop.verify(model, cache, texts, q, drafts, k, u, v, [GREEDY] * 2,
                                               speculative.verify)
    assert logits.shape == (2, 3, hparams["n_vocab"]) and all(0 <= nb <= 2 for nb in n) and len(token) == 2
    assert list(cache["lengths"]) == [len(text) for text in texts]


@pytest.mark.parametrize("settings", [GREEDY, SAMPLED, UNPENALIZED], ids=["greedy", "penalized", "sampled"])
def test_text_through_recorded_steps_equals_the_cpu_path(both, settings):
    """60 tokens on the tiny model (n_ctx 64): every row's window restarts on the way."""
    hparams, params, dev = both
    assert generate(dev, hparams, 60, settings, seed=3) == generate(params, hparams, 60, settings, seed=3)


@pytest.mark.parametrize("settings", [GREEDY, UNPENALIZED], ids=["greedy", "sampled"])
def test_a_step_drawn_inside_its_graph_gives_the_tokens_and_logits_of_a_step_drawn_after(both, monkeypatch, settings):
    """Plain decoding's passes and draws as one recorded loop (cuda_decode_loop.step), STEPS
    tokens a row a step, and a pass at a time with the draw after it: every token and every
    logits row a callback sees (a server's logprobs), bit for bit, windows restarting on the
    way."""
    hparams, _, dev = both
    runs = []
    for looped in (True, False):
        seen, drawn, step = [], [], cuda_decode_loop.step

        def stepped(*args, looped=looped, **kwargs):
            drawn.append(step(*args, **kwargs) if looped else None)
            return drawn[-1]
        with monkeypatch.context() as m:
            m.setattr(cuda_decode_loop, "step", stepped)
            texts = batching.generate(reading_logits(batching.requests(PROMPTS, 60, settings, 3)), (dev, hparams),
                                      callback=lambda seq, token, accepted, logits: seen.append(
                                          (seq.index, token, logits.tolist())))[0]
        runs.append((texts, sorted(seen, key=lambda event: event[0])))  # each row's events in order
        sizes = [max(map(len, d[0])) for d in drawn if d is not None]  # tokens a row of each step
        assert (sizes.count(cuda_decode_loop.STEPS) > 8 and sum(sizes) > 40) if looped else not any(drawn)
    assert runs[0] == runs[1] and len(runs[0][1]) == 3 * 60


@pytest.mark.parametrize("settings", [GREEDY, UNPENALIZED, sampling.SamplingSettings(temperature=1.5)],
                         ids=["greedy", "sampled", "flat"])  # flat: the tiny model's text depends on every draw
def test_a_plain_step_of_several_tokens_gives_the_tokens_of_one_a_step(both, monkeypatch, settings):
    """A plain step on the recorded loop makes up to cuda_decode_loop.STEPS tokens a row: the
    tokens of one a step (STEPS = 1), bit for bit, with rows of several lengths (max_new_tokens
    no multiple of STEPS), one row ending at EOS inside a step, and windows restarting on the
    way; and most steps make STEPS. A callback that reads only the tokens (a stream) sees each,
    in order, and no logits."""
    hparams, _, dev = both
    lengths, made, streamed = [61, 58, 70], [], []  # (row 0's window fills in a step where row 2 makes STEPS)
    with monkeypatch.context() as m:
        m.setattr(cuda_decode_loop, "STEPS", 1)
        one_a_step = [batching.generate([r], (dev, hparams))[0][0]
                      for r in batching.requests(PROMPTS, 70, settings, 3)]  # each row alone
    eos = next(t for i, t in enumerate(one_a_step[1]) if i % cuda_decode_loop.STEPS == 2 and t not in one_a_step[1][:i])
    step = cuda_decode_loop.step

    def counted(*args, **kwargs):
        made.append(step(*args, **kwargs))
        return made[-1]
    monkeypatch.setattr(cuda_decode_loop, "step", counted)
    reqs = [batching.Request(tuple(p), n, settings, 3 + b, eos if b == 1 else None)
            for b, (p, n) in enumerate(zip(PROMPTS, lengths))]
    got = batching.generate(reqs, (dev, hparams), callback=lambda seq, token, accepted, logits: streamed.append(
        (seq.index, token, logits)))[0]
    assert got == [one_a_step[0][:61], one_a_step[1][:one_a_step[1].index(eos) + 1], one_a_step[2]]
    assert [[t for i, t, _ in streamed if i == b] for b in range(3)] == got and all(x is None for *_, x in streamed)
    assert (len(got[1]) - 1) % cuda_decode_loop.STEPS  # inside a step (a first token comes alone, then STEPS)
    sizes = [max(map(len, m[0])) for m in made if m is not None]
    assert sizes.count(cuda_decode_loop.STEPS) > 0.6 * len(made) and set(sizes) > {1, cuda_decode_loop.STEPS}


@pytest.mark.parametrize("K", [1, 4, 7])
def test_speculative_greedy_equals_plain_greedy_through_recorded_steps(both, K):
    """Verification passes of K + 1 tokens, rows padded where they accepted fewer drafts."""
    hparams, params, dev = both
    got, stats = spec(dev, hparams, 30, K)
    assert got == generate(dev, hparams, 30) == generate(params, hparams, 30) and 0 < stats.acceptance_rate < 1


def watch_verify(monkeypatch, looped=True):
    """[(drafts, u, v, each row's q at its drafts)] as speculative.verify sees them, and [pass
    0's tokens T, for each step drafted by the recorded loop]; looped False: every step drafts
    a pass at a time. The verification runs after its pass, where the host sees its arguments
    (not in a recorded graph of its own: test_the_recorded_verification_...)."""
    seen, loops, verify, draft, static_loop = [], [], speculative.verify, cuda_decode_loop.draft, \
        cuda_decode_loop.static_loop
    monkeypatch.setattr(cuda_decode_loop, "static_loop", lambda model, cache, Bp, T, K, *keep: loops.append(T) or
                        static_loop(model, cache, Bp, T, K, *keep))

    def watched(p, q, drafts, k, u, v):
        q_host = speculative.one_hot(drafts, k, p.shape[-1]) if q is None else q if isinstance(q, np.ndarray) else \
            q.get()  # [B, K, n_vocab]
        seen.append((drafts.tolist(), u.tolist(), v.tolist(), [q_host[b, :kb].tolist() for b, kb in enumerate(k)]))
        return verify(p, q, drafts, k, u, v)

    monkeypatch.setattr(speculative, "verify", watched)
    monkeypatch.setattr(cuda_decode_loop, "draft", lambda *args: draft(*args) if looped else None)
    monkeypatch.setattr(cuda_decode_loop, "verify", lambda *args, **kwargs: None)
    return seen, loops


def watch_verification(monkeypatch, looped):
    """[(the target's logits, n and tokens) of each step's verification] and [(B', T, K,
    one_hot) of each recorded verification made]; looped False: every verification runs after
    its pass."""
    seen, graphs = [], []
    verify_with_target, verify, static_verification = speculative.verify_with_target, cuda_decode_loop.verify, \
        cuda_decode_loop.static_verification

    def watched(*args):
        logits, n, token = verify_with_target(*args)
        seen.append(((logits if isinstance(logits, np.ndarray) else logits.get()).tolist(), n, token))
        return logits, n, token
    monkeypatch.setattr(speculative, "verify_with_target", watched)
    monkeypatch.setattr(cuda_decode_loop, "verify", lambda *args, **kwargs: verify(*args, want_logits=True)
                        if looped else None)  # (the logits a callback would see: to compare)
    monkeypatch.setattr(cuda_decode_loop, "static_verification", lambda model, cache, Bp, T, K, one_hot=False:
                        graphs.append((Bp, T, K, one_hot)) or static_verification(model, cache, Bp, T, K, one_hot))
    return seen, graphs


@pytest.mark.parametrize("settings, adaptive", [(GREEDY, False), (UNPENALIZED, False), (GREEDY, True),
                                                ([UNPENALIZED, GREEDY, MIN_P], True)],
                         ids=["greedy", "sampled", "adaptive K", "each row its settings"])
def test_the_recorded_draft_loop_drafts_what_a_pass_at_a_time_drafts(both, monkeypatch, settings, adaptive):
    """Speculative decoding with the draft's K passes and draws as one recorded loop, and a pass
    at a time: the same drafts, draws and q (bit for bit) in every step, and the same texts. Rows
    draft fewer than the batch's K (adaptive K, their ends), some steps read two tokens (a
    catch-up pass), and the windows restart (pass 0 then too long for a static step)."""
    hparams, _, dev = both
    runs = []
    for looped in (True, False):
        with monkeypatch.context() as m:
            seen, loops = watch_verify(m, looped)
            runs.append((spec(dev, hparams, 60, 4, settings, seed=5, adaptive=adaptive)[0], seen))
        if looped:  # most steps in the loop, catch-up passes among them
            assert len(loops) > len(seen) // 2 and 2 in loops
        else:
            assert not loops
    assert runs[0] == runs[1]


@pytest.mark.parametrize("settings, adaptive", [(GREEDY, False), (UNPENALIZED, False), (GREEDY, True),
                                                ([UNPENALIZED, GREEDY, MIN_P], True)],
                         ids=["greedy", "sampled", "adaptive K", "each row its settings"])
def test_the_recorded_verification_accepts_what_a_verification_after_its_pass_accepts(both, monkeypatch, settings,
                                                                                     adaptive):
    """The target's pass, its distributions p and the verification as one recorded graph, and
    the verification after the pass: in every step the same logits (a callback's), accepted n
    and tokens, bit for bit, and the same texts. Rows verify fewer drafts than the batch's K
    (adaptive K, their ends; padding rows past B), drafts are rejected, and the windows
    restart (kv_cache.prefill_alone caching the restarted window before the graph's pass)."""
    hparams, _, dev = both
    runs = []
    for looped in (True, False):
        with monkeypatch.context() as m:
            seen, graphs = watch_verification(m, looped)
            texts, stats = spec(dev, hparams, 60, 4, settings, seed=5, adaptive=adaptive)
            runs.append((texts, seen))
        drafted = sum(len(logits[0]) > 1 for logits, _, _ in seen)  # (a step without drafts has no graph)
        assert (len(graphs) == drafted > len(seen) // 2) if looped else not graphs
        assert 0 < stats.acceptance_rate < 1
    assert runs[0] == runs[1]
    assert len({len(logits[0]) for logits, _, _ in runs[0][1]}) > (2 if adaptive else 1)  # steps of several K


@pytest.mark.parametrize("settings", [GREEDY, UNPENALIZED], ids=["greedy", "sampled"])
def test_prompt_lookup_verifies_its_drafts_through_the_recorded_verification(both, monkeypatch, settings):
    """A drafter without a model (q None: one-hot at its drafts, which the graph makes itself):
    the steps with drafts are verified by a recorded graph of its own, with the logits, n and
    tokens of the verification after its pass (speculative.verify on one_hot's q), bit for bit;
    greedy, the CPU's greedy text."""
    hparams, params, dev = both
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5 + [9]]
    runs = []
    for looped in (True, False):
        with monkeypatch.context() as m:
            seen, graphs = watch_verification(m, looped)
            got, stats = speculative.speculative_generate(batching.requests(prompts, 30, settings, seed=3),
                                                          (dev, hparams), speculative.PROMPT_LOOKUP)
            runs.append((got, seen))
        assert stats.drafted and (graphs and all(one_hot for *_, one_hot in graphs) if looped else not graphs)
    assert runs[0] == runs[1]
    if settings is GREEDY:
        assert runs[0][0] == generate(params, hparams, 30, prompts=prompts)


def test_a_draft_with_a_smaller_window_drafts_a_pass_at_a_time_where_it_would_restart(both, monkeypatch):
    """A draft of n_ctx 32 for the target's 64: where a row's drafts would pass the draft's
    window, the loop leaves them to a pass at a time (which restarts the window between
    passes); the same drafts, q and text as a pass at a time throughout."""
    hparams, _, dev = both
    draft = speculative.model_drafter((dict(dev, blocks=dev["blocks"][:1], wpe=dev["wpe"][:32]),
                                       dict(hparams, n_layer=1, n_ctx=32)))
    runs = []
    for looped in (True, False):
        with monkeypatch.context() as m:
            seen, loops = watch_verify(m, looped)
            runs.append((speculative.speculative_generate(batching.requests([list(range(100, 125))], 30, GREEDY),
                                                          (dev, hparams), draft)[0], seen))
        assert (0 < len(loops) < len(seen)) if looped else not loops
    assert runs[0] == runs[1]


def test_rows_joining_and_leaving_mid_run_keep_their_texts(both):
    """12 requests through 3 rows of the scheduler: rows come and go, shapes change, and each
    request's text is what the CPU gives it alone."""
    hparams, params, dev = both
    rng = np.random.default_rng(0)
    reqs = [batching.Request(tuple(rng.integers(0, 50000, rng.integers(1, 12)).tolist()), int(rng.integers(1, 20)),
                             GREEDY, seed=i) for i in range(12)]
    events = list(scheduler.serve(reqs, scheduler.autoregressive((dev, hparams)), max_batch=3))
    finished = {e.index: e.tokens for e in events if e.kind == "finished"}
    assert finished == {i: batching.generate([r], (params, hparams))[0][0] for i, r in enumerate(reqs)}


def test_a_servers_rows_make_several_tokens_a_step_and_the_logits_a_request_reads(both, monkeypatch):
    """The scheduler's rows (a server's: its events are the batch's callback) on the recorded
    loop make up to STEPS tokens a step, also while a request in the batch wants_logits (a
    server's logprobs): that request's every event carries the logits of a step drawn after its
    pass, bit for bit; the others' events carry none. Each text is the CPU's for that request
    alone, whichever requests read their logits."""
    hparams, params, dev = both
    rng = np.random.default_rng(3)
    reqs = [batching.Request(tuple(rng.integers(0, 50000, rng.integers(1, 12)).tolist()), int(rng.integers(6, 30)),
                             UNPENALIZED if i % 2 else GREEDY, seed=i) for i in range(8)]
    alone = {i: batching.generate([r], (params, hparams))[0][0] for i, r in enumerate(reqs)}
    step, made = cuda_decode_loop.step, []

    def counted(model, cache, texts, *args, looped=True, **kwargs):  # (request 2 in the batch, tokens a row)
        drawn = step(model, cache, texts, *args, **kwargs) if looped else None
        made.append((any(text[:len(reqs[2].prompt)] == list(reqs[2].prompt) for text in texts),
                     drawn and max(map(len, drawn[0]))))
        return drawn
    runs = {}
    for reading, looped in ((False, True), (True, True), (True, False)):
        made.clear()
        monkeypatch.setattr(cuda_decode_loop, "step", lambda *args, looped=looped, **kw: counted(*args, looped=looped,
                                                                                                  **kw))
        served = [dataclasses.replace(r, wants_logits=reading and i == 2) for i, r in enumerate(reqs)]
        events = list(scheduler.serve(served, scheduler.autoregressive((dev, hparams)), max_batch=3))
        assert {e.index: e.tokens for e in events if e.kind == "finished"} == alone
        tokens = [e for e in events if e.kind == "token"]
        assert all((e.logits is not None) == (reading and e.index == 2) for e in tokens)
        runs[reading, looped] = [e.logits.tolist() for e in tokens if e.index == 2 and reading]
        if looped:
            sizes = collections.Counter(made)
            assert sizes[False, cuda_decode_loop.STEPS] > 3  # (once request 2 has left, or before it came)
            assert sizes[True, cuda_decode_loop.STEPS] > 3
    assert runs[True, True] == runs[True, False] and len(runs[True, True]) == len(alone[2])


def test_a_speculative_batch_whose_rows_come_and_go_drafts_through_the_recorded_loop(both, monkeypatch):
    """12 requests through 3 rows of the scheduler's speculative decoder, prompts in chunks of
    8 tokens (a step that caches a chunk drafts a pass at a time): the loop's graphs serve
    the batch's first rows as it changes size, and each text is the CPU's greedy text alone."""
    hparams, params, dev = both
    rng = np.random.default_rng(1)
    reqs = [batching.Request(tuple(rng.integers(0, 50000, rng.integers(1, 30)).tolist()), int(rng.integers(1, 20)),
                             GREEDY, seed=i) for i in range(12)]
    draft = speculative.model_drafter((dict(dev, blocks=dev["blocks"][:1]), dict(hparams, n_layer=1)))
    seen, loops = watch_verify(monkeypatch)
    events = list(scheduler.serve(reqs, scheduler.speculative_decoder((dev, hparams), draft,
                                                                      speculative.SpeculativeConfig(K=3)),
                                  max_batch=3, max_prefill_tokens=8))
    finished = {e.index: e.tokens for e in events if e.kind == "finished"}
    assert finished == {i: batching.generate([r], (params, hparams))[0][0] for i, r in enumerate(reqs)}
    assert len(seen) > len(loops) > len(seen) // 2, (len(seen), len(loops))


def test_a_padding_token_stores_nothing_and_attends_to_nothing():
    rng = np.random.default_rng(0)
    B, H, T, D, S = 2, 2, 3, 4, 8
    q, k, v = (rng.standard_normal((B, H, T, D), dtype=np.float32) for _ in range(3))
    layer = {"k": np.zeros((B, H, S, D), np.float32), "v": np.zeros((B, H, S, D), np.float32)}
    positions = np.array([[2, 3, -1], [0, -1, -1]])  # row 0: two tokens after 2 cached; row 1: its first token
    out = cuda_ops.attend_reference(positions, layer, q, k, v)
    assert np.array_equal(layer["k"][0, :, 2:4], k[0, :, :2]) and np.array_equal(layer["v"][1, :, 0], v[1, :, 0])
    assert not layer["k"][0, :, 4:].any() and not layer["k"][1, :, 1:].any()  # the padding stored nothing
    assert not out[0, :, 2].any() and not out[1, :, 1:].any()
    np.testing.assert_allclose(out[1, :, 0], v[1, :, 0], rtol=1e-6)  # a first token sees itself alone


def test_main_with_backend_cupy_runs_our_layout_end_to_end_on_a_numpy_stand_in(models_dir, capsys, monkeypatch):
    """main.py --backend cupy with GPT2_GPU_KERNELS=1, CuPy played by NumPy (test_benchmark's
    stand-in): the wiring from the flags to the recorded steps, speculative decoding included."""
    import main
    from test_benchmark import numpy_as_cupy
    monkeypatch.setitem(sys.modules, "cupy", numpy_as_cupy())
    monkeypatch.setenv(layout.GPU_KERNELS_ENV, "1")
    steps, step = [], cuda_graphs.step
    monkeypatch.setattr(cuda_graphs, "step", lambda *args: steps.append(args[2].shape) or step(*args))
    rc = main.main(["--models_dir", models_dir, "--target_model_size", "124M", "--draft_model_size", "355M",
                    "--temperature", "0", "--n_tokens_to_generate", "20", "--backend", "cupy"])
    assert rc == 0 and "greedy texts identical: yes" in capsys.readouterr().out
    assert (1, 1) in steps and any(T > 1 for _, T in steps)  # decode steps and verifications went through it


V = 512  # the vocabulary of the device's tests: the emulation runs the 50,257-wide head in seconds
SMALL_PROMPTS = [[t % V for t in p] for p in PROMPTS]


@pytest.fixture(scope="module")
def small(tiny):
    """(hparams, plain params) of the tiny GPT-2 cut to its first V tokens."""
    _, hparams, params = tiny
    plain = layout.plain_layout(params)
    return dict(hparams, n_vocab=V), dict(plain, wte=np.ascontiguousarray(np.asarray(plain["wte"])[:V]))


def replays(monkeypatch):
    """[1 for each replay of a recorded step] from now on: a device test's steps were graphs."""
    count, record = [], cuda_graphs.record

    def counted(forward, like):
        replay, out, keep = record(forward, like)
        return (lambda: count.append(1) or replay()), out, keep
    monkeypatch.setattr(cuda_graphs, "record", counted)
    return count


def on_device(cupy, small, dtype="float32"):
    hparams, params = small
    return layout.device_layout(params, cupy, dtype), hparams


def test_recorded_steps_on_the_device_give_the_cpus_logits(cupy, small):
    """12 steps of three rows, replayed from the third: logits within 1e-4 of the CPU's pass."""
    hparams, params = small
    model = on_device(cupy, small)
    texts = [list(p) for p in SMALL_PROMPTS]
    cpu = kv_cache.init_cache(hparams, 3, hparams["n_ctx"], like=params["wpe"])
    gpu = kv_cache.init_cache(hparams, 3, hparams["n_ctx"], like=model[0]["wpe"])
    for _ in range(12):
        want = kv_cache.next_logits((params, hparams), cpu, texts)
        got = kv_cache.next_logits(model, gpu, texts)
        np.testing.assert_allclose(cupy.asnumpy(got), want, atol=1e-4, rtol=0)
        for text, token in zip(texts, want[:, -1].argmax(-1)):
            text.append(int(token))
    assert any(shaped["replay"] is not None for shaped in gpu["graphs"].values())


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_replayed_step_on_the_device_is_the_eager_step_bit_for_bit(cupy, small, dtype):
    """The same steps on two caches: one records its shapes and replays them, the other runs
    every step eagerly through the same kernels. Rows leave and join: 3 rows (the bucket of
    4, recorded on a view of 3 rows), then 2, then 4 (the same graph, a row more)."""
    hparams, _ = small
    model = on_device(cupy, small, dtype)
    texts = [list(p) for p in SMALL_PROMPTS + [[5, 6]]]
    replayed, eager = (kv_cache.init_cache(hparams, 4, hparams["n_ctx"], like=model[0]["wpe"]) for _ in range(2))
    for step, rows in enumerate([3, 3, 3, 3, 3, 2, 2, 4, 4, 4, 4, 4]):
        got = kv_cache.next_logits(model, kv_cache.rows(replayed, 0, rows), texts[:rows])
        want = kv_cache.next_logits(model, kv_cache.rows(eager, 0, rows), texts[:rows])
        for shaped in eager["graphs"].values():
            shaped["uses"] = 0  # never recorded: eager every time
        assert np.array_equal(cupy.asnumpy(got), cupy.asnumpy(want)), step
        for text, token in zip(texts, cupy.asnumpy(want[:, -1].argmax(-1))):
            text.append(int(token))
    assert any(shaped["replay"] is not None for shaped in replayed["graphs"].values())
    assert all(shaped["replay"] is None for shaped in eager["graphs"].values())


@pytest.mark.parametrize("K", [0, 4])
def test_greedy_text_on_the_device_equals_the_cpus(cupy, small, K, monkeypatch):
    """Plain greedy (K = 0) and speculative greedy through our kernels' recorded steps give the
    NumPy path's text; 40 tokens on n_ctx 64 restart every row's window."""
    hparams, params = small
    want, replayed = generate(params, hparams, 40, prompts=SMALL_PROMPTS), replays(monkeypatch)
    model = on_device(cupy, small)
    if K == 0:
        assert generate(model[0], hparams, 40, prompts=SMALL_PROMPTS) == want
    else:
        draft = speculative.model_drafter((dict(model[0], blocks=model[0]["blocks"][:1]), dict(hparams, n_layer=1)))
        got, stats = speculative.speculative_generate(batching.requests(SMALL_PROMPTS, 40, GREEDY, 0), model, draft,
                                                      speculative.SpeculativeConfig(K=K))
        assert got == want and 0 < stats.acceptance_rate < 1
    assert replayed


def device_speculation(cupy, small, monkeypatch, dtype, field):
    """(hparams, params, the model on the device in dtype, its first layer as the draft, K = 4
    adaptive, [whether each run of a static step with `field` (the draft loop's "q", the
    verification's "accept") was a replay]), our kernels chosen."""
    monkeypatch.setenv(layout.GPU_KERNELS_ENV, "1")
    hparams, params = small
    model = on_device(cupy, small, dtype)
    draft = speculative.model_drafter((dict(model[0], blocks=model[0]["blocks"][:1]), dict(hparams, n_layer=1)))
    replayed, run = [], cuda_graphs.run
    monkeypatch.setattr(cuda_graphs, "run", lambda static: replayed.append(
        field in static and static["replay"] is not None) or run(static))
    return hparams, params, model, draft, speculative.SpeculativeConfig(K=4, adaptive=True, costs=CHEAP), replayed


@pytest.mark.parametrize("settings, dtype", [(GREEDY, "float32"), (UNPENALIZED, "float32"), (UNPENALIZED, "float16")],
                         ids=["greedy", "sampled", "sampled-float16"])
def test_the_recorded_draft_loop_on_the_device_drafts_what_a_pass_at_a_time_drafts(cupy, small, monkeypatch,
                                                                                   settings, dtype):
    """Our kernels drafting with a 1-layer draft and adaptive K: the K passes and draws recorded
    and replayed as one graph give the drafts, draws and q (bit for bit) of a pass at a time,
    and greedy gives the CPU's greedy text."""
    hparams, params, model, draft, config, replayed = device_speculation(cupy, small, monkeypatch, dtype, "q")
    runs = []
    for looped in (True, False):
        with monkeypatch.context() as m:
            seen, loops = watch_verify(m, looped)
            runs.append((speculative.speculative_generate(batching.requests(SMALL_PROMPTS, 40, settings, 5), model,
                                                          draft, config)[0], seen))
        assert (len(loops) > len(seen) // 2) if looped else not loops
        assert any(replayed) == looped  # the loop's graph replayed
        replayed.clear()
    assert runs[0] == runs[1]
    if settings is GREEDY:
        assert runs[0][0] == generate(params, hparams, 40, prompts=SMALL_PROMPTS)


@pytest.mark.parametrize("settings, dtype", [(GREEDY, "float32"), (UNPENALIZED, "float32"), (UNPENALIZED, "float16"),
                                             ([UNPENALIZED, GREEDY, MIN_P], "float32")],
                         ids=["greedy", "sampled", "sampled-float16", "each row its settings"])
def test_the_recorded_verification_on_the_device_accepts_what_one_after_its_pass_accepts(cupy, small, monkeypatch,
                                                                                        settings, dtype):
    """Our kernels verifying a 1-layer draft's drafts with adaptive K: the target's pass, p and
    the verification (cuda_sampling.accept) recorded and replayed as one graph give the
    logits, accepted n and tokens of the verification after its pass (bit for bit), and
    greedy gives the CPU's greedy text."""
    hparams, params, model, draft, config, replayed = device_speculation(cupy, small, monkeypatch, dtype, "accept")
    runs = []
    for looped in (True, False):
        with monkeypatch.context() as m:
            seen, graphs = watch_verification(m, looped)
            each = settings if isinstance(settings, list) else [settings] * len(SMALL_PROMPTS)
            reqs = [batching.Request(tuple(p), 40, s, seed=5 + b) for b, (p, s) in enumerate(zip(SMALL_PROMPTS, each))]
            texts, stats = speculative.speculative_generate(reqs, model, draft, config)
            runs.append((texts, seen))
        drafted = sum(len(logits[0]) > 1 for logits, _, _ in seen)  # (a step without drafts has no graph)
        assert (len(graphs) == drafted > len(seen) // 2) if looped else not graphs
        assert any(replayed) == looped and 0 < stats.acceptance_rate < 1
        replayed.clear()
    assert runs[0] == runs[1]
    if settings is GREEDY:
        assert runs[0][0] == generate(params, hparams, 40, prompts=SMALL_PROMPTS)


def test_prompt_lookup_on_the_device_verifies_through_the_recorded_verification(cupy, small, monkeypatch):
    """q None, one-hot at the drafts, which the recorded verification's kernel reads so: the
    CPU's greedy text, the verification replayed."""
    monkeypatch.setenv(layout.GPU_KERNELS_ENV, "1")
    hparams, params = small
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5 + [9]]
    seen, graphs = watch_verification(monkeypatch, True)
    replayed, run = [], cuda_graphs.run
    monkeypatch.setattr(cuda_graphs, "run", lambda static: replayed.append(
        "accept" in static and static["replay"] is not None) or run(static))
    got, stats = speculative.speculative_generate(batching.requests(prompts, 20, GREEDY), on_device(cupy, small),
                                                  speculative.PROMPT_LOOKUP)
    assert got == generate(params, hparams, 20, prompts=prompts) and stats.drafted and graphs and any(replayed)


def test_a_host_q_of_another_dtype_is_verified_as_float32_on_the_device(cupy, small, monkeypatch):
    """A drafter of one's own may hand q in float64: the recorded verification takes it as the
    float32 it keeps (as the verification after its pass converts it), the same n and token."""
    monkeypatch.setenv(layout.GPU_KERNELS_ENV, "1")
    hparams, _ = small
    model = on_device(cupy, small)
    drafts, texts, got = np.array([[5, 6], [7, 8]]), [SMALL_PROMPTS[0] + [5, 6], SMALL_PROMPTS[2] + [7, 8]], []
    for dtype in (np.float32, np.float64):
        cache = kv_cache.init_cache(hparams, 2, hparams["n_ctx"], like=model[0]["wpe"])
        q, _, k, u, v = verification_args(model, drafts, dtype)
        got.append(cuda_decode_loop.verify(model, cache, texts, q, drafts, k, u, v, [GREEDY] * 2, speculative.verify,
                                           want_logits=False))
    assert got[0] == got[1] and got[0][0] is None


def test_the_device_verifies_a_q_of_none_as_its_one_hot(cupy, small, monkeypatch):
    """cuda_decode_loop.verify with q None (a deterministic drafter's) and with one_hot's q on
    the host, copied in: the same logits, n and tokens, bit for bit, eager and replayed, under
    sampling, with rows of fewer drafts and drafts accepted and rejected."""
    monkeypatch.setenv(layout.GPU_KERNELS_ENV, "1")
    hparams, params = small
    model = on_device(cupy, small)
    replayed, run = [], cuda_graphs.run
    monkeypatch.setattr(cuda_graphs, "run", lambda static: replayed.append(static["replay"] is not None) or run(static))
    caches = [kv_cache.init_cache(hparams, 3, hparams["n_ctx"], like=model[0]["wpe"]) for _ in range(2)]
    rng, accepted = np.random.default_rng(7), set()
    likely = np.array(generate(params, hparams, 3, prompts=SMALL_PROMPTS))  # [3, 3]: the greedy continuations
    for _ in range(4):  # eager twice, then replayed
        drafts, k = np.where(rng.uniform(size=(3, 3)) < 0.7, likely, rng.integers(0, V, (3, 3))), np.array([3, 1, 2])
        u, v = rng.uniform(0.01, 1.0, (3, 3)), rng.uniform(0.01, 1.0, 3)
        texts = [p + drafts[b, :k[b]].tolist() for b, p in enumerate(SMALL_PROMPTS)]
        got = []
        for q, cache in zip((None, speculative.one_hot(drafts, k, V)), caches):
            kv_cache.rollback(cache, [len(p) - 1 for p in SMALL_PROMPTS])  # the drafts and the prompt's last pending
            logits, n, token = cuda_decode_loop.verify(model, cache, texts, q, drafts, k, u, v, [UNPENALIZED] * 3,
                                                       speculative.verify)
            got.append((cupy.asnumpy(logits).tolist(), n, token))
        assert got[0] == got[1]
        accepted.update(got[0][1])
    assert replayed[-2:] == [True, True] and len(accepted) > 1


def test_the_costs_on_the_device_are_timed_as_decoding_runs_them(cupy, small, monkeypatch):
    """main.py's advice and the benchmark time a step, a draft token and a verification on the
    device as replays of their recorded graphs (test_a_timed_step_and_verification_...)."""
    from cli import timing
    monkeypatch.setenv(layout.GPU_KERNELS_ENV, "1")
    model = on_device(cupy, small)
    count = replays(monkeypatch)
    assert timing.step_seconds(model, 8, reps=1) > 0 and timing.draft_seconds(model, 8, K=2, reps=1) > 0
    assert timing.verify_seconds(model, 8, K=2, reps=1) > 0 and len(count) == 3


def test_rows_of_their_own_settings_moving_under_one_recorded_graph_keep_their_texts(cupy, small, monkeypatch):
    """Four requests, each with settings of its own, decoded in the bucket of 4 a token a step
    (STEPS = 1): as they finish, the last row moves into the freed one (batching.remove) and the
    same graph replays with other settings in a row. Each text is the CPU's text alone."""
    monkeypatch.setenv(layout.GPU_KERNELS_ENV, "1")
    monkeypatch.setattr(cuda_decode_loop, "STEPS", 1)
    hparams, params = small
    model, replayed, run = on_device(cupy, small), [], cuda_graphs.run
    monkeypatch.setattr(cuda_graphs, "run", lambda static: replayed.append(
        "q" in static and static["replay"] is not None) or run(static))
    each = [GREEDY, UNPENALIZED, MIN_P, sampling.SamplingSettings(temperature=0.7, top_k=5)]
    reqs = [batching.Request(tuple(p), n, s, seed=b) for b, (p, n, s) in
            enumerate(zip(SMALL_PROMPTS + [[7, 8]], [12, 4, 7, 9], each))]
    got = batching.generate(reqs, model)[0]
    assert got == [batching.generate([r], (params, hparams))[0][0] for r in reqs] and sum(replayed) > 4


def test_uncached_passes_and_beam_search_on_the_device_decide_as_the_cpu(cupy, small):
    """Passes without a cache (attention over the pass's own keys) and beam search (its
    bookkeeping on the host, a copy of the logits a step): the CPU's tokens, its scores to 1e-5."""
    hparams, params = small
    model = on_device(cupy, small)
    uncached = [batching.generate(batching.requests(SMALL_PROMPTS, 8, GREEDY, 0), m, use_cache=False)[0]
                for m in (model, (params, hparams))]
    assert uncached[0] == uncached[1]
    got, want = (beam_search.beam_search(SMALL_PROMPTS[:2], m, 8, beam_search.BeamSettings(num_beams=3))
                 for m in (model, (params, hparams)))
    assert [[t for t, _ in hyps] for hyps in got] == [[t for t, _ in hyps] for hyps in want]
    np.testing.assert_allclose([[s for _, s in hyps] for hyps in got], [[s for _, s in hyps] for hyps in want],
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("settings", [SAMPLED, UNPENALIZED], ids=["penalized", "sampled"])
def test_sampled_text_on_the_device_equals_the_cpus(cupy, small, monkeypatch, settings):
    """Sampling with a repetition penalty: the penalty in CuPy's operations, then top-k, top-p
    and the draw in kernels/cuda_sampling.py; without: the pass and its draw recorded as one
    graph (cuda_decode_loop.py). The same seed as the CPU's, the CPU's text."""
    monkeypatch.setenv(layout.GPU_KERNELS_ENV, "1")
    hparams, params = small
    model, drawn_inside, run = on_device(cupy, small), [], cuda_graphs.run
    monkeypatch.setattr(cuda_graphs, "run", lambda static: drawn_inside.append(
        "q" in static and static["replay"] is not None) or run(static))
    assert generate(model[0], hparams, 20, settings, seed=7, prompts=SMALL_PROMPTS) == \
        generate(params, hparams, 20, settings, seed=7, prompts=SMALL_PROMPTS)
    assert any(drawn_inside) == (settings is UNPENALIZED)


@pytest.mark.parametrize("settings", [GREEDY, UNPENALIZED], ids=["greedy", "sampled"])
def test_the_logits_a_request_reads_come_through_the_devices_replays_as_a_pass_at_a_times(cupy, small, monkeypatch,
                                                                                           settings):
    """Plain decoding reading every token's logits (a server's logprobs) through the recorded
    loop that keeps each pass's, replayed STEPS tokens at a time, and a pass at a time with the
    draw after (the loop refused): every token and logits row bit for bit, one row ending at
    EOS inside a step."""
    monkeypatch.setenv(layout.GPU_KERNELS_ENV, "1")
    hparams, params = small
    model, replayed, loop = on_device(cupy, small), replays(monkeypatch), cuda_decode_loop.step
    alone = generate(params, hparams, 30, settings, seed=5, prompts=SMALL_PROMPTS)
    eos = next(t for i, t in enumerate(alone[0]) if i >= 9 and i % cuda_decode_loop.STEPS and t not in alone[0][:i])
    reqs = reading_logits(batching.requests(SMALL_PROMPTS, 30, settings, 5))
    reqs[0] = dataclasses.replace(reqs[0], eos_id=eos)  # row 0 ends inside a step, the others make all 30 tokens
    runs = []
    for looped in (True, False):
        seen, sizes = [], []

        def stepped(*args, **kwargs):
            ran = loop(*args, **kwargs) if looped else None
            sizes.append(ran and max(map(len, ran[0])))
            return ran
        monkeypatch.setattr(cuda_decode_loop, "step", stepped)
        texts = batching.generate(reqs, model,
                                  callback=lambda seq, token, accepted, logits: seen.append(
                                      (seq.index, token, cupy.asnumpy(logits).tolist())))[0]
        runs.append((texts, sorted(seen, key=lambda event: event[0])))
        assert sizes.count(cuda_decode_loop.STEPS) > 4 and replayed if looped else not any(sizes)
    assert runs[0] == runs[1] and runs[0][0] == [alone[0][:alone[0].index(eos) + 1], alone[1], alone[2]]


def test_requests_joining_and_leaving_rows_on_the_device_keep_their_texts(cupy, small, monkeypatch):
    """Continuous batching on the device: 8 requests through 3 rows of the scheduler, rows
    and shapes coming and going, each text the CPU's for that request alone."""
    hparams, params = small
    rng = np.random.default_rng(1)
    reqs = [batching.Request(tuple(rng.integers(0, V, rng.integers(1, 12)).tolist()), int(rng.integers(1, 12)),
                             GREEDY, seed=i) for i in range(8)]
    replayed = replays(monkeypatch)
    events = list(scheduler.serve(reqs, scheduler.autoregressive(on_device(cupy, small)), max_batch=3))
    finished = {e.index: e.tokens for e in events if e.kind == "finished"}
    assert finished == {i: batching.generate([r], (params, hparams))[0][0] for i, r in enumerate(reqs)} and replayed


@pytest.mark.parametrize("name", ["autoregressive", "speculative"])
def test_chunked_prefill_and_the_prefix_cache_on_the_device_change_no_bit(cupy, small, name, monkeypatch):
    """The tiny model with a window of 160 (wpe given random rows more): prompts of up to 100
    tokens and past the window, half of them sharing a beginning, served with prompts whole,
    then in chunks of 8 tokens a step with a prefix cache. Every token and every logits row the
    same bits (every pass's products, layer norms and attention are our kernels, a prompt's
    products over many rows too: cuda_ops.pass_ops), prompts chunked, prefixes copied."""
    hparams, params = small
    rng = np.random.default_rng(2)
    more = rng.standard_normal((96, hparams["n_embd"]), dtype=np.float32) * np.asarray(params["wpe"]).std()
    longer = dict(hparams, n_ctx=160), dict(params, wpe=np.concatenate([params["wpe"], more]))  # a pass of > 64 tokens
    hparams, model = longer[0], on_device(cupy, longer)
    if name == "autoregressive":
        dec = scheduler.autoregressive(model)
    else:
        draft = speculative.model_drafter((dict(model[0], blocks=model[0]["blocks"][:1]), dict(hparams, n_layer=1)))
        dec = scheduler.speculative_decoder(model, draft, speculative.SpeculativeConfig(K=3))
    shared = rng.integers(0, V, 40).tolist()
    reqs = reading_logits([batching.Request(tuple((shared if i % 2 else [])[:n] + rng.integers(0, V, n).tolist())[:n],
                                            6, SAMPLED if i % 3 else GREEDY, seed=i)
                           for i, n in enumerate([100, 45, 12, 170, 3, 52])])

    def served(**kw):
        events = list(scheduler.serve(reqs, dec, max_batch=3, **kw))
        rows = {i: [cupy.asnumpy(e.logits) for e in events if e.kind == "token" and e.index == i] for i in range(6)}
        return {e.index: (e.tokens, rows[e.index]) for e in events if e.kind == "finished"}
    prefix, ride_along, riders = prefix_cache.new_prefix_cache(1 << 20), kv_cache.ride_along, []
    whole = served()
    monkeypatch.setattr(kv_cache, "ride_along", lambda model, chunks, *args: riders.append(len(chunks))
                        or ride_along(model, chunks, *args))
    replayed = replays(monkeypatch)
    chunked = served(prefix=prefix, max_prefill_tokens=8)
    assert chunked.keys() == whole.keys() == set(range(6)) and riders and prefix["hits"] and replayed
    for i in whole:
        assert chunked[i][0] == whole[i][0] and len(chunked[i][1]) == len(whole[i][1]) > 0
        assert all(np.array_equal(a, b) for a, b in zip(chunked[i][1], whole[i][1]))


@pytest.mark.parametrize("name", ["autoregressive", "speculative"])
def test_paused_requests_on_the_device_resume_with_their_texts(cupy, small, name):
    """Clients that lag while others wait: their rows are paused (keys kept, or dropped and
    computed again on resume: a GPU's own kernels give the same bits), one leaves while paused;
    every other text is its text alone (test_scheduler's run, on the device)."""
    import test_scheduler
    hparams, _ = small
    model = on_device(cupy, small)
    models = [model, (dict(model[0], blocks=model[0]["blocks"][:1]), dict(hparams, n_layer=1))]
    rng = np.random.default_rng(8)
    reqs = [batching.Request(tuple(rng.integers(0, V, rng.integers(1, 21)).tolist()), 12, SAMPLED, seed=100 + i)
            for i in range(6)]
    lags = {i: (range(2, 40), i % 2 == 0) for i in range(4)}  # even ones backed up: paused with nobody waiting
    events, finished = test_scheduler.serve_lagging(models, name, reqs, lags, max_batch=2, cancel_at={30: [0]},
                                                    prefix=prefix_cache.new_prefix_cache(1 << 20))
    kinds = [(e.kind, e.index) for e in events]
    assert {i for k, i in kinds if k == "paused"} == {0, 1, 2, 3} and ("resumed", 0) not in kinds
    alone = [test_scheduler.decoders(models)[name][1](r) for r in reqs]
    assert finished[0].tokens == alone[0][:len(finished[0].tokens)] and len(finished[0].tokens) < 12
    assert all(finished[i].tokens == alone[i] for i in range(1, 6))


def test_a_drafts_vocabulary_subset_runs_the_same_kernels_on_the_device(cupy, small):
    """--draft_vocab wraps the draft's wte (speculative.VocabSubset): its passes still run our
    kernels (kv_cache.kernel_ops), so its keys are the same bits as the draft's own passes'
    (which chunks, copied prefixes and keys computed again on resume are)."""
    hparams, _ = small
    model = on_device(cupy, small)
    subset = speculative.vocab_subset(model, [SMALL_PROMPTS[1]], 40)
    assert kv_cache.kernel_ops(subset) == kv_cache.kernel_ops(model) is not None
    caches = [kv_cache.init_cache(hparams, 1, hparams["n_ctx"], like=model[0]["wpe"]) for _ in range(2)]
    for m, cache in zip((model, subset), caches):
        kv_cache.next_logits(m, cache, [SMALL_PROMPTS[1]])
    assert all(np.array_equal(cupy.asnumpy(a[name]), cupy.asnumpy(b[name]))
               for a, b in zip(caches[0]["layers"], caches[1]["layers"]) for name in ("k", "v"))


def test_the_cpus_recording_runs_nothing_and_replays_the_device_arrays_of_now(monkeypatch):
    """The emulation holds what a GPU's recording holds: a recorded launch runs at replay, on
    the arrays' values then; a host value read or a host array copied while recording fails."""
    if cuda_on_cpu.unavailable():
        pytest.skip(cuda_on_cpu.unavailable())
    cupy = cuda_on_cpu.cupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    cuda.module.cache_clear()  # compiled for the CPU (a GPU's may be there)
    cuda.function.cache_clear()
    w, b = cupy.asarray(np.eye(3, 16, dtype=np.float32)), cupy.asarray(np.zeros(3, np.float32))
    x = cupy.asarray(np.ones((1, 16), np.float32))

    def forward():
        return cuda_matmul.launch(x, w, b, gelu=False) * 2.0 + 1.0  # [1, 3]
    eager = cupy.asnumpy(forward())
    replay, out, _ = cuda_graphs.record(forward, forward())
    x.set(np.full((1, 16), 3.0, np.float32))
    assert np.array_equal(eager, [[3.0, 3.0, 3.0]]) and not np.array_equal(cupy.asnumpy(out), eager)
    replay()
    assert np.array_equal(cupy.asnumpy(out), [[7.0, 7.0, 7.0]])  # the new x, into the same output
    for wrong in (lambda: x + float(x.sum()), lambda: cupy.asarray(np.ones(16, np.float32)), lambda: x @ w.T,
                  lambda: x[x > 2.0]):
        with pytest.raises(RuntimeError, match="records|recorded"):
            cuda_graphs.record(wrong, x)
    assert cuda_on_cpu.recording is None  # each failed recording ended
    ended = cupy.cuda.Stream.end_capture

    def invalidated(stream):  # as CUDA ends a capture that an error broke: with an error of its own
        ended(stream)
        raise RuntimeError("cudaErrorStreamCaptureInvalidated")
    monkeypatch.setattr(cupy.cuda.Stream, "end_capture", invalidated)
    with pytest.raises(RuntimeError, match="records") as failed:
        cuda_graphs.record(lambda: x + float(x.sum()), x)
    assert "Invalidated" not in str(failed.value) and cuda_on_cpu.recording is None  # forward's error, not CUDA's
    cuda.module.cache_clear()
    cuda.function.cache_clear()


def test_no_collection_inside_a_capture_frees_an_old_graphs_memory(monkeypatch):
    """A dropped cache's graphs (each a pool of device memory) are freed by Python's collector,
    and freeing memory while a stream captures may lose the capture: none runs inside one."""
    if cuda_on_cpu.unavailable():
        pytest.skip(cuda_on_cpu.unavailable())
    cupy = cuda_on_cpu.cupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    x = cupy.asarray(np.ones(4, np.float32))

    def forward():  # garbage, then a pass's many Python objects: a collection comes due inside it
        old = {"pool": cupy.cuda.MemoryPool()}
        old["itself"] = old  # held by a cycle only, as an old cache's graphs are
        del old
        return x * float(len([[i] for i in range(10_000)]))
    thresholds = gc.get_threshold()
    gc.collect()
    gc.set_threshold(1, 1, 1)  # collect at every allocation, every generation
    try:
        replay, out, _ = cuda_graphs.record(forward, x)
        assert gc.isenabled()
        gc.collect()  # (the old pool, now: outside the capture)
    finally:
        gc.set_threshold(*thresholds)
    replay()
    assert np.array_equal(cupy.asnumpy(out), [10_000.0] * 4)


def emulated_with_our_kernels(monkeypatch):
    """(cupy, params, hparams): the emulation standing in for CuPy, our kernels chosen, and
    random weights of the tiny model's shapes with a vocabulary of V."""
    why = cuda_on_cpu.unavailable()
    if why:
        pytest.skip(f"CUDA C cannot run on this CPU: {why}")
    cupy = cuda_on_cpu.cupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setenv(layout.GPU_KERNELS_ENV, "1")
    return (cupy, *common.random_params("tiny", n_vocab=V, n_ctx=64))


def launches(recording):
    """The GPU launches in an emulated recording: our kernels by name, and "operation" for each
    launch of CuPy's operations that write memory (a view, which shares its input's, launches
    none; indexing by k > 1 arrays, k + 2: CuPy's _prepare_multiple_array_indexing fills an
    index, adds each array's share to it, then takes)."""
    for node in recording:
        if node.func is cuda_on_cpu.run:
            yield node.args[0]
            continue
        _, args, kwargs, result = node.args  # (cuda_on_cpu.run_again's)
        inputs = [a.a for a in cuda_on_cpu.leaves((args, kwargs)) if isinstance(a, cuda_on_cpu.Device)]
        outputs = [r.a for r in cuda_on_cpu.leaves(result) if isinstance(r, cuda_on_cpu.Device)]
        if not (outputs and all(any(np.shares_memory(o, a) for a in inputs) for o in outputs)):
            index = args[1] if len(args) == 2 and isinstance(args[1], tuple) else ()
            arrays = sum(isinstance(i, cuda_on_cpu.Device) for i in index)
            yield from ["operation"] * (arrays + 2 if arrays > 1 else 1)



def test_a_recorded_step_launches_five_kernels_a_layer(monkeypatch):
    """A graph's launches cost the GPU microseconds each, whatever they do: a layer of a
    recorded step is 5 (c_attn with the layer norm before it, attention storing the step's keys
    and values, attn c_proj with the residual add, c_fc with its layer norm and GELU, mlp
    c_proj with its residual add), counted in the recording itself with 1 and with 2 layers;
    then the embeddings (CuPy's two gathers and their sum), the final layer norm, the head, and
    the draw (its distribution, then the token): no gather of the tokens that need logits,
    which are all (CuPy's would be five launches). Where a callback reads the logits, one copy
    more a pass keeps them. A speculative step's graphs, the draft loop's K passes and the
    verification, add one take at most (the logits at the tokens wanted, when a pass has more)."""
    cupy, params, hparams = emulated_with_our_kernels(monkeypatch)
    recorded, end_capture = [], cupy.cuda.Stream.end_capture

    def kept(stream):
        recorded.append(collections.Counter(launches(cuda_on_cpu.recording)))
        return end_capture(stream)
    monkeypatch.setattr(cupy.cuda.Stream, "end_capture", kept)
    kernels = {}
    for n_layer, reading in ((1, False), (2, False), (1, True)):
        model = (layout.device_layout(layout.plain_layout(dict(params, blocks=params["blocks"][:n_layer])), cupy),
                 dict(hparams, n_layer=n_layer))
        recorded.clear()
        with monkeypatch.context() as m:
            m.setattr(cuda_decode_loop, "STEPS", 1)  # a pass a graph
            reqs = batching.requests([[1, 2, 3]], 4, GREEDY)
            batching.generate(reading_logits(reqs) if reading else reqs, model, callback=lambda *_: None)
        kernels[n_layer, reading] = recorded[0]
    layer = kernels[2, False] - kernels[1, False]
    assert layer == {"row_times_columns_ln_f32": 2, "row_times_columns_f32": 2, "attend_f32": 1}, layer  # (a row)
    assert kernels[1, False] - layer == {"operation": 3, "row_times_columns_f32": 1, "layer_norm_f32": 1,
                                         "distribution_rows": 1, "sample": 1}, kernels[1, False] - layer
    assert kernels[1, True] - kernels[1, False] == {"operation": 1} and not kernels[1, False] - kernels[1, True]
    recorded.clear()
    speculative.speculative_generate(batching.requests([[1, 2, 3]], 24, GREEDY), model,
                                     speculative.model_drafter(model), speculative.SpeculativeConfig(K=4))
    assert any(graph["residual"] for graph in recorded), recorded  # a verification (cuda_sampling.accept's kernel)
    assert all(graph["layer_norm_f32"] > 1 for graph in recorded if not graph["residual"]), recorded  # loops
    for graph in recorded:
        passes = graph["layer_norm_f32"]  # the final layer norm: one a pass
        assert graph["operation"] - 3 * passes in (0, 1), graph


def test_a_recorded_step_calls_into_the_device_a_few_times_whatever_its_layers(monkeypatch):
    """On a GPU a step is bound by the host: each call into CuPy (an operation, a view, a
    copy, a launch) costs microseconds. Counted on the CPU's emulation, outside the replays,
    once every shape is recorded: a step of plain decoding, greedy or sampled (the ids and
    draws in, the replay of STEPS passes and draws, the ids out) and a step of speculative
    decoding (the model drafting for itself: four drafts in one replay, q copied to the
    verification, then the target's pass, its distributions and the verification in another
    replay) make the same few calls with 2 layers as with 1, none a layer, and no more than
    now. Without the cache's views kept (kv_cache.rows) there are 2 more a layer, a model
    pass; with the draws made from the host after each pass (cuda_decode_loop.py), 8 greedy,
    12 sampled, 68 speculative; with the verification after its pass, 19 speculative; with
    the logits copied where no callback reads them, 6 plain and 12 speculative."""
    cupy, params, hparams = emulated_with_our_kernels(monkeypatch)
    calls, record = [], cuda_graphs.record

    def counted(f):  # f, each call outside a recording noted
        def g(*args, **kwargs):
            if cuda_on_cpu.recording is None:
                calls.append(f.__name__)
            return f(*args, **kwargs)
        return g
    for where, name in ((cuda_on_cpu, "operation"), (cuda_on_cpu, "run"), (cuda_on_cpu.Device, "set"),
                        (cuda_on_cpu.Device, "read")):
        monkeypatch.setattr(where, name, counted(getattr(where, name)))

    def one_call(forward, like):  # a replay is one call, whatever it runs
        replay, out, keep = record(forward, like)

        def replayed():
            n = len(calls)
            replay()
            del calls[n:]
            calls.append("replay")
        return replayed, out, keep
    monkeypatch.setattr(cuda_graphs, "record", one_call)
    per_step = {}
    for n_layer in (1, 2):
        model = (layout.device_layout(layout.plain_layout(dict(params, blocks=params["blocks"][:n_layer])), cupy),
                 dict(hparams, n_layer=n_layer))
        for name, where, step, settings in (("greedy", batching, batching.autoregressive_step, GREEDY),
                                            ("sampled", batching, batching.autoregressive_step, UNPENALIZED),
                                            ("speculative", speculative, speculative.speculative_step, GREEDY)):
            steps = []

            def counting(*args, step=step):
                calls.clear()
                step(*args)
                steps.append(len(calls))
            monkeypatch.setattr(where, step.__name__, counting)
            if where is batching:
                batching.generate(batching.requests([[1, 2, 3]], 24, settings), model)
            else:
                speculative.speculative_generate(batching.requests([[1, 2, 3]], 40, settings), model,
                                                 speculative.model_drafter(model), speculative.SpeculativeConfig(K=4))
            monkeypatch.setattr(where, step.__name__, step)
            per_step[name, n_layer] = collections.Counter(steps[3:]).most_common(1)[0][0]  # recorded
    assert len({per_step[name, n_layer] for name in ("greedy", "sampled") for n_layer in (1, 2)}) == 1, per_step
    assert per_step["greedy", 1] <= 3, per_step  # 3 now
    assert per_step["speculative", 1] == per_step["speculative", 2] <= 10, per_step  # 10 now

