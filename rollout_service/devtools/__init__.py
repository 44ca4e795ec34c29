"""Servers and builds for tests, benchmarks and laptops: reference server, tiny model, local service."""
