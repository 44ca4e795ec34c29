"""The agent's tools. Everything here runs inside the sandbox's action server: stdlib and
ptyprocess at import time only (jupyter_client is imported when the first cell runs)."""
