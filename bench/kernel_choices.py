"""What the sandboxed kernel's own choices inside the sandbox save, each against the kernel
as it runs, in one run.

* Sending IOPub messages from the thread that makes them: inside the sandbox the kernel's
  start-up code (``sandbox_kernel/inside/fast_io.py``) sends each IOPub message (busy, the
  input, the result, idle) from the thread that makes it when the IOPub thread has nothing
  left to do, instead of handing every one to the IOPub thread, which wakes to send it.
* Shell and IOPub without the channel relay: the kernel takes over their host-facing
  listeners from the relay, which lets go of its sockets for a pause
  (``sandbox_kernel/inside/kernel_relay.py``, ``Keeper``).
* Subshells on demand: ipykernel 7 reads every shell request in a thread of its own and
  hands it to the main thread (and the reply back), so that subshells can run beside the
  main shell. The sandboxed kernel's main thread reads the shell channel itself until a
  client asks for a subshell (``sandbox_kernel/inside/kernel_app.py``); the kernelspec key
  ``subshells: false`` keeps it so for good.
* Replies sent as they are made: ipykernel's shell stream queues each reply for its
  loop's next turn, which comes after the ``idle`` that fast_io sends at once; the
  sandboxed kernel's main thread sends it at once (``ReplyStream`` in kernel_app.py).

This times ``1+1`` (``execute_interactive``, to the reply and the idle status) on six
kernels, one sample of each per round in an order shuffled per round, so that the
machine's load and the kernels' threads falling asleep between samples touch all of them
alike:

* ``local``: a local ipykernel (``--baseline``), the reference for the ratios;
* ``sandboxed``: a sandboxed kernel (``--kernel``) as it runs, no subshell asked for;
* ``sandboxed, subshells started``: a second one, after a ``list_subshell_request`` (its
  shell-channel thread reads the shell channel, ipykernel's own path);
* ``sandboxed, handed``: a third one, alike but for ``fast_io.DIRECT_SENDS`` turned off:
  every IOPub message through the IOPub thread, as ipykernel sends them;
* ``sandboxed, no subshells``: a fourth one, of a variant of the kernelspec with
  ``subshells: false``;
* ``sandboxed, all relayed``: a fifth one, started with the kernel's argument
  ``--SandboxedKernelApp.take_channels=False``: the channel relay keeps shell and IOPub
  too (their host connections cross the relay's process, as before the kernel took their
  listeners over);
* ``sandboxed, replies queued``: a sixth one, alike but for ``ReplyStream.at_once``
  (``sandbox_kernel/inside/kernel_app.py``) turned off: each reply waits in the shell
  stream's queue for the loop's next turn, or for the flush after ``idle``, as ipykernel
  sends it.

Each kernel has one client, so each publishes to one subscriber. Run from the project
root::

    .venv/bin/python bench/kernel_choices.py
    .venv/bin/python bench/kernel_choices.py --runs 500 --json
"""

from __future__ import annotations

import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from latency import (
    execute_once,
    in_turns,
    in_turns_main,
    kernelspec_variant,
    percentile,
    progress,
    ratio_table,
    running_kernel,
)

KERNELS = (
    "local",
    "sandboxed",
    "sandboxed, subshells started",
    "sandboxed, handed",
    "sandboxed, no subshells",
    "sandboxed, all relayed",
    "sandboxed, replies queued",
)
#: The start of the kernel whose relay keeps every channel.
RELAY_ALL = {"extra_arguments": ["--SandboxedKernelApp.take_channels=False"]}
#: Run in the second sandboxed kernel: every IOPub message through its IOPub thread.
HAND_EVERY_MESSAGE = "import sys; sys.modules['sandbox_kernel_fast_io'].DIRECT_SENDS = False"
#: Run in the last sandboxed kernel: its replies wait in its shell stream's queue.
QUEUE_REPLIES = "type(get_ipython().kernel.shell_stream).at_once = False"


def measure(kernel: str, baseline: str, runs: int, warmup: int, cwd: str) -> dict[str, list[float]]:
    """Milliseconds per kernel, ``runs`` each, in a shuffled order every round."""
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        quick = kernelspec_variant(kernel, "no-subshells", {"subshells": False}, folder)
        progress(f"starting a local {baseline} kernel, five {kernel} kernels and a {quick} kernel")
        specs = (baseline, kernel, kernel, kernel, quick, kernel, kernel)
        clients = {
            name: stack.enter_context(
                running_kernel(spec, cwd, **(RELAY_ALL if name.endswith("relayed") else {}))
            ).client
            for name, spec in zip(KERNELS, specs, strict=True)
        }
        started = clients["sandboxed, subshells started"]
        asked = started.session.msg("list_subshell_request", {})
        started.control_channel.send(asked)
        if started.control_channel.get_msg(timeout=60)["content"].get("status") != "ok":
            msg = "cannot start the subshells of a sandboxed kernel"
            raise RuntimeError(msg)
        set_up = {"sandboxed, handed": HAND_EVERY_MESSAGE, "sandboxed, replies queued": QUEUE_REPLIES}
        for name, code in set_up.items():
            reply = clients[name].execute_interactive(code, timeout=60)
            if reply["content"]["status"] != "ok":
                msg = f"cannot set up the kernel {name!r}: {reply['content']}"
                raise RuntimeError(msg)
        times = in_turns(lambda name: execute_once(clients[name]), KERNELS, runs, warmup)
        progress("stopping the kernels")
    return times


def format_table(times: dict[str, list[float]]) -> str:
    sandboxed, started, handed, quick, relayed, queued = (percentile(times[name], 50) for name in KERNELS[1:])
    footer = [
        f"The kernel holding the shell and IOPub listeners itself saves {relayed - sandboxed:.2f} ms at p50 "
        f"({(relayed - sandboxed) / relayed:.0%} of the round trip with every channel relayed).",
        f"Sending from the thread that makes each message saves {handed - sandboxed:.2f} ms at p50 "
        f"({(handed - sandboxed) / handed:.0%} of the handed kernel's round trip).",
        f"The main thread reading the shell channel until a subshell is asked for saves "
        f"{started - sandboxed:.2f} ms at p50 ({(started - sandboxed) / started:.0%} of the round trip "
        f"with subshells started); subshells: false differs by {quick - sandboxed:+.2f} ms.",
        f"Sending each reply as it is made saves {queued - sandboxed:.2f} ms at p50 "
        f"({(queued - sandboxed) / queued:.0%} of the round trip with replies queued).",
    ]
    return "\n".join([ratio_table(times, KERNELS, "kernel"), "", *footer])


def main(argv: list[str] | None = None) -> int:
    return in_turns_main(__doc__, measure, format_table, argv, runs=300, warmup=20, each="kernel")


if __name__ == "__main__":
    sys.exit(main())
