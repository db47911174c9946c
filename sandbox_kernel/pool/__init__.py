"""The warm pool: sandboxes started ahead of their kernels (sandboxes) and what makes one a
kernel's (binding). Filling a kernelspec's pool as a start would plan it is
:mod:`sandbox_kernel.warming`; claiming one is the kernel's (:mod:`sandbox_kernel.kernel.launching`).
"""
