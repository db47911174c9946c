"""Who runs the sandboxes: the interface (base), Docker + gVisor (docker, docker_args,
gvisor_checkpoint), and an in-memory fake for tests (fake).
"""
