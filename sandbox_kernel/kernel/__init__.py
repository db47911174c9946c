"""One kernel on the host: the parts :class:`~sandbox_kernel.provisioner.SandboxProvisioner`
composes, each owning its state and handed its collaborators (not one of them knows the provisioner).

- :mod:`.site`: where the kernel runs now (its sandbox, folders and plan), shared by all;
- :mod:`.start`: one start read from jupyter_client's arguments;
- :mod:`.launching`: a cold start, or a claim from the warm pool;
- :mod:`.channels`: the bridge, the ledger of executions, the host's own messages;
- :mod:`.egress`: with network "allowlist", the kernel's CA, credentials and approvals;
- :mod:`.watchdog`: looks at the kernel and acts on the pure judge's verdicts;
- :mod:`.freezer`: a quiet kernel's idle freeze, thawed at a client's next message;
- :mod:`.pauser`: pausing to disk and resuming;
- :mod:`.holding`: which manager drives the kernel; letting go on a take-over;
- :mod:`.exits`: why a sandbox ended, told once;
- :mod:`.state`: what a later process needs to reattach;
- :mod:`.manager`: what is read of the kernel manager and server above.
"""
