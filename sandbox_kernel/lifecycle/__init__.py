"""A kernel's life on the host across processes: its launch folder and seal, the start-up
mark, who owns which kernel (pruning, the reaper, reattach state on disk), the pure steps
of a pause, and the watchdog's pure judgement (judge).
"""
