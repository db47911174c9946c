"""jupyter_server integration: the kernel manager adopting persistent kernels (server), the
JupyterLab endpoint and server extension (lab), the contents manager writing as the
workspace's owner (contents), the server's audit lines.
"""
