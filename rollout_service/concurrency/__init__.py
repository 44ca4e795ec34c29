"""Running many episodes in one process: green threads, Redis auto-pipelining, CPU priority."""
