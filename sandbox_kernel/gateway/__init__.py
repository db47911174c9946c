"""The sandbox gateway: sandboxed kernels served to the Jupyter servers of other users and
machines, through Jupyter's own gateway protocol (``jupyter lab --gateway-url``)."""
