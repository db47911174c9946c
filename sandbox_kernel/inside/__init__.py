"""What runs inside the sandbox, with the standard library and the image's pyzmq only: the
channel relay (kernel_relay) and the kernel's start-up code (in_kernel, in_kernel_startup).
The host copies these files into the launch folder; they import nothing of sandbox_kernel.
"""
