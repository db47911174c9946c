"""Host plumbing with no kernel logic: the background loop, cgroups, mounts, and walking
folder trees that kernel code may have made.
"""
