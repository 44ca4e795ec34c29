"""Glue for trainer libraries (each module imports its library only when used)."""
