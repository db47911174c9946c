"""One timed ``1+1`` for bench/roundtrip.py, on the host and inside the sandbox (the
image's Python runs this file's text, so: the standard library and jupyter_client only)."""

import datetime
import time


def once(client):  # type: ignore[no-untyped-def]  # (runs in the image's Python too)
    """[ms from sending ``1+1`` to its reply and idle status, ms the kernel itself took:
    from its ``busy`` status to its ``idle`` one, both stamped by the kernel's clock, ms of
    the way in: from sending to the kernel's ``busy``, by this clock and the kernel's]. The
    rest is the way out, from the kernel's ``idle`` until both are in here. (The wall clock
    of a gVisor sandbox is the host's: the sentry reads the host's.)"""
    stamps = {}
    # What the kernel published for other clients' samples (every client of a kernel sees
    # its IOPub), read before the clock starts, as a kernel's only client would not get it.
    while client.iopub_channel.msg_ready():
        client.get_iopub_msg(timeout=0)

    def note(msg):  # type: ignore[no-untyped-def]
        if msg["header"]["msg_type"] == "status":
            stamps[msg["content"]["execution_state"]] = msg["header"]["date"]

    sent = datetime.datetime.now(datetime.timezone.utc)
    started = time.perf_counter()
    reply = client.execute_interactive("1+1", timeout=30, output_hook=note)
    total = (time.perf_counter() - started) * 1000
    if reply["content"]["status"] != "ok":
        msg = f"1+1 failed: {reply['content']}"
        raise RuntimeError(msg)
    kernel = (stamps["idle"] - stamps["busy"]).total_seconds() * 1000
    return [total, kernel, (stamps["busy"] - sent).total_seconds() * 1000]


def parts(sample):  # type: ignore[no-untyped-def]
    """A sample of :func:`once` by its parts, in ms: the whole round trip, the way in, the
    kernel itself and the way out (the rest)."""
    total, kernel, way_in = sample
    return {"total": total, "in": way_in, "kernel": kernel, "out": total - kernel - way_in}
