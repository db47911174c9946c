"""`jupyter sandbox-kernel` (app), the kernelspecs' launcher for front ends that run argv
themselves (launch), and the files shipped with the package (resources).
"""
