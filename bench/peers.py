"""An optional peer cannot take the benchmark down: each one (llama.cpp, transformers) runs
in a process of its own.

A peer is native code this project does not control: llama.cpp built for one CPU died
with a segmentation fault inside its decode on another, and with it, in one process,
went every result of the run. In a process of its own, a crash ends that process only;
the benchmark records it as the peer's line ("crashed (SIGSEGV)") and goes on.

A peer process runs the functions it is sent (module-level, so that they pickle by
name), one at a time, and keeps what they leave in their module (an open llama.cpp
model) for the next call. A Python exception there is the peer refusing ("refused
(...)"); a peer silent for timeout_s is killed ("timed out").
"""
import multiprocessing
import signal

TIMEOUT_S = 3600  # a call that takes longer has hung: the slowest, a 1558M peer's load and runs, takes minutes


class PeerFailed(Exception):
    """A peer crashed, refused or hung; str() is its line in the results."""


def start():
    """A fresh peer process (spawned: a forked copy of this process would share its threads'
    locks and, on a GPU, its CUDA context): (process, this end of its pipe)."""
    mp = multiprocessing.get_context("spawn")
    ours, theirs = mp.Pipe()
    process = mp.Process(target=serve, args=(theirs,), name="benchmark peer")
    process.start()
    theirs.close()  # the peer's end lives in the peer: its death is then EOF here
    return process, ours


def serve(conn):
    """The peer's loop: (fn, args) in, ("ok", fn(*args)) or ("refused", why) out, until
    None or until the benchmark's end of the pipe closes."""
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        fn, args = message
        try:
            reply = ("ok", fn(*args))
        except Exception as e:  # the peer says no; it stays up for the next call
            reply = ("refused", f"{type(e).__name__}: {e}")
        conn.send(reply)


def call(peer, fn, *args, timeout_s=TIMEOUT_S):
    """fn(*args) in the peer: its value, or PeerFailed with the peer's line."""
    process, conn = peer
    try:
        conn.send((fn, args))
        if not conn.poll(timeout_s):
            stop(peer)
            raise PeerFailed(f"timed out ({timeout_s:.0f} s)")
        kind, value = conn.recv()
    except (EOFError, OSError):  # the pipe broke: the peer is gone
        process.join(10)
        raise PeerFailed(exit_line(process.exitcode)) from None
    if kind == "refused":
        raise PeerFailed(f"refused ({value})")
    return value


def exit_line(exitcode):
    """How a peer process ended, in words: "crashed (SIGSEGV)" for a signal."""
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            return f"crashed ({signal.Signals(-exitcode).name})"
        except ValueError:
            return f"crashed (signal {-exitcode})"
    return f"exited with code {exitcode}"


def stop(peer):
    """End the peer: asked first, killed if it does not go."""
    process, conn = peer
    if process.is_alive():
        try:
            conn.send(None)
        except OSError:
            pass
        process.join(10)
    if process.is_alive():
        process.kill()
        process.join()
    conn.close()


def run_apart(fn, *args, timeout_s=TIMEOUT_S):
    """fn(*args) in a peer process of its own, ended after: its value, or PeerFailed."""
    peer = start()
    try:
        return call(peer, fn, *args, timeout_s=timeout_s)
    finally:
        stop(peer)
