"""The host side of a kernel's channels: the bridge and its meter, reading and checking
signed wire messages, the output cap, cleaning output, the audit ledger, approval prompts.
"""
