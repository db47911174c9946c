"""For programs and AI assistants: the session API, shell commands, the workspace's files
API, and the MCP server with its results, transport and file tools.
"""
